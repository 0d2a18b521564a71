"""ToMe around a block's sub-modules (tomesd's way): the plan is made from the block's input, each selected
sub-module (a *target*) gets merged tokens and gives back unmerged ones.

    block pre-hook   plan = planner.block_call(block input)            (B, N, C) -> plan of N -> M tokens
                     (``Planner.block_pre``: the planner's own hook)
    target pre-hook  x -> plan.merge(x)                                 (B, N, C) -> (B, M, C), rotary rows and masks
                                                                        at the merged tokens, text passing whole
    target           runs on M tokens
    target hook      out -> plan.unmerge(out)                           (B, M, C) -> (B, N, C)
    block hook       forget the plan

A target's kind (family records, ``families/spec.py``) says how: ``SELF`` and ``MLP`` take the image tokens alone,
``JOINT`` a sequence of image and text tokens (the image merged, the text whole), ``CROSS`` the queries of a
cross-attention. The same hook methods serve torch's module hooks (``install``) and diffusers' ``ModelHook`` chain
(``chain_hook``: below a cache's hook, ``engine/registries.py``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ...families.spec import JOINT, SELF, Arg
from ..call import sides
from ..discover import bind
from ..planner import Planned, follow
from ..registries import ChainHook

__all__ = ["ToMeAround", "BoundTarget"]

_HIDDEN = Arg("hidden_states", also=("x",), fallback_index=0)
_CONTEXT = Arg("encoder_hidden_states", also=("context",))


class BoundTarget:
    """A target of one block, bound to its sub-module's signature."""

    __slots__ = ("spec", "arg", "context", "rotary", "mask", "inside", "same", "twins", "masks")

    def __init__(self, spec, sub: nn.Module, inside: bool = False, context: bool = False):
        named = _bound(sub)
        self.spec, self.arg, self.inside = spec, bind(_HIDDEN, sub), inside
        self.context = bind(_CONTEXT, sub) if context else None  # ToDo's pooled keys and values go there
        self.rotary = bind(Arg(spec.rotary.kwarg, also=spec.rotary.also), sub) if spec.rotary is not None else None
        self.mask = bind(Arg(spec.mask.kwarg if spec.mask is not None else "attention_mask"), sub)
        self.same = named(spec.same)  # arguments that carry the input's very tokens (``Target.same``)
        self.twins = named(spec.rotary.same if spec.rotary else ())  # the very rotary table again (``Rotary.same``)
        self.masks = named(spec.mask.same if spec.mask else ())  # other masks over the same tokens (``Mask.same``)


def _bound(module):
    return lambda names: tuple(b for b in (bind(Arg(n), module) for n in names) if b is not None)


class ToMeAround(Planned):
    """ToMe around the targets of each patched block.

    Args:
        patch: the installed patch (config, blocks, family, its ``CallHook``, observer).
    """

    name = "ToMe"

    def __init__(self, patch):
        super().__init__(patch)
        self.targets: list[list[BoundTarget]] = []  # per block, its bound targets

    # ---- what it merges -------------------------------------------------------------------------------------
    target_kinds: tuple | None = None  # the kinds of target whose tokens are merged (ToDo: self-attention only)

    @classmethod
    def merged_targets(cls, config, blocks, kinds=None):
        """``(block index, target index, path, module)`` of the sub-modules the patch hooks (``kinds``: only those)."""
        for i, site in enumerate(blocks):
            t = 0
            for spec in site.targets:
                sub = getattr(site.module, spec.attr, None)
                if isinstance(sub, nn.Module) and cls.wanted(config, spec.kind):
                    if kinds is None or spec.kind in kinds:
                        yield i, t, f"{site.path}.{spec.attr}", sub
                    t += 1

    @classmethod
    def region(cls, config, blocks) -> list:
        """The merged targets and everything inside them."""
        if not cls.changes(config):
            return []
        return [(f"{path}.{name}" if name else path, module)
                for _, _, path, sub in cls.merged_targets(config, blocks, cls.target_kinds)
                for name, module in sub.named_modules()]

    @classmethod
    def routed(cls, config, blocks) -> dict:
        """Every hooked target: target ``t`` of block ``i`` is the ``t``-th it hooks."""
        return {id(sub): (i, t) for i, t, _, sub in cls.merged_targets(config, blocks)}

    # ---- installation -------------------------------------------------------------------------------------
    def bind(self, site, spec, sub: nn.Module) -> BoundTarget:
        """The target ``spec`` of block ``site`` bound to its sub-module (refused here if it cannot be merged)."""
        if spec.refuse is not None:
            raise ValueError(f"tokenmerge: {site.path}.{spec.attr} cannot take merged tokens: {spec.refuse}")
        return BoundTarget(spec, sub, context=spec.kind == SELF)

    def install(self) -> list:
        """Register the hooks on every patched block and its targets; returns their handles."""
        handles = []
        for index, site in enumerate(self.patch.blocks):
            block = site.module
            bound = []
            for spec in site.targets:
                sub = getattr(block, spec.attr, None)
                if self.wanted(self.config, spec.kind) and isinstance(sub, nn.Module):
                    bound.append(self.bind(site, spec, sub))
            self.targets.append(bound)
            # the block's own hooks are the planner's (its plan for the call); the targets' are the technique's
            handles.append(block.register_forward_pre_hook(functools.partial(self.planner.block_pre, index),
                                                           with_kwargs=True))
            handles.append(block.register_forward_hook(functools.partial(self.planner.block_post, index),
                                                       always_call=True))
            for t, target in enumerate(bound):
                sub = getattr(block, target.spec.attr)
                self.target_handles[(index, t)] = (
                    sub.register_forward_pre_hook(functools.partial(self.target_pre, index, t), with_kwargs=True),
                    sub.register_forward_hook(functools.partial(self.target_post, index, t)))
                handles.extend(self.target_handles[(index, t)])
        return handles

    def chain_hook(self, index: int, t: int) -> ChainHook:
        """This target's hooks as a diffusers ``ModelHook`` (merged from inside the module's hook chain)."""
        return ChainHook(functools.partial(self.target_pre, index, t), functools.partial(self.target_post, index, t))

    # ---- the hooks ----------------------------------------------------------------------------------------
    def target_pre(self, index: int, t: int, module, args, kwargs):
        """The target's input at the merged tokens: its image tokens merged (text and references pass whole), the
        rotary rows and masks following them."""
        observer = self.patch.observer
        if observer is not None:
            observer.begin("merge")
        state = self.calls.state
        call, target = state.work.blocks.get(index) if state.work is not None else None, self.targets[index][t]
        if call is not None and call.plan is not None and call.plan.num_merged:
            plan, spec = call.plan, target.spec
            if target.mask is not None and spec.kind in (SELF, JOINT) and target.mask.read(args, kwargs) is not None \
                    and (spec.mask is None or (target.context is not None and target.context.read(args, kwargs)
                                               is not None)):
                raise ValueError(f"tokenmerge: {spec.attr} got an attention mask ({target.mask.name}) over image "
                                 f"tokens, which the {self.patch.site.family.name} family does not declare to follow; "
                                 "apply the patch with merge_attn=False for this model")
            x = target.arg.read(args, kwargs)  # (B, N, C), or (B, S, C) with text or references beside the image
            if spec.kind == JOINT or x.shape[1] != plan.num_tokens:
                before, after = call.text[t] = sides(x.shape[1], plan.num_tokens, spec.text, state.trailing)
                merged = plan.merge(x, before, after)  # the text and references as they are
                args, kwargs = target.arg.replace(args, kwargs, merged)
                if target.same:  # the same tokens passed again (Lumina's keys): the same merged tokens
                    args, kwargs = self._replace_same(target, target.same, x, merged, "hidden_states", args, kwargs)
            else:
                args, kwargs = target.arg.replace(args, kwargs, plan.merge(x))  # (B, M, C)
            if target.rotary is not None and spec.rotary is not None:
                value = target.rotary.read(args, kwargs)
                if value is not None:
                    taken = follow(state, plan, spec.rotary, value)
                    args, kwargs = target.rotary.replace(args, kwargs, taken)
                    if target.twins:  # the same table under another name (Lumina-Next's key_rotary_emb)
                        args, kwargs = self._replace_same(target, target.twins, value, taken, target.rotary.name,
                                                          args, kwargs)
            if spec.mask is not None:
                for bound in (target.mask, *target.masks):
                    value = bound.read(args, kwargs) if bound is not None else None
                    if value is not None:
                        args, kwargs = bound.replace(args, kwargs, follow(state, plan, spec.mask, value))
        if observer is not None:
            observer.end("merge")
            observer.begin(target.spec.kind)
        return args, kwargs

    def target_post(self, index: int, t: int, module, args, output):
        """The target's output back at every token (its image part; text and references as computed)."""
        observer = self.patch.observer
        if observer is not None:
            observer.end(self.targets[index][t].spec.kind)
            observer.begin("unmerge")
        work = self.calls.state.work
        call = work.blocks.get(index) if work is not None else None
        if call is not None and call.plan is not None and call.plan.num_merged:
            plan, spec = call.plan, self.targets[index][t].spec
            around = call.text.pop(t, None)  # (tokens before, after the image) of a joint sequence
            before, after = around or (0, 0)
            image = output
            if isinstance(output, (tuple, list)) and around is not None:  # (image stream, text stream[, ...])
                image = output[spec.output_image]
            elif not isinstance(output, torch.Tensor):
                raise TypeError(f"tokenmerge: {spec.attr} returned a {type(output).__name__}, expected a tensor "
                                "to unmerge")
            heads = image.shape[2:] if spec.per_head else None  # (B, M, heads, head_dim): unmerged as (B, M, C)
            if heads is not None:
                image = image.flatten(2)
            image = plan.unmerge(image, before, after)
            if heads is not None:
                image = image.unflatten(2, heads)
            if isinstance(output, (tuple, list)):
                parts = list(output)
                parts[spec.output_image] = image
                output = type(output)(parts)
            else:
                output = image
        if observer is not None:
            observer.end("unmerge")
        return output

    def _replace_same(self, target: BoundTarget, bounds, old, new, what: str, args, kwargs):
        """Each argument of ``bounds`` that is ``old`` itself becomes ``new``; one that is another tensor is an
        error (the family declares it to be the same)."""
        for bound in bounds:
            value = bound.read(args, kwargs)
            if value is old:
                args, kwargs = bound.replace(args, kwargs, new)
            elif value is not None:
                raise ValueError(f"tokenmerge: {target.spec.attr} got a {bound.name} that is not its {what}, "
                                 f"which the {self.patch.site.family.name} family declares it to be")
        return args, kwargs
