"""Whole-block merging (scope="block"): y = x + unmerge(block(merge(x)) - merge(x)), checked against the formula
computed with the unpatched block, on a DiT block, a UNet block and a Flux block (text and rotary rows)."""

from __future__ import annotations

import pytest
import torch
from tiny_denoisers import CATALOGUE, available
from tiny_models import record_plans

import tokenmerge

pytestmark = pytest.mark.usefixtures("fast_cpu")


@pytest.mark.parametrize("name,blocks", [("pixart", "transformer_blocks"), ("dit", "transformer_blocks"),
                                         ("wan", "blocks")])
def test_the_block_update_is_unmerged_onto_the_residual_stream(name, blocks):
    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    model, inputs = entry.build(), entry.inputs(batch=2)
    block = getattr(model, blocks)[0]
    seen = {}

    def grab_in(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, dict(kwargs)

    def grab_out(module, args, kwargs, output):
        seen["out"] = output

    # the block's own input and output in a run where only this block is patched (its input is the plain one)
    h_in = block.register_forward_pre_hook(grab_in, with_kwargs=True, prepend=True)
    tokenmerge.apply_patch(model, ratio=0.5, scope="block", blocks=[0])
    recorder = record_plans(model)
    h_out = block.register_forward_hook(grab_out, with_kwargs=True)
    with torch.no_grad():
        model(**inputs)
    for h in (h_in, h_out):
        h.remove()
    tokenmerge.remove_patch(model)
    plan, args, kwargs = recorder.plans[0].plan, seen["args"], seen["kwargs"]
    x = kwargs.get("hidden_states", args[0] if args else None)
    merged = plan.merge(x)
    call_args = (merged,) + tuple(args[1:]) if args else args
    call_kwargs = dict(kwargs, hidden_states=merged) if "hidden_states" in kwargs else kwargs
    if name == "wan":  # the rotary table follows the merged tokens: take the rows of each slot's first token
        rep = plan.representatives()[0]
        cos, sin = call_args[3] if len(call_args) > 3 else call_kwargs["rotary_emb"]
        rot = (cos.index_select(1, rep), sin.index_select(1, rep))
        if len(call_args) > 3:
            call_args = call_args[:3] + (rot,) + call_args[4:]
        else:
            call_kwargs["rotary_emb"] = rot
    with torch.no_grad():
        expected = x + plan.unmerge(block(*call_args, **call_kwargs) - merged)
    torch.testing.assert_close(seen["out"], expected, rtol=0, atol=0)
