"""Step timing: every mode on one cell, interleaved (A, B, C, A, B, C...) after warm-up rounds, medians; then,
with ``compile``, every mode compiled, one after another.

On CUDA a step's time is the device's (CUDA events around the call), and the host's time to issue the call is
kept beside it; elsewhere both are the wall time with the device synchronised. With ``kernels``, each mode's
kernels per denoiser call are counted once after the timed rounds (``kernels.count_kernels``: operators
dispatched, and on CUDA the profiler's launches and the device's busy time).

Compiled modes are not interleaved. Dynamo keeps compiled code per code object (the denoiser's ``forward``,
shared by every mode) and does not guard on forward hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``):
code compiled for vanilla runs unchanged for a patched model and the reverse, and a patch applied again makes new
hook objects, which fail the guards of code traced with the old ones (a recompile per round). So each mode is
compiled by itself: ``torch.compiler.reset()``, the patch applied, ``torch.compile(model, mode=...,
fullgraph=True)`` (a model that is not one graph, e.g. a reference package, is compiled again with graph breaks,
as torch.compile's default allows: ``fullgraph`` False in its record; ``regional``: the blocks compiled in place,
``Module.compile(fullgraph=True)``, after the patch), warm-up calls (they compile; with ``reduce-overhead`` they
record the CUDA graphs), ``repeats`` timed calls, the kernel count, the patch removed, the blocks' compilation
dropped, ``torch.compiler.reset()``. The caches across steps decide each call in its hooks here (a bare denoiser: no
pipeline enters its ``cache_context``): compiled whole they run their hooks eagerly (``fullgraph`` False), regionally
a skipped step runs no compiled code. Each compiled mode is checked against the same mode eager
(``compiled_vs_eager``: the largest difference of the outputs over the largest output value), so a compiled
call that ran another mode's code would show.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import asdict

import torch

from ..measure import sync, timed
from ..merge import kernels_failed
from ..tools.methods import MethodSpec
from .cell import Cell, applied, is_oom, record_fields, regional, set_attention, step, step_timed
from .kernels import count_kernels, host_device_times, profile_launches

__all__ = ["time_cell", "COMPILE_MODES", "compile_suffix", "step_calls", "main_tensor"]

# torch.compile modes the bench runs: inductor's default and CUDA graphs ("reduce-overhead") on the whole denoiser, and
# "regional": its repeated blocks compiled in place (inductor's default mode), as diffusers' compile_repeated_blocks
COMPILE_MODES = ("default", "reduce-overhead", "regional")
# a call whose device was busy less than this share of its time waited for the host: launch-bound
BUSY_LAUNCH_BOUND = 0.8
# the timestep of a stateful mode's timed partial step (the inputs' default is 500: the step before it)
LATER = 450


def compile_suffix(compile_mode: str | None) -> str:
    """The label suffix of a compiled mode: ``" compiled"`` (inductor's default mode) or
    ``" compiled reduce-overhead"``; empty for eager."""
    if not compile_mode:
        return ""
    return " compiled" + ("" if compile_mode == "default" else f" {compile_mode}")


def step_calls(inputs) -> int:
    """Denoiser calls in one step (two for pipelines that run guidance as two calls)."""
    return len(inputs) if isinstance(inputs, (list, tuple)) else 1


def main_tensor(out) -> torch.Tensor:
    """The main output tensor of a denoiser call (``.sample``, the first element of a tuple, a stacked list)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "sample"):
        return out.sample
    if isinstance(out, dict):
        return main_tensor(next(iter(out.values())))
    if isinstance(out, (list, tuple)) and out:
        if all(isinstance(o, torch.Tensor) for o in out) and len(out) > 1 and out[0].dim() >= 3 \
                and all(o.shape == out[0].shape for o in out):
            return torch.stack(list(out))  # per-sample outputs (Z-Image)
        return main_tensor(out[0])
    raise TypeError(f"cannot find the output tensor in {type(out).__name__}")


def _compile_friendly() -> None:
    """Let dynamo keep the guards of every mode's graphs (e.g. two call shapes per step)."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


def _inputs(preset, cell: Cell, mode: MethodSpec, dtype, device):
    """A mode's step inputs: the cell's, or for ``grid-limit`` the same call at the merged token count."""
    resolution = cell.resolution
    if mode.name == "grid-limit":
        resolution = preset.merged_resolution(cell.resolution, mode.value, cell.frames)
    return preset.inputs(cell.batch, resolution, dtype, device, frames=cell.frames)


def _unchanged(later, inputs):
    """``later`` with each tensor equal to the one of its name in ``inputs`` replaced by that one: a pipeline passes
    its position ids, masks and text embeddings unchanged from step to step, and the engine reads a tensor's values
    on the host once (the grid from Flux's ids), so a later step's call must not bring new ones."""
    if isinstance(later, (list, tuple)):
        return type(later)(_unchanged(a, b) for a, b in zip(later, inputs))
    same = {}
    for name, value in later.items():
        old = inputs.get(name)
        if (isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor) and value.shape == old.shape
                and value.dtype == old.dtype and torch.equal(value, old)):
            value = old
        same[name] = value
    return same


def _call(device, model, inputs, compile_mode=None) -> tuple[float, float]:
    """``(device_s, host_s)`` of one step: CUDA events and the host's issue time on CUDA, else the wall time."""
    if compile_mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()
    if device.type == "cuda":
        host, seconds = host_device_times(step, device, model, inputs)
        return seconds, host
    seconds = timed(device, step, model, inputs)[1]
    return seconds, seconds


def _kernel_fields(counts: dict, calls: int, device_s: float | None) -> dict:
    """A kernel count's record fields, per denoiser call, and the device's busy share of the step."""
    def per_call(n):
        return None if n is None else n / calls

    busy = None
    if counts.get("kernel_time_s") is not None and device_s:
        busy = min(1.0, counts["kernel_time_s"] / device_s)
    return dict(kernels_per_call=per_call(counts.get("kernels")), syncs_per_call=per_call(counts.get("syncs")),
                launches_per_call=per_call(counts.get("launches")), kernel_time_s=counts.get("kernel_time_s"),
                device_busy=busy)


def _launch_bound(record: dict, device) -> bool | None:
    """Whether the device waited for the host: busy less than ``BUSY_LAUNCH_BOUND`` of the step (profiler), or
    without a profile, the host's issue time at least 90% of the device time. None off CUDA."""
    if device.type != "cuda" or record.get("median_s") is None:
        return None
    if record.get("device_busy") is not None:
        return record["device_busy"] < BUSY_LAUNCH_BOUND
    host = record.get("host_median_s")
    return None if host is None else host >= 0.9 * record["median_s"]


def _record(cell: Cell, mode: MethodSpec, compile_mode, status, times, hosts, peak, extra=None) -> dict:
    fields = record_fields(mode)
    fields["label"] += compile_suffix(compile_mode)
    if fields.get("reference"):
        fields["reference"] += compile_suffix(compile_mode)
    return dict(asdict(cell), **fields, compiled=bool(compile_mode), compile_mode=compile_mode, status=status,
                median_s=statistics.median(times) if times else None, runs=len(times), times_s=times,
                host_median_s=statistics.median(hosts) if hosts else None, host_times_s=hosts,
                peak_mem_mb=peak / 2**20 if peak is not None else None, **(extra or {}))


def time_cell(unet, preset, cell: Cell, modes: list[MethodSpec], repeats: int, device, dtype,
              progress=None, compile=False, warmup: int = 1, kernels: bool = False, eager: bool = True,
              log=None) -> list[dict]:
    """Time every mode on one cell; one record per mode (``status`` "ok", "OOM" or why compiling failed).

    Args:
        unet, preset, cell: the model, its preset and the cell.
        modes: the methods, vanilla first.
        repeats: timed rounds (eager) or timed calls (each compiled mode).
        device, dtype: where the model is.
        progress: a tqdm bar (or None).
        compile: also time each mode compiled: ``True`` (inductor's default mode) or a list of
            ``COMPILE_MODES``; each compiled mode is compared with compiled vanilla of the same compile mode.
        warmup: untimed rounds before the timed ones (compiled: at least one call, which compiles).
        kernels: count each mode's kernels per call (after the timed rounds).
        eager: time the eager modes (False: only the compiled ones).
        log: called with a line per record as soon as it is made (a run cut short by a time limit keeps them in
            its log), or None.
    """
    set_attention(unet, cell.attention, preset.family)
    device = torch.device(device)
    inputs = {m.text: _inputs(preset, cell, m, dtype, device) for m in modes}
    compile_modes = list(COMPILE_MODES[:1] if compile is True else compile or [])
    records = []
    later = {m.text: _unchanged(preset.inputs(cell.batch, cell.resolution, dtype, device, timestep=LATER,
                                              frames=cell.frames), inputs[m.text])
             for m in modes if m.stateful}  # a later step's inputs: the stateful modes' partial step
    if eager:
        records += _eager(unet, cell, modes, inputs, repeats, device, progress, warmup, kernels, later)
        for r in records:
            _log(log, r)
    if compile_modes:
        _compile_friendly()
        for compile_mode in compile_modes:
            for mode in modes:
                records.append(_compiled(unet, cell, mode, inputs[mode.text], repeats, device, progress, warmup,
                                         kernels, compile_mode, later.get(mode.text)))
                _log(log, records[-1])
    for r in records:  # the token grid a grid-limit call ran on
        if r["mode"] == "grid-limit":
            grid = preset.grid(preset.merged_resolution(cell.resolution, r["ratio"], cell.frames), cell.frames)
            r["limit_grid"], r["limit_tokens"] = "x".join(map(str, grid)), math.prod(grid)
    return records


def _log(log, r: dict) -> None:
    """One line of a finished record: its label, median step time, kernels per call and status."""
    if log is None:
        return
    time = f"{r['median_s'] * 1000:.4g} ms" if r.get("median_s") is not None else "-"
    kernels = f", {r['kernels_per_call']:,.0f} kernels/call" if r.get("kernels_per_call") else ""
    log(f"  done: {r['label']}: {time}{kernels} ({r['status']})")


def _eager(unet, cell, modes, inputs, repeats, device, progress, warmup, kernels, later=None) -> list[dict]:
    """The eager modes, interleaved: ``warmup`` untimed rounds, then ``repeats`` timed ones.

    A stateful mode (token reuse) is timed on two steps of a generation per round: its first step (every token
    computed, the caches filled: ``full_times_s``) and then a partial step at ``later[mode]`` inputs (a later
    timestep: ``times_s``, its steady state), with its schedule's warm-up cut to that one full step (the
    partial step's work does not depend on the schedule)."""
    times: dict[str, list[float]] = {m.text: [] for m in modes}
    hosts: dict[str, list[float]] = {m.text: [] for m in modes}
    fulls: dict[str, list[float]] = {m.text: [] for m in modes if m.stateful}
    peak: dict[str, int] = {}
    status = {m.text: "ok" for m in modes}
    for rep in range(warmup + repeats):  # the first ``warmup`` rounds are not timed
        for mode in modes:
            k = mode.text
            if status[k] != "ok":
                continue
            try:
                with applied(mode, unet):
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    if mode.stateful:
                        full, _ = _call(device, unet, inputs[k])
                        if rep >= warmup:
                            fulls[k].append(full)
                    seconds, host = _call(device, unet, later[k] if mode.stateful else inputs[k])
                    if rep >= warmup:
                        times[k].append(seconds)
                        hosts[k].append(host)
                    if device.type == "cuda":
                        peak[k] = max(peak.get(k, 0), torch.cuda.max_memory_allocated(device))
            except Exception as err:
                if not is_oom(err):
                    raise
                status[k] = "OOM"
            if progress is not None:
                progress.update(1)
    records = []
    for mode in modes:
        k = mode.text
        extra = {}
        if kernels and status[k] == "ok":
            try:
                with applied(mode, unet):
                    if mode.stateful:  # a steady partial step's kernels: after a round that builds its tables
                        for each in (inputs[k], later[k], inputs[k]):  # (round-robin order, window), then the
                            step(unet, each)  # full step that fills the caches
                    counts = count_kernels(step, device, unet, later[k] if mode.stateful else inputs[k])
                ts = times[k]
                extra = _kernel_fields(counts, step_calls(inputs[k]), statistics.median(ts) if ts else None)
            except Exception as err:
                if not is_oom(err):
                    raise
        if mode.stateful:
            extra.update(full_median_s=statistics.median(fulls[k]) if fulls[k] else None, full_times_s=fulls[k],
                         step_timed=step_timed(mode))
        if dict(mode.options).get("kernels") == "triton" and kernels_failed() is not None:  # it ran the torch
            status[k] = "Triton failed"  # operators (the library's fallback): not a time of the Triton kernels
            extra["error"] = kernels_failed()
        record = _record(cell, mode, None, status[k], times[k], hosts[k], peak.get(k), extra)
        record["launch_bound"] = _launch_bound(record, device)
        records.append(record)
    return records


def _compiled(unet, cell, mode, inputs, repeats, device, progress, warmup, kernels, compile_mode,
              later=None) -> dict:
    """One mode compiled (``compile_mode``) by itself: reset, patch, compile, warm up, time, count, remove.

    A stateful mode (token reuse, ``later``: its partial step's inputs) runs as in ``_eager``: each timed call is a
    partial step after a full one (both compiled in the warm-up), ``full_times_s`` beside it; its
    ``compiled_vs_eager`` compares a full step."""
    from torch._dynamo.utils import counters

    times, hosts, fulls, peak, extra, status = [], [], [], None, {}, "ok"
    torch.compiler.reset()
    try:
        with applied(mode, unet):
            counters["inductor"].clear()
            model, extra["fullgraph"] = _compile(unet, inputs, device, warmup, compile_mode, later)
            if compile_mode == "reduce-overhead" and device.type == "cuda":  # not CUDA graphs after all: say so
                extra["cudagraph_skips"] = counters["inductor"].get("cudagraph_skips", 0)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(repeats):
                if later is not None:
                    fulls.append(_call(device, model, inputs, compile_mode)[0])
                seconds, host = _call(device, model, inputs if later is None else later, compile_mode)
                times.append(seconds)
                hosts.append(host)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device)
            extra["compiled_vs_eager"] = _difference(unet, model, inputs, device, compile_mode)
            if kernels:
                if later is not None:  # the partial step's kernels, after the full step that fills the caches
                    _call(device, model, inputs, compile_mode)
                if compile_mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                counts = profile_launches(step, device, model, inputs if later is None else later)
                extra.update(_kernel_fields(counts, step_calls(inputs), statistics.median(times)))
            if later is not None:
                extra.update(full_median_s=statistics.median(fulls), full_times_s=fulls, step_timed=step_timed(mode))
    except Exception as err:  # out of memory, or a mode that does not compile (a package that does not trace): say so
        status = "OOM" if is_oom(err) else f"compile failed ({type(err).__name__})"
        if status != "OOM":
            extra["error"] = str(err)[:500]
    finally:
        for module in regional(unet) if compile_mode == "regional" else ():
            module._compiled_call_impl = None
        torch.compiler.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if progress is not None:
        progress.update(max(1, warmup) + repeats)
    record = _record(cell, mode, compile_mode, status, times, hosts, peak, extra)
    record["launch_bound"] = _launch_bound(record, device)
    return record


def _compile(unet, inputs, device, warmup: int, compile_mode: str, later=None):
    """``(compiled model, fullgraph)``: compiled as one graph (``fullgraph=True``) and warmed up (the calls compile;
    with ``reduce-overhead`` two more record the CUDA graphs; ``later``: each warm-up call a full step and a partial
    one); a model that is not one graph (a graph break: e.g. a reference package, token reuse's decision on the
    host) is compiled again as torch.compile's default allows, with graph breaks (``fullgraph`` False in its
    record)."""
    import torch._dynamo

    calls = max(1, warmup) + (2 if compile_mode == "reduce-overhead" else 0)
    mode = None if compile_mode == "default" else compile_mode
    for fullgraph in (True, False):
        if compile_mode == "regional":
            for module in regional(unet):
                module.compile(fullgraph=fullgraph)
            model = unet
        else:
            model = torch.compile(unet, mode=mode, fullgraph=fullgraph)
        try:
            for _ in range(calls):
                for each in (inputs,) if later is None else (inputs, later):
                    _call(device, model, each, compile_mode)
            return model, fullgraph
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError):
            if not fullgraph:
                raise
            torch.compiler.reset()
    raise AssertionError("unreachable")


@torch.no_grad()
def _difference(unet, model, inputs, device, compile_mode) -> float | None:
    """Largest |compiled - eager| of the step's output over its largest |eager| value (None if not finite)."""
    if compile_mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()
    compiled = main_tensor(step(model, inputs)).detach().float().clone()  # a CUDA graph's output is reused
    with torch.compiler.set_stance("force_eager") if compile_mode == "regional" else contextlib.nullcontext():
        eager = main_tensor(step(unet, inputs)).detach().float()  # (regional: the same model, its blocks eager)
    sync(device)
    scale = eager.abs().max().item()
    diff = (compiled - eager).abs().max().item()
    if not (math.isfinite(scale) and math.isfinite(diff)) or scale == 0:
        return None
    return diff / scale
