"""Image fidelity to the vanilla model's image: PSNR (``tokenmerge.measure``'s, in float) and SSIM per image, a mean
with a confidence interval, and a clip's per-frame and temporal scores.

Images are float tensors (C, H, W) or (B, C, H, W) with values in [0, 1].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..measure import batched, mean_ci, psnr, to_tensor

__all__ = ["psnr", "ssim", "mean_ci", "to_tensor"]


def _gaussian_window(size: int, sigma: float, channels: int, like: torch.Tensor) -> torch.Tensor:
    coords = torch.arange(size, dtype=like.dtype, device=like.device) - (size - 1) / 2
    g = torch.exp(-coords.pow(2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :]).expand(channels, 1, size, size).contiguous()


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Structural similarity per image (Wang et al. 2004: Gaussian window 11, sigma 1.5, K1 0.01, K2 0.03,
    data range 1), averaged over the valid (unpadded) positions and the channels."""
    a, b = batched(a), batched(b)
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


def video_scores(a: torch.Tensor, b: torch.Tensor, frames: int) -> tuple[float, float, float]:
    """For clips stored as frame strips ``(C, H, frames * W)``: (mean per-frame PSNR, mean per-frame SSIM,
    temporal PSNR: the PSNR of ``a``'s frame-to-frame differences against ``b``'s, which falls when motion
    differs even if each frame is close)."""
    fa, fb = torch.stack(a.chunk(frames, -1)), torch.stack(b.chunk(frames, -1))  # (F, C, H, W)
    temporal = float(psnr((fa[1:] - fa[:-1]).flatten(0, 1)[None], (fb[1:] - fb[:-1]).flatten(0, 1)[None]))
    return float(psnr(fa, fb).mean()), float(ssim(fa, fb).mean()), temporal
