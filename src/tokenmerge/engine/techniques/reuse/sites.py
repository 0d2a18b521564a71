"""Which sub-modules of a block token reuse hooks (``reuse.TokenReuse``, at install time): its attentions, and with
``keys="fresh"`` its per-token layers (cross-attention, feed-forward, pointwise layers, a separate query projection),
whose inputs a partial step gathers at the recomputed tokens."""

from __future__ import annotations

import dataclasses

from torch import nn

from ....families.spec import JOINT, MLP, SELF, TEXT_BEFORE, TEXT_NONE, Arg, BlockSite
from ...attention import backend_refusal
from ...discover import bind, resolve

__all__ = ["Site", "hooked_sites", "sub_module", "check", "NOTE_MEMORY", "NOTE_KEYS", "NOTE_TEXT", "NOTE_EXTRAPOLATE"]


NOTE_MEMORY = (
    "token reuse keeps one tensor of each patched block's image output (batch x image tokens x width) from the "
    "first step of a generation to its end, per call of a step (guidance run as two calls keeps two)")
NOTE_KEYS = ("keys='kept' keeps the keys and values of every token (text too) of each patched attention as well: "
             "two more tensors per attention")
NOTE_TEXT = "text=True keeps one tensor of each block's text-stream output as well"
NOTE_EXTRAPOLATE = ("extrapolate keeps a slope beside each of those tensors (kept residuals, keys and values): twice "
                    "their memory")

HIDDEN = Arg("hidden_states", also=("x",), fallback_index=0)


@dataclasses.dataclass(frozen=True)
class Site:
    """A hooked sub-module of a block (optional: a query projection, passed untouched off its attention's layout)."""

    spec: object
    arg: object
    attention: bool
    optional: bool = False


def sub_module(block: nn.Module, attr: str) -> nn.Module | None:
    """The sub-module of ``block`` at the dotted ``attr``, or ``None``."""
    return sub if isinstance(sub := resolve(block, attr), nn.Module) else None


def hooked_sites(site: BlockSite, cached: bool) -> list[Site]:
    """The sub-modules of a block that token reuse hooks (``cached``: ``keys="kept"``, its attentions alone: the
    whole block runs on the recomputed tokens)."""
    sites = []
    for spec in (*site.targets, *site.pointwise):
        sub = sub_module(site.module, spec.attr)
        if sub is None:
            continue
        attention = spec.kind in (SELF, JOINT) and spec in site.targets
        if cached and not attention:
            continue
        sites.append(Site(spec, bind(HIDDEN, sub), attention))
        query = sub_module(sub, spec.query) if attention and spec.query and not cached else None
        if query is not None:  # the queries of the tokens that are not recomputed are never attended
            sites.append(Site(dataclasses.replace(spec, attr=f"{spec.attr}.{spec.query}", kind=MLP),
                              bind(HIDDEN, query), False, optional=True))
    return sites


def check(site, blocks, config) -> None:
    """Refuse, with the reason, a denoiser whose blocks token reuse cannot follow."""
    name = f"{site.path or type(site.module).__name__} ({site.family.name})"
    if site.timestep is None:
        raise TypeError(f"tokenmerge: {name} takes no timestep argument, which token reuse needs to tell the "
                        "denoising steps apart")
    for block in blocks:
        if block.whole is None:
            raise ValueError(f"tokenmerge: token reuse needs to know where {block.path} returns its image tokens "
                             f"(its family {site.family.name} declares no whole-block layout), so it cannot "
                             "patch this model")
        if block.seq_first:
            raise ValueError(f"tokenmerge: token reuse does not support the sequence-first blocks of {name}")
        if not any(t.kind in (SELF, JOINT) for t in block.targets):
            raise ValueError(f"tokenmerge: {block.path} declares no attention over its image tokens, which token "
                             "reuse needs")
        for spec in block.targets:
            if spec.refuse is not None:  # a sub-module that mixes tokens (a convolution over the grid, MoE routing)
                raise ValueError(f"tokenmerge: token reuse cannot patch {block.path}: its {spec.attr} mixes "
                                 f"tokens outside attention ({spec.refuse})")
            if spec.reuse is not None and config.keys == "fresh":
                raise ValueError(f"tokenmerge: token reuse with keys='fresh' cannot patch {block.path}: "
                                 f"{spec.reuse}; keys='kept' runs the whole block on the recomputed tokens")
            sub = resolve(block.module, spec.attr)
            why = backend_refusal(sub, "token reuse") if spec.kind in (SELF, JOINT) and \
                isinstance(sub, nn.Module) else None
            if why is not None:
                raise ValueError(f"tokenmerge: {block.path}.{spec.attr}: {why}")
    if config.text:
        _check_text(site, blocks)


def _check_text(site, blocks) -> None:
    """``text=True``: refuse blocks none of which has a separate text stream whose rows lead its rotary table."""
    streams = [b for b in blocks if b.whole.text is not None and bind(Arg(b.whole.text), b.module) is not None]
    if not streams:
        raise ValueError(f"tokenmerge: token reuse's text=True recomputes part of a separate text stream, and the "
                         f"blocks of {site.family.name} have none that it knows of (Flux.1 and its kin do); leave "
                         "text=False")
    for b in streams:
        rotary = b.whole.rotary
        if rotary is not None and (rotary.layout != "tensor" or rotary.text != TEXT_BEFORE):
            raise ValueError(f"tokenmerge: token reuse's text=True cannot follow the rotary table of {b.path} "
                             "(its text rows do not lead one tensor); leave text=False")
        if any(t.kind in (SELF, JOINT) and t.keys not in (TEXT_BEFORE, TEXT_NONE) for t in b.targets):
            raise ValueError(f"tokenmerge: token reuse's text=True recomputes text rows that lead the attention's "
                             f"keys, and {b.path}'s attention puts the text after the image; leave text=False")
