"""A generation never stops halfway because one call cannot be merged (issue #34), checked on the configurations
diffusers' own model and pipeline tests use.

- A call whose token grid is smaller than the merge window (diffusers' pipeline tests at 16-32 px, a preview, a
  hires-fix's first pass) or whose position ids describe no grid (diffusers' model tests pass random ``img_ids``)
  runs unmerged, bit for bit the unpatched model's output, with one warning per patch that names the size and why.
  Levels of a UNet call where no window fits while others do are left unmerged; the others merge.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_denoisers import CATALOGUE, available, output_tensor
from tiny_models import make_unet, record_plans, unet_inputs

import tokenmerge

pytestmark = pytest.mark.usefixtures("fast_cpu")


def _need(name):
    reason = available(name)
    if reason is not None:
        pytest.skip(reason)
    return CATALOGUE[name], CATALOGUE[name].build()


def _run(model, kw):
    with torch.no_grad():
        return output_tensor(model(**kw))


def _tokenmerge_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("tokenmerge")]


@pytest.mark.parametrize("method", ["tome", "todo-ratio"])
def test_a_call_smaller_than_the_window_runs_unmerged_with_one_warning(method):
    model = make_unet("sd")
    small, large = unet_inputs(h=6, w=6), unet_inputs(h=16, w=16)
    plain_small, plain_large = _run(model, small), _run(model, large)
    if method == "tome":
        tokenmerge.apply_patch(model, ratio=0.5, sx=8, sy=8)
    else:
        tokenmerge.apply_todo(model, downsample=1, ratio=0.5, sx=8, sy=8)  # downsample 1: only the query merging
    with pytest.warns(RuntimeWarning, match=r"6x6 token grid ran unmerged: the merge window \(sx=8, sy=8\) is larger"):
        assert torch.equal(_run(model, small), plain_small)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(_run(model, small), plain_small)  # once per patch
        merged = _run(model, large)  # 16x16: two windows a side, merged
    assert not _tokenmerge_warnings(caught)
    assert not torch.allclose(merged, plain_large)
    tokenmerge.apply_patch(model, ratio=0.5, sx=4, sy=2)  # a window that fits once is fine: merged, no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not torch.allclose(_run(model, small), plain_small)
    assert not _tokenmerge_warnings(caught)
    tokenmerge.remove_patch(model)
    assert torch.equal(_run(model, small), plain_small)


def test_levels_where_no_window_fits_are_left_unmerged_and_the_others_merge():
    """max_downsample=2 patches the 2x2 and the 1x1 level of a 2x2 latent: the first merges, the second cannot."""
    model = make_unet("sd")
    kw = unet_inputs(h=2, w=2)
    plain = _run(model, kw)
    tokenmerge.apply_patch(model, ratio=0.5, max_downsample=2)
    recorder = record_plans(model)
    with pytest.warns(RuntimeWarning, match=r"unmerged in some levels: .*\(1x1 at downsample 2\); the other levels"):
        out = _run(model, kw)
    levels = {p.grid: p.plan.num_merged for p in recorder.plans}  # the 2x2 level and the 1x1 one
    assert levels == {(2, 2): 2, (1, 1): 0}, levels
    assert not torch.allclose(out, plain)


# diffusers' model tests of the Flux layout pass img_ids = torch.randn(H * W, 3) (and random txt_ids): no grid
RANDOM_IDS = ["flux", "chroma", "bria", "bria-fibo", "longcat-image", "ovis-image"]


@pytest.mark.parametrize("name", RANDOM_IDS)
def test_position_ids_that_describe_no_grid_run_unmerged(name):
    entry, model = _need(name)
    kw = entry.inputs()
    g = torch.Generator().manual_seed(0)
    kw["img_ids"] = torch.randn(kw["img_ids"].shape, generator=g)
    kw["txt_ids"] = torch.randn(kw["txt_ids"].shape, generator=g)
    plain = _run(model, kw)
    tokenmerge.apply_patch(model, ratio=0.5)
    with pytest.warns(RuntimeWarning, match=rf"tokenmerge: {type(model).__name__}: a call with a 1x1 token grid ran "
                                            r"unmerged"):
        out = _run(model, kw)
    assert torch.equal(out, plain)
    tokenmerge.remove_patch(model)


def test_joyimage_edit_plus_at_diffusers_test_shapes_runs_unmerged():
    """diffusers' test gives two items of one token each (shape_list [(1, 1, 1), (1, 1, 1)])."""
    entry, model = _need("joyimage-edit-plus")
    kw = entry.inputs(batch=1, grid=(1, 1))
    plain = _run(model, kw)
    tokenmerge.apply_patch(model, ratio=0.5)
    with pytest.warns(RuntimeWarning, match="1x1 token grid ran unmerged"):
        assert torch.equal(_run(model, kw), plain)
    tokenmerge.remove_patch(model)


def test_ids_that_form_no_grid_are_read_once_per_tensor():
    """The verdict on a call's ids is kept like its grid: a generation's later steps read nothing (the same ids
    tensor), a new ids tensor is read again."""
    from tokenmerge.engine.grids import GridReader, NoGrid
    from tokenmerge.families.spec import IdsGrid

    entry, model = _need("flux")
    ids = torch.zeros(6, 3)
    ids[:, 1] = torch.tensor([0, 0, 1, 1, 2, 5])
    ids[:, 2] = torch.tensor([0, 1, 0, 1, 0, 1])
    with pytest.raises(NoGrid, match="6 tokens do not form a 6x2 grid"):  # the reader itself reads every time
        GridReader(IdsGrid(), model).read((), {"img_ids": ids})
    kw = entry.inputs()
    g = torch.Generator().manual_seed(0)
    kw["img_ids"] = torch.randn(kw["img_ids"].shape, generator=g)
    tokenmerge.apply_patch(model, ratio=0.5)
    reads = []
    original = GridReader._read_ids
    try:
        GridReader._read_ids = staticmethod(lambda *a: reads.append(1) or original(*a))
        with pytest.warns(RuntimeWarning, match="ran unmerged"):
            for _ in range(3):  # one generation: the same ids at every step
                _run(model, kw)
        assert reads == [1]
        _run(model, {**kw, "img_ids": kw["img_ids"].clone()})  # another generation's ids
        assert reads == [1, 1]
    finally:
        GridReader._read_ids = staticmethod(original)
        tokenmerge.remove_patch(model)


# ---- pipelines at the sizes diffusers' pipeline tests use ------------------------------------------------------
def _small_wan():
    """WanPipeline with an 8x spatial VAE, as diffusers' tests build it: 16 px -> a 3x1x1 token grid."""
    from tiny_pipelines import CASES, _vae_wan_like

    case = CASES["wan-t2v"]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    pipe.vae = _vae_wan_like("AutoencoderKLWan", down=(False, True, True))
    pipe.vae_scale_factor_spatial = 8
    return case, pipe, {**kw, "height": 16, "width": 16}


def _small_cogvideox():
    """CogVideoXPipeline at 8 px: a 3x1x1 token grid (4x VAE, patch 2)."""
    from tiny_pipelines import CASES

    case = CASES["cogvideox"]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    return case, pipe, {**kw, "height": 8, "width": 8}


@pytest.mark.parametrize("build", [_small_wan, _small_cogvideox], ids=["wan", "cogvideox"])
def test_a_pipeline_smaller_than_the_window_generates_unmerged(build):
    case, pipe, kw = build()
    plain = case.generate(pipe, kw)
    tokenmerge.apply_patch(pipe, ratio=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = case.generate(pipe, kw)
    messages = _tokenmerge_warnings(caught)
    assert len(messages) == 1 and "a call with a 3x1x1 token grid ran unmerged" in messages[0], messages
    assert torch.equal(out, plain)
    tokenmerge.remove_patch(pipe)


# ---- models at the configurations of diffusers' model tests -----------------------------------------------------
def test_hunyuan_dit_with_one_broadcast_rotary_row_merges():
    """diffusers' HunyuanDiT test passes image_rotary_emb as one (1, d) row for every token: merged tokens take it
    as it is, exactly as they take their own rows of the same table written out per token."""
    entry, model = _need("hunyuan-dit")
    kw = entry.inputs()
    tokens = kw["hidden_states"].shape[-2] * kw["hidden_states"].shape[-1] // 4
    row = [torch.randn(1, 8, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    broadcast, written = {**kw, "image_rotary_emb": row}, {**kw, "image_rotary_emb": [r.expand(tokens, 8) for r in row]}
    plain = _run(model, broadcast)
    assert torch.equal(plain, _run(model, written))
    for apply in (lambda m: tokenmerge.apply_patch(m, ratio=0.5), lambda m: tokenmerge.apply_todo(m, downsample=2)):
        apply(model)
        out = _run(model, broadcast)
        torch.testing.assert_close(out, _run(model, written), rtol=0, atol=0)
        assert not torch.allclose(out, plain)
        tokenmerge.remove_patch(model)


def _attn1_inputs(model, kw):
    """What the first block's ``attn1`` is given (after the patch's hook): its tokens and rotary rows."""
    attn1, seen = model.transformer_blocks[0].attn1, []
    handle = attn1.register_forward_pre_hook(lambda m, a, k: seen.append(
        ((a[0] if a else k["hidden_states"]), k["image_rotary_emb"])), with_kwargs=True)
    _run(model, kw)
    handle.remove()
    return seen[0]


def test_ltx_with_video_coords_merges_the_video_and_keeps_conditioning_tokens_whole():
    """LTXConditionPipeline calls the transformer with video_coords (B, 3, S) and no num_frames/height/width, the
    tokens of conditioning frames first: the grid is read from the coordinates' last tokens, and the conditioning
    tokens reach attn1 unchanged with their own rotary rows (the pipeline end to end: tiny_pipelines' ltx-condition)."""
    entry, model = _need("ltx")
    kw = entry.inputs(batch=2, grid=(3, 4, 4))
    f, h, w = torch.meshgrid(torch.arange(3) * 8.0, torch.arange(4) * 32.0, torch.arange(4) * 32.0, indexing="ij")
    video = torch.stack([(f - 7).clamp(min=0) / 25, h, w]).flatten(1)
    cond = torch.stack([f[:1] + 16, h[:1], w[:1]]).flatten(1) / torch.tensor([25.0, 1, 1])[:, None]  # frame 16
    coords = torch.cat([cond, video], 1)[None].expand(2, -1, -1).contiguous()
    x = torch.cat([torch.randn(2, 16, kw["hidden_states"].shape[-1]), kw["hidden_states"]], 1)
    call = {k: v for k, v in kw.items() if k not in ("num_frames", "height", "width")}
    call.update(hidden_states=x, video_coords=coords)
    plain_x, plain_rope = _attn1_inputs(model, call)
    tokenmerge.apply_patch(model, ratio=0.5)
    recorder = record_plans(model)
    merged_x, merged_rope = _attn1_inputs(model, call)
    assert recorder.plans[0].call_grid == (3, 4, 4)
    assert merged_x.shape[1] == 16 + 48 // 2
    assert torch.equal(merged_x[:, :16], plain_x[:, :16])
    for merged, plain in zip(merged_rope, plain_rope):
        assert merged.shape[-2] == 16 + 24 and torch.equal(merged[..., :16, :], plain[..., :16, :])
    tokenmerge.remove_patch(model)


def _gates_made_random(model, *names):
    """Give the zero-initialised layers ``names`` (gates, output layer) random values, as a trained model has."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(n in name for n in names):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_ernie_image_at_diffusers_test_config_is_merged():
    """At diffusers' test config ERNIE-Image's output layer and modulation are zero-initialised: its output is zero
    for any input, so a patched and an unpatched call agree bit for bit. The tokens are merged all the same: the
    attention gets half the image tokens (and the text whole), and with those layers given values the output changes."""
    if available("ernie-image") is not None:
        pytest.skip(available("ernie-image"))
    from tiny_denoisers import _cls

    torch.manual_seed(0)
    model = _cls("ErnieImageTransformer2DModel")(
        hidden_size=16, num_attention_heads=1, num_layers=1, ffn_hidden_size=16, in_channels=16, out_channels=16,
        patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=(8, 4, 4), eps=1e-6, qk_layernorm=True).eval()
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 16, 16, 16, generator=g), timestep=torch.tensor([1.0]),
              text_bth=torch.randn(1, 16, 16, generator=g), text_lens=torch.tensor([16]))
    assert not _run(model, kw).any()  # zero output: nothing can change it
    tokenmerge.apply_patch(model, ratio=0.5)
    seen = []
    model.layers[0].self_attention.register_forward_pre_hook(lambda m, a, k: seen.append(
        (a[0] if a else k["hidden_states"]).shape[1]), with_kwargs=True)
    _run(model, kw)
    assert seen == [256 // 2 + 16]
    tokenmerge.remove_patch(model)
    _gates_made_random(model, "adaLN_modulation", "final_linear")
    plain = _run(model, kw)
    tokenmerge.apply_patch(model, ratio=0.5)
    assert not torch.allclose(_run(model, kw), plain)
    tokenmerge.remove_patch(model)


def test_prx_with_zero_initialised_gates_is_merged():
    """PRX zero-initialises its modulation (diffusers' test config too, at 1792 wide; a narrow one here): the gates
    are zero, attention adds nothing to the output, and a patched call agrees with an unpatched one bit for bit.
    The attention gets half the image tokens all the same, and with the gates given values the output changes."""
    if available("prx") is not None:
        pytest.skip(available("prx"))
    from tiny_denoisers import _cls

    torch.manual_seed(0)
    model = _cls("PRXTransformer2DModel")(in_channels=16, patch_size=2, context_in_dim=32, hidden_size=32,
                                          mlp_ratio=3.5, num_heads=2, depth=2, axes_dim=[8, 8], theta=10_000).eval()
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 16, 16, 16, generator=g),
              encoder_hidden_states=torch.randn(1, 16, 32, generator=g), timestep=torch.tensor([1.0]))
    plain = _run(model, kw)
    tokenmerge.apply_patch(model, ratio=0.5)
    seen = []
    model.blocks[0].attention.register_forward_pre_hook(lambda m, a, k: seen.append(
        (a[0] if a else k["hidden_states"]).shape[1]), with_kwargs=True)
    assert torch.equal(_run(model, kw), plain)
    assert seen == [64 // 2]
    tokenmerge.remove_patch(model)
    _gates_made_random(model, "modulation")
    plain = _run(model, kw)
    tokenmerge.apply_patch(model, ratio=0.5)
    assert not torch.allclose(_run(model, kw), plain)
    tokenmerge.remove_patch(model)


def test_refusals_are_type_or_value_errors_that_name_tokenmerge():
    """A layout, an argument or a backend the engine cannot follow is a ValueError (a setting that cannot work) or
    a TypeError (the wrong kind of object), never a RuntimeError (kept for internal errors)."""
    from tokenmerge.engine.call import sides, take_mask, take_rotary
    from tokenmerge.families.spec import TEXT_NONE, Mask, Rotary

    with pytest.raises(ValueError, match="tokenmerge: a sequence of 1 tokens cannot hold the 16 image tokens"):
        sides(1, 16, TEXT_NONE)
    with pytest.raises(ValueError, match="tokenmerge: 20 tokens where the image grid has 16.*not declared"):
        sides(20, 16, TEXT_NONE)
    with pytest.raises(TypeError, match="tokenmerge: rotary embedding 'freqs' is a dict"):
        take_rotary(Rotary("freqs"), {}, 16, torch.arange(8))
    with pytest.raises(TypeError, match="tokenmerge: attention mask 'mask' is a object"):
        take_mask(Mask("mask"), object(), 16, torch.arange(8))
    model = make_unet("sd")
    tokenmerge.apply_patch(model, ratio=0.5)
    block = model.get_submodule(tokenmerge.describe_patch(model).denoisers[0].blocks[0][0])
    with pytest.raises(ValueError, match="tokenmerge: block .* was called outside its denoiser's forward"):
        block(torch.randn(1, 64, 32), encoder_hidden_states=torch.randn(1, 5, 32))
