"""Image transformers with text and reference tokens beside the image's: only the generated image's tokens are
merged; text, reference-image tokens and their rotary rows reach attention unchanged, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_denoisers import CATALOGUE, available
from tiny_models import record_plans

import tokenmerge
from tokenmerge.engine.discover import bind
from tokenmerge.families.spec import Arg

pytestmark = pytest.mark.usefixtures("fast_cpu")

# (entry, block list, attention, rotary keyword, text before the image in hidden_states, token axis of the rotary)
CASES = [
    ("flux-kontext", "transformer_blocks", "attn", "image_rotary_emb", False, -2),
    ("flux-kontext", "single_transformer_blocks", "attn", "image_rotary_emb", True, -2),
    ("flux2-klein-ref", "transformer_blocks", "attn", "image_rotary_emb", False, -2),
    ("flux2-klein-ref", "single_transformer_blocks", "attn", "image_rotary_emb", True, -2),
    ("qwen-image-edit", "transformer_blocks", "attn", "image_rotary_emb", False, -2),
    ("chroma", "single_transformer_blocks", "attn", "image_rotary_emb", True, -2),
    ("hunyuan-video", "transformer_blocks", "attn", "image_rotary_emb", False, -2),
]


def _capture(model, block, attr, kwarg, inputs):
    attn = getattr(block, attr)
    binds = {n: bind(Arg(n), attn) for n in ("hidden_states", "encoder_hidden_states", kwarg, "attention_mask")}
    seen = {}
    handle = attn.register_forward_pre_hook(
        lambda m, a, k: seen.update({n: b.read(a, k) for n, b in binds.items() if b is not None}), with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    return seen


def _tables(value):
    if value is None:
        return []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tables(v)]
    return [value]


@pytest.mark.parametrize("name,blocks,attr,kwarg,text_first,axis", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_text_and_reference_tokens_reach_attention_unchanged(name, blocks, attr, kwarg, text_first, axis):
    reason = available(name)
    if reason is not None:
        pytest.skip(reason)
    entry = CATALOGUE[name]
    model = entry.build()
    inputs = entry.inputs(batch=2)
    block = getattr(model, blocks)[0]
    plain = _capture(model, block, attr, kwarg, inputs)
    # patch this block alone: its input is the unpatched model's, so everything but the image must be too
    tokenmerge.apply_patch(model, ratio=0.5)
    paths = [path for path, _ in tokenmerge.describe_patch(model).denoisers[0].blocks]
    tokenmerge.apply_patch(model, ratio=0.5, blocks=[paths.index(f"{blocks}.0")])
    assert tokenmerge.describe_patch(model).num_blocks == 1
    recorder = record_plans(model)
    merged = _capture(model, block, attr, kwarg, inputs)
    grid = recorder.plans[0].call_grid
    tokenmerge.remove_patch(model)
    n = math.prod(grid)
    x, y = plain["hidden_states"], merged["hidden_states"]
    extra = x.shape[1] - n
    assert y.shape[1] - extra == n - int(n * 0.5), "only the image's tokens are merged"
    text = inputs["encoder_hidden_states"].shape[1] if text_first else 0
    refs = extra - text
    assert torch.equal(x[:, :text], y[:, :text]), "text tokens changed"
    assert torch.equal(x[:, x.shape[1] - refs:], y[:, y.shape[1] - refs:]), "reference tokens changed"
    if plain.get("encoder_hidden_states") is not None:
        assert torch.equal(plain["encoder_hidden_states"], merged["encoder_hidden_states"]), "text stream changed"
    for a, b in zip(_tables(plain.get(kwarg)), _tables(merged.get(kwarg))):
        rows = a.shape[axis] - b.shape[axis]
        assert rows == int(n * 0.5) or a.shape[axis] < n, "rotary rows do not follow the merge"
        if a.shape[axis] < n:  # a text-only table (Qwen's text freqs) passes whole
            assert torch.equal(a, b)
            continue
        before = a.shape[axis] - n - refs if a.shape[axis] > n + refs - 1 else 0
        head = a.narrow(axis, 0, before), b.narrow(axis, 0, before)
        tail = a.narrow(axis, a.shape[axis] - refs, refs), b.narrow(axis, b.shape[axis] - refs, refs)
        assert torch.equal(*head) and torch.equal(*tail), "text or reference rotary rows changed"
