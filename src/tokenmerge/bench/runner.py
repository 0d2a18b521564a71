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
from tokenmerge.methods import MethodSpec, parse_spec

from .presets import Preset, load_pipeline, resolve

__all__ = ["Cell", "run_grid", "bench_label", "ATTENTION_BACKENDS", "MODE_NAMES"]

# --modes names; each becomes a MethodSpec (methods.parse_spec) per ratio or factor
MODE_NAMES = ("vanilla", "tokenmerge", "tomesd", "limit", "todo", "todo-limit")
ATTENTION_BACKENDS = ("vanilla", "sdpa", "xformers")
# this library's methods: they install tokenmerge hooks, so their phases can be timed (--breakdown)
OWN_METHODS = ("tome", "todo", "limit", "todo-limit")


def bench_label(spec: MethodSpec) -> str:
    """The column name of a method in the tables: this library's ToMe is "tokenmerge" beside "tomesd"."""
    return "tokenmerge" + spec.label[4:] if spec.name == "tome" else spec.label


def _record_fields(spec: MethodSpec) -> dict:
    return dict(mode="tokenmerge" if spec.name == "tome" else spec.name, spec=spec.text, label=bench_label(spec),
                ratio=0.0 if spec.is_factor or spec.value is None else spec.value,
                factor=spec.value if spec.is_factor else 0, options=dict(spec.options))


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


def timed(device: torch.device, fn, *args):
    """``(fn(*args), seconds)``, the device synchronised before and after."""
    _sync(device)
    start = time.perf_counter()
    out = fn(*args)
    _sync(device)
    return out, time.perf_counter() - start


@torch.no_grad()
def _step(unet, inputs: dict):
    """One denoiser call on the keyword ``inputs``; its output."""
    if "sample" in inputs:  # a UNet: the latent by position, as tomesd (which reads args[0]) needs
        rest = {k: v for k, v in inputs.items() if k != "sample"}
        return unet(inputs["sample"], **rest)
    return unet(**inputs)


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
    inputs = preset.inputs(cell.batch, cell.resolution, dtype, device)
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
                    seconds = timed(device, _step, model, inputs)[1]
                    if rep >= warmup:
                        times[k].append(seconds)
                    if device.type == "cuda":
                        peak[k] = max(peak.get(k, 0), torch.cuda.max_memory_allocated(device))
            except Exception as err:
                if _is_oom(err):
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
        fields = _record_fields(run[0])
        if run[1]:
            fields["label"] += " compiled"
        ts = times[k]
        records.append(dict(asdict(cell), **fields, compiled=run[1], status=status[k],
                            median_s=statistics.median(ts) if ts else None, runs=len(ts), times_s=ts,
                            peak_mem_mb=peak[k] / 2**20 if k in peak else None))
    return records


def memory_cell(preset: Preset, cell: Cell, mode: MethodSpec, dtype: str, limit_mb: int | None,
                timeout: float = 3600) -> dict:
    """Peak resident memory of one step in a fresh process (the CPU's way to measure), under ``limit_mb``."""
    payload = json.dumps({"cell": asdict(cell), "mode": mode.text, "dtype": dtype, "limit_mb": limit_mb,
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
        inputs = preset.inputs(cell.batch, cell.resolution, dtype, torch.device("cpu"))
        mode.apply(unet)
        setup_peak = peak_rss_mb()
        before = rss_mb()
        reset_peak_rss()  # from here the high-water mark is the step's (where the OS can reset it)
        _step(unet, inputs)
        step_peak = peak_rss_mb()
        print(json.dumps({"status": "ok", "peak_rss_mb": max(setup_peak, step_peak),
                          "step_rss_mb": max(0.0, step_peak - before)}), flush=True)
    except Exception as err:
        if not _is_oom(err):
            raise
        print(json.dumps({"status": "OOM", "peak_rss_mb": None, "step_rss_mb": None}), flush=True)


def breakdown_cell(unet, preset, cell: Cell, modes: list[MethodSpec], repeats: int, device, dtype,
                   warmup: int = 1) -> list[dict]:
    """Time the phases inside the patched blocks (similarity, merge, attention, unmerge) for this library's
    methods, with the device synchronised at every phase boundary (so the total is slower than a normal step).
    ``tome:0`` runs the same blocks unmerged, as the reference. One record per method: medians per step."""
    from .breakdown import PhaseTimer, attach

    own = [MethodSpec("tome", 0.0)] + [m for m in modes if m.name in OWN_METHODS]
    set_attention(unet, cell.attention, preset.family)
    inputs = preset.inputs(cell.batch, cell.resolution, dtype, device)
    runs: dict[str, list[dict]] = {m.text: [] for m in own}
    for rep in range(warmup + repeats):
        for mode in own:
            timer = PhaseTimer(device)
            with mode.applied(unet):
                attach(unet, timer)
                _step(unet, inputs)
            if rep >= warmup:
                runs[mode.text].append(timer.totals())
    records = []
    for mode in own:
        phases = sorted({k for run in runs[mode.text] for k in run})
        medians = {k: statistics.median(run.get(k, 0.0) for run in runs[mode.text]) for k in phases}
        records.append(dict(asdict(cell), **_record_fields(mode), phases_s=medians, runs=len(runs[mode.text])))
    return records


def _vae(preset: Preset, dtype, device):
    """The preset's VAE: the pipeline's own for --model, else the SD/SD3/Flux VAE architecture, random weights."""
    if preset.model is not None:
        return load_pipeline(preset.model, dtype).vae.to(device).eval()
    from diffusers import AutoencoderKL

    channels = preset.latent_channels
    torch.manual_seed(0)
    if preset.name.startswith("tiny"):
        return AutoencoderKL(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=channels,
                             norm_num_groups=32).to(device, dtype).eval()
    return AutoencoderKL(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2,
                         latent_channels=channels).to(device, dtype).eval()


@torch.no_grad()
def generate(unet, vae, preset: Preset, inputs: dict, steps: int, guidance: float = 7.5):
    """A text-to-image denoising loop of ``steps`` steps and the VAE decode, as a pipeline runs them, on the
    bench's inputs (prompt embeddings given: the text encoder's few milliseconds are left out)."""
    import diffusers

    flow = preset.family in ("sd3", "flux")  # flow matching (diffusers >= 0.29, as are these models)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler() if flow else diffusers.DDIMScheduler()
    scheduler.set_timesteps(steps)
    key = "sample" if "sample" in inputs else "hidden_states"
    cfg = preset.family != "flux"
    n = inputs[key].shape[0]
    x = inputs[key][: n // 2] if cfg else inputs[key]
    rest = {k: v for k, v in inputs.items() if k not in (key, "timestep")}
    for t in scheduler.timesteps:
        model_in = torch.cat([x, x]) if cfg else x
        step_t = torch.full((n,), float(t) / (1000 if preset.family == "flux" else 1), device=x.device)
        out = _step(unet, {key: model_in, "timestep": step_t, **rest}).sample
        if cfg:
            uncond, cond = out.chunk(2)
            out = uncond + guidance * (cond - uncond)
        out = out[:, : x.shape[1]]  # PixArt predicts a variance too
        x = scheduler.step(out, t, x).prev_sample
    if preset.family == "flux":  # unpack 2x2 latent pixels per token
        side = int(round(x.shape[1] ** 0.5))
        c = preset.latent_channels
        x = x.view(x.shape[0], side, side, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(x.shape[0], c, 2 * side, 2 * side)
    return vae.decode(x / vae.config.scaling_factor).sample


def time_generation(unet, preset, cell: Cell, modes: list[MethodSpec], repeats: int, steps: int, device, dtype,
                    progress=None) -> dict[str, list[float]]:
    """Seconds of ``generate`` per mode, interleaved, after one VAE warm-up (the steps were warmed by
    ``time_cell``)."""
    vae = _vae(preset, dtype, device)
    inputs = preset.inputs(cell.batch, cell.resolution, dtype, device)
    generate(unet, vae, preset, inputs, 1)  # warms the scheduler and the VAE at this size
    times: dict[str, list[float]] = {m.text: [] for m in modes}
    for _ in range(repeats):
        for mode in modes:
            with mode.applied(unet):
                times[mode.text].append(timed(device, generate, unet, vae, preset, inputs, steps)[1])
            if progress is not None:
                progress.update(1)
    return times


def run_grid(presets, attentions, resolutions, batches, modes: list[MethodSpec], repeats, device, dtype,
             memory=False, memory_limit_mb=None, progress=True, breakdown=False, steps=0, compile=False,
             log=print, warmup: int = 1) -> tuple[list[dict], dict]:
    """Every cell of the grid; records of step times (and memory), plus, with ``breakdown``, records of the
    phases (``kind="breakdown"``), and with ``steps``, each record's ``generate_s`` (the end-to-end time)."""
    from tqdm.auto import tqdm

    device = torch.device(device)
    dtype_name = str(dtype).split(".")[-1]
    cells = len(presets) * len(attentions) * len(resolutions) * len(batches)
    total = cells * len(modes) * (warmup + repeats) * (2 if compile else 1) + (cells * len(modes) * repeats if steps else 0)
    bar = tqdm(total=total, desc="bench", disable=not progress, unit="run")
    records = []
    for preset in presets:
        name = preset.name
        unet = preset.build(dtype, device)
        for attention in attentions:
            for resolution in resolutions:
                for batch in batches:
                    cell = Cell(name, attention, resolution, batch)
                    if memory_limit_mb is not None and device.type == "cpu":
                        probes = {m.text: memory_cell(preset, cell, m, dtype_name, memory_limit_mb) for m in modes}
                        fits = [m for m in modes if probes[m.text]["status"] == "ok"]
                    else:
                        probes, fits = {}, list(modes)
                    cell_records = time_cell(unet, preset, cell, fits, repeats, device, dtype, bar,
                                             compile=compile, warmup=warmup) if fits else []
                    bar.update((warmup + repeats) * (len(modes) - len(fits)) * (2 if compile else 1))
                    done = {r["spec"] for r in cell_records}
                    for m in modes:
                        if m.text not in done:
                            cell_records.append(dict(asdict(cell), **_record_fields(m), status="OOM", median_s=None,
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
                    if steps and ok:
                        gen = time_generation(unet, preset, cell, ok, repeats, steps, device, dtype, bar)
                        for r in cell_records:
                            ts = None if r.get("compiled") else gen.get(r["spec"])
                            if ts:
                                r["generate_s"], r["generate_times_s"] = statistics.median(ts), ts
                    if breakdown and ok:
                        cell_records += [dict(r, kind="breakdown", status="ok")
                                         for r in breakdown_cell(unet, preset, cell, ok, repeats, device, dtype,
                                                                         warmup)]
                    records += cell_records
        del unet
    bar.close()
    meta = dict(versions(device), dtype=dtype_name, repeats=repeats, warmup=warmup, steps=steps, compile=compile,
                memory="CUDA allocator peak" if device.type == "cuda" else
                ("peak RSS of an isolated one-step process" if memory or memory_limit_mb else "not measured"),
                memory_limit_mb=memory_limit_mb)
    for r in records:
        r.setdefault("kind", "step")
        r["dtype"] = meta["dtype"]
        r["device"] = meta["device_name"]
    return records, meta


if __name__ == "__main__":  # the isolated memory probe
    os.environ.setdefault("TQDM_DISABLE", "1")
    _memory_child(sys.argv[1])
