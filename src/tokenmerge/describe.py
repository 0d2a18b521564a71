"""What a patch did, in plain words: ``describe_patch`` and its ``PatchInfo`` (the settings, the patched blocks
per denoiser, and notes on what a setting is known not to pay, with pointers to the measurements in docs/gpu.md)."""

from __future__ import annotations

from dataclasses import dataclass

from .engine.install import patches_of

__all__ = ["PatchInfo", "DenoiserInfo", "describe_patch"]


@dataclass(frozen=True)
class DenoiserInfo:
    path: str
    family: str
    class_name: str
    blocks: tuple[tuple[str, int], ...]  # (block path, downsample) of each patched block
    total_blocks: int
    scope: str = ""  # what the technique does to this denoiser's blocks, in words (Technique.scope)


@dataclass(frozen=True)
class PatchInfo:
    """What ``apply_patch`` (or another technique's apply) did: the settings and, per denoiser, the patched blocks;
    ``summary`` is the technique's own line (``Technique.summary``)."""

    config: object
    denoisers: tuple[DenoiserInfo, ...]
    notes: tuple[str, ...] = ()  # where the setting is known not to pay, what it keeps, in plain words
    summary: str = ""
    ran: dict | None = None  # a cache across steps: what its latest generation computed ({"steps", "computed"})

    @property
    def num_blocks(self) -> int:
        return sum(len(d.blocks) for d in self.denoisers)

    def __str__(self) -> str:
        lines = [self.summary or f"tokenmerge: {self.config}"]
        for d in self.denoisers:
            lines.append(f"  {d.path or '<model>'} ({d.class_name}, {d.family}): {d.scope}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def describe_patch(model) -> PatchInfo | None:
    """What is patched in ``model`` (``None`` when nothing is). ``print()`` it for a summary."""
    patches = patches_of(model)
    if not patches:
        return None
    denoisers = tuple(
        DenoiserInfo(p.site.path, p.site.family.name, type(p.site.module).__name__,
                     tuple((b.path, b.downsample) for b in p.blocks), len(p.site.blocks), p.technique.scope())
        for p in patches
    )
    ran = next((r for r in (p.technique.computed_share() for p in patches) if r is not None), None)
    return PatchInfo(patches[0].config, denoisers, _notes(patches), patches[0].technique.summary(), ran)


def _notes(patches) -> tuple[str, ...]:
    """What was chosen and why (``accelerate``), then each technique's notes (``Technique.notes``), each once."""
    notes = []
    for p in patches:
        for note in ([p.chosen] if p.chosen is not None else []) + p.technique.notes():
            if note not in notes:
                notes.append(note)
    return tuple(notes)
