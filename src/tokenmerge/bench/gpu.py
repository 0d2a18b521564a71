"""The GPU table (``tokenmerge bench --gpu``): full-size models, one denoiser step each, every method against
vanilla and its zero-overhead limit, eager and compiled, with kernels per call and host against device time.

``ROWS`` are the rows of the table measured by hand on an H100 before this command existed: SD 1.5 at 512 and
1024, SDXL at 1024 and 2048, PixArt-alpha 1024, Flux.1-dev at 1024 and 2048, Wan 2.1 1.3B and 14B at 480x832 x
81 frames, HunyuanVideo at 720x1280 x 61 frames; fp16 for the UNets and PixArt, bf16 for the others. Each row
runs ToMe 0.5 (the defaults: local matching, ``match_radius=1``, one plan per level, ``share_plans=True``), with a
plan per block (``share_plans=False``), ToMe 0.5 global (``match_radius=None``), whole-block ToMe 0.5
(``scope="block"``, with either plan), on the UNets the merge forced below ``min_size`` (``min_size=0``), ToDo 2
(video: also ToDo (2, 2, 2)), tomesd 0.5 (UNets), and their zero-overhead limits: ``limit`` (the same hooks with
a free merge), ``grid-limit`` (whole-block merging on a transformer: the unpatched model at the merged token count,
no hooks at all), ``todo-limit``.

``summary`` turns the records of one or more runs (their JSONL files) into the table, one row per cell, one
column per method: speed-up (and its share of the limit), kernels per call, host / device time, peak memory.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

__all__ = ["Row", "ROWS", "QUICK", "COLUMNS", "summary"]

_TOME = ("tome:0.5", "tome:0.5,share_plans=false", "tome:0.5,match_radius=None", "tome:0.5,scope=block",
         "tome:0.5,scope=block,share_plans=false", "todo:2")
# UNets at their usual sizes fall below min_size on CUDA (config.CUDA_MIN_SIZE): the defaults run unmerged there, so
# the rows also force the merge (min_size=0), with its limits
_UNET = ("vanilla",) + _TOME + ("tome:0.5,min_size=0", "todo:2,min_size=0", "tomesd:0.5", "limit:0.5",
                                "limit:0.5,min_size=0", "limit:0.5,scope=block", "todo-limit:2",
                                "todo-limit:2,min_size=0")
# transformers: also the Triton kernels (kernels=triton) of attention and whole-block ToMe
_DIT = ("vanilla",) + _TOME + ("tome:0.5,kernels=triton", "tome:0.5,scope=block,kernels=triton", "limit:0.5",
                               "grid-limit:0.5", "todo-limit:2")
_VIDEO = _DIT + ("todo:2x2x2", "todo-limit:2x2x2")


@dataclass(frozen=True)
class Row:
    """One row of the GPU table.

    Args:
        preset: the full-size preset.
        resolution: pixels per side or ``"HxW"``.
        frames: pixel frames (video) or None.
        dtype: the model's dtype, as the pipeline runs it.
        methods: method specs (``tools.methods.parse_spec``), vanilla first.
        repeats: timed rounds (eager) and timed calls (each compiled mode).
        full_size: a full-size model (refused off CUDA); False only for test rows.
    """

    preset: str
    resolution: int | str
    frames: int | None
    dtype: str
    methods: tuple[str, ...]
    repeats: int = 10
    full_size: bool = True


ROWS = {
    "sd15-512": Row("sd15", 512, None, "float16", _UNET, repeats=15),
    "sd15-1024": Row("sd15", 1024, None, "float16", _UNET),
    "sdxl-1024": Row("sdxl", 1024, None, "float16", _UNET),
    "sdxl-2048": Row("sdxl", 2048, None, "float16", _UNET, repeats=5),
    "pixart-alpha-1024": Row("pixart-alpha-1024", 1024, None, "float16", _DIT),
    "flux1-dev-1024": Row("flux1-dev", 1024, None, "bfloat16", _DIT),
    "flux1-dev-2048": Row("flux1-dev", 2048, None, "bfloat16", _DIT, repeats=5),
    "wan2.1-1.3b-480p": Row("wan2.1-1.3b", "480x832", 81, "bfloat16", _VIDEO, repeats=5),
    "wan2.1-14b-480p": Row("wan2.1-14b", "480x832", 81, "bfloat16", _VIDEO, repeats=3),
    "hunyuan-video-720p": Row("hunyuan-video-13b", "720x1280", 61, "bfloat16", _VIDEO, repeats=3),
}
# a few minutes on an H100: the three kinds of model (a UNet, an image transformer, a video transformer)
QUICK = ("sd15-512", "flux1-dev-1024", "wan2.1-1.3b-480p")

# the table's method columns: (heading, label of the record in a cell)
# (the 2026-11-26 tables, measured when share_plans=False was the default, name share_plans=True explicitly)
COLUMNS = (("ToMe 0.5", "tokenmerge 0.5"), ("ToMe 0.5 plan per block", "tokenmerge 0.5 share_plans=False"),
           ("ToMe 0.5 global", "tokenmerge 0.5 match_radius=None"),
           ("ToMe 0.5 shared", "tokenmerge 0.5 share_plans=True"), ("ToMe 0.5 min_size=0", "tokenmerge 0.5 min_size=0"),
           ("whole-block 0.5", "tokenmerge 0.5 scope=block"),
           ("whole-block 0.5 plan per block", "tokenmerge 0.5 scope=block share_plans=False"),
           ("whole-block 0.5 shared", "tokenmerge 0.5 scope=block share_plans=True"),
           ("ToMe 0.5 Triton", "tokenmerge 0.5 kernels=triton"),
           ("whole-block 0.5 Triton", "tokenmerge 0.5 scope=block kernels=triton"), ("ToDo 2", "todo 2"),
           ("ToDo 2 min_size=0", "todo 2 min_size=0"), ("ToDo 2x2x2", "todo 2x2x2"), ("tomesd 0.5", "tomesd 0.5"),
           ("limit 0.5", "limit 0.5"), ("limit 0.5 min_size=0", "limit 0.5 min_size=0"),
           ("limit 0.5 block", "limit 0.5 scope=block"), ("grid-limit 0.5", "grid-limit 0.5"),
           ("todo-limit 2", "todo-limit 2"), ("todo-limit 2 min_size=0", "todo-limit 2 min_size=0"),
           ("todo-limit 2x2x2", "todo-limit 2x2x2"))
_SECTIONS = ((None, "eager"), ("default", "compiled (inductor, default mode)"),
             ("reduce-overhead", "compiled (inductor, mode=\"reduce-overhead\": CUDA graphs)"),
             ("regional", "compiled regionally (the blocks in place, inductor's default mode)"))


def _row_name(r: dict) -> str:
    frames = f" x {r['frames']}" if r.get("frames") else ""
    return f"{r['preset']} {r['resolution']}{frames} ({r.get('dtype', '')})"


def _speed(r: dict, base: dict) -> str:
    if r["status"] != "ok":
        return r["status"]
    ratio = r.get("speedup_vs_compiled") if r.get("compiled") else r.get("speedup")
    if ratio is None:
        return ""
    text = f"{ratio:.2f}x" + (" (graph breaks)" if r.get("fullgraph") is False else "") \
        + (" (CUDA graphs skipped)" if r.get("cudagraph_skips") else "")
    if r.get("limit_share") is not None and r["mode"] not in ("limit", "grid-limit", "todo-limit"):
        text += f" ({r['limit_share'] * 100:.0f}% of {r['limit_label'].split(' compiled')[0]})"
    return text


def _kernels(r: dict, base: dict) -> str:
    from .report import kernels_of

    k = kernels_of(r)
    if r["status"] != "ok" or k is None:
        return r["status"] if r["status"] != "ok" else ""
    ratio = f" ({r['kernels_vs_vanilla']:.2f}x)" if r.get("kernels_vs_vanilla") and r["mode"] != "vanilla" else ""
    syncs = f", {r['syncs_per_call']:g} syncs" if r.get("syncs_per_call") else ""
    return f"{k:,.0f}{ratio}{syncs}"


def _host(r: dict, base: dict) -> str:
    if r["status"] != "ok" or r.get("median_s") is None:
        return r["status"] if r["status"] != "ok" else ""
    text = f"{(r.get('host_median_s') or 0) * 1000:.3g} / {r['median_s'] * 1000:.3g}"
    if r.get("device_busy") is not None:
        text += f", busy {r['device_busy'] * 100:.0f}%"
    return text + (" **LB**" if r.get("launch_bound") else "")


def _memory(r: dict, base: dict) -> str:
    if r["status"] != "ok":
        return r["status"]
    return f"{r['peak_mem_mb'] / 1024:.1f}" if r.get("peak_mem_mb") is not None else ""


_TABLES = (
    ("speed-up over vanilla (compiled: over compiled vanilla of the same mode) and share of the zero-overhead "
     "limit's speed (100%: as fast as the limit)", _speed, "vanilla ms", lambda r: f"{r['median_s'] * 1000:.4g}"),
    ("kernels launched per denoiser call (CUDA: profiler launches; x vanilla's)", _kernels, "vanilla kernels",
     lambda r: _kernels(r, r)),
    ("host time to issue a step / device time (ms); busy: share of the step the GPU ran kernels; **LB**: "
     "launch-bound (the GPU waits for the host)", _host, "vanilla host / device", lambda r: _host(r, r)),
    ("peak memory (GB, CUDA allocator)", _memory, "vanilla GB", lambda r: _memory(r, r)),
)


def summary(records: list[dict], commands: list[str] | None = None, metas: list[dict] | None = None) -> str:
    """The GPU table of ``records`` (annotated step records of one or more runs): per compile section
    (eager, compiled, compiled reduce-overhead), one table per figure (speed-up and share of the limit, kernels
    per call, host / device time, peak memory), one row per cell, one column per method of ``COLUMNS``.

    Args:
        records: step records (``report.annotate`` run on them).
        commands: the commands that made them (listed under the tables).
        metas: their runs' metadata (device, versions), listed once each.
    """
    steps = [r for r in records if r.get("kind", "step") == "step"]
    lines = ["## GPU table: one denoiser step (guidance as the pipeline runs it), full-size models with RANDOM "
             "weights", ""]
    for meta in _unique(metas or []):
        lines.append(f"- Device: {meta.get('device_name')} ({meta.get('device')}); torch {meta.get('torch')}, CUDA "
                     f"{meta.get('cuda')}, triton {meta.get('triton')}, diffusers {meta.get('diffusers')}, tokenmerge "
                     f"{meta.get('tokenmerge')}" + (f", tomesd {meta['tomesd']}" if meta.get("tomesd") else ""))
    for command in dict.fromkeys(commands or []):
        lines.append(f"- Command: `{command}`")
    if metas or commands:
        lines.append("")
    for compile_mode, title in _SECTIONS:
        rows = defaultdict(dict)
        for r in steps:
            if (r.get("compile_mode") or None) == compile_mode and (compile_mode or not r.get("compiled")):
                rows[_row_name(r)][r["label"].split(" compiled")[0]] = r
        if not rows:
            continue
        columns = [(head, label) for head, label in COLUMNS if any(label in cells for cells in rows.values())]
        for caption, fmt, vanilla_head, vanilla_fmt in _TABLES:
            if fmt is _memory and not any(r.get("peak_mem_mb") is not None for c in rows.values() for r in c.values()):
                continue  # measured on CUDA only
            lines += [f"### {title}: {caption}", "",
                      "| model | " + vanilla_head + " | " + " | ".join(h for h, _ in columns) + " |",
                      "|---|---|" + "---|" * len(columns)]
            for name, cells in rows.items():
                base = cells.get("vanilla")
                first = [vanilla_fmt(base) if base and base["status"] == "ok" else (base or {}).get("status", "")]
                lines.append(f"| {name} | " + " | ".join(first + [fmt(cells[label], base) if label in cells else ""
                                                                  for _, label in columns]) + " |")
            lines.append("")
    return "\n".join(lines)


def _unique(metas: list[dict]) -> list[dict]:
    seen, out = set(), []
    for meta in metas:
        key = tuple(meta.get(k) for k in ("device_name", "torch", "cuda", "diffusers", "tokenmerge"))
        if key not in seen:
            seen.add(key)
            out.append(meta)
    return out
