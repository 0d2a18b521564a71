"""Fidelity the user sets, verified on the user's own model: ``tune`` searches this library's cache schedules for the
fastest that holds a PSNR target (or the most faithful within a speed) and verifies it on held-out prompts and seeds;
``Tuned`` is its result and its file, which ``accelerate(pipe, setting=...)`` applies."""

from .runs import fidelity
from .search import TuneWarning, run_tune, tune
from .tuned import Tuned

__all__ = ["tune", "run_tune", "Tuned", "TuneWarning", "fidelity"]
