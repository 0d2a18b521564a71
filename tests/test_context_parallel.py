"""Merging under diffusers' context parallelism (issues 40, 48): two processes on the CPU (gloo, Ulysses).

The two ranks (tests/cp_worker.py) run each family single-process, then with
``enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))`` in both orders (enable then patch, patch then
enable), for ToMe (attention and ``scope="block"``), ToDo and token reuse (keys fresh and cached, text on Flux.1:
generations of three steps on Wan, Flux.1 and LTX-Video); the tests below read what they recorded. They are
started once per test session (a file lock keeps pytest-xdist workers from starting them twice) and take about
10-15 s on 2 cores. The pure-shape parts (slices of a grid, the random draw of a slice) are tested in this process.

Fidelity of per-slice merging against single-process merging (these tiny models, 2 ranks, batch 2, measured):
- ToDo, and ToMe with every source merged within its own window (``ratio=0.75, match_radius=0``): the slices cut no
  window, so per-slice merging is single-process merging: max |CP - single| <= 4.8e-7 (tolerance 1e-5).
- ToMe at ``ratio=0.5`` (attention / whole-block): each rank merges its own most similar half of its tokens, where
  one process picks them over the whole grid, and no token is matched across the slice edge. |CP - single| over
  |single(seed 1) - single(seed 0)| (how much other random destinations change the output): Wan 0.39 / 0.43,
  LTX-Video 0.32 / 0.30, ChronoEdit 0.37 / 0.35 (slices of whole frames); Flux.1 0.60 / 0.50, Qwen-Image
  0.71 / 0.62, Flux.2 0.58 / 0.54 (slices of whole rows); Wan on 3 frames of 8 x 8 (1.5 frames a rank, merged as
  one tall grid of 12 rows: ``shard_grid``) 0.63 / 0.54. Over |single - vanilla| (the merging's own change):
  0.25-0.45 for the video families on whole frames, 0.53-0.70 for the image ones, 0.63 / 0.56 for the tall grid.
  Without the slice's share of the single-process random draw (``Shard.shift``) the first figures were 0.68-0.83.
  Tolerance: below 1 (per-slice merging changes the output less than a reseed does).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmerge.engine.grids import NoGrid
from tokenmerge.engine.parallel import Split, shard_grid
from tokenmerge.merge import num_windows, random_offsets

HERE = Path(__file__).parent
ALL_FAMILIES = ("wan", "flux", "qwen-image", "flux2", "ltx", "chronoedit", "wan-3-frames")
# the default run's two ranks run Wan (split at its first block) and Flux.1 (split at the denoiser's input); the
# other families, the same checks, are slow (``pytest -m slow``): the ranks then run them all
FAST = ("wan", "flux")
FAMILIES = [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in ALL_FAMILIES]
METHODS = ("tome", "block", "todo")
ORDERS = ("enable_first", "patch_first")
WORLD = 2


# ---- the shapes (this process) --------------------------------------------------------------------------------
@pytest.mark.parametrize("grid, world, local", [
    ((8, 16, 16), 2, (4, 16, 16)),  # whole frames
    ((1, 16, 16), 2, (1, 8, 16)),  # an image in a video model: whole rows
    ((16, 16), 4, (4, 16)),
    ((4, 4), 8, (1, 2)),  # half a row: a sub-grid still
    ((3, 4, 4), 1, (3, 4, 4)),
    ((21, 30, 52), 2, (1, 315, 52)),  # Wan 81 frames: 10.5 latent frames a rank, merged as 315 rows
    ((3, 4, 4), 2, (1, 6, 4)),
])
def test_shard_grid(grid, world, local):
    assert shard_grid(grid, world) == local


@pytest.mark.parametrize("grid, world", [((1, 3, 4), 2), ((5, 5), 2), ((2, 3, 4), 4)])
def test_shard_grid_refuses_slices_of_no_whole_rows(grid, world):
    with pytest.raises(NoGrid):
        shard_grid(grid, world)


@pytest.mark.parametrize("grid, windows, world", [((8, 16, 16), (1, 2, 2), 2), ((16, 12), (2, 2), 4),
                                                   ((4, 8, 8), (2, 2, 2), 2)])
def test_slice_draw_is_the_single_process_draw_of_its_windows(grid, windows, world):
    """``Shard.shift``: a rank's random destinations are those one process draws for the same windows."""
    from tokenmerge.merge.match import _GOLDEN, _MASK32

    local = shard_grid(grid, world)
    full = random_offsets(num_windows(grid, windows), 4, torch.tensor([[12345]]), "cpu")
    n = num_windows(local, windows)
    assert n * world == full.shape[-1]
    for rank in range(world):
        shift = (rank * n * _GOLDEN) & _MASK32
        part = random_offsets(n, 4, torch.tensor([[12345]]) + shift, "cpu")
        assert torch.equal(part, full[:, rank * n:(rank + 1) * n])


def test_hand_over_gives_the_slice_back():
    x = torch.randn(2, 6, 3)
    for rank in range(3):
        split = Split(world=3, rank=rank, ulysses=3, ring=1, block=0, where="blocks.0")
        assert torch.equal(split.local(split.hand_over(x)), x)
        tokens = torch.arange(12).view(1, 12, 1)
        assert torch.equal(split.local(tokens), tokens[:, 4 * rank: 4 * rank + 4])


# ---- two processes --------------------------------------------------------------------------------------------
def _skip_reason() -> str | None:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        return "torch.distributed with gloo is not available"
    try:
        from diffusers import ContextParallelConfig  # noqa: F401
    except ImportError:
        import diffusers

        return f"diffusers {diffusers.__version__} has no context parallelism (ContextParallelConfig)"
    return None


def _launch(out: Path, names) -> None:
    """Start the ranks, wait for them; a failing rank fails the tests with its log."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    init = out / "rendezvous"
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(out / f"rank{r}.log", "w")) for r in range(WORLD)]
        procs = [subprocess.Popen([sys.executable, str(HERE / "cp_worker.py"), str(out), str(r), str(WORLD), str(init),
                                   *names], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(HERE.parent))
                 for r, log in enumerate(logs)]
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=300))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
    if any(codes):
        text = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD))
        pytest.fail(f"context-parallel ranks exited with {codes}:\n{text}")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, request):
    """``{name: (rank 0's record, rank 1's record)}`` of the families and of the edge cases (``"+edges"``)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from tiny_denoisers import available

    everything = "slow" in (request.config.getoption("markexpr") or "").replace("not slow", "")
    names = [n for n in (ALL_FAMILIES if everything else FAST) if available(n.removesuffix("-3-frames")) is None]
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one run for every xdist worker
    out = shared / ("context-parallel-all" if everything else "context-parallel")
    try:
        from filelock import FileLock
    except ImportError:  # pragma: no cover (diffusers' hub client needs filelock)
        FileLock = None
    lock = FileLock(str(out) + ".lock") if FileLock else None
    if lock:
        lock.acquire()
    try:
        if not (out / "done").exists():
            out.mkdir(exist_ok=True)
            _launch(out, names + ["+edges"])
            (out / "done").write_text("ok")
    finally:
        if lock:
            lock.release()
    return {n: tuple(torch.load(out / f"{n}.rank{r}.pt", weights_only=False) for r in range(WORLD))
            for n in names + ["+edges"]}


def _family(ranks, name):
    if name not in ranks:
        pytest.skip(f"{name} is not available on this diffusers")
    return ranks[name]


@pytest.mark.processes
@pytest.mark.parametrize("name", FAMILIES)
def test_vanilla_context_parallel_is_the_single_process_output(ranks, name):
    r0, r1 = _family(ranks, name)
    assert (r0["vanilla_cp"]["out"] - r0["vanilla_sp"]["out"]).abs().max() <= 1e-5
    assert torch.equal(r0["vanilla_cp"]["out"], r1["vanilla_cp"]["out"])


@pytest.mark.processes
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", FAMILIES)
def test_merges_per_slice(ranks, name, method, order):
    """Finite, merged (fewer queries, or keys for ToDo, in every attention call than vanilla CP: as many as one
    process merges to), the same on both ranks, the rotary rows each attention gets matching its tokens."""
    r0, r1 = _family(ranks, name)
    cp, vanilla, single = r0[f"{method}_cp_{order}"], r0["vanilla_cp"], r0[f"{method}_sp"]
    assert torch.isfinite(cp["out"]).all()
    assert torch.equal(cp["out"], r1[f"{method}_cp_{order}"]["out"])
    assert (cp["out"] - vanilla["out"]).abs().max() > 1e-3
    axis = 1 if method == "todo" else 0  # ToDo pools the keys; ToMe merges the queries (and keys)
    merged = [c[axis] for c in cp["sdpa"]]
    whole = [c[axis] for c in vanilla["sdpa"]]
    assert len(merged) == len(whole)
    # Ulysses' attention sees every rank's tokens: per self-attention call, the single process's merged count
    self_attention = [i for i, c in enumerate(vanilla["sdpa"]) if c[1] == c[0]]
    assert self_attention and all(merged[i] < whole[i] for i in self_attention)
    assert [merged[i] for i in self_attention] == [single["sdpa"][i][axis] for i in self_attention]
    assert cp["rotary_ok"] and not cp["warnings"]


@pytest.mark.processes
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", FAMILIES)
def test_removal_gives_vanilla_context_parallel(ranks, name, method, order):
    r0, _ = _family(ranks, name)
    assert torch.equal(r0[f"{method}_removed_{order}"]["out"], r0["vanilla_cp"]["out"])


@pytest.mark.processes
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("method", ["todo", "tome_all", "block_all"])
@pytest.mark.parametrize("name", FAMILIES)
def test_where_slices_cut_no_window_context_parallel_is_single_process(ranks, name, method, order):
    """ToDo's pooling windows and, with every source merged in its own window, ToMe's: per-slice merging is then
    single-process merging (measured max |d| <= 4.8e-7)."""
    r0, _ = _family(ranks, name)
    assert (r0[f"{method}_cp_{order}"]["out"] - r0[f"{method}_sp"]["out"]).abs().max() <= 1e-5
    assert (r0[f"{method}_sp"]["out"] - r0["vanilla_sp"]["out"]).abs().max() > 1e-3  # and it merged


@pytest.mark.processes
@pytest.mark.parametrize("method", ["tome", "block"])
@pytest.mark.parametrize("name", FAMILIES)
def test_per_slice_tome_differs_from_single_process_less_than_a_reseed(ranks, name, method):
    """Per-slice ToMe picks other pairs than one process (its own top half per slice, none across the slice edge):
    measured 0.38-0.71 of the change another seed makes (module docstring); tolerance 1."""
    r0, _ = _family(ranks, name)
    single = r0[f"{method}_sp"]["out"]
    cp = r0[f"{method}_cp_enable_first"]["out"]
    reseeded = r0[f"{method}_sp_seed1"]["out"]
    assert (cp - single).norm() < (reseeded - single).norm()


@pytest.mark.processes
@pytest.mark.parametrize("case, why", [("wan_half_rows", "holds no whole rows"),
                                       ("flux_kontext", "reference tokens"),
                                       ("ltx_condition", "conditioning or reference tokens")])
def test_unmergeable_slices_run_unmerged_with_one_warning(ranks, case, why):
    rec = ranks["+edges"][0][case]
    for key in ("first", "patch_first"):
        assert torch.equal(rec[key]["out"], rec["vanilla"]["out"])
        assert len(rec[key]["warnings"]) == 1 and why in rec[key]["warnings"][0]
    assert rec["second"]["warnings"] == [] and torch.equal(rec["removed"]["out"], rec["vanilla"]["out"])


@pytest.mark.processes
def test_blocks_after_the_split_merge(ranks):
    """Wan splits at blocks.0; patching blocks.1 only merges there (the split comes before it), both orders."""
    rec = ranks["+edges"][0]["wan_block1"]
    for key in ("first", "patch_first"):
        assert not rec[key]["warnings"] and (rec[key]["out"] - rec["vanilla"]["out"]).abs().max() > 1e-3
        assert rec[key]["sdpa"][0] == rec["vanilla"]["sdpa"][0]  # blocks.0: whole
        assert rec[key]["sdpa"][2][0] < rec["vanilla"]["sdpa"][2][0]  # blocks.1's self-attention: merged
    assert torch.equal(rec["removed"]["out"], rec["vanilla"]["out"])


@pytest.mark.processes
def test_refused_at_apply_when_it_cannot_be_right(ranks):
    rec = ranks["+edges"][0]
    assert rec["ring_todo"] is not None and "ring attention" in rec["ring_todo"]
    assert rec["ring_tome"] is None  # ToMe per slice keeps the ring's chunks equal: allowed (not run on a CPU)
    assert rec["split_inside"] is not None and "'blocks.1'" in rec["split_inside"]
    assert rec["split_inside_block1"] is None


REUSE_FAMILIES = [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in ("wan", "flux", "ltx",
                                                                                     "wan-3-frames")]
REUSE_METHODS = ("reuse", "reuse_cached", "reuse_text", "reuse_extrapolate")


def _reuse(ranks, name, method):
    r0, r1 = _family(ranks, name)
    if f"{method}_sp" not in r0:
        pytest.skip(f"{method} is not run on {name}")
    return r0, r1


@pytest.mark.processes
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("method", REUSE_METHODS)
@pytest.mark.parametrize("name", REUSE_FAMILIES)
def test_token_reuse_recomputes_the_same_share_of_each_slice(ranks, name, method, order):
    """Token reuse under Ulysses: its full step is the vanilla context-parallel output; at its partial steps each
    rank recomputes the same share of its own slice (the attention calls see as many queries, or keys and values
    spliced back to every token, as one process: the all-to-all stays balanced), the same on both ranks, finite,
    changed from vanilla, the rotary rows each attention gets matching its tokens, no warning; its fidelity to the
    single-process run is bounded in the next test. Removal gives vanilla back."""
    r0, r1 = _reuse(ranks, name, method)
    cp, single, vanilla = r0[f"{method}_cp_{order}"], r0[f"{method}_sp"], r0["vanilla_steps_cp"]
    assert (cp[0]["out"] - vanilla[0]["out"]).abs().max() <= 1e-5  # the full step
    for step, call in enumerate(cp):
        assert torch.isfinite(call["out"]).all() and torch.equal(call["out"], r1[f"{method}_cp_{order}"][step]["out"])
        assert call["rotary_ok"] and not call["warnings"]
        self_attention = [c for c, v in zip(call["sdpa"], vanilla[step]["sdpa"]) if v[0] == v[1]]
        assert self_attention == [c for c, v in zip(single[step]["sdpa"], r0["vanilla_steps_sp"][step]["sdpa"])
                                  if v[0] == v[1]], step  # Ulysses' calls see every rank's rows: as one process
    for step in range(1, len(cp)):
        assert (cp[step]["out"] - vanilla[step]["out"]).abs().max() > 1e-3  # it reused
    removed = r0[f"{method}_removed_{order}"]
    assert all(torch.equal(a["out"], b["out"]) for a, b in zip(removed, vanilla))


@pytest.mark.processes
@pytest.mark.parametrize("method", REUSE_METHODS)
@pytest.mark.parametrize("name", REUSE_FAMILIES)
def test_token_reuse_per_slice_stays_near_the_single_process_run(ranks, name, method):
    """Each rank walks its own slice's round-robin (and spreads within it), where one process walks the whole
    grid's. Its distance to the single-process run over the single-process run's own change from vanilla (measured,
    partial steps 1 and 2: Wan 0.03 / 0.04, Flux.1 0.04 / 0.03 (text=True too), LTX-Video 0.04-0.05, Wan on 1.5
    frames a rank 0.09 / 0.10; docs/design-parallel.md): tolerance 0.3."""
    r0, _ = _reuse(ranks, name, method)
    for step in range(1, len(r0[f"{method}_sp"])):
        single, cp = r0[f"{method}_sp"][step]["out"], r0[f"{method}_cp_enable_first"][step]["out"]
        vanilla = r0["vanilla_steps_sp"][step]["out"]
        assert (cp - single).norm() < 0.3 * (vanilla - single).norm(), step


@pytest.mark.processes
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", REUSE_FAMILIES)
def test_the_step_cache_under_context_parallelism_is_the_single_process_run(ranks, name, order):
    """computed, skipped, computed: each rank keeps its own slice of the stack's residual and slope, so every call
    (the skipped one too) is the single-process step cache's to float rounding, on both ranks, with no warning; the
    skipped step is not vanilla's; removal gives vanilla back. (Wan's split is at its first block: diffusers' split
    hook wraps the step cache's forward, patch first, or the step cache's wraps it, enable first.)"""
    r0, r1 = _reuse(ranks, name, "stepcache")
    cp, single, vanilla = r0[f"stepcache_cp_{order}"], r0["stepcache_sp"], r0["vanilla_steps_cp"]
    for step, call in enumerate(cp):
        assert (call["out"] - single[step]["out"]).abs().max() <= 1e-5, step
        assert torch.equal(call["out"], r1[f"stepcache_cp_{order}"][step]["out"]) and not call["warnings"]
    assert (cp[1]["out"] - vanilla[1]["out"]).abs().max() > 1e-3  # the skipped step
    assert (cp[0]["out"] - vanilla[0]["out"]).abs().max() <= 1e-5
    assert all(torch.equal(a["out"], b["out"]) for a, b in zip(r0[f"stepcache_removed_{order}"], vanilla))


@pytest.mark.processes
def test_token_reuse_refuses_ring_attention(ranks):
    rec = ranks["+edges"][0]
    assert rec["ring_reuse"] is not None and "ring attention" in rec["ring_reuse"]


# ---- the bench under torchrun -----------------------------------------------------------------------------------
@pytest.mark.parametrize("env, args, words", [
    ({}, [], "torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, [], "at least 2 processes"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["--compile"], "leave out --compile"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["--kernels"], "leave out --kernels"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["--modes", "vanilla", "grid-limit"], "leave out grid-limit"),
])
def test_bench_context_parallel_argument_errors(monkeypatch, capsys, env, args, words):
    from tokenmerge.cli import main

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--context-parallel", "ulysses", "--preset", "tiny-wan", "--resolutions", "64", *args])
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.processes
def test_bench_under_torchrun_on_the_cpu(tmp_path):
    """``torchrun --nproc-per-node 2 -m tokenmerge bench --context-parallel ulysses``: gloo on the CPU, the tiny Wan
    preset (2 latent frames: a frame per rank), vanilla, ToMe and ToDo timed; rank 0 writes the tables."""
    import json

    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(HERE.parent / "src") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "tokenmerge",
           "bench", "--context-parallel", "ulysses", "--preset", "tiny-wan", "--resolutions", "64", "--frames", "5",
           "--repeats", "1", "--device", "cpu", "--modes", "vanilla", "tokenmerge", "todo", "--no-progress",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path), check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ran unmerged" not in done.stdout + done.stderr  # the patch's one warning when a call cannot merge
    records = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in records] == ["vanilla", "tokenmerge", "todo"]
    assert all(r["status"] == "ok" and r["median_s"] > 0 and r["grid"] == "2x4x4" for r in records)
    assert records[0]["meta"]["context_parallel"] == {"kind": "ulysses", "ranks": 2}
    assert "Context parallelism: ulysses over 2 ranks" in (tmp_path / "bench.md").read_text()
