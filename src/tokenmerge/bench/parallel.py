"""Step timing under diffusers' context parallelism: ``torchrun --nproc-per-node N -m tokenmerge bench
--context-parallel ulysses ...`` (one process per GPU; on a CPU, gloo processes, for checking the path).

Every rank builds the same preset (seeded weights, seeded inputs), enables ``ContextParallelConfig(ulysses_degree=N)``
(or ``ring_degree=N``) on it, and runs the bench's own interleaved step timing (``steps.time_cell``) in lockstep:
each mode is applied after parallelism is enabled (the order docs/guides/multi-gpu.md recommends). The collectives
keep the ranks together; a step's time is the slowest rank's (``slowest``). Rank 0 writes the outputs.

On a CPU diffusers places rank r on device ``r % torch.accelerator.device_count()``, which is 0 without an
accelerator: while parallelism is enabled the count reads 1 (``_one_device``), nothing else changes.
"""

from __future__ import annotations

import contextlib
import os
import statistics

import torch

__all__ = ["KINDS", "Parallel", "TupleOutputs", "launched", "no_plan", "setup", "slowest", "teardown"]

KINDS = ("ulysses", "ring")


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup(device_text: str) -> tuple[torch.device, int, int]:
    """``(device, rank, world)``: joins the process group torchrun describes (nccl on CUDA, gloo on a CPU).
    ``device_text``: the bench's --device (``auto``/``cuda``: this rank's GPU, ``LOCAL_RANK``; ``cpu``)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = device_text in ("auto", "cuda") and torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return device, rank, world


def teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def no_plan(preset) -> str | None:
    """Why ``preset``'s model cannot run under context parallelism (its class has no ``_cp_plan``), or None."""
    import diffusers

    from .preset import _CLASSES

    cls = getattr(diffusers, _CLASSES.get(preset.family, ""), None)
    if cls is None or getattr(cls, "_cp_plan", None) is None:
        return (f"{preset.name}: diffusers {diffusers.__version__} has no context-parallel plan (_cp_plan) for "
                f"{cls.__name__ if cls is not None else preset.family}")
    return None


@contextlib.contextmanager
def _one_device():
    """``torch.accelerator.device_count()`` reads 1 inside (diffusers' ``rank % device_count`` on a CPU)."""
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


class Parallel:
    """``prepare(model, preset)`` for ``runner.run_grid``: enables context parallelism on each built model.

    Args:
        kind: "ulysses" or "ring"; world: ranks; device: this rank's.
    """

    def __init__(self, kind: str, world: int, device: torch.device):
        self.kind, self.world, self.device = kind, world, device

    def __call__(self, model, preset):
        from diffusers import ContextParallelConfig

        config = ContextParallelConfig(**{f"{self.kind}_degree": self.world})
        with _one_device() if self.device.type == "cpu" else contextlib.nullcontext():
            model.enable_parallelism(config=config)
        return model


class TupleOutputs:
    """A preset whose step inputs ask for tuple outputs (``return_dict=False``, as the pipelines call): diffusers'
    gather at the model's output takes tensors only (Wan's plan hooks the model's own forward)."""

    def __init__(self, preset):
        self._preset = preset

    def __getattr__(self, name):
        return getattr(self._preset, name)

    def inputs(self, *args, **kwargs):
        calls = self._preset.inputs(*args, **kwargs)
        if isinstance(calls, (list, tuple)):
            return [dict(c, return_dict=False) for c in calls]
        return dict(calls, return_dict=False)


def slowest(records: list[dict]) -> None:
    """Each record's step times become, round by round, the slowest rank's (an all-reduce of the maximum), and
    its median follows. Every rank holds the same records in the same order (they ran the same grid)."""
    import torch.distributed as dist

    width = max((len(r.get("times_s") or []) for r in records), default=0)
    if not records or width == 0:
        return
    times = torch.full((len(records), width), -1.0, dtype=torch.float64)
    for i, r in enumerate(records):
        ts = r.get("times_s") or []
        times[i, : len(ts)] = torch.tensor(ts, dtype=torch.float64)
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    times = times.to(on)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.cpu()
    for i, r in enumerate(records):
        n = len(r.get("times_s") or [])
        if n:
            r["times_s"] = times[i, :n].tolist()
            r["median_s"] = statistics.median(r["times_s"])
