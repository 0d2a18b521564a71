"""The techniques, each a class of the protocol (``engine/technique.py``) whose hooks read merge -> work -> unmerge:

- ``around.ToMeAround``: ToMe around a block's sub-modules (self-attention, joint text+image attention,
  cross-attention's queries, the feed-forward): the plan from the block's input, each sub-module's input merged,
  its output unmerged.
- ``block.ToMeWholeBlock``: whole-block ToMe (``scope="block"``): the block's input merged once, the whole block run on
  the merged tokens, its update unmerged onto the residual stream.
- ``todo.ToDoPool``: ToDo: self-attention's keys and values pooled from the token grid (given as
  ``encoder_hidden_states``, or inside the attention call), queries merged too when ``ratio > 0``.
- ``reuse.TokenReuse``: token reuse: a share of the tokens recomputed at each partial step, the others' block
  residuals kept from their last computation.
- ``step_cache.StepCache``: the step cache: some steps computed, the others run no block at all and take the stack's
  kept residual, moved along its slope.
- ``unet_cache.UNetCache``: the UNet cache: some steps computed, the others run a UNet's shallow path only and take
  the deep path's output from the last computed step (DeepCache).

Each config class has one technique (``technique.technique_for``), registered here.
"""

from __future__ import annotations

from ...config import ReuseConfig, ToDoConfig, ToMeConfig
from ..technique import register_technique
from .around import ToMeAround
from .block import ToMeWholeBlock
from .reuse import TokenReuse
from .step_cache import StepCache, StepCacheConfig
from .todo import ToDoPool
from .unet_cache import UNetCache, UNetCacheConfig

__all__ = ["ToMeAround", "ToMeWholeBlock", "ToDoPool", "TokenReuse", "StepCache", "StepCacheConfig", "UNetCache",
           "UNetCacheConfig"]

register_technique(ToMeConfig, lambda config: ToMeWholeBlock if config.scope == "block" else ToMeAround)
register_technique(ToDoConfig, lambda config: ToDoPool if config.pools else ToMeAround)
register_technique(ReuseConfig, lambda config: TokenReuse)
register_technique(StepCacheConfig, lambda config: StepCache)
register_technique(UNetCacheConfig, lambda config: UNetCache)
