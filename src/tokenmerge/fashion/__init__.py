"""The embedded Fashion-MNIST model (see ``model.py``) and its diffusers pipeline (``pipeline.py``); the larger
testbeds (``mosaic.py``: 1,024 image and 32 text tokens; ``video_long.py``: 2,048 tokens) and the classifier that
scores them all (``classifier.py``).

Imported lazily by the CLI: ``import tokenmerge`` never imports diffusers.
"""

from .model import CLASS_NAMES, WEIGHTS, class_ids

__all__ = ["CLASS_NAMES", "WEIGHTS", "class_ids", "load_fashion_pipeline", "load_fashion_dit", "load_fashion_video",
           "load_fashion_mosaic", "load_fashion_video_long"]


def load_fashion_pipeline(*args, **kwargs):
    from .pipeline import load_fashion_pipeline as load

    return load(*args, **kwargs)


def load_fashion_dit(*args, **kwargs):
    from .dit import load_fashion_dit as load

    return load(*args, **kwargs)


def load_fashion_video(*args, **kwargs):
    from .video import load_fashion_video as load

    return load(*args, **kwargs)


def load_fashion_mosaic(*args, **kwargs):
    from .mosaic import load_fashion_mosaic as load

    return load(*args, **kwargs)


def load_fashion_video_long(*args, **kwargs):
    from .video_long import load_fashion_video_long as load

    return load(*args, **kwargs)
