"""Where a denoiser call stands in its generation, and the state a call keeps.

- ``Where``: a call's place, as told on the host: the scheduler's step index, the denoising progress (0 at pure noise,
  1 at the end), the generation's step count, and who told it: the pipeline's ``cache_context`` fields
  (``context_where``: diffusers 0.42's ``CacheContext``, as Wan's and Cosmos's pipelines pass them), its scheduler's
  host state (``host_where``), or the call's timestep, read (``CallHook``).
- ``CallInfo``: what the one place that decides a call (``CallHook.decide``) hands the technique's ``begin``.
- ``decide_ahead``: a call decided before it, where the denoiser's ``cache_context`` tells it.

The scheduler's host state: a diffusers pipeline sets its scheduler's ``timesteps`` once per generation
(``set_timesteps``: a new tensor) and moves a step counter of the scheduler's at each step: ``step_index`` (the
k-diffusion-style and flow schedulers: Euler, flow-matching Euler, DPM-Solver, UniPC, LCM..., ``None`` until the first
step, which starts at ``begin_index``), PNDM's ``counter``; DDIM keeps none, but Stable Diffusion's pipelines pass it
``t`` itself, an element of its ``timesteps`` (a view: where it lies in their storage is the step). The step's
timestep on the scheduler's 0..1000 scale comes from a host copy of ``timesteps`` read once per generation (one
``tolist()`` at its first call; its progress ``1 - t / num_train_timesteps`` is what the families' timestep arguments
give too). A scheduler whose timesteps do not fall from ``num_train_timesteps`` to 0 (EDM's, Mochi's inverted ones),
or a call outside a pipeline, tells nothing here: the engine reads the call's timestep instead (``describe_patch``
says which).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Where", "CallInfo", "decide_ahead", "host_where", "host_step", "host_progress", "context_where",
           "STALE_CALLS", "PARALLEL_ATTR"]

PARALLEL_ATTR = "_parallel_config"  # where a diffusers model keeps its ParallelConfig (enable_parallelism)


@dataclass(frozen=True)
class Where:
    """Where a call stands: ``index``, the scheduler's step index (``None`` where not told); ``progress``, the denoising
    progress (``None``: no timestep); ``steps``, the generation's step count (``None`` where not told); ``source``, who
    told it (``"context"``: the pipeline's ``cache_context``, ``"scheduler"``: its host state, ``"timestep"``: the
    call's timestep, read); ``grid``, the mark of the generation's time grid (the scheduler's ``timesteps``)."""

    index: int | None
    progress: float | None
    steps: int | None = None
    source: str = "timestep"
    grid: object = None


@dataclass
class CallInfo:
    """What the one place that decides a call (``CallHook.decide``) hands the technique's ``begin``: the call's
    arguments (a call decided before it, in its ``cache_context``, gets them when it starts: ``args`` is ``None``
    until then), the device, the timestep (a tensor, or ``None``), where it stands, and whether it runs compiled (the
    host-side set-up of a compiled call: numbers the blocks read go as tensors)."""

    args: tuple | None
    kwargs: dict | None
    device: object
    timestep: object
    where: Where
    compiled: bool = False


STALE_CALLS = 16  # calls at one host step beyond which the scheduler's counter is taken as not moving


def host_step(scheduler, timestep) -> int | None:
    """The index in ``scheduler.timesteps`` of the step a call with ``timestep`` belongs to, from the scheduler's
    host state, or ``None`` where it keeps none."""
    timesteps = getattr(scheduler, "timesteps", None)
    if not isinstance(timesteps, torch.Tensor) or timesteps.dim() != 1:
        return None
    state = getattr(scheduler, "__dict__", {})
    if "_step_index" in state:
        index = state["_step_index"]
        if index is None:  # before the generation's first step: its first (img2img: its begin index)
            begin = state.get("_begin_index")
            return begin if isinstance(begin, int) else 0
        return index if isinstance(index, int) else None
    if type(scheduler).__name__ == "PNDMScheduler" and isinstance(state.get("counter"), int):
        return state["counter"]
    if isinstance(timestep, torch.Tensor) and timestep.dim() == 0 and timestep.device == timesteps.device and \
            timesteps.numel() and timestep.untyped_storage().data_ptr() == timesteps.untyped_storage().data_ptr():
        index, rest = divmod(timestep.storage_offset() - timesteps.storage_offset(), timesteps.stride(0) or 1)
        return index if not rest and 0 <= index < len(timesteps) else None
    return None


def host_progress(scheduler) -> tuple | None:
    """The denoising progress of each step of ``scheduler``'s generation (0 at pure noise), read from its
    ``timesteps`` once (call it once per generation), or ``None`` where they are not on the 0..N scale, falling."""
    timesteps = getattr(scheduler, "timesteps", None)
    config = getattr(scheduler, "config", None)
    n = getattr(config, "num_train_timesteps", None) if config is not None else None
    if not isinstance(timesteps, torch.Tensor) or timesteps.dim() != 1 or not timesteps.numel() or \
            not isinstance(n, (int, float)) or n <= 0:
        return None
    values = timesteps.tolist()  # the one host read of the generation
    if values[0] > n * 1.001 or values[-1] < 0 or any(b > a for a, b in zip(values, values[1:])):
        return None
    return tuple(1.0 - t / n for t in values)


def host_where(clock, scheduler, timestep) -> Where | None:
    """Where a call stands, from ``scheduler``'s host state (its progress list read once per generation), or
    ``None`` where it tells none (the call's timestep is read instead)."""
    index = None if clock.hostless or scheduler is None else host_step(scheduler, timestep)
    if index is None:
        return None
    timesteps = getattr(scheduler, "timesteps", None)
    if timesteps is not clock.levels[0]:
        clock.levels = (timesteps, host_progress(scheduler))
    levels = clock.levels[1]
    if levels is None or not 0 <= index < len(levels):
        return None
    clock.same = clock.same + 1 if index == clock.index else 0
    if clock.same >= STALE_CALLS:  # e.g. a loop of the user's that never calls scheduler.step
        clock.hostless = True
        return None
    return Where(index, levels[index], None, "scheduler", timesteps)


def context_where(fields: dict, scheduler=None) -> Where | None:
    """Where a call stands, from what a pipeline passed to the denoiser's ``cache_context`` (diffusers
    0.42's ``CacheContext`` fields, as Wan's and Cosmos's pipelines pass them: ``step_index``, ``sigma``,
    ``num_inference_steps``, ``timestep``), or ``None`` where they do not tell a step and its progress.

    The progress is ``1 - sigma`` for a flow sigma in [0, 1] (a flow scheduler's timestep is ``1000 sigma``), else
    ``1 - timestep / num_train_timesteps`` (the scheduler's, 1000 without one): what ``host_progress`` gives.

    Example:
        >>> context_where({"step_index": 3, "sigma": 0.75, "num_inference_steps": 50})
        Where(index=3, progress=0.25, steps=50, source='context', grid=None)
    """
    index = fields.get("step_index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        return None
    steps = fields.get("num_inference_steps")
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > index else None
    sigma, timestep = fields.get("sigma"), fields.get("timestep")
    grid = getattr(scheduler, "timesteps", None)
    if isinstance(sigma, (int, float)) and not isinstance(sigma, bool) and 0.0 <= sigma <= 1.0:
        return Where(index, 1.0 - float(sigma), steps, "context", grid)
    if isinstance(timestep, torch.Tensor) and timestep.numel() == 1 and timestep.device.type == "cpu":
        timestep = float(timestep)  # (a host tensor: no device read)
    if isinstance(timestep, (int, float)) and not isinstance(timestep, bool):
        config = getattr(scheduler, "config", None)
        n = getattr(config, "num_train_timesteps", None) or 1000
        if 0.0 <= timestep <= n:
            return Where(index, 1.0 - float(timestep) / n, steps, "context", grid)
    return None


def decide_ahead(calls, fields: dict):
    """A call of ``calls`` (a ``CallHook``) told before it, by the denoiser's ``cache_context``
    (``across.DecidingContext``: diffusers' pipelines enter it around each call): decided now, on the host
    (``CallHook.decide``), where the pipeline tells its step (the context's ``fields``: ``context_where``; else its
    scheduler's host state), so that the call reads only what was decided (compiled whole with ``fullgraph=True``). Its
    branch is its place among the step's calls made so (guidance as two calls: two branches). Returns the call's state,
    or ``None``: not decided (the call decides itself, at its pre-hook)."""
    state = calls.state
    state.reset()
    if calls.timestep is None or getattr(calls.patch.site.module, PARALLEL_ATTR, None) is not None:  # (CP)
        return None
    pipe = calls.pipeline() if calls.pipeline is not None else None
    scheduler = getattr(pipe, "scheduler", None)
    where = context_where(fields, scheduler)
    if where is None and scheduler is not None:
        where = host_where(state.clock, scheduler, None)
    if where is None:
        return None
    state.decided = True
    calls.decide(state, where, ("cache_context",), CallInfo(None, None, None, None, where))
    return state
