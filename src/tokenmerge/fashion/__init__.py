"""The embedded Fashion-MNIST model (see ``model.py``) and its diffusers pipeline (``pipeline.py``).

Imported lazily by the CLI: ``import tokenmerge`` never imports diffusers.
"""

from .model import CLASS_NAMES, WEIGHTS, class_ids

__all__ = ["CLASS_NAMES", "WEIGHTS", "class_ids", "load_fashion_pipeline", "load_fashion_dit", "load_fashion_video"]


def load_fashion_pipeline(*args, **kwargs):
    from .pipeline import load_fashion_pipeline as load

    return load(*args, **kwargs)


def load_fashion_dit(*args, **kwargs):
    from .dit import load_fashion_dit as load

    return load(*args, **kwargs)


def load_fashion_video(*args, **kwargs):
    from .video import load_fashion_video as load

    return load(*args, **kwargs)
