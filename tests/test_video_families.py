"""The video families of 2025-2026 (``tokenmerge.families``: HunyuanVideo 1.5 and LTX-2 of ``video``, ``easyanimate``,
``cosmos``, ``sana_video``, ``kandinsky``, ``allegro``) lay out their tokens right.

A "merge" that only permutes the video tokens (every other token, rotary row and mask entry where the family says it
is) leaves the model's output unchanged up to rounding, since attention and feed-forwards are equivariant to a
permutation of their tokens when the positions and masks follow them. A wrong text side, rotary axis or mask layout
moves text rows or positions and changes the output by far more than rounding. Also: the refusals name their
reasons, and the timestep conversions (Cosmos 1.0's EDM log-sigma) give the right denoising progress.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_denoisers import CATALOGUE, available, output_tensor
from tiny_models import permuting_matcher, record_plans

import tokenmerge
from tokenmerge.engine.discover import bind
from tokenmerge.families import allegro, cosmos, easyanimate, kandinsky, match_family, refusal_for, sana_video, video
from tokenmerge.families.spec import Arg

pytestmark = pytest.mark.usefixtures("fast_cpu")

FAMILIES = ((video.HUNYUAN_VIDEO_15,) + easyanimate.FAMILIES + cosmos.FAMILIES + sana_video.FAMILIES
            + kandinsky.FAMILIES + (video.LTX2,) + allegro.FAMILIES)
EXAMPLES = [name for family in FAMILIES for name in family.examples]


def _build(name):
    reason = available(name)
    if reason is not None:
        pytest.skip(reason)
    return CATALOGUE[name], CATALOGUE[name].build()


def _out(model, inputs, entry):
    with torch.no_grad():
        out = model(**inputs)
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return torch.cat([o.reshape(-1) for o in out])  # every output (LTX-2's audio too)
    return output_tensor(out, entry).clone().reshape(-1)


def _permuted(name, **config):
    entry, model = _build(name)
    family = match_family(model)
    refused = {t.kind for b in family.blocks for t in b.targets if t.refuse is not None}
    inputs = entry.inputs(batch=2, grid=entry.second_grid(), seed=3)
    plain = _out(model, inputs, entry)
    config = dict(dict(ratio=0.5, merge_crossattn=True, merge_mlp="mlp" not in refused), **config)
    tokenmerge.apply_config(model, tokenmerge.ToMeConfig(**config), matcher=permuting_matcher)
    try:
        permuted = _out(model, inputs, entry)
    finally:
        tokenmerge.remove_patch(model)
    return plain, permuted


def test_cosmos_edm_timesteps_give_the_denoising_progress():
    """Cosmos 1.0 is called with c_noise = log(sigma) / 4: sigma 80 (the first step) is near the start, sigma 0.002
    near the end, and sigma 1 half-way, as Cosmos-Predict 2's sigma / (1 + sigma) = 0.5 is."""
    entry, model = _build("cosmos")
    bound = bind(match_family(model).timestep, model)
    first, last, middle = (bound.progress(0.25 * math.log(s), 1000) for s in (80.0, 0.002, 1.0))
    assert first == pytest.approx(1 / 81) and last == pytest.approx(1 - 0.002 / 1.002) and middle == 0.5
    assert bound.progress(1e6, 1000) == 0.0 and bound.progress(-1e6, 1000) == 1.0  # no overflow
    plain = bind(Arg("timestep", scale=1000.0), model)
    assert plain.progress(0.5, 1000) == 0.5


def test_cosmos_schedules_follow_the_edm_timestep():
    """A schedule over the first half of denoising merges at sigma 80 and leaves sigma 0.01 alone, bit for bit."""
    entry, model = _build("cosmos")
    inputs = entry.inputs(batch=2)
    late = dict(inputs, timestep=torch.full((2,), 0.25 * math.log(0.01)))
    early = dict(inputs, timestep=torch.full((2,), 0.25 * math.log(80.0)))
    plain_late, plain_early = _out(model, late, entry), _out(model, early, entry)
    tokenmerge.apply_patch(model, ratio=0.5, start=0.0, stop=0.5)
    try:
        assert torch.equal(_out(model, late, entry), plain_late)
        assert not torch.equal(_out(model, early, entry), plain_early)
    finally:
        tokenmerge.remove_patch(model)


@pytest.mark.parametrize("name,record", [
    ("kandinsky6", "kandinsky6"), ("kandinsky6-sr", "kandinsky6-sr"), ("minimax-h3", "minimax-h3"),
    ("wan-animate-2", "wan-animate-2"), ("sana-wm", "sana-wm"), ("sana-wm-refiner", "sana-wm-refiner"),
])
def test_refused_video_models_name_their_own_reason(name, record):
    entry, model = _build(name)
    assert refusal_for(model).name == record
    with pytest.raises(TypeError, match=f"tokenmerge cannot patch .*{type(model).__name__}"):
        tokenmerge.apply_patch(model, ratio=0.5)
    assert tokenmerge.describe_patch(model) is None


def test_kandinsky5_nabla_and_easyanimate_shared_feed_forward_are_refused():
    entry, model = _build("kandinsky5")
    model.register_to_config(attention_type="nabla")
    assert match_family(model) is None and refusal_for(model).name == "kandinsky5-nabla"
    entry, model = _build("easyanimate")
    model.transformer_blocks[-1].txt_ff = None  # a block past mmdit_layers runs ``ff`` on the text too
    assert match_family(model) is None and refusal_for(model).name == "easyanimate-shared-ff"
    with pytest.raises(TypeError, match="one feed-forward"):
        tokenmerge.apply_patch(model, ratio=0.5)


def _ltx2_with_keyframes(entry, model, batch=2, keyframes=5, seed=4):
    """LTX-2 inputs whose video sequence carries ``keyframes`` conditioning tokens after the grid's (as the condition
    pipelines append them), with their own positions and a per-token timestep (0 on the keyframe tokens)."""
    inputs = entry.inputs(batch=batch, grid=entry.second_grid(), seed=seed)
    f, h, w = inputs["num_frames"], inputs["height"], inputs["width"]
    g = torch.Generator().manual_seed(seed)
    coords = model.rope.prepare_video_coords(batch, f, h, w, torch.device("cpu"), fps=inputs["fps"])
    extra = coords[:, :, :keyframes] + 3.0  # their own positions
    n = f * h * w
    return dict(inputs, hidden_states=torch.cat([inputs["hidden_states"],
                                                 torch.randn(batch, keyframes, inputs["hidden_states"].shape[-1],
                                                             generator=g)], 1),
                video_coords=torch.cat([coords, extra], 2),
                timestep=torch.cat([torch.full((batch, n), 500.0), torch.zeros(batch, keyframes)], 1),
                audio_timestep=torch.full((batch,), 500.0), sigma=torch.full((batch,), 500.0))


def test_ltx2_keyframe_tokens_after_the_grid_pass_whole():
    """The condition pipelines append keyframe tokens after the video grid's: a permutation of the grid's tokens
    (merging every sub-module, the audio-to-video cross-attention too) changes nothing, the keyframes and the audio
    included; real merging changes the output and keeps it finite."""
    entry, model = _build("ltx2")
    inputs = _ltx2_with_keyframes(entry, model)
    plain = _out(model, inputs, entry)
    tokenmerge.apply_config(model, tokenmerge.ToMeConfig(ratio=0.5, merge_crossattn=True, merge_mlp=True),
                            matcher=permuting_matcher)
    try:
        permuted = _out(model, inputs, entry)
    finally:
        tokenmerge.remove_patch(model)
    scale = plain.abs().max()
    torch.testing.assert_close(permuted / scale, plain / scale, rtol=0, atol=2e-5)
    tokenmerge.apply_patch(model, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    try:
        merged = _out(model, inputs, entry)
    finally:
        tokenmerge.remove_patch(model)
    assert merged.shape == plain.shape and torch.isfinite(merged).all() and not torch.equal(merged, plain)


def test_ltx2_video_self_attention_mask_is_refused_clearly():
    """IC-LoRA's video self-attention mask (B, S, S) is not followed: merging the self-attention stops with an error
    that says so (merge_attn=False still merges the rest)."""
    entry, model = _build("ltx2")
    inputs = entry.inputs(batch=2)
    n = inputs["hidden_states"].shape[1]
    inputs["video_self_attention_mask"] = torch.ones(2, n, n)
    tokenmerge.apply_patch(model, ratio=0.5)
    try:
        with pytest.raises(ValueError, match="attention mask"), torch.no_grad():
            model(**inputs)
    finally:
        tokenmerge.remove_patch(model)
    tokenmerge.apply_patch(model, ratio=0.5, merge_attn=False, merge_mlp=True)
    try:
        assert torch.isfinite(_out(model, inputs, entry)).all()
    finally:
        tokenmerge.remove_patch(model)


def test_tables_positions_rotary_keeps_the_tables_and_takes_the_positions_of_the_merged_tokens():
    from tokenmerge.engine.call import take_rotary
    from tokenmerge.families.spec import Rotary

    tables = ((torch.randn(3, 4), torch.randn(3, 4)), (torch.randn(5, 4), torch.randn(5, 4)))
    positions = (torch.arange(6).view(1, 6), torch.arange(6).view(1, 6) * 10)
    reps = torch.tensor([0, 2, 5])
    out = take_rotary(Rotary("r", layout="tables_positions", token_axis=-1, text="none"), (tables, positions), 6, reps)
    assert out[0] is tables
    assert [p.tolist() for p in out[1]] == [[[0, 2, 5]], [[0, 20, 50]]]


def test_allegro_positions_are_those_of_each_merged_tokens_first_token():
    entry, model = _build("allegro")
    inputs = entry.inputs(batch=2, grid=(3, 4, 6))
    attn = model.transformer_blocks[0].attn1
    tokenmerge.apply_patch(model, ratio=0.5)
    recorder, seen = record_plans(model), []
    grab = attn.register_forward_pre_hook(  # after tokenmerge's own pre-hook: what the attention receives
        lambda m, a, k: seen.append(k["image_rotary_emb"]), with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        grab.remove()
        tokenmerge.remove_patch(model)
    (tables, positions), plan, plain = seen[0], recorder.plans[0].plan, inputs["image_rotary_emb"]
    assert tables is plain[0]
    first = plan.representatives()[0]
    assert 0 < first.numel() < 3 * 4 * 6
    for merged, whole in zip(positions, plain[1]):
        assert torch.equal(merged, whole[:, first])


@pytest.mark.parametrize("name,blocks,attr,heads_first", [
    ("easyanimate", "transformer_blocks", "attn1", True),  # keys [text | video]
    ("hunyuan-video-1.5", "transformer_blocks", "attn", False),  # keys [video | context]
    ("cosmos", "transformer_blocks", "attn1", True),  # keys: the video's only
])
def test_todo_pools_the_video_keys_inside_the_attention_call(name, blocks, attr, heads_first):
    """The rows ToDo pools inside the attention call are the video's keys: after the key norm they are only rotated,
    so each row keeps the norm it has at the output of ``norm_k`` (the text's keys come from another norm)."""
    from tokenmerge.merge import downsample

    entry, model = _build(name)
    attn = getattr(getattr(model, blocks)[0], attr)
    normed, pooled = [], []
    hook = attn.norm_k.register_forward_hook(lambda m, a, out: normed.append(out))

    def recording(x, grid, factors, mode):
        pooled.append(x)
        return downsample(x, grid, factors, mode)

    tokenmerge.apply_config(model, tokenmerge.ToDoConfig(downsample=2), downsampler=recording)
    try:
        with torch.no_grad():
            model(**entry.inputs(batch=2))
    finally:
        hook.remove()
        tokenmerge.remove_patch(model)
    keys = normed[0] if heads_first else normed[0].transpose(1, 2)  # (B, heads, N, d)
    torch.testing.assert_close(pooled[0].norm(dim=-1), keys.flatten(0, 1).norm(dim=-1), rtol=1e-4, atol=1e-5)
