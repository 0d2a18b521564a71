"""Pure tensor algorithms of token merging: no model, no diffusers.

Token grids of any rank (images ``(h, w)``, video ``(frames, h, w)``), tokens in raster order. The 2-D API
(``bipartite_soft_matching_2d``, ``downsample_tokens``, ...) wraps the N-D one. ``match`` makes merge plans
(``plan``) from the grid's windows (``windows``: index tables, kept in a ``plan.Tables`` store); ``downsample``
pools a grid (ToDo); ``kernels`` runs a plan's merge and unmerge as Triton kernels (``kernels="triton"``). The
bench's zero-overhead stand-ins (``SlicePlan``, ``slice_match``, ``slice_downsample``) live on the tools' side, in
``tokenmerge.tools.limits``.
"""

from .downsample import downsample, downsample_tokens, pooled_shape, pooled_size
from .kernels import failed as kernels_failed
from .match import (
                    GlobalMatching,
                    LocalMatching,
                    Matching,
                    matching,
                    normalize_radius,
                    random_offsets,
                    window_destinations,
                    window_split,
)
from .plan import TABLES, IdentityPlan, MergePlan, Tables
from .soft_matching import (
                            bipartite_soft_matching,
                            bipartite_soft_matching_2d,
                            local_soft_matching,
                            local_soft_matching_2d,
)
from .windows import num_windows

__all__ = [
    "GlobalMatching", "IdentityPlan", "LocalMatching", "Matching", "MergePlan", "TABLES", "Tables",
    "bipartite_soft_matching", "bipartite_soft_matching_2d", "downsample", "downsample_tokens", "kernels_failed",
    "local_soft_matching", "local_soft_matching_2d", "matching", "normalize_radius", "num_windows", "pooled_shape",
    "pooled_size", "random_offsets", "window_destinations", "window_split",
]
