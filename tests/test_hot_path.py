"""The hot path stays small and readable: one steady denoiser call, profiled with ``sys.setprofile``, runs through at
most 5 files and 29 functions of the library for every technique: ToMe (both scopes) and ToDo on the tiny UNet, PixArt
and Flux.1 models, token reuse's partial step (keys fresh, cached, text=True) on a tiny 2-block Flux.1, which makes at
most 150 library Python calls (issue 48: 345-520 before token reuse joined the shared engine). Generator expressions
and comprehensions count as functions on Python 3.11 (3.12 inlines comprehensions); a generator's every resumption
counts as a call.

The Triton kernels (``kernels="triton"``) are not counted here: on a CPU they run under Triton's interpreter, whose
kernel bodies are Python (compiled on a GPU), and they add ``merge/kernels.py``, their launcher, to the 5 files.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch
from tiny_denoisers import _FLUX, CATALOGUE, available
from tiny_models import later_step

import tokenmerge

ROOT = os.path.dirname(tokenmerge.__file__)
# 29 functions: 28 until one place came to decide every call (CallHook.decide, issue #70: the pre-hook and the
# denoiser's cache_context both call it), one more frame per denoiser call, none per block
MAX_FILES, MAX_FUNCTIONS, MAX_REUSE_CALLS = 5, 29, 150


def _profiled(model, calls) -> Counter:
    """The library's functions (file, name, line) the last of ``calls`` makes, with their call counts."""
    seen = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            code = frame.f_code
            seen[(os.path.relpath(code.co_filename, ROOT), code.co_name, code.co_firstlineno)] += 1

    try:
        with torch.no_grad():
            for inputs in calls[:-1]:
                model(**inputs)
            sys.setprofile(profile)
            try:
                model(**calls[-1])
            finally:
                sys.setprofile(None)
    finally:
        tokenmerge.remove_patch(model)
    return seen


def _listing(seen: Counter) -> str:
    files = {f for f, _, _ in seen}
    lines = "\n".join(f"{n:4d} {f}:{line} {fn}" for (f, fn, line), n in sorted(seen.items()))
    return f"{len(files)} files, {len(seen)} functions, {sum(seen.values())} calls:\n{lines}"


def _model(name):
    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    return entry, entry.build()


@pytest.mark.parametrize("technique", ["tome", "tome-block", "todo"])
@pytest.mark.parametrize("name", ["unet-sd", "pixart", "flux"])
def test_one_call_runs_through_few_files_and_functions(name, technique):
    entry, model = _model(name)
    inputs = entry.inputs(batch=2)
    if technique == "todo":
        tokenmerge.apply_todo(model, downsample=2)
    else:
        tokenmerge.apply_patch(model, ratio=0.5, scope="block" if technique == "tome-block" else "attention")
    seen = _profiled(model, [inputs] * 3)
    files = {f for f, _, _ in seen}
    assert seen, "the profile saw no call of the library"
    assert len(files) <= MAX_FILES and len(seen) <= MAX_FUNCTIONS, _listing(seen)
    # the technique's own hooks are among them: merge -> work -> unmerge in one file
    own = {"tome": "around.py", "tome-block": "block.py", "todo": "todo.py"}[technique]
    assert f"engine/techniques/{own}" in files


@pytest.mark.parametrize("kwargs", [dict(), dict(keys="kept"), dict(keys="kept", text=True)])
def test_a_token_reuse_partial_step_runs_through_few_files_functions_and_calls(kwargs):
    """The tiny Flux.1 with 1 double and 1 single block, a steady partial step (the round-robin's second round: its
    tables built already)."""
    if available("flux") is not None:
        pytest.skip(available("flux"))
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**dict(_FLUX, num_single_layers=1), guidance_embeds=True).eval()
    calls = [CATALOGUE["flux"].inputs(batch=2)]
    for _ in range(11):  # the text's round-robin (2 of 5 tokens a step) comes back after 5 partial steps
        calls.append(later_step(model, calls[-1], 0.95))
    tokenmerge.apply_reuse(model, 0.5, warmup=1, **kwargs)
    patch = model._tokenmerge_patch
    seen = _profiled(model, calls)
    files = {f for f, _, _ in seen}
    assert "engine/techniques/reuse/block.py" in files and patch.calls.state.work is None  # (forgotten after the call)
    assert len(files) <= MAX_FILES and len(seen) <= MAX_FUNCTIONS, _listing(seen)
    assert sum(seen.values()) <= MAX_REUSE_CALLS, _listing(seen)
    assert any(fn == "attend" for _, fn, _ in seen), "no SDPA call was caught: not a partial step"


def _tensors() -> dict:
    """Every tensor alive in the process, by id."""
    import gc

    gc.collect()
    return {id(obj): obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)}


_HELD = (dict(), dict(scope="block"), dict(todo=True), dict(reuse=True))  # every technique on Wan, ToMe on each model


@pytest.mark.parametrize("name, kwargs", [(name, kwargs) if name == "wan" or not kwargs else
                                          pytest.param(name, kwargs, marks=pytest.mark.slow)  # (the rest: -m slow)
                                          for name in ("unet-sd", "flux", "wan") for kwargs in _HELD])
def test_no_tensor_is_held_after_removal(name, kwargs):
    """The index tables, matchings, plans, kept residuals and grids a patch builds are its own (released by
    remove_patch): after the removal no tensor made while the model was patched is alive, and the shared table
    store was not used."""
    from tokenmerge.merge import TABLES

    entry, model = _model(name)
    inputs = entry.inputs(batch=2)
    with torch.no_grad():
        model(**inputs)  # the model's own caches, if any, made before counting
    calls = [inputs, later_step(model, inputs)]
    before, shared = set(_tensors()), len(TABLES)
    if kwargs.get("todo"):
        tokenmerge.apply_todo(model, downsample=(1, 2, 2) if entry.kind == "video" else 2)
    elif kwargs.get("reuse"):
        tokenmerge.apply_reuse(model, 0.5, warmup=1)
    else:
        tokenmerge.apply_patch(model, ratio=0.5, **kwargs)
    with torch.no_grad():
        for c in calls:
            model(**c)
    made = {i: t for i, t in _tensors().items() if i not in before}
    tokenmerge.remove_patch(model)
    if not kwargs.get("todo"):  # ToMe built tables and plans, token reuse residuals (the count sees them)
        assert made
    del made
    left = [(tuple(t.shape), t.dtype) for i, t in _tensors().items() if i not in before]
    assert left == [] and len(TABLES) == shared


@pytest.mark.parametrize("speed", ["faithful", "balanced", "fast"])
@pytest.mark.parametrize("which", ["computed", "skipped"])
def test_accelerates_steady_calls_run_through_few_files_functions_and_calls(speed, which):
    """``tokenmerge.accelerate`` on the tiny Flux.1 with 1 double and 1 single block: a computed step after the
    warm-up and a skipped step (the step cache's), each after steps of both kinds."""
    if available("flux") is not None:
        pytest.skip(available("flux"))
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**dict(_FLUX, num_single_layers=1), guidance_embeds=True).eval()
    calls = [CATALOGUE["flux"].inputs(batch=2)]
    for _ in range(11):
        calls.append(later_step(model, calls[-1], 0.95))
    tokenmerge.accelerate(model, speed=speed)
    schedule = tokenmerge.describe_patch(model).config.schedule(len(calls))
    last = max(k for k, computed in enumerate(schedule) if computed == (which == "computed"))
    assert last > schedule.index(False), schedule  # (after a skipped step and a computed one)
    seen = _profiled(model, calls[: last + 1])
    files = {f for f, _, _ in seen}
    assert ("engine/techniques/step_cache.py" in files) and len(files) <= MAX_FILES, _listing(seen)
    assert len(seen) <= MAX_FUNCTIONS and sum(seen.values()) <= MAX_REUSE_CALLS, _listing(seen)


@pytest.mark.parametrize("which", ["computed", "cached"])
def test_accelerates_steady_unet_calls_run_through_few_files_functions_and_calls(which):
    """``tokenmerge.accelerate`` on the tiny SD UNet (the UNet cache at the balanced point): a computed step after the
    warm-up and a cached step, each after steps of both kinds."""
    entry, model = _model("unet-sd")
    calls = [entry.inputs(batch=2)]
    for _ in range(11):
        calls.append(later_step(model, calls[-1], 0.95))
    tokenmerge.accelerate(model, speed="balanced")
    schedule = tokenmerge.describe_patch(model).config.schedule(len(calls))
    last = max(k for k, computed in enumerate(schedule) if computed == (which == "computed"))
    assert last > schedule.index(False), schedule
    seen = _profiled(model, calls[: last + 1])
    files = {f for f, _, _ in seen}
    assert ("engine/techniques/unet_cache.py" in files) and len(files) <= MAX_FILES, _listing(seen)
    assert len(seen) <= MAX_FUNCTIONS and sum(seen.values()) <= MAX_REUSE_CALLS, _listing(seen)
