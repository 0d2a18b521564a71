"""Run a benchmark grid: cells (preset x attention x resolution x batch), modes compared interleaved.

In a cell, every mode runs once to warm up, then the modes take turns (A, B, C, A, B, C, ...) so that drift
of a shared machine hits them alike; the figures are medians, with the device synchronised around each step.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

import tokenmerge
from tokenmerge.merge.plan import slice_matcher
from tokenmerge.methods import auto_downsample

from .presets import Preset, resolve

__all__ = ["Mode", "Cell", "run_grid", "ATTENTION_BACKENDS", "MODE_NAMES"]

MODE_NAMES = ("vanilla", "tokenmerge", "tomesd", "limit", "todo")
ATTENTION_BACKENDS = ("vanilla", "sdpa", "xformers")


@dataclass(frozen=True)
class Mode:
    name: str
    ratio: float = 0.0
    factor: int = 0  # ToDo's downsampling factor

    @property
    def label(self) -> str:
        if self.name == "todo":
            return f"todo {self.factor}"
        return self.name if self.name == "vanilla" else f"{self.name} {self.ratio:g}"

    def apply(self, unet) -> None:
        if self.name == "todo":
            tokenmerge.apply_todo(unet, downsample=self.factor)
        elif self.name == "tokenmerge":
            tokenmerge.apply_patch(unet, ratio=self.ratio)
        elif self.name == "limit":
            tokenmerge.apply_config(unet, tokenmerge.ToMeConfig(ratio=self.ratio), matcher=slice_matcher)
        elif self.name == "tomesd":
            import tomesd

            # the same blocks as ours: tomesd's own default (1) matches nothing on SDXL
            tomesd.apply_patch(unet, ratio=self.ratio, max_downsample=auto_downsample(unet))

    def remove(self, unet) -> None:
        if self.name == "tomesd":
            import tomesd

            tomesd.remove_patch(unet)
        elif self.name != "vanilla":
            tokenmerge.remove_patch(unet)


@dataclass(frozen=True)
class Cell:
    preset: str
    attention: str
    resolution: int
    batch: int


def set_attention(unet, backend: str, family: str = "unet") -> None:
    from diffusers.models import attention_processor as ap

    if family in ("sd3", "flux"):  # their own joint processors, SDPA-based: nothing else computes their attention
        if backend != "sdpa":
            raise ValueError(f"attention {backend!r} is not available for the {family} preset; use sdpa")
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, MemoryError) or "out of memory" in str(err).lower() or \
        type(err).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(err).lower()


@torch.no_grad()
def _step(unet, inputs: dict) -> None:
    if "sample" in inputs:  # a UNet: the latent by position, as tomesd (which reads args[0]) needs
        rest = {k: v for k, v in inputs.items() if k != "sample"}
        unet(inputs["sample"], **rest)
    else:
        unet(**inputs)


def versions(device: torch.device) -> dict:
    import diffusers

    info = {"torch": torch.__version__, "diffusers": diffusers.__version__, "tokenmerge": tokenmerge.__version__,
            "python": platform.python_version(), "device": str(device), "threads": torch.get_num_threads()}
    try:
        import tomesd  # noqa: F401
        from importlib.metadata import version

        info["tomesd"] = version("tomesd")
    except Exception:
        pass
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def time_cell(unet, preset, cell: Cell, modes: list[Mode], repeats: int, device, dtype, progress=None) -> list[dict]:
    """Time every mode on one cell; one record per mode (``status`` "ok" or "OOM")."""
    set_attention(unet, cell.attention, preset.family)
    inputs = preset.inputs(cell.batch, cell.resolution, dtype, device)
    times: dict[str, list[float]] = {m.label: [] for m in modes}
    peak: dict[str, int] = {}
    status = {m.label: "ok" for m in modes}
    for rep in range(repeats + 1):  # round 0 warms up
        for mode in modes:
            if status[mode.label] != "ok":
                continue
            mode.apply(unet)
            try:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                start = time.perf_counter()
                _step(unet, inputs)
                _sync(device)
                if rep:
                    times[mode.label].append(time.perf_counter() - start)
                if device.type == "cuda":
                    peak[mode.label] = max(peak.get(mode.label, 0), torch.cuda.max_memory_allocated(device))
            except Exception as err:
                if not _is_oom(err):
                    raise
                status[mode.label] = "OOM"
            finally:
                mode.remove(unet)
            if progress is not None:
                progress.update(1)
    records = []
    for mode in modes:
        ts = times[mode.label]
        records.append(dict(asdict(cell), mode=mode.name, ratio=mode.ratio, factor=mode.factor, label=mode.label,
                            status=status[mode.label], median_s=statistics.median(ts) if ts else None,
                            runs=len(ts), times_s=ts,
                            peak_mem_mb=peak[mode.label] / 2**20 if mode.label in peak else None))
    return records


def memory_cell(preset: Preset, cell: Cell, mode: Mode, dtype: str, limit_mb: int | None,
                timeout: float = 3600) -> dict:
    """Peak resident memory of one step in a fresh process (the CPU's way to measure), under ``limit_mb``."""
    payload = json.dumps({"cell": asdict(cell), "mode": asdict(mode), "dtype": dtype, "limit_mb": limit_mb,
                          "model": preset.model})
    proc = subprocess.run([sys.executable, "-m", "tokenmerge.bench.runner", payload], capture_output=True,
                          text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if lines:  # the probe's own verdict, "ok" or "OOM"
        return json.loads(lines[-1])
    # killed (the kernel's OOM killer, or an allocation failure that aborted): out of memory as well
    tail = proc.stderr[-4000:]
    if proc.returncode < 0 or any(w in tail for w in ("MemoryError", "can't allocate memory", "Cannot allocate memory",
                                                       "out of memory")):
        return {"status": "OOM", "peak_rss_mb": None, "step_rss_mb": None}
    raise RuntimeError(f"memory probe failed for {cell} {mode}:\n{proc.stderr[-2000:]}")


def _memory_child(payload: str) -> None:
    spec = json.loads(payload)
    cell, mode = Cell(**spec["cell"]), Mode(**spec["mode"])
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
        inputs = preset.inputs(cell.batch, cell.resolution, dtype, torch.device("cpu"))
        mode.apply(unet)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        _step(unet, inputs)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"status": "ok", "peak_rss_mb": peak, "step_rss_mb": peak - before}), flush=True)
    except Exception as err:
        if not _is_oom(err):
            raise
        print(json.dumps({"status": "OOM", "peak_rss_mb": None, "step_rss_mb": None}), flush=True)


def run_grid(presets, attentions, resolutions, batches, modes, repeats, device, dtype, memory=False,
             memory_limit_mb=None, progress=True, log=print) -> tuple[list[dict], dict]:
    from tqdm.auto import tqdm

    device = torch.device(device)
    dtype_name = str(dtype).split(".")[-1]
    total = len(presets) * len(attentions) * len(resolutions) * len(batches) * len(modes) * (repeats + 1)
    bar = tqdm(total=total, desc="bench", disable=not progress, unit="step")
    records = []
    for preset in presets:
        name = preset.name
        unet = preset.build(dtype, device)
        for attention in attentions:
            for resolution in resolutions:
                for batch in batches:
                    cell = Cell(name, attention, resolution, batch)
                    if memory_limit_mb is not None and device.type == "cpu":
                        probes = {m.label: memory_cell(preset, cell, m, dtype_name, memory_limit_mb)
                                  for m in modes}
                        fits = [m for m in modes if probes[m.label]["status"] == "ok"]
                    else:
                        probes, fits = {}, list(modes)
                    cell_records = time_cell(unet, preset, cell, fits, repeats, device, dtype, bar) if fits else []
                    bar.update((repeats + 1) * (len(modes) - len(fits)))
                    done = {r["label"] for r in cell_records}
                    for m in modes:
                        if m.label not in done:
                            cell_records.append(dict(asdict(cell), mode=m.name, ratio=m.ratio, factor=m.factor,
                                                      label=m.label,
                                                      status="OOM", median_s=None, runs=0, times_s=[],
                                                      peak_mem_mb=None))
                    for r in cell_records:
                        probe = probes.get(r["label"])
                        if probe is None and memory and device.type == "cpu" and r["status"] == "ok":
                            probe = memory_cell(preset, cell, Mode(r["mode"], r["ratio"], r.get("factor", 0)), dtype_name,
                                                None)
                        if probe is not None:
                            r["peak_mem_mb"], r["step_mem_mb"] = probe["peak_rss_mb"], probe["step_rss_mb"]
                            if probe["status"] == "OOM":
                                r["status"] = "OOM"
                    records += cell_records
        del unet
    bar.close()
    meta = dict(versions(device), dtype=dtype_name, repeats=repeats,
                memory="CUDA allocator peak" if device.type == "cuda" else
                ("peak RSS of an isolated one-step process" if memory or memory_limit_mb else "not measured"),
                memory_limit_mb=memory_limit_mb)
    for r in records:
        r["dtype"] = meta["dtype"]
        r["device"] = meta["device_name"]
    return records, meta


if __name__ == "__main__":  # the isolated memory probe
    os.environ.setdefault("TQDM_DISABLE", "1")
    _memory_child(sys.argv[1])
