"""Run a benchmark grid: cells (preset x attention x resolution x batch), modes compared interleaved.

In a cell, every mode runs once to warm up, then the modes take turns (A, B, C, A, B, C, ...) so that drift
of a shared machine hits them alike; the figures are medians, with the device synchronised around each step.
The jobs live beside this driver: ``steps`` (step timing), ``memory`` (the isolated memory probe),
``breakdown`` (phases inside the patched blocks), ``generation`` (whole generations), ``cell`` (what they share).
"""

from __future__ import annotations

import math
import platform
import statistics
from dataclasses import asdict

import torch

import tokenmerge

from ..tools.methods import MethodSpec, parse_spec
from .breakdown import breakdown_cell
from .cell import Cell, record_fields
from .generation import time_generation
from .memory import memory_cell
from .steps import time_cell

__all__ = ["run_grid", "versions"]


def _describe(preset) -> dict:
    """What a table says of a preset: its description and how its step runs guidance."""
    return dict(description=preset.description, guidance=getattr(preset, "guidance_text", None),
                family=preset.family)


def versions(device: torch.device) -> dict:
    import diffusers

    info = {"torch": torch.__version__, "diffusers": diffusers.__version__, "tokenmerge": tokenmerge.__version__,
            "python": platform.python_version(), "device": str(device), "threads": torch.get_num_threads()}
    try:
        from importlib.metadata import version

        import tomesd  # noqa: F401

        info["tomesd"] = version("tomesd")
    except Exception:
        pass
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        try:
            import triton

            info["triton"] = triton.__version__
        except Exception:
            pass
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def _frames(preset, frames) -> list:
    """The frame counts of a preset's cells: ``frames`` (or its default) for video presets, ``[None]`` else."""
    if not getattr(preset, "video", False):
        return [None]
    return list(frames) if frames else [preset.default_frames]


def _run_cell(unet, preset, cell: Cell, modes, repeats, device, dtype, dtype_name, memory, memory_limit_mb,
              breakdown, breakdown_repeats, steps, compile, warmup, bar, kernels=False, eager=True,
              log=None) -> list[dict]:
    """One cell: the memory probes, the interleaved step timing, whole generations, the breakdown."""
    if memory_limit_mb is not None and device.type == "cpu":
        probes = {m.text: memory_cell(preset, cell, m, dtype_name, memory_limit_mb) for m in modes}
        fits = [m for m in modes if probes[m.text]["status"] == "ok"]
    else:
        probes, fits = {}, list(modes)
    cell_records = time_cell(unet, preset, cell, fits, repeats, device, dtype, bar, compile=compile, warmup=warmup,
                             kernels=kernels, eager=eager, log=log) if fits else []
    bar.update(_runs(warmup, repeats, compile, eager) * (len(modes) - len(fits)))
    done = {r["spec"] for r in cell_records}
    for m in modes:
        if m.text not in done:
            cell_records.append(dict(asdict(cell), **record_fields(m), status="OOM", median_s=None,
                                     runs=0, times_s=[], peak_mem_mb=None))
    for r in cell_records:
        probe = probes.get(r["spec"]) if not r.get("compiled") else None
        if probe is None and memory and device.type == "cpu" and r["status"] == "ok":
            probe = memory_cell(preset, cell, parse_spec(r["spec"], bench=True), dtype_name, None)
        if probe is not None:
            r["peak_mem_mb"], r["step_mem_mb"] = probe["peak_rss_mb"], probe["step_rss_mb"]
            if probe["status"] == "OOM":
                r["status"] = "OOM"
    ok = [m for m in modes if any(r["spec"] == m.text and r["status"] == "ok" and not r.get("compiled")
                                  for r in cell_records)]
    if steps and ok:  # a whole generation at the cell's size: grid-limit (a smaller call) has none
        ok = [m for m in ok if m.name != "grid-limit"]
        gen, ran = time_generation(unet, preset, cell, ok, repeats, steps, device, dtype, bar)
        for r in cell_records:
            ts = None if r.get("compiled") else gen.get(r["spec"])
            if ts:
                r["generate_s"], r["generate_times_s"] = statistics.median(ts), ts
                if r["spec"] in ran:
                    r["generate_ran"] = ran[r["spec"]]
    if breakdown and ok:  # no warm-up round of its own: the step rounds just ran every mode on this cell
        cell_records += [dict(r, kind="breakdown", status="ok")
                         for r in breakdown_cell(unet, preset, cell, ok, breakdown_repeats, device, dtype, 0)]
    return cell_records


def _compile_modes(compile) -> list[str]:
    """``compile`` as a list of compile modes: False/None/[] -> none, True -> inductor's default mode."""
    from .steps import COMPILE_MODES

    return list(COMPILE_MODES[:1]) if compile is True else list(compile or [])


def _runs(warmup: int, repeats: int, compile, eager: bool = True) -> int:
    """Progress units of one mode in one cell: eager rounds, and each compiled mode's calls."""
    return (warmup + repeats if eager else 0) + len(_compile_modes(compile)) * (max(1, warmup) + repeats)


def run_grid(presets, attentions, resolutions, batches, modes: list[MethodSpec], repeats, device, dtype,
             memory=False, memory_limit_mb=None, progress=True, breakdown=False, steps=0, compile=False,
             log=None, warmup: int = 1, frames=None, breakdown_repeats: int | None = None, kernels: bool = False,
             eager: bool = True, prepare=None) -> tuple[list[dict], dict]:
    """Every cell of the grid; records of step times (and memory), plus, with ``breakdown``, records of the
    phases (``kind="breakdown"``, ``breakdown_repeats`` rounds, default ``repeats``), and with ``steps``, each
    record's ``generate_s`` (the end-to-end time). ``frames``: pixel frames of the video presets' cells.
    ``compile``: False, True (inductor's default mode) or a list of compile modes (``steps.COMPILE_MODES``);
    ``kernels``: count each mode's kernels per call; ``eager=False``: only the compiled modes; ``log``: called with a
    line per step record as soon as it is made (None: silent); ``prepare``:
    ``prepare(model, preset) -> model``, called on each built model (``bench.parallel.Parallel``: context
    parallelism)."""
    from tqdm.auto import tqdm

    device = torch.device(device)
    dtype_name = str(dtype).split(".")[-1]
    breakdown_repeats = repeats if breakdown_repeats is None else breakdown_repeats
    cells = sum(len(_frames(p, frames)) for p in presets) * len(attentions) * len(resolutions) * len(batches)
    compile = _compile_modes(compile)
    total = cells * len(modes) * _runs(warmup, repeats, compile, eager) + (cells * len(modes) * repeats if steps else 0)
    bar = tqdm(total=total, desc="bench", disable=not progress, unit="run")
    job = dict(modes=modes, repeats=repeats, device=device, dtype=dtype, dtype_name=dtype_name, memory=memory,
               memory_limit_mb=memory_limit_mb, breakdown=breakdown, breakdown_repeats=breakdown_repeats, steps=steps,
               compile=compile, warmup=warmup, bar=bar, kernels=kernels, eager=eager, log=log)
    records = []
    for preset in presets:
        unet = preset.build(dtype, device)
        if prepare is not None:
            unet = prepare(unet, preset)
        for attention in attentions:
            for resolution in resolutions:
                for batch in batches:
                    for frame_count in _frames(preset, frames):
                        cell = Cell(preset.name, attention, resolution, batch, frame_count)
                        grid = preset.grid(resolution, frame_count) if hasattr(preset, "grid") else None
                        for r in _run_cell(unet, preset, cell, **job):
                            if grid:
                                r["grid"], r["tokens"] = "x".join(map(str, grid)), math.prod(grid)
                            records.append(r)
        del unet
    bar.close()
    meta = dict(versions(device), dtype=dtype_name, repeats=repeats, warmup=warmup, steps=steps, compile=compile,
                kernels=kernels, eager=eager,
                breakdown_repeats=breakdown_repeats if breakdown else None,
                presets={p.name: _describe(p) for p in presets},
                memory="CUDA allocator peak" if device.type == "cuda" else
                ("peak RSS of an isolated one-step process" if memory or memory_limit_mb else "not measured"),
                memory_limit_mb=memory_limit_mb)
    for r in records:
        r.setdefault("kind", "step")
        r["dtype"] = meta["dtype"]
        r["device"] = meta["device_name"]
    return records, meta
