"""Wall-clock timing with the device synchronised around what is timed (shared by ``bench`` and ``quality``)."""

from __future__ import annotations

import time

import torch

__all__ = ["sync", "timed"]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA, MPS); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(device: torch.device, fn, *args):
    """``(fn(*args), seconds)``, the device synchronised before and after.

    Example:
        >>> out, seconds = timed(torch.device("cpu"), sum, [1, 2, 3])
    """
    sync(device)
    start = time.perf_counter()
    out = fn(*args)
    sync(device)
    return out, time.perf_counter() - start
