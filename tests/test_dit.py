"""DiT-family transformers: DiT, PixArt, SD3 (joint attention) and Flux (joint + rotary positions).

Tiny random configurations of each: off / on / removed, ToDo where it applies and a clear refusal where it
cannot be correct, block choice by index, non-square grids, the text stream of joint attention, Flux's positions,
and pipelines built from tiny parts run end to end.
"""

import pytest
import torch
from tiny_models import dit_inputs, make_dit, make_flux, make_pixart, make_sd3, record_plans

import tokenmerge

diffusers = pytest.importorskip("diffusers")
MAKERS = {"dit": make_dit, "pixart": make_pixart, "sd3": make_sd3, "flux": make_flux}
# DiT and PixArt are built as the generic Transformer2DModel on diffusers before 0.28 (see tiny_models)
NEEDS = {"dit": "Transformer2DModel", "pixart": "Transformer2DModel", "sd3": "SD3Transformer2DModel",
         "flux": "FluxTransformer2DModel"}


def _model(kind):
    if not hasattr(diffusers, NEEDS[kind]):
        pytest.skip(f"diffusers {diffusers.__version__} has no {NEEDS[kind]}")
    return MAKERS[kind]()


@torch.no_grad()
def _run(model, inputs):
    return model(**inputs).sample


@pytest.mark.parametrize("kind", list(MAKERS))
def test_off_on_removed(kind):
    model = _model(kind)
    inputs = dit_inputs(kind)
    plain = _run(model, inputs)
    tokenmerge.apply_patch(model, ratio=0.0)
    assert torch.equal(_run(model, inputs), plain)  # ratio 0: bit for bit
    tokenmerge.apply_patch(model, ratio=0.5)
    info = tokenmerge.describe_patch(model)
    assert info.num_blocks == 2
    merged = _run(model, inputs)
    assert merged.shape == plain.shape and torch.isfinite(merged).all()
    assert not torch.allclose(merged, plain, atol=1e-4)  # merging ran
    tokenmerge.remove_patch(model)
    assert torch.equal(_run(model, inputs), plain)  # removal: bit for bit


@pytest.mark.parametrize("kind", ["dit", "pixart", "sd3", "flux"])
def test_non_square_grid_and_odd_batch(kind):
    model = _model(kind)
    inputs = dit_inputs(kind, batch=3, h=6, w=10)
    plain = _run(model, inputs)
    tokenmerge.apply_patch(model, ratio=0.5)
    merged = _run(model, inputs)
    tokenmerge.remove_patch(model)
    assert merged.shape == plain.shape and not torch.allclose(merged, plain, atol=1e-4)


@pytest.mark.parametrize("kind", ["dit", "pixart"])
def test_todo_on_dit_and_pixart(kind):
    model = _model(kind)
    inputs = dit_inputs(kind)
    plain = _run(model, inputs)
    tokenmerge.apply_todo(model, downsample=1)
    assert torch.equal(_run(model, inputs), plain)  # factor 1 pools nothing
    tokenmerge.apply_todo(model, downsample=2)
    pooled = _run(model, inputs)
    tokenmerge.remove_patch(model)
    assert not torch.allclose(pooled, plain, atol=1e-4)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_todo_on_joint_attention_pools_inside_the_call_and_refuses_query_merging(kind):
    model = _model(kind)
    inputs = dit_inputs(kind)
    plain = _run(model, inputs)
    tokenmerge.apply_todo(model, downsample=2)  # keys/values pooled inside the attention call (test_todo_inside)
    pooled = _run(model, inputs)
    tokenmerge.remove_patch(model)
    assert not torch.allclose(pooled, plain, atol=1e-4) and torch.equal(_run(model, inputs), plain)
    with pytest.raises(ValueError, match="cannot be merged as well"):
        tokenmerge.apply_todo(model, downsample=2, ratio=0.3)
    assert tokenmerge.describe_patch(model) is None  # nothing left behind


def test_blocks_by_index():
    model = _model("pixart")
    tokenmerge.apply_patch(model, ratio=0.5, blocks=[1])
    assert [p for p, _ in tokenmerge.describe_patch(model).denoisers[0].blocks] == ["transformer_blocks.1"]
    tokenmerge.apply_patch(model, ratio=0.5, blocks=range(0, 2, 2))
    assert [p for p, _ in tokenmerge.describe_patch(model).denoisers[0].blocks] == ["transformer_blocks.0"]
    with pytest.raises(ValueError, match=r"blocks \[5\] out of range.*2 blocks"):
        tokenmerge.apply_patch(model, ratio=0.5, blocks=[5])
    for bad in ([], "all", [0.5], 3):
        with pytest.raises(ValueError, match="blocks must be"):
            tokenmerge.apply_patch(model, ratio=0.5, blocks=bad)
    tokenmerge.remove_patch(model)


def _block_io(block, store):
    def pre(module, args, kwargs):
        store["ctx_in"] = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None).clone()

    def post(module, args, kwargs, output):
        store["ctx_out"] = output[0].clone()

    return [block.register_forward_pre_hook(pre, with_kwargs=True),
            block.register_forward_hook(post, with_kwargs=True)]


def test_sd3_text_stream():
    """The text tokens are never merged: they enter joint attention whole, and where only the image stream's
    feed-forward is merged, the text stream a block hands on is bit-identical to the unpatched model's."""
    model = _model("sd3")
    inputs = dit_inputs("sd3")
    block = model.transformer_blocks[0]
    runs = {}
    for name, kwargs in (("plain", None), ("mlp", dict(merge_attn=False, merge_mlp=True)),
                         ("attn", dict(ratio=0.5))):
        if kwargs is not None:
            tokenmerge.apply_patch(model, **kwargs)
        store = runs[name] = {}
        handles = _block_io(block, store)
        seen = []
        handles.append(block.attn.register_forward_pre_hook(
            lambda m, a, k: seen.append(k["encoder_hidden_states"].shape[1]), with_kwargs=True))
        _run(model, inputs)
        store["attn_text_tokens"] = seen[0]
        for h in handles:
            h.remove()
        tokenmerge.remove_patch(model)
    assert torch.equal(runs["mlp"]["ctx_out"], runs["plain"]["ctx_out"])
    assert torch.equal(runs["attn"]["ctx_in"], runs["plain"]["ctx_in"])
    assert runs["attn"]["attn_text_tokens"] == runs["plain"]["attn_text_tokens"] == 5
    # with attention merged, text queries see merged image keys, so the text stream changes (the check can fail)
    assert not torch.equal(runs["attn"]["ctx_out"], runs["plain"]["ctx_out"])


@pytest.mark.parametrize("block_list", ["transformer_blocks", "single_transformer_blocks"])
def test_flux_positions_follow_the_merged_tokens(block_list):
    """Each merged image token is given the rotary position of a token merged into it (the lowest index), as the
    model's own position embedding computes it from img_ids; the text tokens keep theirs.

    The check is against ``pos_embed`` of the representatives' ids, so it fails if positions were dropped,
    shifted, taken in slot order, or taken from a token not merged into the slot."""
    model = _model("flux")
    inputs = dit_inputs("flux", batch=2, h=6, w=8)
    tokenmerge.apply_patch(model, ratio=0.5, use_rand=True)
    recorder = record_plans(model)
    attn = getattr(model, block_list)[0].attn
    seen = {}

    def capture(module, args, kwargs):
        seen["rotary"] = kwargs["image_rotary_emb"]
        seen["x"] = kwargs["hidden_states"]

    handle = attn.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        _run(model, inputs)
    finally:
        handle.remove()
        tokenmerge.remove_patch(model)
    plan = recorder.of(f"{block_list}.0")[0]
    reps = plan.representatives()[0]
    dest = plan.dest[0]
    assert plan.num_merged > 0 and torch.equal(dest[reps], torch.arange(plan.num_slots))  # each rep is in its slot
    ids = torch.cat([inputs["txt_ids"], inputs["img_ids"][reps]])
    expected = model.pos_embed(ids)
    for got, want in zip(seen["rotary"], expected):
        assert torch.equal(got, want)
    text = inputs["txt_ids"].shape[0]
    assert seen["x"].shape[1] == (text if block_list == "single_transformer_blocks" else 0) + plan.num_slots
    # a mix-up would be seen: slot order instead of the representatives gives other positions
    wrong = model.pos_embed(torch.cat([inputs["txt_ids"], inputs["img_ids"][: plan.num_slots]]))
    assert not torch.equal(seen["rotary"][0], wrong[0])


def test_flux_plan_is_shared_across_the_batch():
    """Positions are per token, not per image: one pattern for the batch, so image i of a batch of 2 is
    merged exactly as it would be with the same pattern alone."""
    model = _model("flux")
    inputs = dit_inputs("flux", batch=2)
    tokenmerge.apply_patch(model, ratio=0.5)
    recorder = record_plans(model)
    try:
        _run(model, inputs)
    finally:
        tokenmerge.remove_patch(model)
    plan = recorder.of("transformer_blocks.0")[0]
    assert plan.batch == 1  # one pattern, made once for the batch
    x = torch.randn(2, plan.num_tokens, 4)
    both = plan.merge(x)  # each element merged exactly as it would be alone with that pattern
    assert torch.equal(both[0], plan.merge(x[:1])[0]) and torch.equal(both[1], plan.merge(x[1:])[0])
    assert torch.equal(plan.unmerge(both)[1], plan.unmerge(both[1:])[0])


def test_flux_schedule_reads_its_0_to_1_timestep():
    model = _model("flux")
    inputs = dit_inputs("flux")  # timestep 0.5: half-way
    plain = _run(model, inputs)
    tokenmerge.apply_patch(model, ratio=0.5, start=0.6)  # starts after this step
    assert torch.equal(_run(model, inputs), plain)
    tokenmerge.apply_patch(model, ratio=0.5, stop=0.6)
    assert not torch.equal(_run(model, inputs), plain)
    tokenmerge.remove_patch(model)


PIPELINES = {"dit": "DiTPipeline", "pixart": "PixArtAlphaPipeline", "sd3": "StableDiffusion3Pipeline",
             "flux": "FluxPipeline"}


@pytest.mark.parametrize("kind", list(PIPELINES))
def test_pipelines_end_to_end(kind):
    from tiny_models import make_dit_pipeline

    if not hasattr(diffusers, PIPELINES[kind]):
        pytest.skip(f"diffusers {diffusers.__version__} has no {PIPELINES[kind]}")
    pipe, kwargs = make_dit_pipeline(kind)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images

    plain = generate()
    tokenmerge.apply_patch(pipe, ratio=0.5)
    assert tokenmerge.describe_patch(pipe).denoisers[0].path == "transformer"
    merged = generate()
    tokenmerge.remove_patch(pipe)
    plain, merged = torch.as_tensor(plain), torch.as_tensor(merged)  # old DiTPipeline returns numpy
    assert merged.shape == plain.shape and torch.isfinite(merged).all() and not torch.equal(merged, plain)
    assert torch.equal(torch.as_tensor(generate()), plain)
