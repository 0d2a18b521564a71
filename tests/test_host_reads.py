"""No host read of a tensor value in a patched call under a pipeline (issue #63): on a GPU each read of a device
tensor (``.item()``, ``bool(t)``, ``float(t)``, ``int(t)``, an index, ``.tolist()``) waits for the queue to drain, and a
CUDA graph cannot hold one.

A ``TorchFunctionMode`` counts them over a whole generation and inside each denoiser call (between a pre-hook put
first and a hook put last), patched (``accelerate``, ``apply_step_cache``, the UNet cache) against unpatched, on tiny
real diffusers pipelines and on the embedded mosaic testbed (a flow-matching Euler pipeline): the same reads in each
call, and at most 1 more per generation, the scheduler's ``timesteps`` read once (``clock.host_progress``): before the
first call where the pipeline enters the denoiser's ``cache_context`` (Wan, Qwen-Image, HunyuanVideo, LTX, the
mosaic), in the first call where it does not (Flux Kontext, Stable Diffusion). A bare model, which no scheduler tells,
reads its timestep once per call, and ``describe_patch`` says so. A planted read per call is seen (the count's own
check)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tokenmerge
from tokenmerge.engine.call import CallHook

pytestmark = pytest.mark.usefixtures("fast_cpu")
READS = frozenset({"item", "__bool__", "__float__", "__int__", "__index__", "tolist"})
STEPS = 10  # >= accelerate's min_steps (9): some steps skipped


class Reads(TorchFunctionMode):
    """Host reads of tensor values: ``total`` while active, ``calls``: per denoiser call (``watch``)."""

    def __init__(self):
        super().__init__()
        self.total, self.calls, self.inside = 0, [], False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            self.total += 1
            if self.inside:
                self.calls[-1] += 1
        return func(*args, **(kwargs or {}))

    def enter(self, *_):
        self.inside = True
        self.calls.append(0)

    def leave(self, *_):
        self.inside = False


def _reads(model, generate) -> Reads:
    """The reads of one ``generate()``, and per call of ``model`` (its hooks put around the patch's)."""
    reads = Reads()
    handles = [model.register_forward_pre_hook(reads.enter, prepend=True),
               model.register_forward_hook(reads.leave, always_call=True)]
    try:
        with reads:
            generate()
    finally:
        for handle in handles:
            handle.remove()
    return reads


def _compare(pipe, model, generate, patch) -> tuple[Reads, Reads]:
    plain = _reads(model, generate)
    patch(pipe)
    try:
        patched = _reads(model, generate)
        told = set(model._tokenmerge_patch.technique.tally.sources)
        cached = sum(model._tokenmerge_patch.technique.tally.cached.values())
    finally:
        tokenmerge.remove_patch(pipe)
    # (the steps told by the pipeline's cache_context fields or its scheduler; some skipped)
    assert told <= {"scheduler", "context"} and told and cached > 0, (told, cached)
    assert len(patched.calls) == len(plain.calls) > 0
    return plain, patched


def _assert_no_more_per_call(plain: Reads, patched: Reads, first: int) -> None:
    """The same reads in every call but the first (``first`` more there), at most 1 more in the generation."""
    more = [p - q for p, q in zip(patched.calls, plain.calls)]
    assert more == [first] + [0] * (len(more) - 1), more
    assert patched.total - plain.total <= 1, (patched.total, plain.total)


_ACCELERATE = lambda p: tokenmerge.accelerate(p, speed="fast")  # noqa: E731
_STEP_CACHE = lambda p: tokenmerge.apply_step_cache(p, skip=1, warmup=2, min_steps=0)  # noqa: E731


@pytest.mark.parametrize("patch", [_ACCELERATE, _STEP_CACHE], ids=["accelerate", "step-cache"])
@pytest.mark.parametrize("name, first", [("wan-t2v", 0), ("qwen-image", 0), ("hunyuan-video", 0), ("ltx", 0),
                                         ("flux-kontext", 1)])
def test_a_patched_pipeline_reads_no_tensor_more_per_call(name, first, patch):
    """``first``: 1 where the pipeline enters no ``cache_context`` (the timesteps read in the first call's hook)."""
    from tiny_pipelines import CASES

    case = CASES[name]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    kw = {**kw, "num_inference_steps": STEPS}
    plain, patched = _compare(pipe, pipe.transformer, lambda: case.generate(pipe, kw), patch)
    _assert_no_more_per_call(plain, patched, first)


def test_the_mosaic_testbed_reads_no_tensor_more_per_call():
    from tokenmerge.fashion.mosaic import load_fashion_mosaic

    try:
        pipe = load_fashion_mosaic()
    except ImportError as err:  # a diffusers without FluxTransformer2DModel
        pytest.skip(str(err))
    if not hasattr(pipe.transformer, "cache_context"):
        pytest.skip("this diffusers has no cache_context (CacheMixin: diffusers >= 0.33)")

    def generate():
        return pipe(["a bag at the top left"], num_inference_steps=STEPS, output_type="pt",
                    generator=torch.Generator().manual_seed(0))

    plain, patched = _compare(pipe, pipe.transformer, generate, _ACCELERATE)
    _assert_no_more_per_call(plain, patched, 0)


def test_a_stable_diffusion_pipeline_under_the_unet_cache_reads_no_tensor_more_per_call(tmp_path):
    """DDIM keeps no step index: the step is where the pipeline's timestep lies in the scheduler's timesteps."""
    from tiny_models import make_sd_pipeline

    pipe = make_sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe("a cat", num_inference_steps=STEPS, height=32, width=32, output_type="pt",
                    generator=torch.Generator().manual_seed(0))

    plain, patched = _compare(pipe, pipe.unet, generate, _ACCELERATE)
    _assert_no_more_per_call(plain, patched, 1)


def _bare_wan():
    from tiny_denoisers import CATALOGUE, skip_unavailable
    from tiny_models import steps_of

    skip_unavailable("wan")
    entry = CATALOGUE["wan"]
    model = entry.build()
    return model, steps_of(model, entry.inputs(batch=2), STEPS)


def _generate(model, calls):
    def generate():
        with torch.no_grad():
            for call in calls:
                model(**call)
    return generate


def test_a_bare_model_reads_its_timestep_once_per_call_and_says_so():
    model, calls = _bare_wan()
    plain = _reads(model, _generate(model, calls))
    tokenmerge.apply_step_cache(model, skip=1, warmup=2)
    patched = _reads(model, _generate(model, calls))
    words = str(tokenmerge.describe_patch(model))
    tokenmerge.remove_patch(model)
    assert [p - q for p, q in zip(patched.calls, plain.calls)] == [1] * len(calls)
    assert "steps told by each call's timestep, read on the host (a bare model" in words


def test_a_planted_read_per_call_is_seen(monkeypatch):
    """The count's own check: a hook that reads the timestep in every call (as the caches did before the scheduler
    told the steps) makes the pipeline test fail."""
    from tiny_pipelines import CASES

    case = CASES["wan-t2v"]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    kw = {**kw, "num_inference_steps": STEPS}
    pre = CallHook.pre

    def reading(self, module, args, kwargs, compiled=False):
        float(kwargs["timestep"].max())  # the planted read
        return pre(self, module, args, kwargs, compiled)

    monkeypatch.setattr(CallHook, "pre", reading)
    plain, patched = _compare(pipe, pipe.transformer, lambda: case.generate(pipe, kw), _ACCELERATE)
    with pytest.raises(AssertionError):
        _assert_no_more_per_call(plain, patched, 0)
