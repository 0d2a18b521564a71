"""Property tests over the argument space (hypothesis): sizes, strides, ratios, batches, dtypes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenmerge
from tokenmerge import ToMeConfig
from tokenmerge.merge import bipartite_soft_matching_2d, random_offsets


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 12), w=st.integers(1, 12), sx=st.integers(1, 4), sy=st.integers(1, 4),
       frac=st.floats(0, 1), batch=st.integers(1, 3), rand=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_plans_are_consistent(h, w, sx, sy, frac, batch, rand, dtype):
    if sx * sy < 2:
        return
    ratio = frac * (1 - 1 / (sx * sy))
    # the data from the example (not the global RNG), so that hypothesis reproduces what it finds
    x = torch.randn(batch, h * w, 3, generator=torch.Generator().manual_seed(h * 1000 + w * 10 + batch)).to(dtype)
    windows = (h // sy) * (w // sx)
    offsets = random_offsets(windows, sx * sy, 7, torch.device("cpu")) if rand and windows else None
    r = int(h * w * ratio)
    plan = bipartite_soft_matching_2d(x, h, w, sx, sy, r, offsets)
    merged = plan.merge(x)
    expected = h * w - (min(r, h * w - windows) if windows else 0)
    assert merged.shape == (batch, expected, 3)
    back = plan.unmerge(merged)
    assert back.shape == x.shape and back.dtype == dtype
    # merging what unmerge produced gives the merged tokens back (each slot holds copies of one value), up to the
    # rounding of a sum of k copies in the input's dtype (k: the most tokens in one slot; bfloat16: about k ulps)
    most = max(int(torch.bincount(row).max()) for row in plan.dest) if plan.num_merged else 1
    tol = max(1e-2, most * torch.finfo(dtype).eps)
    torch.testing.assert_close(plan.merge(back), merged, rtol=tol, atol=tol)


@settings(max_examples=80, deadline=None)
@given(ratio=st.one_of(st.floats(allow_nan=True), st.integers(-3, 3), st.none(), st.text(max_size=2)),
       sx=st.one_of(st.integers(-2, 5), st.floats(0, 3)), sy=st.integers(-2, 5),
       max_downsample=st.one_of(st.none(), st.integers(-2, 9), st.floats(0, 3)))
def test_config_accepts_exactly_the_documented_space(ratio, sx, sy, max_downsample):
    valid_sx = isinstance(sx, int) and sx >= 1
    valid = (
        valid_sx and sy >= 1 and sx * sy >= 2
        and isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
        and 0 <= ratio <= 1 - 1 / (sx * sy)
        and (max_downsample is None or (isinstance(max_downsample, int) and max_downsample >= 1))
    )
    if valid:
        ToMeConfig(ratio=ratio, sx=sx, sy=sy, max_downsample=max_downsample)
    else:
        with pytest.raises(ValueError):
            ToMeConfig(ratio=ratio, sx=sx, sy=sy, max_downsample=max_downsample)


@pytest.fixture(scope="module")
def unet():
    from tiny_models import make_unet

    return make_unet("sd")


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), h=st.integers(6, 20), w=st.integers(6, 20), ratio=st.floats(0, 0.75),
       seed=st.integers(0, 2**31), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       todo=st.integers(0, 3))
def test_patched_unet_any_size(unet, batch, h, w, ratio, seed, dtype, todo):
    from tiny_models import unet_inputs

    inp = unet_inputs(batch=batch, h=h, w=w, dtype=dtype)
    unet.to(dtype)
    if todo:
        tokenmerge.apply_todo(unet, downsample=todo, ratio=ratio, seed=seed, max_downsample=2)
    else:
        tokenmerge.apply_patch(unet, ratio=ratio, seed=seed, max_downsample=2, merge_mlp=True)
    try:
        with torch.no_grad():
            out = unet(**inp).sample
    finally:
        tokenmerge.remove_patch(unet)
        unet.to(torch.float32)
    assert out.shape == inp["sample"].shape and out.dtype == dtype and torch.isfinite(out).all()
