"""The shipped Fashion-MNIST classifier: what ``tokenmerge quality`` measures generated images with.

A small CNN (torch only) on 32 x 32 crops in [0, 1] with 11 outputs: the ten Fashion-MNIST classes and "no item"
(``EMPTY``: an empty mosaic cell). Its 64 penultimate features are where the Fréchet distance is measured
(``tokenmerge.quality.distribution``); its predictions against the prompts give the prompt adherence. Trained by
``scripts/train_fashion_classifier.py`` on the train split with shifts and shrinks (so that an item shrunk to 24 px
and moved, as in a video frame, is still recognised); weights in ``weights/fashion_classifier.safetensors`` (fp16),
which also holds the reference statistics of real data per class (``ref.<form>.count``, ``.mean``, ``.cov``: of the
features over the test split, float32), so the metric needs no dataset at hand.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .data import EMPTY

__all__ = ["CLASSIFIER_WEIGHTS", "FEATURES", "FORMS", "FashionClassifier", "load_classifier"]

CLASSIFIER_WEIGHTS = Path(__file__).with_name("weights") / "fashion_classifier.safetensors"
FEATURES = 64
# the forms of real data the reference statistics describe: "item" (28 px, centred in 32: the 32 px images and the
# mosaic cells), "frame" (shrunk to 24 px, anywhere in the 32 px frame: the video models' frames)
FORMS = ("item", "frame")


class FashionClassifier(nn.Module):
    """``(B, 1, 32, 32)`` in [0, 1] -> logits ``(B, 11)``; ``features(x)``: the penultimate ``(B, 64)``."""

    def __init__(self):
        super().__init__()

        def block(cin, cout):
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                    nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

        self.body = nn.Sequential(*block(1, 32), *block(32, 64), *block(64, 64), nn.Flatten(),
                                  nn.Dropout(0.25), nn.Linear(64 * 4 * 4, FEATURES), nn.ReLU())
        self.head = nn.Linear(FEATURES, EMPTY + 1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body((x - 0.5) / 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def load_classifier(weights: str | Path | None = None) -> tuple[FashionClassifier, dict[str, torch.Tensor]]:
    """The shipped classifier (eval mode, float32) and its reference statistics (``ref.*`` tensors, float64).

    Example:
        >>> model, ref = load_classifier()  # doctest: +SKIP
        >>> model(images).argmax(-1)        # doctest: +SKIP
    """
    from safetensors.torch import load_file

    path = Path(weights) if weights is not None else CLASSIFIER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"the Fashion-MNIST classifier's weights are not at {path}: reinstall tokenmerge, or "
                                "train them with `python scripts/train_fashion_classifier.py` from the repository")
    state = load_file(str(path))
    model = FashionClassifier()
    model.load_state_dict({k[6:]: v.float() for k, v in state.items() if k.startswith("model.")})
    ref = {k[4:]: v.double() for k, v in state.items() if k.startswith("ref.")}
    return model.eval(), ref
