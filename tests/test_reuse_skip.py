"""Token reuse's ``skip=``: after each computed step, ``skip`` steps where every block recomputes two tokens and the
others carry their kept residuals (moved along their slopes with ``extrapolate``). Checked: the schedule, the
refusals, a run against a reference made from the unpatched blocks' outputs, and the frontier's timing of it."""

from __future__ import annotations

import pytest
import torch
from test_reuse import CACHED_WHOLE, ENTRIES, REFUSED, _frontier, _run, _skip, _steps
from test_reuse_extrapolate import _record
from tiny_denoisers import CATALOGUE

import tokenmerge
from tokenmerge.config import ReuseConfig
from tokenmerge.merge.recompute import MIN_COUNT, share
from tokenmerge.tools.methods import parse_spec

pytestmark = pytest.mark.usefixtures("fast_cpu")


def test_the_schedule_skips_after_each_computed_step():
    assert ReuseConfig(fraction=1.0, warmup=2, skip=2).schedule(8) == [None, None, 0.0, 0.0, None, 0.0, 0.0, None]
    assert ReuseConfig(fraction=0.5, warmup=1, skip=1).schedule(5) == [None, 0.0, 0.5, 0.0, 0.5]
    assert ReuseConfig(fraction=1.0, warmup=1, skip=1).reuses and not ReuseConfig(fraction=1.0).reuses
    # skip_growth: each round skips that many more steps than the one before
    grown = ReuseConfig(fraction=1.0, warmup=4, skip=2, skip_growth=1).schedule(20)
    assert [k for k, part in enumerate(grown) if part is None] == [0, 1, 2, 3, 6, 10, 15]
    assert all(part == 0.0 for part in grown if part is not None)
    grown = ReuseConfig(fraction=0.5, warmup=1, skip_growth=2).schedule(8)  # rounds of 1, 3, 5 steps
    assert grown == [None, 0.5, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0]
    # every: a full step still comes every ``every``-th step; a share that reaches 1 is a full step
    assert ReuseConfig(fraction=0.5, warmup=1, skip=1, every=3).schedule(5) == [None, 0.0, 0.5, None, 0.5]
    assert share(5, 1.0, 0.25, 0.5, 1.0, 1, 0) is None and share(5, 0.5, 0.25, 0.5, 1.0, 1, 0) == pytest.approx(2 / 3)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
@pytest.mark.parametrize("name", ["skip", "skip_growth"])
def test_bad_skip_is_refused(name, value):
    with pytest.raises(ValueError, match=name):
        ReuseConfig(**{name: value})


@pytest.mark.parametrize("factor", [0.0, 1.0])
def test_a_skipped_step_carries_every_kept_residual_but_two_tokens(factor):
    """Two full steps, then two skipped ones (``fraction=1``): in each block two image tokens and two text tokens are
    recomputed (against kept keys: test_reuse_extrapolate checks such rows) and every other row (not recomputed
    since) is its input plus the residual of the last full step, moved along (R1 - R0) / (p1 - p0) over the
    progress since with ``extrapolate``; the next computed step is a full one, the unpatched block's output."""
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 5)
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    tokenmerge.apply_reuse(model, 1.0, warmup=2, skip=2, keys="cached", text=True, spread=0.0, extrapolate=factor)
    patch = model._tokenmerge_patch
    seen, handles = _record(model, blocks, patch)
    with torch.no_grad():
        for c in calls:
            model(**c)
    for h in handles:
        h.remove()
    tokenmerge.remove_patch(model)
    n, txt = calls[0]["hidden_states"].shape[1], calls[0]["encoder_hidden_states"].shape[1]
    checked = 0
    for i, block in enumerate(blocks):
        site = patch.blocks[i]
        p = [s["progress"] for s in seen[i]]
        for step in range(5):
            rec = seen[i][step]
            with torch.no_grad():
                want = block(**rec["kwargs"])
            call = rec["call"]
            for at, name, rows in ((site.whole.output, "hidden_states", call.levels[0][1]),
                                   (site.whole.text_output, "encoder_hidden_states", call.text.get(txt))):
                if at is None:
                    continue
                got, plain = rec["out"][at], want[at]
                if step in (0, 1, 4):  # full steps (warm-up, then the computed step after two skipped ones)
                    assert not call.partial
                    torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-5)
                    continue
                assert call.partial and len(rows) == MIN_COUNT
                x = rec["kwargs"][name]
                r0, r1 = (seen[i][k]["out"][at] - seen[i][k]["kwargs"][name] for k in (0, 1))
                moved = r1 + factor * (r1 - r0) * (p[step] - p[1]) / (p[1] - p[0])
                others = torch.ones(x.shape[1], dtype=torch.bool)
                others[rows] = False
                if step == 3:  # the token the first skipped step recomputed has its residual from then
                    first = seen[i][2]["call"]
                    others[first.levels[0][1] if name == "hidden_states" else first.text[txt]] = False
                torch.testing.assert_close(got[:, others], (x + moved)[:, others], rtol=1e-5, atol=1e-5)
                checked += 1
    rows = sum(1 + (site.whole.text_output is not None) for site in patch.blocks)  # image and text streams
    assert checked == 2 * rows and n > 1


def test_describe_names_it():
    _skip("flux")
    model = CATALOGUE["flux"].build()
    tokenmerge.apply_reuse(model, 1.0, skip=2, keys="cached")
    assert "skip=2" in str(tokenmerge.describe_patch(model))
    tokenmerge.remove_patch(model)


def test_the_frontier_times_a_skipped_step_as_the_bench_one_token_step():
    frontier = _frontier()
    bench = [{"spec": "reuse:0.5", "status": "ok", "speedup": 2.0, "full_speedup": 1.0},
             {"spec": "reuse:0.0001", "status": "ok", "speedup": 20.0, "full_speedup": 1.0}]
    table = frontier._reuse_table(bench)
    speed, how = frontier._reuse_speed(table, parse_spec("reuse:1,warmup=2,skip=1"), 6)  # F F S F S F
    assert speed == pytest.approx(6 / (4 * 1.0 + 2 * 0.05)) and "4 full + 0 partial + 2 skipped" in how
    speed, how = frontier._reuse_speed(table, parse_spec("reuse:0.5,warmup=2,skip=1"), 6)  # F F S P S P
    assert speed == pytest.approx(6 / (2 * 1.0 + 2 * 0.5 + 2 * 0.05))
    table = frontier._reuse_table(bench[:1])  # no skipped step measured: no speed
    assert frontier._reuse_speed(table, parse_spec("reuse:0.5,warmup=2,skip=1"), 6) == (None, "")


@pytest.mark.parametrize("name", [n for n in ENTRIES if n not in REFUSED and n not in CACHED_WHOLE])
def test_skipped_steps_run_on_every_family(name):
    """Full, skipped, skipped, full (``fraction=1, skip=2``, keys cached, extrapolated): the full steps are the
    unpatched model's, the skipped ones finite and not it; removal gives the model back."""
    _skip(name)
    entry = CATALOGUE[name]
    model = entry.build()
    calls = _steps(model, entry.inputs(batch=2), 4)
    vanilla = _run(model, calls)
    tokenmerge.apply_reuse(model, 1.0, warmup=1, skip=2, keys="cached", extrapolate=1.0)
    reused = _run(model, calls)
    assert torch.equal(reused[0], vanilla[0])
    for got, want in zip(reused[1:3], vanilla[1:3]):
        assert torch.isfinite(got).all() and not torch.equal(got, want)
    torch.testing.assert_close(reused[3], vanilla[3], rtol=1e-4, atol=1e-5)
    tokenmerge.remove_patch(model)
    assert all(torch.equal(a, b) for a, b in zip(_run(model, calls), vanilla))
