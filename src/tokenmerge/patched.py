"""``tokenmerge.patched``: any technique, or ``accelerate``, inside a with-block, as before outside."""

from __future__ import annotations

import contextlib

from .accelerate import accelerate
from .api import _restore, _snapshot, apply_patch, apply_reuse, apply_todo, remove_patch
from .api_steps import apply_step_cache, apply_unet_cache

__all__ = ["patched"]


@contextlib.contextmanager
def patched(model, ratio: float | None = None, *, method: str = "tome", **kwargs):
    """``with tokenmerge.patched(pipe, ratio=0.5): pipe(...)``: patched inside, as before outside.

    ``method``: ``"tome"`` (``apply_patch``'s arguments; ``ratio`` 0.5 unless given), ``"todo"`` (``apply_todo``'s;
    ``ratio`` its optional query merging, 0 unless given), ``"reuse"`` (``apply_reuse``'s; ``ratio`` its
    ``fraction``), ``"step_cache"``, ``"unet_cache"`` (``apply_step_cache``'s, ``apply_unet_cache``'s: no ``ratio``)
    or ``"accelerate"`` (``speed=``). A patch that was in place before is restored on exit.

    Example:
        >>> with tokenmerge.patched(pipe, method="accelerate", speed="fast"):  # doctest: +SKIP
        ...     image = pipe("a red cube").images[0]
    """
    calls = {"tome": (apply_patch, 0.5), "todo": (apply_todo, 0.0), "reuse": (apply_reuse, 0.5),
             "step_cache": (apply_step_cache, None), "unet_cache": (apply_unet_cache, None),
             "accelerate": (accelerate, None)}
    if method not in calls:
        raise ValueError(f"method must be one of {', '.join(map(repr, calls))}; got {method!r}")
    apply, default = calls[method]
    if default is None and ratio is not None:
        raise ValueError(f"method={method!r} takes no ratio (it caches whole steps): pass its own arguments "
                         f"({'speed=' if method == 'accelerate' else 'warmup=, gap=, ...'})")
    previous = _snapshot(model)
    if default is None:
        apply(model, **kwargs)
    elif method == "todo":
        apply(model, ratio=default if ratio is None else ratio, **kwargs)
    else:
        apply(model, default if ratio is None else ratio, **kwargs)
    try:
        yield model
    finally:
        remove_patch(model)
        _restore(previous)
