"""cache-dit's DBCache (the ``cache-dit`` package, PyPI ``cache-dit==1.5.3``) as a method of ``tokenmerge quality``.

What runs is the package's own code: ``cache_dit.enable_cache(BlockAdapter(...), cache_config=DBCacheConfig(...),
calibrator_config=TaylorSeerCalibratorConfig(...))``, undone by ``cache_dit.disable_cache``.

Its calibrators (``calibrator=``; what forecasts a cached step's residual instead of reusing the last one):
``taylorseer`` (``TaylorSeerCalibratorConfig``, ``taylorseer_order``: ``order=``), ``foca`` (``FoCaCalibratorConfig``:
FoCa's BDF2 predictor and Heun corrector, no field of its own), ``dmd`` (``DMDCalibratorConfig``: Dynamic Mode
Decomposition, an exponential-basis fit of the last ``dmd_history`` computed steps, ``history=``, ``rank=``,
``ridge=``, ``svd=``; below 4 snapshots its Taylor fallback of ``order=``). Its step masks
(``DBCacheConfig.steps_computation_mask``, 1 = computed, 0 = cached if the threshold allows, always with
``steps_computation_policy="static"``): ``mask=1110101...``; ``mask=slow|medium|fast|ultra``, the mask of
``cache_dit.steps_mask(total_steps=N, mask_policy=...)`` (28 steps: 18 / 15 / 11 / 8 computed); ``steps=N``, N
computed steps (``cache_dit.steps_mask(compute_bins, cache_bins)`` of a head of ``ceil(N / 2)`` computed steps then
``floor(N / 2)`` single ones spread evenly to the last step, the shape of cache-dit's policies; static, so exactly
N). A named mask and ``steps=`` are built for each generation from its ``num_inference_steps``. cache-dit does not know
the testbeds' pipeline classes, so the adapter is built here as its own Flux and Wan adapters build theirs: a
``FluxTransformer2DModel``'s ``transformer_blocks`` and ``single_transformer_blocks``, two lists of
``ForwardPattern.Pattern_1`` that each decide their own steps (``fused=true``: one list of both, as cache-dit's
default Flux adapter runs them); a ``WanTransformer3DModel``'s ``blocks`` (``Pattern_2``). cache-dit wraps the
pipeline class's ``__call__``, so each generation starts from fresh contexts; a step is one transformer call (the
testbeds batch guidance). ``computed_share(pipe)``: the last generation's cached steps, from cache-dit's statistics.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref

__all__ = ["DEFAULT_THRESHOLD", "OPTIONS", "CALIBRATORS", "MASK_POLICIES", "configs", "mask_plan", "computed_mask",
           "enable", "disable", "active", "computed_share"]

DEFAULT_THRESHOLD = 0.08  # DBCacheConfig's residual_diff_threshold
# KEY=VALUE options -> the DBCacheConfig field each sets (the others: the calibrator, the mask plan, the adapter)
OPTIONS = {"Fn": "Fn_compute_blocks", "Bn": "Bn_compute_blocks", "warmup": "max_warmup_steps",
           "cached": "max_cached_steps", "continuous": "max_continuous_cached_steps",
           "mask": "steps_computation_mask", "policy": "steps_computation_policy", "steps": None,
           "separate_cfg": "enable_separate_cfg", "calibrator": None, "taylorseer": None, "order": None,
           "history": None, "rank": None, "ridge": None, "svd": None, "fused": None}
# calibrator= -> cache-dit's config class (cache_dit/caching/cache_contexts/calibrators/__init__.py)
CALIBRATORS = {"taylorseer": "TaylorSeerCalibratorConfig", "foca": "FoCaCalibratorConfig",
               "dmd": "DMDCalibratorConfig"}
_DMD = {"history": "dmd_history", "rank": "dmd_rank", "ridge": "dmd_ridge", "svd": "dmd_svd_precision"}
# cache_dit.steps_mask's predefined policies (cache_dit/caching/cache_interface.py), most computed steps first
MASK_POLICIES = ("slow", "medium", "fast", "ultra")
_FN = 1  # cache-dit's default Fn_compute_blocks is 8: more blocks than a testbed's list has
_STATE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pipeline -> what enable() did to it


def _integer(key: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"cachedit's {key} must be an integer >= {low}, got {value!r}")
    return value


def _mask(value) -> list[int]:
    """``mask=1110101`` (read as a number: a mask starts with a computed step) or ``mask=(1,1,1,0,1)``."""
    digits = [int(d) for d in str(value)] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(digits, (tuple, list)) or not digits or any(d not in (0, 1) for d in digits) or digits[0] != 1:
        raise ValueError(f"cachedit's mask must be a string of 1 (computed) and 0 (cached if the threshold allows; "
                         f"always with policy=static) per step, starting with 1, or one of cache-dit's policies "
                         f"{', '.join(MASK_POLICIES)}; got {value!r}")
    return list(digits)


def computed_mask(total: int, computed: int) -> list[int]:
    """``steps=N``'s mask: ``total`` steps, ``computed`` of them computed, built with cache-dit's own
    ``steps_mask(compute_bins, cache_bins, total_steps)``: a head of ``ceil(N / 2)`` computed steps (cache-dit's
    warmup under a mask), then ``floor(N / 2)`` single computed steps, the last one the last step, the cached steps
    spread evenly between them (the later gaps the longer), the shape of cache-dit's predefined policies. All
    computed where ``computed >= total``."""
    from cache_dit import steps_mask

    if computed >= total:
        return [1] * total
    head = -(-computed // 2)
    singles = computed - head
    gaps = [(total - computed) // singles + (i >= singles - (total - computed) % singles) for i in range(singles)]
    return list(steps_mask(compute_bins=[head] + [1] * singles, cache_bins=gaps, total_steps=total))


def _policy_mask(total: int, policy: str) -> list[int]:
    """``mask=fast`` and the others: ``cache_dit.steps_mask(total_steps=total, mask_policy=policy)``. Its policies
    cover 4, 6 and 8 or more steps; at 1 or 2 steps no step can be cached (a mask computes its first step, and
    cache-dit its last): all computed; 3, 5, 7 steps are refused."""
    from cache_dit import steps_mask

    if total <= 2:
        return [1] * total
    if total < 8 and total not in (4, 6):
        raise ValueError(f"tokenmerge: cachedit's mask={policy} is cache-dit's steps_mask policy, which has none for "
                         f"{total} steps (4, 6 or 8 and more)")
    return list(steps_mask(total_steps=total, mask_policy=policy))


def mask_plan(options: dict):
    """The mask a generation of N steps gets, as a function of N, where it depends on N (``mask=fast``,
    ``steps=N``); None for a fixed mask or none."""
    if "steps" in options:
        computed = options["steps"]
        return lambda total: computed_mask(total, computed)
    if options.get("mask") in MASK_POLICIES:
        policy = options["mask"]
        return lambda total: _policy_mask(total, policy)
    return None


def _calibrator(cache_dit, options: dict):
    """The calibrator config of ``calibrator=`` (or ``taylorseer=true``), or None."""
    name = options.get("calibrator")
    if name is not None and name not in CALIBRATORS:
        raise ValueError(f"cachedit's calibrator is one of {', '.join(CALIBRATORS)}, got {name!r}")
    if "taylorseer" in options:
        if options["taylorseer"] and name not in (None, "taylorseer"):
            raise ValueError(f"cachedit's taylorseer=true and calibrator={name} contradict: give one")
        if options["taylorseer"]:
            name = "taylorseer"
    dmd = [k for k in _DMD if k in options]
    if dmd and name != "dmd":
        raise ValueError(f"cachedit's {', '.join(dmd)} are DMD's: give calibrator=dmd too")
    if "order" in options and name not in ("taylorseer", "dmd"):
        raise ValueError("cachedit's order= is TaylorSeer's (and DMD's fallback): give taylorseer=true (or "
                         "calibrator=taylorseer|dmd) too")
    if name is None:
        return None
    config = getattr(cache_dit, CALIBRATORS[name], None)
    if config is None:
        raise ImportError(f"this cache-dit has no {CALIBRATORS[name]} (cache-dit==1.5.3 has it)")
    if name == "taylorseer":  # it forecasts the cached steps' residuals (and the text stream's)
        return config(taylorseer_order=_integer("order", options.get("order", 1), 1))
    if name == "foca":
        return config()
    fields = {}
    if "order" in options:  # DMDCalibrator's n_derivatives (its Taylor fallback), through calibrator_kwargs
        fields["calibrator_kwargs"] = {"n_derivatives": _integer("order", options["order"], 1)}
    if "history" in options:
        fields["dmd_history"] = _integer("history", options["history"], 4)  # its fit needs 4 snapshots
    if "rank" in options:
        fields["dmd_rank"] = _integer("rank", options["rank"], 0)
    if "ridge" in options:
        ridge = options["ridge"]
        if not isinstance(ridge, (int, float)) or isinstance(ridge, bool) or not ridge >= 0:
            raise ValueError(f"cachedit's ridge must be a number >= 0, got {ridge!r}")
        fields["dmd_ridge"] = float(ridge)
    if "svd" in options:
        if options["svd"] not in ("low", "medium", "high"):
            raise ValueError(f"cachedit's svd (DMD's SVD precision) is low, medium or high, got {options['svd']!r}")
        fields["dmd_svd_precision"] = options["svd"]
    return config(**fields)


def configs(value, options: dict):
    """``(DBCacheConfig, calibrator config or None, fused)`` for ``cachedit:VALUE,KEY=VALUE...``; a ``ValueError``
    names an unknown or bad option (an ``ImportError`` without cache-dit). A mask that depends on the step count
    (``mask=fast``, ``steps=N``) is not in the config: ``mask_plan`` builds it for each generation."""
    unknown = [k for k in options if k not in OPTIONS]
    if unknown:
        raise ValueError(f"cachedit takes no option {', '.join(unknown)} (options: {', '.join(OPTIONS)})")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"cachedit's threshold (residual_diff_threshold) must be a number >= 0, got {value!r}")
    try:
        import cache_dit
    except ImportError as err:
        raise ImportError(f"cachedit needs the cache-dit package (pip install cache-dit==1.5.3): {err}") from None
    fields = {"residual_diff_threshold": float(value), "Fn_compute_blocks": _FN, "Bn_compute_blocks": 0}
    for key, low in (("Fn", 1), ("Bn", 0), ("warmup", 0), ("cached", -1), ("continuous", -1)):
        if key in options:
            fields[OPTIONS[key]] = _integer(key, options[key], low)
    if "mask" in options and "steps" in options:
        raise ValueError("cachedit's mask= and steps= both say which steps are computed: give one")
    if "steps" in options:
        _integer("steps", options["steps"], 2)  # a mask computes its first step, and cache-dit its last
        fields["steps_computation_policy"] = "static"  # exactly N computed: the 0 steps are cached
    elif "mask" in options and options["mask"] not in MASK_POLICIES:
        fields["steps_computation_mask"] = _mask(options["mask"])
    if options.get("policy", "dynamic") not in ("dynamic", "static"):
        raise ValueError(f"cachedit's policy (of the mask's 0 steps) is dynamic or static, got {options['policy']!r}")
    if "policy" in options:
        if "mask" not in options and "steps" not in options:
            raise ValueError("cachedit's policy= is the mask's: give mask= (or steps=) too")
        fields["steps_computation_policy"] = options["policy"]
    for key in ("separate_cfg", "taylorseer", "fused"):
        if key in options and not isinstance(options[key], bool):
            raise ValueError(f"cachedit's {key} is true or false, got {options[key]!r}")
    if "separate_cfg" in options:
        fields["enable_separate_cfg"] = options["separate_cfg"]
    calibrator = _calibrator(cache_dit, options)
    return cache_dit.DBCacheConfig(**fields), calibrator, bool(options.get("fused", False))


@contextlib.contextmanager
def _quiet():
    """cache-dit's loggers (each its own handler, INFO by default) at ERROR inside the block."""
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.split(".")[0] == "cache_dit"]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _lists(pipe, fused: bool):
    """``(transformer, [(name, blocks, pattern)], dummy names)``: the block lists cache-dit caches."""
    from cache_dit import ForwardPattern
    from torch import nn

    model = getattr(pipe, "transformer", None)
    kind = type(model).__name__
    if kind == "FluxTransformer2DModel":
        double, single = model.transformer_blocks, model.single_transformer_blocks
        if fused:
            return model, [("transformer_blocks", nn.ModuleList([*double, *single]), ForwardPattern.Pattern_1)], \
                ["single_transformer_blocks"]
        return model, [("transformer_blocks", double, ForwardPattern.Pattern_1),
                       ("single_transformer_blocks", single, ForwardPattern.Pattern_1)], []
    if fused:
        raise ValueError(f"tokenmerge: cachedit's fused=true is for Flux's two block lists; this is a {kind}")
    if kind == "WanTransformer3DModel":
        return model, [("blocks", model.blocks, ForwardPattern.Pattern_2)], []
    found = kind if model is not None else type(getattr(pipe, "unet", pipe)).__name__
    raise ValueError(f"tokenmerge: cachedit adapts a FluxTransformer2DModel or a WanTransformer3DModel (their "
                     f"block lists and forward patterns, as cache-dit's own adapters); this pipeline's denoiser is a "
                     f"{found}")


def enable(pipe, value, options: dict) -> None:
    """Switch cache-dit's DBCache on for ``pipe`` (a ``ValueError`` starting with 'tokenmerge' if it cannot be)."""
    import cache_dit
    from cache_dit.caching.block_adapters import BlockAdapterRegister

    if pipe in _STATE:
        raise ValueError("tokenmerge: cache-dit is already on for this pipeline (remove it first)")
    config, calibrator, fused = configs(value, options)
    model, lists, dummies = _lists(pipe, fused)
    for name, blocks, _ in lists:
        if config.Fn_compute_blocks + config.Bn_compute_blocks > len(blocks):
            raise ValueError(f"tokenmerge: cachedit's Fn={config.Fn_compute_blocks} + Bn={config.Bn_compute_blocks} "
                             f"exceed the {len(blocks)} blocks of {name}")
    if config.enable_separate_cfg is None:  # what cache-dit's registry says of the pipeline (False: one call a step)
        config.enable_separate_cfg = bool(BlockAdapterRegister.has_separate_cfg(pipe))
    names, blocks, patterns = (list(x) for x in zip(*lists))
    state = {"had_forward": "forward" in vars(model), "had_call": "__call__" in vars(type(pipe)),
             "order": list(model._modules),
             "lists": [(n, len(b)) for n, b in zip(names, blocks)], "fn_bn": config.Fn_compute_blocks +
             config.Bn_compute_blocks}
    with _quiet():
        adapter = cache_dit.BlockAdapter(pipe=pipe, transformer=model, blocks=blocks if len(blocks) > 1 else blocks[0],
                                         blocks_name=names if len(names) > 1 else names[0],
                                         dummy_blocks_names=dummies,
                                         forward_pattern=patterns if len(patterns) > 1 else patterns[0])
        adapter.check_forward_pattern = True  # cache-dit skips its check where a diffusers hook registry is on
        state["adapter"] = adapter
        _STATE[pipe] = state
        try:
            cache_dit.enable_cache(adapter, cache_config=config, calibrator_config=calibrator)
            plan = mask_plan(options)
            if plan is not None:
                _per_generation(pipe, state, plan)
        except BaseException as err:
            with contextlib.suppress(Exception):  # what it did before it failed, undone as far as it goes
                disable(pipe)
            _STATE.pop(pipe, None)
            if isinstance(err, AssertionError):  # cache-dit's own checks (a block's forward of another pattern)
                raise ValueError(f"tokenmerge: cache-dit refused the adapter: {err}") from None
            raise


def _per_generation(pipe, state, plan) -> None:
    """Set the mask of ``plan(N)`` into cache-dit's contexts' configs before each generation of N steps: the call
    of ``pipe``'s class (cache-dit's wrapper, which resets its contexts from those configs) wrapped once more; its
    ``disable_cache`` puts the class's own call back, which takes this wrapper off too."""
    adapter, cls = state["adapter"], type(pipe)
    configs_of = {id(c): c for c in (b._context_kwargs["cache_config"] for per in adapter.blocks for b in per)}
    state["plan"], state["configs"] = plan, list(configs_of.values())
    inner = cls.__call__
    signature = inspect.signature(inner)

    @functools.wraps(inner)
    def call(self, *args, **kwargs):
        mine = _STATE.get(self)
        if mine is not None and mine.get("plan") is not None:
            mask = mine["plan"](_steps_of(signature, self, args, kwargs))
            for config in mine["configs"]:
                config.steps_computation_mask = mask
        return inner(self, *args, **kwargs)

    cls.__call__ = call


def _steps_of(signature, pipe, args, kwargs) -> int:
    """The call's ``num_inference_steps`` (given, or the pipeline's default)."""
    steps = kwargs.get("num_inference_steps")
    if steps is None:
        try:
            bound = signature.bind(pipe, *args, **kwargs)
        except TypeError:
            bound = None
        if bound is not None:
            bound.apply_defaults()
            steps = bound.arguments.get("num_inference_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"tokenmerge: cachedit's mask=POLICY and steps=N are built from the call's "
                         f"num_inference_steps; this call gives {steps!r}")
    return steps


def active(pipe) -> bool:
    return pipe in _STATE


def disable(pipe) -> None:
    """Switch it off: cache-dit's ``disable_cache``, then what it leaves behind (the transformer's ``forward``
    instance attribute, a subclass's ``__call__`` put back into its own class) removed and the order of the
    transformer's children put back."""
    state = _STATE.pop(pipe, None)
    if state is None:
        return
    import cache_dit

    with _quiet():
        cache_dit.disable_cache(state["adapter"])
    model = pipe.transformer
    if not state["had_forward"]:
        vars(model).pop("forward", None)
    if not state["had_call"] and "__call__" in vars(type(pipe)):
        delattr(type(pipe), "__call__")
    # its disable_cache sets the block lists again, which moves them to the end of the transformer's children: the
    # order a model's blocks are found in (diffusers' First Block Cache takes the first it finds as its leader)
    order = state["order"] + [k for k in model._modules if k not in state["order"]]
    model._modules = {k: model._modules[k] for k in order if k in model._modules}


def computed_share(pipe) -> dict | None:
    """The last generation's steps under cache-dit (None when it is not on ``pipe``, or before one): ``steps``,
    per block list the ``cached`` step indices cache-dit recorded, and ``computed`` (the share of the skippable
    blocks' steps that ran: per list, weighted by the blocks each can skip; one list: computed steps / steps)."""
    state = _STATE.get(pipe)
    if state is None:
        return None
    adapter, lists, fn_bn = state["adapter"], state["lists"], state["fn_bn"]
    blocks = [b for per_model in adapter.blocks for b in per_model]  # normalized: a list per transformer
    if not all(hasattr(b, "_cached_steps") for b in blocks):
        return None
    steps = blocks[0]._accumulated_executed_steps
    cached = {name: list(b._cached_steps) for (name, _), b in zip(lists, blocks)}
    weights = [max(size - fn_bn, 0) for _, size in lists]
    ran = sum(w * (steps - len(cached[name])) for w, (name, _) in zip(weights, lists))
    total = sum(weights) * steps
    return {"steps": steps, "cached": cached, "computed": ran / total if total else 1.0}
