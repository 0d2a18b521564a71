"""More model families (filled in group by group; layout facts: docs/family-facts.md)."""

from __future__ import annotations

__all__ = ["FAMILIES", "REFUSED"]

FAMILIES: tuple = ()
REFUSED: tuple = ()
