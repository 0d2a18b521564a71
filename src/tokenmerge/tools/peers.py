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

- ``seacache[:threshold]``: SeaCache (diffusers >= 0.42; default threshold 0.25, diffusers' default): whole steps
  of the blocks are skipped (the residual of the last computed ones reused, moved along its slope) while the
  accumulated relative change of the SEA-filtered visual latent stays below the threshold; options
  ``residual_order=``, ``retention_steps=``, ``cache_end_steps=``, ``max_consecutive_cached=``, ``power_exp=``.
  It gates a call only where the pipeline enters ``transformer.cache_context(name, step_index=, sigma=,
  num_inference_steps=)`` (diffusers' Wan pipelines and the embedded testbeds do; its Flux pipelines do not) and a
  ``raw_vision_callback`` gives it the visual latent: diffusers' own for Wan T2V and Cosmos 3, this module's for
  Flux's packed layout (``FluxTransformer2DModel``: the ``(B, N, C)`` tokens put back on their grid from
  ``img_ids``). Elsewhere it would run "fail-open" (caching nothing): refused here with the reason instead.
  ``computed_share``: the steps it computed, by its own gate.

- ``cachedit[:threshold]``: cache-dit's DBCache, the cache-dit package itself (``tools/cachedit.py``; default
  threshold 0.08, its default): past warmup steps, a block list's blocks after its first ``Fn`` are skipped (their
  residual reused) while the first ``Fn``'s residual changes less than the threshold; options ``Fn=``, ``Bn=``,
  ``warmup=``, ``cached=``, ``continuous=``, ``mask=`` (1 and 0 per step, or cache-dit's ``slow``, ``medium``,
  ``fast``, ``ultra``), ``steps=`` (N computed steps), ``policy=``, ``calibrator=taylorseer|foca|dmd`` (or
  ``taylorseer=true``) with ``order=`` (and DMD's ``history=``, ``rank=``, ``ridge=``, ``svd=``), ``fused=``.

FasterCache needs callbacks into the pipeline's guidance; it is not offered here.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import logging
import math
import weakref

from . import cachedit

__all__ = ["CACHES", "cache_config", "enable", "disable", "calibrate", "needs_calibration", "computed_share"]

CACHES = {
    "fbc": "diffusers' First Block Cache; VALUE = threshold (default 0.05)",
    "taylorseer": "diffusers' TaylorSeer cache; VALUE = cache_interval (default 5)",
    "pab": "diffusers' Pyramid Attention Broadcast; VALUE = spatial_attention_block_skip_range (default 2)",
    "magcache": "diffusers' MagCache; VALUE = threshold (default 0.06), its ratios calibrated on the model first",
    "seacache": "diffusers' SeaCache (diffusers >= 0.42); VALUE = threshold (default 0.25); options residual_order= "
                "(0|1, default 1), retention_steps= (1), cache_end_steps= (1), max_consecutive_cached= (2, 0: no "
                "limit), power_exp= (3); needs a pipeline that passes cache_context(step_index=, sigma=, "
                "num_inference_steps=) and a Wan T2V, Cosmos 3 or Flux-layout transformer",
    "cachedit": "cache-dit's DBCache (the cache-dit package); VALUE = residual_diff_threshold (default 0.08); options "
                "Fn= (default 1), Bn= (0), warmup= (8), cached=, continuous= (max cached / consecutive cached steps, "
                "-1: no limit), mask= (1 and 0 per step, or cache-dit's policy slow|medium|fast|ultra, built for "
                "each generation's step count) or steps=N (N computed steps a generation), policy=dynamic|static "
                "(the mask's 0 steps; steps=N: static), calibrator=taylorseer|foca|dmd (taylorseer=true: the first) "
                "with order= (1; TaylorSeer's, DMD's fallback), DMD's history= (6), rank= (0), ridge=, "
                "svd=low|medium|high; fused=true (Flux's two block lists as one), separate_cfg=",
}
DEFAULTS = {"fbc": 0.05, "taylorseer": 5, "pab": 2, "magcache": 0.06, "seacache": 0.25,
            "cachedit": cachedit.DEFAULT_THRESHOLD}
_VALUE_FIELD = {"fbc": "threshold", "taylorseer": "cache_interval", "pab": "spatial_attention_block_skip_range",
                "magcache": "threshold", "seacache": "threshold"}
_SEA_INTEGERS = {"residual_order": 0, "retention_steps": 0, "cache_end_steps": 0, "max_consecutive_cached": 0}
_SEA_OPTIONS = (*_SEA_INTEGERS, "power_exp")
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
                                 "calibrate first (tools.peers.calibrate)")
            if ratios is None:  # a spec checked before any model: its options only
                kwargs["calibrate"] = True
            else:
                kwargs.update(mag_ratios=ratios, num_inference_steps=len(ratios))
        return hooks.MagCacheConfig(**kwargs)
    if name == "seacache":
        return _sea_config(hooks, value, options, pipe)
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
    if name == "seacache":
        return _sea_enable(pipe, value, options)
    _denoiser(pipe).enable_cache(cache_config(name, value, options, pipe))


def disable(pipe, name: str | None = None) -> None:
    if name == "cachedit":
        return cachedit.disable(pipe)
    count = _SEA.pop(pipe, None)
    if count is not None:
        count.remove()
    _denoiser(pipe).disable_cache()


# ---- SeaCache --------------------------------------------------------------------------------------------------
_SEA: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pipeline -> its _SeaCount


def _sea_config(hooks, value, options: dict, pipe=None):
    """``SeaCacheConfig(threshold=VALUE, **options)``, with the vision adapter of ``pipe``'s transformer (none
    without a pipeline: a spec checked before any model)."""
    if not hasattr(hooks, "SeaCacheConfig"):
        raise ImportError("SeaCache needs diffusers >= 0.42 (diffusers.hooks.SeaCacheConfig)")
    unknown = [k for k in options if k not in _SEA_OPTIONS]
    if unknown:
        raise ValueError(f"seacache takes no option {', '.join(unknown)} (options: {', '.join(_SEA_OPTIONS)})")
    for key, low in _SEA_INTEGERS.items():
        given = options.get(key, low)
        if not isinstance(given, int) or isinstance(given, bool) or given < low:
            raise ValueError(f"seacache's {key} must be an integer >= {low}, got {given!r}")
    power = options.get("power_exp", 3.0)
    if not isinstance(power, (int, float)) or isinstance(power, bool) or not (math.isfinite(power) and power > 0):
        raise ValueError(f"seacache's power_exp must be a number > 0, got {power!r}")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"seacache's threshold must be a number >= 0, got {value!r}")
    callback = _sea_adapter(pipe) if pipe is not None else None
    return hooks.SeaCacheConfig(threshold=float(value), raw_vision_callback=callback, **options)


def _sea_adapter(pipe):
    """The ``raw_vision_callback`` SeaCache gets for ``pipe``'s transformer: None where diffusers has its own (Wan
    T2V, Cosmos 3), ``flux_raw_vision`` for a ``FluxTransformer2DModel``; a ``ValueError`` where there is neither."""
    import diffusers

    def kind(name):
        return getattr(diffusers, name, None) or type(None)

    model = getattr(pipe, "transformer", None)
    if isinstance(model, kind("WanTransformer3DModel")):
        if model.config.in_channels == model.config.out_channels:  # diffusers' condition for its T2V adapter
            return None
        found = f"a WanTransformer3DModel taking {model.config.in_channels} channels for {model.config.out_channels}"
        hint = " (an image-to-video Wan: the image's condition rides on the input's channels)"
    elif isinstance(model, kind("Cosmos3OmniTransformer")):
        return None
    elif isinstance(model, kind("FluxTransformer2DModel")):
        return flux_raw_vision
    else:
        found = f"a {type(model).__name__}" if model is not None else \
            f"no transformer (its denoiser is a {type(getattr(pipe, 'unet', pipe)).__name__})"
        hint = ""
    raise ValueError(f"tokenmerge: SeaCache needs a vision adapter for the model (its raw_vision_callback: the visual "
                     f"latents a call generates, (C, T, H, W) each): diffusers has one for Wan text-to-video "
                     f"(WanTransformer3DModel) and Cosmos 3, this library one for Flux's packed layout "
                     f"(FluxTransformer2DModel); this pipeline has {found}{hint}")


def flux_raw_vision(module, args: tuple, kwargs: dict) -> list:
    """SeaCache's ``raw_vision_callback`` for a ``FluxTransformer2DModel``: the visual latent of each sample as
    ``(C, 1, H, W)`` (one frame), from the packed ``hidden_states`` ``(B, N, C)`` put back on their grid.

    The grid is read from ``img_ids`` (``(N, 3)``: ``(0, row, column)`` per token; the tokens whose first id is not
    0, such as Kontext's reference image, are a condition, not the output, and are left out); without ids, a square
    grid of ``sqrt(N)`` a side. A ``ValueError`` (SeaCache then runs that call in full) where neither gives one."""
    import torch

    try:
        from diffusers.utils.torch_utils import unwrap_module
    except ImportError:  # (older diffusers: no compiled-module unwrapping there)
        def unwrap_module(m):
            return getattr(m, "_orig_mod", m)
    module = unwrap_module(module)
    bound = inspect.signature(type(module).forward).bind_partial(module, *args, **kwargs).arguments
    hidden, ids = bound.get("hidden_states"), bound.get("img_ids")
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3:
        raise ValueError("the Flux layout's hidden_states are (B, N, C) packed tokens; got "
                         f"{getattr(hidden, 'shape', type(hidden).__name__)}")
    batch, tokens, channels = hidden.shape
    if isinstance(ids, torch.Tensor):
        ids = ids[0] if ids.ndim == 3 else ids  # (B, N, 3): diffusers < 0.31's batched ids
        if ids.ndim != 2 or ids.shape[0] != tokens or ids.shape[1] < 3:
            raise ValueError(f"img_ids of shape {tuple(ids.shape)} do not place {tokens} tokens")
        out = ids[:, 0] == 0
        if not bool(out.any()):
            out = torch.ones_like(out)
        rows, cols = ids[out, 1].round().long(), ids[out, 2].round().long()
        rows, cols = rows - rows.min(), cols - cols.min()
        height, width = int(rows.max()) + 1, int(cols.max()) + 1
        index = rows * width + cols
        if height * width != index.numel() or torch.unique(index).numel() != index.numel():
            raise ValueError(f"img_ids do not tile a full grid ({index.numel()} tokens on {height} x {width})")
        grid = hidden.new_zeros(batch, height * width, channels)
        grid[:, index.to(hidden.device)] = hidden[:, out.to(hidden.device)]
    else:
        height = width = math.isqrt(tokens)
        if height * width != tokens:
            raise ValueError(f"without img_ids, {tokens} tokens are no square grid")
        grid = hidden
    grid = grid.reshape(batch, height, width, channels).permute(0, 3, 1, 2).unsqueeze(2)  # (B, C, 1, H, W)
    return list(grid.unbind(0))


class _SeaCount:
    """What SeaCache decided on each transformer call of the last generation, read after its leader block (the
    first block: a skipped call runs none of the blocks): ``(context name, step index, computed)`` per call.

    A call SeaCache could not gate (its "fail-open": no ``cache_context`` with the step fields, no visual latent) is
    refused with the reason, raised from that call: it would cache nothing, and a quality report would show the
    unpatched model under its name."""

    def __init__(self, model):
        from diffusers.hooks.sea_cache import _SEA_CACHE_LEADER_BLOCK_HOOK, _SEA_CACHE_ROOT_HOOK

        self.root = model._diffusers_hook.get_hook(_SEA_CACHE_ROOT_HOOK)
        leaders = [m for m in model.modules() if m is not model and getattr(m, "_diffusers_hook", None) is not None
                   and m._diffusers_hook.get_hook(_SEA_CACHE_LEADER_BLOCK_HOOK) is not None]
        self.calls: list[tuple[str, int, bool]] = []
        self.seen = set(self.root.shared_state._warned_messages)
        self.handles = [leaders[0].register_forward_hook(self._after_leader)] if leaders else []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _after_leader(self, module, args, output):
        manager, meta = self.root.state_manager, self.root.shared_state.forward_metadata
        context = manager._context
        if meta is None:
            raise RuntimeError(f"tokenmerge: SeaCache cannot gate this call, and would cache nothing: "
                               f"{self._reason(context)}")
        key = (context.name, meta.step_index)
        if self.calls and (meta.step_index < self.calls[-1][1] or key in {c[:2] for c in self.calls}):
            self.calls = []  # a new generation
        self.calls.append((*key, not manager.get_state().skip_remaining))

    def _reason(self, context) -> str:
        import torch

        if torch.is_grad_enabled():
            return "the call runs with autograd on (SeaCache is for inference)"
        if context is None:
            return ("the pipeline calls its transformer outside transformer.cache_context(name, step_index=, "
                    "sigma=, num_inference_steps=)")
        missing = [f for f in ("step_index", "sigma", "num_inference_steps") if getattr(context, f, None) is None]
        if missing:
            return (f"the pipeline enters transformer.cache_context({context.name!r}) without {', '.join(missing)} "
                    "(diffusers' Wan pipelines pass them, its Flux pipelines do not)")
        new = sorted(self.root.shared_state._warned_messages - self.seen)
        return "; ".join(new) if new else "SeaCache got no visual latent for the call"

    def computed_share(self) -> dict | None:
        if not self.calls:
            return None
        steps = sorted({step for _, step, _ in self.calls})
        cached = [s for s in steps if not any(ran for _, step, ran in self.calls if step == s)]
        return {"steps": len(steps), "cached": cached,
                "computed": sum(ran for *_, ran in self.calls) / len(self.calls)}


def _sea_enable(pipe, value, options: dict) -> None:
    """Switch SeaCache on for ``pipe``'s transformer, with the count of what it skips."""
    hooks = _hooks()
    config = _sea_config(hooks, value, options, pipe)  # the adapter refused first: before any hook is set
    model = _denoiser(pipe)
    try:
        model.enable_cache(config)
    except ValueError as err:
        if "not registered" not in str(err):
            raise
        raise ValueError(f"tokenmerge: SeaCache needs diffusers' TransformerBlockRegistry metadata for the model's "
                         f"blocks (which output is the hidden states): {err}") from None
    try:
        _SEA[pipe] = _SeaCount(model)
    except BaseException:
        model.disable_cache()
        raise


def computed_share(pipe) -> dict | None:
    """The share of its last generation's calls the cache on ``pipe`` computed: ``{"steps", "computed"}`` (the calls
    it computed; cache-dit's: ``tools/cachedit.computed_share``; SeaCache's: its gate's decisions, ``cached`` the steps
    it skipped; this library's caches across steps: ``describe_patch``'s ``ran``), or None (diffusers' other caches
    keep no such count)."""
    found = cachedit.computed_share(pipe)
    if found is None and pipe in _SEA:
        return _SEA[pipe].computed_share()
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
