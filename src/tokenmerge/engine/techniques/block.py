"""Whole-block ToMe (``scope="block"``): the block's input merged once, the whole block (norms, attention,
feed-forward, modulation) run on the merged tokens, its update unmerged onto the full-resolution residual stream.

    block pre-hook   plan = planner.block_call(x);  x -> m = plan.merge(x)       (B, N, C) -> (B, M, C), rotary rows
                                                                                 and masks at the merged tokens
    block            y_m = block(m)                                              on M tokens
    block hook       y = x + plan.unmerge(y_m - m)                               (B, M, C) -> (B, N, C)

Text and reference tokens in the block's sequence pass whole; a block's other outputs (a text stream) are as
computed. Families declare the block's layout (``families.spec.Whole``); calls whose arguments a whole-block merge
cannot follow (per-token modulation, token counts) are refused with the reason.
"""

from __future__ import annotations

import functools

import torch

from ..call import image_part, sides
from ..discover import bind_whole
from ..planner import Planned, follow

__all__ = ["ToMeWholeBlock"]


class ToMeWholeBlock(Planned):
    """Whole-block ToMe on each patched block.

    Args:
        patch: the installed patch (config, blocks, family, its ``CallHook``, observer).
    """

    name = "ToMe"

    def __init__(self, patch):
        super().__init__(patch)
        self.bound: list[tuple] = []  # per block: its input, rotary, mask, per-token and refusing arguments

    @classmethod
    def refuses_cache(cls, config, is_target: bool) -> str | None:
        return "scope='block' merges the tokens of its block"

    def install(self) -> list:
        """Register the hooks on every patched block; returns their handles."""
        handles = []
        for index, site in enumerate(self.patch.blocks):
            whole, block = site.whole, site.module
            if whole is None:
                raise ValueError(f"tokenmerge: scope='block' is not declared for {site.path} (family "
                                 f"{self.patch.site.family.name}): how its output and per-token arguments are laid out "
                                 "is not known; use scope='attention'")
            self.bound.append(bind_whole(site))
            handles.append(block.register_forward_pre_hook(functools.partial(self.block_pre, index),
                                                           with_kwargs=True))
            handles.append(block.register_forward_hook(functools.partial(self.block_post, index), always_call=True))
        return handles

    def block_pre(self, index: int, block, args, kwargs):
        observer = self.patch.observer
        if observer is not None:
            observer.begin("block")
        call = self.planner.block_call(index, args, kwargs)
        if call is None or call.plan is None or call.plan.num_merged == 0:
            return None
        state, site = self.calls.state, self.patch.blocks[index]
        plan, image = call.plan, call.plan.num_tokens
        arg, rotary, mask, per_token, refuse_if = self.bound[index]
        full = arg.read(args, kwargs)
        split = state.shard.split if state.shard is not None and state.shard.split.block == index else None
        if split is not None:  # diffusers splits this block's input inside its forward (parallel.py)
            full = split.local(full)
        for bound in refuse_if:
            if bound.read(args, kwargs) is not None:
                raise ValueError(f"tokenmerge: {site.path} got {bound.name!r}, which a whole-block merge would make "
                                 "wrong; use scope='attention' for this model")
        for bound, per in per_token:  # per-token modulation (Wan 2.2 TI2V's temb): not declared to follow a merge
            if per.holds(bound.read(args, kwargs), image, full.shape[1]):
                raise ValueError(f"tokenmerge: {site.path} got a per-token {bound.name!r} (one entry per token), "
                                 "which a whole-block merge does not follow; use scope='attention' for this model")
        before, after = sides(full.shape[1], image, site.text, state.trailing)
        joined = plan.merge(full, before, after)  # (B, before + N + after, C) -> (B, before + M + after, C)
        merged = image_part(joined, plan.num_slots, before)
        call.entry = (full, merged, before, after)
        state.work.blocks[index] = call
        if split is not None:  # a sequence whose split at this rank gives the merged slice back
            joined = split.hand_over(joined)
        args, kwargs = arg.replace(args, kwargs, joined)
        if rotary is not None:
            value = rotary.read(args, kwargs)
            if value is not None:
                args, kwargs = rotary.replace(args, kwargs, follow(state, plan, site.whole.rotary, value))
        if mask is not None:
            value = mask.read(args, kwargs)
            if value is not None:
                args, kwargs = mask.replace(args, kwargs, follow(state, plan, site.whole.mask, value))
        return args, kwargs

    def block_post(self, index: int, block, args, output):
        """``x + unmerge(block(merge(x)) - merge(x))`` on the image tokens; the rest of the output as computed."""
        observer = self.patch.observer
        if observer is not None:
            observer.end("block")
        work = self.calls.state.work
        call = work.blocks.pop(index, None) if work is not None else None
        if call is None or output is None:
            return None
        full, merged, before, after = call.entry
        at = None if isinstance(output, torch.Tensor) else self.patch.blocks[index].whole.output  # a tuple: the image
        seq = output if at is None else output[at]  # stream's
        seq = call.plan.unmerge_update(seq, merged, full, before, after)  # full + unmerge(seq - merged): image
        if at is None:
            return seq
        parts = list(output)
        parts[at] = seq
        return type(output)(parts)
