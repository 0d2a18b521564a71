"""The CUDA lane: what the patched models give on a GPU, against the CPU, in half precision, compiled.

One tiny catalogue model per engine feature (``LANE``): a UNet (levels; ToDo outside the attention call), PixArt
(a DiT with cross-attention; ToDo outside the attention call), SD3 (joint attention), Flux.1 (double and single
stream, rotary), Flux.2 (4-axis rotary, fused parallel blocks), Qwen-Image (a rotary pair, ``img_shapes``), Wan
(3-D grid, rotary), HunyuanVideo (text after the video, masked) and LTX-Video (packed 3-D tokens). Every method it
takes (``METHODS``: ToMe with local and global matching, whole-block ToMe, ToDo in or outside the attention
call, and on video the temporal window ``st=2`` and ToDo (2, 2, 2)) is checked to

- make the same merge plans on the device in float32 as on the CPU, and outputs close to the CPU's, and to remove
  to bit-identical outputs;
- run in float16 and bfloat16 with finite outputs, and remove to bit-identical outputs;
- add no host synchronisation after the first call: no operator that reads device memory on the host (counted
  with ``tokenmerge.bench.kernels.count_kernels``, on any device) beyond the unpatched model's own, and on CUDA
  none under ``torch.cuda.set_sync_debug_mode``;
- compile (``COMPILE_CASES``, marked ``compile``) with ``torch.compile(fullgraph=True)``, inductor, to the eager
  patched outputs, and with ``mode="reduce-overhead"`` (``GRAPH_CASES``: CUDA graphs recorded and replayed, none
  skipped for a reason the unpatched model does not have) too. ToMe's default random window choice
  (``use_rand=True``) is in every family's case: inductor on CUDA indexes an ``arange`` in int32, where a hash
  constant out of int32 range fails to compile (issue #32), which the CPU (int64 indices) never shows.

The tests are marked ``cuda``: they run on ``TOKENMERGE_LANE_DEVICE`` (default: the first CUDA device), and skip
with the reason where there is none. ``TOKENMERGE_LANE_DEVICE=cpu`` runs their logic on the CPU (the device
comparison is then CPU against CPU), skipping only what needs CUDA (CUDA graphs, the sync debug mode).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_denoisers import CATALOGUE, available, output_tensor

import tokenmerge
from tokenmerge.bench.kernels import count_kernels

pytestmark = pytest.mark.cuda

# catalogue entry -> the engine feature it stands for
LANE = {
    "unet-sd": "UNet levels; ToDo outside the attention call",
    "pixart": "DiT with cross-attention; ToDo outside the attention call",
    "sd3": "joint attention (no whole-block merging); ToDo inside the attention call",
    "flux": "Flux.1: double and single stream, rotary ids",
    "flux2": "Flux.2: 4-axis rotary, fused parallel single blocks",
    "qwen-image": "Qwen-Image: rotary pair, img_shapes",
    "wan": "Wan: 3-D grid, rotary self-attention",
    "hunyuan-video": "HunyuanVideo: text after the video, masked",
    "ltx": "LTX-Video: packed 3-D tokens",
}
VIDEO = ("wan", "hunyuan-video", "ltx")
NO_WHOLE_BLOCK = ("sd3",)
# method -> (apply_patch or apply_todo, its keyword arguments)
METHODS = {
    "tome-local": ("tome", {}),  # the defaults: match_radius=1, use_rand=True
    "tome-global": ("tome", {"match_radius": None}),
    "tome-block": ("tome", {"scope": "block"}),
    "todo": ("todo", {"downsample": 2}),  # in or outside the attention call, as the family runs it
    "tome-st2": ("tome", {"st": 2}),  # video windows across frames
    "todo-2x2x2": ("todo", {"downsample": (2, 2, 2)}),
}


def _methods(name: str) -> list[str]:
    out = ["tome-local", "tome-global", "todo"] + ([] if name in NO_WHOLE_BLOCK else ["tome-block"])
    return out + (["tome-st2", "todo-2x2x2"] if name in VIDEO else [])


CASES = [(name, method) for name in LANE for method in _methods(name)]
# compiled: the default ToMe on every family (the int32 case), whole-block ToMe on two transformers, ToDo
# outside the attention call (ToDo inside it refuses torch.compile: tests/test_conformance.py)
COMPILE_CASES = [(name, "tome-local") for name in LANE] + [("flux", "tome-block"), ("wan", "tome-block"),
                                                            ("unet-sd", "todo")]
GRAPH_CASES = [("unet-sd", "tome-local"), ("flux", "tome-local"), ("wan", "tome-local")]


# ---- helpers ---------------------------------------------------------------------------------------------------
def _grid(entry):
    """A grid with room for local matching (several windows per axis): 8 x 8 images, 3 x 8 x 8 video."""
    if entry.fixed_grid:
        return entry.grid
    return (3, 8, 8) if entry.kind == "video" else (8, 8)


def _setup(name: str):
    reason = available(name)
    if reason is not None:
        pytest.skip(reason)
    entry = CATALOGUE[name]
    return entry, entry.build(), entry.inputs(batch=2, grid=_grid(entry))


def _to(value, device, dtype=None):
    """``value`` (tensors in dicts, lists, tuples) on ``device``; floating tensors cast to ``dtype`` if given."""
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point():
            return value.to(device, dtype)
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device, dtype) for v in value)
    return value


@torch.no_grad()
def _run(model, inputs) -> torch.Tensor:
    return output_tensor(model(**inputs)).clone()


def _apply(model, method: str, matcher=None):
    kind, kwargs = METHODS[method]
    kwargs = dict(kwargs, min_size=0)  # the tiny models' calls are far below CUDA's default min_size: merge them
    if kind == "todo":
        return tokenmerge.apply_todo(model, **kwargs)
    if matcher is None:
        return tokenmerge.apply_patch(model, ratio=0.5, **kwargs)
    return tokenmerge.apply_config(model, tokenmerge.ToMeConfig(ratio=0.5, **kwargs), matcher=matcher)


def _partition(plan) -> list[list[int]] | str:
    """A merge plan as the partition of each batch row's tokens (slots renumbered by first appearance), so that
    two plans compare equal exactly when they merge the same tokens together."""
    if getattr(plan, "num_merged", None) == 0:
        return "nothing merged"
    dest = getattr(plan, "dest", None)
    assert dest is not None, f"the lane reads a plan's token -> slot map (dest); {type(plan).__name__} has none"
    rows = []
    for row in dest.cpu().tolist():
        seen: dict[int, int] = {}
        rows.append([seen.setdefault(slot, len(seen)) for slot in row])
    return rows


def _plans(model, inputs, method: str) -> list:
    """The plans one patched call makes, in call order (ToMe methods; ToDo makes none)."""
    plans = []

    def recording(*args, **kwargs):
        plan = tokenmerge.merge.bipartite_soft_matching(*args, **kwargs)
        plans.append(_partition(plan))
        return plan

    _apply(model, method, matcher=recording)
    try:
        _run(model, inputs)
    finally:
        tokenmerge.remove_patch(model)
    return plans


def _close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str) -> None:
    """``actual`` within ``tolerance`` of ``expected``, relative to ``expected``'s largest value."""
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    scale = expected.abs().max().clamp_min(1e-6)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=0, atol=tolerance, msg=lambda m: f"{what}: {m}")


@pytest.fixture
def exact_fp32():
    """float32 as float32 on CUDA: no TF32 in matmuls and convolutions (the CPU has none)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


# ---- the checks ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, method", CASES)
def test_same_plans_and_outputs_on_the_device_as_on_the_cpu(name, method, lane_device, exact_fp32):
    """float32: the plans (which tokens merge together) equal the CPU's, the outputs are close to the CPU's, and
    removal gives the device's unpatched outputs bit for bit."""
    entry, model, inputs = _setup(name)
    tome = METHODS[method][0] == "tome"
    cpu_plans = _plans(model, inputs, method) if tome else None
    _apply(model, method)
    cpu_out = _run(model, inputs)
    tokenmerge.remove_patch(model)

    model.to(lane_device)
    on_device = _to(inputs, lane_device)
    plain = _run(model, on_device)
    if tome:
        device_plans = _plans(model, on_device, method)
        assert device_plans, "the patched call made no plan"
        assert device_plans == cpu_plans, f"{name} {method}: the plans on {lane_device} differ from the CPU's"
    _apply(model, method)
    merged = _run(model, on_device)
    tokenmerge.remove_patch(model)
    assert merged.device.type == lane_device.type and torch.isfinite(merged).all()
    assert not torch.equal(merged, plain), f"{name} {method}: the patch changed nothing"
    _close(merged, cpu_out, 1e-3, f"{name} {method} on {lane_device} against the CPU")
    assert torch.equal(_run(model, on_device), plain), "removal must give the unpatched outputs bit for bit"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name, method", CASES)
def test_half_precision_runs_finite_and_removes_bit_identical(name, method, dtype, lane_device):
    entry, model, inputs = _setup(name)
    dtype = getattr(torch, dtype)
    model.to(lane_device, dtype)
    inputs = _to(inputs, lane_device, dtype)
    plain = _run(model, inputs)
    _apply(model, method)
    merged = _run(model, inputs)
    tokenmerge.remove_patch(model)
    assert merged.dtype == plain.dtype == dtype and merged.shape == plain.shape
    assert torch.isfinite(merged).all(), f"{name} {method} {dtype}: non-finite outputs"
    assert not torch.equal(merged, plain), f"{name} {method} {dtype}: the patch changed nothing"
    assert torch.equal(_run(model, inputs), plain), "removal must give the unpatched outputs bit for bit"


@pytest.mark.parametrize("name", ["unet-sd", "flux"])
def test_the_defaults_leave_calls_below_min_size_unmerged_on_cuda(name, lane_device):
    """On CUDA, the default ``min_size`` (4096 x 1024 tokens x channels per sample) leaves the tiny models' calls
    unmerged: bit for bit the unpatched outputs, and describe_patch says why; ``min_size=0`` merges them. Off CUDA
    (the lane's CPU self-check) every call merges by default."""
    entry, model, inputs = _setup(name)
    model.to(lane_device)
    inputs = _to(inputs, lane_device)
    plain = _run(model, inputs)
    tokenmerge.apply_patch(model, ratio=0.5)
    default = _run(model, inputs)
    notes = tokenmerge.describe_patch(model).notes
    tokenmerge.apply_patch(model, ratio=0.5, min_size=0)
    forced = _run(model, inputs)
    tokenmerge.remove_patch(model)
    assert not torch.equal(forced, plain)
    if lane_device.type == "cuda":
        assert torch.equal(default, plain)
        assert any("smaller than min_size" in n for n in notes) and any("min_size=None: on CUDA" in n for n in notes)
    else:
        assert not torch.equal(default, plain)


def _syncs(model, inputs, device) -> tuple[int, list[str]]:
    """Operators of one call that read device memory on the host, and on CUDA the sync debug mode's warnings."""
    from tokenmerge.bench.kernels import SYNCS

    counts = count_kernels(_run, device, model, inputs)
    names = sorted(name for name in counts["ops"] if name in SYNCS)
    caught: list[str] = []
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _run(model, inputs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        caught = [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message).lower()]
    return counts["syncs"], names + caught


@pytest.mark.parametrize("name, method", CASES)
def test_no_host_sync_after_the_first_call(name, method, lane_device):
    """After the first call (which may build cached tables), a patched call reads nothing back to the host that
    the unpatched model does not read itself; on CUDA, where the unpatched model syncs nowhere, a patched call
    runs under ``torch.cuda.set_sync_debug_mode("error")``."""
    entry, model, inputs = _setup(name)
    model.to(lane_device)
    inputs = _to(inputs, lane_device)
    _run(model, inputs)
    plain_syncs, plain_what = _syncs(model, inputs, lane_device)
    _apply(model, method)
    try:
        _run(model, inputs)  # the first call: plans, tables and caches are built here
        syncs, what = _syncs(model, inputs, lane_device)
        if lane_device.type == "cuda" and not plain_what:
            torch.cuda.set_sync_debug_mode("error")
            try:
                _run(model, inputs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        tokenmerge.remove_patch(model)
    assert syncs <= plain_syncs and len(what) <= len(plain_what), (
        f"{name} {method}: host syncs after the first call: {what} (the unpatched model: {plain_what})")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.compile
@pytest.mark.parametrize("name, method, mode", [(n, m, "default") for n, m in COMPILE_CASES]
                         + [(n, m, "reduce-overhead") for n, m in GRAPH_CASES])
def test_compiled_fullgraph_matches_eager(name, method, mode, lane_device, fresh_dynamo, exact_fp32):
    """``torch.compile(fullgraph=True)`` with inductor (and ``mode="reduce-overhead"``: CUDA graphs, replayed)
    gives the eager patched outputs, and they are merged ones (the patch is in the compiled graph)."""
    pytest.importorskip("torch._inductor")
    if mode == "reduce-overhead" and lane_device.type != "cuda":
        pytest.skip("CUDA graphs need CUDA (mode='reduce-overhead' on the CPU is inductor's default mode)")
    entry, model, inputs = _setup(name)
    model.to(lane_device)
    inputs = _to(inputs, lane_device)
    plain = _run(model, inputs)
    _apply(model, method)
    try:
        eager = _run(model, inputs)
        outs, skips = _compiled_runs(model, inputs, mode)
    finally:
        tokenmerge.remove_patch(model)
    assert not torch.equal(eager, plain)
    for i, out in enumerate(outs):
        _close(out, eager, 2e-3, f"{name} {method} compiled ({mode}), call {i + 1}")
    if skips:  # CUDA graphs were not used for the patched model: only the unpatched model's own reasons excuse it
        torch._dynamo.reset()
        plain_skips = _compiled_runs(model, inputs, mode)[1]
        assert skips <= plain_skips, (f"{name} {method}: CUDA graphs skipped {skips} times for the patched model, "
                                      f"{plain_skips} for the unpatched one (TORCH_LOGS=perf_hints says why)")


def _compiled_runs(model, inputs, mode: str) -> tuple[list[torch.Tensor], int]:
    """Outputs of ``torch.compile(model, fullgraph=True, mode=...)`` (three calls with CUDA graphs: warm-up,
    record, replay) and how often inductor skipped CUDA graphs."""
    from torch._dynamo.utils import counters

    counters["inductor"].clear()
    compiled = torch.compile(model, fullgraph=True, mode=None if mode == "default" else mode)
    outs = []
    for _ in range(3 if mode == "reduce-overhead" else 1):
        torch.compiler.cudagraph_mark_step_begin()
        outs.append(_run(compiled, inputs))
    return outs, counters["inductor"].get("cudagraph_skips", 0)
