"""Token reuse (``apply_reuse``): the property it promises on every family it accepts, its refusals elsewhere,
exactness of full steps and of removal, steps and branches told apart by the timestep, the order of recomputed
tokens, diffusers' caches beside it, and the command line's spec, bench and frontier for it.

The property (checked against the unpatched block on the very same input): at a partial step, a patched block's
recomputed tokens leave it exactly as the unpatched block computes them (they attend to fresh keys and values of
every token), and every other token leaves it as its input plus the block residual cached for it."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from tiny_denoisers import CATALOGUE, compiled_twice
from tiny_denoisers import outputs_of as _run
from tiny_denoisers import skip_unavailable as _skip
from tiny_models import later_step

import tokenmerge
from tokenmerge.config import ReuseConfig
from tokenmerge.engine.call import image_part, sides
from tokenmerge.families import BUILTIN
from tokenmerge.merge.recompute import select

pytestmark = pytest.mark.usefixtures("fast_cpu")

# every catalogue entry a built-in family matches
ENTRIES = sorted({example for f in BUILTIN for example in f.examples} & set(CATALOGUE))
# entries token reuse refuses at apply time, each with a word of its reason: no declared layout of the block's output
# (scope="block" is not declared), a family-wide refusal
LAYOUT = "image tokens"
REFUSED = {name: LAYOUT for name in (
    "sana", "sana-sprint", "sana-controlnet", "sana-video", "hidream", "hunyuan-video-1.5", "hunyuan-video-1.5-i2v",
    "ltx2", "allegro", "easyanimate", "cosmos", "cosmos-v2w", "cosmos-predict2", "hunyuan-dit",
    "hunyuan-dit-controlnet", "qwen-image-2.1", "cogview3plus", "cogview4", "aura-flow", "hunyuan-image-2.1", "prx",
    "nucleus-moe-image", "kandinsky5", "krea2", "glm-image", "joyimage-edit", "joyimage-edit-plus", "ernie-image",
    "flux3", "flux3-ref")}
# entries whose attention cannot give back only some tokens' rows: keys="fresh" is refused (with a word of the
# reason), keys="kept" (the whole block on the recomputed tokens) runs
FRESH_REFUSED = {"flux2": "fused", "flux2-klein": "fused", "flux2-klein-ref": "fused", "mochi": "splits",
                 "omnigen": "reshapes", "sd3": "splits", "sd3.5": "splits", "sd3-controlnet": "splits"}


def _kept(patch):
    """The kept tensors of the one branch a run of plain calls fills (the clock's ``kept``: token reuse's by branch)."""
    kept = list(patch.calls.state.clock.kept.values())
    assert len(kept) == 1, kept
    return kept[0]


def _now(patch):
    """This call's recomputed tokens per level: ``(tokens, recomputed or None, grid)``."""
    return patch.calls.state.work.levels


def _steps(model, inputs, n):
    calls = [inputs]
    for _ in range(n - 1):
        calls.append(later_step(model, calls[-1]))
    return calls


@pytest.mark.parametrize("name", ENTRIES)
def test_every_family_keeps_the_recomputed_tokens_exact_and_the_others_cached(name):
    _skip(name)
    entry = CATALOGUE[name]
    model = entry.build()
    refused = REFUSED.get(name) or FRESH_REFUSED.get(name)
    if refused is not None:
        with pytest.raises((ValueError, TypeError), match=refused):
            tokenmerge.apply_reuse(model, 0.5, warmup=1)
        assert tokenmerge.describe_patch(model) is None  # nothing left installed
        return
    calls = _steps(model, entry.inputs(batch=2), 2)
    tokenmerge.apply_reuse(model, 0.5, warmup=1, blocks=[-1], spread=0.0)
    patch = model._tokenmerge_patch
    site = patch.blocks[0]
    seen = {}

    def grab(module, args, kwargs):  # before the patch's own hook: the block's plain input
        seen["args"], seen["kwargs"] = args, dict(kwargs)
        seen["image"], seen["index"], _ = _now(patch)[site.level]
        seen["trailing"] = patch.calls.state.trailing

    handles = [site.module.register_forward_pre_hook(grab, with_kwargs=True, prepend=True),
               site.module.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out))]
    with torch.no_grad():
        model(**calls[0])  # a full step: fills the cache
        cache = _kept(patch).residual[0].clone()
        model(**calls[1])  # a partial step
    for handle in handles:
        handle.remove()
    tokenmerge.remove_patch(model)
    with torch.no_grad():
        expected = site.module(*seen["args"], **seen["kwargs"])  # the unpatched block on the same input
    n, index, trailing = seen["image"], seen["index"], seen["trailing"]
    assert index is not None and 0 < len(index) < n
    where = site.whole.output
    got = seen["out"] if isinstance(seen["out"], torch.Tensor) else seen["out"][where]
    want = expected if isinstance(expected, torch.Tensor) else expected[where]
    before, after = sides(got.shape[1], n, site.text, trailing)
    x = seen["kwargs"].get("hidden_states", seen["kwargs"].get("x", seen["args"][0] if seen["args"] else None))
    x = image_part(x, n, sides(x.shape[1], n, site.text, trailing)[0])
    others = torch.ones(n, dtype=torch.bool)
    others[index] = False
    got_image, want_image = image_part(got, n, before), image_part(want, n, before)
    torch.testing.assert_close(got_image[:, index], want_image[:, index], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_image[:, others], (x + cache)[:, others], rtol=0, atol=0)
    assert not torch.allclose(got_image[:, others], want_image[:, others])  # they are really reused
    if before or after:  # text or reference rows beside the image: as computed
        rest = torch.cat([got[:, :before], got[:, got.shape[1] - after:]], 1)
        torch.testing.assert_close(rest, torch.cat([want[:, :before], want[:, want.shape[1] - after:]], 1),
                                   rtol=1e-4, atol=1e-5)
    if not isinstance(expected, torch.Tensor):  # the other streams (text) too
        for i, (a, b) in enumerate(zip(seen["out"], expected)):
            if i != where and isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_spread_gives_the_others_their_recomputed_neighbours_mean_change(name):
    """``spread``: each token not recomputed gets ``spread`` x the mean, over the recomputed tokens of its 3x3 (video:
    3x3x3) neighbourhood, of their residual's change since they were last computed (checked by a loop over the
    grid, apart from the library's pooling)."""
    _skip(name)
    entry = CATALOGUE[name]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 2)
    runs, seen = {}, []
    for spread in (0.0, 0.5):
        tokenmerge.apply_reuse(model, 0.5, warmup=1, blocks=[-1], spread=spread)
        patch = model._tokenmerge_patch
        hook = patch.blocks[0].module.register_forward_pre_hook(lambda m, a: seen.append(_now(patch)[0]))
        with torch.no_grad():
            model(**calls[0])
            before = _kept(patch).residual[0].clone()
            model(**calls[1])
            runs[spread] = _kept(patch).residual[0].clone()
        hook.remove()
        tokenmerge.remove_patch(model)
    _, chosen, grid = seen[-1]
    change = runs[0.0] - before  # nonzero on the recomputed tokens only
    coords = list(torch.cartesian_prod(*[torch.arange(g) for g in grid]).reshape(-1, len(grid)).tolist())
    picked = set(chosen.tolist())
    expected = runs[0.0].clone()
    for i, c in enumerate(coords):
        if i in picked:
            continue
        near = [j for j, d in enumerate(coords) if j in picked and max(abs(a - b) for a, b in zip(c, d)) <= 1]
        if near:
            expected[:, i] += 0.5 * change[:, near].mean(1)
    torch.testing.assert_close(runs[0.5], expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(runs[0.5], runs[0.0])


def test_spread_weights_are_made_once_per_recomputed_set(monkeypatch):
    """Which tokens get how much of their neighbours' change depends on the recomputed tokens and the grid only: made
    once per recomputed set (a table, a handful of kernels), not in every block nor at every step; every block still
    spreads."""
    from tokenmerge.engine.techniques.reuse import block as reuse

    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 5)
    made, spread = [], []
    real_weights, real_spread = reuse.spread_weights, reuse.spread
    monkeypatch.setattr(reuse, "spread_weights", lambda *a: made.append(1) or real_weights(*a))
    monkeypatch.setattr(reuse, "spread", lambda *a: spread.append(1) or real_spread(*a))
    tokenmerge.apply_reuse(model, 0.5, warmup=1)
    blocks = len(model._tokenmerge_patch.blocks)
    _run(model, calls)
    # four partial calls, two recomputed sets (half the tokens each: the round-robin comes back after two)
    assert blocks > 1 and len(made) == 2 and len(spread) == 4 * blocks


@pytest.mark.parametrize("name", ["flux", "wan", "pixart", "hunyuan-video", "qwen-image", "unet-sdxl"])
def test_full_steps_are_exact_partial_steps_change_and_removal_is_bit_identical(name):
    _skip(name)
    entry = CATALOGUE[name]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 4)
    vanilla = _run(model, calls)
    tokenmerge.apply_reuse(model, 0.5, warmup=2)
    reused = _run(model, calls)
    for k in (0, 1):  # the warm-up: every token computed
        assert torch.equal(reused[k], vanilla[k])
    for k in (2, 3):  # partial steps: finite, and not vanilla
        assert torch.isfinite(reused[k]).all()
        assert not torch.allclose(reused[k], vanilla[k])
    tokenmerge.remove_patch(model)
    assert tokenmerge.describe_patch(model) is None
    for got, want in zip(_run(model, calls), vanilla):
        assert torch.equal(got, want)


def test_fraction_one_recomputes_every_token_exactly():
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 3)
    vanilla = _run(model, calls)
    tokenmerge.apply_reuse(model, 1.0, warmup=1)
    for got, want in zip(_run(model, calls), vanilla):
        assert torch.equal(got, want)


def test_guidance_branches_keep_their_own_caches_and_a_new_generation_starts_over():
    _skip("wan")
    entry = CATALOGUE["wan"]
    model = entry.build()
    cond = entry.inputs(batch=1, seed=0)
    uncond = dict(cond, encoder_hidden_states=torch.randn_like(cond["encoder_hidden_states"]))
    steps = 3
    conds, unconds = _steps(model, cond, steps), _steps(model, uncond, steps)
    tokenmerge.apply_reuse(model, 0.5, warmup=1)
    with torch.no_grad():  # guidance as two calls per step: cond, then uncond, with the same timestep
        both = [model(**c).sample.flatten() for k in range(steps) for c in (conds[k], unconds[k])]
        alone = [model(**u).sample.flatten() for u in unconds]  # the uncond branch as a generation of its own
    tokenmerge.remove_patch(model)
    vanilla = _run(model, unconds)
    for k in range(steps):
        assert torch.equal(both[2 * k + 1], alone[k])  # the cond call's cache never reached the uncond's
    assert torch.equal(alone[0], vanilla[0])  # the second generation started over with a full step
    assert not torch.equal(alone[2], vanilla[2])


@pytest.mark.parametrize("order", ["strided", "grid", "random"])
@pytest.mark.parametrize("grid,count", [((8, 8), 16), ((8, 8), 32), ((4, 6, 6), 36), ((5, 7), 7)])
def test_each_order_recomputes_every_token_once_a_round(order, grid, count):
    n = math.prod(grid)
    rounds = n // count
    picked = torch.cat([select(grid, order, count, 0, k * count, "cpu") for k in range(rounds)])
    assert sorted(picked.tolist()) == list(range(n))  # a round of partial steps covers the image once
    first = select(grid, order, count, 0, 0, "cpu")
    assert len(first) == count and torch.equal(first, first.sort().values)
    assert not torch.equal(first, select(grid, order, count, 0, count, "cpu"))  # it moves


def test_grid_order_spreads_each_step_over_the_image():
    first = select((8, 8), "grid", 16, 0, 0, "cpu")  # a quarter: one token of every 2x2 window
    windows = {(int(i) // 8 // 2, int(i) % 8 // 2) for i in first}
    assert len(windows) == 16


def test_a_ramp_recomputes_more_tokens_early():
    cfg = ReuseConfig(0.6, warmup=2, fraction_end=0.2)
    schedule = cfg.schedule(10)
    assert schedule[:2] == [None, None] and schedule[2] == pytest.approx(0.6)
    assert schedule[-1] == pytest.approx(0.2 + 0.4 * (1 - 0.9) / 0.8)
    assert all(a > b for a, b in zip(schedule[2:], schedule[3:]))
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 4)
    tokenmerge.apply_reuse(model, 0.75, warmup=1, fraction_end=0.25)
    counts = []
    block = model.transformer_blocks[0]
    hook = block.register_forward_pre_hook(lambda m, a: counts.append(_now(model._tokenmerge_patch)[0][1]))
    _run(model, calls)
    hook.remove()
    sizes = [len(c) for c in counts if c is not None]
    assert len(sizes) == 3 and sizes[0] > sizes[1] > sizes[2]


@pytest.mark.parametrize("kwargs,words", [
    (dict(fraction=0), "fraction"), (dict(fraction=1.5), "fraction"), (dict(warmup=0), "warmup"),
    (dict(every=-1), "every"), (dict(order="spiral"), "order"), (dict(fraction_end=0), "fraction_end"),
    (dict(blocks=[]), "blocks"), (dict(seed=1.5), "seed")])
def test_bad_settings_are_refused(kwargs, words):
    _skip("flux")
    model = CATALOGUE["flux"].build()
    with pytest.raises(ValueError, match=words):
        tokenmerge.apply_reuse(model, **kwargs)
    assert tokenmerge.describe_patch(model) is None


def test_fullgraph_compile_is_refused_with_the_reason():
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    tokenmerge.apply_reuse(model, 0.5, warmup=1)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    try:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="token reuse .* without fullgraph=True"):
            with torch.no_grad():
                compiled(**entry.inputs(batch=2))
    finally:
        tokenmerge.remove_patch(model)
        torch.compiler.reset()


@pytest.mark.compile
@pytest.mark.parametrize("name,kwargs", [("flux", {}), pytest.param("wan", {}, marks=pytest.mark.slow),
                                         pytest.param("flux", dict(keys="kept", text=True), marks=pytest.mark.slow),
                                         pytest.param("flux", dict(keys="kept", text=True, extrapolate=1.0),
                                                      marks=pytest.mark.slow),
                                         pytest.param("wan", dict(extrapolate=0.5), marks=pytest.mark.slow)])
def test_compiled_reuse_gives_the_eager_outputs_with_one_break_per_call(name, kwargs):
    """torch.compile (without fullgraph): the step decision runs on the host (the denoiser's hooks: a graph break at
    each end of the call, and no other), the blocks' full and partial calls compile once, and a second generation
    compiles nothing more."""
    _skip(name)
    entry = CATALOGUE[name]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 6)
    vanilla = _run(model, calls)
    tokenmerge.apply_reuse(model, 0.5, warmup=2, **kwargs)
    eager = _run(model, calls)
    try:
        got, again, breaks = compiled_twice(model, calls)
    finally:
        tokenmerge.remove_patch(model)
        torch.compiler.reset()
    # two breaks in all: the denoiser's pre-hook and hook, each run on the host (full and partial calls alike)
    assert sum(breaks.values()) == 2 and all("on the host" in reason for reason in breaks), breaks
    assert sorted("CallHook.pre" in r for r in breaks) == [False, True], breaks
    for run in (got, again):
        for a, b in zip(run, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(eager[-1], vanilla[-1]), "the reuse acted"


def test_attention_cache_is_refused_and_block_cache_runs_outside_the_reuse():
    pytest.importorskip("diffusers.hooks", reason="this diffusers has no cache hooks (diffusers.hooks)")
    from diffusers.hooks import FirstBlockCacheConfig, PyramidAttentionBroadcastConfig

    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    tokenmerge.apply_reuse(model, 0.5, warmup=1)
    with pytest.raises(ValueError, match="token reuse"):  # on the attention modules inside the blocks
        model.enable_cache(PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                                           current_timestep_callback=lambda: 500))
    tokenmerge.remove_patch(model)
    model.disable_cache() if getattr(model, "is_cache_enabled", False) else None
    calls = _steps(model, entry.inputs(batch=2), 3)
    for cache_first in (False, True):  # both orders
        if cache_first:
            model.enable_cache(FirstBlockCacheConfig(threshold=0.0))  # 0: never skips, every block computed
            tokenmerge.apply_reuse(model, 0.5, warmup=1)
        else:
            tokenmerge.apply_reuse(model, 0.5, warmup=1)
            model.enable_cache(FirstBlockCacheConfig(threshold=0.0))
        registry = model.transformer_blocks[0]._diffusers_hook
        order = list(registry._hook_order)
        assert order.index("tokenmerge_chain_hook") < order.index("fbc_leader_block_hook")  # reuse inside
        with model.cache_context("predict"):
            with_cache = _run(model, calls)
        model.disable_cache()
        tokenmerge.remove_patch(model)
        tokenmerge.apply_reuse(model, 0.5, warmup=1)
        alone = _run(model, calls)
        tokenmerge.remove_patch(model)
        for a, b in zip(with_cache, alone):  # a cache that skips nothing changes nothing
            assert torch.equal(a, b)


def test_describe_patched_and_the_method_spec():
    from tokenmerge.tools.methods import parse_spec

    _skip("wan")
    entry = CATALOGUE["wan"]
    model = entry.build()
    tokenmerge.apply_patch(model, 0.5)
    with tokenmerge.patched(model, 0.35, method="reuse", warmup=3):
        info = tokenmerge.describe_patch(model)
        text = str(info)
        assert isinstance(info.config, ReuseConfig) and "token reuse: fraction=0.35" in text and "warmup=3" in text
        assert any("keeps one tensor" in note for note in info.notes)
    assert isinstance(tokenmerge.describe_patch(model).config, tokenmerge.ToMeConfig)  # the ToMe patch is back
    tokenmerge.remove_patch(model)
    spec = parse_spec("reuse:0.35,warmup=3,order=grid,fraction_end=0.2")
    assert spec.stateful and spec.steady().text == "reuse:0.35"
    assert spec.reuse_config() == ReuseConfig(0.35, warmup=3, order="grid", fraction_end=0.2)
    with spec.applied(model):
        assert tokenmerge.describe_patch(model).config.order == "grid"
    assert tokenmerge.describe_patch(model) is None
    with pytest.raises(ValueError, match="fraction"):
        parse_spec("reuse:0")
    assert parse_spec("reuse:0.5+fbc:0.1").name == "reuse+fbc"
    # block indices of any count (a factor per axis takes 2 or 3), and the text stream's reuse
    assert parse_spec("reuse:0.4,blocks=(1,2,3,4,5)").reuse_config().blocks == (1, 2, 3, 4, 5)
    assert parse_spec("reuse:0.4,blocks=[0,]").reuse_config().blocks == (0,)
    assert parse_spec("reuse:0.4,keys=kept,text=true").reuse_config().text is True


def test_the_bench_times_a_full_and_a_partial_step(tmp_path):
    import json

    from tokenmerge.cli import main

    _skip("wan")
    out = tmp_path / "res"
    assert main(["bench", "--preset", "tiny-wan", "--resolutions", "256", "--frames", "9", "--modes", "vanilla",
                 "--methods", "reuse:0.25,warmup=4", "--repeats", "1", "--warmup", "0", "--out", str(out),
                 "--no-progress"]) == 0
    records = {r["spec"]: r for r in map(json.loads, (out / "bench.jsonl").open())}
    reuse = records["reuse:0.25,warmup=4"]
    assert reuse["status"] == "ok" and reuse["step_timed"] == "partial"
    # both steps timed (which is faster is the bench's to measure, not a test's)
    assert reuse["full_median_s"] > 0 and reuse["median_s"] > 0 and reuse["full_speedup"] > 0
    assert "full step" in (out / "bench.md").read_text()


def _frontier():
    """scripts/frontier.py as a module."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "frontier.py"
    loader = importlib.util.spec_from_file_location("frontier", path)
    frontier = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(frontier)
    return frontier


def test_frontier_averages_the_measured_steps_over_the_schedule():
    frontier = _frontier()
    from tokenmerge.tools.methods import parse_spec

    bench = [{"spec": "reuse:0.5", "status": "ok", "speedup": 2.0, "full_speedup": 1.0},
             {"spec": "reuse:0.3", "status": "ok", "speedup": 4.0, "full_speedup": 0.8}]
    table = frontier._reuse_table(bench)
    speed, how = frontier._reuse_speed(table, parse_spec("reuse:0.5,warmup=4"), 20)
    full = (1 / 1.0 + 1 / 0.8) / 2
    assert speed == pytest.approx(20 / (4 * full + 16 * 0.5)) and "4 full + 16 partial" in how
    speed, how = frontier._reuse_speed(table, parse_spec("reuse:0.4,warmup=4"), 20)  # between two fractions
    assert speed == pytest.approx(20 / (4 * full + 16 * (0.5 + 0.25) / 2)) and "interpolated" in how
    assert frontier._reuse_speed(table, parse_spec("reuse:0.2,warmup=4"), 20) == (None, "")  # not measured


def test_frontier_joins_several_bench_tables_the_last_one_winning(tmp_path):
    """Settings timed in another sitting join the table: each against vanilla in its own table; a setting in
    both takes the later file's record, and both commands are named."""
    import json

    frontier = _frontier()
    old = [{"spec": "tome:0.5", "status": "ok", "speedup": 1.3, "command": "bench one"},
           {"spec": "todo:2", "status": "ok", "speedup": 1.1, "command": "bench one"}]
    new = [{"spec": "tome:0.5", "status": "ok", "speedup": 1.5, "command": "bench two"},
           {"spec": "reuse:0.5", "status": "ok", "speedup": 2.0, "full_speedup": 1.0, "command": "bench two"}]
    methods = [{"spec": spec, "label": spec, "psnr_mean": psnr, "ssim_mean": 0.9, "linear_work": 0.5}
               for spec, psnr in (("vanilla", "inf"), ("tome:0.5", 12.0), ("todo:2", 11.0),
                                  ("reuse:0.5,warmup=4", 33.0))]
    files = []
    for name, records in (("one.jsonl", old), ("two.jsonl", new), ("q.json", None)):
        files.append(tmp_path / name)
        files[-1].write_text("\n".join(json.dumps(r) for r in records) if records else
                             json.dumps({"methods": methods, "command": "quality", "steps": 20}))
    assert frontier.main(["--bench", str(files[0]), str(files[1]), "--quality", str(files[2]), "--out",
                          str(tmp_path / "out"), "--stem", "f", "--title", "t"]) == 0
    md = (tmp_path / "out" / "f.md").read_text()
    assert "`bench one` and `bench two`" in md
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[2] for line in md.splitlines() if " | " in line}
    assert rows["tome:0.5"] == "1.50x" and rows["todo:2"] == "1.10x"
    assert rows["reuse:0.5,warmup=4"] == f"{20 / (4 + 16 * 0.5):.2f}x"


# ---- keys="kept": the block on the recomputed tokens, the others' keys and values kept ---------------------
# catalogue entries whose calls keys="kept" cannot run on the recomputed tokens alone (per-token arguments, token
# counts): those calls compute every token, with one warning (a word of its reason here)
CACHED_WHOLE = {"qwen-image-edit-2511": "per-token", "wan-ti2v": "per-token", "skyreels-v2-df": "per-token",
                "ltx-i2v": "per-token", "hunyuan-video-i2v-token-replace": "num_tokens"}
# where the timestep enters each of these models (zeroed below: a model whose blocks do not depend on the step)
TIME_EMBEDDING = {"flux": "time_text_embed.timestep_embedder.linear_2", "hunyuan-video":
                  "time_text_embed.timestep_embedder.linear_2", "wan": "condition_embedder.time_embedder.linear_2"}


@pytest.mark.parametrize("name", [n for n in ENTRIES if n not in REFUSED])
def test_cached_keys_run_or_refuse_on_every_family(name):
    _skip(name)
    entry = CATALOGUE[name]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 3)
    vanilla = _run(model, calls)
    tokenmerge.apply_reuse(model, 0.5, warmup=1, keys="kept")
    if name in CACHED_WHOLE:  # never an error halfway through a generation: those calls compute every token
        with pytest.warns(RuntimeWarning, match=CACHED_WHOLE[name]):
            reused = _run(model, calls)
        for got, want in zip(reused, vanilla):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:
        reused = _run(model, calls)
        assert torch.equal(reused[0], vanilla[0])
        for got, want in zip(reused[1:], vanilla[1:]):
            assert torch.isfinite(got).all() and not torch.equal(got, want)
    tokenmerge.remove_patch(model)
    for got, want in zip(_run(model, calls), vanilla):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(TIME_EMBEDDING))
def test_cached_keys_are_the_fresh_ones_when_nothing_changes_between_steps(name):
    """With a model whose blocks ignore the timestep and the same latent at every step, the other tokens' kept keys
    and values are exactly this step's: keys="kept" must then give what keys="fresh" gives (which the property
    test checks against the unpatched blocks); with the real timestep embedding they differ."""
    _skip(name)
    entry = CATALOGUE[name]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 3)
    runs = {}
    for still in (False, True):
        if still:
            torch.nn.init.zeros_(model.get_submodule(TIME_EMBEDDING[name]).weight)
            torch.nn.init.zeros_(model.get_submodule(TIME_EMBEDDING[name]).bias)
        for keys in ("fresh", "cached"):
            tokenmerge.apply_reuse(model, 0.5, warmup=1, keys=keys)
            runs[still, keys] = _run(model, calls)
            tokenmerge.remove_patch(model)
    for a, b in zip(runs[True, "fresh"], runs[True, "cached"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(runs[False, "fresh"][2], runs[False, "cached"][2])


def test_cached_keys_run_the_block_on_the_recomputed_tokens():
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 2)
    seen = []
    model.single_transformer_blocks[0].proj_mlp.register_forward_hook(lambda m, a, out: seen.append(a[0].shape[1]))
    model.single_transformer_blocks[0].attn.to_q.register_forward_hook(lambda m, a, out: seen.append(a[0].shape[1]))
    for keys in ("cached", "fresh"):
        tokenmerge.apply_reuse(model, 0.25, warmup=1, keys=keys)
        _run(model, calls)
        tokenmerge.remove_patch(model)
    n, text = calls[0]["hidden_states"].shape[1], calls[0]["encoder_hidden_states"].shape[1]
    # cached: every projection on text + a quarter of the image; fresh: queries and the MLP on those rows only
    assert seen == [text + n] * 2 + [text + n // 4] * 2 + [text + n] * 2 + [text + n // 4] * 2


def test_the_quality_tools_linear_work_counts_the_rows_computed():
    """``tokenmerge quality``'s count of nn.Linear work sees what each layer computed, not the full-size output a
    reuse hook on the layer gives back (checked against the layers' inputs as they enter, after the patch's hooks)."""
    import types

    from tokenmerge.quality.run import linear_work

    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 2)
    tokenmerge.apply_reuse(model, 0.25, warmup=1)
    entered = [0]

    def count(module, args):
        entered[0] += args[0].shape[:-1].numel() * module.in_features * module.out_features

    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    handles = [m.register_forward_pre_hook(count) for m in layers]  # after the patch's: the rows each layer gets
    with torch.no_grad():
        model(**calls[0])
        entered[0] = 0
        with linear_work(types.SimpleNamespace(transformer=model)) as work:
            model(**calls[1])
    for handle in handles:
        handle.remove()
    assert work[0] == entered[0] > 0


# ---- text=True: the text stream's tokens reused too (keys="kept") -------------------------------------------
def test_text_reuse_is_the_plain_reuse_when_nothing_changes_between_steps():
    """With blocks that ignore the timestep and the same latent at every step, the kept text residuals, keys and
    values are exactly this step's: text=True must give what text=False gives; with the timestep they differ."""
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 4)
    runs = {}
    for still in (False, True):
        if still:
            for name in ("weight", "bias"):
                torch.nn.init.zeros_(getattr(model.get_submodule(TIME_EMBEDDING["flux"]), name))
        for text in (False, True):
            tokenmerge.apply_reuse(model, 0.5, warmup=1, keys="kept", text=text)
            runs[still, text] = _run(model, calls)
            tokenmerge.remove_patch(model)
    for a, b in zip(runs[True, False], runs[True, True]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch.equal(runs[False, False][0], runs[False, True][0])  # the full step
    assert not torch.allclose(runs[False, False][3], runs[False, True][3])


def test_text_reuse_runs_the_block_on_the_recomputed_text_tokens_and_keeps_the_others():
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 3)
    block = model.transformer_blocks[0]
    seen, outs = [], []
    model.single_transformer_blocks[0].proj_mlp.register_forward_hook(lambda m, a, out: seen.append(a[0].shape[1]))
    inputs = []
    block.register_forward_pre_hook(lambda m, a, kw: inputs.append(kw["encoder_hidden_states"]), with_kwargs=True,
                                    prepend=True)
    tokenmerge.apply_reuse(model, 0.25, warmup=1, keys="kept", text=True)
    block.register_forward_hook(lambda m, a, out: outs.append(out))  # after the patch's: the block's final output
    patch = model._tokenmerge_patch
    kept = []
    with torch.no_grad():
        for i, c in enumerate(calls):
            model(**c)
            kept.append(_kept(patch).text[0].clone())
    tokenmerge.remove_patch(model)
    n, text = calls[0]["hidden_states"].shape[1], calls[0]["encoder_hidden_states"].shape[1]
    taken = round(0.25 * text)
    assert seen == [text + n, taken + n // 4, taken + n // 4]
    # at each partial step, the text tokens not recomputed leave the block as their input plus their kept residual;
    # round-robin: the two steps recompute different text tokens
    changed = []
    for step in (1, 2):
        out_text = outs[step][0]
        same = (out_text == inputs[step] + kept[step - 1]).all(-1).all(0)
        assert int(same.sum()) >= text - taken
        changed.append(~same)
    assert not torch.equal(changed[0], changed[1])


@pytest.mark.parametrize("name,kwargs,words", [
    ("flux", dict(text=True), "keys='kept'"), ("flux", dict(keys="kept", text="yes"), "True or False"),
    ("wan", dict(keys="kept", text=True), "text=False"), ("pixart", dict(keys="kept", text=True), "text=False")])
def test_text_reuse_is_refused_where_it_cannot_work(name, kwargs, words):
    _skip(name)
    model = CATALOGUE[name].build()
    with pytest.raises(ValueError, match=words):
        tokenmerge.apply_reuse(model, 0.5, **kwargs)
    assert tokenmerge.describe_patch(model) is None


def test_text_reuse_with_an_attention_mask_recomputes_every_text_token():
    _skip("chroma")
    entry = CATALOGUE["chroma"]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 3)
    if calls[0].get("attention_mask") is None:
        pytest.skip("this diffusers' Chroma takes no attention mask")
    runs = []
    for text in (False, True):
        tokenmerge.apply_reuse(model, 0.5, warmup=1, keys="kept", text=text)
        runs.append(_run(model, calls))
        tokenmerge.remove_patch(model)
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kept_keys_take_a_call_whose_text_changed_length():
    """keys="kept": the kept keys (3 text + 8 image rows) get a partial step's fresh rows in place where the
    layout holds (the text's recomputed rows at their places); a call whose text changed length gets every text row
    fresh and the kept image rows with the recomputed ones fresh."""
    from tokenmerge.engine.attention import CachedKeys

    kept = torch.randn(1, 2, 3 + 8, 4)
    index = torch.tensor([1, 4, 6])
    for text_rows, text in ((3, None), (5, None), (2, torch.tensor([0, 2])), (4, torch.tensor([0, 2]))):
        fresh = torch.randn(1, 2, text_rows + 3, 4)
        pairs, seen = [[kept.clone(), kept.clone()]], {}
        mode = CachedKeys(8, index, "before", 0, pairs, text if text is None or text_rows == 2 else text[:0])
        if text is not None and text_rows != 2:  # a recomputed-text index of another length: every text row fresh
            mode.text = torch.arange(text_rows + 1)
        mode.attend(lambda **kw: seen.update(kw), dict(query=fresh, key=fresh, value=fresh))
        image = kept[..., 3:, :].clone()
        image[..., index, :] = fresh[..., text_rows:, :]
        if text is not None and text_rows == 2:  # the kept text, its recomputed rows fresh
            lead = kept[..., :3, :].clone()
            lead[..., text, :] = fresh[..., :2, :]
        else:  # every text row fresh
            lead = fresh[..., :text_rows, :]
        torch.testing.assert_close(seen["key"], torch.cat([lead, image], -2), rtol=0, atol=0)


_SDPA = torch.nn.functional.scaled_dot_product_attention  # (token reuse routes the name while its modes are open)


class _Keys(torch.overrides.TorchFunctionMode):
    """Every SDPA call's keys and values (``record``), or, with ``kept`` and ``fresh`` rows, its keys and values at
    the kept rows replaced by ``kept``'s (the reference of keys="kept")."""

    def __init__(self, kept=None, fresh=None):
        super().__init__()
        self.kept, self.fresh, self.seen = kept, fresh, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not _SDPA:
            return func(*args, **kwargs)
        names = ("query", "key", "value")
        kwargs.update(zip(names, args))
        args = ()
        self.seen.append((kwargs["key"].clone(), kwargs["value"].clone()))
        if self.kept is not None:
            keep = torch.ones(kwargs["key"].shape[-2], dtype=torch.bool)
            keep[self.fresh] = False
            k, v = (t.clone() for t in (kwargs["key"], kwargs["value"]))
            k[..., keep, :], v[..., keep, :] = self.kept[0][..., keep, :], self.kept[1][..., keep, :]
            kwargs["key"], kwargs["value"] = k, v
        return func(**kwargs)


@pytest.mark.parametrize("text", [False, True])
def test_cached_keys_and_text_against_an_exact_reference(text):
    """keys="kept" (and text=True): at a partial step each block's recomputed rows (image, and text ones with
    text=True) are the unpatched block's outputs with the other tokens' keys and values taken from their last
    computation (recorded at the full step), and every other row is its input plus its residual of that step."""
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 2)
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    seen = {i: [] for i in range(len(blocks))}
    for i, block in enumerate(blocks):  # before the patch's hooks: each call's plain input, and its final output
        block.register_forward_pre_hook(lambda m, a, kw, i=i: seen[i].append({"kwargs": dict(kw)}), with_kwargs=True,
                                        prepend=True)
    tokenmerge.apply_reuse(model, 0.5, warmup=1, keys="kept", text=text, spread=0.0)
    patch = model._tokenmerge_patch
    rows = []
    for i, block in enumerate(blocks):
        block.register_forward_hook(lambda m, a, out, i=i: seen[i][-1].update(out=out))
        block.register_forward_pre_hook(lambda m, a: rows.append(patch.calls.state.work))
    with torch.no_grad():
        full_keys = []
        for i, block in enumerate(blocks):  # the full step, each block under a recorder of its keys and values
            block.register_forward_pre_hook(lambda m, a, kw: full_keys.append(_Keys().__enter__()), with_kwargs=True)
            block.register_forward_hook(lambda m, a, out: full_keys[-1].__exit__(None, None, None))
        model(**calls[0])
        for block in blocks:
            block._forward_pre_hooks.popitem()
            block._forward_hooks.popitem()
        model(**calls[1])
    call = rows[-1]
    index = call.levels[0][1]
    tokenmerge.remove_patch(model)
    n, txt = calls[0]["hidden_states"].shape[1], calls[0]["encoder_hidden_states"].shape[1]
    text_rows = call.text.get(txt) if text else None
    assert index is not None and len(index) == n // 2 and (not text or len(text_rows) == round(0.5 * txt))
    fresh = torch.cat([text_rows if text else torch.arange(txt), txt + index])  # rows of [text | image] keys
    for i, block in enumerate(blocks):
        first, second = seen[i]
        kept = full_keys[i].seen[0]
        with torch.no_grad(), _Keys(kept, fresh):
            want = block(**second["kwargs"])
        got = second["out"]
        stream = patch.blocks[i].whole.output
        x0, x1 = first["kwargs"]["hidden_states"], second["kwargs"]["hidden_states"]
        residual = first["out"][stream] - x0
        others = torch.ones(n, dtype=torch.bool)
        others[index] = False
        torch.testing.assert_close(got[stream][:, index], want[stream][:, index], rtol=1e-4, atol=1e-5)
        assert torch.equal(got[stream][:, others], (x1 + residual)[:, others])
        t_at = patch.blocks[i].whole.text_output
        if t_at is not None:
            c0, c1 = first["kwargs"]["encoder_hidden_states"], second["kwargs"]["encoder_hidden_states"]
            if text:
                rest = torch.ones(txt, dtype=torch.bool)
                rest[text_rows] = False
                torch.testing.assert_close(got[t_at][:, text_rows], want[t_at][:, text_rows], rtol=1e-4, atol=1e-5)
                assert torch.equal(got[t_at][:, rest], (c1 + (first["out"][t_at] - c0))[:, rest])
            else:
                torch.testing.assert_close(got[t_at], want[t_at], rtol=1e-4, atol=1e-5)
