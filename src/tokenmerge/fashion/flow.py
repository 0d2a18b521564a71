"""What the embedded transformers (``dit.py``, ``video.py``) share: their diffusers class, sampling with their
pipeline's scheduler (``schedulers.py``) and classifier-free guidance, and loading their shipped weights."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import torch

__all__ = ["transformer_class", "check_call", "sample", "load_parts", "TimestepMixin", "context_fields"]


class TimestepMixin:
    """``pipe.current_timestep`` (0..1000, None outside a step), as diffusers' pipelines expose it."""

    _current_timestep = None

    @property
    def current_timestep(self):
        return self._current_timestep


def transformer_class(name: str, since: str):
    """The diffusers class ``name``, or an ``ImportError`` saying which diffusers brought it."""
    import diffusers

    if not hasattr(diffusers, name):
        raise ImportError(f"the embedded model is a {name}, which diffusers {diffusers.__version__} does not have (it "
                          f"came in diffusers {since})")
    return getattr(diffusers, name)


def check_call(num_inference_steps, output_type: str) -> None:
    if output_type not in ("pil", "pt", "np"):
        raise ValueError(f"output_type must be 'pil', 'pt' or 'np', got {output_type!r}")
    if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be a positive int, got {num_inference_steps!r}")


def sample(velocity: Callable, x: torch.Tensor, steps: int, guidance_scale: float, pipe) -> torch.Tensor:
    """Sample from noise ``x`` with ``pipe.scheduler`` (``schedulers.py``) in ``steps`` steps; ``velocity(x, t)``
    (``t`` the flow time in [0, 1], 1 = noise) takes the batch doubled (unconditional first) when
    ``guidance_scale != 1``.

    The transformer runs as diffusers' own pipelines run it, so that diffusers' cache hooks
    (``transformer.enable_cache(...)``) and this library's caches see what they see there: the scheduler's
    ``set_timesteps`` (flow-matching Euler on Flux's grid: sigmas ``linspace(1, 1/N, N)``, shifted by the scheduler),
    each call inside ``transformer.cache_context("predict", step_index=, sigma=, num_inference_steps=)`` (the fields
    where this diffusers has them, as Wan's pipeline passes them), ``pipe.current_timestep`` the step's timestep
    during the step, the cache's state reset before and after the generation."""
    guided = guidance_scale != 1.0
    scheduler = pipe.scheduler
    if type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler":  # Flux's grid (SD3's differs at its end)
        scheduler.set_timesteps(sigmas=[1.0 - k / steps for k in range(steps)], device=x.device)
    else:
        scheduler.set_timesteps(steps, device=x.device)
    model = getattr(pipe, "transformer", None)
    context = getattr(model, "cache_context", None)  # diffusers >= 0.33 (CacheMixin)
    fields = context_fields()
    _reset_cache(model)
    try:
        for i, t in enumerate(scheduler.timesteps):
            inp = torch.cat([x, x]) if guided else x
            pipe._current_timestep = t
            told = {"step_index": i, "sigma": float(scheduler.sigmas[i]), "num_inference_steps": steps} \
                if fields else {}  # where the loop is, as Wan's pipeline tells it
            with context("predict", **told) if context is not None else contextlib.nullcontext():
                v = velocity(inp, (t / 1000).expand(inp.shape[0]).to(x.dtype))
            if guided:
                v_u, v_c = v.chunk(2)
                v = v_u + guidance_scale * (v_c - v_u)
            x = scheduler.step(v, t, x, return_dict=False)[0]
    finally:
        pipe._current_timestep = None
        _reset_cache(model)
    return x


def context_fields() -> bool:
    """Whether this diffusers' ``cache_context`` takes where the loop is (``CacheContext``'s ``step_index``,
    ``sigma``, ``num_inference_steps``: diffusers >= 0.42)."""
    try:
        from diffusers.hooks.hooks import CacheContext
    except ImportError:
        return False
    return "step_index" in getattr(CacheContext, "__dataclass_fields__", {})


def _reset_cache(model) -> None:
    reset = getattr(model, "_reset_stateful_cache", None)  # what DiffusionPipeline.maybe_free_model_hooks calls
    if reset is not None:
        reset()


def load_parts(path: Path, transformer: torch.nn.Module, text: torch.nn.Module, what: str, script: str):
    """``transformer`` and ``text`` with the weights of ``path`` (keys ``transformer.*``, ``text.*``), in eval mode."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"the embedded {what}'s weights are not at {path}: reinstall tokenmerge, or train them "
                                f"with `python scripts/{script}` from the repository")
    state = load_file(str(path))
    transformer.load_state_dict({k[12:]: v.float() for k, v in state.items() if k.startswith("transformer.")})
    text.load_state_dict({k[5:]: v.float() for k, v in state.items() if k.startswith("text.")})
    return transformer.eval(), text.eval()
