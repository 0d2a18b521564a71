"""LDM-style models (CompVis / Stability code bases): found by structure, parity with tomesd's LDM path."""

import itertools

import pytest
import torch
from tiny_models import CROSS_DIM, ldm_unet

import tokenmerge


def inputs(batch=2, h=16, w=16):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(batch, 4, h, w, generator=g), torch.full((batch,), 321),
            torch.randn(batch, 7, CROSS_DIM, generator=g))


def run(model, x, t, c):
    with torch.no_grad():
        return model.apply_model(x, t, c)


@pytest.mark.parametrize("flags", [f for f in itertools.product([False, True], repeat=3) if any(f)])
@pytest.mark.parametrize("size", [(16, 16), (10, 14)])
def test_parity_with_tomesd(flags, size):
    import tomesd

    model = ldm_unet()
    x, t, c = inputs(h=size[0], w=size[1])
    kw = dict(zip(("merge_attn", "merge_crossattn", "merge_mlp"), flags), ratio=0.5, use_rand=False,
              max_downsample=2)
    vanilla = run(model, x, t, c)
    tomesd.apply_patch(model, **kw)
    ref = run(model, x, t, c)
    tomesd.remove_patch(model)
    tokenmerge.apply_patch(model, match_radius=None, share_plans=False, **kw)
    ours = run(model, x, t, c)
    tokenmerge.remove_patch(model)
    assert (ours - vanilla).abs().max() > 1e-3
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(run(model, x, t, c), vanilla)


@pytest.mark.parametrize("where", ["top", "wrapper", "unet"])
def test_found_wherever_users_hold_it(where):
    model = ldm_unet()
    target = {"top": model, "wrapper": model.model, "unet": model.model.diffusion_model}[where]
    tokenmerge.apply_patch(target, max_downsample=2)
    info = tokenmerge.describe_patch(target)
    assert info.denoisers[0].family == "ldm-unet"
    paths = {p: ds for p, ds in info.denoisers[0].blocks}
    prefix = {"top": "model.diffusion_model.", "wrapper": "diffusion_model.", "unet": ""}[where]
    # level 0: input_blocks.1 and output_blocks.1; level 1: input_blocks.3, middle, output_blocks.0
    assert paths == {
        f"{prefix}input_blocks.1.1.transformer_blocks.0": 1,
        f"{prefix}input_blocks.3.1.transformer_blocks.0": 2,
        f"{prefix}middle_block.1.transformer_blocks.0": 2,
        f"{prefix}output_blocks.0.1.transformer_blocks.0": 2,
        f"{prefix}output_blocks.1.1.transformer_blocks.0": 1,
    }
    tokenmerge.remove_patch(target)
    tokenmerge.apply_patch(target)  # default: the finest level with attention only
    assert {ds for _, ds in tokenmerge.describe_patch(target).denoisers[0].blocks} == {1}
    tokenmerge.remove_patch(target)


def test_latent_passed_by_keyword():
    model = ldm_unet()
    x, t, c = inputs(h=12, w=8)
    tokenmerge.apply_patch(model)
    unet = model.model.diffusion_model
    with torch.no_grad():
        a = unet(x, t, context=c)
        b = unet(x=x, timesteps=t, context=c)
    tokenmerge.remove_patch(model)
    assert torch.equal(a, b)
