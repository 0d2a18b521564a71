"""The CPU's memory probe: one step of one mode in a fresh process (``python -m tokenmerge.bench.memory``),
optionally under a data-size limit, reporting the process's own peak resident memory."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from dataclasses import asdict

import torch

from ..tools.methods import MethodSpec, parse_spec
from .cell import Cell, is_oom, set_attention, step
from .presets import Preset, resolve

__all__ = ["memory_cell", "rss_mb", "peak_rss_mb", "reset_peak_rss"]


def memory_cell(preset: Preset, cell: Cell, mode: MethodSpec, dtype: str, limit_mb: int | None,
                timeout: float = 3600) -> dict:
    """Peak resident memory of one step in a fresh process (the CPU's way to measure), under ``limit_mb``."""
    payload = json.dumps({"cell": asdict(cell), "mode": mode.text, "dtype": dtype, "limit_mb": limit_mb,
                          "model": preset.model})
    proc = subprocess.run([sys.executable, "-m", "tokenmerge.bench.memory", payload], capture_output=True,
                          text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if lines:  # the probe's own verdict, "ok" or "OOM"
        return json.loads(lines[-1])
    # killed (the kernel's OOM killer, or an allocation failure that aborted): out of memory as well; so is an
    # OpenMP runtime that could not map a thread's stack under the limit (libgomp exits: "Thread creation failed"),
    # and oneDNN that could not allocate a convolution's primitive under it (seen with OMP_NUM_THREADS=1)
    tail = proc.stderr[-4000:]
    words = ("MemoryError", "can't allocate memory", "Cannot allocate memory", "out of memory")
    words += ("Thread creation failed", "could not create a primitive") if limit_mb else ()
    if proc.returncode < 0 or any(w in tail for w in words):
        return {"status": "OOM", "peak_rss_mb": None, "step_rss_mb": None}
    raise RuntimeError(f"memory probe failed for {cell} {mode}:\n{proc.stderr[-2000:]}")


def _proc_status_mb(field: str) -> float | None:
    """A ``kB`` field of ``/proc/self/status`` (Linux) in MB, or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mb() -> float:
    """This process's resident memory now, in MB (Linux; elsewhere its peak, the best the OS tells)."""
    now = _proc_status_mb("VmRSS")
    return now if now is not None else peak_rss_mb()


def peak_rss_mb() -> float:
    """This process's own peak resident memory in MB.

    Linux: ``VmHWM``, the high-water mark of this process's address space. Not ``ru_maxrss``: Linux carries that
    across ``execve`` from the forked parent, so a probe started by a parent holding 14 GB would report 14 GB
    whatever it used itself. Elsewhere ``ru_maxrss`` (bytes on macOS, kilobytes on the other Unixes).
    """
    hwm = _proc_status_mb("VmHWM")
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024


def reset_peak_rss() -> bool:
    """Reset the peak (``VmHWM``) to the current resident size, so that it measures what follows (Linux >= 4.0,
    through ``/proc/self/clear_refs``). False where the OS does not allow it: the peak then spans the process."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_child(payload: str) -> None:
    spec = json.loads(payload)
    cell, mode = Cell(**spec["cell"]), parse_spec(spec["mode"], bench=True)
    dtype = getattr(torch, spec["dtype"])
    preset = resolve(cell.preset if spec["model"] is None else None, spec["model"], dtype)
    from diffusers import UNet2DConditionModel  # noqa: F401  (imports first: the limit is for the model and step)
    from diffusers.models import attention_processor  # noqa: F401

    if spec["limit_mb"]:
        limit = int(spec["limit_mb"]) * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    try:
        unet = preset.build(dtype)
        set_attention(unet, cell.attention, preset.family)
        inputs = preset.inputs(cell.batch, cell.resolution, dtype, torch.device("cpu"), frames=cell.frames)
        mode.apply(unet)
        setup_peak = peak_rss_mb()
        before = rss_mb()
        reset_peak_rss()  # from here the high-water mark is the step's (where the OS can reset it)
        step(unet, inputs)
        step_peak = peak_rss_mb()
        print(json.dumps({"status": "ok", "peak_rss_mb": max(setup_peak, step_peak),
                          "step_rss_mb": max(0.0, step_peak - before)}), flush=True)
    except Exception as err:
        if not is_oom(err):
            raise
        print(json.dumps({"status": "OOM", "peak_rss_mb": None, "step_rss_mb": None}), flush=True)


if __name__ == "__main__":  # the isolated probe
    os.environ.setdefault("TQDM_DISABLE", "1")
    _memory_child(sys.argv[1])
