"""Generate vanilla and each method's images from identical noise, cache them, and measure fidelity and time.

Work items are (prompt, seed) pairs; inside an item the methods take turns (vanilla, A, B, ...), so timings
drift alike. Under ``accelerate launch`` the items are split across processes; every image lands in the shared
cache, and the main process builds the report from it once all are done.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..measure import timed
from ..tools.methods import MethodSpec
from ..tools.peers import calibrate, computed_share, needs_calibration
from .images import ImageCache
from .metrics import mean_ci, psnr, ssim, to_tensor, video_scores

__all__ = ["QualityJob", "run_job", "VANILLA", "MethodRefused"]

VANILLA = MethodSpec("vanilla")


@dataclass
class QualityJob:
    model_key: str  # "embedded", or the --model path / id: part of every cache key
    prompts: list[str]
    seeds: list[int]
    specs: list[MethodSpec]  # the configurations compared with vanilla
    steps: int
    guidance: float | None = None
    size: int | None = None
    cache: Path = Path("tokenmerge-quality/cache")
    extra_call_kwargs: dict = field(default_factory=dict)
    frames: int = 0  # > 0: each image is a clip's frames side by side (per-frame and temporal scores too)

    @property
    def all_specs(self) -> list[MethodSpec]:
        return [VANILLA] + [s for s in self.specs if s.name != "vanilla"]

    def key(self, spec: MethodSpec, prompt: str, seed: int) -> str:
        text = json.dumps([self.model_key, spec.label, prompt, seed, self.steps, self.guidance, self.size],
                          sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:20]


def _call_kwargs(job: QualityJob, prompt: str, seed: int, device: torch.device, steps: int) -> dict:
    kwargs = dict(job.extra_call_kwargs, num_inference_steps=steps,
                  generator=torch.Generator("cpu").manual_seed(seed))  # CPU noise: the same on every device
    if job.guidance is not None:
        kwargs["guidance_scale"] = job.guidance
    if job.size is not None:
        kwargs["height"] = kwargs["width"] = job.size
    return kwargs


@contextlib.contextmanager
def linear_work(pipe):
    """``with linear_work(pipe) as count:`` ``count[0]`` = the multiply-adds of every ``nn.Linear`` call of the
    pipeline's denoiser inside the block (projections and feed-forwards: the work a cache skips or merged tokens
    shrink; attention's own products and convolutions are not counted). A counter per call, no host sync."""
    model = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    count = [0]

    def hook(module, args, output):
        count[0] += output.numel() * module.in_features

    # first among the module's forward hooks: it counts the rows the layer computed, before a patch's own hook on
    # the layer gives its output back at full size (token reuse's per-token layers)
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    layers = [m for m in modules if isinstance(m, torch.nn.Linear)]
    handles = [m.register_forward_hook(hook, prepend=True) for m in layers]
    try:
        yield count
    finally:
        for handle in handles:
            handle.remove()


class MethodRefused(RuntimeError):
    """A method the model refuses (a combination that cannot be correct, an unsupported family): its spec and
    the library's reason. The images generated before it stay cached."""

    def __init__(self, spec, err: Exception):
        super().__init__(f"--methods {spec.text}: {err}")
        self.spec = spec


def _generate(pipe, job: QualityJob, spec: MethodSpec, prompt: str, seed: int, device, steps: int):
    try:
        with spec.applied(pipe), linear_work(pipe) as work:
            out, seconds = timed(device, lambda: pipe(prompt, **_call_kwargs(job, prompt, seed, device, steps)))
            counted = computed_share(pipe)  # the cache's own count of the steps it computed (cache-dit's), or None
    except (TypeError, ValueError, RuntimeError) as err:
        if not str(err).startswith("tokenmerge"):  # not one of this library's refusals: a bug, with its traceback
            raise
        raise MethodRefused(spec, err) from err
    return out.images[0], seconds, work[0], counted


def generate_items(pipe, job: QualityJob, items: list[tuple[str, int]], device, progress=None, rank: int = 0) -> int:
    """Generate what the cache lacks for ``items``; returns the number of images generated."""
    cache = ImageCache(job.cache)
    job.cache.mkdir(parents=True, exist_ok=True)
    todo = [(p, s, spec) for p, s in items for spec in job.all_specs if cache.load(job.key(spec, p, s)) is None]
    if any(needs_calibration(spec) for _, _, spec in todo):  # MagCache's ratios: from the run's first item
        prompt, seed = items[0]
        calibrate(pipe, lambda: pipe(prompt, **_call_kwargs(job, prompt, seed, device, job.steps)), job.steps)
    # warm-up: one short run per method, untimed, so the first timed image pays no start-up cost; a cache's warning
    # that such a short generation skipped nothing is the warm-up's, not the run's: not shown
    if todo:
        for spec in {t[2] for t in todo}:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", r"tokenmerge: .*fewer than min_steps", RuntimeWarning)
                _generate(pipe, job, spec, todo[0][0], todo[0][1], device, min(job.steps, 2))
    for prompt, seed, spec in todo:
        image, seconds, work, counted = _generate(pipe, job, spec, prompt, seed, device, job.steps)
        cache.store(job.key(spec, prompt, seed), image,
                    {"prompt": prompt, "seed": seed, "label": spec.label, "seconds": seconds, "steps": job.steps,
                     "linear_macs": work, "device": str(device), "process": rank,
                     **({"cache_steps": counted} if counted is not None else {})})
        if progress is not None:
            progress.update(1)
    return len(todo)


def _finite(x: float):
    return x if x == x and abs(x) != float("inf") else str(x)


def collect(job: QualityJob, items: list[tuple[str, int]], extra_metrics=None, scorer=None) -> dict:
    """The report: per-image and per-method PSNR/SSIM against vanilla, and seconds per image; with ``scorer`` (a
    ``distribution.FashionScorer``) each method's FD and prompt adherence too (a message instead: why they are
    missing)."""
    cache = ImageCache(job.cache)

    def entry(spec, prompt, seed):
        key = job.key(spec, prompt, seed)
        found = cache.load(key)
        if found is None:  # removed or damaged since it was generated (by another process, or by hand)
            raise RuntimeError(f"the cache entry {cache.image_path(key)} ({spec.label}, seed {seed}) is missing or "
                               "damaged after generation; run the command again to regenerate it")
        return key, found[0], found[1]

    video = ("frame_psnr", "ssim", "temporal_psnr") if job.frames else ()
    rows, per_spec = [], {s.label: {"psnr": [], "ssim": [], "seconds": [], "frame_psnr": [], "temporal_psnr": [],
                                    "work": [], "computed": []} for s in job.all_specs}
    images: dict[str, list] = {s.label: [] for s in job.all_specs}
    for prompt, seed in items:
        _, ref, ref_meta = entry(VANILLA, prompt, seed)
        ref = to_tensor(ref)
        for spec in job.all_specs:
            key, img, meta = entry(spec, prompt, seed)
            x = to_tensor(img)
            scores = {"psnr": float(psnr(x, ref))}
            if video:  # SSIM per frame (its window must not straddle two frames of the strip)
                scores.update(zip(video, video_scores(x, ref, job.frames)))
            else:
                scores["ssim"] = float(ssim(x, ref))
            images[spec.label].append(img)
            stats = per_spec[spec.label]
            for name, value in scores.items():
                stats[name].append(value)
            stats["seconds"].append(meta["seconds"])
            if meta.get("linear_macs") and ref_meta.get("linear_macs"):  # entries cached before it was counted: none
                stats["work"].append(meta["linear_macs"] / ref_meta["linear_macs"])
            if meta.get("cache_steps"):  # the share of steps the cache computed, by its own count
                stats["computed"].append(meta["cache_steps"]["computed"])
            rows.append({"prompt": prompt, "seed": seed, "label": spec.label,
                         **{k: _finite(v) for k, v in scores.items()}, "seconds": meta["seconds"],
                         "process": meta.get("process", 0), "image": str(cache.image_path(key))})
    base = statistics.median(per_spec[VANILLA.label]["seconds"])
    summary = []
    for spec in job.all_specs:
        stats = per_spec[spec.label]
        pm, pci = mean_ci(stats["psnr"])
        sm, sci = mean_ci(stats["ssim"])
        sec = statistics.median(stats["seconds"])
        summary.append({"label": spec.label, "spec": spec.text, "n": len(stats["psnr"]), "psnr_mean": _finite(pm),
                        "psnr_ci95": _finite(pci), "ssim_mean": sm, "ssim_ci95": _finite(sci),
                        "seconds_median": sec, "speedup": base / sec,
                        "linear_work": statistics.mean(stats["work"]) if len(stats["work"]) == len(stats["psnr"])
                        else None, "steps_computed": statistics.mean(stats["computed"])
                        if len(stats["computed"]) == len(stats["psnr"]) else None})
        for name in video[::2]:  # frame_psnr, temporal_psnr
            mean, half = mean_ci(stats[name])
            summary[-1].update({f"{name}_mean": _finite(mean), f"{name}_ci95": _finite(half)})
    distribution, scores = (scorer if isinstance(scorer, str) else None), None
    if scorer is not None and not isinstance(scorer, str):
        try:
            scores = scorer.score([p for p, _ in items], images)
        except ValueError as err:  # a prompt the classifier's labels cannot be read from
            distribution = f"skipped: {str(err)[:300]}"
    if scores is not None:
        distribution = {"crops": scorer.layout, "per_method": len(scores[VANILLA.label]["per_image"]) *
                        {"image": 1, "mosaic": 4, "frames": scorer.frames}[scorer.layout]}
        for entry in summary:
            got = scores[entry["label"]]
            entry.update({"fd": got["fd"], "fd_vanilla": got.get("fd_vanilla"), "adherence": got["adherence"],
                          "adherence_ci95": _finite(got["adherence_ci95"])})
        position = {(p, s): i for i, (p, s) in enumerate(items)}
        for row in rows:
            row["adherence"] = scores[row["label"]]["per_image"][position[(row["prompt"], row["seed"])]]
    report = {"model": job.model_key, "steps": job.steps, "guidance": job.guidance, "size": job.size,
              "frames": job.frames,
              "prompts": len({p for p, _ in items}), "seeds": sorted({s for _, s in items}),
              "methods": summary, "images": rows}
    if distribution is not None:
        report["distribution"] = distribution
    if extra_metrics is not None:
        report["extra"] = extra_metrics(job, items, images)
    return report


def run_job(pipe, job: QualityJob, device, progress=True, extra_metrics=None, scorer="auto") -> dict | None:
    """Generate (split across processes under accelerate) and, on the main process, return the report.

    ``scorer``: ``"auto"`` (default) scores the embedded Fashion-MNIST models' images by the shipped classifier (FD
    and prompt adherence, ``distribution.scorer_for``) and no other pipeline's; None: no such scores."""
    from tqdm.auto import tqdm

    items = [(p, s) for p in job.prompts for s in job.seeds]
    state = _distributed_state(device)
    mine = items if state is None else items[state.process_index::state.num_processes]
    main = state is None or state.is_main_process
    bar = tqdm(total=len(mine) * len(job.all_specs), desc="quality", disable=not (progress and main), unit="img")
    made = generate_items(pipe, job, mine, device, bar, 0 if state is None else state.process_index)
    bar.close()
    if state is not None:
        state.wait_for_everyone()
    if not main:
        return None
    if scorer == "auto":
        from .distribution import scorer_for

        scorer = scorer_for(pipe)
    report = collect(job, items, extra_metrics, scorer)
    report["generated"] = made if state is None else None
    report["processes"] = 1 if state is None else state.num_processes
    return report


def _distributed_state(device: torch.device):
    """accelerate's process state when launched with several processes (``accelerate launch``, ``torchrun``),
    else None. On a CPU, accelerate joins the processes only when told ``cpu=True``."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    return PartialState(cpu=device.type == "cpu")
