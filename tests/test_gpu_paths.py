"""What a CUDA call needs of the hot path, checked on the CPU: no host synchronisation after the first call, the
CUDA code paths (one product instead of tiles and chunks) giving the CPU paths' results, and a small, fixed number
of kernels per merged block (counted as dispatched backend operators: ``tokenmerge.bench.kernels``)."""

from __future__ import annotations

import pytest
import torch
from tiny_denoisers import CATALOGUE, available, output_tensor

import tokenmerge
from tokenmerge.bench.kernels import count_kernels

pytestmark = pytest.mark.usefixtures("fast_cpu")

# one entry per engine feature: a UNet (levels), PixArt (2-D, no rotary), SD3 (joint attention), Flux (ids grid,
# text before the image, rotary), Qwen-Image (shapes grid, rotary pair), Wan (3-D latent grid), HunyuanVideo
# (text after the image), LTX (grid from integer arguments)
ENTRIES = ["unet-sd", "pixart", "sd3", "flux", "qwen-image", "wan", "hunyuan-video", "ltx"]
METHODS = {  # the defaults (one plan per level: share_plans=True), and a plan per block
    "tome": dict(),
    "tome-per-block": dict(share_plans=False),
    "tome-global": dict(match_radius=None, share_plans=False),
    "whole-block": dict(scope="block"),
    "whole-block-per-block": dict(scope="block", share_plans=False),
    "todo": None,  # ToDo 2 per side (each frame of a video)
}
# the refusals these tests expect (at apply time, with the family's reason); any other error fails
REFUSED: dict = {}  # (SD3 declares its whole-block layout now)


def _video(model) -> bool:
    return any(e.kind == "video" for e in CATALOGUE.values() if e.cls == type(model).__name__)


def _config(method: str, model):
    kwargs = METHODS[method]
    if kwargs is None:
        return tokenmerge.ToDoConfig(downsample=(1, 2, 2) if _video(model) else 2)
    return tokenmerge.ToMeConfig(ratio=0.5, **kwargs)


def _setup(name):
    reason = available(name)
    if reason is not None:
        pytest.skip(reason)
    entry = CATALOGUE[name]
    grid = tuple(2 * g for g in entry.grid[-2:])  # a larger grid: more windows than one tile
    grid = (*entry.grid[:-2], *grid) if not entry.fixed_grid else entry.grid
    return entry, entry.build(), entry.inputs(batch=2, grid=grid)


def _apply(method, model, name=None, code_paths=None):
    """Patch ``model`` with ``method`` (with the code paths of ``code_paths``' device); a refusal listed in
    ``REFUSED`` skips the test, with its reason checked."""
    if (name, method) in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[(name, method)]):
            tokenmerge.apply_config(model, _config(method, model))
        pytest.skip(f"{name} refuses {method}: {REFUSED[(name, method)]}")
    tokenmerge.apply_config(model, _config(method, model), code_paths=code_paths)


@torch.no_grad()
def _syncs(model, inputs) -> int:
    return count_kernels(lambda: model(**inputs), "cpu")["syncs"]


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("name", ENTRIES)
def test_no_host_sync_after_the_first_call(name, method):
    """After the first call (which may read position ids on the host once), a patched call reads nothing back
    from the device that the unpatched model does not: what ``torch.cuda.set_sync_debug_mode("error")`` checks
    on CUDA, here by counting the operators that synchronise (``.item()``, ``nonzero``, ``equal``...)."""
    entry, model, inputs = _setup(name)
    with torch.no_grad():
        model(**inputs)
    vanilla = _syncs(model, inputs)
    _apply(method, model, name, code_paths="cuda")
    try:
        with torch.no_grad():
            model(**inputs)  # the first call: grids read, tables built
        patched = _syncs(model, inputs)
    finally:
        tokenmerge.remove_patch(model)
    assert patched == vanilla


@pytest.mark.parametrize("method", ["tome", "tome-per-block", "whole-block"])
@pytest.mark.parametrize("name", ["pixart", "flux", "wan", "unet-sd"])
def test_cuda_code_paths_give_the_cpu_paths_results(name, method):
    """The CUDA code paths (local matching as one masked product, no chunks) merge the same tokens into the
    same destinations as the CPU's tiles: the outputs agree to rounding."""
    entry, model, inputs = _setup(name)
    _apply(method, model, name)
    try:
        with torch.no_grad():
            cpu = output_tensor(model(**inputs), entry)
        _apply(method, model, name, code_paths="cuda")
        with torch.no_grad():
            cuda = output_tensor(model(**inputs), entry)
        tokenmerge.remove_patch(model)
        with torch.no_grad():
            plain = output_tensor(model(**inputs), entry)
    finally:
        tokenmerge.remove_patch(model)
    assert not torch.allclose(cpu, plain)  # the patch acts
    torch.testing.assert_close(cuda, cpu, rtol=1e-4, atol=1e-4)


def _needs(*names):
    for name in names:
        if available(name) is not None:
            pytest.skip(available(name))


def _per_block(method: str | None, layers: tuple[int, int] = (2, 6)) -> float:
    """Kernels a block issues on the CUDA paths (tiny PixArt, a 16x16 grid, batch 2; patched by ``method``, or
    vanilla for None): the count per step with ``layers[1]`` blocks minus with ``layers[0]``, over the blocks
    added (the per-call part cancels)."""
    _needs("pixart")
    entry = CATALOGUE["pixart"]
    counts = []
    for n in layers:
        torch.manual_seed(0)
        model = type(entry.build()).from_config(dict(entry.build().config, num_layers=n)).eval()
        inputs = entry.inputs(batch=2, grid=(16, 16))
        if method is not None:
            _apply(method, model, "pixart", code_paths="cuda")
        with torch.no_grad():
            model(**inputs)  # warm-up: the cached tables built
            counts.append(count_kernels(lambda: model(**inputs), "cpu")["kernels"])
        tokenmerge.remove_patch(model)
    return (counts[1] - counts[0]) / (layers[1] - layers[0])


# kernels a merged PixArt block adds on the CUDA paths, at most: what this hot path takes (the one before it took
# 83 local, 66 global, 86 whole-block, 45 shared, 29 ToDo, plans made per block but "shared"). A regression guard,
# not a timing: a change that adds kernels to every block shows here (raise the budget only for a reason).
BUDGET = {"tome-per-block": 25, "tome-global": 24, "whole-block-per-block": 28, "tome": 4, "whole-block": 7,
          "todo": 1}


@pytest.mark.parametrize("method", sorted(BUDGET))
def test_kernels_per_merged_block(method):
    assert _per_block(method) - _per_block(None) <= BUDGET[method]


def test_describe_patch_says_where_a_setting_cannot_pay_on_a_gpu():
    """Attention-only ToMe on an image transformer and plans built block by block on a transformer are named
    plainly; whole-block merging with the default shared plans, and ToDo without query merging, get no such note;
    a UNet gets neither."""
    from tokenmerge.engine.notes import NOTE_ATTENTION_ONLY, NOTE_PLAN_PER_BLOCK

    _needs("pixart", "unet-sd")
    model = CATALOGUE["pixart"].build()
    tokenmerge.apply_patch(model, ratio=0.5)
    notes = tokenmerge.describe_patch(model).notes
    assert notes == (NOTE_ATTENTION_ONLY,) and "note: merging around attention" in str(tokenmerge.describe_patch(model))
    tokenmerge.apply_patch(model, ratio=0.5, share_plans=False)
    assert tokenmerge.describe_patch(model).notes == (NOTE_ATTENTION_ONLY, NOTE_PLAN_PER_BLOCK)
    tokenmerge.apply_patch(model, ratio=0.5, scope="block")
    assert tokenmerge.describe_patch(model).notes == ()
    tokenmerge.apply_todo(model, downsample=2)
    assert tokenmerge.describe_patch(model).notes == ()
    unet = CATALOGUE["unet-sd"].build()
    for plans in (None, False):  # a UNet's plan per block (its default) was no slower on the H200: no note
        tokenmerge.apply_patch(unet, ratio=0.5, share_plans=plans)
        assert tokenmerge.describe_patch(unet).notes == ()
    tokenmerge.remove_patch(model)
    tokenmerge.remove_patch(unet)


# ---- min_size: calls too small to pay on a GPU run unmerged --------------------------------------------------
def test_min_size_defaults_to_the_h200_threshold_on_cuda_only():
    from tokenmerge.config import CUDA_MIN_SIZE, min_size_on

    assert CUDA_MIN_SIZE == 4096 * 1024
    assert min_size_on(None, torch.device("cuda", 0)) == CUDA_MIN_SIZE
    assert min_size_on(None, torch.device("cpu")) == 0 and min_size_on(None, "mps") == 0
    assert min_size_on(0, torch.device("cuda")) == 0 and min_size_on(7, torch.device("cpu")) == 7
    for bad in (-1, 1.5, True, "big"):
        with pytest.raises(ValueError, match="min_size must be None"):
            tokenmerge.ToMeConfig(min_size=bad)
        with pytest.raises(ValueError, match="min_size must be None"):
            tokenmerge.ToDoConfig(min_size=bad)


@pytest.mark.parametrize("method", ["tome", "whole-block", "todo"])
@pytest.mark.parametrize("name", ["unet-sd", "pixart", "flux", "wan"])
def test_calls_below_min_size_run_unmerged_and_describe_patch_says_so(name, method):
    """A call whose hidden states (tokens x channels per sample) are below ``min_size`` runs unmerged, bit for bit
    the unpatched model's (ToDo pools nothing either), and ``describe_patch`` names the level and sizes; at
    ``min_size=0`` the same call merges."""
    entry, model, inputs = _setup(name)
    with torch.no_grad():
        plain = output_tensor(model(**inputs), entry)
    kwargs = dict(downsample=(1, 2, 2) if _video(model) else 2) if method == "todo" else \
        dict(ratio=0.5, scope="block" if method == "whole-block" else "attention")
    apply = tokenmerge.apply_todo if method == "todo" else tokenmerge.apply_patch
    try:
        apply(model, min_size=10**9, **kwargs)
    except ValueError as err:  # a method this family refuses at apply time (with its reason)
        pytest.skip(f"{method} refused: {err}")
    try:
        with torch.no_grad():
            small = output_tensor(model(**inputs), entry)
        notes = tokenmerge.describe_patch(model).notes
        apply(model, min_size=0, **kwargs)
        with torch.no_grad():
            merged = output_tensor(model(**inputs), entry)
        assert not any("smaller than min_size" in n for n in tokenmerge.describe_patch(model).notes)
    finally:
        tokenmerge.remove_patch(model)
    assert torch.equal(small, plain)
    assert any("calls ran unmerged where their hidden states were smaller than min_size (downsample 1: " in n
               and "< 1,000,000,000" in n for n in notes), notes
    assert not torch.equal(merged, plain)
