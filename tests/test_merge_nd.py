"""The pure tensor algorithms on N-D token grids (video: frames x height x width), against naive references."""

import math

import pytest
import torch
import torch.nn.functional as F

from tokenmerge.merge import (
    IdentityPlan,
    bipartite_soft_matching,
    bipartite_soft_matching_2d,
    downsample,
    downsample_tokens,
    num_windows,
    pooled_shape,
    pooled_size,
    random_offsets,
    window_destinations,
)
from tokenmerge.merge.match import matching
from tokenmerge.merge.soft_matching import local_soft_matching, local_soft_matching_2d
from tokenmerge.tools.limits import SlicePlan, slice_downsample, slice_match

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------------- references

def _reference(metric, shape, windows, r, offsets, radius):
    """The plan's content the slow, obvious way: ``(B, N)`` the window each token ends up in (its own for a
    destination), -1 for a source kept alone; and the number of sources.

    Every token's coordinates, its window (raster order over the window grid) and its choice (raster order
    inside the window) are computed from scratch; each source is scored against every destination, the ones
    beyond ``radius`` (per axis: an int or None) masked; the r best sources go to their best window.
    """
    rank, tokens = len(shape), math.prod(shape)
    index = torch.arange(tokens)
    coord = [index // math.prod(shape[i + 1:]) % shape[i] for i in range(rank)]
    grid = [n // s for n, s in zip(shape, windows)]
    wc = [c // s for c, s in zip(coord, windows)]  # window coordinates (past the grid for the rest)
    windowed = torch.stack([a < g for a, g in zip(wc, grid)]).all(0)
    window = torch.zeros_like(index)
    choice = torch.zeros_like(index)
    for a, g, c, s in zip(wc, grid, coord, windows):
        window, choice = window * g + a.clamp(max=g - 1), choice * s + c % s
    pick = torch.zeros(math.prod(grid), dtype=torch.int64) if offsets is None else offsets
    is_dst = windowed & (choice == pick[window.clamp(max=len(pick) - 1)])
    dst, src = index[is_dst], index[~is_dst]
    dst = dst[window[dst].argsort()]  # in window order
    assert torch.equal(window[dst], torch.arange(len(dst)))  # one destination per window
    unit = F.normalize(metric.double(), dim=-1)
    scores = unit[:, src] @ unit[:, dst].transpose(1, 2)  # (B, Ns, Nd)
    near = torch.ones(len(src), len(dst), dtype=torch.bool)
    for axis, rad in enumerate(radius):
        if rad is not None:
            a = wc[axis].clamp(max=grid[axis] - 1)
            near &= (a[src].unsqueeze(1) - a[dst].unsqueeze(0)).abs() <= rad
    values, best = scores.masked_fill(~near, -3.0).max(dim=-1)
    r = min(r, len(src))
    order = values.argsort(dim=1, descending=True)[:, :r]
    out = torch.full((metric.shape[0], tokens), -1)
    out.scatter_(1, src[order], best.gather(1, order))
    out[:, dst] = torch.arange(len(dst))
    return out, len(src)


def _content(plan, num_src):
    """The same view of a plan: the window a token was merged into, -1 for a token kept alone (the slots: kept
    sources first, then the destinations in window order); each kept source has a slot of its own."""
    kept = num_src - plan.num_merged
    dest = plan.dest
    for row in dest:
        counts = torch.bincount(row, minlength=plan.num_slots)
        assert (counts >= 1).all()  # every slot non-empty
        assert (counts[:kept] == 1).all()
    return torch.where(dest >= kept, dest - kept, -1)


def _radius_tuple(radius, rank):
    return (radius,) * rank if radius is None or isinstance(radius, int) else radius


def _check_plan(shape, windows, r, radius, use_rand, seed=0, batch=2, channels=6):
    torch.manual_seed(seed)
    tokens = math.prod(shape)
    metric = torch.randn(batch, tokens, channels)
    offsets = random_offsets(num_windows(shape, windows), math.prod(windows), seed + 3, CPU) if use_rand else None
    plan = bipartite_soft_matching(metric, shape, windows, r, offsets, radius)
    want, num_src = _reference(metric, shape, windows, r, offsets, _radius_tuple(radius, len(shape)))
    assert plan.num_slots == tokens - min(r, num_src)
    assert torch.equal(_content(plan, num_src), want)
    return metric, offsets, plan


# ------------------------------------------------------------------------------------------------ 2-D equivalence

@pytest.mark.parametrize("h, w, sx, sy", [(8, 8, 2, 2), (9, 11, 2, 2), (13, 10, 3, 2), (7, 5, 1, 3), (3, 17, 2, 1)])
@pytest.mark.parametrize("radius", [None, 0, 1, 2])
@pytest.mark.parametrize("use_rand", [False, True])
def test_nd_api_is_the_2d_api_bit_for_bit(h, w, sx, sy, radius, use_rand):
    torch.manual_seed(h * w + sx)
    metric = torch.randn(3, h * w, 7)
    offsets = random_offsets((h // sy) * (w // sx), sx * sy, 11, CPU) if use_rand else None
    assert num_windows((h, w), (sy, sx)) == (h // sy) * (w // sx)
    for r in (1, h * w // 3, h * w):
        a = bipartite_soft_matching_2d(metric, h, w, sx, sy, r, offsets, radius)
        b = bipartite_soft_matching(metric, (h, w), (sy, sx), r, offsets, radius)
        assert torch.equal(a.dest, b.dest) and a.num_slots == b.num_slots
        if radius is not None:
            c = local_soft_matching(metric, (h, w), (sy, sx), r, offsets, (radius, radius))
            assert torch.equal(local_soft_matching_2d(metric, h, w, sx, sy, r, offsets, radius).dest, c.dest)
    dst, src = window_destinations(h, w, sx, sy, offsets, CPU)
    assert sorted(torch.cat([dst, src]).tolist()) == list(range(h * w))


@pytest.mark.parametrize("radius", [None, 0, 1, 3])
def test_a_single_frame_video_is_the_image(radius):
    h, w, sx, sy = 13, 11, 2, 2
    torch.manual_seed(4)
    metric = torch.randn(2, h * w, 7)
    offsets = random_offsets((h // sy) * (w // sx), 4, 2, CPU)
    image = bipartite_soft_matching_2d(metric, h, w, sx, sy, 60, offsets, radius)
    for rad in (radius, (0, radius, radius), (None, radius, radius)):
        assert torch.equal(bipartite_soft_matching(metric, (1, h, w), (1, sy, sx), 60, offsets, rad).dest, image.dest)


@pytest.mark.parametrize("h, w, sx, sy, radius", [(9, 11, 2, 2, None), (13, 10, 3, 2, 1), (7, 12, 2, 2, 0)])
def test_2d_plans_match_the_reference(h, w, sx, sy, radius):
    _check_plan((h, w), (sy, sx), h * w // 2, radius, use_rand=True)


# -------------------------------------------------------------------------------------------------- 3-D matching

SHAPES_3D = [(3, 5, 7), (4, 6, 4), (5, 7, 6)]  # tokens outside every window on the spatial / temporal axes


@pytest.mark.parametrize("shape", SHAPES_3D)
@pytest.mark.parametrize("windows", [(1, 2, 2), (2, 2, 2), (2, 3, 2)])
@pytest.mark.parametrize("use_rand", [False, True])
@pytest.mark.parametrize("ratio", [0.2, 0.6])
def test_3d_global_matching_is_the_reference(shape, windows, use_rand, ratio):
    r = int(math.prod(shape) * ratio)
    metric, _, plan = _check_plan(shape, windows, r, None, use_rand)
    assert plan.merge(metric).shape[1] == math.prod(shape) - plan.num_merged
    const = torch.full_like(metric, 0.75)
    torch.testing.assert_close(plan.unmerge(plan.merge(const)), const, rtol=1e-6, atol=0)  # a constant comes back


def _frames_of_slots(plan, shape):
    """``(B, M)`` whether every slot's tokens lie in one frame."""
    frame = torch.arange(math.prod(shape)) // math.prod(shape[1:])
    dest = plan.dest
    low = torch.full((dest.shape[0], plan.num_slots), shape[0]).scatter_reduce(1, dest, frame.expand_as(dest), "amin")
    high = torch.full_like(low, -1).scatter_reduce(1, dest, frame.expand_as(dest), "amax")
    return low == high


@pytest.mark.parametrize("shape", SHAPES_3D)
@pytest.mark.parametrize("use_rand", [False, True])
@pytest.mark.parametrize("radius", [(0, None, None), (0, 1, 1), (0, 0, 0), (0, 1, None), 0])
def test_same_frame_matching_never_merges_across_frames(shape, use_rand, radius):
    windows = (1, 2, 2)
    metric, offsets, plan = _check_plan(shape, windows, math.prod(shape) // 2, radius, use_rand)
    assert _frames_of_slots(plan, shape).all()
    # ... which the global matching does not respect: the check has something to catch
    unmasked = bipartite_soft_matching(metric, shape, windows, math.prod(shape) // 2, offsets)
    assert not _frames_of_slots(unmasked, shape).all()


@pytest.mark.parametrize("shape, windows, radius", [
    ((5, 9, 11), (1, 2, 2), 1), ((6, 9, 10), (2, 2, 2), 1), ((4, 13, 9), (1, 3, 2), (1, 2, 1)),
    ((7, 10, 10), (1, 2, 2), (2, 1, 0)), ((6, 9, 9), (2, 2, 2), (0, 1, 1)), ((6, 9, 9), (2, 2, 2), (0, None, None)),
    ((5, 9, 11), (1, 2, 2), (1, None, None)), ((5, 9, 11), (1, 2, 2), (None, 1, None)),
    ((5, 9, 11), (1, 2, 2), (0, None, 1)), ((5, 9, 11), (1, 2, 2), (0, 9, 1)),
    ((7, 9, 11), (2, 2, 2), 1), ((7, 9, 11), (2, 2, 3), (1, 0, 2)), ((7, 9, 11), (2, 2, 2), (None, 1, 0)),
])
@pytest.mark.parametrize("use_rand", [False, True])
def test_3d_local_matching_is_the_global_matching_with_far_destinations_masked(shape, windows, radius, use_rand):
    metric, offsets, plan = _check_plan(shape, windows, math.prod(shape) // 2, radius, use_rand)
    # the radius matters here: the masked reference differs from the unmasked one
    rad = _radius_tuple(radius, 3)
    assert not torch.equal(_reference(metric, shape, windows, math.prod(shape) // 2, offsets, rad)[0],
                           _reference(metric, shape, windows, math.prod(shape) // 2, offsets, (None,) * 3)[0])


@pytest.mark.parametrize("chunk, tile", [(None, None), (400, None), (None, 2), (5000, 3)])
def test_3d_local_matching_chunks_and_tiles(chunk, tile):
    shape, windows, radius = (5, 9, 11), (1, 2, 2), (1, 1, 1)
    torch.manual_seed(5)
    metric = torch.randn(2, math.prod(shape), 6)
    offsets = random_offsets(num_windows(shape, windows), 4, 9, CPU)
    plan = local_soft_matching(metric, shape, windows, 200, offsets, radius, chunk=chunk, tile=tile)
    want, num_src = _reference(metric, shape, windows, 200, offsets, radius)
    assert torch.equal(_content(plan, num_src), want)


def test_a_radius_that_covers_the_grid_is_the_global_matching():
    shape, windows = (4, 8, 6), (1, 2, 2)
    torch.manual_seed(2)
    metric = torch.randn(2, math.prod(shape), 6)
    offsets = random_offsets(num_windows(shape, windows), 4, 1, CPU)
    plan = bipartite_soft_matching(metric, shape, windows, 80, offsets)
    for radius in (3, (3, 3, 2), (None, 3, 9), (5, None, None)):
        assert torch.equal(bipartite_soft_matching(metric, shape, windows, 80, offsets, radius).dest, plan.dest)
    same_frame = bipartite_soft_matching(metric, shape, windows, 80, offsets, (0, None, None))
    assert torch.equal(bipartite_soft_matching(metric, shape, windows, 80, offsets, (0, 3, 2)).dest,
                       same_frame.dest)


def test_identity_and_errors():
    metric = torch.randn(2, 3 * 4 * 6, 5)
    for r in (0, -3):
        plan = bipartite_soft_matching(metric, (3, 4, 6), (1, 2, 2), r)
        assert isinstance(plan, IdentityPlan) and plan.merge(metric) is metric and plan.unmerge(metric) is metric
        assert plan.num_merged == 0 and plan.num_tokens == plan.num_slots == 3 * 4 * 6
    assert isinstance(bipartite_soft_matching(metric, (3, 4, 6), (4, 2, 2), 10), IdentityPlan)  # no whole window
    assert isinstance(slice_match(metric, (3, 4, 6), (1, 2, 2), 0), IdentityPlan)
    limit = slice_match(metric, (3, 4, 6), (1, 2, 2), 1000)
    assert isinstance(limit, SlicePlan) and limit.num_slots == 3 * 6  # r capped at the sources: one per window
    with pytest.raises(RuntimeError, match="3 x 4 x 5 grid"):
        bipartite_soft_matching(metric, (3, 4, 5), (1, 2, 2), 10)
    with pytest.raises(ValueError, match="same rank"):
        bipartite_soft_matching(metric, (3, 4, 6), (2, 2), 10)
    with pytest.raises(ValueError, match="radius"):
        bipartite_soft_matching(metric, (3, 4, 6), (1, 2, 2), 10, radius=(0, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("radius", [None, (0, None, None), (0, 1, 1)])
def test_3d_dtypes(dtype, radius):
    x = torch.randn(2, 4 * 6 * 6, 8, dtype=dtype)
    plan = bipartite_soft_matching(x, (4, 6, 6), (1, 2, 2), 60, radius=radius)
    out = plan.unmerge(plan.merge(x))
    assert out.dtype == dtype and out.shape == x.shape and plan.num_slots == 4 * 36 - 60


# ------------------------------------------------------------------------------------------------------ downsample

@pytest.mark.parametrize("h, w", [(8, 8), (7, 9), (1, 5)])
@pytest.mark.parametrize("factor", [1, 2, 3])
@pytest.mark.parametrize("mode", ["nearest-exact", "avg", "bilinear"])
def test_2d_downsample_bit_for_bit(h, w, factor, mode):
    x = torch.randn(2, h * w, 5)
    grid = x.transpose(1, 2).reshape(2, 5, h, w)
    kwargs = dict(mode={"avg": "area"}.get(mode, mode), **({"align_corners": False} if mode == "bilinear" else {}))
    out = downsample(x, (h, w), (factor, factor), mode)
    assert torch.equal(out, downsample_tokens(x, h, w, factor, mode))
    if factor == 1:
        assert out is x
    else:
        ref = F.interpolate(grid, size=pooled_size(h, w, factor), **kwargs).flatten(2).transpose(1, 2)
        assert torch.equal(out, ref)
    assert slice_downsample(x, (h, w), (factor, factor)).shape[1] == math.prod(pooled_size(h, w, factor))


@pytest.mark.parametrize("shape", [(4, 8, 6), (5, 7, 9)])
@pytest.mark.parametrize("factors", [(2, 2, 2), (1, 2, 2), (3, 2, 1), (2, 1, 1)])
@pytest.mark.parametrize("mode", ["nearest-exact", "avg", "trilinear"])
def test_3d_downsample_is_interpolate_on_the_5d_tensor(shape, factors, mode):
    x = torch.randn(2, math.prod(shape), 5)
    grid = x.transpose(1, 2).reshape(2, 5, *shape)
    out = downsample(x, shape, factors, mode)
    size = pooled_shape(shape, factors)
    assert size == tuple(-(-n // f) for n, f in zip(shape, factors))
    kwargs = dict(mode={"avg": "area"}.get(mode, mode), **({"align_corners": False} if mode == "trilinear" else {}))
    ref = F.interpolate(grid, size=size, **kwargs).flatten(2).transpose(1, 2)
    assert out.shape == (2, math.prod(size), 5)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert slice_downsample(x, shape, factors).shape == out.shape


@pytest.mark.parametrize("mode", ["nearest-exact", "avg", "bilinear"])
def test_3d_downsample_without_time_is_each_frame_pooled(mode):
    shape = (3, 7, 9)
    x = torch.randn(2, math.prod(shape), 5)
    out = downsample(x, shape, (1, 2, 2), mode)
    frames = [downsample_tokens(f, 7, 9, 2, mode) for f in x.view(2, 3, 63, 5).unbind(1)]
    assert torch.equal(out, torch.cat(frames, 1))
    assert downsample(x, shape, (1, 1, 1), mode) is x


def test_4d_avg_is_the_mean_of_each_block():
    shape, factors = (4, 6, 6, 8), (2, 3, 2, 2)
    x = torch.randn(2, math.prod(shape), 3, dtype=torch.float64)
    blocks = x.view(2, 2, 2, 2, 3, 3, 2, 4, 2, 3).mean(dim=(2, 4, 6, 8))  # (B, 2, 2, 3, 4, C)
    torch.testing.assert_close(downsample(x, shape, factors, "avg"), blocks.reshape(2, -1, 3))


def test_downsample_errors():
    x = torch.randn(2, 4 * 6 * 6, 5)
    with pytest.raises(ValueError, match="trilinear"):
        downsample(x, (4, 6, 6), (2, 2, 2), "bilinear")
    with pytest.raises(ValueError, match="3-D grid"):
        downsample(torch.randn(2, 36, 5), (6, 6), (2, 2), "trilinear")
    with pytest.raises(ValueError, match="mode"):
        downsample(x, (4, 6, 6), (2, 2, 2), "max")
    with pytest.raises(RuntimeError, match="4 x 6 x 5 grid"):
        downsample(x, (4, 6, 5), (2, 2, 2))


# --------------------------------------------------------------------------------------------------------- compile

@pytest.mark.compile
@pytest.mark.parametrize("shape, windows, radius", [
    ((3, 6, 8), (1, 2, 2), (0, None, None)), pytest.param((3, 6, 8), (1, 2, 2), (0, 1, 1), marks=pytest.mark.slow),
    pytest.param((5, 6, 6), (2, 2, 2), 1, marks=pytest.mark.slow),
], ids=["same-frame", "same-frame-local", "local-3d-slabs"])
def test_compiled_3d_matcher_is_one_graph_and_matches_eager(shape, windows, radius):
    pytest.importorskip("torch._inductor")
    torch._dynamo.reset()

    def step(x, key):
        offsets = random_offsets(num_windows(shape, windows), math.prod(windows), key, x.device)
        plan = bipartite_soft_matching(x, shape, windows, 60, offsets, radius)
        return plan.unmerge(plan.merge(x) * 2)

    x, key = torch.randn(2, math.prod(shape), 8), torch.tensor([123])
    try:
        compiled = torch.compile(step, fullgraph=True)(x, key)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, step(x, key))


# ------------------------------------------------------------------------------------- dense local matching (GPU)

@pytest.mark.parametrize("shape, windows, radius", [
    ((9, 11), (2, 2), (1, 1)), ((13, 10), (3, 2), (0, 2)), ((8, 8), (2, 2), (None, 1)),
    ((5, 9, 11), (1, 2, 2), (0, 1, 1)), ((6, 9, 10), (2, 2, 2), (1, 1, 1)), ((7, 9, 11), (2, 2, 3), (1, 0, 2)),
    ((5, 9, 11), (1, 2, 2), (1, None, None)), ((7, 9, 11), (2, 2, 2), (None, 1, 0)),
])
@pytest.mark.parametrize("use_rand", [False, True])
def test_dense_local_matching_is_the_reference(shape, windows, radius, use_rand):
    """The one-product local matching used off the CPU gives the reference plan: same candidates (the reach
    masked from a table), kept sources first (in rank order), destinations in window order."""
    torch.manual_seed(4)
    metric = torch.randn(2, math.prod(shape), 6)
    offsets = random_offsets(num_windows(shape, windows), math.prod(windows), 11, CPU) if use_rand else None
    r = math.prod(shape) // 2
    plan = local_soft_matching(metric, shape, windows, r, offsets, radius, dense=True)
    want, num_src = _reference(metric, shape, windows, r, offsets, radius)
    assert plan.num_slots == math.prod(shape) - min(r, num_src)
    assert torch.equal(_content(plan, num_src), want)


@pytest.mark.parametrize("radius", [(0, 1, 1), (0, 2, None)])
def test_dense_local_matching_of_folded_frames(radius):
    """As a CUDA call runs it (frames folded into the batch, ranked together; the CUDA code paths): the dense path
    gives the tiles' plan."""
    shape, windows = (4, 9, 10), (1, 2, 2)
    torch.manual_seed(6)
    metric = torch.randn(2, math.prod(shape), 6)
    offsets = random_offsets(num_windows(shape, windows), 4, 5, CPU)
    tiles = bipartite_soft_matching(metric, shape, windows, 150, offsets, radius)
    cuda = matching(shape, windows, radius, CPU, paths="cuda")
    assert cuda.dense and not matching(shape, windows, radius, CPU).dense
    dense = cuda(metric, 150, offsets)
    want, num_src = _reference(metric, shape, windows, 150, offsets, radius)
    assert torch.equal(_content(dense, num_src), want) and torch.equal(_content(tiles, num_src), want)
