"""ToDo (token downsampling, arXiv 2402.13573): self-attention's keys and values come from the token grid pooled by
a factor per axis; queries stay whole (or are merged by ToMe too, ``ratio > 0``: ``ToMeAround``'s merge).

Two ways, as the family declares its self-attention (``Target.keys``):

    outside the attention call (UNets, PixArt: keys and values from ``encoder_hidden_states``)
        target pre-hook   encoder_hidden_states = pool(x)          (B, N, C) -> (B, N / f^2, C)
    inside the attention call (Flux, Wan, HunyuanVideo, LTX...: rotary positions applied inside, or joint keys)
        target pre-hook   enter PoolInAttention                    every SDPA call of the target pools the image
        target            keys and values after their projections, norms and rotary embedding
        target hook       leave it (an attention backend that made no SDPA call is an error, never silent)

``PoolInAttention`` is a ``TorchFunctionMode`` that catches ``torch.nn.functional.scaled_dot_product_attention``
(what diffusers' default "native" attention backend and PyTorch's own attention use) and pools the image part of the
keys and values there; text and reference keys pass whole; a key mask is pooled the same way.
"""

from __future__ import annotations

import math

from torch import nn

from ...families.spec import JOINT, SELF
from ..attention import PoolInAttention, backend_refusal, leave
from ..projections import give_to_kv, take_to_kv
from .around import BoundTarget, ToMeAround

__all__ = ["ToDoPool"]

NO_SDPA = ("tokenmerge: ToDo found no scaled_dot_product_attention call in {attr} to pool the keys of: its attention "
           "backend computes attention another way (ToDo pools keys inside the call only with PyTorch's SDPA, "
           "diffusers' default 'native' backend), or a cache hook on it (TaylorSeer, Pyramid Attention Broadcast) "
           "returned an output without computing it, which this ToDo cannot follow: disable one of them")


class ToDoPool(ToMeAround):
    """ToDo on each patched block's self-attention (and ToMe's query merging where ``ratio > 0``)."""

    name = "ToDo"
    pools = True
    inside = "ToDo pools keys"
    target_kinds = (SELF,)  # merged: the queries of self-attention (ratio > 0)
    merger = "ToDo with query merging (ratio > 0)"

    @classmethod
    def check(cls, site, blocks, config) -> None:
        super().check(site, blocks, config)
        if site.family.todo_refused is not None:
            raise ValueError(f"tokenmerge: {site.path or type(site.module).__name__} ({site.family.name}): "
                             f"{site.family.todo_refused}")
        cross = []  # ToDo pools self-attention's keys and values: an attn1 that attends to the text changes nothing
        for block in blocks:
            for spec in block.targets:
                sub = getattr(block.module, spec.attr, None)
                if spec.kind != SELF or not isinstance(sub, nn.Module):
                    continue
                if getattr(block.module, "only_cross_attention", False) or \
                        getattr(block.module, "disable_self_attn", False) or getattr(sub, "is_cross_attention", False):
                    cross.append(f"{block.path}.{spec.attr}")
        if cross:
            shown = ", ".join(cross[:4]) + (f" and {len(cross) - 4} more" if len(cross) > 4 else "")
            raise ValueError(
                f"tokenmerge: ToDo pools the keys and values of self-attention, but {shown} attend"
                f"{'s' if len(cross) == 1 else ''} to the text (a UNet built with only_cross_attention, such as the x4 "
                "upscaler's, or LDM's disable_self_attn): ToDo would change nothing there. Use ToMe (apply_patch), "
                "or leave these blocks out (max_downsample=..., blocks=...)")

    def pooled(self) -> list:
        """The self-attention targets whose keys and values are pooled."""
        return [sub for _, _, _, sub in self.merged_targets(self.config, self.blocks, (SELF,))]

    def install(self) -> list:
        handles = super().install()
        give_to_kv(self.pooled())
        return handles

    def release(self) -> None:
        take_to_kv(self.pooled())
        super().release()

    def __init__(self, patch):
        super().__init__(patch)
        cfg = patch.config
        self.factors, self.mode = cfg.factors(self.planner.rank), cfg.mode
        self.downsample = patch.downsampler

    def bind(self, site, spec, sub) -> BoundTarget:
        """A self-attention pooled outside its attention call (``encoder_hidden_states``) or inside it."""
        inside = spec.keys is not None and spec.kind in (SELF, JOINT)
        cfg = self.patch.config
        if not inside and spec.kind == JOINT:
            raise ValueError(f"tokenmerge: ToDo cannot pool the keys of {site.path}.{spec.attr}: joint attention "
                             f"whose key layout the {self.patch.site.family.name} family does not declare")
        if inside and (cfg.ratio > 0 or (cfg.ratio_end or 0) > 0):
            raise ValueError(f"tokenmerge: ToDo with ratio={cfg.ratio:g} on {self.patch.site.family.name}: its keys "
                             "are pooled inside the attention call from the tokens that call gets, so the queries "
                             "cannot be merged as well; use ratio=0 (or ToMe alone)")
        why = backend_refusal(sub, "ToDo") if inside else None
        if why is not None:
            raise ValueError(f"tokenmerge: {site.path}.{spec.attr}: {why}")
        target = super().bind(site, spec, sub)
        if inside:
            target.inside, target.context = True, None
        elif spec.kind == SELF and target.context is None:
            raise TypeError(f"tokenmerge: {site.path}.{spec.attr} takes no encoder_hidden_states/context argument to "
                            "pass downsampled keys and values through (ToDo)")
        return target

    def target_pre(self, index: int, t: int, module, args, kwargs):
        state = self.calls.state
        call = state.work.blocks.get(index) if state.work is not None else None
        target = self.targets[index][t]
        if call is None:
            return None
        if target.inside:  # after the rotary embedding: pool inside the attention call (ratio is 0 here)
            image = math.prod(call.grid)  # (under Ulysses context parallelism the keys are every rank's: a segment
            segments = 1 if state.shard is None else state.shard.split.ulysses  # per rank)
            call.modes[t] = mode = PoolInAttention(image, call.grid, self.factors, self.mode, target.spec.keys,
                                                   state.trailing, self.downsample, segments)
            mode.open()
            return None
        if target.spec.kind == SELF and target.context.read(args, kwargs) is None:  # keys and values: the pooled grid
            if target.mask is not None and target.mask.read(args, kwargs) is not None:  # of the whole tokens
                raise ValueError(f"tokenmerge: {target.spec.attr} got an attention mask ({target.mask.name}) over "
                                 "image tokens, which ToDo cannot pool; apply the patch with merge_attn=False for "
                                 "this model")
            x = target.arg.read(args, kwargs)
            args, kwargs = target.context.replace(args, kwargs, self.downsample(x, call.grid, self.factors, self.mode))
        if call.plan is None and self.patch.observer is None:  # no query merging (an observer sees the phases)
            return args, kwargs
        return super().target_pre(index, t, module, args, kwargs)  # the queries merged, where ratio > 0

    def target_post(self, index: int, t: int, module, args, output):
        work = self.calls.state.work
        call = work.blocks.get(index) if work is not None else None
        if call is None:
            return None
        if t in call.modes:
            leave(call.modes.pop(t), NO_SDPA.format(attr=self.targets[index][t].spec.attr))
        if call.plan is None and self.patch.observer is None:
            return None
        return super().target_post(index, t, module, args, output)
