"""Pure tensor algorithms of token merging: no model, no diffusers.

Token grids of any rank (images ``(h, w)``, video ``(frames, h, w)``), tokens in raster order. The 2-D API
(``bipartite_soft_matching_2d``, ``downsample_tokens``, ...) wraps the N-D one.
The bench's zero-overhead stand-ins (``SlicePlan``, ``slice_match``, ``slice_downsample``) live on the tools' side,
in ``tokenmerge.tools.limits``.
"""

from .bipartite import bipartite_soft_matching, bipartite_soft_matching_2d, normalize_radius
from .downsample import downsample, downsample_tokens, pooled_shape, pooled_size
from .local import local_soft_matching, local_soft_matching_2d
from .plan import IdentityPlan, MergePlan
from .windows import num_windows, random_offsets, window_destinations, window_split

__all__ = [
    "IdentityPlan", "MergePlan", "bipartite_soft_matching", "bipartite_soft_matching_2d", "downsample",
    "downsample_tokens", "local_soft_matching", "local_soft_matching_2d", "normalize_radius", "num_windows",
    "pooled_shape", "pooled_size", "random_offsets", "window_destinations", "window_split",
]
