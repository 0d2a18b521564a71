"""Token reuse (``tokenmerge.apply_reuse``), one technique in one folder: ``block.py`` (``TokenReuse``: its call's
set-up and its block and sub-module hooks), ``state.py`` (what a branch keeps, the round-robin, one call's and one
block's state), ``sites.py`` (which sub-modules it hooks, its apply-time refusals, its notes). Its tensor code is
``merge/recompute.py``; its attention modes (``QueryRows``, ``CachedKeys``) are ``engine/attention.py``'s."""

from .block import TokenReuse

__all__ = ["TokenReuse"]
