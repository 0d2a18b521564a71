"""What a patch did, in plain words: ``describe_patch`` and its ``PatchInfo`` (the settings, the patched blocks
per denoiser, and notes on what a setting is known not to pay, with pointers to the measurements in docs/gpu.md)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .config import ReuseConfig, ToDoConfig, ToMeConfig
from .engine.install import patches_of
from .engine.refusals import merges
from .families.spec import grid_rank

__all__ = ["PatchInfo", "DenoiserInfo", "describe_patch"]


@dataclass(frozen=True)
class DenoiserInfo:
    path: str
    family: str
    class_name: str
    blocks: tuple[tuple[str, int], ...]  # (block path, downsample) of each patched block
    total_blocks: int


@dataclass(frozen=True)
class PatchInfo:
    """What ``apply_patch`` did: the settings and, per denoiser, the patched blocks."""

    config: ToMeConfig | ToDoConfig | ReuseConfig
    denoisers: tuple[DenoiserInfo, ...]
    notes: tuple[str, ...] = ()  # where the setting is known not to pay, in plain words

    @property
    def num_blocks(self) -> int:
        return sum(len(d.blocks) for d in self.denoisers)

    def __str__(self) -> str:
        c = self.config
        if isinstance(c, ReuseConfig):
            end = "" if c.fraction_end is None else f" fraction_end={c.fraction_end:g}"
            lines = [f"tokenmerge token reuse: fraction={c.fraction:g} (recomputed per partial step){end} "
                     f"warmup={c.warmup} every={c.every} keys={c.keys}" + (" text=True" if c.text else "")
                     + f" spread={c.spread:g}" + (f" extrapolate={c.extrapolate:g}" if c.extrapolate else "")
                     + (f" skip={c.skip} (steps skipped a round)" if c.skip else "")
                     + (f" skip_growth={c.skip_growth} (more each round)" if c.skip_growth else "")
                     + f" order={c.order} seed={c.effective_seed}"]
            lines += [f"  {d.path or '<model>'} ({d.class_name}, {d.family}): {len(d.blocks)}/{d.total_blocks} "
                      "transformer blocks patched" for d in self.denoisers]
            return "\n".join(lines + [f"  note: {note}" for note in self.notes])
        head = (f"tokenmerge ToDo patch: downsample={c.downsample} mode={c.mode} query ratio={c.ratio:g} "
                if isinstance(c, ToDoConfig) else f"tokenmerge ToMe patch: ratio={c.ratio:g} ")
        lines = [
            head + f"max_downsample={c.max_downsample} (None = auto) "
            f"sx={c.sx} sy={c.sy}" + (f" st={c.st}" if c.st != 1 else "")
            + f" use_rand={c.use_rand} seed={c.effective_seed} merge: "
            + ", ".join(n for n, on in (("attn", c.merge_attn), ("crossattn", c.merge_crossattn),
                                        ("mlp", c.merge_mlp)) if on)
            + (f" schedule: {c.start:g}..{c.stop:g}" + (f" ratio -> {c.ratio_end:g}" if c.ratio_end is not None
                                                          else "") if c.scheduled else "")
            + (f" kernels={c.kernels}" if c.kernels != "torch" else "")
        ]
        for d in self.denoisers:
            by_level: dict[int, int] = {}
            for _, ds in d.blocks:
                by_level[ds] = by_level.get(ds, 0) + 1
            levels = ", ".join(f"{n} at downsample {ds}" for ds, n in sorted(by_level.items()))
            lines.append(f"  {d.path or '<model>'} ({d.class_name}, {d.family}): "
                         f"{len(d.blocks)}/{d.total_blocks} transformer blocks patched ({levels})")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def describe_patch(model) -> PatchInfo | None:
    """What is patched in ``model`` (``None`` when nothing is). ``print()`` it for a summary."""
    patches = patches_of(model)
    if not patches:
        return None
    denoisers = tuple(
        DenoiserInfo(p.site.path, p.site.family.name, type(p.site.module).__name__,
                     tuple((b.path, b.downsample) for b in p.blocks), len(p.site.blocks))
        for p in patches
    )
    return PatchInfo(patches[0].config, denoisers, _notes(patches))


# what a setting cannot do on a GPU, told by describe_patch
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


def _small_note(p) -> str | None:
    """Which levels of ``p``'s calls ran unmerged for their size (``min_size``), or ``None``."""
    if not p.planner.small:
        return None
    name = p.site.path or type(p.site.module).__name__
    parts = [f"downsample {2 ** level}: {'x'.join(map(str, grid))} tokens x {channels} channels = "
             f"{math.prod(grid) * channels:,} < {smallest:,}"
             for level, (grid, channels, smallest) in sorted(p.planner.small.items())]
    return f"{name}: calls ran unmerged where their hidden states were smaller than min_size ({'; '.join(parts)})"


def _on_cuda(module) -> bool:
    return any(t.device.type == "cuda" for t in itertools.chain(module.parameters(), module.buffers()))


NOTE_TRITON_OFF_CUDA = (
    "kernels='triton' runs its kernels on CUDA tensors in eager mode; this model is not on CUDA, so its merges run "
    "the torch operators (as they do under torch.compile)")


NOTE_REUSE_MEMORY = (
    "token reuse keeps one tensor of each patched block's image output (batch x image tokens x width) from the "
    "first step of a generation to its end, per call of a step (guidance run as two calls keeps two)")
NOTE_REUSE_KEYS = ("keys='cached' keeps the keys and values of every token (text too) of each patched attention as "
                   "well: two more tensors per attention")
NOTE_REUSE_TEXT = "text=True keeps one tensor of each block's text-stream output as well"
NOTE_REUSE_EXTRAPOLATE = ("extrapolate keeps a slope beside each of those tensors (kept residuals, keys and values): "
                          "twice their memory")


def _notes(patches) -> tuple[str, ...]:
    """Plain-language notes on settings known not to pay on a GPU and on calls left unmerged (``PatchInfo.notes``)."""
    notes = []
    for p in patches:
        cfg, family = p.config, p.site.family
        if p.chosen is not None and p.chosen not in notes:
            notes.append(p.chosen)
        if isinstance(cfg, ReuseConfig):
            wanted = [NOTE_REUSE_MEMORY] + [NOTE_REUSE_KEYS] * (cfg.keys == "cached") + [NOTE_REUSE_TEXT] * cfg.text \
                + [NOTE_REUSE_EXTRAPOLATE] * bool(cfg.extrapolate)
            notes += [note for note in wanted if note not in notes]
            continue
        small = _small_note(p)
        if small is not None:
            notes.append(small)
        if cfg.min_size is None and _on_cuda(p.site.module) and NOTE_SMALL_ON_CUDA not in notes:
            notes.append(NOTE_SMALL_ON_CUDA)
        merging = merges(cfg)
        if merging and cfg.kernels == "triton" and not _on_cuda(p.site.module) and NOTE_TRITON_OFF_CUDA not in notes:
            notes.append(NOTE_TRITON_OFF_CUDA)
        if merging and family.kind == "transformer" and grid_rank(family.grid) == 2 \
                and getattr(cfg, "scope", "attention") == "attention" and not cfg.merge_mlp \
                and not isinstance(cfg, ToDoConfig) and NOTE_ATTENTION_ONLY not in notes:
            notes.append(NOTE_ATTENTION_ONLY)
        if merging and family.kind == "transformer" and not cfg.plans_shared(family.kind) \
                and NOTE_PLAN_PER_BLOCK not in notes:
            notes.append(NOTE_PLAN_PER_BLOCK)
    return tuple(notes)
