"""tokenmerge: diffusion models generate faster, faithfully, with no retraining: ``accelerate(pipe)`` picks a cache
across steps (the step cache on transformers, the UNet cache on UNets), ``tune`` measures one on your model for the
fidelity you set; token merging (ToMe), token downsampling (ToDo), whole-block merging and token reuse on their own.

A drop-in successor to ``tomesd``: ``import tokenmerge as tomesd`` works, with ``apply_patch`` and
``remove_patch`` meaning what they mean there. diffusers is never imported here.
"""

from .accelerate import accelerate
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
from .engine.tuned_for import TunedSettingWarning
from .families import Family, register_family, registered_families, unregister_family
from .patched import patched
from .tuning import Tuned, TuneWarning, tune
from .version import __version__

__all__ = [
    "BlockPlan",
    "Family",
    "PatchInfo",
    "ReuseConfig",
    "StepCacheConfig",
    "ToDoConfig",
    "ToMeConfig",
    "TuneWarning",
    "Tuned",
    "TunedSettingWarning",
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
    "tune",
    "unregister_family",
]
