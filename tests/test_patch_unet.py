"""ToMe on diffusers UNets and ControlNets: parity with tomesd, exact removal, levels, sizes, seeds, dtypes."""

import itertools

import pytest
import torch
from tiny_models import make_controlnet, make_unet, unet_inputs

import tokenmerge


def run(unet, inp, positional=False):
    with torch.no_grad():
        if positional:  # tomesd reads the latent from args[0]
            return unet(inp["sample"], inp["timestep"], inp["encoder_hidden_states"]).sample
        return unet(**inp).sample


@pytest.fixture(scope="module")
def unet():
    return make_unet("sd")


@pytest.mark.parametrize("merge_attn, merge_crossattn, merge_mlp",
                         [f for f in itertools.product([False, True], repeat=3) if any(f)])
@pytest.mark.parametrize("max_downsample", [1, 2])
def test_parity_with_tomesd(unet, merge_attn, merge_crossattn, merge_mlp, max_downsample):
    import tomesd

    inp = unet_inputs(batch=2, h=16, w=16)
    flags = dict(merge_attn=merge_attn, merge_crossattn=merge_crossattn, merge_mlp=merge_mlp)
    vanilla = run(unet, inp)
    tomesd.apply_patch(unet, ratio=0.5, max_downsample=max_downsample, use_rand=False, **flags)
    try:
        ref = run(unet, inp, positional=True)
    finally:
        tomesd.remove_patch(unet)
    tokenmerge.apply_patch(unet, ratio=0.5, max_downsample=max_downsample, use_rand=False, match_radius=None,
                           share_plans=False, **flags)  # tomesd's matching, a plan per block: two arguments away
    try:
        ours = run(unet, inp)
    finally:
        tokenmerge.remove_patch(unet)
    assert (ours - vanilla).abs().max() > 1e-3  # the patch acts
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_ratio_zero_and_removal_are_bit_identical(unet):
    inp = unet_inputs()
    vanilla = run(unet, inp)
    tokenmerge.apply_patch(unet, ratio=0.0, merge_crossattn=True, merge_mlp=True)
    assert torch.equal(run(unet, inp), vanilla)
    tokenmerge.apply_patch(unet, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    assert not torch.equal(run(unet, inp), vanilla)
    tokenmerge.remove_patch(unet)
    assert torch.equal(run(unet, inp), vanilla)
    for module in unet.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not hasattr(module, "_tokenmerge_patch")
    tokenmerge.remove_patch(unet)  # removing twice is harmless


def test_apply_again_replaces_and_describe_reports(unet):
    inp = unet_inputs()
    tokenmerge.apply_patch(unet, ratio=0.3)
    once = run(unet, inp)
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in unet.modules())
    tokenmerge.apply_patch(unet, ratio=0.5)
    tokenmerge.apply_patch(unet, ratio=0.3)
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in unet.modules()) == hooks
    assert torch.equal(run(unet, inp), once)
    info = tokenmerge.describe_patch(unet)
    assert info.config.ratio == 0.3 and info.num_blocks == 5
    assert {ds for d in info.denoisers for _, ds in d.blocks} == {1}
    assert "5/6 transformer blocks patched (5 at downsample 1)" in str(info)
    tokenmerge.remove_patch(unet)
    assert tokenmerge.describe_patch(unet) is None


def test_context_manager_restores_previous_state(unet):
    inp = unet_inputs()
    vanilla = run(unet, inp)
    with tokenmerge.patched(unet, ratio=0.5) as m:
        assert m is unet
        inside = run(unet, inp)
    assert not torch.equal(inside, vanilla)
    assert torch.equal(run(unet, inp), vanilla)
    tokenmerge.apply_patch(unet, ratio=0.3)
    before = run(unet, inp)
    with tokenmerge.patched(unet, ratio=0.6):
        pass
    assert tokenmerge.describe_patch(unet).config.ratio == 0.3
    assert torch.equal(run(unet, inp), before)
    tokenmerge.remove_patch(unet)
    with pytest.raises(RuntimeError):
        with tokenmerge.patched(unet):
            raise RuntimeError("boom")
    assert tokenmerge.describe_patch(unet) is None


def test_sdxl_default_merges_and_explicit_one_is_refused():
    unet = make_unet("sdxl")
    inp = unet_inputs(h=16, w=16)
    vanilla = run(unet, inp)
    tokenmerge.apply_patch(unet)  # tomesd's default would touch nothing here
    info = tokenmerge.describe_patch(unet)
    assert info.num_blocks > 0 and {ds for _, ds in info.denoisers[0].blocks} == {2}
    assert (run(unet, inp) - vanilla).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"downsample \[2, 4\]; max_downsample=1 selects none"):
        tokenmerge.apply_patch(unet, max_downsample=1)
    # the failed call left the previous patch as it was
    assert tokenmerge.describe_patch(unet).num_blocks == info.num_blocks
    tokenmerge.apply_patch(unet, max_downsample=4)
    assert {ds for _, ds in tokenmerge.describe_patch(unet).denoisers[0].blocks} == {2, 4}
    tokenmerge.remove_patch(unet)
    assert torch.equal(run(unet, inp), vanilla)


def test_tomesd_default_does_nothing_on_sdxl_while_ours_does():
    import tomesd

    unet = make_unet("sdxl")
    inp = unet_inputs()
    vanilla = run(unet, inp)
    tomesd.apply_patch(unet)
    try:
        assert torch.equal(run(unet, inp, positional=True), vanilla)
    finally:
        tomesd.remove_patch(unet)


@pytest.mark.parametrize("batch, h, w", [(1, 16, 16), (3, 16, 16), (2, 12, 20), (2, 14, 10), (2, 18, 18),
                                         (4, 10, 16)])
@pytest.mark.parametrize("use_rand", [False, True])
def test_sizes_and_batches(unet, batch, h, w, use_rand):
    """Non-square, sizes the 2x2 windows do not divide at some level, odd batches, batch changes."""
    import tomesd

    inp = unet_inputs(batch=batch, h=h, w=w)
    vanilla = run(unet, inp)
    tokenmerge.apply_patch(unet, ratio=0.5, use_rand=use_rand, max_downsample=2, match_radius=None, share_plans=False)
    try:
        out = run(unet, inp)
        out_again = run(unet, unet_inputs(batch=batch + 1, h=h, w=w))  # batch size changes between calls
    finally:
        tokenmerge.remove_patch(unet)
    assert out.shape == vanilla.shape and out_again.shape[0] == batch + 1
    assert torch.isfinite(out).all()
    assert (out - vanilla).abs().max() > 1e-4
    if not use_rand or batch % 2 == 1:  # deterministic destinations: compare with tomesd
        tomesd.apply_patch(unet, ratio=0.5, use_rand=False, max_downsample=2)
        try:
            ref = run(unet, inp, positional=True)
        finally:
            tomesd.remove_patch(unet)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_size_is_read_by_name_not_position(unet):
    inp = unet_inputs(h=12, w=20)
    tokenmerge.apply_patch(unet)
    try:
        by_name = run(unet, inp)
        by_position = run(unet, inp, positional=True)
    finally:
        tokenmerge.remove_patch(unet)
    torch.testing.assert_close(by_name, by_position, rtol=0, atol=0)


def test_seed_makes_the_pattern_reproducible_and_the_global_rng_is_untouched(unet):
    inp = unet_inputs()
    outs = {}
    for seed in (None, 0, 1):
        tokenmerge.apply_patch(unet, seed=seed)
        state = torch.get_rng_state()
        outs[seed] = run(unet, inp)
        assert torch.equal(torch.get_rng_state(), state)
        assert torch.equal(run(unet, inp), outs[seed])  # same call again: same pattern
        tokenmerge.remove_patch(unet)
    assert torch.equal(outs[None], outs[0])
    assert not torch.equal(outs[0], outs[1])
    # the pattern changes with the timestep (fresh destinations every step, as in the paper)
    tokenmerge.apply_patch(unet, seed=1)
    other_t = run(unet, {**inp, "timestep": torch.tensor(499)})
    tokenmerge.remove_patch(unet)
    vanilla_other_t = run(unet, {**inp, "timestep": torch.tensor(499)})
    tokenmerge.apply_patch(unet, seed=1, use_rand=False)
    fixed_other_t = run(unet, {**inp, "timestep": torch.tensor(499)})
    tokenmerge.remove_patch(unet)
    assert not torch.equal(other_t, fixed_other_t) and not torch.equal(other_t, vanilla_other_t)


@pytest.mark.processes
def test_seed_is_reproducible_across_processes(unet, tmp_path):
    import subprocess
    import sys

    code = (
        "import sys, torch; sys.path.insert(0, 'tests'); import tokenmerge; from tiny_models import *\n"
        "unet = make_unet('sd'); tokenmerge.apply_patch(unet, seed=5)\n"
        "with torch.no_grad(): out = unet(**unet_inputs()).sample\n"
        f"torch.save(out, r'{tmp_path / 'out.pt'}')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    tokenmerge.apply_patch(unet, seed=5)
    try:
        here = run(unet, unet_inputs())
    finally:
        tokenmerge.remove_patch(unet)
    assert torch.equal(torch.load(tmp_path / "out.pt"), here)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(dtype):
    unet = make_unet("sd").to(dtype)
    inp = unet_inputs(dtype=dtype)
    vanilla = run(unet, inp)
    tokenmerge.apply_patch(unet, merge_crossattn=True, merge_mlp=True)
    out = run(unet, inp)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert (out.float() - vanilla.float()).abs().max() > 0
    tokenmerge.remove_patch(unet)
    assert torch.equal(run(unet, inp), vanilla)


def test_backward_through_a_patched_unet():
    unet = make_unet("sd").train()
    tokenmerge.apply_patch(unet, merge_crossattn=True, merge_mlp=True)
    out = unet(**unet_inputs()).sample
    out.square().mean().backward()
    grads = [p.grad for p in unet.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and all(torch.isfinite(g).all() for g in grads)
    tokenmerge.remove_patch(unet)


def test_controlnet_and_multi_controlnet():
    try:
        from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel
    except ImportError:  # diffusers < 0.31
        from diffusers.pipelines.controlnet.multicontrolnet import MultiControlNetModel

    net = make_controlnet()
    inp = unet_inputs()
    cond = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        vanilla = net(**inp, controlnet_cond=cond, return_dict=False)
    tokenmerge.apply_patch(net)
    with torch.no_grad():
        merged = net(**inp, controlnet_cond=cond, return_dict=False)
    assert (merged[0][1] - vanilla[0][1]).abs().max() > 1e-4
    tokenmerge.remove_patch(net)
    with torch.no_grad():
        again = net(**inp, controlnet_cond=cond, return_dict=False)
    assert all(torch.equal(a, b) for a, b in zip(again[0], vanilla[0]))
    multi = MultiControlNetModel([net, make_controlnet(seed=2)])
    tokenmerge.apply_patch(multi)
    info = tokenmerge.describe_patch(multi)
    assert [d.path for d in info.denoisers] == ["nets.0", "nets.1"]
    tokenmerge.remove_patch(multi)
    assert tokenmerge.describe_patch(multi) is None


def test_unsupported_models_get_a_type_error():
    with pytest.raises(TypeError, match="supported are"):
        tokenmerge.apply_patch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="cannot patch a str"):
        tokenmerge.apply_patch("unet")
    from diffusers import AutoencoderKL

    with pytest.raises(TypeError, match="AutoencoderKL"):
        tokenmerge.apply_patch(AutoencoderKL(block_out_channels=(32,), norm_num_groups=32))


def test_remove_and_describe_refuse_what_is_not_a_model():
    for call in (tokenmerge.remove_patch, tokenmerge.describe_patch):
        with pytest.raises(TypeError, match="holds no model"):
            call("unet")
    assert tokenmerge.remove_patch(torch.nn.Linear(2, 2)) is not None  # a module without a patch: a no-op


def test_a_unet_without_transformer_blocks_is_refused():
    unet = make_unet("sd", down_block_types=("DownBlock2D", "DownBlock2D"),
                     up_block_types=("UpBlock2D", "UpBlock2D"), mid_block_type=None)
    with pytest.raises(ValueError, match="has no transformer blocks"):
        tokenmerge.apply_patch(unet)


def test_block_called_outside_the_denoiser_is_a_clear_error(unet):
    block = unet.down_blocks[0].attentions[0].transformer_blocks[0]
    tokenmerge.apply_patch(unet)
    try:
        with pytest.raises(ValueError, match="outside its denoiser"):
            block(torch.randn(2, 256, 32))
    finally:
        tokenmerge.remove_patch(unet)


def test_import_as_tomesd():
    import tokenmerge as tomesd

    unet = make_unet("sd")
    assert tomesd.apply_patch(unet, ratio=0.5, max_downsample=1, sx=2, sy=2, use_rand=True, merge_attn=True,
                              merge_crossattn=False, merge_mlp=False) is unet
    assert tomesd.remove_patch(unet) is unet


def test_match_radius_reaches_the_matcher_and_changes_the_result():
    from tokenmerge.merge import bipartite_soft_matching

    unet = make_unet()
    inp = unet_inputs(h=32, w=32)  # level 0: 32 x 32 tokens, 16 x 16 windows: radius 1 is local
    radii = []

    def spy(metric, shape, windows, r, offsets, radius):
        radii.append(radius)
        return bipartite_soft_matching(metric, shape, windows, r, offsets, radius)

    with torch.no_grad():
        plain = unet(**inp).sample
        tokenmerge.apply_patch(unet, match_radius=None)  # tomesd's global matching
        exact = unet(**inp).sample
        tokenmerge.apply_config(unet, tokenmerge.ToMeConfig())  # the default: match_radius=1
        local = unet(**inp).sample
        tokenmerge.apply_config(unet, tokenmerge.ToMeConfig(), matcher=spy)  # the same radius reaches a matcher
        assert torch.equal(unet(**inp).sample, local)
        tokenmerge.remove_patch(unet)
        again = unet(**inp).sample
    assert radii and set(radii) == {1}
    assert not torch.equal(local, exact) and not torch.equal(local, plain)
    assert torch.equal(again, plain)
