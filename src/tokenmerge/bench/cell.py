"""A benchmark cell (preset x attention x resolution x batch) and what every measurement of one shares: the
attention backend, one denoiser step, a method as a round applies it, the record fields of a method, the modules
regional compilation compiles, out-of-memory detection."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from ..tools.methods import MethodSpec

__all__ = ["Cell", "MODE_NAMES", "ATTENTION_BACKENDS", "OWN_METHODS", "GENERIC_PROCESSORS", "bench_label",
           "record_fields", "set_attention", "available_attention", "is_oom", "size", "step", "applied", "step_timed",
           "regional"]

# --modes names; each becomes a MethodSpec (tools.methods.parse_spec) per ratio or factor
MODE_NAMES = ("vanilla", "tokenmerge", "tomesd", "limit", "todo", "todo-limit", "grid-limit")
ATTENTION_BACKENDS = ("vanilla", "sdpa", "xformers")
# this library's methods: they install tokenmerge hooks, so their phases can be timed (--breakdown)
OWN_METHODS = ("tome", "todo", "limit", "todo-limit")


@dataclass(frozen=True)
class Cell:
    """``resolution``: pixels per side (square) or ``"HxW"`` (height x width); ``frames``: pixel frames of a video
    preset (None for images)."""

    preset: str
    attention: str
    resolution: int | str
    batch: int
    frames: int | None = None


def size(resolution: int | str) -> tuple[int, int]:
    """``(height, width)`` in pixels of a cell's resolution (``512`` or ``"480x832"``)."""
    if isinstance(resolution, str):
        h, _, w = resolution.lower().partition("x")
        return int(h), int(w)
    return int(resolution), int(resolution)


def bench_label(spec: MethodSpec) -> str:
    """The column name of a method in the tables: this library's ToMe is "tokenmerge" beside "tomesd"."""
    return "tokenmerge" + spec.label[4:] if spec.name == "tome" else spec.label


def record_fields(spec: MethodSpec) -> dict:
    """The fields naming a method in a record (mode, spec, label, ratio or factor, options)."""
    factor = 0
    if spec.is_factor:
        factor = spec.value_text if isinstance(spec.value, tuple) else spec.value
    limit = spec.limit
    return dict(mode="tokenmerge" if spec.name == "tome" else spec.name, spec=spec.text, label=bench_label(spec),
                ratio=0.0 if spec.is_factor or spec.value is None else spec.value,
                factor=factor, options=dict(spec.options), reference=bench_label(limit) if limit else None)


# families whose attention modules take diffusers' generic processors (AttnProcessor, AttnProcessor2_0...); the
# other transformers run their own processors, which compute attention with PyTorch's SDPA
GENERIC_PROCESSORS = ("unet", "pixart")


def set_attention(unet, backend: str, family: str = "unet") -> None:
    from diffusers.models import attention_processor as ap

    if family not in GENERIC_PROCESSORS:  # their own processors, SDPA-based: nothing else computes their attention
        if backend != "sdpa":
            raise ValueError(f"attention {backend!r} is not available for the {family} preset (it runs its own "
                             "attention processors, on PyTorch's SDPA); use sdpa")
        return
    if backend == "vanilla":
        unet.set_attn_processor(ap.AttnProcessor())
    elif backend == "sdpa":
        unet.set_attn_processor(ap.AttnProcessor2_0())
    elif backend == "xformers":
        unet.set_attn_processor(ap.XFormersAttnProcessor())
    else:
        raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}; got {backend!r}")


def available_attention() -> list[str]:
    out = ["vanilla", "sdpa"]
    try:
        import xformers.ops  # noqa: F401

        out.append("xformers")
    except Exception:
        pass
    return out


def is_oom(err: BaseException) -> bool:
    return isinstance(err, MemoryError) or "out of memory" in str(err).lower() or \
        type(err).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(err).lower()


@torch.no_grad()
def step(unet, inputs: dict | list[dict]):
    """One denoising step: a denoiser call on the keyword ``inputs``, or one call per dict of a list (the
    separate conditional and unconditional calls of pipelines that run guidance that way); the last output."""
    if isinstance(inputs, (list, tuple)):
        out = None
        for call in inputs:
            out = step(unet, call)
        return out
    if "sample" in inputs:  # a UNet: the latent by position, as tomesd (which reads args[0]) needs
        rest = {k: v for k, v in inputs.items() if k != "sample"}
        return unet(inputs["sample"], **rest)
    return unet(**inputs)


def _steady(mode: MethodSpec) -> MethodSpec:
    """What a round applies: a stateful mode with one full step before its partial (token reuse) or skipped (the step
    cache) ones (``steps._eager``; ``auto``: ``applied``)."""
    if not mode.stateful or mode.name == "auto":
        return mode
    if mode.is_across_steps:
        return MethodSpec(mode.name, mode.value, mode.steady().options + (("warmup", 1),))
    return MethodSpec(mode.name, mode.value, mode.steady().options + (("warmup", 1), ("every", 0)))


@contextlib.contextmanager
def applied(mode: MethodSpec, unet):
    """``mode`` applied as a round applies it (``_steady``), removed after; ``auto`` (``tokenmerge.accelerate``): the
    cache it chose, its warm-up cut to one computed step as the caches' (a skipped step's work does not depend on
    the schedule), so that its rounds time a computed step and a skipped one, not two computed ones."""
    import tokenmerge

    with _steady(mode).applied(unet):
        config = getattr(tokenmerge.describe_patch(unet), "config", None) if mode.name == "auto" else None
        if getattr(config, "warmup", 1) > 1:
            tokenmerge.apply_config(unet, dataclasses.replace(config, warmup=1))
        yield unet


def step_timed(mode: MethodSpec) -> str:
    """Which later step a stateful mode's record times: the caches' skipped (cached) one, token reuse's partial."""
    return "skipped" if mode.is_across_steps or mode.name == "auto" else "partial"


def regional(unet) -> list:
    """The modules regional compilation compiles in place: those of the model's ``_repeated_blocks`` (what diffusers'
    ``compile_repeated_blocks`` compiles), else those of its lists named ``*blocks`` and its ``mid_block`` (a UNet's
    down, mid and up blocks, a transformer's blocks)."""
    names = getattr(unet, "_repeated_blocks", None)
    if names:
        return [m for m in unet.modules() if type(m).__name__ in names]
    return [m for n, c in unet.named_children() for m in (
        c if isinstance(c, torch.nn.ModuleList) and n.endswith("blocks") else [c] if n == "mid_block" else [])]
