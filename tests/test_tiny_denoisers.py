"""The tiny-denoiser catalogue builds and runs: deterministic, the expected output shape, finite, on a second grid
and an odd batch. Entries whose class the installed diffusers lacks are skipped with the reason."""

from __future__ import annotations

import pytest
import torch
from tiny_denoisers import CATALOGUE, available, cpu_fast, output_tensor

NAMES = sorted(CATALOGUE)


@pytest.fixture(autouse=True)
def _no_onednn():
    with cpu_fast():
        yield


def test_catalogue_is_consistent():
    kinds = {entry.kind for entry in CATALOGUE.values()}
    assert kinds <= {"image", "video", "audio", "other"}, kinds
    for name, entry in CATALOGUE.items():
        assert entry.name == name
        assert len(entry.grid) in (1, 2, 3), (name, entry.grid)
        assert len(entry.second_grid()) == len(entry.grid), name
        if entry.kind == "video":
            assert len(entry.grid) == 3, name
        if entry.kind == "image":
            assert len(entry.grid) == 2, name


def test_available_reports_missing_classes(monkeypatch):
    import dataclasses

    import tiny_denoisers

    fake = dataclasses.replace(CATALOGUE["unet-sd"], name="fake", cls="NoSuchTransformer3DModel")
    monkeypatch.setitem(tiny_denoisers.CATALOGUE, "fake", fake)
    reason = available("fake")
    assert reason is not None and "NoSuchTransformer3DModel not in diffusers" in reason
    needs = dataclasses.replace(fake, cls="UNet2DConditionModel", requires=("no_such_module_xyz",))
    monkeypatch.setitem(tiny_denoisers.CATALOGUE, "fake", needs)
    assert "no_such_module_xyz" in available("fake")
    assert available("unet-sd") is None  # in every supported diffusers


@pytest.mark.parametrize("name", NAMES)
def test_tiny_denoiser_runs(name):
    reason = available(name)
    if reason is not None:
        pytest.skip(reason)
    entry = CATALOGUE[name]
    model = entry.build()
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())

    kwargs = entry.inputs(batch=2, grid=entry.grid, seed=0)
    with torch.no_grad():
        first = output_tensor(model(**kwargs), entry)
        second = output_tensor(model(**entry.inputs(batch=2, grid=entry.grid, seed=0)), entry)
    assert tuple(first.shape) == entry.expected_shape(kwargs), name
    assert torch.isfinite(first).all(), name
    torch.testing.assert_close(first, second, rtol=0, atol=0)  # deterministic: same inputs, same output

    # a different seed must change the output (the inputs reach it)
    with torch.no_grad():
        other = output_tensor(model(**entry.inputs(batch=2, grid=entry.grid, seed=1)), entry)
    assert not torch.equal(first, other), name

    grid = entry.second_grid()
    kwargs3 = entry.inputs(batch=3, grid=grid, seed=2)
    with torch.no_grad():
        third = output_tensor(model(**kwargs3), entry)
    assert tuple(third.shape) == entry.expected_shape(kwargs3), name
    assert torch.isfinite(third).all(), name
    if grid != entry.grid:
        assert third.shape[1:] != first.shape[1:], name  # the grid reached the output


def test_build_is_seeded():
    name = "wan" if available("wan") is None else "unet-sd"
    entry = CATALOGUE[name]
    a, b = entry.build(), entry.build()
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
