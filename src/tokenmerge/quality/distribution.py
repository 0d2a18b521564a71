"""A distribution metric for the embedded Fashion-MNIST models, as the founding documents' FID: a Fréchet distance
in the features of the shipped Fashion-MNIST classifier, and that classifier's accuracy on the generated images
against their prompts (prompt adherence).

Each generated image is cut into the 32 x 32 crops the classifier reads: the whole image (the 32 px models), each
of the 4 cells of a mosaic (``fashion-mosaic``), each frame of a clip (the video models). A crop's expected label
comes from the prompt: the class it names, or for a mosaic the class the sentence puts in that cell ("no item"
for a cell it does not name).

- **FD**: the Fréchet distance between the Gaussian of the generated crops' 64 penultimate features and the
  Gaussian of real data with the same labels (a mixture of the per-class statistics of the test split shipped with
  the classifier: each class weighted by how often the prompts ask for it). Lower is closer to real data. Like FID
  it is biased upwards at small sample sizes: compare methods at the same prompts and seeds, vanilla's value first.
- **adherence**: the share of crops the classifier labels as the prompt asks, per image, then averaged over images.

The Fréchet distance ``|mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^(1/2))`` takes the trace of the matrix square
root from the eigenvalues of the symmetric ``S1^(1/2) S2 S1^(1/2)`` (float64 ``torch.linalg.eigh``; the same
eigenvalues as ``S1 S2``, as torchmetrics computes FID), which needs no scipy.
"""

from __future__ import annotations

import torch

from .metrics import mean_ci, to_tensor

__all__ = ["frechet_distance", "feature_stats", "crops", "expected_labels", "FashionScorer", "scorer_for"]

LAYOUTS = ("image", "mosaic", "frames")


def feature_stats(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance (float64) of ``(n, d)`` features."""
    f = features.double()
    return f.mean(0), (torch.cov(f.T) if len(f) > 1 else torch.zeros(f.shape[1], f.shape[1], dtype=f.dtype))


def _sqrt_psd(m: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh((m + m.T) / 2)
    return (vectors * values.clamp(min=0).sqrt()) @ vectors.T


def frechet_distance(mu1: torch.Tensor, cov1: torch.Tensor, mu2: torch.Tensor, cov2: torch.Tensor) -> float:
    """The Fréchet distance between the Gaussians N(mu1, cov1) and N(mu2, cov2) (0 for identical ones).

    Example:
        >>> frechet_distance(torch.zeros(2), torch.eye(2), torch.ones(2), torch.eye(2))
        2.0
    """
    mu1, mu2, cov1, cov2 = (t.double() for t in (mu1, mu2, cov1, cov2))
    root1 = _sqrt_psd(cov1)
    middle = root1 @ cov2 @ root1
    trace_root = torch.linalg.eigvalsh((middle + middle.T) / 2).clamp(min=0).sqrt().sum()
    value = (mu1 - mu2).pow(2).sum() + torch.trace(cov1) + torch.trace(cov2) - 2 * trace_root
    return max(float(value), 0.0)


def crops(image: torch.Tensor, layout: str, frames: int = 0) -> torch.Tensor:
    """``(C, H, W)`` in [0, 1] -> the ``(n, 1, 32, 32)`` crops the classifier reads (channels averaged): the
    image itself (``"image"``), the 4 cells of a 2 x 2 mosaic, row-major (``"mosaic"``), or the ``frames`` frames
    of a frame strip (``"frames"``); a crop of another size is resized to 32 x 32 (area)."""
    import torch.nn.functional as F

    x = image.float().mean(0, keepdim=True)
    if layout == "image":
        parts = x[None]
    elif layout == "mosaic":
        _, h, w = x.shape
        parts = x.reshape(1, 2, h // 2, 2, w // 2).permute(1, 3, 0, 2, 4).reshape(4, 1, h // 2, w // 2)
    elif layout == "frames":
        if frames < 1:
            raise ValueError("layout 'frames' needs frames >= 1")
        parts = torch.stack(x.chunk(frames, -1))
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if parts.shape[-2:] != (32, 32):
        parts = F.interpolate(parts, size=(32, 32), mode="area")
    return parts


def expected_labels(prompt: str, layout: str, frames: int = 0) -> list[int]:
    """The label each crop of ``prompt``'s image should get (see ``crops``)."""
    from ..fashion.data import parse_mosaic
    from ..fashion.model import class_ids

    if layout == "mosaic":
        return parse_mosaic(prompt)
    label = class_ids([prompt])[0]
    return [label] * (frames if layout == "frames" else 1)


class FashionScorer:
    """FD and adherence of generated images by the shipped classifier (``layout``: see ``crops``).

    Example:
        >>> scorer = FashionScorer("mosaic")                      # doctest: +SKIP
        >>> scorer.score(prompts, {"vanilla": images, "tome 0.5": merged})  # doctest: +SKIP
        {'vanilla': {'fd': 3.1, 'adherence': 0.94, ...}, 'tome 0.5': {...}}
    """

    def __init__(self, layout: str = "image", frames: int = 0, weights=None):
        from ..fashion.classifier import load_classifier

        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout, self.frames = layout, frames
        self.model, ref = load_classifier(weights)
        form = "frame" if layout == "frames" else "item"
        self.ref_mean, self.ref_cov = ref[f"{form}.mean"], ref[f"{form}.cov"]

    @torch.no_grad()
    def classify(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(n, 1, 32, 32)`` crops -> (features ``(n, 64)``, predicted labels ``(n,)``)."""
        features = self.model.features(batch.float())
        return features, self.model.head(features).argmax(-1)

    def reference(self, labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and covariance of real data with these labels: the mixture of the per-class Gaussians."""
        weights = torch.bincount(torch.tensor(labels), minlength=len(self.ref_mean)).double()
        weights = weights / weights.sum()
        mean = (weights[:, None] * self.ref_mean).sum(0)
        second = (weights[:, None, None] * (self.ref_cov + self.ref_mean[:, :, None] * self.ref_mean[:, None, :]))
        return mean, second.sum(0) - mean[:, None] * mean[None, :]

    def score(self, prompts: list[str], images: dict[str, list]) -> dict[str, dict]:
        """Per method label: ``fd`` (to real data), ``fd_vanilla`` (to the vanilla images' crops, when a
        ``"vanilla"`` entry is there), ``adherence`` and its 95% half-width, ``per_image`` adherence.

        ``images``: per label, the images (PIL, or ``(C, H, W)`` tensors in [0, 1]) of ``prompts`` in order."""
        expected = [expected_labels(p, self.layout, self.frames) for p in prompts]
        ref_mean, ref_cov = self.reference([label for labels in expected for label in labels])
        feats, out = {}, {}
        for label, imgs in images.items():
            if len(imgs) != len(prompts):
                raise ValueError(f"{label}: {len(imgs)} images for {len(prompts)} prompts")
            parts = [crops(img if isinstance(img, torch.Tensor) else to_tensor(img), self.layout, self.frames)
                     for img in imgs]
            features, predicted = self.classify(torch.cat(parts))
            feats[label] = features
            sizes = [len(p) for p in parts]
            per_image = [float((pred == torch.tensor(exp)).float().mean())
                         for pred, exp in zip(predicted.split(sizes), expected)]
            mean, half = mean_ci(per_image)
            out[label] = {"fd": frechet_distance(*feature_stats(features), ref_mean, ref_cov),
                          "adherence": mean, "adherence_ci95": half, "per_image": per_image}
        if "vanilla" in feats:
            base = feature_stats(feats["vanilla"])
            for label, features in feats.items():
                out[label]["fd_vanilla"] = frechet_distance(*feature_stats(features), *base)
        return out


def scorer_for(pipe) -> FashionScorer | str | None:
    """The scorer of an embedded Fashion-MNIST pipeline (a message when its classifier is missing), None for any
    other pipeline (the classifier knows Fashion-MNIST only)."""
    if getattr(pipe, "class_names", None) is None:
        return None
    frames = int(getattr(pipe, "frames", 0) or 0)
    layout = getattr(pipe, "layout", None) or ("frames" if frames else "image")
    try:
        return FashionScorer(layout, frames)
    except FileNotFoundError as err:
        return f"skipped: {err}"
