"""The step cache (``apply_step_cache``): its schedule, its refusals, skipped steps against references made from the
unpatched model (the stack's residual of the computed steps, moved along its slope), one kept state per guidance
branch, no block run at a skipped step, ControlNet residuals added afresh, every family of the catalogue, pipelines,
torch.compile, memory.

References: at a skipped step, the unpatched model's output with its last block's output replaced by the first
block's input at that step plus ``R + extrapolate * S * dt`` (``R`` the last block's output minus the first block's
input at the last computed step, ``S`` its change per unit of progress since the computed step before, ``dt`` the
progress since the last computed step); the stack's blocks run in the reference (their outputs are not used)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from tiny_denoisers import CATALOGUE, lora_after_the_patch, stopped_and_restarted
from tiny_denoisers import outputs_of as _run
from tiny_denoisers import progress_of as _progress
from tiny_denoisers import skip_unavailable as _skip
from tiny_models import counting_forwards, make_unet, runs_per_call, steps_of

import tokenmerge
from tokenmerge import StepCacheConfig
from tokenmerge.families import BUILTIN

pytestmark = pytest.mark.usefixtures("fast_cpu")
ENTRIES = sorted({example for f in BUILTIN for example in f.examples} & set(CATALOGUE))
# refused at apply time, with a word of the reason: UNets (their attention blocks sit between convolutions) and
# ControlNets (their outputs are read after every block)
REFUSED = {**{n: "UNet" for n in ("controlnet", "controlnet-union", "controlnet-xs", "dreamlite-unet", "i2vgen-xl",
                                  "sparsectrl", "unet-3d", "unet-motion", "unet-sd", "unet-sdxl", "unet-svd")},
           **{n: "ControlNet" for n in ("flux-controlnet", "flux-controlnet-union", "hunyuan-dit-controlnet",
                                        "qwen-image-controlnet", "sana-controlnet", "sd3-controlnet")}}


# ---- the schedule and the settings ---------------------------------------------------------------------------------
def test_the_schedule():
    def mask(cfg, n, shift=1.0):
        return "".join("1" if c else "0" for c in cfg.schedule(n, shift))

    assert mask(StepCacheConfig(warmup=2, skip=2), 9) == "110010010"
    assert mask(StepCacheConfig(warmup=3, skip=1, skip_growth=1), 20) == "11101001000100001000"
    assert mask(StepCacheConfig(warmup=4, skip=2, skip_growth=1), 20) == "11110010001000010000"
    assert mask(StepCacheConfig(warmup=1, skip=1, skip_growth=2), 10) == "1010001000"
    assert mask(StepCacheConfig(mask="1101"), 6) == "110111"  # steps past a mask's end are computed
    assert sum(StepCacheConfig(warmup=4, skip=1, skip_growth=1).schedule(50)) == 12
    # gap: computed once the progress since the last computed step passes gap + gap_growth x its progress
    gap = StepCacheConfig(warmup=3, gap=0.035, gap_growth=0.3)
    assert mask(gap, 20) == "11101010010001000010"  # linear: at progress .2 (.1 past .1 > .035 + .03), .3, .45, .7
    assert mask(gap, 28, 3.0) == "1110010001000100010001000100"  # shifted by 3: the late steps are long ones
    assert gap.kind == "gap" and StepCacheConfig(skip=1).kind == "rounds" and StepCacheConfig(mask="1").kind == "mask"


@pytest.mark.parametrize("kwargs,words", [
    (dict(warmup=0), "warmup must be an integer >= 1"), (dict(skip=0), "skip must be None or an integer >= 1"),
    (dict(gap=1.5), "gap must be a number in"), (dict(gap_growth=-0.1), "gap_growth must be"),
    (dict(skip=1, gap=0.05), "give one schedule"), (dict(mask="101", gap_growth=0.2), "give one schedule"),
    (dict(skip_growth=-1), "skip_growth must be"), (dict(skip=1.5), "skip must be"), (dict(warmup=True), "warmup"),
    (dict(extrapolate=1.5), "extrapolate must be a number in"), (dict(min_steps=-1), "min_steps must be"),
    (dict(mask="0111"), "starting with 1"), (dict(mask="11x"), "mask must be"), (dict(mask=""), "mask must be")])
def test_bad_settings_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        StepCacheConfig(**kwargs)


# ---- against references ---------------------------------------------------------------------------------------------
def _stack(model):
    """The tiny Flux.1's or Wan's blocks, and the (image, text) positions of their outputs (text: ``None``)."""
    if hasattr(model, "single_transformer_blocks"):
        return [*model.transformer_blocks, *model.single_transformer_blocks], (1, 0)
    return list(model.blocks), (None, None)


def _recorded(model, calls):
    """Per call of the unpatched model: the first block's inputs (image, text) and the last block's outputs."""
    blocks, (img, txt) = _stack(model)
    seen = []
    first = blocks[0].register_forward_pre_hook(
        lambda m, a, kw: seen.append({"x": kw.get("hidden_states", a[0] if a else None),
                                      "e": kw.get("encoder_hidden_states")}), with_kwargs=True)

    def last_out(m, a, kw, out):
        seen[-1]["y"] = out if img is None else out[img]
        seen[-1]["f"] = None if txt is None else out[txt]

    last = blocks[-1].register_forward_hook(last_out, with_kwargs=True)
    try:
        _run(model, calls)
    finally:
        first.remove()
        last.remove()
    return seen


def _with_stack_output(model, call, image, text):
    """The unpatched model's output for ``call`` with its last block's output replaced: ``image(x0)`` and
    ``text(e0)`` of the first block's inputs at this call."""
    blocks, (img, txt) = _stack(model)
    got = {}
    first = blocks[0].register_forward_pre_hook(
        lambda m, a, kw: got.update(x=kw.get("hidden_states", a[0] if a else None), e=kw.get("encoder_hidden_states")),
        with_kwargs=True)

    def replace(m, a, kw, out):
        if img is None:
            return image(got["x"])
        parts = list(out)
        parts[img], parts[txt] = image(got["x"]), text(got["e"])
        return type(out)(parts)

    last = blocks[-1].register_forward_hook(replace, with_kwargs=True)
    try:
        return _run(model, [call])[0]
    finally:
        first.remove()
        last.remove()


def _reference(model, calls, schedule, factor):
    """Each call's reference output under a step cache of ``schedule`` (computed: the unpatched output)."""
    seen = _recorded(model, calls)
    progress = [_progress(model, c) for c in calls]
    vanilla = _run(model, calls)
    out, last, before = [], None, None
    for k, call in enumerate(calls):
        if schedule[k]:
            before, last = last, k
            out.append(vanilla[k])
            continue
        r = {s: seen[last][o] - seen[last][i] for s, (i, o) in {"x": ("x", "y"), "e": ("e", "f")}.items()
             if seen[last][o] is not None}
        if before is not None and factor:
            gap, ahead = progress[last] - progress[before], progress[k] - progress[last]
            for s, (i, o) in {"x": ("x", "y"), "e": ("e", "f")}.items():
                if s in r:
                    slope = (r[s] - (seen[before][o] - seen[before][i])) / gap
                    r[s] = r[s] + factor * ahead * slope
        out.append(_with_stack_output(model, call, lambda x: x + r["x"], lambda e: e + r["e"] if "e" in r else e))
    return out


@pytest.mark.parametrize("name", ["flux", "wan"])
@pytest.mark.parametrize("factor", [0.0, 0.7, 1.0])
def test_skipped_steps_against_the_reference(name, factor):
    """warmup=2, skip=2: computed, computed, skipped, skipped, computed, skipped. A skipped step's output is the
    unpatched model's with the stack's output x0 + R + factor * S * dt (image and, on Flux.1, text)."""
    _skip(name)
    entry = CATALOGUE[name]
    model = entry.build()
    calls = steps_of(model, entry.inputs(batch=2), 6)
    cfg = StepCacheConfig(warmup=2, skip=2, extrapolate=factor)
    want = _reference(model, calls, cfg.schedule(6), factor)
    tokenmerge.apply_config(model, cfg)
    got = _run(model, calls)
    tokenmerge.remove_patch(model)
    assert cfg.schedule(6) == [True, True, False, False, True, False]
    for k, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"call {k}")
    assert not torch.allclose(got[2], _run(model, calls[2:3])[0], atol=1e-4), "the skipped step is the vanilla one"


def test_guidance_as_two_calls_keeps_one_state_per_branch():
    """Wan-style guidance: a conditional and an unconditional call per step, each its own branch: each branch follows
    its own reference (as if run alone)."""
    _skip("wan")
    entry = CATALOGUE["wan"]
    model = entry.build()
    cond = steps_of(model, entry.inputs(batch=1, seed=0), 5)
    uncond = [dict(c, encoder_hidden_states=torch.randn_like(c["encoder_hidden_states"])) for c in cond]
    cfg = StepCacheConfig(warmup=2, skip=1, extrapolate=1.0)
    want = [_reference(model, branch, cfg.schedule(5), 1.0) for branch in (cond, uncond)]
    tokenmerge.apply_config(model, cfg)
    got = [[], []]
    for c, u in zip(cond, uncond):
        got[0] += _run(model, [c])
        got[1] += _run(model, [u])
    tokenmerge.remove_patch(model)
    for branch in range(2):
        for a, b in zip(got[branch], want[branch]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_skipped_step_runs_no_block():
    """The blocks' own forward (their class's, counted) runs at every computed step and at no skipped one."""
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = steps_of(model, entry.inputs(batch=2), 5)
    with counting_forwards(model) as count:
        tokenmerge.apply_step_cache(model, skip=2, warmup=2)
        per_call = runs_per_call(model, calls, count)
    tokenmerge.remove_patch(model)
    assert per_call[0] > 0 and per_call[1] == per_call[0] and per_call[4] == per_call[0]
    assert per_call[2] == per_call[3] == 0, per_call


def test_controlnet_residuals_are_added_afresh_at_a_skipped_step():
    """Flux.1 with ControlNet residuals added after each block: the stack's residual leaves them out (the runs of
    blocks each end where the model added one), a skipped step adds this step's own."""
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = steps_of(model, entry.inputs(batch=2), 4)
    blocks, _ = _stack(model)
    gen = torch.Generator().manual_seed(5)
    for k, c in enumerate(calls):
        x = c["hidden_states"]
        samples = [0.3 * torch.randn(*x.shape[:2], model.inner_dim, generator=gen) for _ in blocks]
        c["controlnet_block_samples"] = samples[:len(model.transformer_blocks)]
        c["controlnet_single_block_samples"] = samples[len(model.transformer_blocks):]
    residuals = []  # per call, every block's own residual (image stream)
    handles = [b.register_forward_hook(lambda m, a, kw, out: residuals[-1].append(out[1] - kw["hidden_states"]),
                                       with_kwargs=True) for b in blocks]
    first = blocks[0].register_forward_pre_hook(lambda m, a, kw: residuals.append([]), with_kwargs=True)
    _run(model, calls)
    for h in (*handles, first):
        h.remove()
    cfg = StepCacheConfig(warmup=2, skip=1, extrapolate=0.0)  # computed, computed, skipped, computed
    tokenmerge.apply_config(model, cfg)
    got = _run(model, calls)
    tokenmerge.remove_patch(model)
    kept = sum(residuals[1])
    added = sum(calls[2]["controlnet_block_samples"]) + sum(calls[2]["controlnet_single_block_samples"])
    seen = _recorded(model, [calls[1]])[0]
    text = seen["f"] - seen["e"]  # the text stream has no additions: its one run's residual
    want = _with_stack_output(model, {k: v for k, v in calls[2].items() if not k.startswith("controlnet")},
                              lambda x: x + added + kept, lambda e: e + text)
    torch.testing.assert_close(got[2], want, rtol=1e-4, atol=1e-5)
    vanilla = _run(model, calls)
    assert torch.equal(got[0], vanilla[0]) and torch.allclose(got[3], vanilla[3], rtol=1e-4, atol=1e-5)


# ---- every family ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ENTRIES)
def test_every_family_skips_or_is_refused_with_the_reason(name):
    """computed, skipped, skipped, computed (warmup=1, skip=2): the computed steps are the unpatched model's, the
    skipped ones finite and not it, with no warning (every block's layout told); removal gives the model back."""
    _skip(name)
    entry = CATALOGUE[name]
    model = entry.build()
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            tokenmerge.apply_step_cache(model, skip=2, warmup=1)
        assert tokenmerge.describe_patch(model) is None
        return
    try:
        calls = steps_of(model, entry.inputs(batch=2), 4)
    except ValueError:  # a model whose timestep cannot move on (Cosmos 1.0's tiny inputs): a first step only
        calls = [entry.inputs(batch=2)]
    vanilla = _run(model, calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        tokenmerge.apply_step_cache(model, skip=2, warmup=1)
        got = _run(model, calls)
    assert torch.equal(got[0], vanilla[0])
    if len(calls) > 1:
        for a, b in zip(got[1:3], vanilla[1:3]):
            assert torch.isfinite(a).all() and not torch.allclose(a, b), "a skipped step gave the vanilla output"
        torch.testing.assert_close(got[3], vanilla[3], rtol=1e-4, atol=1e-5)
    tokenmerge.remove_patch(model)
    assert all(torch.equal(a, b) for a, b in zip(_run(model, calls), vanilla))


def test_a_block_whose_layout_cannot_be_told_runs_every_step_with_one_warning():
    _skip("wan")
    entry = CATALOGUE["wan"]
    model = entry.build()
    calls = steps_of(model, entry.inputs(batch=2), 3)
    vanilla = _run(model, calls)
    block = model.blocks[0]

    class Odd(type(block)):  # returns a tuple whose second element comes from no input
        @functools.wraps(type(block).forward)
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs), torch.zeros(3, 7)

    block.__class__ = Odd
    nxt = model.blocks[1].register_forward_pre_hook(lambda m, a: (a[0][0], *a[1:]))
    vanilla = _run(model, calls)
    tokenmerge.apply_step_cache(model, skip=1, warmup=1)
    with pytest.warns(RuntimeWarning, match=r"cannot skip the steps of this generation: blocks.0 returns a \(3, 7\) "
                                            "tensor at position 1 that matches no input"):
        got = _run(model, calls)
    assert all(torch.equal(a, b) for a, b in zip(got, vanilla))
    tokenmerge.remove_patch(model)
    nxt.remove()


def test_describe_patch_and_the_memory_it_keeps():
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = steps_of(model, entry.inputs(batch=2), 2)
    tokenmerge.apply_step_cache(model, skip=1, warmup=4, skip_growth=1)
    info = tokenmerge.describe_patch(model)
    assert str(info).startswith("tokenmerge step cache: warmup=4 skip=1 skip_growth=1 extrapolate=0.7 min_steps=9")
    assert "computed of 28 on a linear time grid: 9, shifted by 3: 9; of 50 shifted by 3: 12" in str(info)
    assert "its slope beside it" in str(info)
    _run(model, calls)
    patch = model._tokenmerge_patch
    (kept,) = patch.calls.state.clock.kept.values()
    tensors = [t for run in kept.runs for t in (run.residual, run.slope) if t is not None]
    seen = _recorded(model, calls[:1])[0]  # the stack's streams (the blocks' width)
    x, e = seen["x"], seen["e"]
    # per branch: the image stream's residual and slope, the text stream's: 2 image-sized tensors + 2 text-sized
    assert sorted(t.shape for t in tensors) == sorted([x.shape, x.shape, e.shape, e.shape])
    tokenmerge.remove_patch(model)
    assert not patch.calls.state.clock.kept


def test_a_new_generation_and_a_stopped_one_start_over():
    """A generation stopped after a skipped step, then another from noise: its first steps are computed again (the
    outputs equal a fresh patch's)."""
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = steps_of(model, entry.inputs(batch=2), 5)
    tokenmerge.apply_step_cache(model, skip=1, warmup=1)  # (stopped after its first skipped step)
    assert stopped_and_restarted(model, calls)
    tokenmerge.remove_patch(model)


def test_an_img2img_generation_starting_midway_is_a_new_generation():
    """A generation that starts midway (img2img's strength: fewer steps from a later timestep) after a whole one: its
    first steps are the warm-up's computed ones, as under a fresh patch."""
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = steps_of(model, entry.inputs(batch=2), 8)
    tokenmerge.apply_step_cache(model, skip=1, warmup=1)
    _run(model, calls)
    midway = _run(model, calls[3:])
    tokenmerge.remove_patch(model)
    vanilla = _run(model, calls[3:])
    tokenmerge.apply_step_cache(model, skip=1, warmup=1)
    fresh = _run(model, calls[3:])
    tokenmerge.remove_patch(model)
    assert torch.equal(midway[0], vanilla[0])  # computed: the warm-up again
    assert all(torch.equal(a, b) for a, b in zip(midway, fresh))


def test_patched_context_manager_and_the_method_spec():
    from tokenmerge.tools.methods import parse_spec

    _skip("flux")
    model = CATALOGUE["flux"].build()
    with tokenmerge.patched(model, method="step_cache", skip=2, warmup=3):
        assert tokenmerge.describe_patch(model).config == StepCacheConfig(warmup=3, skip=2)
    assert tokenmerge.describe_patch(model) is None
    with pytest.raises(ValueError, match="takes no ratio"):
        with tokenmerge.patched(model, 0.5, method="step_cache"):
            pass
    spec = parse_spec("stepcache:2,warmup=3,skip_growth=1")
    assert spec.config() == StepCacheConfig(warmup=3, skip=2, skip_growth=1) and spec.is_across_steps
    assert parse_spec("stepcache").config() == StepCacheConfig()  # no value: the config's schedule (gap)
    with pytest.raises(ValueError, match="stepcache"):
        parse_spec("stepcache:2,fraction=0.5")
    # patched() with the UNet cache and accelerate: patched inside, as before outside
    with tokenmerge.patched(model, method="accelerate", speed="fast"):
        assert isinstance(tokenmerge.describe_patch(model).config, StepCacheConfig)
        assert "accelerate(speed='fast')" in tokenmerge.describe_patch(model).notes[0]
    assert tokenmerge.describe_patch(model) is None
    unet = make_unet("sd")
    with tokenmerge.patched(unet, method="unet_cache", warmup=2):
        assert tokenmerge.describe_patch(unet).config == tokenmerge.UNetCacheConfig(warmup=2)
    assert tokenmerge.describe_patch(unet) is None
    with pytest.raises(ValueError, match="method='accelerate' takes no ratio"):
        with tokenmerge.patched(model, 0.5, method="accelerate"):
            pass


# ---- torch.compile ---------------------------------------------------------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_compiled_accelerate_gives_the_eager_outputs_and_a_second_generation_compiles_nothing(name):
    """``accelerate(speed="fast")`` (the step cache) compiled without fullgraph: the decision runs on the host (a graph
    break at each end of the call), the computed and skipped calls compile once, a second generation compiles
    nothing more, and the outputs are the eager ones."""
    from torch._dynamo.utils import counters

    _skip(name)
    entry = CATALOGUE[name]
    model = entry.build()
    calls = steps_of(model, entry.inputs(batch=2), 8)
    tokenmerge.accelerate(model, speed="fast")
    eager = _run(model, calls)
    torch.compiler.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    try:
        got = _run(compiled, calls)
        frames, breaks = counters["frames"]["total"], dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
        again = _run(compiled, calls)
        assert counters["frames"]["total"] == frames, "a second generation compiled again"
        assert dict(counters["graph_break"]) == breaks, "a second generation broke the graph again"
    finally:
        tokenmerge.remove_patch(model)
        torch.compiler.reset()
    assert sum(breaks.values()) == 2 and all("on the host" in reason for reason in breaks), breaks
    # a graph of the call's start, one of a computed and one of a skipped call (measured: 3 on Flux.1 and Wan; a
    # slope weight handed to the blocks as a number made one more per weight)
    assert graphs <= 3, graphs
    for run in (got, again):
        for a, b in zip(run, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fullgraph_compile_is_refused_with_the_reason():
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    tokenmerge.apply_step_cache(model)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    try:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="step cache .* without fullgraph=True"):
            with torch.no_grad():
                compiled(**entry.inputs(batch=2))
    finally:
        tokenmerge.remove_patch(model)
        torch.compiler.reset()


# ---- pipelines, LoRA, copies --------------------------------------------------------------------------------------
def _ran_per_call(pipe, names=("transformer",)):
    """{component: [True where its blocks ran, per call]} (a block's sub-modules run only inside its forward)."""
    seen = {name: [] for name in names}
    handles = []
    for name in names:
        model = getattr(pipe, name)
        blocks = [b for site in tokenmerge.engine.find_denoisers(model) for b in site.blocks]
        ran = [False]
        handles.append(model.register_forward_pre_hook(lambda m, a, ran=ran: ran.__setitem__(0, False)))
        handles.append(model.register_forward_hook(lambda m, a, o, ran=ran, name=name: seen[name].append(ran[0])))
        handles += [sub.register_forward_pre_hook(lambda m, a, ran=ran: ran.__setitem__(0, True))
                    for b in blocks for sub in b.module.children()]
    return seen, handles


@pytest.mark.parametrize("name", ["wan-t2v", "flux-kontext", "flux2-klein"])
def test_pipelines_skip_steps_and_a_second_run_is_the_first(name):
    """A pipeline's generation (Wan: guidance as two calls a step; Kontext: reference tokens after the image's;
    Flux.2: the text joined to the image before the single blocks) with the step cache: finite, not vanilla's, the
    same again in a second run (its scheduler starts a new generation), vanilla's once removed."""
    from tiny_pipelines import CASES

    case = CASES[name]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    kw = {**kw, "num_inference_steps": 5}
    vanilla = case.generate(pipe, kw)
    tokenmerge.apply_step_cache(pipe, skip=1, warmup=1, min_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # every block's layout told: no "cannot skip"
        first = case.generate(pipe, kw)
    assert torch.isfinite(first).all() and not torch.allclose(first, vanilla, atol=1e-5)
    assert torch.equal(case.generate(pipe, kw), first)
    tokenmerge.remove_patch(pipe)
    assert torch.equal(case.generate(pipe, kw), vanilla)


def test_a_pipeline_of_fewer_than_min_steps_skips_nothing():
    """``min_steps``: a generation shorter than it (its scheduler's step count) computes every step (distilled
    models); a longer one skips."""
    from tiny_pipelines import CASES

    case = CASES["flux-kontext"]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    short, long = {**kw, "num_inference_steps": 5}, {**kw, "num_inference_steps": 9}
    vanilla = [case.generate(pipe, k) for k in (short, long)]
    tokenmerge.apply_config(pipe, StepCacheConfig(warmup=1, skip=1, min_steps=9))
    got = [case.generate(pipe, k) for k in (short, long)]
    tokenmerge.remove_patch(pipe)
    assert torch.equal(got[0], vanilla[0]) and not torch.allclose(got[1], vanilla[1], atol=1e-5)


def test_wan_2_2s_two_transformers_each_keep_their_own_state():
    """Wan 2.2's experts (``transformer`` for the noisy steps, ``transformer_2`` after the boundary): both patched,
    each with its own clock: the second expert's first call starts its own generation (computed)."""
    from tiny_pipelines import CASES

    case = CASES["wan-t2v"]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    if "transformer_2" not in getattr(pipe, "_optional_components", ()) and not hasattr(pipe, "transformer_2"):
        pytest.skip("this diffusers' WanPipeline has no second transformer (Wan 2.2)")
    parts = {k: v for k, v in pipe.components.items()}
    parts["transformer_2"] = CATALOGUE["wan"].build()
    pipe = type(pipe)(**parts, boundary_ratio=0.9)
    kw = {**kw, "num_inference_steps": 10, "guidance_scale": 1.0}
    tokenmerge.apply_step_cache(pipe, skip=1, warmup=1)
    assert [d.path for d in tokenmerge.describe_patch(pipe).denoisers] == ["transformer", "transformer_2"]
    seen, handles = _ran_per_call(pipe, ("transformer", "transformer_2"))
    out = case.generate(pipe, kw)
    for h in handles:
        h.remove()
    tokenmerge.remove_patch(pipe)
    assert torch.isfinite(out).all()
    for name in ("transformer", "transformer_2"):  # each expert: computed, skipped, computed, skipped...
        assert len(seen[name]) > 2 and seen[name] == [k % 2 == 0 for k in range(len(seen[name]))], (name, seen)


def test_a_lora_loaded_after_the_patch_acts_at_the_computed_steps():
    _skip("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    calls = steps_of(model, entry.inputs(batch=2), 4)
    tokenmerge.apply_step_cache(model, skip=1, warmup=1)  # computed, skipped, computed, skipped
    plain, with_lora, vanilla_lora = lora_after_the_patch(model, calls)
    assert torch.equal(with_lora[0], vanilla_lora[0]) and torch.allclose(with_lora[2], vanilla_lora[2], atol=1e-5)
    assert not torch.allclose(with_lora[1], plain[1], atol=1e-4)  # the skipped step carries the LoRA's residual


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_are_independent_patched_models(how):
    import copy
    import pickle

    _skip("wan")
    entry = CATALOGUE["wan"]
    model = entry.build()
    calls = steps_of(model, entry.inputs(batch=2), 4)
    tokenmerge.apply_step_cache(model, skip=1, warmup=1)
    want = _run(model, calls)
    other = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    assert all(torch.equal(a, b) for a, b in zip(_run(other, calls), want))
    tokenmerge.remove_patch(other)
    assert all(torch.equal(a, b) for a, b in zip(_run(model, calls), want))  # the original keeps its patch
    assert not torch.equal(_run(other, calls)[1], want[1])


# ---- the time grid: the pipeline's scheduler tells the steps ----------------------------------------------------
@pytest.mark.parametrize("name", ["wan-t2v", "flux-kontext"])
@pytest.mark.parametrize("cfg", [StepCacheConfig(warmup=2, gap=0.05, gap_growth=0.2, min_steps=0),
                                 StepCacheConfig(warmup=2, skip=1, skip_growth=1, min_steps=0)])
def test_the_scheduler_tells_the_steps_as_the_timestep_does(name, cfg):
    """Patched through its pipeline (steps and progress from the pipeline's cache_context fields, as Wan's passes
    them, or the scheduler's host state, as Flux Kontext's: no tensor read per call) or on its bare transformer (the
    fields again, or the timestep read at each call): the same steps skipped, the same outputs; the report says how
    the steps were told."""
    from tiny_pipelines import CASES

    from tokenmerge.fashion.flow import context_fields

    case = CASES[name]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    kw = {**kw, "num_inference_steps": 10}
    got = {}
    for target in ("pipe", "transformer"):
        tokenmerge.apply_config(pipe if target == "pipe" else pipe.transformer, cfg)
        got[target] = case.generate(pipe, kw)
        patch = pipe.transformer._tokenmerge_patch
        ran = patch.technique.tally
        got[target + " ran"] = (dict(ran.computed), dict(ran.cached))
        # (Wan's pipeline passes where its loop is to cache_context: heard by the bare transformer's patch too)
        told = "context" if name == "wan-t2v" and context_fields() else "scheduler" if target == "pipe" else \
            "timestep"
        assert set(ran.sources) == {told}, ran
        tokenmerge.remove_patch(pipe)
    assert got["pipe ran"] == got["transformer ran"] and sum(got["pipe ran"][1].values()) > 0, got["pipe ran"]
    torch.testing.assert_close(got["pipe"], got["transformer"], rtol=1e-5, atol=1e-6)


def test_a_generation_reports_what_it_computed():
    """After a generation, describe_patch says how many steps each call computed and skipped, and what steps were
    told by; a generation shorter than min_steps reports its fallback."""
    from tiny_pipelines import CASES

    case = CASES["flux-kontext"]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    tokenmerge.apply_step_cache(pipe, warmup=2, skip=1)
    assert "no generation has run yet" in str(tokenmerge.describe_patch(pipe))
    case.generate(pipe, {**kw, "num_inference_steps": 10})
    words = str(tokenmerge.describe_patch(pipe))
    assert "last generation (10 steps): 6 of 10 computed, 4 skipped" in words, words
    assert "steps told by the pipeline's scheduler" in words, words
    from tokenmerge.tools.peers import computed_share

    assert computed_share(pipe) == {"steps": 10, "computed": 0.6}
    case.generate(pipe, {**kw, "num_inference_steps": 5})
    words = str(tokenmerge.describe_patch(pipe))
    assert "last generation (5 steps): 5 of 5 computed, 0 skipped" in words, words
    assert "5 calls computed because the generation has fewer than min_steps=9 steps" in words, words
    tokenmerge.remove_patch(pipe)
