"""Whole-block merging (``scope="block"``): merge a block's input once, run the whole block on the merged tokens,
unmerge its update onto the residual stream. A mixin of ``DenoiserPatch``."""

from __future__ import annotations

import torch

from ..families.spec import BlockSite
from .layout import image_part, join, sides, take_mask, take_rotary
from .state import BlockCall, SharedPlan

__all__ = ["WholeBlocks"]


class WholeBlocks:
    """``_merge_block`` at a block's forward pre-hook, ``_unmerge_block`` at its forward hook."""
    def _merge_block(self, index: int, site: BlockSite, call: BlockCall, args, kwargs):
        """Merge the block's input (its image part) and the per-token arguments that follow it."""
        plan, image = call.plan, call.plan.num_tokens
        rotary, mask, per_token, refuse_if = self._wholes[index]
        full = self._inputs[index].read(args, kwargs)
        shard = self.state.shard
        split = shard.split if shard is not None and shard.split.block == index else None
        if split is not None:  # diffusers splits this block's input inside its forward (parallel.py)
            full = split.local(full)
        for bound in refuse_if:
            if bound.read(args, kwargs) is not None:
                raise ValueError(f"tokenmerge: {site.path} got {bound.name!r}, which a whole-block merge would make "
                                 "wrong; use scope='attention' for this model")
        for bound in per_token:
            value = bound.read(args, kwargs)
            # per-token modulation: (B, N, 6, D) (Wan 2.2 TI2V) or (B, 6, N, D) (SkyReels-V2 diffusion forcing)
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and (value.shape[1] in (image, full.shape[1]) or (
                    value.dim() >= 4 and value.shape[2] in (image, full.shape[1]))):
                raise ValueError(f"tokenmerge: {site.path} got a per-token {bound.name!r} (one entry per token), "
                                 "which a whole-block merge does not follow; use scope='attention' for this model")
        before, after = sides(full.shape[1], image, site.text, self.state.trailing)
        part = image_part(full, image, before)
        merged = plan.merge(part)
        call.entry = (part, merged, before, after)
        joined = join(full, merged, before, after)
        if split is not None:  # a sequence whose split at this rank gives the merged slice back
            joined = split.hand_over(joined)
        args, kwargs = self._inputs[index].replace(args, kwargs, joined)
        for bound, spec, take in ((rotary, site.whole.rotary, take_rotary), (mask, site.whole.mask, take_mask)):
            value = bound.read(args, kwargs) if bound is not None else None
            if value is not None:
                if not isinstance(plan, SharedPlan):
                    raise ValueError(f"tokenmerge: {site.path} takes per-token positions or masks, which need one "
                                     f"merge pattern for the batch: family {self.family.name!r} must set "
                                     "shared_plan=True")
                args, kwargs = bound.replace(args, kwargs, plan.take(take, spec, value, self.state.trailing))
        return args, kwargs

    def _unmerge_block(self, call: BlockCall, site: BlockSite, output):
        """``x + unmerge(block(merge(x)) - merge(x))`` on the image tokens; the rest of the output as computed."""
        part, merged, before, after = call.entry
        index = None if isinstance(output, torch.Tensor) else site.whole.output  # a tuple: the image stream's
        seq = output if index is None else output[index]
        update = image_part(seq, merged.shape[1], before) - merged
        seq = join(seq, part + call.plan.unmerge(update), before, after)
        if index is None:
            return seq
        parts = list(output)
        parts[index] = seq
        return type(output)(parts)
