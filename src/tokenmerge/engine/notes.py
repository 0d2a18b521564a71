"""``describe_patch``'s notes on ToMe and ToDo (``planner.Planned.notes``): calls left unmerged for their size, and
settings known not to pay on a GPU, with pointers to the measurements in docs/gpu.md."""

from __future__ import annotations

import itertools
import math

from ..families.spec import grid_rank

__all__ = ["planned", "NOTE_ATTENTION_ONLY", "NOTE_PLAN_PER_BLOCK", "NOTE_SMALL_ON_CUDA", "NOTE_TRITON_OFF_CUDA"]

NOTE_ATTENTION_ONLY = (
    "merging around attention alone saves little on an image transformer at 1024 px and below: attention is a "
    "small part of its step on a GPU, so the merge overhead can make the step slower there (docs/gpu.md); "
    "scope='block' (the whole block on merged tokens) or apply_todo(...) save more, and the gain of this setting "
    "grows with the image size")
NOTE_PLAN_PER_BLOCK = (
    "share_plans=False: each merged block builds its own plan; run eagerly on a GPU, its small kernels cost host "
    "time that a denoiser step near 1024 px does not hide (docs/gpu.md: slower than one plan per level, the "
    "transformers' default), or compile the model (torch.compile), which removes the launch overhead")
NOTE_SMALL_ON_CUDA = (
    "min_size=None: on CUDA, a block's call whose hidden states hold fewer than 4096 x 1024 elements per sample "
    "(tokens x channels) runs unmerged, since smaller calls were no faster merged on the GPU table (docs/gpu.md); "
    "min_size=0 merges every call")
NOTE_TRITON_OFF_CUDA = (
    "kernels='triton' runs its kernels on CUDA tensors in eager mode; this model is not on CUDA, so its merges run "
    "the torch operators (as they do under torch.compile)")


def _small_note(technique) -> str | None:
    """Which levels of the patch's calls ran unmerged for their size (``min_size``), or ``None``."""
    small = technique.planner.small
    if not small:
        return None
    site = technique.patch.site
    name = site.path or type(site.module).__name__
    parts = [f"downsample {2 ** level}: {'x'.join(map(str, grid))} tokens x {channels} channels = "
             f"{math.prod(grid) * channels:,} < {smallest:,}"
             for level, (grid, channels, smallest) in sorted(small.items())]
    return f"{name}: calls ran unmerged where their hidden states were smaller than min_size ({'; '.join(parts)})"


def _on_cuda(module) -> bool:
    return any(t.device.type == "cuda" for t in itertools.chain(module.parameters(), module.buffers()))


def planned(technique) -> list[str]:
    """The notes of one ToMe or ToDo patch."""
    cfg, family, module = technique.config, technique.patch.site.family, technique.patch.site.module
    notes = [n for n in [_small_note(technique)] if n is not None]
    if cfg.min_size is None and _on_cuda(module):
        notes.append(NOTE_SMALL_ON_CUDA)
    merging = technique.changes(cfg)
    if merging and cfg.kernels == "triton" and not _on_cuda(module):
        notes.append(NOTE_TRITON_OFF_CUDA)
    if merging and family.kind == "transformer" and grid_rank(family.grid) == 2 and cfg.merges_around_attention_only:
        notes.append(NOTE_ATTENTION_ONLY)
    if merging and family.kind == "transformer" and not cfg.plans_shared(family.kind):
        notes.append(NOTE_PLAN_PER_BLOCK)
    return notes
