"""Image fidelity to the vanilla model's image: PSNR and SSIM per image, and a mean with a confidence interval.

Images are float tensors (C, H, W) or (B, C, H, W) with values in [0, 1].
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

__all__ = ["psnr", "ssim", "mean_ci", "to_tensor"]

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


def _batch(x: torch.Tensor) -> torch.Tensor:
    return (x[None] if x.dim() == 3 else x).double()


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB per image (data range 1); ``inf`` for identical images."""
    a, b = _batch(a), _batch(b)
    mse = (a - b).pow(2).flatten(1).mean(1)
    return (10 * torch.log10(1.0 / mse)).float()


def _gaussian_window(size: int, sigma: float, channels: int, like: torch.Tensor) -> torch.Tensor:
    coords = torch.arange(size, dtype=like.dtype, device=like.device) - (size - 1) / 2
    g = torch.exp(-coords.pow(2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :]).expand(channels, 1, size, size).contiguous()


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Structural similarity per image (Wang et al. 2004: Gaussian window 11, sigma 1.5, K1 0.01, K2 0.03,
    data range 1), averaged over the valid (unpadded) positions and the channels."""
    a, b = _batch(a), _batch(b)
    channels = a.shape[1]
    window = min(window, a.shape[-1], a.shape[-2])
    w = _gaussian_window(window, sigma, channels, a)
    c1, c2 = 0.01**2, 0.03**2

    def blur(x):
        return F.conv2d(x, w, groups=channels)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return s.flatten(1).mean(1).float()


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


def video_scores(a: torch.Tensor, b: torch.Tensor, frames: int) -> tuple[float, float, float]:
    """For clips stored as frame strips ``(C, H, frames * W)``: (mean per-frame PSNR, mean per-frame SSIM,
    temporal PSNR: the PSNR of ``a``'s frame-to-frame differences against ``b``'s, which falls when motion
    differs even if each frame is close)."""
    fa, fb = torch.stack(a.chunk(frames, -1)), torch.stack(b.chunk(frames, -1))  # (F, C, H, W)
    temporal = float(psnr((fa[1:] - fa[:-1]).flatten(0, 1)[None], (fb[1:] - fb[:-1]).flatten(0, 1)[None]))
    return float(psnr(fa, fb).mean()), float(ssim(fa, fb).mean()), temporal
