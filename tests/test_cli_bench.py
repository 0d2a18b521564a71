"""`tokenmerge bench` end to end on the tiny preset: outputs written, OOM path, argument errors."""

import csv
import json
import subprocess
import sys

import pytest

from tokenmerge.cli import main


def test_bench_tiny_end_to_end(tmp_path, capsys):
    out = tmp_path / "res"
    rc = main(["bench", "--preset", "tiny", "--resolutions", "128", "--batch-sizes", "1", "2", "--ratios", "0.3",
               "0.5", "--attention", "sdpa", "vanilla", "--repeats", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    md = (out / "bench.md").read_text()
    for label in ("vanilla", "tokenmerge 0.3", "tokenmerge 0.5", "tomesd 0.5", "limit 0.5"):
        assert label in md
    assert "### tiny, sdpa attention" in md and "### tiny, vanilla attention" in md
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert len(rows) == 2 * 2 * 7  # attention x batch x (vanilla + 3 modes x 2 ratios)
    assert all(r["status"] == "ok" and float(r["median_s"]) > 0 for r in rows)
    assert {r["torch"] for r in rows} and {r["diffusers"] for r in rows} and {r["tomesd"] for r in rows} == {"0.1.3"}
    vanilla = [r for r in rows if r["mode"] == "vanilla"]
    assert all(float(r["speedup"]) == 1.0 for r in vanilla)
    records = [json.loads(line) for line in (out / "bench.jsonl").open()]
    assert len(records) == len(rows) and records[0]["meta"]["repeats"] == 1
    assert (out / "bench.png").stat().st_size > 1000
    assert "wrote" in capsys.readouterr().out


def test_todo_mode(tmp_path):
    out = tmp_path / "res"
    assert main(["bench", "--preset", "tiny", "--resolutions", "128", "--modes", "vanilla", "todo",
                 "--todo-factors", "2", "4", "--repeats", "1", "--out", str(out), "--no-progress"]) == 0
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [r["label"] for r in rows] == ["vanilla", "todo 2", "todo 4"]
    assert all(r["status"] == "ok" for r in rows)


def test_memory_limit_reports_oom_and_goes_on(tmp_path):
    out = tmp_path / "res"
    # 300 MB of data cannot hold torch + the model: every mode of the cell is OOM, and the run still completes
    rc = main(["bench", "--preset", "tiny", "--resolutions", "64", "--modes", "vanilla", "tokenmerge",
               "--repeats", "1", "--memory-limit", "300MB", "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [r["status"] for r in rows] == ["OOM", "OOM"]
    assert "| 64 | 1 | OOM | OOM |" in (out / "bench.md").read_text()


def test_memory_limit_that_fits_measures_memory(tmp_path):
    out = tmp_path / "res"
    rc = main(["bench", "--preset", "tiny", "--resolutions", "64", "--modes", "vanilla", "--repeats", "1",
               "--memory-limit", "16GB", "--out", str(out), "--no-progress"])
    assert rc == 0
    row = next(csv.DictReader((out / "bench.csv").open()))
    assert row["status"] == "ok" and float(row["peak_mem_mb"]) > 50


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the inherited high-water mark is Linux's")
def test_memory_probe_reports_its_own_peak_not_its_parents():
    """Linux carries ``ru_maxrss`` across fork + exec: a probe started by a parent holding 2 GB more than the
    probe needs would report the parent's figure (the 1024 px rows of an earlier table read 14.7 GB, step 0)."""
    from tokenmerge.bench.cell import Cell
    from tokenmerge.bench.memory import memory_cell, peak_rss_mb, rss_mb
    from tokenmerge.bench.presets import resolve
    from tokenmerge.tools.methods import MethodSpec

    ballast = bytearray(2 * 2**30)  # resident: zero pages are touched
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    parent = rss_mb()
    assert parent > 2048 and peak_rss_mb() >= parent
    probe = memory_cell(resolve("tiny"), Cell("tiny", "sdpa", 64, 1), MethodSpec("vanilla"), "float32", None)
    del ballast
    assert probe["status"] == "ok"
    assert 50 < probe["peak_rss_mb"] < parent - 1024, (probe, parent)
    assert 0 <= probe["step_rss_mb"] < probe["peak_rss_mb"]


@pytest.mark.parametrize("args, words", [
    (["--resolutions", "100"], "multiple of 8"),
    (["--resolutions", "32"], ">= 64"),
    (["--ratios", "0.9"], "(0, 0.75]"),
    (["--batch-sizes", "0"], ">= 1"),
    (["--preset", "sd99"], "invalid choice"),
    (["--modes", "fast"], "invalid choice"),
    (["--memory-limit", "lots"], "512MB"),
    (["--warmup", "-1"], "warmup must be >= 0"),
    (["--warmup", "0", "--compile"], "--warmup 0 with --compile"),
    (["--attention", "xformers"], "xformers"),
    (["--device", "tpu"], "--device"),
    (["--methods", "fast:1"], "method must be one of"),
    (["--methods", "tome:0.5,bogus=1"], "bogus"),
    (["--steps", "-1"], ">= 0"),
])
def test_argument_errors(args, words, capsys):
    with pytest.raises(SystemExit) as err:
        main(["bench", "--preset", "tiny", *args])
    assert err.value.code == 2
    assert words in capsys.readouterr().err


def test_help_and_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "tokenmerge", "bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "RANDOM weights" in out.stdout and "--memory-limit" in out.stdout and "limit:" in out.stdout


def test_model_that_is_not_here_says_how_to_pass_a_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as err:
        main(["bench", "--model", str(tmp_path / "no-such-pipeline"), "--resolutions", "64"])
    assert err.value.code == 2
    text = capsys.readouterr().err
    assert "--model" in text and "model_index.json" in text and "local folder" in text


def test_model_from_a_local_folder(tmp_path):
    """A real pipeline folder (saved from tiny parts) is benchmarked like a preset."""
    from tiny_models import make_sd_pipeline

    folder = tmp_path / "pipe"
    make_sd_pipeline(tmp_path).save_pretrained(folder)
    out = tmp_path / "res"
    rc = main(["bench", "--model", str(folder), "--resolutions", "64", "--modes", "vanilla", "tokenmerge",
               "--repeats", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [r["preset"] for r in rows] == ["pipe", "pipe"] and all(r["status"] == "ok" for r in rows)


def test_methods_whole_generations_and_breakdown(tmp_path):
    out = tmp_path / "res"
    rc = main(["bench", "--preset", "tiny", "--resolutions", "128", "--modes", "vanilla", "tokenmerge", "limit", "todo",
               "todo-limit", "--methods", "tome:0.5,reuse_steps=2", "todo:2,mode=avg", "--steps", "2", "--breakdown",
               "--repeats", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    records = [json.loads(line) for line in (out / "bench.jsonl").open()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["label"] for r in steps] == ["vanilla", "tokenmerge 0.5", "limit 0.5", "todo 2", "todo-limit 2",
                                           "tokenmerge 0.5 reuse_steps=2", "todo 2 mode=avg"]
    assert all(r["status"] == "ok" and r["generate_s"] > 0 and len(r["generate_times_s"]) == 1 for r in steps)
    todo = next(r for r in steps if r["label"] == "todo 2")
    assert todo["gain_kept"] is None or todo["gain_kept"] == pytest.approx(
        (todo["speedup"] - 1) / (next(r for r in steps if r["label"] == "todo-limit 2")["speedup"] - 1))
    parts = {r["spec"]: r["phases_s"] for r in records if r["kind"] == "breakdown"}
    # vanilla and nothing else is left out: it has no patched blocks; "tome:0" is the unmerged reference
    assert set(parts) == {"tome:0", "tome:0.5", "limit:0.5", "todo:2", "todo-limit:2", "tome:0.5,reuse_steps=2",
                          "todo:2,mode=avg"}
    for spec, ph in parts.items():
        assert {"block", "similarity", "merge", "self", "unmerge"} <= set(ph), spec
        inner = sum(v for k, v in ph.items() if k != "block")
        assert 0 < inner <= ph["block"] * 1.001, spec  # the phases happen inside the blocks
    md = (out / "bench.md").read_text()
    assert "whole generation (2 steps + VAE decode)" in md and "Inside the patched blocks" in md
    assert "| unmerged blocks (tome 0) |" in md and "% of blocks |" in md


@pytest.mark.parametrize("kind", ["pixart", "sd3", "flux"])
def test_whole_generation_of_transformer_families(kind):
    """The bench's generation loop (scheduler, guidance, Flux's unpacking, VAE decode) on tiny transformers."""
    import diffusers
    import torch

    from tiny_models import make_flux, make_pixart, make_sd3
    from tokenmerge.bench.cell import Cell
    from tokenmerge.bench.generation import generate, time_generation, vae_for
    from tokenmerge.bench.presets import Preset
    from tokenmerge.tools.methods import MethodSpec

    needs = {"pixart": "PixArtTransformer2DModel", "sd3": "SD3Transformer2DModel", "flux": "FluxTransformer2DModel"}
    if not hasattr(diffusers, needs[kind]):
        pytest.skip(f"diffusers {diffusers.__version__} has no {needs[kind]}")
    model = {"pixart": make_pixart, "sd3": make_sd3, "flux": make_flux}[kind]()
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    text_dim = {"pixart": 16, "sd3": 16, "flux": 32}[kind]
    preset = Preset(f"tiny-{kind}", "test", config, text_tokens=5, family=kind, text_dim=text_dim)
    cell = Cell(preset.name, "sdpa", 64, 1)
    inputs = preset.inputs(1, 64, torch.float32, torch.device("cpu"))
    vae = vae_for(preset, torch.float32, "cpu")
    image = generate(model, vae, preset, inputs, 2)
    assert image.shape == (1, 3, 16, 16) and torch.isfinite(image).all()
    times = time_generation(model, preset, cell, [MethodSpec("vanilla"), MethodSpec("tome", 0.5)], 1, 2,
                           torch.device("cpu"), torch.float32)
    assert all(len(ts) == 1 and ts[0] > 0 for ts in times.values())


@pytest.mark.compile
def test_compiled_modes_side_by_side(tmp_path):
    pytest.importorskip("torch._inductor")
    out = tmp_path / "res"
    rc = main(["bench", "--preset", "tiny", "--resolutions", "64", "--modes", "vanilla", "tokenmerge", "--compile",
               "--repeats", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "bench.jsonl").open()]
    assert [(r["label"], r["compiled"]) for r in rows] == [
        ("vanilla", False), ("tokenmerge 0.5", False), ("vanilla compiled", True), ("tokenmerge 0.5 compiled", True)]
    assert all(r["status"] == "ok" and r["median_s"] > 0 for r in rows)
    assert rows[3]["speedup_vs_compiled"] == pytest.approx(rows[2]["median_s"] / rows[3]["median_s"])
    assert "vs vanilla compiled" in (out / "bench.md").read_text()


def test_table_shows_the_spread_of_paired_rounds_and_step_memory():
    from tokenmerge.bench.report import annotate, markdown

    cell = dict(kind="step", preset="p", attention="sdpa", resolution=512, batch=1, status="ok", ratio=0.5, factor=0,
                compiled=False)
    records = [dict(cell, mode="vanilla", label="vanilla", median_s=11.0, times_s=[10.0, 12.0]),
               dict(cell, mode="tokenmerge", label="tokenmerge 0.5", median_s=6.5, times_s=[5.0, 8.0],
                    peak_mem_mb=3072.0, step_mem_mb=1024.0),
               dict(cell, mode="limit", label="limit 0.5", median_s=6.0, times_s=[6.0])]  # unpaired: no spread
    annotate(records)
    assert records[1]["speedup_runs"] == [2.0, 1.5] and records[2]["speedup_runs"] is None
    meta = dict(device_name="x", device="cpu", threads=2, dtype="float32", torch="t", diffusers="d",
                tokenmerge="m", repeats=2, memory="peak RSS of an isolated one-step process")
    md = markdown(records, meta, "cmd")
    assert "6.5 s (+69% [+50, +100]), 83% of limit, 3.00 GB (1.00 GB step)" in md
    assert "6 s (+83%) |" in md


def test_no_warmup_round_times_every_round(tmp_path, monkeypatch):
    from tokenmerge.bench import steps

    calls = []
    real_timed = steps.timed
    monkeypatch.setattr(steps, "timed", lambda *a: calls.append(1) or real_timed(*a))
    out = tmp_path / "res"
    assert main(["bench", "--preset", "tiny", "--resolutions", "64", "--modes", "vanilla", "tokenmerge",
                 "--repeats", "2", "--warmup", "0", "--out", str(out), "--no-progress"]) == 0
    records = [json.loads(line) for line in (out / "bench.jsonl").open()]
    assert len(calls) == 2 * 2  # modes x rounds: none untimed
    assert [len(r["times_s"]) for r in records] == [2, 2] and records[0]["meta"]["warmup"] == 0
    assert "median of 2 runs after no warm-up round" in (out / "bench.md").read_text()
