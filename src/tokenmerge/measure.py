"""Measuring a generation the same way everywhere (``tune``, ``quality``, ``bench``): fidelity as PSNR computed in float
(data range 1: never on ``uint8`` arithmetic, which wraps), a mean with its 95% interval, and wall-clock time with
the device synchronised around what is timed."""

from __future__ import annotations

import math
import statistics
import time

import torch

__all__ = ["psnr", "mean_ci", "to_tensor", "batched", "sync", "timed"]

# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; 1.96 (the normal's) beyond
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def to_tensor(image) -> torch.Tensor:
    """A PIL image or an (H, W[, C]) uint8 array as a (C, H, W) float tensor in [0, 1]."""
    import numpy as np

    array = np.asarray(image)
    if array.ndim == 2:
        array = array[..., None]
    return torch.from_numpy(array.astype("float32") / 255.0).permute(2, 0, 1)


def batched(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a batch of images in double precision (a ``(C, H, W)`` image gets a batch axis)."""
    return (x[None] if x.dim() == 3 else x).double()


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB per image (data range 1); ``inf`` for identical images."""
    a, b = batched(a), batched(b)
    mse = (a - b).pow(2).flatten(1).mean(1)
    return (10 * torch.log10(1.0 / mse)).float()


def mean_ci(values) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student's t); half-width nan for one value.

    Infinite values (PSNR of identical images) make the mean infinite and the half-width nan.
    """
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_ci needs at least one value")
    mean = statistics.fmean(values)
    if len(values) < 2 or not all(math.isfinite(v) for v in values):
        return mean, math.nan
    df = len(values) - 1
    t = _T975[df - 1] if df <= len(_T975) else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


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
