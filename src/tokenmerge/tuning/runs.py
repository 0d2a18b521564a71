"""Generations for a tune: one (prompt, seed) item at a time, the same way each time (the user's call arguments,
the step count, noise from a CPU generator seeded by the item), the output as a float tensor in [0, 1], timed; and
what the denoiser saw of the time grid (``Recorder``: each step's denoising progress and the sample's shape)."""

from __future__ import annotations

import inspect
import math

import torch

from ..engine import find_denoisers
from ..measure import psnr, timed

__all__ = ["Runner", "Recorder", "as_tensor", "fidelity", "denoiser_site", "call_default"]


def denoiser_site(pipe):
    """The first denoiser ``pipe`` holds that has blocks (what a cache patches), or ``None``."""
    return next((site for site in find_denoisers(pipe) if site.blocks), None)


def call_default(pipe, name: str):
    """The default of the pipeline call's argument ``name`` (``None`` where it has none)."""
    try:
        found = inspect.signature(pipe.__call__).parameters.get(name)
    except (TypeError, ValueError):
        return None
    return None if found is None or found.default is inspect.Parameter.empty else found.default


def as_tensor(output) -> torch.Tensor:
    """A pipeline output's images or video frames as one float tensor in [0, 1] (a tensor, a numpy array, PIL
    images or lists of them)."""
    found = getattr(output, "images", None)
    if found is None:
        found = getattr(output, "frames", None)
    if found is None and isinstance(output, (tuple, list)) and output:
        found = output[0]
    if found is None:
        raise TypeError(f"tokenmerge.tune: the pipeline returned a {type(output).__name__} with no images or frames")
    return _tensor(found)


def _tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu()
    if isinstance(x, (list, tuple)):
        return torch.stack([_tensor(v) for v in x])
    if hasattr(x, "mode") and hasattr(x, "size"):  # a PIL image
        from ..measure import to_tensor

        return to_tensor(x)
    import numpy as np

    array = np.asarray(x)
    return torch.from_numpy(array.astype("float32") / (255.0 if array.dtype == np.uint8 else 1.0))


def fidelity(out: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR in dB (float arithmetic, data range 1) of a generation to its unpatched reference, over the whole output
    (every image of a batch, every frame of a clip); 100 for identical outputs."""
    if out.shape != ref.shape:
        raise RuntimeError(f"tokenmerge.tune: a generation's output is {tuple(out.shape)}, its reference's "
                           f"{tuple(ref.shape)}: the pipeline's output changed between runs")
    value = float(psnr(out.reshape(1, -1), ref.reshape(1, -1))[0])
    return 100.0 if not math.isfinite(value) else min(value, 100.0)


class Recorder:
    """While entered, what the denoiser's calls tell (read on the host, once per call: a tune's references only):
    the progress of each step (``1 - timestep / 1000``, the step caches' measure; a call at the progress of the one
    before is another call of its step) and the sample's shape without the batch."""

    def __init__(self, site):
        self.site, self.progress, self.sample, self.handle = site, [], None, None

    def __enter__(self):
        self.progress, self.sample = [], None
        self.handle = self.site.module.register_forward_pre_hook(self._pre, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def _pre(self, module, args, kwargs):
        bound = self.site.timestep
        t = bound.read(args, kwargs) if bound is not None else None
        at = bound.progress(t, 1000) if t is not None else None
        if at is not None and (not self.progress or abs(at - self.progress[-1]) > 1e-9):
            self.progress.append(at)
        x = self.site.sample.read(args, kwargs) if self.site.sample is not None else None
        if self.sample is None and isinstance(x, torch.Tensor):
            self.sample = tuple(x.shape[1:])


class Runner:
    """Runs ``pipe`` on an item ``(k, seed)``: ``prompts[k]`` (a prompt, or a dict of call arguments),
    ``num_inference_steps=steps``, the user's ``call_kwargs``, ``generator`` a CPU generator seeded by ``seed`` (the
    same noise on every device), ``output_type="pt"`` where the call takes one and the user gave none; counts its
    generations and, with ``bar``, moves it."""

    def __init__(self, pipe, prompts: list, steps: int, call_kwargs: dict, device, bar=None):
        self.pipe, self.prompts, self.steps, self.device, self.bar = pipe, prompts, steps, device, bar
        self.kwargs = dict(call_kwargs)
        if "output_type" not in self.kwargs and call_default(pipe, "output_type") is not None:
            self.kwargs["output_type"] = "pt"
        self.generations = 0

    def __call__(self, item: tuple) -> tuple[torch.Tensor, float]:
        """``(output, seconds)`` of one generation of ``item``."""
        prompt, seed = self.prompts[item[0]], item[1]
        args = (prompt,) if isinstance(prompt, str) else ()
        kwargs = {**self.kwargs, **({} if args else prompt), "num_inference_steps": self.steps,
                  "generator": torch.Generator("cpu").manual_seed(seed)}
        with torch.no_grad():
            out, seconds = timed(self.device, lambda: self.pipe(*args, **kwargs))
        self.generations += 1
        if self.bar is not None:
            self.bar.update(1)
        return as_tensor(out), seconds
