"""Step timing: every mode on one cell, interleaved (A, B, C, A, B, C...) after warm-up rounds, medians."""

from __future__ import annotations

import statistics
from dataclasses import asdict

import torch

from ..tools.methods import MethodSpec
from ..tools.timing import timed
from .cell import Cell, is_oom, record_fields, set_attention, step

__all__ = ["time_cell"]


def _compile_friendly() -> None:
    """Every mode x compiled variant is its own set of guards on the same code: let dynamo keep them all."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


def time_cell(unet, preset, cell: Cell, modes: list[MethodSpec], repeats: int, device, dtype,
              progress=None, compile: bool = False, warmup: int = 1) -> list[dict]:
    """Time every mode on one cell; one record per mode (``status`` "ok", "OOM" or why compiling failed).

    ``warmup`` untimed rounds come first. ``compile``: every mode also runs under ``torch.compile``, interleaved
    with the eager runs (the warm-up round compiles)."""
    set_attention(unet, cell.attention, preset.family)
    inputs = preset.inputs(cell.batch, cell.resolution, dtype, device, frames=cell.frames)
    runs = [(m, False) for m in modes] + ([(m, True) for m in modes] if compile else [])
    if compile:
        _compile_friendly()

    def key(run):
        return run[0].text + (" compiled" if run[1] else "")

    times: dict[str, list[float]] = {key(r): [] for r in runs}
    peak: dict[str, int] = {}
    status = {key(r): "ok" for r in runs}
    for rep in range(warmup + repeats):  # the first ``warmup`` rounds are not timed
        for run in runs:
            mode, compiled = run
            k = key(run)
            if status[k] != "ok":
                continue
            try:
                with mode.applied(unet):
                    model = torch.compile(unet) if compiled else unet
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    seconds = timed(device, step, model, inputs)[1]
                    if rep >= warmup:
                        times[k].append(seconds)
                    if device.type == "cuda":
                        peak[k] = max(peak.get(k, 0), torch.cuda.max_memory_allocated(device))
            except Exception as err:
                if is_oom(err):
                    status[k] = "OOM"
                elif compiled:  # e.g. a reference package that does not trace: say so, go on
                    status[k] = f"compile failed ({type(err).__name__})"
                else:
                    raise
            if progress is not None:
                progress.update(1)
    records = []
    for run in runs:
        k = key(run)
        fields = record_fields(run[0])
        if run[1]:
            fields["label"] += " compiled"
        ts = times[k]
        records.append(dict(asdict(cell), **fields, compiled=run[1], status=status[k],
                            median_s=statistics.median(ts) if ts else None, runs=len(ts), times_s=ts,
                            peak_mem_mb=peak[k] / 2**20 if k in peak else None))
    return records
