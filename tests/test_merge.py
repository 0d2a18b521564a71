"""The pure tensor algorithm: round trips, the mean, the windows, parity with tomesd's merge function."""

import pytest
import torch

from tokenmerge.merge import IdentityPlan, MergePlan, bipartite_soft_matching_2d, random_offsets, window_destinations


def test_identity_plan_for_r_zero():
    x = torch.randn(2, 64, 8)
    plan = bipartite_soft_matching_2d(x, 8, 8, 2, 2, 0)
    assert isinstance(plan, IdentityPlan)
    assert plan.merge(x) is x and plan.unmerge(x) is x


@pytest.mark.parametrize("h, w, sx, sy, ratio", [(8, 8, 2, 2, 0.5), (7, 9, 2, 2, 0.5), (6, 10, 3, 2, 0.6),
                                                 (5, 5, 2, 2, 0.75), (1, 9, 2, 2, 0.5)])
def test_merge_is_the_mean_and_unmerge_copies_back(h, w, sx, sy, ratio):
    torch.manual_seed(0)
    b, c = 3, 5
    x = torch.randn(b, h * w, c)
    r = int(h * w * ratio)
    plan = bipartite_soft_matching_2d(x, h, w, sx, sy, r)
    windows = (h // sy) * (w // sx)
    if windows == 0:
        assert isinstance(plan, IdentityPlan)
        return
    expected_r = min(r, h * w - windows)
    assert plan.num_slots == h * w - expected_r
    merged = plan.merge(x)
    assert merged.shape == (b, h * w - expected_r, c)
    dest = plan.dest
    for bi in range(b):  # naive per-slot mean
        for slot in range(plan.num_slots):
            members = (dest[bi] == slot).nonzero().squeeze(1)
            assert len(members) >= 1
            torch.testing.assert_close(merged[bi, slot], x[bi, members].mean(0))
    back = plan.unmerge(merged)
    assert back.shape == x.shape
    torch.testing.assert_close(back, merged.gather(1, dest.unsqueeze(-1).expand(-1, -1, c)))
    # tokens alone in their slot come back exactly
    alone = torch.zeros_like(dest, dtype=torch.bool)
    for bi in range(b):
        counts = torch.bincount(dest[bi], minlength=plan.num_slots)
        alone[bi] = counts[dest[bi]] == 1
    assert torch.equal(back[alone], x[alone])


def test_each_window_keeps_exactly_one_destination():
    h, w, sx, sy = 6, 8, 2, 3
    offsets = random_offsets((h // sy) * (w // sx), sx * sy, 12345, torch.device("cpu"))
    dst, src = window_destinations(h, w, sx, sy, offsets, "cpu")
    assert sorted(torch.cat([dst, src]).tolist()) == list(range(h * w))
    rows, cols = dst // w, dst % w
    windows = (rows // sy) * (w // sx) + cols // sx
    assert sorted(windows.tolist()) == list(range(len(dst)))


def test_random_offsets_are_a_pure_function_of_the_key_and_uniform():
    a = random_offsets(4096, 4, 99, torch.device("cpu"))
    assert torch.equal(a, random_offsets(4096, 4, 99, torch.device("cpu")))
    assert torch.equal(a, random_offsets(4096, 4, torch.tensor([99]), torch.device("cpu")))
    assert not torch.equal(a, random_offsets(4096, 4, 100, torch.device("cpu")))
    counts = torch.bincount(a, minlength=4).float() / 4096
    assert (counts - 0.25).abs().max() < 0.03
    assert int(a.min()) >= 0 and int(a.max()) <= 3


@pytest.mark.parametrize("h, w", [(8, 8), (9, 7), (4, 6)])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("chunk", [None, 50])  # 50 elements: sources scored a row or two at a time
def test_parity_with_tomesd_merge_function(h, w, ratio, chunk, monkeypatch):
    from tomesd.merge import bipartite_soft_matching_random2d

    from tokenmerge.merge import match

    if chunk is not None:
        monkeypatch.setattr(match, "SCORE_CHUNK", chunk)

    torch.manual_seed(1)
    x = torch.randn(2, h * w, 16)
    r = int(h * w * ratio)
    m, u = bipartite_soft_matching_random2d(x, w, h, 2, 2, r, no_rand=True)
    plan = bipartite_soft_matching_2d(x, h, w, 2, 2, r)
    ref_merged = m(x)
    ours = plan.merge(x)
    # the order of merged tokens may differ; what each token gets back may not
    torch.testing.assert_close(plan.unmerge(ours), u(ref_merged))
    # the merged token sets agree (as sets: the order of the sequence is free)
    torch.testing.assert_close(ours.sort(dim=1).values, ref_merged.sort(dim=1).values)


def test_plan_checks_shapes():
    x = torch.randn(2, 16, 4)
    plan = bipartite_soft_matching_2d(x, 4, 4, 2, 2, 8)
    with pytest.raises(RuntimeError, match="batch=2, tokens=16"):
        plan.merge(torch.randn(2, 15, 4))
    with pytest.raises(RuntimeError, match="4 x 5 grid"):
        bipartite_soft_matching_2d(x, 4, 5, 2, 2, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dtypes_and_autograd(dtype):
    x = torch.randn(2, 64, 8, dtype=dtype, requires_grad=True)
    plan = bipartite_soft_matching_2d(x, 8, 8, 2, 2, 32)
    out = plan.unmerge(plan.merge(x) * 2)
    assert out.dtype == dtype
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype
    # every token contributes 2 * (1/count) * count = 2 to the sum of its slot's copies
    assert torch.allclose(x.grad.float(), torch.full_like(x.grad.float(), 2.0), atol=1e-2)


def test_merge_plan_from_dest():
    dest = torch.tensor([[0, 1, 1, 2]])
    plan = MergePlan(dest, 3)
    x = torch.tensor([[[1.0], [2.0], [4.0], [8.0]]])
    assert plan.merge(x).flatten().tolist() == [1.0, 3.0, 8.0]
    assert plan.unmerge(plan.merge(x)).flatten().tolist() == [1.0, 3.0, 3.0, 8.0]


@pytest.mark.parametrize("chunk", [1, 100, 1000, 10**9])
def test_scores_in_chunks_give_the_same_matches(chunk):
    from tokenmerge.merge.match import best_matches

    torch.manual_seed(0)
    a = torch.nn.functional.normalize(torch.randn(2, 300, 16), dim=-1)
    b = torch.nn.functional.normalize(torch.randn(2, 100, 16), dim=-1)
    whole_values, whole_index = (a @ b.transpose(1, 2)).max(dim=-1)
    values, index = best_matches(a, b, chunk)
    assert torch.equal(index, whole_index)
    torch.testing.assert_close(values, whole_values, rtol=0, atol=1e-6)


def _masked_reference(metric, h, w, sx, sy, offsets, radius):
    """Global scores with every destination beyond ``radius`` windows masked out: what the local matching
    must find, computed the slow way."""
    metric = torch.nn.functional.normalize(metric, dim=-1)
    dst, src = window_destinations(h, w, sx, sy, offsets, "cpu")
    scores = metric[:, src] @ metric[:, dst].transpose(1, 2)
    hsy, wsx = h // sy, w // sx
    src_wy, src_wx = (src // w // sy).clamp(max=hsy - 1), (src % w // sx).clamp(max=wsx - 1)
    dst_wy, dst_wx = torch.arange(hsy * wsx) // wsx, torch.arange(hsy * wsx) % wsx
    near = ((src_wy[:, None] - dst_wy).abs() <= radius) & ((src_wx[:, None] - dst_wx).abs() <= radius)
    return scores.masked_fill(~near, -2.0).max(dim=-1), src


def _merged_windows(plan, kept):
    """``(B, N)``: the window a token was merged into, -1 for a token kept alone (its slot number is free)."""
    dest = plan.dest
    return torch.where(dest >= kept, dest - kept, -1)


@pytest.mark.parametrize("h, w, sx, sy, radius", [
    (8, 8, 2, 2, 0), (9, 11, 2, 2, 0), (13, 10, 3, 2, 0),
    (9, 11, 2, 2, 1), (13, 10, 3, 2, 2), (40, 36, 2, 2, 1), (40, 37, 2, 2, 3), (41, 36, 2, 2, 5),
])
@pytest.mark.parametrize("chunk, tile", [(None, None), (300, None), (None, 2), (5000, 7)])  # 300: a tile at a time
@pytest.mark.parametrize("use_rand", [True, False])
def test_local_matching_is_the_global_matching_with_far_destinations_masked(h, w, sx, sy, radius, chunk, tile,
                                                                              use_rand):
    from tokenmerge.merge.soft_matching import local_soft_matching_2d

    torch.manual_seed(0)
    metric = torch.randn(2, h * w, 5)
    windows = (h // sy) * (w // sx)
    offsets = random_offsets(windows, sx * sy, 7, torch.device("cpu")) if use_rand else None
    (values, index), src = _masked_reference(metric, h, w, sx, sy, offsets, radius)
    dst = window_destinations(h, w, sx, sy, offsets, "cpu")[0]
    r = src.shape[0] // 2
    kept = src.shape[0] - r
    plan = local_soft_matching_2d(metric, h, w, sx, sy, r, offsets, radius, chunk=chunk, tile=tile)
    assert plan.num_slots == h * w - r
    want = torch.full((2, h * w), -1)
    order = values.argsort(dim=1, descending=True)[:, :r]
    want.scatter_(1, src[order], index.gather(1, order))  # the r best sources, into their best window
    want[:, dst] = torch.arange(windows)  # every destination keeps its own window's slot
    assert torch.equal(_merged_windows(plan, kept), want)
    for row in plan.dest:  # the kept sources have one slot each
        assert torch.equal(torch.bincount(row, minlength=plan.num_slots)[:kept], torch.ones(kept, dtype=torch.int64))


def test_match_radius_changes_the_plan_and_one_that_covers_the_grid_is_the_global_matching():
    torch.manual_seed(0)
    metric = torch.randn(2, 24 * 20, 8)
    offsets = random_offsets(12 * 10, 4, 3, torch.device("cpu"))
    plan = bipartite_soft_matching_2d(metric, 24, 20, 2, 2, 200, offsets)
    assert torch.equal(bipartite_soft_matching_2d(metric, 24, 20, 2, 2, 200, offsets, radius=11).dest, plan.dest)
    local = bipartite_soft_matching_2d(metric, 24, 20, 2, 2, 200, offsets, radius=1)
    assert local.num_merged == plan.num_merged and not torch.equal(local.dest, plan.dest)
    # every merged source lands on a destination at most one window away (slots: kept sources, then the
    # destinations in window order)
    src = window_destinations(24, 20, 2, 2, offsets, "cpu")[1]
    slot = local.dest[:, src]  # (B, Ns)
    kept = local.num_slots - 12 * 10
    merged = slot >= kept
    assert merged.sum().item() == 2 * 200
    window = (slot - kept).clamp(min=0)
    src_wy, src_wx = (src // 20 // 2).clamp(max=11), (src % 20 // 2).clamp(max=9)
    assert ((window // 10 - src_wy).abs() <= 1)[merged].all()
    assert ((window % 10 - src_wx).abs() <= 1)[merged].all()
    # ... which the global matching does not respect: the check above has something to catch
    global_window = (plan.dest[:, src] - kept).clamp(min=0)
    far = ((global_window // 10 - src_wy).abs() > 1) | ((global_window % 10 - src_wx).abs() > 1)
    assert (far & (plan.dest[:, src] >= kept)).any()
