"""diffusers' own cache hooks as methods of ``tokenmerge quality``: ``fbc:0.05``, ``taylorseer:5``, ``pab:2``.

Each is diffusers' documented configuration (``diffusers.hooks``), switched on with ``transformer.enable_cache``
and off with ``transformer.disable_cache``; the pipeline must run its transformer as diffusers' pipelines do (in
``transformer.cache_context(...)``, exposing ``current_timestep``): diffusers' own pipelines and the embedded
transformer models do. VALUE is the setting a user turns first; other fields of the config are KEY=VALUE options.

- ``fbc[:threshold]``: First Block Cache (default threshold 0.05, diffusers' default): the other blocks' residual
  is reused while the first block's output changes less than the threshold (relative mean absolute difference).
- ``taylorseer[:cache_interval]``: TaylorSeer (default interval 5, its first 3 steps computed): the blocks'
  outputs are computed every ``cache_interval`` steps and predicted by a Taylor expansion in between.
- ``pab[:block_skip_range]``: Pyramid Attention Broadcast (default 2): the spatial self-attention's output is
  computed every ``block_skip_range`` steps and broadcast in between, for timesteps in (100, 800) of 0..1000.

- ``magcache[:threshold]``: MagCache (default threshold 0.06, diffusers' default): whole steps of the blocks are
  skipped while the accumulated error, predicted from the model's magnitude ratios, stays below the threshold.
  The ratios are the model's: without ``mag_ratios``, ``tokenmerge quality`` calibrates them first (diffusers'
  calibration mode, one generation of the run's first prompt and seed that skips nothing; ``calibrate``).

- ``cachedit[:threshold]``: cache-dit's DBCache, the cache-dit package itself (``tools/cachedit.py``; default
  threshold 0.08, its default): past warmup steps, a block list's blocks after its first ``Fn`` are skipped (their
  residual reused) while the first ``Fn``'s residual changes less than the threshold; options ``Fn=``, ``Bn=``,
  ``warmup=``, ``cached=``, ``continuous=``, ``mask=``, ``policy=``, ``taylorseer=true`` with ``order=``, ``fused=``.

FasterCache needs callbacks into the pipeline's guidance; it is not offered here.
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import weakref

from . import cachedit

__all__ = ["CACHES", "cache_config", "enable", "disable", "calibrate", "needs_calibration", "counted_steps"]

CACHES = {
    "fbc": "diffusers' First Block Cache; VALUE = threshold (default 0.05)",
    "taylorseer": "diffusers' TaylorSeer cache; VALUE = cache_interval (default 5)",
    "pab": "diffusers' Pyramid Attention Broadcast; VALUE = spatial_attention_block_skip_range (default 2)",
    "magcache": "diffusers' MagCache; VALUE = threshold (default 0.06), its ratios calibrated on the model first",
    "cachedit": "cache-dit's DBCache (the cache-dit package); VALUE = residual_diff_threshold (default 0.08); options "
                "Fn= (default 1), Bn= (0), warmup= (8), cached=, continuous= (max cached / consecutive cached steps, "
                "-1: no limit), mask= (1 and 0 per step) with policy=dynamic|static, taylorseer=true with order= (1), "
                "fused=true (Flux's two block lists as one), separate_cfg=",
}
DEFAULTS = {"fbc": 0.05, "taylorseer": 5, "pab": 2, "magcache": 0.06, "cachedit": cachedit.DEFAULT_THRESHOLD}
_VALUE_FIELD = {"fbc": "threshold", "taylorseer": "cache_interval", "pab": "spatial_attention_block_skip_range",
                "magcache": "threshold"}
_RATIOS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # transformer -> its calibrated ratios


def _hooks():
    try:
        import diffusers.hooks as hooks
    except ImportError as err:  # diffusers < 0.32
        raise ImportError(f"diffusers' cache hooks need diffusers >= 0.33 ({err})") from None
    return hooks


def cache_config(name: str, value, options: dict, pipe=None):
    """The diffusers config of cache ``name`` (a ``TypeError`` naming an unknown option)."""
    if name == "cachedit":
        return cachedit.configs(value, options)
    hooks = _hooks()
    kwargs = {_VALUE_FIELD[name]: value, **options}
    if name == "fbc":
        return hooks.FirstBlockCacheConfig(**kwargs)
    if name == "taylorseer":
        if not hasattr(hooks, "TaylorSeerCacheConfig"):
            raise ImportError("the TaylorSeer cache needs diffusers >= 0.36")
        return hooks.TaylorSeerCacheConfig(**kwargs)
    if name == "pab":
        def timestep():
            t = getattr(pipe, "current_timestep", None)
            if t is None:
                raise RuntimeError("Pyramid Attention Broadcast reads the pipeline's current_timestep, which is None "
                                   "here: call the model through its pipeline")
            return t

        return hooks.PyramidAttentionBroadcastConfig(current_timestep_callback=timestep, **kwargs)
    if name == "magcache":
        if not hasattr(hooks, "MagCacheConfig"):
            raise ImportError("this diffusers has no MagCache (diffusers.hooks.MagCacheConfig)")
        if "mag_ratios" not in kwargs:
            ratios = _RATIOS.get(_denoiser(pipe)) if pipe is not None else None
            if pipe is not None and ratios is None:
                raise ValueError("tokenmerge: MagCache needs the model's magnitude ratios: pass mag_ratios=[...] or "
                                 "calibrate first (tools.caches.calibrate)")
            if ratios is None:  # a spec checked before any model: its options only
                kwargs["calibrate"] = True
            else:
                kwargs.update(mag_ratios=ratios, num_inference_steps=len(ratios))
        return hooks.MagCacheConfig(**kwargs)
    raise ValueError(f"unknown cache {name!r}; one of {', '.join(CACHES)}")


def _denoiser(pipe):
    model = getattr(pipe, "transformer", None)
    if model is None or not hasattr(model, "enable_cache"):
        found = type(getattr(pipe, "unet", pipe)).__name__
        raise TypeError(f"diffusers' cache hooks apply to a pipeline's transformer (CacheMixin); this pipeline's "
                        f"denoiser is a {found}")
    return model


def enable(pipe, name: str, value, options: dict) -> None:
    if name == "cachedit":
        return cachedit.enable(pipe, value, options)
    _denoiser(pipe).enable_cache(cache_config(name, value, options, pipe))


def disable(pipe, name: str | None = None) -> None:
    if name == "cachedit":
        return cachedit.disable(pipe)
    _denoiser(pipe).disable_cache()


def counted_steps(pipe) -> dict | None:
    """What the cache on ``pipe`` counted of its last generation: ``{"steps", "computed"}`` (the share of the calls
    it computed; cache-dit's: ``tools/cachedit.counted``; this library's caches across steps: ``describe_patch``'s
    ``ran``), or None (diffusers' caches keep no such count)."""
    found = cachedit.counted(pipe)
    if found is None:
        import tokenmerge

        try:
            info = tokenmerge.describe_patch(pipe)
        except TypeError:  # not a model tokenmerge knows: nothing of its own on it
            info = None
        found = info.ran if info is not None else None
    return found


def needs_calibration(spec) -> bool:
    """Whether ``spec`` (a method, or a combination) runs MagCache without ratios of its own."""
    parts = getattr(spec, "parts", (spec,))
    return any(p.name == "magcache" and "mag_ratios" not in p.kwargs() for p in parts)


def calibrate(pipe, run, steps: int) -> list[float]:
    """Calibrate MagCache's ratios for ``pipe``'s transformer at ``steps`` steps: ``run()`` (one generation) under
    diffusers' calibration mode, which skips nothing and reports the ratios at the end (read from its log); kept
    for the transformer (``cache_config`` takes them) and returned. Once per transformer and step count."""
    model = _denoiser(pipe)
    known = _RATIOS.get(model)
    if known is not None and len(known) == steps:
        return known
    log, seen = logging.getLogger("diffusers.hooks.mag_cache"), []

    class _Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler, level, propagate = _Seen(), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # its INFO records to this handler alone, not diffusers' (they would print)
    log.propagate = False
    model.enable_cache(_hooks().MagCacheConfig(calibrate=True, num_inference_steps=steps))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # (it prints them too)
            run()
    finally:
        model.disable_cache()
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
    found = [m.split(":", 1)[1] for m in seen if m.startswith("MagCache Calibration Results:")]
    if not found:
        raise RuntimeError("MagCache's calibration reported no ratios (a diffusers whose MagCache logs otherwise)")
    ratios = [float(r) for r in ast.literal_eval(found[-1].strip())]
    if len(ratios) != steps:
        raise RuntimeError(f"MagCache's calibration gave {len(ratios)} ratios for {steps} steps")
    _RATIOS[model] = ratios
    return ratios
