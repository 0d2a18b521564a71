"""The generic engine: finds denoisers and their family, installs the hooks a family spec describes, removes
them exactly. It has no family-specific code: families are data (``tokenmerge.families``)."""

from ..families.spec import BlockSite
from .discover import SUPPORTED, DenoiserSite, find_denoisers, held_modules
from .patch import PATCH_ATTR, DenoiserPatch

__all__ = ["BlockSite", "DenoiserPatch", "DenoiserSite", "PATCH_ATTR", "SUPPORTED", "find_denoisers", "held_modules"]
