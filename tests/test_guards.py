"""Combinations that used to give wrong results or silently change nothing: each is now correct or refused.

- diffusers' cache hooks: attention-level caches (Pyramid Attention Broadcast, FasterCache, TaylorSeer) on merged
  targets give each token its own cached output (what the cache gives on the unmerged tokens, computed by hand),
  in both orders of enabling; one that cannot (inside a target, or with scope="block") is refused at apply_patch
  or at the cache's own registration; with ToDo (keys and values pooled, queries whole) they reuse full outputs;
  block-level caches (First Block Cache, MagCache) give exactly what the cache computes from the patched blocks'
  outputs.
- torch.compile: compiled calls follow apply_patch and remove_patch, in both orders (compiled before the patch,
  compiled after a removal), through the compiled wrapper and on the module it holds; blocks compiled in place
  (regional compilation) are refused.
- ToDo with fused QKV projections, in both orders; ToDo on ``attn1`` that is a cross-attention is refused; a class
  instead of an instance is named. (A merge window larger than a call's token grid: tests/test_never_break.py.)
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny_models import dit_inputs, ldm_unet, make_flux, make_pixart, make_unet, unet_inputs

import tokenmerge


def _hooks():
    """``diffusers.hooks``, or a skip saying this diffusers predates it."""
    import diffusers

    try:
        import diffusers.hooks as hooks
    except ImportError:
        pytest.skip(f"diffusers {diffusers.__version__} has no diffusers.hooks (no cache hooks to combine with)")
    return hooks


def _need(hooks, *names):
    import diffusers

    missing = [n for n in names if not hasattr(hooks, n)]
    if missing:
        pytest.skip(f"diffusers {diffusers.__version__} has no {', '.join(missing)}")
    return [getattr(hooks, n) for n in names]


@contextlib.contextmanager
def cache_context(model, name="cond"):
    """The cache context diffusers' stateful hooks need (``model.cache_context`` where the model has one)."""
    if hasattr(model, "cache_context"):
        with model.cache_context(name):
            yield
        return
    try:
        from diffusers.hooks import HookRegistry
    except ImportError:  # a diffusers without hooks: nothing to set
        yield
        return

    registry = HookRegistry.check_if_exists_or_initialize(model)
    if hasattr(registry, "_set_context"):  # diffusers before CacheContext
        registry._set_context(name)
        try:
            yield
        finally:
            registry._set_context(None)
        return
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    _set_cache_context(model, CacheContext(name))
    try:
        yield
    finally:
        _set_cache_context(model, None)


STEP = {"t": 700}


def _pab(hooks):
    (config,) = _need(hooks, "PyramidAttentionBroadcastConfig")
    return hooks.apply_pyramid_attention_broadcast, config(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(100, 800),
        current_timestep_callback=lambda: STEP["t"])


def _faster(hooks):
    (config,) = _need(hooks, "FasterCacheConfig")
    return hooks.apply_faster_cache, config(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 681),
        current_timestep_callback=lambda: STEP["t"], attention_weight_callback=lambda _: 0.5,
        is_guidance_distilled=True)


def _taylorseer(hooks):
    (config,) = _need(hooks, "TaylorSeerCacheConfig")
    return hooks.apply_taylorseer_cache, config(cache_interval=2, disable_cache_before_step=1,
                                                cache_identifiers=[r"transformer_blocks\.\d+\.attn1"],
                                                taylor_factors_dtype=torch.float32)


def _unet_call(model, step=0):
    inputs = unet_inputs(seed=step)
    inputs["timestep"] = torch.tensor(STEP["t"])
    with torch.no_grad():
        return model(**inputs).sample


def _pixart_call(model, step=0):
    inputs = dit_inputs("pixart", seed=step)
    inputs["timestep"] = torch.full((2,), STEP["t"])
    with torch.no_grad(), cache_context(model):
        return model(**inputs).sample


def _flux_call(model, step=0):
    inputs = dit_inputs("flux", h=4, w=4, seed=step)
    inputs["timestep"] = torch.full((2,), STEP["t"] / 1000)
    with torch.no_grad(), cache_context(model):
        return model(**inputs).sample


def _taylorseer_flux(hooks):
    """TaylorSeer on every ``attn`` of a Flux model (its default identifiers), through ``enable_cache``."""
    (config,) = _need(hooks, "TaylorSeerCacheConfig")

    def apply(model, cache):
        if not hasattr(model, "enable_cache"):
            pytest.skip("this diffusers' Flux model has no enable_cache")
        model.enable_cache(cache)

    return apply, config(cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32)


# (cache, model factory, call) of the attention-level caches diffusers ships
ATTENTION_CACHES = {
    "pab-unet": (_pab, lambda: make_unet("sd"), _unet_call),
    "pab-pixart": (_pab, make_pixart, _pixart_call),
    "fastercache-pixart": (_faster, make_pixart, _pixart_call),
    "taylorseer-pixart": (_taylorseer, make_pixart, _pixart_call),
    "taylorseer-flux": (_taylorseer_flux, make_flux, _flux_call),
}
STEPS = (700, 600, 500, 400)
# what each cache gives at steps 1 and 3 of STEPS from the outputs it computed (o[0], o[2]): PAB reuses the last;
# FasterCache (guidance-distilled, weight 0.5) and TaylorSeer (order 1, every other step) extrapolate the last two
CACHED = {
    "pab": {1: lambda o: o[0], 3: lambda o: o[2]},
    "fastercache": {1: lambda o: o[0], 3: lambda o: o[2] + (o[2] - o[0]) * 0.5},
    "taylorseer": {1: lambda o: o[0], 3: lambda o: o[2] + (o[2] - o[0]) / 2},
}
MERGING = {
    "tome": lambda m: tokenmerge.apply_patch(m, ratio=0.5),
    "todo-ratio": lambda m: tokenmerge.apply_todo(m, ratio=0.5),
}


def _cached_names(model) -> list[str]:
    """The modules that carry a cache hook (the attention modules the cache chose)."""
    return [name for name, module in model.named_modules()
            if any(n in CACHE_HOOKS for n in getattr(module.__dict__.get("_diffusers_hook"), "hooks", {}))]


CACHE_HOOKS = ("pyramid_attention_broadcast", "faster_cache_block", "taylorseer_cache")


def _as_the_cache_would(model, names, rule):
    """Forward hooks (after the patch's) on the modules ``names``: they record each step's whole-token output and,
    at the steps of ``rule``, return what the cache would return from them (computed by hand)."""
    history, step, handles = {n: [] for n in names}, {"i": 0}, []
    modules = dict(model.named_modules())

    def hook(name):
        def fn(module, args, output):
            done = history[name]
            if step["i"] in rule:
                outs = [tuple(o) if isinstance(o, tuple) else (o,) for o in done]
                made = tuple(rule[step["i"]]([o[k] for o in outs]) for k in range(len(outs[0])))
                output = made if isinstance(output, tuple) else made[0]
            done.append(output)
            return output
        return fn

    for name in names:
        handles.append(modules[name].register_forward_hook(hook(name)))
    return step, handles


@pytest.mark.usefixtures("fast_cpu")
@pytest.mark.parametrize("case,method", [(c, "tome") for c in ATTENTION_CACHES] + [("pab-pixart", "todo-ratio")])
@pytest.mark.parametrize("order", ["cache-then-patch", "patch-then-cache"])
def test_attention_caches_give_each_token_its_own_cached_output(case, method, order):
    """The cache sees whole tokens: at the steps it reuses or extrapolates, each token gets what the cache gives
    from that token's own (unmerged) outputs at the steps it computed, as on an unmerged model (computed by hand
    from the merged model's outputs); the patch merges from inside the module's hook chain, below the cache."""
    cache, factory, call = ATTENTION_CACHES[case]
    apply, config = cache(_hooks())
    model = factory()
    if order == "cache-then-patch":
        apply(model, config)
        MERGING[method](model)
    else:
        MERGING[method](model)
        apply(model, config)
    names = _cached_names(model)
    assert names, "the cache hooked no module"
    outputs = []
    for i, t in enumerate(STEPS):
        STEP["t"] = t
        outputs.append(call(model, i))

    reference = MERGING[method](factory())
    step, handles = _as_the_cache_would(reference, names, CACHED[case.split("-")[0]])
    plain = MERGING[method](factory())
    for i, t in enumerate(STEPS):
        STEP["t"] = t
        step["i"] = i
        expected = call(reference, i)
        scale = expected.abs().max()
        torch.testing.assert_close(outputs[i] / scale, expected / scale, rtol=0, atol=1e-6)
        if i in (1, 3):  # the cache changed these steps: a test that mixed tokens up would see it
            assert not torch.allclose(expected, call(plain, i))
    for h in handles:
        h.remove()
    tokenmerge.remove_patch(model)
    assert _cached_names(model) == names  # the cache's hooks stay; the patch's went with it
    assert not any("tokenmerge_chain_hook" in getattr(m.__dict__.get("_diffusers_hook"), "hooks", ())
                   for m in model.modules())


def test_removing_the_patch_under_a_cache_restores_the_cached_model():
    """PAB, then ToMe, then the patch removed: the same outputs as PAB on a model never patched, and no registry
    the patch made is left behind."""
    apply, config = _pab(_hooks())
    reference, model = make_pixart(), make_pixart()
    apply(reference, config)
    apply(model, config)
    registries = {n for n, m in model.named_modules() if "_diffusers_hook" in m.__dict__}
    tokenmerge.apply_patch(model, ratio=0.5)
    assert {n for n, m in model.named_modules() if "_diffusers_hook" in m.__dict__} > registries  # watched
    tokenmerge.remove_patch(model)
    assert {n for n, m in model.named_modules() if "_diffusers_hook" in m.__dict__} == registries
    assert model.transformer_blocks[0].attn1._diffusers_hook._hook_order == ["pyramid_attention_broadcast"]
    for i, t in enumerate(STEPS):
        STEP["t"] = t
        torch.testing.assert_close(_pixart_call(model, i), _pixart_call(reference, i), rtol=0, atol=0)


def test_a_hook_that_cannot_be_registered_again_above_a_cache():
    """The patch goes below a cache by registering the cache's hooks again above its own; a hook added after the
    cache that does not support removal (as diffusers' layerwise casting) stops that: refused at apply_patch. Added
    after the patch and the cache, it makes remove_patch leave the patch's hook in place, passing everything."""
    hooks = _hooks()

    class Pinned(hooks.ModelHook):
        def deinitalize_hook(self, module):
            raise NotImplementedError("cannot be removed")

    apply, config = _pab(hooks)
    model, reference = make_pixart(), make_pixart()
    apply(model, config)
    hooks.HookRegistry.check_if_exists_or_initialize(model.transformer_blocks[0].attn1).register_hook(Pinned(), "pin")
    with pytest.raises(ValueError, match="the diffusers hook 'pin' added after it cannot be registered again"):
        tokenmerge.apply_patch(model, ratio=0.5)
    assert tokenmerge.describe_patch(model) is None

    model = make_pixart()
    tokenmerge.apply_patch(model, ratio=0.5)
    for m in (model, reference):
        apply(m, config)
        hooks.HookRegistry.check_if_exists_or_initialize(m.transformer_blocks[0].attn1).register_hook(Pinned(), "pin")
    tokenmerge.remove_patch(model)
    assert model.transformer_blocks[0].attn1._diffusers_hook._hook_order == [
        "tokenmerge_chain_hook", "pyramid_attention_broadcast", "pin"]
    for i, t in enumerate(STEPS):
        STEP["t"] = t
        torch.testing.assert_close(_pixart_call(model, i), _pixart_call(reference, i), rtol=0, atol=0)


def _taylorseer_on(hooks, pattern):
    (config,) = _need(hooks, "TaylorSeerCacheConfig")
    return hooks.apply_taylorseer_cache, config(cache_interval=2, disable_cache_before_step=1,
                                                cache_identifiers=[pattern], taylor_factors_dtype=torch.float32)


@pytest.mark.parametrize("order", ["cache-then-patch", "patch-then-cache"])
def test_a_cache_inside_a_merged_target_is_refused_before_any_call(order):
    """A cache on a sub-module of a merged target (here TaylorSeer on attn1's output projection) would keep merged
    tokens whichever way: refused at apply_patch, or at the cache's own registration."""
    apply, config = _taylorseer_on(_hooks(), r"transformer_blocks\.\d+\.attn1\.to_out\.0")
    model = make_pixart()
    if order == "cache-then-patch":
        apply(model, config)
        with pytest.raises(ValueError, match=r"TaylorSeer cache \(apply_taylorseer_cache\) is enabled on "
                                             r"transformer_blocks.0.attn1.to_out.0.*inside a merged target"):
            tokenmerge.apply_patch(model, ratio=0.5)
        assert tokenmerge.describe_patch(model) is None
        return
    tokenmerge.apply_patch(model, ratio=0.5)
    with pytest.raises(ValueError, match=r"TaylorSeer cache \(apply_taylorseer_cache\) cannot be added after the "
                                         r"patch on transformer_blocks.0.attn1.to_out.0"):
        apply(model, config)
    STEP["t"] = 700
    _pixart_call(model)  # the call itself runs


@pytest.mark.parametrize("cache", ["pab", "first-block-cache"])
@pytest.mark.parametrize("order", ["cache-then-patch", "patch-then-cache"])
def test_caches_on_blocks_merged_whole_are_refused_before_any_call(cache, order):
    """scope="block" runs whole blocks on merged tokens: a cache on a block or inside one cannot see whole tokens."""
    hooks = _hooks()
    if cache == "pab":
        apply, config = _pab(hooks)
    else:
        (fbc,) = _need(hooks, "FirstBlockCacheConfig")
        apply, config = hooks.apply_first_block_cache, fbc(threshold=1e9)
    model = make_pixart()
    match = r"cannot be added after the patch|is enabled" if cache == "pab" else "First Block Cache"
    if order == "cache-then-patch":
        apply(model, config)
        with pytest.raises(ValueError, match=rf"(?s)({match}).*scope='block' merges the tokens of its block"):
            tokenmerge.apply_patch(model, ratio=0.5, scope="block")
        return
    tokenmerge.apply_patch(model, ratio=0.5, scope="block")
    with pytest.raises(ValueError, match=r"cannot be added after the patch.*scope='block'"):
        apply(model, config)


def _attn1_outputs(model):
    """Forward hooks that record (``record=True``) or replay each ``attn1``'s output."""
    store, handles = {}, []
    mode = {"record": True}

    def hook(name):
        def fn(module, args, output):
            if mode["record"]:
                store[name] = output
                return None
            return store[name]
        return fn

    for name, module in model.named_modules():
        if name.endswith("attn1"):
            handles.append(module.register_forward_hook(hook(name)))
    return mode, handles


@pytest.mark.parametrize("order", ["cache-then-patch", "patch-then-cache"])
def test_todo_with_pyramid_attention_broadcast_reuses_full_outputs(order):
    """ToDo keeps every query, so an attention output reused by PAB is in full token space: the output at a reused
    step is the ToDo model's with every ``attn1`` output of the previous step (computed by hand here)."""
    apply, config = _pab(_hooks())
    model = make_unet("sd")
    if order == "cache-then-patch":
        apply(model, config)
        tokenmerge.apply_todo(model)
    else:
        tokenmerge.apply_todo(model)
        apply(model, config)
    STEP["t"] = 700
    _unet_call(model, 0)
    STEP["t"] = 600
    cached = _unet_call(model, 1)  # PAB reuses every attn1 output here (iteration 1, timestep in range)

    reference = tokenmerge.apply_todo(make_unet("sd"))
    mode, handles = _attn1_outputs(reference)
    STEP["t"] = 700
    _unet_call(reference, 0)
    mode["record"] = False
    STEP["t"] = 600
    expected = _unet_call(reference, 1)
    mode["record"] = True
    for h in handles:
        h.remove()
    fresh = _unet_call(reference, 1)
    assert not torch.allclose(expected, fresh)  # the reuse changes the output: the test would see a mix-up
    torch.testing.assert_close(cached, expected, rtol=0, atol=0)


@pytest.mark.parametrize("case", [c for c in ATTENTION_CACHES if c.endswith("pixart")])
@pytest.mark.parametrize("order", ["cache-then-patch", "patch-then-cache"])
def test_attention_caches_with_todo_pooling_only_are_allowed(case, order):
    """ToDo without query merging leaves every attention output in full token space, so an attention cache
    reuses (or extrapolates) outputs in the right places, as PAB's exact test above shows: allowed."""
    cache, factory, call = ATTENTION_CACHES[case]
    apply, config = cache(_hooks())
    model = factory()
    if order == "cache-then-patch":
        apply(model, config)
        tokenmerge.apply_todo(model)
    else:
        tokenmerge.apply_todo(model)
        apply(model, config)
    for step, t in enumerate((700, 600, 500, 400)):
        STEP["t"] = t
        assert torch.isfinite(call(model, step)).all()


def _block_hooks(model, replace):
    """Forward hooks on the two blocks of the tiny PixArt: ``replace[i](input, output)`` gives block i's output."""
    handles = []
    for i, block in enumerate(model.transformer_blocks):
        def fn(module, args, kwargs, output, i=i):
            x = kwargs.get("hidden_states", args[0] if args else None)
            return replace[i](x, output)
        handles.append(block.register_forward_hook(fn, with_kwargs=True))
    return handles


BLOCK_PATCHES = {
    "tome": lambda m: tokenmerge.apply_patch(m, ratio=0.5),
    "todo": lambda m: tokenmerge.apply_todo(m, ratio=0.5),
}


@pytest.mark.parametrize("method", list(BLOCK_PATCHES))
@pytest.mark.parametrize("order", ["cache-then-patch", "patch-then-cache"])
def test_first_block_cache_with_merging_gives_what_the_cache_computes(method, order):
    """At a step First Block Cache skips, the blocks' output is the head block's (patched, merged inside) plus the
    tail residual of the last full step: block outputs are in full token space, so nothing mixes plans."""
    hooks = _hooks()
    (config,) = _need(hooks, "FirstBlockCacheConfig")
    model = make_pixart()
    patch = BLOCK_PATCHES[method]
    if order == "cache-then-patch":
        hooks.apply_first_block_cache(model, config(threshold=1e9))
        patch(model)
    else:
        patch(model)
        hooks.apply_first_block_cache(model, config(threshold=1e9))
    STEP["t"] = 700
    _pixart_call(model, 0)
    STEP["t"] = 600
    cached = _pixart_call(model, 1)  # skipped after the head block

    reference = patch(make_pixart())
    seen = {}
    handles = _block_hooks(reference, [lambda x, out: seen.__setitem__("head", out),
                                       lambda x, out: seen.__setitem__("tail", out)])
    STEP["t"] = 700
    _pixart_call(reference, 0)
    for h in handles:
        h.remove()
    residual = seen["tail"] - seen["head"]
    handles = _block_hooks(reference, [lambda x, out: out + residual, lambda x, out: x])
    STEP["t"] = 600
    expected = _pixart_call(reference, 1)
    for h in handles:
        h.remove()
    assert not torch.allclose(expected, _pixart_call(reference, 1))
    torch.testing.assert_close(cached, expected, rtol=1e-6, atol=1e-6)
    assert tokenmerge.describe_patch(model).num_blocks == 2


@pytest.mark.parametrize("method", list(BLOCK_PATCHES))
@pytest.mark.parametrize("order", ["cache-then-patch", "patch-then-cache"])
def test_mag_cache_with_merging_gives_what_the_cache_computes(method, order):
    """At a step MagCache skips, the blocks' output is their input plus the residual of the last full step."""
    hooks = _hooks()
    (config,) = _need(hooks, "MagCacheConfig")
    model = make_pixart()
    cache = config(threshold=0.5, max_skip_steps=3, retention_ratio=0.0, num_inference_steps=4,
                   mag_ratios=[1.0] * 4)
    if order == "cache-then-patch":
        hooks.apply_mag_cache(model, cache)
        BLOCK_PATCHES[method](model)
    else:
        BLOCK_PATCHES[method](model)
        hooks.apply_mag_cache(model, cache)
    STEP["t"] = 700
    _pixart_call(model, 0)
    STEP["t"] = 600
    cached = _pixart_call(model, 1)

    reference = BLOCK_PATCHES[method](make_pixart())
    seen = {}
    handles = _block_hooks(reference, [lambda x, out: seen.__setitem__("in", x),
                                       lambda x, out: seen.__setitem__("out", out)])
    STEP["t"] = 700
    _pixart_call(reference, 0)
    for h in handles:
        h.remove()
    residual = seen["out"] - seen["in"]
    handles = _block_hooks(reference, [lambda x, out: x + residual, lambda x, out: x])
    STEP["t"] = 600
    expected = _pixart_call(reference, 1)
    for h in handles:
        h.remove()
    assert not torch.allclose(expected, _pixart_call(reference, 1))
    torch.testing.assert_close(cached, expected, rtol=1e-6, atol=1e-6)


def test_stateful_hooks_on_merged_modules_are_refused_and_stateless_ones_are_not():
    """A cache diffusers ships later (or SeaCache / the text K/V cache put on a merged module) is known by what it
    is (a stateful hook): on a merged target it sees whole tokens, inside one it is refused, at its registration or
    at apply_patch; a hook that computes from its input every call (here: a scaling) is left alone."""
    hooks = _hooks()

    class Stateless(hooks.ModelHook):
        def post_forward(self, module, output):
            return output * 1.0

    class Kept(hooks.ModelHook):
        _is_stateful = True

        def reset_state(self, module):
            return module

    model = make_unet("sd")
    attn1 = model.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    hooks.HookRegistry.check_if_exists_or_initialize(attn1.to_q).register_hook(Stateless(), "my_scale")
    tokenmerge.apply_patch(model, ratio=0.5)
    merged = _unet_call(model)
    with pytest.raises(ValueError, match=r"'my_cache' \(Kept.*cannot be added after the patch on .*attn1.to_out.0"):
        hooks.HookRegistry.check_if_exists_or_initialize(attn1.to_out[0]).register_hook(Kept(), "my_cache")
    hooks.HookRegistry.check_if_exists_or_initialize(attn1).register_hook(Kept(), "my_cache")  # on the target
    assert attn1._diffusers_hook._hook_order == ["tokenmerge_chain_hook", "my_cache"]
    torch.testing.assert_close(_unet_call(model), merged, rtol=0, atol=0)  # merged inside, below it
    tokenmerge.remove_patch(model)
    hooks.HookRegistry.check_if_exists_or_initialize(attn1.to_out[0]).register_hook(Kept(), "my_cache")
    with pytest.raises(ValueError, match="'my_cache'.*is enabled on .*to_out.0"):
        tokenmerge.apply_patch(model, ratio=0.5)
    tokenmerge.apply_patch(model, ratio=0.5, merge_attn=False, merge_mlp=True)  # the cache is not in ff: fine
    _unet_call(model)


# ---- torch.compile ------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _eager_reference():
    """The tiny PixArt's output (its graph traces in seconds, a UNet's in tens): plain, ToMe 0.5, ToMe 0.3."""
    ref = make_pixart()
    outputs = [_pixart_call(ref)]
    for ratio in (0.5, 0.3):
        tokenmerge.apply_patch(ref, ratio=ratio)
        outputs.append(_pixart_call(ref))
    return outputs


def _compiled_calls_follow_the_patch(compiled, model):
    """Both orders of issue #34 on one compiled PixArt: (a) compiled and called, then patched; (b) removed, then
    patched again with another ratio; and a patch replaced. Each compiled call gives what the eager model gives
    with the patch of that moment."""
    plain, merged, lighter = _eager_reference()
    close = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_pixart_call(compiled), plain, **close)
    tokenmerge.apply_patch(model, ratio=0.5)  # (a) code compiled before the patch
    torch.testing.assert_close(_pixart_call(compiled), merged, **close)
    tokenmerge.remove_patch(model)
    torch.testing.assert_close(_pixart_call(compiled), plain, **close)
    tokenmerge.apply_patch(model, ratio=0.3)  # (b) code compiled after a removal
    torch.testing.assert_close(_pixart_call(compiled), lighter, **close)
    tokenmerge.apply_patch(compiled, ratio=0.5)  # replaced, through the wrapper (or the module compiled in place)
    torch.testing.assert_close(_pixart_call(compiled), merged, **close)


@pytest.mark.compile
@pytest.mark.parametrize("how", ["wrapper", pytest.param("in-place", marks=pytest.mark.slow)])
def test_compiled_calls_follow_apply_and_remove(how, fresh_dynamo):
    """Dynamo does not guard on empty hook dicts: code compiled before a patch (or after a removal) would keep
    running without it. Installing and removing a patch drop the code compiled for the model's modules, so the next
    compiled call is traced again with the hooks as they are (eager backend: the tracing is what is tested)."""
    model = make_pixart()
    if how == "wrapper":
        _compiled_calls_follow_the_patch(torch.compile(model, backend="eager"), model)
    else:
        model.compile(backend="eager")
        _compiled_calls_follow_the_patch(model, model)


@pytest.mark.compile
@pytest.mark.slow
def test_inductor_compiled_calls_follow_apply_and_remove(fresh_dynamo):
    """The same with inductor's generated code (five compilations of the tiny PixArt: minutes on 2 cores)."""
    model = make_pixart()
    _compiled_calls_follow_the_patch(torch.compile(model), model)


@pytest.mark.compile
@pytest.mark.parametrize("order", ["compile-then-patch", "patch-then-compile"])
def test_blocks_compiled_in_place_are_refused(order, fresh_dynamo):
    """Regional compilation (blocks compiled in place, as diffusers' compile_repeated_blocks does) runs the blocks'
    hooks apart from the denoiser's call, whose grid they need: refused at apply, or at the first call after it."""
    model = make_pixart()
    plain = _pixart_call(model)
    if order == "compile-then-patch":
        for block in model.transformer_blocks:
            block.compile(backend="eager")
        with pytest.raises(ValueError, match=r"transformer_blocks.0 is compiled in place .*Compile the whole denoiser"):
            tokenmerge.apply_patch(model, ratio=0.5)
        assert tokenmerge.describe_patch(model) is None
        return
    tokenmerge.apply_patch(model, ratio=0.5)
    model.transformer_blocks[1].attn1.compile(backend="eager")
    with pytest.raises(ValueError, match=r"transformer_blocks.1.attn1 was compiled in place after the patch"):
        _pixart_call(model)
    tokenmerge.remove_patch(model)
    torch.testing.assert_close(_pixart_call(model), plain, rtol=1e-5, atol=1e-5)


# ---- ToDo with fused projections, ToDo on cross-attention, classes -------------------------------------------
@pytest.mark.parametrize("order", ["fuse-then-todo", "todo-then-fuse"])
def test_todo_with_fused_qkv_projections(order):
    reference = tokenmerge.apply_todo(make_unet("sd"))
    expected = _unet_call(reference)
    model = make_unet("sd")
    if not hasattr(model, "fuse_qkv_projections"):
        pytest.skip("this diffusers has no fuse_qkv_projections")
    if order == "fuse-then-todo":
        model.fuse_qkv_projections()
        tokenmerge.apply_todo(model)
    else:
        tokenmerge.apply_todo(model)
        model.fuse_qkv_projections()
    torch.testing.assert_close(_unet_call(model), expected, rtol=1e-5, atol=1e-5)
    keys = set(model.state_dict())
    tokenmerge.remove_patch(model)
    assert set(model.state_dict()) == keys  # the adapter is not a sub-module
    assert not any("to_kv" in vars(m) for m in model.modules())
    fused_plain = make_unet("sd")
    fused_plain.fuse_qkv_projections()
    torch.testing.assert_close(_unet_call(model), _unet_call(fused_plain), rtol=0, atol=0)


def test_todo_where_attn1_is_a_cross_attention_is_refused():
    model = make_unet("sd", only_cross_attention=True)  # the x4 upscaler's layout
    with pytest.raises(ValueError, match="only_cross_attention.*ToDo would change nothing"):
        tokenmerge.apply_todo(model)
    assert tokenmerge.describe_patch(model) is None
    tokenmerge.apply_patch(model, ratio=0.5)  # ToMe merges the queries of that attn1: fine
    ldm = ldm_unet()
    for module in ldm.modules():
        if hasattr(module, "disable_self_attn"):
            module.disable_self_attn = True
    with pytest.raises(ValueError, match="disable_self_attn"):
        tokenmerge.apply_todo(ldm)


def test_a_class_instead_of_an_instance_is_named():
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    for cls in (UNet2DConditionModel, StableDiffusionPipeline):
        for fn in (tokenmerge.apply_patch, tokenmerge.apply_todo, tokenmerge.remove_patch,
                   tokenmerge.describe_patch):
            with pytest.raises(TypeError, match=rf"the class .*\.{cls.__name__}, not a model: pass an instance"):
                fn(cls)


def test_the_call_time_check_is_cheap():
    """The check a patched denoiser call makes (caches added since the patch): a dictionary lookup per module that
    sees merged tokens, once per call (about 25 us for the 220 such modules of this whole-UNet patch)."""
    import time

    model = make_unet("sdxl")
    tokenmerge.apply_patch(model, ratio=0.5, max_downsample=4, merge_crossattn=True, merge_mlp=True)
    watch = getattr(model, "_tokenmerge_patch").watch  # what each call checks (engine/call.py)
    assert len(watch.region) > 200
    watch.check()
    start = time.perf_counter()
    for _ in range(200):
        watch.check()
    assert (time.perf_counter() - start) / 200 < 1e-3
