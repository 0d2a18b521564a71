"""The engine: finds the denoisers in what a user holds (``discover``), installs one ``Patch`` per denoiser
(``install``): a hook on the denoiser that reads each call's grid (``call``), a technique's hooks on its blocks
(``techniques``) that ask the ``planner`` for merge plans, and the guards (``refusals``, ``caches``, ``compiled``,
``projections``). Nothing here knows a family by name: the family records (``tokenmerge.families``) say it all."""

from .discover import HOLDER_PATHS, SUPPORTED, DenoiserSite, find_denoisers, held_modules
from .install import PATCH_ATTR, Patch

__all__ = ["Patch", "PATCH_ATTR", "DenoiserSite", "find_denoisers", "held_modules", "SUPPORTED", "HOLDER_PATHS"]
