"""``kernels="triton"``: the fused merge, unmerge and whole-block update (``tokenmerge.merge.kernels``) against the
torch path they replace.

They run on CUDA where there is one, else on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` with the
triton package: ``scripts/test.sh`` runs this file so, with triton in ``.venv-triton``); elsewhere they skip, except
the config checks, which need no triton.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import tokenmerge
from tokenmerge.config import ToMeConfig
from tokenmerge.merge import kernels
from tokenmerge.merge.plan import MergePlan


def _device() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


DEVICE = _device()
needs_triton = pytest.mark.skipif(DEVICE is None, reason="needs triton and CUDA, or triton with TRITON_INTERPRET=1 "
                                                         "(scripts/test.sh runs it so on the CPU)")
pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def kernels_ran(request, monkeypatch):
    """A parity test cannot pass by comparing the torch path with itself: where the Triton kernels can run, every
    test that reaches them must launch them (``kernels_ran``: the launches) without one falling back, unless it is
    about the fallback (``broken_triton``)."""
    launched = []
    if DEVICE is None or "broken_triton" in request.fixturenames:
        yield launched
        return
    real = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda *a, **k: launched.append(a[0]) or real(*a, **k))
    yield launched
    assert kernels.failed() is None, f"a Triton kernel fell back to the torch operators: {kernels.failed()}"
    if request.node.get_closest_marker("parity") is not None:
        assert launched, "the parity test compared the torch path with itself: no Triton kernel ran"


def _plan(rows: int, tokens: int, slots: int, device) -> MergePlan:
    """A random plan: every slot gets one token, the others land anywhere (some slots get many)."""
    dest = []
    for _ in range(rows):
        extra = torch.randint(0, slots, (tokens - slots,))
        dest.append(torch.cat([torch.arange(slots), extra])[torch.randperm(tokens)])
    plan = MergePlan(torch.stack(dest).to(device), slots)
    plan.kernels = "triton"
    return plan


def _torch(plan: MergePlan) -> MergePlan:
    """The same plan on the torch path."""
    return MergePlan(plan.dest, plan.num_slots)


@pytest.mark.parity
@needs_triton
@pytest.mark.parametrize("rows", [1, 2], ids=["one-pattern", "per-element"])
@pytest.mark.parametrize("before,after", [(0, 0), (3, 0), (0, 2), (2, 5)])
def test_fused_equals_torch_path_float32(rows, before, after):
    batch, tokens, slots, channels = 2, 37, 14, 40
    plan = _plan(rows, tokens, slots, DEVICE)
    ref = _torch(plan)
    x = torch.randn(batch, before + tokens + after, channels, device=DEVICE)
    y = torch.randn(batch, before + slots + after, channels, device=DEVICE)
    merged = torch.randn(batch, slots, channels, device=DEVICE)
    got, want = plan.merge(x, before, after), ref.merge(x, before, after)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if before or after:  # the other tokens copied exactly
        assert torch.equal(got[:, :before], x[:, :before]) and torch.equal(got[:, got.shape[1] - after:],
                                                                           x[:, x.shape[1] - after:])
    torch.testing.assert_close(plan.unmerge(y, before, after), ref.unmerge(y, before, after),
                               rtol=0, atol=0)
    torch.testing.assert_close(plan.unmerge_update(y, merged, x, before, after),
                               ref.unmerge_update(y, merged, x, before, after), rtol=1e-6, atol=1e-6)


@needs_triton
def test_fused_paths_ran_and_tables_are_kept_per_layout(monkeypatch):
    """The triton path is taken (not a silent fallback), and a plan builds its index tables once per layout."""
    calls = []
    for name in ("merge_join", "unmerge_join", "unmerge_update"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    plan = _plan(1, 20, 8, DEVICE)
    x = torch.randn(1, 22, 16, device=DEVICE)
    for _ in range(2):
        m = plan.merge(x, 2, 0)
        plan.unmerge_update(m, m[:, 2:], x, 2, 0)
        plan.unmerge(m, 2, 0)
    assert calls == ["merge_join", "unmerge_update", "unmerge_join"] * 2
    assert sorted(plan._kernel_tables) == [("merge", 2, 0), ("unmerge", 2, 0)]


@pytest.mark.parity
@needs_triton
def test_strided_inputs():
    """A transposed view (PixArt's patch embedding hands its first block one) is read through its strides."""
    plan = _plan(1, 30, 11, DEVICE)
    x = torch.randn(2, 24, 30, device=DEVICE).transpose(1, 2)  # (2, 30, 24), channels stride 30
    assert not x.is_contiguous()
    torch.testing.assert_close(plan.merge(x), _torch(plan).merge(x.contiguous()), rtol=1e-6, atol=1e-6)
    y = torch.randn(2, 24, 11, device=DEVICE).transpose(1, 2)
    torch.testing.assert_close(plan.unmerge_update(y, y, x), x, rtol=0, atol=0)  # no update: the input back


@pytest.mark.parity
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_at_least_as_accurate_as_the_torch_path(dtype):
    """float32 sums in a fixed order: at least as close to the float64 mean as ``index_add`` in the input's dtype."""
    plan = _plan(1, 300, 40, DEVICE)  # ~7 tokens a slot
    x = torch.randn(2, 300, 1100, device=DEVICE).to(dtype)  # more channels than one program's block
    exact = _torch(plan).merge(x.double())
    fused_err = (plan.merge(x).double() - exact).abs().max()
    torch_err = (_torch(plan).merge(x).double() - exact).abs().max()
    assert fused_err <= torch_err
    assert fused_err <= torch.finfo(dtype).eps * 4


@needs_triton
def test_other_dtypes_and_compile_take_the_torch_path():
    plan = _plan(1, 20, 8, DEVICE)
    x = torch.randn(1, 20, 4, device=DEVICE, dtype=torch.float64)
    assert not kernels.runs(x)
    assert torch.equal(plan.merge(x), _torch(plan).merge(x))
    seen = []
    compiled = torch.compile(lambda t: (seen.append(kernels.runs(t)), t * 2)[1], backend="eager", fullgraph=True)
    compiled(x.float())
    assert seen == [False]


def _to(value, device):
    """``value`` (a tensor, or dicts, lists and tuples of them) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


def _class(name: str):
    """A diffusers model class, or a skip where the installed diffusers has none (the oldest supported)."""
    import diffusers

    if not hasattr(diffusers, name):
        pytest.skip(f"diffusers {diffusers.__version__} has no {name}")
    return getattr(diffusers, name)


def _pixart(layers: int = 3):
    PixArtTransformer2DModel = _class("PixArtTransformer2DModel")

    model = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                     num_layers=layers, cross_attention_dim=16, sample_size=16, patch_size=2,
                                     caption_channels=16, norm_type="ada_norm_single",
                                     use_additional_conditions=False).eval()
    inputs = dict(hidden_states=torch.randn(2, 4, 16, 16), encoder_hidden_states=torch.randn(2, 8, 16),
                  timestep=torch.tensor([500, 500]), added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    return model, inputs


def _flux():
    FluxTransformer2DModel = _class("FluxTransformer2DModel")

    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=2,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=8, axes_dims_rope=(2, 2, 4)).eval()
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(8.0), indexing="ij"), -1)
    inputs = dict(hidden_states=torch.randn(1, 64, 8), encoder_hidden_states=torch.randn(1, 5, 16),
                  pooled_projections=torch.randn(1, 8), timestep=torch.tensor([0.5]), img_ids=ids.reshape(-1, 3),
                  txt_ids=torch.zeros(5, 3))
    return model, inputs


@pytest.mark.parity
@needs_triton
@pytest.mark.parametrize("make", [_pixart, _flux], ids=["pixart", "flux"])
@pytest.mark.parametrize("scope", ["attention", "block"])
def test_patched_model_matches_the_torch_kernels(make, scope, monkeypatch):
    """A patched model's output with kernels="triton" is the torch kernels' (float32), through the text joins of
    Flux's joint attention and single-stream blocks; removal restores the model."""
    model, inputs = make()
    model.to(DEVICE)
    inputs = _to(inputs, DEVICE)
    with torch.no_grad():
        vanilla = model(**inputs)[0]
        outs = {}
        for name in kernels.KERNELS:
            tokenmerge.apply_patch(model, 0.5, scope=scope, kernels=name)
            calls = []
            real = kernels.merge_join
            monkeypatch.setattr(kernels, "merge_join", lambda *a, **k: calls.append(1) or real(*a, **k))
            outs[name] = model(**inputs)[0]
            monkeypatch.setattr(kernels, "merge_join", real)
            assert bool(calls) == (name == "triton")
            tokenmerge.remove_patch(model)
        assert torch.equal(model(**inputs)[0], vanilla)
    assert not torch.equal(outs["torch"], vanilla)
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-5)


@needs_triton
def test_compiled_model_with_triton_kernels_is_one_graph():
    """Under torch.compile the torch operators run (inductor fuses them): fullgraph holds, outputs as eager."""
    model, inputs = _pixart()
    model.to(DEVICE)
    inputs = _to(inputs, DEVICE)
    tokenmerge.apply_patch(model, 0.5, scope="block", kernels="triton")
    with torch.no_grad():
        eager = model(**inputs)[0]
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)(**inputs)[0]
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_kernels_setting_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="kernels must be one of 'torch', 'triton'"):
        ToMeConfig(kernels="cuda")
    ToMeConfig(kernels="triton")  # a config can name them anywhere (the GPU table's rows are parsed on a CPU)
    from tiny_models import make_unet

    model = make_unet()
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)
    for apply in (tokenmerge.apply_patch, tokenmerge.apply_todo):
        with pytest.raises(ValueError, match="kernels='triton' cannot run here: the triton package is not installed"):
            apply(model, kernels="triton")
        assert tokenmerge.describe_patch(model) is None  # nothing installed


@needs_triton
def test_describe_patch_says_where_the_kernels_run():
    model, _ = _pixart()
    tokenmerge.apply_patch(model, 0.5, scope="block", kernels="triton")
    text = str(tokenmerge.describe_patch(model))
    assert "kernels=triton" in text.splitlines()[0]
    assert ("this model is not on CUDA" in text) == (next(model.parameters()).device.type != "cuda")
    tokenmerge.apply_patch(model, 0.5)
    assert "kernels" not in str(tokenmerge.describe_patch(model))


class _Broken:
    """A stand-in for a Triton kernel that cannot be built here."""

    def __getitem__(self, grid):
        def launch(*args, **meta):
            raise RuntimeError("PTX .version 9.9 does not support .target sm_00\nmore lines")

        return launch


@pytest.fixture
def broken_triton(monkeypatch):
    """Triton "installed" (a stand-in module whose kernels fail) and its kernels taking CPU tensors: no triton
    needed, so this runs in every test run."""
    import sys
    import types

    fake = types.ModuleType("tokenmerge.merge._triton")
    fake.mean_rows = fake.gather_rows = _Broken()
    monkeypatch.setitem(sys.modules, "tokenmerge.merge._triton", fake)
    import tokenmerge.merge as merge_package

    monkeypatch.setattr(merge_package, "_triton", fake, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "missing", lambda: None)
    monkeypatch.setattr("tokenmerge.engine.planner.missing", lambda: None)
    monkeypatch.setattr(kernels, "_failed", None)
    yield


def test_a_kernel_that_fails_falls_back_to_torch_with_one_warning(broken_triton):
    """A generation never fails halfway: the first failure warns once, that call and every later one run the
    torch operators (the same outputs), and ``failed()`` says why."""
    model, inputs = _pixart()
    with torch.no_grad():
        tokenmerge.apply_patch(model, 0.5, scope="block")
        want = model(**inputs)[0]
        tokenmerge.apply_patch(model, 0.5, scope="block", kernels="triton")
        with pytest.warns(RuntimeWarning, match=r"Triton kernels \(kernels='triton'\) failed \(RuntimeError: PTX "
                                                r"\.version 9\.9 does not support \.target sm_00\); merging goes on"):
            got = model(**inputs)[0]
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = model(**inputs)[0]
    assert torch.equal(got, want) and torch.equal(again, want)
    assert kernels.failed().startswith("RuntimeError: PTX") and "more lines" not in kernels.failed()


def test_the_bench_says_when_the_triton_kernels_did_not_run(broken_triton, tmp_path):
    """A method with kernels=triton whose kernels fell back is not reported as their time."""
    import json
    import warnings

    from tokenmerge.cli import main

    out = tmp_path / "res"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert main(["bench", "--preset", "tiny", "--resolutions", "64", "--methods", "tome:0.5",
                     "tome:0.5,kernels=triton", "--repeats", "1", "--warmup", "0", "--out", str(out),
                     "--no-progress"]) == 0
    records = {r["label"]: r for r in map(json.loads, (out / "bench.jsonl").open())}
    assert records["tokenmerge 0.5"]["status"] == "ok"
    bad = records["tokenmerge 0.5 kernels=triton"]
    assert bad["status"] == "Triton failed" and bad["error"].startswith("RuntimeError: PTX")


# families with a layout of their own (per-sample plans, video grids, text after the image, reference tokens, the
# same tokens passed twice, sequence-first blocks): the whole catalogue agrees as well (146 family x scope cases,
# relative difference at most 1e-6 on 2026-11-26, checked by hand under the interpreter: about two minutes)
LAYOUTS = ["unet-sd", "wan", "hunyuan-video", "qwen-image-edit", "lumina2", "ernie-image", "cogvideox", "ltx"]


@pytest.mark.parity
@needs_triton
@pytest.mark.parametrize("name", LAYOUTS)
def test_families_match_the_torch_kernels(name, monkeypatch):
    import warnings

    from tiny_denoisers import CATALOGUE, available, output_tensor

    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    model = entry.build().to(DEVICE)
    inputs = _to(entry.inputs(batch=2), DEVICE)
    compared, launched = 0, []
    real = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda *a, **k: launched.append(a[0]) or real(*a, **k))
    for scope in ("attention", "block"):
        outs = {}
        for name_ in kernels.KERNELS:
            try:
                tokenmerge.apply_patch(model, 0.5, scope=scope, kernels=name_)
            except ValueError:  # a scope the family does not declare
                break
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # no fallback from a failed kernel
                outs[name_] = output_tensor(model(**inputs), entry).float()
            tokenmerge.remove_patch(model)
        if len(outs) == 2:
            torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-5)
            compared += 1
    assert compared and {"mean_rows", "gather_rows"} <= set(launched)


def test_the_merge_kernels_benchmark_runs_its_torch_half_on_the_cpu(tmp_path):
    """benchmarks/merge_kernels.py (the GPU lane's smoke runs it on CUDA): its table, the torch kernels alone here."""
    import importlib.util as util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "merge_kernels.py"
    spec = util.spec_from_file_location("merge_kernels", path)
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--calls", "1", "--rounds", "1", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "merge-kernels.md").read_text()
    assert table.count("| Flux.1 1024") == 5 and table.count("| Wan 2.1") == 3 and "torch device / host" in table
