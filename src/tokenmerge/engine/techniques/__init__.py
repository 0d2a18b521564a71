"""The techniques: each one hook object, chosen at install time, whose hooks read merge -> work -> unmerge.

- ``around.MergeAround``: ToMe around a block's sub-modules (self-attention, joint text+image attention,
  cross-attention's queries, the feed-forward): the plan from the block's input, each sub-module's input merged,
  its output unmerged.
- ``block.MergeBlock``: whole-block ToMe (``scope="block"``): the block's input merged once, the whole block run on
  the merged tokens, its update unmerged onto the residual stream.
- ``todo.PoolKeys``: ToDo: self-attention's keys and values pooled from the token grid (given as
  ``encoder_hidden_states``, or inside the attention call), queries merged too when ``ratio > 0``.
- ``reuse.ReuseBlock``: token reuse: a share of the tokens recomputed at each partial step, the others' block
  residuals kept from their last computation.

Each has ``plans`` (whether it merges by the planner's plans), ``pools`` (ToDo: a call too small to merge still
pools), ``install()`` and its hooks; what it cannot patch it refuses in a static ``check(site, blocks, config)``.
"""

from __future__ import annotations

from ...config import ReuseConfig, ToDoConfig
from .around import MergeAround
from .block import MergeBlock
from .reuse import ReuseBlock
from .todo import PoolKeys

__all__ = ["MergeAround", "MergeBlock", "PoolKeys", "ReuseBlock", "technique_for"]


def technique_for(config) -> type:
    """The technique class of a config."""
    if isinstance(config, ReuseConfig):
        return ReuseBlock
    if isinstance(config, ToDoConfig) and config.pools:
        return PoolKeys
    if getattr(config, "scope", "attention") == "block":
        return MergeBlock
    return MergeAround
