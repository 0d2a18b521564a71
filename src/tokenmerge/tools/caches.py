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

MagCache needs per-model magnitude ratios calibrated first, and FasterCache needs callbacks into the pipeline's
guidance; neither is offered here.
"""

from __future__ import annotations

__all__ = ["CACHES", "cache_config", "enable", "disable"]

CACHES = {
    "fbc": "diffusers' First Block Cache; VALUE = threshold (default 0.05)",
    "taylorseer": "diffusers' TaylorSeer cache; VALUE = cache_interval (default 5)",
    "pab": "diffusers' Pyramid Attention Broadcast; VALUE = spatial_attention_block_skip_range (default 2)",
}
DEFAULTS = {"fbc": 0.05, "taylorseer": 5, "pab": 2}
_VALUE_FIELD = {"fbc": "threshold", "taylorseer": "cache_interval", "pab": "spatial_attention_block_skip_range"}


def _hooks():
    try:
        import diffusers.hooks as hooks
    except ImportError as err:  # diffusers < 0.32
        raise ImportError(f"diffusers' cache hooks need diffusers >= 0.33 ({err})") from None
    return hooks


def cache_config(name: str, value, options: dict, pipe=None):
    """The diffusers config of cache ``name`` (a ``TypeError`` naming an unknown option)."""
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
    raise ValueError(f"unknown cache {name!r}; one of {', '.join(CACHES)}")


def _denoiser(pipe):
    model = getattr(pipe, "transformer", None)
    if model is None or not hasattr(model, "enable_cache"):
        found = type(getattr(pipe, "unet", pipe)).__name__
        raise TypeError(f"diffusers' cache hooks apply to a pipeline's transformer (CacheMixin); this pipeline's "
                        f"denoiser is a {found}")
    return model


def enable(pipe, name: str, value, options: dict) -> None:
    _denoiser(pipe).enable_cache(cache_config(name, value, options, pipe))


def disable(pipe) -> None:
    _denoiser(pipe).disable_cache()
