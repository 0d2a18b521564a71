"""The caches across steps compiled as users compile (issue #63; docs/guides/compile.md), with dynamo's eager backend
(the graphs as traced; one inductor run is marked slow):

- regional compilation (blocks compiled in place: ``Module.compile()``, diffusers' ``compile_repeated_blocks``),
  ``fullgraph=True``, before or after ``accelerate``: the outputs of the eager patch, a skipped (cached) step runs no
  compiled block (graph runs counted), no more compiled variants than the unpatched model's (one per block class,
  and the model's own stride variants), a second generation compiles nothing; on the tiny Flux.1, Wan,
  HunyuanVideo and LTX transformers (the step cache) and the SD UNet (the UNet cache); in the fast run each order
  on one model, the other pairs and the bench's compiled timing under ``-m slow`` (the same code paths);
- the denoiser compiled whole with ``fullgraph=True`` in a pipeline that enters its ``cache_context`` (Wan,
  HunyuanVideo, LTX, Qwen-Image, the mosaic testbed's Flux.1 layout): no graph break, the forward compiled in two
  variants (computed, skipped: one bool of the call's state, decided on the host before the call), a second
  generation compiles nothing, the eager outputs; refused with the reason where nothing decides the call before it
  (a Stable Diffusion pipeline, a bare model);
- what CUDA graphs need that a CPU can check: the kept tensors keep their shapes and addresses across the steps and
  generations (updated in place; the slope's weight and gap 0-d tensors filled on the host), no graph break (no host
  read) in the compiled frames. What only a GPU can check (CUDA-graph capture and replay with
  ``mode="reduce-overhead"``, its timings) is the GPU lane's;
- ToMe, ToDo and token reuse still refuse blocks compiled in place, with their reason, in either order.
"""

from __future__ import annotations

import pytest
import torch
from tiny_denoisers import CATALOGUE, skip_unavailable
from tiny_denoisers import outputs_of as _run
from tiny_models import steps_of

import tokenmerge
from tokenmerge.engine import find_denoisers

pytest.importorskip("torch._dynamo")
pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fast_cpu")]
ORDERS = ["compile-then-patch", "patch-then-compile"]
STEPS = 10  # pipelines: >= accelerate's min_steps (9), so that steps are skipped


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Graphs:
    """A dynamo backend that runs the graphs as traced and counts the frames it compiles and the graphs' runs."""

    def __init__(self):
        self.frames = self.runs = 0

    def __call__(self, gm, example_inputs):
        self.frames += 1

        def run(*args):
            self.runs += 1
            return gm.forward(*args)
        return run


def _close(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _model(name: str, steps: int = 12):
    """A tiny catalogue model (skipped where this diffusers lacks it) and ``steps`` calls of one generation."""
    skip_unavailable(name)
    model = CATALOGUE[name].build()
    return model, steps_of(model, CATALOGUE[name].inputs(batch=2), steps)


def _accelerated(model, calls) -> list:
    """``accelerate(model, speed="fast")`` applied (and left on): the eager outputs of ``calls``."""
    tokenmerge.accelerate(model, speed="fast")
    return _run(model, calls)


def _compile_in_place(modules, backend) -> None:
    for module in modules:
        module.compile(fullgraph=True, backend=backend)


def _uncompiled(modules) -> None:
    for module in modules:
        module._compiled_call_impl = None
    torch._dynamo.reset()


def _regional(model, calls, compiled, order) -> dict:
    """``accelerate(model, speed="fast")`` with ``compiled`` (modules of ``model``) compiled in place in ``order``,
    against the eager patch and the unpatched model compiled so: what the test checks."""
    eager = _accelerated(model, calls)
    tokenmerge.remove_patch(model)
    vanilla = Graphs()
    _compile_in_place(compiled, vanilla)
    _run(model, calls)
    _uncompiled(compiled)
    graphs = Graphs()
    if order == "compile-then-patch":
        _compile_in_place(compiled, graphs)
        tokenmerge.accelerate(model, speed="fast")
    else:
        tokenmerge.accelerate(model, speed="fast")
        _compile_in_place(compiled, graphs)
    patch = model._tokenmerge_patch
    marks = []  # per call, after the patch's hook decided it: (graphs run so far, whether it is cached)
    handle = model.register_forward_pre_hook(lambda *_: marks.append((graphs.runs, patch.calls.state.work.cached)))
    try:
        got = _run(model, calls)
        frames = graphs.frames
        again = _run(model, calls)
    finally:
        handle.remove()
        tokenmerge.remove_patch(model)
    _close(got, eager)
    _close(again, eager)
    marks.append((graphs.runs, None))
    per_call = [(b - a, cached) for (a, cached), (b, _) in zip(marks, marks[1:])]
    bypassed = {id(m) for m in patch.technique.bypassed}
    return dict(frames=frames, again=graphs.frames - frames, vanilla=vanilla.frames,
                computed={n for n, cached in per_call if not cached}, cached={n for n, cached in per_call if cached},
                shallow=sum(id(m) not in bypassed for m in compiled), compiled=len(compiled))


def _orders(*names) -> list:
    """``(name, order)`` for each model and order: each order on one of the first two models in the fast run, the
    other pairs under ``-m slow`` (the same code paths, for the suite's time)."""
    fast = {(names[0], ORDERS[0]), (names[1], ORDERS[1])}
    return [pytest.param(n, o, marks=() if (n, o) in fast else pytest.mark.slow) for n in names for o in ORDERS]


@pytest.mark.parametrize("name, order", _orders("flux", "wan", "hunyuan-video", "ltx"))
def test_blocks_compiled_in_place_with_accelerate(name, order):
    model, calls = _model(name)
    blocks = [b.module for b in find_denoisers(model)[0].blocks]
    seen = _regional(model, calls, blocks, order)
    assert seen["computed"] == {len(blocks)} and seen["cached"] == {0}, seen  # a skipped step runs no block
    assert seen["frames"] == seen["vanilla"] <= 2 * len({type(b) for b in blocks}) and seen["again"] == 0, seen


def test_sub_modules_compiled_in_place_run_inside_computed_blocks():
    """A block's attention compiled in place (not a module the cache bypasses): it runs compiled inside each computed
    block, not at all at a skipped step."""
    model, calls = _model("flux")
    eager = _accelerated(model, calls)
    graphs, blocks = Graphs(), find_denoisers(model)[0].blocks
    _compile_in_place([b.module.attn for b in blocks], graphs)
    got = _run(model, calls)
    ran = model._tokenmerge_patch.technique.tally
    tokenmerge.remove_patch(model)
    _close(got, eager)
    assert sum(ran.cached.values()) > 0 and graphs.runs == sum(ran.computed.values()) * len(blocks)


@pytest.mark.parametrize("name, order", _orders("flux", "wan"))
def test_compile_repeated_blocks_with_accelerate(name, order):
    """diffusers' regional compilation, as its docs recommend it (``compile_repeated_blocks(fullgraph=True)``)."""
    model, calls = _model(name)
    if not hasattr(model, "compile_repeated_blocks"):
        pytest.skip("this diffusers has no compile_repeated_blocks (diffusers >= 0.35)")
    repeated = [m for m in model.modules() if type(m).__name__ in model._repeated_blocks]
    # compile_repeated_blocks calls Module.compile on each of these: the same modules, then through the call itself
    seen = _regional(model, calls, repeated, order)
    assert seen["computed"] == {len(repeated)} and seen["cached"] == {seen["shallow"]} == {0}, seen
    assert seen["frames"] == seen["vanilla"] and seen["again"] == 0, seen
    _uncompiled(repeated)
    eager = _accelerated(model, calls)
    graphs = Graphs()
    model.compile_repeated_blocks(fullgraph=True, backend=graphs)
    _close(_run(model, calls), eager)
    tokenmerge.remove_patch(model)
    assert graphs.frames == seen["vanilla"]


@pytest.mark.parametrize("order", ["compile-then-patch", pytest.param("patch-then-compile", marks=pytest.mark.slow)])
def test_unet_blocks_compiled_in_place_with_accelerate(order):
    """The UNet cache: the down, mid and up blocks compiled in place. Those it bypasses whole run no compiled code at
    a cached step; the first down and last up blocks, which hold the layers of its cut, run theirs (their cached
    variant runs no bypassed layer)."""
    model, calls = _model("unet-sd")
    compiled = [*model.down_blocks, model.mid_block, *model.up_blocks]
    seen = _regional(model, calls, compiled, order)
    assert seen["computed"] == {len(compiled)} and max(seen["cached"]) <= seen["shallow"] == 2, seen
    assert seen["frames"] <= 2 * len(compiled) and seen["again"] == 0, seen


# ---- the denoiser compiled whole ----------------------------------------------------------------------------------
def _entries(code) -> int | None:
    """Dynamo's compiled variants of ``code`` (a private API: ``None`` where this torch has none)."""
    from torch._dynamo import eval_frame

    entries = getattr(eval_frame, "_debug_get_cache_entry_list", None)
    return None if entries is None else len(entries(code))


def _pipeline(name):
    if name == "mosaic":
        from tokenmerge.fashion.mosaic import load_fashion_mosaic

        try:
            pipe = load_fashion_mosaic()
        except ImportError as err:  # a diffusers without FluxTransformer2DModel
            pytest.skip(str(err))
        return pipe, lambda: pipe(["a bag at the top left"], num_inference_steps=STEPS, output_type="pt",
                                  generator=torch.Generator().manual_seed(0)).images
    from tiny_pipelines import CASES

    case = CASES[name]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    return pipe, lambda: case.generate(pipe, {**kw, "num_inference_steps": STEPS})


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
@pytest.mark.parametrize("name", ["wan-t2v", pytest.param("hunyuan-video", marks=pytest.mark.slow),
                                  pytest.param("ltx", marks=pytest.mark.slow), "qwen-image", "mosaic"])
def test_the_denoiser_compiled_whole_with_fullgraph_in_its_pipeline(name, how):
    from torch._dynamo.utils import counters

    from tokenmerge.fashion.flow import context_fields

    if how == "Module.compile" and name != "wan-t2v":
        pytest.skip("one pipeline compiles in place (the same frames as torch.compile's)")
    pipe, generate = _pipeline(name)
    model = pipe.transformer
    if not hasattr(model, "cache_context"):
        pytest.skip("this diffusers has no cache_context (CacheMixin: diffusers >= 0.33)")
    tokenmerge.accelerate(pipe, speed="fast")
    eager = generate()
    graphs = Graphs()
    if how == "torch.compile":
        pipe.transformer = torch.compile(model, fullgraph=True, backend=graphs)
    else:
        model.compile(fullgraph=True, backend=graphs)
    counters.clear()
    try:
        got = generate()
        frames, breaks = graphs.frames, dict(counters["graph_break"])
        variants = _entries(type(model).forward.__code__)
        again = generate()
        technique = model._tokenmerge_patch.technique
    finally:
        tokenmerge.remove_patch(pipe)
    assert breaks == {} and graphs.frames == frames, (breaks, graphs.frames, frames)
    assert variants in (None, 2), variants  # computed and skipped, each compiled once (the first call ran eagerly)
    told = {"context"} if name in ("wan-t2v", "mosaic") and context_fields() else {"scheduler"}  # (they pass it)
    assert sum(technique.tally.cached.values()) > 0 and set(technique.tally.sources) == told, technique.tally
    _close([got, again], [eager, eager])


def test_whole_fullgraph_where_nothing_decides_the_call_before_it_is_refused_with_the_reason(tmp_path):
    """A Stable Diffusion pipeline enters no cache_context (nor has a UNet one): the UNet cache decides in the call's
    hook, eagerly, which fullgraph=True refuses with the reason (without it: a graph break at each end)."""
    from tiny_models import make_sd_pipeline

    pipe = make_sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    tokenmerge.accelerate(pipe, speed="fast")
    pipe.unet = torch.compile(pipe.unet, fullgraph=True, backend="eager")
    try:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="cache_context.*compile_repeated_blocks"):
            pipe("a cat", num_inference_steps=STEPS, height=32, width=32, output_type="pt")
    finally:
        tokenmerge.remove_patch(pipe)


def test_a_context_that_makes_no_call_forgets_what_it_decided():
    pipe, generate = _pipeline("wan-t2v")
    model = pipe.transformer
    if not hasattr(model, "cache_context"):
        pytest.skip("this diffusers has no cache_context (CacheMixin: diffusers >= 0.33)")
    tokenmerge.accelerate(pipe, speed="fast")
    generate()
    state = model._tokenmerge_patch.calls.state
    pipe.scheduler.set_timesteps(STEPS)  # (a generation set up: the scheduler tells the step)
    with model.cache_context("cond"):
        assert state.decided and state.work is not None
    assert not state.decided and state.work is None
    tokenmerge.remove_patch(pipe)
    assert "cache_context" not in vars(model)


def test_first_calls_on_two_threads_leave_the_compile_stance_as_it_was():
    """A branch's first computed call runs eagerly (the compiler's stance, which is the process's): two generations on
    two threads entering and leaving their first call's context interleaved (A in, B in, A out, B out) leave the
    stance as it was, not forced eager for good (every compiled model of the process then eager)."""
    import threading

    from torch._dynamo import eval_frame

    models = []
    for _ in range(2):
        pipe, _generate = _pipeline("wan-t2v")
        if not hasattr(pipe.transformer, "cache_context"):
            pytest.skip("this diffusers has no cache_context (CacheMixin: diffusers >= 0.33)")
        tokenmerge.accelerate(pipe, speed="fast")
        pipe.scheduler.set_timesteps(STEPS)
        models.append((pipe, pipe.transformer))
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    inside = []

    def first(model, entered, wait, then=None):
        with model.cache_context("cond", step_index=0, sigma=1.0, num_inference_steps=STEPS):
            inside.append(eval_frame._stance.stance)
            entered.set()
            assert wait.wait(10)
        if then is not None:
            then.set()

    threads = [threading.Thread(target=first, args=(models[0][1], a_in, b_in, a_out)),
               threading.Thread(target=first, args=(models[1][1], b_in, a_out))]
    threads[0].start()
    assert a_in.wait(10)
    threads[1].start()
    for t in threads:
        t.join(20)
    try:
        assert inside == ["force_eager", "force_eager"], inside
        assert eval_frame._stance.stance == "default", eval_frame._stance
    finally:
        torch.compiler.set_stance("default")
        for pipe, _ in models:
            tokenmerge.remove_patch(pipe)


# ---- what CUDA graphs need ----------------------------------------------------------------------------------------
def _kept_addresses(patch) -> dict:
    """The addresses and shapes of every tensor the patch keeps, per branch."""
    out = {}
    for branch, kept in patch.calls.state.clock.kept.items():
        tensors = [kept.weight, kept.span, getattr(kept, "feature", None), getattr(kept, "slope", None)]
        tensors += [t for run in getattr(kept, "runs", ()) for t in (run.residual, run.slope)]
        out[branch] = [(t.data_ptr(), tuple(t.shape)) for t in tensors if t is not None]
    return out


@pytest.mark.parametrize("name", ["wan-t2v", "sd"])
def test_the_kept_tensors_keep_their_addresses_across_steps_and_generations(name, tmp_path):
    if name == "sd":
        from tiny_models import make_sd_pipeline

        pipe = make_sd_pipeline(tmp_path)
        pipe.set_progress_bar_config(disable=True)
        model = pipe.unet

        def generate():
            return pipe("a cat", num_inference_steps=STEPS, height=32, width=32, output_type="pt")
    else:
        pipe, generate = _pipeline(name)
        model = pipe.transformer
    tokenmerge.accelerate(pipe, speed="fast")
    patch = model._tokenmerge_patch
    seen = []
    handle = model.register_forward_hook(lambda *_: seen.append(_kept_addresses(patch)), always_call=True)
    generate()
    generate()
    handle.remove()
    tokenmerge.remove_patch(pipe)
    first = {}
    for branches in seen:
        for branch, tensors in branches.items():
            assert first.setdefault(branch, tensors) == tensors, "a kept tensor was made anew"
    assert first and all(first.values()), first  # kept from each branch's first call on


# ---- what stays refused -------------------------------------------------------------------------------------------
_OTHERS = {"todo": lambda m: tokenmerge.apply_todo(m, downsample=2),
           "tome-block": lambda m: tokenmerge.apply_patch(m, ratio=0.5, scope="block"),
           "token-reuse": lambda m: tokenmerge.apply_reuse(m, 0.5, warmup=1)}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("technique", sorted(_OTHERS))
def test_the_other_techniques_refuse_blocks_compiled_in_place(technique, order):
    skip_unavailable("flux")
    entry = CATALOGUE["flux"]
    model = entry.build()
    block = find_denoisers(model)[0].blocks[0]
    apply = _OTHERS[technique]
    if order == "compile-then-patch":
        block.module.compile(backend="eager")
        with pytest.raises(ValueError, match=rf"{block.path} is compiled in place .*hooks apart from the denoiser's "
                                             "call.*the step cache and the UNet cache"):
            apply(model)
        assert tokenmerge.describe_patch(model) is None
        return
    apply(model)
    block.module.compile(backend="eager")
    try:
        with pytest.raises(ValueError, match=rf"{block.path} was compiled in place after the patch"):
            _run(model, [entry.inputs(batch=2)])
    finally:
        tokenmerge.remove_patch(model)


@pytest.mark.parametrize("order", ORDERS)
def test_a_module_holding_merged_blocks_compiled_in_place_is_refused(order):
    """A UNet's down block holds the attention blocks ToMe patches: compiled in place, it would run their hooks."""
    model = CATALOGUE["unet-sd"].build()
    if order == "compile-then-patch":
        model.down_blocks[0].compile(backend="eager")
        with pytest.raises(ValueError, match=r"down_blocks.0 is compiled in place .*ToMe's hooks"):
            tokenmerge.apply_patch(model, ratio=0.5)
        return
    tokenmerge.apply_patch(model, ratio=0.5)
    model.down_blocks[0].compile(backend="eager")
    try:
        with pytest.raises(ValueError, match=r"down_blocks.0 was compiled in place after the patch"):
            _run(model, [CATALOGUE["unet-sd"].inputs(batch=2)])
    finally:
        tokenmerge.remove_patch(model)


# ---- the bench ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_bench_times_accelerates_computed_and_skipped_steps_compiled(tmp_path, monkeypatch):
    """``tokenmerge bench --compile default regional`` with ``auto`` (accelerate: the UNet cache on the tiny UNet): its
    computed step ('full step') and its cached step timed compiled beside compiled vanilla, the cached one shorter;
    ToMe refused regionally, with its reason. Dynamo's eager backend stands in for inductor (docs/guides/compile.md
    has inductor's times)."""
    import json

    from tokenmerge.cli import main

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, fullgraph=False: compile_(fn, fullgraph=fullgraph,
                                                                                         backend="eager"))
    out = tmp_path / "res"
    assert main(["bench", "--preset", "tiny", "--resolutions", "64", "--modes", "vanilla", "--methods", "auto",
                 "tome:0.5", "--compile", "default", "regional", "--compiled-only", "--repeats", "2", "--out",
                 str(out), "--no-progress"]) == 0
    rows = {r["label"]: r for r in map(json.loads, (out / "bench.jsonl").open()) if r["kind"] == "step"}
    for suffix in (" compiled", " compiled regional"):
        auto = rows["auto" + suffix]
        assert auto["status"] == "ok" and auto["step_timed"] == "skipped", auto
        assert auto["median_s"] < auto["full_median_s"] and rows["vanilla" + suffix]["status"] == "ok"
    assert rows["tokenmerge 0.5 compiled"]["status"] == "ok"
    refused = rows["tokenmerge 0.5 compiled regional"]
    assert refused["status"] == "compile failed (ValueError)" and "compiled in place" in refused["error"], refused


# ---- inductor -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_inductor_regional_and_whole_give_the_eager_outputs():
    """Inductor's generated code (minutes on a CPU): Wan's blocks compiled in place, then its pipeline's transformer
    compiled whole with fullgraph=True, under accelerate."""
    model, calls = _model("wan")
    eager = _accelerated(model, calls)
    for site in find_denoisers(model)[0].blocks:
        site.module.compile(fullgraph=True)
    _close(_run(model, calls), eager)
    tokenmerge.remove_patch(model)
    torch._dynamo.reset()
    pipe, generate = _pipeline("wan-t2v")
    tokenmerge.accelerate(pipe, speed="fast")
    eager = generate()
    pipe.transformer = torch.compile(pipe.transformer, fullgraph=True)
    _close([generate()], [eager])
    tokenmerge.remove_patch(pipe)
