"""Video families on 3-D token grids: rotary positions follow the merged tokens exactly, frames merge within
themselves by default and across frames with ``st=2``, and the 3-D settings are validated."""

from __future__ import annotations

import pytest
import torch
from tiny_denoisers import CATALOGUE, available
from tiny_models import record_plans

import tokenmerge
from tokenmerge.engine.discover import bind
from tokenmerge.families.spec import Arg

pytestmark = pytest.mark.usefixtures("fast_cpu")

# (catalogue entry, block list, attention attribute, rotary keyword, token axis of the rotary tensors)
ROTARY = [
    ("wan", "blocks", "attn1", "rotary_emb", 1),
    ("hunyuan-video", "transformer_blocks", "attn", "image_rotary_emb", -2),
    ("hunyuan-video", "single_transformer_blocks", "attn", "image_rotary_emb", -2),
    ("cogvideox-5b", "transformer_blocks", "attn1", "image_rotary_emb", -2),
    ("ltx", "transformer_blocks", "attn1", "image_rotary_emb", -2),
    ("mochi", "transformer_blocks", "attn1", "image_rotary_emb", 0),
    ("hunyuan-video-1.5", "transformer_blocks", "attn", "image_rotary_emb", -2),
    ("easyanimate", "transformer_blocks", "attn1", "image_rotary_emb", -2),
    ("cosmos", "transformer_blocks", "attn1", "image_rotary_emb", -2),
    ("cosmos-predict2", "transformer_blocks", "attn1", "image_rotary_emb", -2),
    ("sana-video", "transformer_blocks", "attn1", "rotary_emb", 1),
    ("kandinsky5", "visual_transformer_blocks", "self_attention", "rotary_emb", 1),
    ("ltx2", "transformer_blocks", "attn1", "query_rotary_emb", -2),
]


def _build(name):
    reason = available(name)
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    return CATALOGUE[name].build(), CATALOGUE[name]


def _capture(model, blocks, attr, kwarg, inputs):
    """The rotary tables the first block's attention receives in one call (after tokenmerge's own pre-hook)."""
    attn = getattr(getattr(model, blocks)[0], attr)
    bound, seen = bind(Arg(kwarg), attn), []
    handle = attn.register_forward_pre_hook(lambda m, a, k: seen.append(bound.read(a, k)), with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    value = seen[0]
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _slots(plan, tokens):
    """For each merged slot, the tokens merged into it (from the plan's destination table, not its helpers)."""
    dest = plan.dest[0]
    return [torch.nonzero(dest == m).flatten() for m in range(int(dest.max()) + 1)]


@pytest.mark.parametrize("name,blocks,attr,kwarg,axis", ROTARY, ids=[f"{r[0]}-{r[1]}" for r in ROTARY])
@pytest.mark.parametrize("st", [1, 2])
def test_rotary_rows_are_those_of_each_merged_tokens_first_token(name, blocks, attr, kwarg, axis, st):
    model, entry = _build(name)
    inputs = entry.inputs(batch=2, grid=(4, 4, 6) if name != "cogvideox-5b" else None)
    plain = _capture(model, blocks, attr, kwarg, inputs)
    tokenmerge.apply_patch(model, ratio=0.5, st=st)
    recorder = record_plans(model)
    try:
        merged = _capture(model, blocks, attr, kwarg, inputs)
    finally:
        tokenmerge.remove_patch(model)
    plan = recorder.of(f"{blocks}.0")[0]
    tokens = plan.num_tokens
    slots = _slots(plan, tokens)
    first = torch.stack([s.min() for s in slots])
    grid_f = None
    for table_plain, table_merged in zip(plain, merged):
        rows = table_plain.shape[axis]
        text = rows - tokens  # rotary rows of text tokens (0 where the table covers the video only)
        keep = first if text == 0 else torch.cat([torch.arange(text), text + first])
        assert table_merged.shape[axis] == keep.numel()
        assert torch.equal(table_merged, table_plain.index_select(axis, keep)), "rotary rows mixed up"
        grid_f = rows
    assert grid_f is not None
    if st == 1:  # each frame merges within itself: every slot's tokens lie in one frame
        f, h, w = (4, 4, 6) if name != "cogvideox-5b" else entry.grid
        per_frame = tokens // f
        assert all(len({int(i) // per_frame for i in s}) == 1 for s in slots)
    assert any(len(s) > 1 for s in slots)


def test_spatio_temporal_windows_merge_across_frames():
    model, entry = _build("wan")
    inputs = entry.inputs(batch=2, grid=(4, 4, 6))
    tokenmerge.apply_patch(model, ratio=0.8, st=2)
    recorder = record_plans(model)
    with torch.no_grad():
        model(**inputs)
    tokenmerge.remove_patch(model)
    plan = recorder.of("blocks.0")[0]
    slots = _slots(plan, plan.num_tokens)
    assert any(len({int(i) // 24 for i in s}) > 1 for s in slots), "st=2 never merged across frames"


def test_video_settings_are_checked():
    model, entry = _build("wan")
    with pytest.raises(ValueError, match="ratio must be a number in"):
        tokenmerge.apply_patch(model, ratio=0.8)  # (1, 2, 2) windows: at most 0.75
    image = _build("unet-sd")[0]
    with pytest.raises(ValueError, match=r"downsample=\(2, 2, 2\) has 3 factors, but this model's token grid has 2"):
        tokenmerge.apply_todo(image, downsample=(2, 2, 2))
    with pytest.raises(ValueError, match="st=2 .* video"):
        tokenmerge.apply_patch(image, ratio=0.5, st=2)
    assert tokenmerge.describe_patch(image) is None
