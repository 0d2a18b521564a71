"""The hooks on a block's target sub-modules: merge their input (and the rotary rows, masks and text beside the
image tokens), pool keys and values for ToDo, unmerge their output. A mixin of ``DenoiserPatch``."""

from __future__ import annotations

import math

import torch

from ..families.spec import JOINT, SELF
from .inside import PoolKeys
from .layout import image_part, join, sides, take_mask, take_rotary
from .state import BlockCall, SharedPlan

__all__ = ["Bound", "TargetHooks", "COMPILE_REFUSED"]

COMPILE_REFUSED = (
    "tokenmerge: ToDo that pools keys inside the attention call (this family's) does not work under torch.compile "
    "yet; run the model eagerly, or use ToMe (apply_patch), which compiles")


class Bound:
    """A target of one block, bound to its sub-module's signature."""

    __slots__ = ("spec", "arg", "context", "rotary", "mask", "inside", "same", "twins", "masks")

    def __init__(self, spec, arg, context, rotary, mask, inside=False, same=(), twins=(), masks=()):
        self.spec, self.arg, self.context, self.rotary, self.mask = spec, arg, context, rotary, mask
        self.inside = inside  # ToDo pools the keys inside the attention call (engine/inside.py)
        self.same = same  # bound arguments that carry the input's very tokens (``Target.same``)
        self.twins = twins  # bound arguments that carry the very rotary table again (``Rotary.same``)
        self.masks = masks  # bound arguments that are other masks over the same tokens (``Mask.same``)


class TargetHooks:
    """Forward pre-hooks / hooks of the targets (``self._targets[block][target]``: ``Bound`` records)."""
    def _merge_input(self, index: int, t: int, module, args, kwargs):
        if self.observer is None:
            return self._merge_now(index, t, args, kwargs)
        self.observer.begin("merge")
        out = self._merge_now(index, t, args, kwargs)
        self.observer.end("merge")
        self.observer.begin(self._targets[index][t].spec.kind)
        return out

    def _merge_now(self, index: int, t: int, args, kwargs):
        call = self.state.blocks.get(index)
        if call is None:
            return None
        plan, target = call.plan, self._targets[index][t]
        kind = target.spec.kind
        if target.inside and torch.compiler.is_compiling():
            raise ValueError(COMPILE_REFUSED)
        if target.inside:  # ToDo after the rotary embedding: pool inside the attention call (ratio is 0 here)
            call.inside[t] = mode = PoolKeys(plan.num_tokens if plan.num_merged else math.prod(call.grid), call.grid,
                                             self.factors, self.config.mode, target.spec.keys, self.state.trailing,
                                             self.downsampler, _segments(self.state))
            mode.__enter__()
            return None
        context = target.context.read(args, kwargs) if target.context is not None else None
        pool = self.todo and kind == SELF and context is None
        if plan.num_merged == 0 and not pool:
            return None
        masked = target.mask is not None and kind in (SELF, JOINT) and target.mask.read(args, kwargs) is not None
        if masked and (target.spec.mask is None or pool or (kind == SELF and context is not None)):
            raise ValueError(
                f"tokenmerge: {target.spec.attr} got an attention mask ({target.mask.name}) over image tokens, which "
                + ("ToDo cannot pool" if pool else f"the {self.family.name} family does not declare to follow")
                + "; apply the patch with merge_attn=False for this model")
        x = target.arg.read(args, kwargs)
        if kind == JOINT or (plan.num_merged and x.shape[1] != plan.num_tokens):  # text or references beside it
            return self._merge_joint(call, t, target, x, args, kwargs)
        if pool:  # ToDo: keys and values from the pooled grid of the full (unmerged) tokens
            pooled = self.downsampler(x, call.grid, self.factors, self.config.mode)
            args, kwargs = target.context.replace(args, kwargs, pooled)
        if plan.num_merged:
            args, kwargs = target.arg.replace(args, kwargs, plan.merge(x))
            args, kwargs = self._follow_rotary(plan, target, args, kwargs)
        return args, kwargs

    def _merge_joint(self, call: BlockCall, t: int, target: Bound, x: torch.Tensor, args, kwargs):
        """A sequence of image and text tokens (joint attention, or a feed-forward run on both): merge the image
        tokens (the text passes whole) and the rotary rows with them."""
        plan, spec = call.plan, target.spec
        before, after = call.text[t] = sides(x.shape[1], plan.num_tokens, spec.text, self.state.trailing)
        image = image_part(x, plan.num_tokens, before)
        merged = join(x, plan.merge(image), before, after)
        args, kwargs = target.arg.replace(args, kwargs, merged)
        # the same tokens passed again (Lumina's keys): the same merged tokens
        args, kwargs = self._replace_same(target, target.same, x, merged, "hidden_states", args, kwargs)
        return self._follow_rotary(plan, target, args, kwargs)

    def _replace_same(self, target: Bound, bounds, old, new, what: str, args, kwargs):
        """Each argument of ``bounds`` that is ``old`` itself becomes ``new``; one that is another tensor is an
        error (the family declares it to be the same)."""
        for bound in bounds:
            value = bound.read(args, kwargs)
            if value is old:
                args, kwargs = bound.replace(args, kwargs, new)
            elif value is not None:
                raise ValueError(f"tokenmerge: {target.spec.attr} got a {bound.name} that is not its {what}, "
                                 f"which the {self.family.name} family declares it to be")
        return args, kwargs

    def _follow_rotary(self, plan, target: Bound, args, kwargs):
        """The target's rotary embedding and attention mask at the merged tokens (each keeps its first token's)."""
        for bound, spec, take in ((target.rotary, target.spec.rotary, take_rotary),
                                  (target.mask, target.spec.mask, take_mask),
                                  *((b, target.spec.mask, take_mask) for b in target.masks)):
            value = bound.read(args, kwargs) if bound is not None and spec is not None else None
            if value is None:
                continue
            if not isinstance(plan, SharedPlan):
                raise ValueError(f"tokenmerge: {target.spec.attr} takes per-token positions or masks, which need "
                                 f"one merge pattern for the batch: family {self.family.name!r} must set "
                                 "shared_plan=True")
            taken = plan.take(take, spec, value, self.state.trailing)
            args, kwargs = bound.replace(args, kwargs, taken)
            if take is take_rotary:  # the same table under another name (Lumina-Next's key_rotary_emb)
                args, kwargs = self._replace_same(target, target.twins, value, taken, bound.name, args, kwargs)
        return args, kwargs

    def _unmerge_output(self, index: int, t: int, module, args, output):
        if self.observer is None:
            return self._unmerge_now(index, t, output)
        self.observer.end(self._targets[index][t].spec.kind)
        self.observer.begin("unmerge")
        out = self._unmerge_now(index, t, output)
        self.observer.end("unmerge")
        return out

    def _unmerge_now(self, index: int, t: int, output):
        call = self.state.blocks.get(index)
        if call is not None and t in call.inside:
            mode = call.inside.pop(t)
            mode.__exit__(None, None, None)
            if mode.calls == 0:
                raise ValueError(
                    f"tokenmerge: ToDo found no scaled_dot_product_attention call in {self._targets[index][t].spec.attr}"
                    " to pool the keys of: its attention backend computes attention another way (ToDo pools keys "
                    "inside the call only with PyTorch's SDPA, diffusers' default 'native' backend), or a cache "
                    "hook on it (TaylorSeer, Pyramid Attention Broadcast) returned an output without computing it, "
                    "which this ToDo cannot follow: disable one of them")
        if call is None or call.plan.num_merged == 0:
            return None
        plan, spec = call.plan, self._targets[index][t].spec
        around = call.text.pop(t, None)
        if around is not None:
            if isinstance(output, (tuple, list)):  # (image stream, text[, ...]): only the image part is unmerged
                parts = list(output)
                parts[spec.output_image] = _unmerge_part(plan, parts[spec.output_image], *around)
                return type(output)(parts)
            return _unmerge_part(plan, output, *around)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"tokenmerge: {spec.attr} returned a {type(output).__name__}, expected a tensor "
                            "to unmerge")
        return _unmerge(plan, output)


def _segments(state) -> int:
    """Under Ulysses context parallelism an attention call gets the keys of every rank, one segment each."""
    return 1 if state.shard is None else state.shard.split.ulysses


def _unmerge(plan, x: torch.Tensor) -> torch.Tensor:
    """``plan.unmerge`` of (B, M, C), or of per-head outputs (B, M, heads, head_dim) (Lumina-Next's attentions)."""
    if x.dim() > 3:
        return plan.unmerge(x.flatten(2)).unflatten(2, x.shape[2:])
    return plan.unmerge(x)


def _unmerge_part(plan, x: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """Unmerge the image tokens of a sequence that also holds ``before`` / ``after`` other tokens."""
    if not (before or after):
        return _unmerge(plan, x)
    return join(x, _unmerge(plan, image_part(x, x.shape[1] - before - after, before)), before, after)
