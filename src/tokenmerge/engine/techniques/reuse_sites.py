"""Which sub-modules of a block token reuse hooks (``reuse.ReuseBlock``, at install time): its attentions, and with
``keys="fresh"`` its per-token layers (cross-attention, feed-forward, pointwise layers, a separate query projection),
whose inputs a partial step gathers at the recomputed tokens."""

from __future__ import annotations

import dataclasses

from torch import nn

from ...families.spec import JOINT, MLP, SELF, Arg, BlockSite
from ..discover import bind, resolve

__all__ = ["Site", "hooked_sites", "sub_module"]

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
    """The sub-modules of a block that token reuse hooks (``cached``: ``keys="cached"``, its attentions alone: the
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
