"""Wall-clock timing with the device synchronised around what is timed (shared by ``bench`` and ``quality``; the
core's ``tokenmerge.measure``)."""

from __future__ import annotations

from ..measure import sync, timed

__all__ = ["sync", "timed"]
