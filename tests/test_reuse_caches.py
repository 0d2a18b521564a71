"""Token reuse composed with diffusers' caches that skip: First Block Cache (threshold above 0), MagCache and
TaylorSeer on whole blocks, both orders of enabling, checked against a reference computed step by step.

What a skipped step does (docs/guides/reuse.md): the cache's hook sits above token reuse's on each block, so a
block the cache skips or predicts runs none of token reuse's hooks, and its kept residual stays as it was; the step
still moves token reuse's clock (the denoiser's own hook runs), but a step cut short (a block that did not run) does
not move its round-robin: the next partial step recomputes the same tokens. The reference follows each block through
the run: where the block ran, a full step's output is the unpatched block's, a partial step's recomputed tokens are
the unpatched block's and the others are their input plus the kept residual (the reference's own copy, updated where
the block ran: ``spread=0``).
"""

from __future__ import annotations

import collections

import pytest
import torch
from tiny_denoisers import CATALOGUE, available
from tiny_models import later_step

import tokenmerge
from tokenmerge.engine.call import image_part, sides
from tokenmerge.merge.recompute import select

pytestmark = pytest.mark.usefixtures("fast_cpu")
STEPS = 8


def _config(name):
    hooks = pytest.importorskip("diffusers.hooks", reason="this diffusers has no cache hooks (diffusers.hooks)")
    if name == "fbc":
        return hooks.FirstBlockCacheConfig(threshold=0.6)
    if name == "magcache":
        if not hasattr(hooks, "MagCacheConfig"):
            pytest.skip("this diffusers has no MagCache")
        return hooks.MagCacheConfig(threshold=0.9, max_skip_steps=2, retention_ratio=0.0, num_inference_steps=STEPS,
                                    mag_ratios=[1.0] * STEPS)
    if not hasattr(hooks, "TaylorSeerCacheConfig"):
        pytest.skip("this diffusers has no TaylorSeer cache")
    blocks = [r"transformer_blocks\.\d+", r"single_transformer_blocks\.\d+"]  # whole blocks (inside one: refused)
    return hooks.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, cache_identifiers=blocks,
                                       taylor_factors_dtype=torch.float32)


def _record(model, log):
    """Per block call that reaches token reuse's hooks (below the cache's, in the block's hook chain): its input, the
    output token reuse gives back, the call's recomputed tokens. A block the cache skips leaves no record."""
    for i, block in enumerate([*model.transformer_blocks, *model.single_transformer_blocks]):
        chained = block._diffusers_hook.hooks["tokenmerge_chain_hook"]  # every block carries the cache's hook
        pre, post = chained.pre, chained.post

        def seen_pre(module, args, kwargs, i=i, pre=pre):
            state = model._tokenmerge_patch.calls.state
            log.append({"block": i, "args": args, "kwargs": dict(kwargs), "partial": state.work.partial,
                        "index": state.work.levels[0][1], "step": state.clock.step})
            return pre(module, args, kwargs)

        def seen_post(module, args, output, i=i, post=post):
            changed = post(module, args, output)
            log[-1]["out"] = output if changed is None else changed
            return changed

        chained.pre, chained.post = seen_pre, seen_post


@pytest.mark.parametrize("cache_first", [False, True])
@pytest.mark.parametrize("cache", ["fbc", "magcache", "taylorseer"])
def test_reuse_with_a_skipping_cache_follows_its_reference_step_by_step(cache, cache_first):
    if available("flux") is not None:
        pytest.skip(available("flux"))
    config = _config(cache)
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = [entry.inputs(batch=2)]
    for _ in range(STEPS - 1):
        calls.append(later_step(model, calls[-1], 0.9))
    if cache_first:
        model.enable_cache(config)
        tokenmerge.apply_reuse(model, 0.5, warmup=1, spread=0.0)
    else:
        tokenmerge.apply_reuse(model, 0.5, warmup=1, spread=0.0)
        model.enable_cache(config)
    patch = model._tokenmerge_patch
    sites = patch.blocks
    log, steps = [], []
    _record(model, log)
    try:
        with torch.no_grad(), model.cache_context("predict"):
            for c in calls:
                model(**c)
                steps.append(patch.calls.state.clock.step)
    finally:
        model.disable_cache()
        tokenmerge.remove_patch(model)
    assert steps == list(range(STEPS))  # every call a step of the clock, skipped or not
    assert len(sites) * STEPS > len(log) > len(sites), "the cache must skip some block calls, not all"
    # the clock: each call's recomputed tokens are the round-robin's next window; a step the cache cut short (not
    # every block ran) recomputed its tokens in too few blocks, so the next step takes the same window again
    n, seed = calls[0]["hidden_states"].shape[1], patch.config.effective_seed
    ran = collections.Counter(e["step"] for e in log)
    window, short = {}, 0
    for step in range(1, STEPS):
        window[step] = step - 1 - short
        short += ran[step] < len(sites)
    assert short, "the cache must cut some partial steps short"
    for e in log:
        if e["step"] == 0:
            assert e["index"] is None
        else:
            assert torch.equal(e["index"], select((4, 4), "grid", n // 2, seed, window[e["step"]] * (n // 2), "cpu"))
    assert len({e["step"] for e in log}) > 2  # partial steps after skipped ones among them
    kept = {}
    checked = 0
    for e in log:
        site = sites[e["block"]]
        with torch.no_grad():
            want = site.module(*e["args"], **e["kwargs"])  # the unpatched block on the same input
        got = e["out"]
        at = site.whole.output
        got, want = (got, want) if isinstance(got, torch.Tensor) else (got[at], want[at])
        x = e["kwargs"].get("hidden_states", e["args"][0] if e["args"] else None)
        before = sides(x.shape[1], n, site.text)[0]
        x, got, want = (image_part(t, n, before) for t in (x, got, want))
        if not e["partial"] or e["block"] not in kept:  # a full step (or a block's first run): every token computed
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        else:
            index = e["index"]
            others = torch.ones(n, dtype=torch.bool)
            others[index] = False
            torch.testing.assert_close(got[:, index], want[:, index], rtol=1e-4, atol=1e-5)
            assert torch.equal(got[:, others], (x + kept[e["block"]])[:, others])
            checked += 1
        kept[e["block"]] = got - x
    assert checked, "no partial block call was checked"


def _progress(patch):
    """A copy of each image token's recorded progress in the call branch's kept state (``None`` before any)."""
    kept = list(patch.calls.state.clock.kept.values())
    when = kept[0].when.get(0) if kept else None
    return None if when is None else when.clone()


@pytest.mark.parametrize("cache", ["fbc", "magcache"])
def test_a_step_the_cache_cuts_short_leaves_the_tokens_progress(cache):
    """extrapolate=: a step where not every block ran leaves each token's recorded progress (its kept rows' gaps run
    from where they were computed) and the round-robin; a step where every block ran moves the recomputed tokens'."""
    if available("flux") is not None:
        pytest.skip(available("flux"))
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = [entry.inputs(batch=2)]
    for _ in range(STEPS - 1):
        calls.append(later_step(model, calls[-1], 0.9))
    tokenmerge.apply_reuse(model, 0.5, warmup=1, keys="kept", extrapolate=1.0)
    config = _config(cache)
    if cache == "fbc":  # (the extrapolated first block changes less from step to step)
        config.threshold = 0.19
    model.enable_cache(config)
    patch = model._tokenmerge_patch
    ran = collections.Counter()
    _record(model, log := [])
    moved = []
    try:
        with torch.no_grad(), model.cache_context("predict"):
            for c in calls:
                before = _progress(patch)
                model(**c)
                step = patch.calls.state.clock.step
                ran[step] = sum(e["step"] == step for e in log)
                moved.append((step, before, _progress(patch)))
    finally:
        model.disable_cache()
        tokenmerge.remove_patch(model)
    short = [(s, b, a) for s, b, a in moved if b is not None and ran[s] < len(patch.blocks)]
    whole = [(s, b, a) for s, b, a in moved if b is not None and ran[s] == len(patch.blocks)]
    assert short and whole, f"the cache must cut some steps short and leave others whole: {ran}"
    for _, b, a in short:
        assert torch.equal(a, b)
    for _, b, a in whole:
        assert not torch.equal(a, b)
