"""A generation never stops halfway because one call cannot be merged (issue #34), checked on the configurations
diffusers' own model and pipeline tests use.

- A call whose token grid is smaller than the merge window (diffusers' pipeline tests at 16-32 px, a preview, a
  hires-fix's first pass) or whose position ids describe no grid (diffusers' model tests pass random ``img_ids``)
  runs unmerged, bit for bit the unpatched model's output, with one warning per patch that names the size and why.
  Levels of a UNet call where no window fits while others do are left unmerged; the others merge.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tokenmerge
from tiny_denoisers import CATALOGUE, available, output_tensor
from tiny_models import make_unet, unet_inputs

pytestmark = pytest.mark.usefixtures("fast_cpu")


def _need(name):
    reason = available(name)
    if reason is not None:
        pytest.skip(reason)
    return CATALOGUE[name], CATALOGUE[name].build()


def _run(model, kw):
    with torch.no_grad():
        return output_tensor(model(**kw))


def _tokenmerge_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("tokenmerge")]


@pytest.mark.parametrize("method", ["tome", "todo-ratio"])
def test_a_call_smaller_than_the_window_runs_unmerged_with_one_warning(method):
    model = make_unet("sd")
    small, large = unet_inputs(h=6, w=6), unet_inputs(h=16, w=16)
    plain_small, plain_large = _run(model, small), _run(model, large)
    if method == "tome":
        tokenmerge.apply_patch(model, ratio=0.5, sx=8, sy=8)
    else:
        tokenmerge.apply_todo(model, downsample=1, ratio=0.5, sx=8, sy=8)  # downsample 1: only the query merging
    with pytest.warns(RuntimeWarning, match=r"6x6 token grid ran unmerged: the merge window \(sx=8, sy=8\) is larger"):
        assert torch.equal(_run(model, small), plain_small)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(_run(model, small), plain_small)  # once per patch
        merged = _run(model, large)  # 16x16: two windows a side, merged
    assert not _tokenmerge_warnings(caught)
    assert not torch.allclose(merged, plain_large)
    tokenmerge.apply_patch(model, ratio=0.5, sx=4, sy=2)  # a window that fits once is fine: merged, no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not torch.allclose(_run(model, small), plain_small)
    assert not _tokenmerge_warnings(caught)
    tokenmerge.remove_patch(model)
    assert torch.equal(_run(model, small), plain_small)


def test_levels_where_no_window_fits_are_left_unmerged_and_the_others_merge():
    """max_downsample=2 patches the 2x2 and the 1x1 level of a 2x2 latent: the first merges, the second cannot."""
    model = make_unet("sd")
    kw = unet_inputs(h=2, w=2)
    plain = _run(model, kw)
    tokenmerge.apply_patch(model, ratio=0.5, max_downsample=2)
    patch = model._tokenmerge_patch
    merged = {}
    handles = [site.module.register_forward_pre_hook(
        lambda m, a, k, i=i: merged.__setitem__(i, patch.state.blocks[i].plan.num_merged), with_kwargs=True)
        for i, site in enumerate(patch.blocks)]
    with pytest.warns(RuntimeWarning, match=r"unmerged in some levels: .*\(1x1 at downsample 2\); the other levels"):
        out = _run(model, kw)
    for h in handles:
        h.remove()
    levels = {site.level: merged[i] for i, site in enumerate(patch.blocks)}
    assert levels == {0: 2, 1: 0}, levels
    assert not torch.allclose(out, plain)


# diffusers' model tests of the Flux layout pass img_ids = torch.randn(H * W, 3) (and random txt_ids): no grid
RANDOM_IDS = ["flux", "chroma", "bria", "bria-fibo", "longcat-image", "ovis-image"]


@pytest.mark.parametrize("name", RANDOM_IDS)
def test_position_ids_that_describe_no_grid_run_unmerged(name):
    entry, model = _need(name)
    kw = entry.inputs()
    g = torch.Generator().manual_seed(0)
    kw["img_ids"] = torch.randn(kw["img_ids"].shape, generator=g)
    kw["txt_ids"] = torch.randn(kw["txt_ids"].shape, generator=g)
    plain = _run(model, kw)
    tokenmerge.apply_patch(model, ratio=0.5)
    with pytest.warns(RuntimeWarning, match=rf"tokenmerge: {type(model).__name__}: a call with a 1x1 token grid ran "
                                            r"unmerged"):
        out = _run(model, kw)
    assert torch.equal(out, plain)
    tokenmerge.remove_patch(model)


def test_joyimage_edit_plus_at_diffusers_test_shapes_runs_unmerged():
    """diffusers' test gives two items of one token each (shape_list [(1, 1, 1), (1, 1, 1)])."""
    entry, model = _need("joyimage-edit-plus")
    kw = entry.inputs(batch=1, grid=(1, 1))
    plain = _run(model, kw)
    tokenmerge.apply_patch(model, ratio=0.5)
    with pytest.warns(RuntimeWarning, match="1x1 token grid ran unmerged"):
        assert torch.equal(_run(model, kw), plain)
    tokenmerge.remove_patch(model)


def test_ids_that_form_no_grid_are_read_once_per_tensor():
    """The reader's verdict on a call's ids is kept like its grid: a generation's later steps read nothing."""
    from tokenmerge.engine.grids import GridReader, NoGrid
    from tokenmerge.families.spec import IdsGrid

    entry, model = _need("flux")
    reader = GridReader(IdsGrid(), model)
    ids = torch.zeros(6, 3)
    ids[:, 1] = torch.tensor([0, 0, 1, 1, 2, 5])
    ids[:, 2] = torch.tensor([0, 1, 0, 1, 0, 1])
    for _ in range(2):
        with pytest.raises(NoGrid, match="6 tokens do not form a 6x2 grid"):
            reader.read((), {"img_ids": ids})
    reads = []
    original = GridReader._read_ids
    try:
        GridReader._read_ids = staticmethod(lambda *a: reads.append(1) or original(*a))
        with pytest.raises(NoGrid):
            reader.read((), {"img_ids": ids})
    finally:
        GridReader._read_ids = staticmethod(original)
    assert reads == []


# ---- pipelines at the sizes diffusers' pipeline tests use ------------------------------------------------------
def _small_wan():
    """WanPipeline with an 8x spatial VAE, as diffusers' tests build it: 16 px -> a 3x1x1 token grid."""
    from tiny_pipelines import CASES, _vae_wan_like

    case = CASES["wan-t2v"]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    pipe.vae = _vae_wan_like("AutoencoderKLWan", down=(False, True, True))
    pipe.vae_scale_factor_spatial = 8
    return case, pipe, {**kw, "height": 16, "width": 16}


def _small_cogvideox():
    """CogVideoXPipeline at 8 px: a 3x1x1 token grid (4x VAE, patch 2)."""
    from tiny_pipelines import CASES

    case = CASES["cogvideox"]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    return case, pipe, {**kw, "height": 8, "width": 8}


@pytest.mark.parametrize("build", [_small_wan, _small_cogvideox], ids=["wan", "cogvideox"])
def test_a_pipeline_smaller_than_the_window_generates_unmerged(build):
    case, pipe, kw = build()
    plain = case.generate(pipe, kw)
    tokenmerge.apply_patch(pipe, ratio=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = case.generate(pipe, kw)
    messages = _tokenmerge_warnings(caught)
    assert len(messages) == 1 and "a call with a 3x1x1 token grid ran unmerged" in messages[0], messages
    assert torch.equal(out, plain)
    tokenmerge.remove_patch(pipe)
