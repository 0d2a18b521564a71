"""The hot path stays small and readable: one steady-state denoiser call of the tiny UNet, PixArt and Flux.1 models
(ToMe with its defaults, and whole-block ToMe), profiled with ``sys.setprofile``, runs through at most 5 files and 25
functions of the library (issue 41: the engine before it took 11-12 files and 50-68 functions; tomesd takes 2 and
8). Generator expressions and comprehensions count as functions on Python 3.11 (3.12 inlines comprehensions)."""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch
from tiny_denoisers import CATALOGUE, available

import tokenmerge

ROOT = os.path.dirname(tokenmerge.__file__)
MAX_FILES, MAX_FUNCTIONS = 5, 25


def _steady_call(name: str, **kwargs) -> Counter:
    """The library's functions (file, name, line) one call makes, after two warm-up calls, with their call counts."""
    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    model, inputs = entry.build(), entry.inputs(batch=2)
    tokenmerge.apply_patch(model, ratio=0.5, **kwargs)
    seen = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            code = frame.f_code
            seen[(os.path.relpath(code.co_filename, ROOT), code.co_name, code.co_firstlineno)] += 1

    try:
        with torch.no_grad():
            model(**inputs)
            model(**inputs)
            sys.setprofile(profile)
            try:
                model(**inputs)
            finally:
                sys.setprofile(None)
    finally:
        tokenmerge.remove_patch(model)
    return seen


@pytest.mark.parametrize("scope", ["attention", "block"])
@pytest.mark.parametrize("name", ["unet-sd", "pixart", "flux"])
def test_one_call_runs_through_few_files_and_functions(name, scope):
    seen = _steady_call(name, scope=scope)
    files = {f for f, _, _ in seen}
    listing = "\n".join(f"{n:4d} {f}:{line} {fn}" for (f, fn, line), n in sorted(seen.items()))
    assert seen, "the profile saw no call of the library"
    assert len(files) <= MAX_FILES and len(seen) <= MAX_FUNCTIONS, \
        f"{len(files)} files, {len(seen)} functions, {sum(seen.values())} calls:\n{listing}"
    # the technique's own hooks are among them: merge -> work -> unmerge in one file
    technique = "engine/techniques/block.py" if scope == "block" else "engine/techniques/around.py"
    assert technique in files


def _tensors() -> dict:
    """Every tensor alive in the process, by id."""
    import gc

    gc.collect()
    return {id(obj): obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)}


@pytest.mark.parametrize("kwargs", [dict(), dict(scope="block"), dict(todo=True)])
@pytest.mark.parametrize("name", ["unet-sd", "flux", "wan"])
def test_no_tensor_is_held_after_removal(name, kwargs):
    """The index tables, matchings, plans and grids a patch builds are its own (released by remove_patch): after the
    removal no tensor made while the model was patched is alive, and the shared table store was not used."""
    from tokenmerge.merge import TABLES

    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    model, inputs = entry.build(), entry.inputs(batch=2)
    with torch.no_grad():
        model(**inputs)  # the model's own caches, if any, made before counting
    before, shared = set(_tensors()), len(TABLES)
    if kwargs.get("todo"):
        tokenmerge.apply_todo(model, downsample=(1, 2, 2) if entry.kind == "video" else 2)
    else:
        tokenmerge.apply_patch(model, ratio=0.5, **kwargs)
    with torch.no_grad():
        model(**inputs)
    made = {i: t for i, t in _tensors().items() if i not in before}
    tokenmerge.remove_patch(model)
    if not kwargs.get("todo"):  # ToMe built tables and plans (the count sees them); ToDo pools without any
        assert made
    del made
    left = [(tuple(t.shape), t.dtype) for i, t in _tensors().items() if i not in before]
    assert left == [] and len(TABLES) == shared
