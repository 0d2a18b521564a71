"""Today's image and video pipelines end to end, from tiny random parts (tests/tiny_pipelines.py): ToMe on, off
(bit-identical to never patched), ToDo, the spatio-temporal window on video, and the schedule and plan reuse
driven by each family's own scheduler and timestep scale.

Every case is skipped, with the reason, on a diffusers without its pipeline class (0.27 has none of them).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from tiny_models import PlanRecorder
from tiny_pipelines import CASES

import tokenmerge
from tokenmerge.merge import bipartite_soft_matching

pytestmark = pytest.mark.usefixtures("fast_cpu")

VIDEO = [name for name, case in CASES.items() if case.video]


def _built(case):
    reason = case.available()
    if reason is not None:
        pytest.skip(reason)
    return case.build()


def _changed(out: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    assert out.shape == reference.shape, what
    assert torch.isfinite(out).all(), what
    assert (out - reference).abs().max() > 1e-4, f"{what}: the output did not change"


@pytest.mark.parametrize("name", list(CASES))
def test_on_off_on_and_todo(name):
    case = CASES[name]
    pipe, kw = _built(case)
    vanilla = case.generate(pipe, kw)
    assert torch.isfinite(vanilla).all()
    assert vanilla.dim() == (5 if case.video else 4) and vanilla.shape[0] == 1

    tokenmerge.apply_patch(pipe, ratio=0.5)
    assert [d.path for d in tokenmerge.describe_patch(pipe).denoisers] == list(case.denoisers)
    calls, handle = _first_block_calls(pipe)
    merged = case.generate(pipe, kw)
    handle.remove()
    _changed(merged, vanilla, "ToMe 0.5")
    # every call merged half of the generated image's grid, read from the pipeline's own arguments; the reference
    # tokens after it (Kontext, Qwen-Image-Edit, Klein with an image) were counted apart, outside the plan
    tokens = math.prod(case.grid)
    assert calls and set(calls) == {(case.grid, case.reference, tokens, tokens // 2)}, set(calls)
    assert torch.equal(case.generate(pipe, kw), merged)  # a seeded call gives the same output again

    tokenmerge.remove_patch(pipe)
    assert tokenmerge.describe_patch(pipe) is None
    assert torch.equal(case.generate(pipe, kw), vanilla)

    if not case.todo:
        with pytest.raises(ValueError, match="ToDo|ToMe"):
            tokenmerge.apply_todo(pipe, downsample=2)
        assert tokenmerge.describe_patch(pipe) is None
        return
    tokenmerge.apply_todo(pipe, downsample=2)
    _changed(case.generate(pipe, kw), vanilla, "ToDo 2")
    tokenmerge.remove_patch(pipe)
    assert torch.equal(case.generate(pipe, kw), vanilla)


@pytest.mark.parametrize("name", VIDEO)
def test_video_spatio_temporal_windows(name):
    """st=2: a token may merge with its neighbours in the next latent frame (windows (2, 2, 2))."""
    case = CASES[name]
    pipe, kw = _built(case)
    vanilla = case.generate(pipe, kw)
    tokenmerge.apply_patch(pipe, ratio=0.5)
    spatial = case.generate(pipe, kw)
    tokenmerge.apply_patch(pipe, ratio=0.5, st=2)
    temporal = case.generate(pipe, kw)
    _changed(temporal, vanilla, "ToMe 0.5, st=2")
    assert not torch.equal(temporal, spatial)
    tokenmerge.remove_patch(pipe)
    assert torch.equal(case.generate(pipe, kw), vanilla)


def _first_block_calls(pipe):
    """Per denoiser call, what the first patched block was given: ``None`` (no merge this call) or (the token
    grid read from the call, the reference tokens after the image's, the plan's tokens, how many it merges)."""
    first = tokenmerge.describe_patch(pipe.transformer).denoisers[0].blocks[0][0]
    record = []

    class Observer(PlanRecorder):
        def plan(self, p):
            if p.path == first and p.plan.num_merged > 0:
                record[-1] = (p.call_grid, p.trailing, p.plan.num_tokens, p.plan.num_merged)

    tokenmerge.observe(pipe.transformer, Observer())
    return record, pipe.transformer.register_forward_pre_hook(lambda *_: record.append(None))


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_merges_in_the_first_half_only(name):
    """start=0, stop=0.5 with the family's scheduler: merged exactly in the calls whose progress 1 - t/1000 (t the
    scheduler's timestep, 0..1000) is at most 0.5, whether the pipeline passes the transformer t (Wan, HunyuanVideo,
    LTX, CogVideoX, SANA, HiDream) or t/1000 (Flux.2, Qwen-Image, Chroma, Flux Kontext)."""
    case = CASES[name]
    pipe, kw = _built(case)
    kw = {**kw, **case.guidance, "num_inference_steps": case.schedule_steps}  # one denoiser call per step
    tokenmerge.apply_patch(pipe, ratio=0.5, start=0.0, stop=0.5)
    calls, handle = _first_block_calls(pipe)
    out = case.generate(pipe, kw)
    handle.remove()
    merged = [c is not None for c in calls]
    assert torch.isfinite(out).all()
    progress = [1.0 - float(t) / 1000.0 for t in pipe.scheduler.timesteps]
    assert len(merged) == len(progress), "one denoiser call per step"
    clear = [(p, m) for p, m in zip(progress, merged) if abs(p - 0.5) > 1e-3]  # not at the boundary itself
    assert [m for _, m in clear] == [p <= 0.5 for p, _ in clear], list(zip(progress, merged))
    assert any(m for _, m in clear) and not all(m for _, m in clear), "the schedule must switch within the run"
    tokenmerge.remove_patch(pipe)


@pytest.mark.parametrize("name", list(CASES))
def test_plan_steps_computes_plans_every_other_call(name):
    case = CASES[name]
    pipe, kw = _built(case)
    kw = {**kw, **case.guidance, "num_inference_steps": 4}
    made = []

    def counting_matcher(*args, **kwargs):
        made.append(len(calls))  # the denoiser call it is made in (from 1)
        return bipartite_soft_matching(*args, **kwargs)

    tokenmerge.apply_config(pipe, tokenmerge.ToMeConfig(ratio=0.5, plan_steps=2, share_plans=False),
                            matcher=counting_matcher)
    calls = []  # the calls of the denoiser the counting reads (Ideogram 4: the conditional transformer's)
    handle = pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    # every patched denoiser makes its plans in the calls of its step (Ideogram 4's unconditional transformer
    # right after the conditional one, whose call count this reads)
    blocks = sum(len(info.blocks) for info in tokenmerge.describe_patch(pipe).denoisers)
    out = case.generate(pipe, kw)
    handle.remove()
    assert torch.isfinite(out).all()
    assert Counter(made) == {1: blocks, 3: blocks}, Counter(made)
    tokenmerge.remove_patch(pipe)
