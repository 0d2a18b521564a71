"""Merge-plan reuse: one plan per level and call (share_plans), and plans kept across calls (plan_steps)."""

import pytest
import torch
from tiny_models import make_unet, unet_inputs
from torch import nn

import tokenmerge
from tokenmerge.merge import bipartite_soft_matching


class TwinBlocks(nn.Module):
    """Two transformer blocks at level 0 that see the same input: their plans cannot differ."""

    def __init__(self):
        super().__init__()
        from diffusers.models.attention import BasicTransformerBlock
        from test_norm_types import _Holder

        torch.manual_seed(0)
        blocks = nn.ModuleList([BasicTransformerBlock(32, 4, 8, cross_attention_dim=16) for _ in range(2)])
        self.conv_in = nn.Identity()
        self.down_blocks = nn.ModuleList([_Holder(attentions=nn.ModuleList([_Holder(transformer_blocks=blocks)]))])
        self.blocks = blocks

    def forward(self, sample, timestep=None, encoder_hidden_states=None):
        x = sample.flatten(2).transpose(1, 2)
        return sum(b(x, encoder_hidden_states=encoder_hidden_states) for b in self.blocks)


def counting(calls):
    def matcher(*args, **kwargs):
        calls.append(1)
        return bipartite_soft_matching(*args, **kwargs)

    return matcher


def twin_inputs(t=500):
    g = torch.Generator().manual_seed(0)
    return dict(sample=torch.randn(2, 32, 8, 8, generator=g), timestep=torch.tensor(t),
                encoder_hidden_states=torch.randn(2, 5, 16, generator=g))


def test_shared_plans_equal_recomputed_ones_when_the_plan_cannot_change():
    model = TwinBlocks()
    inp = twin_inputs()
    calls = []
    tokenmerge.apply_config(model, tokenmerge.ToMeConfig(use_rand=False, merge_mlp=True, share_plans=False),
                            matcher=counting(calls))
    with torch.no_grad():
        recomputed = model(**inp)
    assert len(calls) == 2
    calls.clear()
    tokenmerge.apply_config(model, tokenmerge.ToMeConfig(use_rand=False, merge_mlp=True, share_plans=True),
                            matcher=counting(calls))
    with torch.no_grad():
        shared = model(**inp)  # one plan for the level
    assert len(calls) == 1  # computed once, used twice
    assert torch.equal(shared, recomputed)
    tokenmerge.remove_patch(model)


def test_share_plans_on_a_unet_computes_one_plan_per_level_and_a_unet_defaults_to_one_per_block():
    unet = make_unet()
    inp = unet_inputs()
    calls = []
    tokenmerge.apply_config(unet, tokenmerge.ToMeConfig(max_downsample=2, share_plans=True), matcher=counting(calls))
    with torch.no_grad():
        out = unet(**inp).sample
    assert len(calls) == 2  # levels 0 and 1, for 6 patched blocks
    calls.clear()
    tokenmerge.apply_config(unet, tokenmerge.ToMeConfig(max_downsample=2), matcher=counting(calls))
    with torch.no_grad():
        default = unet(**inp).sample
    assert len(calls) == 6  # the default on a UNet (share_plans=None): a plan per block
    tokenmerge.apply_patch(unet, max_downsample=2, share_plans=False)
    with torch.no_grad():
        exact = unet(**inp).sample
    assert torch.equal(default, exact)
    assert not torch.equal(out, exact)  # a plan per block, from each block's own input, merges other tokens
    tokenmerge.remove_patch(unet)


def test_plan_steps_keeps_plans_for_k_calls_and_a_new_generation_recomputes():
    model = TwinBlocks()
    calls = []
    tokenmerge.apply_config(model, tokenmerge.ToMeConfig(use_rand=False, plan_steps=2, share_plans=False),
                            matcher=counting(calls))
    per_call = []
    with torch.no_grad():
        for t in (900, 800, 700, 600, 999, 900):  # 999: a new generation starts
            before = len(calls)
            model(**twin_inputs(t))
            per_call.append(len(calls) - before)
    assert per_call == [2, 0, 2, 0, 2, 0]
    # identical inputs: the kept plans are the recomputed ones, so results agree exactly
    tokenmerge.apply_patch(model, use_rand=False, share_plans=False)
    with torch.no_grad():
        exact = model(**twin_inputs(800))
    tokenmerge.apply_patch(model, use_rand=False, plan_steps=3, share_plans=False)
    with torch.no_grad():
        model(**twin_inputs(900))
        kept = model(**twin_inputs(800))
    assert torch.equal(kept, exact)
    tokenmerge.remove_patch(model)


def test_reuse_follows_batch_and_ratio_changes():
    unet = make_unet()
    calls = []
    tokenmerge.apply_config(unet, tokenmerge.ToMeConfig(plan_steps=10, share_plans=False), matcher=counting(calls))
    with torch.no_grad():
        unet(**unet_inputs(batch=2))
        n = len(calls)
        unet(**{**unet_inputs(batch=3), "timestep": torch.tensor(400)})  # another batch: no stale plan
    assert len(calls) == 2 * n
    tokenmerge.remove_patch(unet)


@pytest.mark.parametrize("kwargs, words", [(dict(plan_steps=0), "plan_steps"), (dict(share_plans=1), "share_plans")])
def test_bad_reuse_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        tokenmerge.apply_patch(make_unet(), **kwargs)
