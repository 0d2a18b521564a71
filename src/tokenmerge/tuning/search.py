"""``tokenmerge.tune``: the fastest cache schedule that holds a fidelity target on the user's own model (or the most
faithful one within a speed), searched on some prompts and seeds and verified on others.

How it searches (docs/guides/tune.md): the unpatched references of the calibration items are generated first (the
denoiser's time grid recorded on the way); every schedule of the pool (``pool.py``) is reduced to the steps it
computes on that grid, known on the host; distinct masks only are evaluated, by bisection on the number of computed
steps (up to two masks per count, best first by what the frontiers found), then more masks at the counts just below
the one found (fidelity is not monotonic in the count: which steps are computed matters too). The fastest candidate
that holds the target on the calibration items is verified on the held-out items (prompts and seeds the search
never used); where their mean falls below the target, the next more faithful candidate is searched and verified.
Every generation counts against ``budget``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import statistics
import time
import warnings

import torch

from ..accelerate import attempts, kind_of
from ..api import apply_config, remove_patch
from ..describe import describe_patch
from ..engine.install import patches_of
from ..engine.techniques import StepCacheConfig, UNetCacheConfig
from ..engine.tuned_for import scheduler_words
from .pool import Candidate, candidates
from .runs import Recorder, Runner, call_default, denoiser_site, fidelity
from .tuned import Tuned, fingerprint, stats

__all__ = ["tune", "run_tune", "TuneWarning"]

PER_COUNT, EXPLORE = 2, 2  # masks tried per count in the bisection; more masks at each of the 2 counts below it


class TuneWarning(UserWarning):
    """A tune that could not verify a setting at its target within its budget."""


def _check(target_psnr, speed, prompts, seeds, budget, timing) -> tuple[list, list]:
    if (target_psnr is None) == (speed is None):
        raise ValueError("tokenmerge.tune: give exactly one of target_psnr (dB: the fidelity to hold) and speed (the "
                         f"inverse share of steps computed, e.g. 2.5); got target_psnr={target_psnr!r}, "
                         f"speed={speed!r}")
    for name, value, low in (("target_psnr", target_psnr, 0.0), ("speed", speed, 1.0)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or \
                not value > low:
            what = "a finite number of dB > 0 (e.g. 34)" if name == "target_psnr" else \
                "a finite number > 1 (the steps over the computed ones, e.g. 2.5)"
            raise ValueError(f"tokenmerge.tune: {name} must be {what}; got {value!r}")
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts or \
            not all(isinstance(p, str) and p or isinstance(p, dict) and p for p in prompts):
        raise ValueError("tokenmerge.tune: prompts must be a list of non-empty strings (or, for a pipeline without a "
                         "text encoder, of dicts of the call's arguments per prompt, e.g. prompt_embeds); got "
                         f"{str(prompts)[:100]!r}")
    seeds = list(seeds) if isinstance(seeds, (list, tuple, range)) else seeds
    if not isinstance(seeds, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"tokenmerge.tune: seeds must be a list of integers; got {seeds!r}")
    if len(prompts) < 2 or len(set(seeds)) < 2:
        raise ValueError(f"tokenmerge.tune: needs at least 2 prompts and 2 seeds, to hold some of each out of the "
                         f"search and verify on them; got {len(prompts)} prompts and {len(set(seeds))} seeds")
    for name, value, low in (("budget", budget, 8), ("timing", timing, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"tokenmerge.tune: {name} must be an integer >= {low}; got {value!r}")
    return list(prompts), list(dict.fromkeys(seeds))


def _base(pipe, site):
    """The cache config ``accelerate`` would take for the model, the first it can apply (checked, then removed), as
    ``(config class, its fields, "transformer" or "unet")``; ``ValueError`` where no cache can patch it."""
    kind, refusals = kind_of(pipe), []
    for config, _ in attempts(kind, "balanced"):
        if not isinstance(config, (StepCacheConfig, UNetCacheConfig)):
            continue
        try:
            apply_config(pipe, config)
        except (ValueError, TypeError) as err:
            refusals.append(str(err))
            continue
        remove_patch(pipe)
        fields = {k: v for k, v in vars(config).items() if k not in ("warmup", "gap", "gap_growth", "skip",
                                                                      "skip_growth", "mask", "by_steps")}
        return type(config), fields, "unet" if kind == "unet" else "transformer"
    name = site.path or type(site.module).__name__ if site is not None else type(pipe).__name__
    raise ValueError(f"tokenmerge.tune: no cache can patch {name}" + (f": {refusals[-1]}" if refusals else ""))


class _Search:
    """The state of one tune: the runner, the items, the references, the pool and the budget."""

    def __init__(self, pipe, runner: Runner, config_class, base: dict, calibration: list, held: list, budget: int,
                 timing: int):
        self.pipe, self.runner, self.config_class, self.base = pipe, runner, config_class, base
        self.calibration, self.held, self.budget, self.timing = calibration, held, budget, timing
        self.refs: dict = {}  # item -> (output, seconds)
        self.pool: list[Candidate] = []
        self.pairs: list = []  # (vanilla seconds, candidate seconds, candidate) run one after the other

    # ---- generations ---------------------------------------------------------------------------------------------
    def reference(self, item) -> torch.Tensor:
        if item not in self.refs:
            self.refs[item] = self.runner(item)
        return self.refs[item][0]

    def verifying(self) -> int:
        """Generations a first verification needs: the held-out references not made yet and the candidate's."""
        return sum(item not in self.refs for item in self.held) + len(self.held)

    def affordable(self, items: int) -> bool:
        """Whether ``items`` more generations leave enough for a verification and the timing."""
        return self.runner.generations + items + self.verifying() + 2 * self.timing <= self.budget

    def config(self, candidate: Candidate):
        return self.config_class(**{**self.base, **candidate.setting})

    def run(self, candidate: Candidate, items: list, into: list, interleave: bool = False) -> None:
        """Generate ``items`` with ``candidate`` applied, their PSNR to the unpatched references appended to
        ``into``; a reference not made yet is made just before (``interleave``: the two timed as a pair)."""
        for item in items:
            fresh = item not in self.refs
            ref = self.reference(item)
            apply_config(self.pipe, self.config(candidate))
            try:
                out, seconds = self.runner(item)
                ran = describe_patch(self.pipe).ran
            finally:
                remove_patch(self.pipe)
            into.append(fidelity(out, ref))
            candidate.seconds.append(seconds)
            if interleave and fresh:
                self.pairs.append((self.refs[item][1], seconds, candidate))
            if ran is not None and ran.get("computed") is not None and ran.get("steps"):
                candidate.ran = round(ran["computed"] * ran["steps"])

    def evaluate(self, candidate: Candidate) -> float:
        if candidate.score is None:
            self.run(candidate, self.calibration, candidate.calibration)
        return candidate.score

    # ---- the search ------------------------------------------------------------------------------------------------
    def by_count(self) -> dict:
        counts: dict = {}
        for c in self.pool:
            counts.setdefault(c.computed, []).append(c)
        return counts

    def fastest_holding(self, required: float, rejected: list) -> Candidate | None:
        """The fewest computed steps whose candidate holds ``required`` dB on the calibration items (bisection on
        the count, then more masks just below it), the most faithful of that count; ``None``: none within budget."""
        groups = self.by_count()
        counts = sorted(groups)
        cost = len(self.calibration)

        def holds_at(k: int):
            for c in groups[k][:PER_COUNT]:
                if c.score is None:
                    if not self.affordable(cost):
                        return None
                    self.evaluate(c)
                if c.score >= required and not any(c is r for r in rejected):
                    return True
            return False

        lo, hi = 0, len(counts)
        while lo < hi:
            mid = (lo + hi) // 2
            found = holds_at(counts[mid])
            if found is None:
                break
            lo, hi = (lo, mid) if found else (mid + 1, hi)
        for k in reversed(counts[max(0, hi - EXPLORE): hi + 1]):  # fidelity is not monotonic in the count
            for c in groups[k][:PER_COUNT + EXPLORE]:
                if c.score is None and self.affordable(cost):
                    self.evaluate(c)
        holding = [c for c in self.pool if c.score is not None and c.score >= required and
                   not any(c is r for r in rejected)]
        return min(holding, key=lambda c: (c.computed, -c.score)) if holding else None

    def most_faithful_within(self, most: int) -> Candidate | None:
        """The candidate of at most ``most`` computed steps with the best calibration PSNR: the masks of the
        largest such counts evaluated first (more computed steps are the more faithful, mostly), best first, as many
        as the budget leaves."""
        cost = len(self.calibration)
        for c in sorted((c for c in self.pool if c.computed <= most), key=lambda c: (-c.computed, c.prior)):
            if not self.affordable(cost):
                break
            self.evaluate(c)
        done = [c for c in self.pool if c.score is not None and c.computed <= most]
        return max(done, key=lambda c: (c.score, -c.computed)) if done else None

    def verify(self, candidate: Candidate) -> float:
        """The candidate's mean PSNR on the held-out items (references made here are timed beside it)."""
        if not candidate.held_out:
            self.run(candidate, self.held, candidate.held_out, interleave=True)
        return statistics.fmean(candidate.held_out)

    def time(self, candidate: Candidate) -> float | None:
        """Vanilla's seconds over the candidate's, medians of ``timing`` more interleaved pairs and of the pairs
        the verification ran."""
        item = self.held[0]
        for _ in range(self.timing):
            _, vanilla = self.runner(item)
            apply_config(self.pipe, self.config(candidate))
            try:
                _, seconds = self.runner(item)
            finally:
                remove_patch(self.pipe)
            self.pairs.append((vanilla, seconds, candidate))
        pairs = [(v, s) for v, s, c in self.pairs if c is candidate]
        if not pairs:
            return None
        return statistics.median(v for v, _ in pairs) / statistics.median(s for _, s in pairs)


def tune(pipe, prompts, *, target_psnr: float | None = None, speed: float | None = None, seeds=(0, 1),
         steps: int | None = None, call_kwargs: dict | None = None, budget: int = 40, timing: int = 1,
         progress: bool = False) -> Tuned:
    """The fastest cache schedule that holds ``target_psnr`` on this model, or the most faithful within ``speed``,
    searched on some prompts and seeds and verified on the others.

    Important args:
        pipe: a diffusers pipeline (or anything its call takes ``prompt``, ``num_inference_steps``, ``generator``),
            unpatched: its outputs are the references.
        prompts: at least 2; the first half (rounded up) are the search's, the rest held out for verification (a
            prompt may be a dict of the call's arguments instead: its embeddings, for a pipeline without a text
            encoder).
        target_psnr: dB of float PSNR to the unpatched output from the same noise (mean over the items), or
        speed: the steps over the computed ones (2.5: at most 40% of the steps computed). Exactly one of the two.

    Args to tinker with:
        seeds: at least 2, split as the prompts (default 0 and 1): the search runs its prompts at its seeds, the
            verification the held-out prompts at the held-out seeds.
        steps, call_kwargs: the generation tuned for (the pipeline's default step count; ``guidance_scale``,
            ``height``, ``width``, ``num_frames``...: the pipeline's defaults where not given).
        budget: generations in all (references, search, verification, timing; default 40).
        timing: more interleaved (vanilla, setting) generations to time the wall speed-up (default 1).
        progress: a progress bar.

    Returns:
        a ``Tuned`` (``.save(path)``; ``tokenmerge.accelerate(pipe, setting=tuned)`` applies it). Where no candidate
        holds the target on the held-out items within the budget, the most faithful one verified, ``holds=False``,
        with a ``TuneWarning``.

    Example:
        >>> tuned = tokenmerge.tune(pipe, prompts, target_psnr=34)   # doctest: +SKIP
        >>> tuned.save("flux-28.json"); tokenmerge.accelerate(pipe, setting=tuned)   # doctest: +SKIP
    """
    return run_tune(pipe, prompts, target_psnr=target_psnr, speed=speed, seeds=seeds, steps=steps,
                    call_kwargs=call_kwargs, budget=budget, timing=timing, progress=progress)[0]


def run_tune(pipe, prompts, *, target_psnr=None, speed=None, seeds=(0, 1), steps=None, call_kwargs=None, budget=40,
             timing=1, progress=False) -> tuple[Tuned, _Search]:
    """``tune``'s work: the ``Tuned`` and the search's state (its references, for points compared beside it)."""
    prompts, seeds = _check(target_psnr, speed, prompts, seeds, budget, timing)
    started = time.perf_counter()
    site = denoiser_site(pipe)
    if patches_of(pipe):
        raise ValueError("tokenmerge.tune: the model is patched by tokenmerge; its references must be the unpatched "
                         "model's: tokenmerge.remove_patch(pipe) first")
    config_class, base, kind = _base(pipe, site)
    steps = steps if steps is not None else call_default(pipe, "num_inference_steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"tokenmerge.tune: steps must be an integer >= 1 (the pipeline's call has no default); got "
                         f"{steps!r}")
    if steps < base["min_steps"]:
        raise ValueError(f"tokenmerge.tune: steps={steps} is fewer than the cache can skip (a generation of fewer than "
                         f"{base['min_steps']} steps, a distilled model's, computes every step)")
    half_p, half_s = (len(prompts) + 1) // 2, (len(seeds) + 1) // 2
    calibration = [(k, s) for k in range(half_p) for s in seeds[:half_s]]  # (prompt's index, seed)
    held = [(k, s) for k in range(half_p, len(prompts)) for s in seeds[half_s:]]
    call_kwargs = dict(call_kwargs or {})
    device = next(site.module.parameters()).device
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=budget, desc="tune", unit="gen")
    search = _Search(pipe, Runner(pipe, prompts, steps, call_kwargs, device, bar), config_class, base, calibration,
                     held, budget, timing)
    if not search.affordable(3 * len(calibration)):  # the references and two candidates
        raise ValueError(f"tokenmerge.tune: budget={budget} generations cannot evaluate two candidates on "
                         f"{len(calibration)} calibration items and verify on {len(held)}: give a larger budget or "
                         "fewer prompts and seeds")
    try:
        with Recorder(site) as seen:
            search.reference(calibration[0])
        if len(seen.progress) < 2:
            raise ValueError(f"tokenmerge.tune: the denoiser's calls told {len(seen.progress)} distinct timesteps in a "
                             f"generation of steps={steps}: no time grid the caches can skip steps of")
        search.pool = candidates(config_class, base, seen.progress, kind)
        if not search.pool:
            raise ValueError(f"tokenmerge.tune: steps={steps}: no schedule skips a step of this grid's "
                             f"{len(seen.progress)}; fewer steps than the cache can skip")
        fewest = search.pool[0].computed
        most = math.floor(len(seen.progress) / speed + 1e-9) if speed is not None else None
        if most is not None and most < fewest:
            raise ValueError(f"tokenmerge.tune: speed={speed:g} asks at most {most} computed steps of "
                             f"{len(seen.progress)}; the fewest any schedule computes on this grid is {fewest} "
                             f"(speed at most {len(seen.progress) / fewest:.2f})")
        for item in calibration:
            search.reference(item)
        chosen, holds = _choose(search, target_psnr, most)
        wall = search.time(chosen) if chosen is not None else None
    finally:
        if bar is not None:
            bar.close()
    tuned = _result(pipe, site, search, chosen, holds, wall, target_psnr, speed, steps, seen, call_kwargs, budget)
    tuned.seconds = round(time.perf_counter() - started, 1)
    return Tuned.from_json(json.loads(json.dumps(tuned.to_json()))), search  # as its file will read back


def _choose(search: _Search, target: float | None, most: int | None) -> tuple[Candidate, bool | None]:
    """The chosen candidate, verified, and whether it holds the target (``None`` for a speed)."""
    if most is not None:
        chosen = search.most_faithful_within(most)
        search.verify(chosen)
        return chosen, None
    required, rejected = target, []
    while True:
        found = search.fastest_holding(required, rejected)
        if found is None or not found.held_out and not search.affordable(0):
            break  # none holds, or no generations left to verify it
        if search.verify(found) >= target:
            return found, True
        rejected.append(found)
        required = max(required, found.score + 0.01)  # the next more faithful: above its calibration PSNR
    verified = [c for c in search.pool if c.held_out]
    if not verified:  # not even the first verification: the slowest evaluated, verified now
        done = [c for c in search.pool if c.score is not None]
        verified = [max(done, key=lambda c: c.computed)] if done else [search.pool[-1]]
        search.verify(verified[0])
    best = max(verified, key=lambda c: statistics.fmean(c.held_out))
    warnings.warn(f"tokenmerge.tune: no setting held target_psnr={target:g} on the held-out items within "
                  f"budget={search.budget} generations; the most faithful verified one is returned ({best.words()}: "
                  f"{statistics.fmean(best.held_out):.2f} dB held out): raise the budget, or lower the target",
                  TuneWarning, stacklevel=3)
    return best, False


def _said(prompts: list, item) -> list:
    """``[prompt, seed]`` of an item as the report gives it (a prompt given as call arguments: their names)."""
    prompt = prompts[item[0]]
    return [prompt if isinstance(prompt, str) else "call arguments: " + ", ".join(sorted(prompt)), item[1]]


def _result(pipe, site, search, chosen, holds, wall, target, speed, steps, seen, call_kwargs, budget) -> Tuned:
    import datetime

    prompts = search.runner.prompts
    from ..version import __version__

    scheduler = getattr(pipe, "scheduler", None)
    guidance = call_kwargs.get("guidance_scale", call_default(pipe, "guidance_scale"))
    output = tuple(search.refs[search.calibration[0]][0].shape)
    config = search.config(chosen)
    fields = dataclasses.asdict(config)
    grid_steps = len(chosen.mask)
    return Tuned(
        technique="UNet cache" if isinstance(config, UNetCacheConfig) else "step cache", config=fields,
        tuned_for={"model": type(site.module).__name__, "fingerprint": fingerprint(site.module),
                   "pipeline": type(pipe).__name__, "scheduler": scheduler_words(scheduler) if scheduler is not None
                   else {"class": "none"}, "steps": steps, "grid_steps": grid_steps,
                   "progress": [round(p, 6) for p in seen.progress], "sample": list(seen.sample or ()),
                   "output": list(output), "guidance": guidance,
                   "call": {k: v for k, v in call_kwargs.items() if isinstance(v, (int, float, str, bool))}},
        target={"psnr": float(target)} if target is not None else {"speed": float(speed)},
        computed=chosen.ran if chosen.ran is not None else chosen.computed,
        step_speedup=round(grid_steps / (chosen.ran or chosen.computed), 3),
        wall_speedup=None if wall is None else round(wall, 3),
        calibration={**stats(chosen.calibration), "items": [_said(prompts, i) for i in search.calibration],
                     "per_item": [round(v, 3) for v in chosen.calibration]} if chosen.calibration else {},
        held_out={**stats(chosen.held_out), "items": [_said(prompts, i) for i in search.held],
                  "per_item": [round(v, 3) for v in chosen.held_out]},
        holds=holds,
        candidates=[{"setting": c.setting, "mask": c.mask, "computed": c.computed,
                     "calibration": None if c.score is None else round(c.score, 3),
                     "held_out": round(statistics.fmean(c.held_out), 3) if c.held_out else None,
                     "chosen": c is chosen} for c in search.pool if c.score is not None or c.held_out],
        generations=search.runner.generations, budget=budget, device=str(next(site.module.parameters()).device),
        tokenmerge=__version__, created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

