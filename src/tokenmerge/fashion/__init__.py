"""The embedded Fashion-MNIST model (see ``model.py``) and its diffusers pipeline (``pipeline.py``).

Imported lazily by the CLI: ``import tokenmerge`` never imports diffusers.
"""

from .model import CLASS_NAMES, WEIGHTS, class_ids

__all__ = ["CLASS_NAMES", "WEIGHTS", "class_ids", "load_fashion_pipeline"]


def load_fashion_pipeline(*args, **kwargs):
    from .pipeline import load_fashion_pipeline as load

    return load(*args, **kwargs)
