"""The UNet cache (``apply_unet_cache``): its schedule, its refusals, cached steps against references made from the
unpatched model, computed steps exactly the unpatched model's, no deep block run at a cached step, one kept state per
guidance branch, ControlNet and T2I-Adapter residuals, FreeU, every UNet family of the catalogue, pipelines,
torch.compile, removal.

References: at a cached step, the unpatched model's output with the output of its deepest cached module
(``up_blocks[-depth - 1]``) replaced by ``F + extrapolate * S * dt`` (``F`` that module's output at the last computed
step, ``S`` its change per unit of progress since the computed step before, ``dt`` the progress since the last
computed step); the shallow blocks compute normally (the deep ones run in the reference, their outputs unused)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from tiny_denoisers import (
    CATALOGUE,
    all_tensors,
    available,
    compiled_twice,
    lora_after_the_patch,
    stopped_and_restarted,
)
from tiny_denoisers import outputs_of as _run
from tiny_denoisers import progress_of as _progress
from tiny_models import ldm_unet, make_controlnet, make_unet, steps_of, unet_inputs

import tokenmerge
from tokenmerge import StepCacheConfig, UNetCacheConfig
from tokenmerge.families import BUILTIN

pytestmark = pytest.mark.usefixtures("fast_cpu")
SLOW = pytest.mark.slow
ENTRIES = sorted({e for f in BUILTIN if f.kind == "unet" for e in f.examples} & set(CATALOGUE))
# refused at apply time, with a word of the reason: ControlNets alone (their outputs are read at every level) and
# ControlNet-XS (a control UNet beside the base one)
REFUSED = {"controlnet": "ControlNet", "controlnet-union": "ControlNet", "sparsectrl": "ControlNet",
           "controlnet-xs": "ControlNet-XS"}


def _model(name):
    """``sd``: the SD layout, 2 levels of 2 layers; ``sdxl``: the SDXL layout, 3 levels of 1 layer."""
    if name == "sd":
        model = make_unet("sd")
        return model, _floated(unet_inputs(batch=2, h=8, w=8))
    entry = CATALOGUE["unet-sdxl"]
    return entry.build(), entry.inputs(batch=2)


def _floated(call):
    """A float timestep (as a pipeline's scheduler gives; the later steps' are float)."""
    return dict(call, timestep=call["timestep"].float())


def _feature_module(model, depth, layers=None):
    """The deepest module a cached step does not run: ``up_blocks[-depth - 1]`` (the mid block at ``depth`` = the
    levels), or with ``layers`` the layer of ``up_blocks[-depth]`` that reads the skip of ``down_blocks[depth - 1]``'s
    layer ``layers`` (its attention, or its resnet)."""
    n = len(model.down_blocks)
    size = len(model.down_blocks[depth - 1].resnets)
    if layers is None or layers == size:
        return model.up_blocks[n - depth - 1] if depth < n else model.mid_block
    up = model.up_blocks[n - depth]
    return (up.attentions if getattr(up, "attentions", None) else up.resnets)[size - layers - 1]


def _features(model, calls, depth, layers=None):
    """The unpatched model's feature (the deepest cached module's output) at each call."""
    seen = []
    hook = _feature_module(model, depth, layers).register_forward_hook(
        lambda m, a, out: seen.append((out if isinstance(out, torch.Tensor) else out[0]).clone()))
    try:
        _run(model, calls)
    finally:
        hook.remove()
    return seen


def _with_feature(model, call, depth, feature, layers=None):
    """The unpatched model's output for ``call`` with its feature replaced by ``feature``."""
    hook = _feature_module(model, depth, layers).register_forward_hook(
        lambda m, a, out: feature.clone() if isinstance(out, torch.Tensor) else type(out)((feature.clone(), *out[1:])))
    try:
        return _run(model, [call])[0]
    finally:
        hook.remove()


def _reference(model, calls, cfg, branch=None):
    """Each call's reference output under a UNet cache of ``cfg`` (computed: the unpatched output)."""
    features = _features(model, calls, cfg.depth, cfg.layers)
    progress = [_progress(model, c) for c in calls]
    vanilla = _run(model, calls)
    out, last, before = [], None, None
    for k, call in enumerate(calls):
        if cfg.computes(k, progress[k], None if last is None else progress[last]):
            before, last = last, k
            out.append(vanilla[k])
            continue
        f = features[last]
        if before is not None and cfg.extrapolate:
            slope = (features[last] - features[before]) / (progress[last] - progress[before])
            f = f + cfg.extrapolate * (progress[k] - progress[last]) * slope
        out.append(_with_feature(model, call, cfg.depth, f, cfg.layers))
    return out


def _close(got, want):
    for k, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"call {k}: {m}")


# ---- the schedule and the settings ---------------------------------------------------------------------------------
def test_the_schedule():
    def mask(cfg, n):
        return "".join("1" if c else "0" for c in cfg.schedule(n))

    assert mask(UNetCacheConfig(warmup=1, skip=2), 10) == "1001001001"  # DeepCache's uniform interval N = 3
    assert mask(UNetCacheConfig(warmup=1, skip=4), 11) == "10000100001"  # N = 5
    assert mask(UNetCacheConfig(warmup=3, skip=2), 12) == "111001001001"
    assert mask(UNetCacheConfig(warmup=2, skip=1, skip_growth=1), 12) == "110100100010"
    assert mask(UNetCacheConfig(mask="1101"), 6) == "110111"  # steps past a mask's end are computed
    # the default schedule is the step cache's gap schedule at the UNet's own gap and gap_growth
    assert UNetCacheConfig().schedule(28, 3.0) == StepCacheConfig(gap=0.04, gap_growth=0.1).schedule(28, 3.0)
    assert UNetCacheConfig().schedule(28, 3.0) != StepCacheConfig().schedule(28, 3.0)
    assert UNetCacheConfig(skip=2).kind == "rounds" and UNetCacheConfig().kind == "gap"


@pytest.mark.parametrize("kwargs,words", [
    (dict(warmup=0), "warmup must be an integer >= 1"), (dict(skip=0), "skip must be None or an integer >= 1"),
    (dict(skip_growth=-1), "skip_growth must be"), (dict(extrapolate=-0.1), "extrapolate must be a number in"),
    (dict(skip=2, gap=0.1), "give one schedule"),
    (dict(depth=0), "depth must be an integer >= 1"), (dict(depth=1.5), "depth must be"),
    (dict(depth=True), "depth must be"), (dict(mask="0111"), "starting with 1"), (dict(layers=-1), "layers must be"),
    (dict(layers=0.5), "layers must be")])
def test_bad_settings_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        UNetCacheConfig(**kwargs)


def test_models_it_cannot_cut_are_refused_with_the_reason():
    unet = make_unet("sd")  # 2 levels
    with pytest.raises(ValueError, match="depth=3 leaves no deep path to cache .* it has 2 levels"):
        tokenmerge.apply_unet_cache(unet, depth=3)
    with pytest.raises(ValueError, match="LDM-style UNetModel's forward"):
        tokenmerge.apply_unet_cache(ldm_unet())
    if available("flux") is None:
        with pytest.raises(ValueError, match=r"is a transformer \(one stack of blocks\): use tokenmerge.apply_step"):
            tokenmerge.apply_unet_cache(CATALOGUE["flux"].build())
    with pytest.raises(ValueError, match="ControlNet's outputs are read at every level"):
        tokenmerge.apply_unet_cache(make_controlnet())
    unet.up_blocks[-1].resnets = unet.up_blocks[-1].resnets[:2]  # the last up block reads one skip fewer
    with pytest.raises(ValueError, match=r"last 1 up block\(s\) read 2 skip connections, where conv_in and the "
                                         r"first 1 down block\(s\) give 3"):
        tokenmerge.apply_unet_cache(unet)
    assert tokenmerge.describe_patch(unet) is None


# ---- against references ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,depth,layers,factor", [
    ("sd", 1, None, 1.0), ("sd", 1, 0, 0.7), ("sdxl", 2, None, 0.0), *(pytest.param(*p, marks=SLOW) for p in (
        ("sd", 1, None, 0.0), ("sd", 2, None, 0.7), ("sd", 1, 1, 0.0), ("sd", 2, 1, 1.0), ("sdxl", 1, None, 0.7),
        ("sdxl", 2, None, 1.0), ("sdxl", 1, 0, 1.0)))])
def test_cached_steps_against_the_reference(name, depth, layers, factor):
    """warmup=2, skip=2: computed, computed, cached, cached, computed, cached. Whole blocks (``layers=None``),
    or a cut inside ``down_blocks[depth - 1]`` after its first ``layers`` layers; depth 2 of 2 levels caches the mid
    block alone. Computed steps are the unpatched model's exactly, even after cached ones."""
    model, inputs = _model(name)
    calls = steps_of(model, inputs, 6)
    cfg = UNetCacheConfig(warmup=2, skip=2, extrapolate=factor, depth=depth, layers=layers)
    assert cfg.schedule(6) == [True, True, False, False, True, False]
    want = _reference(model, calls, cfg)
    tokenmerge.apply_config(model, cfg)
    got = _run(model, calls)
    tokenmerge.remove_patch(model)
    _close(got, want)
    vanilla = _run(model, calls)
    assert all(torch.equal(got[k], vanilla[k]) for k in (0, 1, 4)), "a computed step is not the unpatched model's"
    assert not torch.allclose(got[2], vanilla[2], atol=1e-4), "the cached step is the vanilla one"
    assert all(torch.equal(a, b) for a, b in zip(_run(model, calls), vanilla)), "removal is not bit-identical"


@pytest.mark.parametrize("layers", [pytest.param(None, marks=SLOW), 0])
def test_freeu_scaling_the_feature_in_place(layers):
    """FreeU scales each layer's input in up_blocks[0] and [1] in place (``apply_freeu``): at depth 2 of the SDXL
    layout the feature enters up_blocks[1] (FreeU's second stage); the kept feature stays the computed step's, and
    cut inside up_blocks[1] the cached layer's placeholder input takes the scaling."""
    model, inputs = _model("sdxl")
    model.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    calls = steps_of(model, inputs, 5)
    cfg = UNetCacheConfig(warmup=1, skip=2, depth=2, layers=layers)
    want = _reference(model, calls, cfg)
    tokenmerge.apply_config(model, cfg)
    got = _run(model, calls)
    tokenmerge.remove_patch(model)
    _close(got, want)


def test_guidance_as_two_calls_keeps_one_state_per_branch():
    """A conditional and an unconditional call per step, each its own branch: each branch follows its own reference
    (as if run alone)."""
    model, inputs = _model("sd")
    cond = steps_of(model, _floated(unet_inputs(batch=1, h=8, w=8, seed=0)), 5)
    uncond = [dict(c, encoder_hidden_states=torch.randn_like(c["encoder_hidden_states"])) for c in cond]
    cfg = UNetCacheConfig(warmup=2, skip=1, extrapolate=1.0)
    want = [_reference(model, branch, cfg) for branch in (cond, uncond)]
    tokenmerge.apply_config(model, cfg)
    got = [[], []]
    for c, u in zip(cond, uncond):
        got[0] += _run(model, [c])
        got[1] += _run(model, [u])
    patch = model._tokenmerge_patch
    assert len(patch.calls.state.clock.kept) == 2
    tokenmerge.remove_patch(model)
    for branch in range(2):
        _close(got[branch], want[branch])


@pytest.mark.parametrize("layers", [pytest.param(None, marks=SLOW), 0])
def test_a_cached_step_runs_no_deep_block(monkeypatch, layers):
    """Every module's own forward (its class's, counted per instance, wrapped before the patch) runs at every computed
    step; at a cached step the deep blocks and layers and all inside them run none, the shallow ones run as usual."""
    model, inputs = _model("sd")
    calls = steps_of(model, inputs, 4)
    counts: dict = {}
    for cls in {type(m) for m in model.modules()}:
        if "forward" not in cls.__dict__:
            continue

        @functools.wraps(cls.forward)  # (its signature: what binding an argument by name reads)
        def counted(self, *args, _forward=cls.forward, **kwargs):
            counts[id(self)] = counts.get(id(self), 0) + 1
            return _forward(self, *args, **kwargs)
        monkeypatch.setattr(cls, "forward", counted)
    down, up, size = model.down_blocks[0], model.up_blocks[-1], 2  # (2 layers)
    m = size if layers is None else layers
    deep = [*down.resnets[m:], *down.attentions[m:], *down.downsamplers, *model.down_blocks[1:], model.mid_block,
            *model.up_blocks[:-1], *up.resnets[:size - m], *up.attentions[:size - m]]
    shallow = [*down.resnets[:m], *down.attentions[:m], *up.resnets[size - m:], *up.attentions[size - m:],
               model.conv_in, model.conv_out]
    inside = {name: {id(m) for b in blocks for m in b.modules()} for name, blocks in (("deep", deep),
                                                                                      ("shallow", shallow))}
    # a module instance used on both paths (diffusers 0.27's activations: one SiLU shared by every resnet) is neither
    deep_names = tuple(f"{n}." for n, m in model.named_modules() if any(m is d for d in deep))
    shared = inside["deep"] & {id(m) for n, m in model.named_modules(remove_duplicate=False)
                               if not f"{n}.".startswith(deep_names)}
    inside = {name: ids - shared for name, ids in inside.items()}
    tokenmerge.apply_unet_cache(model, skip=2, warmup=1, layers=layers)
    per_call = []
    with torch.no_grad():
        for c in calls:
            counts.clear()
            model(**c)
            per_call.append({k: sum(counts.get(i, 0) for i in ids) for k, ids in inside.items()})
    tokenmerge.remove_patch(model)
    assert per_call[0]["deep"] > 0 and per_call[3] == per_call[0], per_call
    assert per_call[1]["deep"] == per_call[2]["deep"] == 0, per_call
    assert per_call[1]["shallow"] == per_call[2]["shallow"] == per_call[0]["shallow"] > 0, per_call


@pytest.mark.parametrize("layers", [None, 0])
def test_a_lora_loaded_after_the_patch_acts_at_every_step(layers):
    """A LoRA on the attention projections, loaded after the patch: the computed steps are the unpatched model's with
    the LoRA; a cached step carries it in the feature (deep path) and runs it where the shallow path's attention
    does."""
    model, inputs = _model("sd")
    calls = steps_of(model, inputs, 4)
    tokenmerge.apply_unet_cache(model, skip=1, warmup=1, layers=layers)  # computed, cached, computed, cached
    plain, with_lora, vanilla_lora = lora_after_the_patch(model, calls)
    for k in (0, 2):
        torch.testing.assert_close(with_lora[k], vanilla_lora[k], rtol=1e-5, atol=1e-5, msg=f"computed step {k}")
    assert not torch.allclose(with_lora[1], plain[1], atol=1e-4)  # the cached step sees the LoRA
    assert not torch.allclose(with_lora[1], vanilla_lora[1], atol=1e-4)  # and is a cached step


# ---- residuals the UNet adds between blocks ------------------------------------------------------------------------
def _controlled(unet, controlnet, calls, seed=5):
    """The calls with the ControlNet's residuals (one conditioning image per call)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c in calls:
        b, _, h, w = c["sample"].shape
        cond = torch.randn(b, 3, 2 * h, 2 * w, generator=gen)  # (2 conditioning levels: 2x the latent)
        with torch.no_grad():
            down, mid = controlnet(c["sample"], c["timestep"], c["encoder_hidden_states"], cond, return_dict=False)
        out.append(dict(c, down_block_additional_residuals=list(down), mid_block_additional_residual=mid))
    return out


def test_controlnet_residuals_at_a_cached_step():
    """A cached step reads this step's ControlNet residuals on the shallow skip connections (conv_in's and the first
    down block's: the reference adds them), and its deep and mid residuals only through the kept feature: changing
    them at a cached step changes nothing, changing a shallow one does."""
    unet, controlnet = make_unet("sd"), make_controlnet()
    calls = _controlled(unet, controlnet, steps_of(unet, _floated(unet_inputs(batch=2, h=8, w=8)), 4))
    cfg = UNetCacheConfig(warmup=2, skip=1, extrapolate=1.0)  # computed, computed, cached, computed
    want = _reference(unet, calls, cfg)
    tokenmerge.apply_config(unet, cfg)
    got = _run(unet, calls)
    reads = 3  # the last up block reads conv_in's skip and the first down block's two layers' (its downsampler's
    # output is read by up_blocks[0], a deep block)

    def moved(call, which, mid):
        down = [r + 1.0 if which(i) else r for i, r in enumerate(call["down_block_additional_residuals"])]
        return dict(call, down_block_additional_residuals=down,
                    mid_block_additional_residual=call["mid_block_additional_residual"] + mid)

    deep_moved = _run(unet, [*calls[:2], moved(calls[2], lambda i: i >= reads, 1.0)])[2]
    shallow_moved = _run(unet, [*calls[:2], moved(calls[2], lambda i: i == reads - 1, 0.0)])[2]
    tokenmerge.remove_patch(unet)
    _close(got, want)
    torch.testing.assert_close(deep_moved, got[2], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(shallow_moved, got[2], atol=1e-3)


def test_t2i_adapter_residuals_are_added_to_writable_placeholders():
    """T2I-Adapter's residuals are added in place to a DownBlock2D's output (``sample += ...``): at a cached step the
    deep block's placeholder takes it (fresh zeros, not a view of one zero), and the output follows the reference."""
    unet, inputs = _model("sd")
    calls = steps_of(unet, inputs, 4)
    gen = torch.Generator().manual_seed(3)
    shapes = [(2, 32, 8, 8), (2, 64, 4, 4)]  # the first down block's last layer, the second block's output
    adapters = [[torch.randn(s, generator=gen) for s in shapes] for _ in calls]

    def with_adapter(k):  # a fresh list per call: the UNet pops it
        return [dict(c, down_intrablock_additional_residuals=list(a)) for c, a in zip(calls, adapters)][k]

    cfg = UNetCacheConfig(warmup=1, skip=2)
    want = _with_feature(unet, with_adapter(1), 1, _features(unet, [with_adapter(0)], 1)[0])
    tokenmerge.apply_config(unet, cfg)
    got = [_run(unet, [with_adapter(k)])[0] for k in range(4)]
    tokenmerge.remove_patch(unet)
    torch.testing.assert_close(got[1], want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got[3], _run(unet, [with_adapter(3)])[0])


# ---- every UNet family ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [e if e in ("unet-sd", "unet-sdxl", "controlnet", "controlnet-xs") else
                                  pytest.param(e, marks=SLOW) for e in ENTRIES])
def test_every_unet_family_caches_or_is_refused_with_the_reason(name):
    """computed, cached, cached, computed (warmup=1, skip=2): the computed steps are the unpatched model's, the cached
    ones finite and not it, with no warning; removal gives the model back."""
    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    model = entry.build()
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            tokenmerge.apply_unet_cache(model, skip=2, warmup=1)
        assert tokenmerge.describe_patch(model) is None
        return
    calls = steps_of(model, entry.inputs(batch=2), 4)
    vanilla = _run(model, calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        tokenmerge.apply_unet_cache(model, skip=2, warmup=1)
        got = _run(model, calls)
    assert torch.equal(got[0], vanilla[0]) and torch.equal(got[3], vanilla[3])
    for a, b in zip(got[1:3], vanilla[1:3]):
        assert torch.isfinite(a).all() and not torch.allclose(a, b), "a cached step gave the vanilla output"
    tokenmerge.remove_patch(model)
    assert all(torch.equal(a, b) for a, b in zip(_run(model, calls), vanilla))


@pytest.mark.slow
def test_a_pipeline_with_a_controlnet_caches_its_unet_and_leaves_the_controlnet(tmp_path):
    from tiny_models import make_sd_pipeline

    pipe = make_sd_pipeline(tmp_path, controlnet=True)
    pipe.set_progress_bar_config(disable=True)
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def generate():
        return torch.from_numpy(pipe("a red cube", image=image, num_inference_steps=5, height=32, width=32,
                                     guidance_scale=5.0, generator=torch.Generator().manual_seed(0),
                                     output_type="np").images)

    vanilla = generate()
    with pytest.warns(UserWarning, match="controlnet is left unpatched by the UNet cache: a ControlNet's outputs"):
        tokenmerge.apply_unet_cache(pipe, skip=2, warmup=2)
    info = tokenmerge.describe_patch(pipe)
    assert [d.path for d in info.denoisers] == ["unet"]
    got, again = generate(), generate()
    tokenmerge.remove_patch(pipe)
    assert torch.equal(got, again), "a second generation did not start over"
    assert torch.isfinite(got).all() and not torch.allclose(got, vanilla, atol=1e-4)
    assert torch.equal(generate(), vanilla)


# ---- state, description, spec ---------------------------------------------------------------------------------------
def test_describe_patch_and_the_memory_it_keeps():
    model, inputs = _model("sdxl")
    calls = steps_of(model, inputs, 4)
    feature = _features(model, calls[:1], 1)[0]
    tokenmerge.apply_unet_cache(model, skip=1, warmup=2, extrapolate=1.0)
    info = str(tokenmerge.describe_patch(model))
    assert info.startswith("tokenmerge UNet cache: depth=1 layers=None warmup=2 skip=1 skip_growth=0 extrapolate=1")
    assert "shallower than up_blocks.1, whose output" in info and "its slope beside it" in info
    _run(model, calls)
    patch = model._tokenmerge_patch
    (kept,) = patch.calls.state.clock.kept.values()
    assert kept.feature.shape == kept.slope.shape == feature.shape
    # the placeholders: views of one zero each
    assert kept.blanks and all(t.untyped_storage().nbytes() == t.element_size() for b in kept.blanks.values()
                               for t in all_tensors(b))
    tokenmerge.remove_patch(model)
    assert not patch.calls.state.clock.kept


def test_a_new_generation_and_a_stopped_one_start_over():
    model, inputs = _model("sd")
    calls = steps_of(model, inputs, 5)
    tokenmerge.apply_unet_cache(model, skip=1, warmup=1, extrapolate=1.0)  # (stopped after its first cached step)
    assert stopped_and_restarted(model, calls)
    tokenmerge.remove_patch(model)


def test_an_img2img_generation_starting_midway_is_a_new_generation():
    """img2img's shorter generation from a later timestep, after a whole one: computed from its first step, as under
    a fresh patch."""
    model, inputs = _model("sd")
    calls = steps_of(model, inputs, 8)
    tokenmerge.apply_unet_cache(model, skip=2, warmup=1, extrapolate=1.0)
    _run(model, calls)
    midway = _run(model, calls[3:])
    tokenmerge.remove_patch(model)
    tokenmerge.apply_unet_cache(model, skip=2, warmup=1, extrapolate=1.0)
    fresh = _run(model, calls[3:])
    tokenmerge.remove_patch(model)
    assert torch.equal(midway[0], _run(model, calls[3:4])[0])
    assert all(torch.equal(a, b) for a, b in zip(midway, fresh))


def test_the_method_spec():
    from tokenmerge.tools.methods import parse_spec

    spec = parse_spec("unetcache:3,depth=2,warmup=1")
    assert spec.config() == UNetCacheConfig(warmup=1, skip=3, depth=2) and spec.is_across_steps and spec.stateful
    assert parse_spec("unetcache").config() == UNetCacheConfig()
    with pytest.raises(ValueError, match="unetcache"):
        parse_spec("unetcache:2,fraction=0.5")
    with pytest.raises(ValueError, match="depth must be"):
        parse_spec("unetcache:2,depth=0")


# ---- torch.compile ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("layers", [None, 0])
def test_compiled_gives_the_eager_outputs_and_a_second_generation_compiles_nothing(layers):
    """Compiled without fullgraph: the decision runs on the host (a graph break at each end of the call), the computed
    and cached calls compile once, a second generation compiles nothing more, and the outputs are the eager ones."""
    model, inputs = _model("sd")
    calls = steps_of(model, inputs, 7)
    tokenmerge.apply_unet_cache(model, skip=2, warmup=2, extrapolate=1.0, layers=layers)
    eager = _run(model, calls)
    try:
        got, again, breaks = compiled_twice(model, calls)
        with pytest.raises(torch._dynamo.exc.Unsupported, match="without fullgraph=True"):
            torch.compiler.reset()
            _run(torch.compile(model, fullgraph=True, backend="eager"), calls[:1])
    finally:
        tokenmerge.remove_patch(model)
        torch.compiler.reset()
    assert sum(breaks.values()) == 2 and all("on the host" in reason for reason in breaks), breaks
    for run in (got, again):
        for a, b in zip(run, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
