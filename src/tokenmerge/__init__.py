"""tokenmerge: token merging (ToMe) for diffusion models, applied in one line, with no retraining.

A drop-in successor to ``tomesd``: ``import tokenmerge as tomesd`` works, with ``apply_patch`` and
``remove_patch`` meaning what they mean there. diffusers is never imported here.
"""

from .api import (
    BlockPlan,
    PatchInfo,
    apply_config,
    apply_patch,
    apply_reuse,
    apply_todo,
    describe_patch,
    new_generation,
    observe,
    remove_patch,
)
from .api_steps import apply_step_cache, apply_unet_cache
from .config import ReuseConfig, ToDoConfig, ToMeConfig
from .engine.techniques import StepCacheConfig, UNetCacheConfig
from .faithful import accelerate
from .families import Family, register_family, registered_families, unregister_family
from .scoped import patched

__version__ = "0.1.0"

__all__ = [
    "BlockPlan",
    "Family",
    "PatchInfo",
    "ReuseConfig",
    "StepCacheConfig",
    "ToDoConfig",
    "ToMeConfig",
    "UNetCacheConfig",
    "__version__",
    "accelerate",
    "apply_config",
    "apply_patch",
    "apply_reuse",
    "apply_step_cache",
    "apply_todo",
    "apply_unet_cache",
    "describe_patch",
    "new_generation",
    "observe",
    "patched",
    "register_family",
    "registered_families",
    "remove_patch",
    "unregister_family",
]
