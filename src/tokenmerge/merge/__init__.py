"""Pure tensor algorithms of token merging: no model, no diffusers."""

from .bipartite import bipartite_soft_matching_2d, random_offsets, window_destinations
from .plan import IdentityPlan, MergePlan

__all__ = ["IdentityPlan", "MergePlan", "bipartite_soft_matching_2d", "random_offsets", "window_destinations"]
