"""`tokenmerge bench` end to end on the tiny presets (the UNet, and tiny versions of the video and 2025-2026
image transformers): outputs written, every mode and the breakdown, OOM path, argument errors."""

import csv
import json
import math
import re
import subprocess
import sys

import pytest
import torch

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


@pytest.mark.slow
@pytest.mark.processes
def test_memory_limit_reports_oom_and_goes_on(tmp_path):
    out = tmp_path / "res"
    # 100 MB of data cannot hold torch + the model (300 MB could, on one thread with old diffusers): every mode
    # of the cell is OOM, and the run still completes
    rc = main(["bench", "--preset", "tiny", "--resolutions", "64", "--modes", "vanilla", "tokenmerge",
               "--repeats", "1", "--memory-limit", "100MB", "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [r["status"] for r in rows] == ["OOM", "OOM"]
    assert "| 64 | 1 | OOM | OOM |" in (out / "bench.md").read_text()


@pytest.mark.parametrize("message", ["libgomp: Thread creation failed: Resource temporarily unavailable\n",
                                     "RuntimeError: could not create a primitive\n"])
@pytest.mark.parametrize("limit_mb, status", [(100, "OOM"), (None, "error")])
def test_memory_probe_that_could_not_start_threads_under_the_limit_is_oom(monkeypatch, limit_mb, status, message):
    """libgomp exits when it cannot map a thread's stack under RLIMIT_DATA (seen with a 100 MB limit), oneDNN
    fails to create a convolution's primitive (the same limit, one OpenMP thread): out of memory under a limit, a
    failure without one."""
    import subprocess

    from tokenmerge.bench import memory
    from tokenmerge.bench.cell import Cell
    from tokenmerge.bench.presets import resolve
    from tokenmerge.tools.methods import MethodSpec

    died = subprocess.CompletedProcess([], 1, "", message)
    monkeypatch.setattr(memory.subprocess, "run", lambda *a, **k: died)
    cell = Cell("tiny", "sdpa", 64, 1)
    if status == "OOM":
        assert memory.memory_cell(resolve("tiny"), cell, MethodSpec("vanilla"), "float32", limit_mb)["status"] == "OOM"
    else:
        with pytest.raises(RuntimeError, match="(?s)memory probe failed.*" + re.escape(message.strip())):
            memory.memory_cell(resolve("tiny"), cell, MethodSpec("vanilla"), "float32", limit_mb)


@pytest.mark.slow
@pytest.mark.processes
def test_memory_limit_that_fits_measures_memory(tmp_path):
    out = tmp_path / "res"
    rc = main(["bench", "--preset", "tiny", "--resolutions", "64", "--modes", "vanilla", "--repeats", "1",
               "--memory-limit", "16GB", "--out", str(out), "--no-progress"])
    assert rc == 0
    row = next(csv.DictReader((out / "bench.csv").open()))
    assert row["status"] == "ok" and float(row["peak_mem_mb"]) > 50


@pytest.mark.slow
@pytest.mark.processes
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


@pytest.mark.processes
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
               "todo-limit", "--methods", "tome:0.5,plan_steps=2", "todo:2,mode=avg", "--steps", "2", "--breakdown",
               "--repeats", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    records = [json.loads(line) for line in (out / "bench.jsonl").open()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["label"] for r in steps] == ["vanilla", "tokenmerge 0.5", "limit 0.5", "todo 2", "todo-limit 2",
                                           "tokenmerge 0.5 plan_steps=2", "todo 2 mode=avg"]
    assert all(r["status"] == "ok" and r["generate_s"] > 0 and len(r["generate_times_s"]) == 1 for r in steps)
    todo = next(r for r in steps if r["label"] == "todo 2")
    assert todo["gain_kept"] is None or todo["gain_kept"] == pytest.approx(
        (todo["speedup"] - 1) / (next(r for r in steps if r["label"] == "todo-limit 2")["speedup"] - 1))
    parts = {r["spec"]: r["phases_s"] for r in records if r["kind"] == "breakdown"}
    # vanilla and nothing else is left out: it has no patched blocks; "tome:0" is the unmerged reference
    assert set(parts) == {"tome:0", "tome:0.5", "limit:0.5", "todo:2", "todo-limit:2", "tome:0.5,plan_steps=2",
                          "todo:2,mode=avg"}
    for spec, ph in parts.items():
        merges = spec.startswith(("tome:0.5", "limit"))  # (no query merging makes no plan: no similarity phase)
        assert {"block", "merge", "self", "unmerge"} | ({"similarity"} if merges else set()) <= set(ph), spec
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
    from tokenmerge.bench.generation import Loop, generate, scheduler_for, time_generation, vae_for
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
    image = generate(Loop(model, scheduler_for(preset, inputs), preset), vae, preset, inputs, 2)
    assert image.shape == (1, 3, 16, 16) and torch.isfinite(image).all()
    times, ran = time_generation(model, preset, cell, [MethodSpec("vanilla"), MethodSpec("tome", 0.5)], 1, 2,
                                 torch.device("cpu"), torch.float32)
    assert all(len(ts) == 1 and ts[0] > 0 for ts in times.values())
    assert ran == {}  # neither counts steps


@pytest.mark.compile
@pytest.mark.slow  # inductor on the bench path: about a minute
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


# ---- video and 2025-2026 image transformer presets (tiny versions: seconds) ------------------------------------
VIDEO_PRESETS = {"tiny-wan": "64x96", "tiny-hunyuan-video": "64x96", "tiny-ltx": "128x160"}
IMAGE_PRESETS = {"tiny-flux2": "128", "tiny-qwen-image": "128", "tiny-sana": "128", "tiny-z-image": "128"}


def _records(out):
    return [json.loads(line) for line in (out / "bench.jsonl").open()]


def _skip_without_class(preset):
    """These presets' classes came with later diffusers than the oldest we test (0.27.2)."""
    import diffusers

    from tokenmerge.bench.presets import _CLASSES, PRESETS

    name = _CLASSES[PRESETS[preset].family]
    if not hasattr(diffusers, name):
        pytest.skip(f"diffusers {diffusers.__version__} has no {name}")


@pytest.mark.parametrize("preset", sorted(VIDEO_PRESETS))
def test_video_presets_run_every_mode_with_breakdown(preset, tmp_path, fast_cpu):
    _skip_without_class(preset)
    out = tmp_path / "res"
    rc = main(["bench", "--preset", preset, "--resolutions", VIDEO_PRESETS[preset], "--frames", "9", "17",
               "--modes", "vanilla", "tokenmerge", "limit", "todo", "todo-limit", "--todo-factors", "2", "2x2x2",
               "--methods", "tome:0.5,st=2", "todo:1x2x2,mode=avg", "--breakdown", "--repeats", "1", "--warmup", "0",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    records = _records(out)
    steps = [r for r in records if r["kind"] == "step"]
    labels = ["vanilla", "tokenmerge 0.5", "limit 0.5", "todo 2", "todo 2x2x2", "todo-limit 2", "todo-limit 2x2x2",
              "tokenmerge 0.5 st=2", "todo 1x2x2 mode=avg"]
    assert [r["label"] for r in steps] == labels * 2  # two cells: 9 and 17 frames
    assert all(r["status"] == "ok" and r["median_s"] > 0 for r in steps)
    per_latent = 8 if preset == "tiny-ltx" else 4
    assert sorted({(r["frames"], int(r["grid"].split("x")[0])) for r in steps}) == \
        [(9, 8 // per_latent + 1), (17, 16 // per_latent + 1)]
    assert all(r["tokens"] == math.prod(int(n) for n in r["grid"].split("x")) for r in steps)
    by_label = {r["label"]: r for r in steps if r["frames"] == 9}
    assert by_label["todo 2x2x2"]["reference"] == "todo-limit 2x2x2" and by_label["todo 2x2x2"]["factor"] == "2x2x2"
    assert by_label["tokenmerge 0.5 st=2"]["reference"] == "limit 0.5"
    parts = {(r["frames"], r["spec"]): r["phases_s"] for r in records if r["kind"] == "breakdown"}
    assert {spec for _, spec in parts} == {"tome:0", "tome:0.5", "limit:0.5", "todo:2", "todo:2x2x2", "todo-limit:2",
                                           "todo-limit:2x2x2", "tome:0.5,st=2", "todo:1x2x2,mode=avg"}
    for (_, spec), ph in parts.items():
        assert ph["block"] > 0, spec
        assert sum(v for k, v in ph.items() if k != "block") <= ph["block"] * 1.001, spec
        if spec.startswith("todo"):  # pooled inside the attention call: timed as merge, not as attention
            assert ph["merge"] > 0, spec
        elif spec != "tome:0":
            assert {"similarity", "merge", "unmerge"} <= set(ph), spec
    md = (out / "bench.md").read_text()
    assert "| resolution | batch | frames | tokens per call |" in md
    assert "Step: " in md and "Inside the patched blocks" in md and ", 9 frames, batch 1" in md
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert len(rows) == len(records) and {r["frames"] for r in rows} == {"9", "17"}
    assert (out / "bench.png").stat().st_size > 1000


@pytest.mark.parametrize("preset", sorted(IMAGE_PRESETS))
def test_image_presets_run_every_mode_with_breakdown(preset, tmp_path, fast_cpu):
    _skip_without_class(preset)
    out = tmp_path / "res"
    rc = main(["bench", "--preset", preset, "--resolutions", IMAGE_PRESETS[preset], "--modes", "vanilla", "tokenmerge",
               "limit", "todo", "todo-limit", "--breakdown", "--repeats", "1", "--warmup", "0", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    records = _records(out)
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["label"] for r in steps] == ["vanilla", "tokenmerge 0.5", "limit 0.5", "todo 2", "todo-limit 2"]
    assert all(r["status"] == "ok" and r["frames"] is None for r in steps)
    parts = {r["spec"]: r["phases_s"] for r in records if r["kind"] == "breakdown"}
    assert set(parts) == {"tome:0", "tome:0.5", "limit:0.5", "todo:2", "todo-limit:2"}
    assert parts["tome:0.5"]["similarity"] > 0 and parts["todo:2"]["merge"] > 0
    md = (out / "bench.md").read_text()
    assert "| resolution | batch | tokens per call |" in md and ("(8 x 8)" in md or "(4 x 4)" in md)


def test_video_preset_guidance_calls_and_inputs_as_the_pipelines_make_them():
    """Without building the models: the real presets' step inputs at the issue's size."""
    import torch

    from tokenmerge.bench.presets import ALIASES, PRESETS, resolve

    cpu = torch.device("cpu")
    wan = resolve("wan")
    assert wan is PRESETS["wan-2b"] and ALIASES["wan"] == "wan-2b"
    assert wan.unet["num_attention_heads"] * wan.unet["attention_head_dim"] == 1536 and wan.unet["ffn_dim"] == 8960
    assert wan.unet["num_layers"] == 2 and "2 of its 30 blocks (REDUCED)" in wan.description
    assert wan.grid("480x832", 33) == (9, 30, 52) and math.prod(wan.grid("480x832", 33)) == 14040
    calls = wan.inputs(1, "480x832", torch.float32, cpu, frames=33)
    assert len(calls) == 2  # conditional, then unconditional: WanPipeline's two calls
    assert [tuple(c["encoder_hidden_states"].shape) for c in calls] == [(1, 512, 4096)] * 2
    assert tuple(calls[0]["hidden_states"].shape) == (1, 16, 9, 60, 104)
    ltx = resolve("ltx")
    assert ltx.grid("480x832", 33) == (5, 15, 26)
    one = ltx.inputs(1, "480x832", torch.float32, cpu, frames=33)
    assert tuple(one["hidden_states"].shape) == (2, 5 * 15 * 26, 128) and one["num_frames"] == 5  # batch doubled
    assert int(one["encoder_attention_mask"][0].sum()) == 64
    hunyuan = resolve("hunyuan-video")
    assert hunyuan.grid("480x832", 33) == (9, 30, 52)
    assert hunyuan.inputs(1, 512, torch.float32, cpu)["hidden_states"].shape[0] == 1  # guidance-distilled
    for name, tokens in [("flux2", 4096), ("qwen-image", 4096), ("sana", 1024)]:
        preset = resolve(name)
        assert "REDUCED" in preset.description and math.prod(preset.grid(1024)) == tokens, name
    qwen = resolve("qwen-image").inputs(1, 1024, torch.float32, cpu)
    assert [c["encoder_hidden_states"].shape[1] for c in qwen] == [128, 6]  # prompt, then the negative prompt
    with pytest.raises(ValueError, match="image preset"):
        resolve("sana").inputs(1, 1024, torch.float32, cpu, frames=9)


@pytest.mark.parametrize("args, words", [
    (["--preset", "tiny-wan", "--frames", "10"], "4k+1"),
    (["--preset", "tiny-hunyuan-video", "--frames", "31"], "4k+1"),
    (["--preset", "tiny-ltx", "--frames", "13"], "8k+1"),
    (["--preset", "tiny-flux2", "--frames", "9"], "video presets only"),
    (["--preset", "tiny-wan", "tiny-sana", "--frames", "9"], "tiny-sana is an image preset"),
    (["--preset", "tiny-wan", "--frames", "0"], "frames must be >= 1"),
    (["--preset", "tiny-wan", "--frames", "x"], "invalid _frames value"),
    (["--preset", "tiny-wan", "--resolutions", "72"], "multiples of 16"),
    (["--preset", "tiny-ltx", "--resolutions", "480x848"], "multiples of 32"),
    (["--preset", "tiny", "--resolutions", "64x96"], "square"),
    (["--preset", "tiny", "--resolutions", "480xx"], "height x width"),
    (["--preset", "tiny-wan", "--attention", "vanilla"], "own attention processors"),
    (["--preset", "tiny-flux2", "--methods", "tome:0.5,st=2"], "applies to video presets"),
    (["--preset", "tiny-flux2", "--modes", "todo", "--todo-factors", "2x2x2"], "3 factors"),
    (["--preset", "tiny-wan", "--modes", "todo", "--todo-factors", "2x2"], "2 factors"),
    (["--preset", "tiny-wan", "--todo-factors", "2x"], "one per axis"),
    (["--preset", "tiny-hunyuan-video", "--steps", "2"], "--steps"),
])
def test_video_and_image_preset_argument_errors(args, words, capsys, tmp_path):
    with pytest.raises(SystemExit) as err:
        main(["bench", *args, "--out", str(tmp_path / "res")])
    assert err.value.code == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "res").exists()


def test_refusals_that_no_longer_hold_are_gone(tmp_path, monkeypatch):
    """limit on Flux and ToDo on joint attention run now (they used to be refused before any work)."""
    from tokenmerge.bench import runner

    seen = []
    monkeypatch.setattr(runner, "run_grid", lambda *a, **k: seen.append(a) or ([], dict(runner.versions(
        __import__("torch").device("cpu")), dtype="float32", repeats=1, memory="not measured")))
    for preset in ("flux-2+4", "sd3", "tiny-flux2"):
        assert main(["bench", "--preset", preset, "--modes", "vanilla", "limit", "todo", "todo-limit",
                     "--out", str(tmp_path / preset), "--no-progress"]) == 0
    assert len(seen) == 3


def test_factor_per_axis_specs():
    from tokenmerge.tools.methods import MethodSpec, parse_spec

    assert parse_spec("todo:2x2x2").value == (2, 2, 2) and parse_spec("todo:1x2x2").label == "todo 1x2x2"
    assert parse_spec("todo,downsample=(2,2,2),mode=avg") == MethodSpec("todo", (2, 2, 2), (("mode", "avg"),))
    assert parse_spec("todo-limit:2x2x2", bench=True).text == "todo-limit:2x2x2"
    assert parse_spec("tome:0.5,st=2").limit == MethodSpec("limit", 0.5)
    assert parse_spec("todo:2x2x2,mode=avg").limit == MethodSpec("todo-limit", (2, 2, 2))
    # where tokens are merged is carried: the limit of a whole-block merge runs whole blocks on merged tokens
    assert parse_spec("tome:0.5,scope=block,st=2").limit == parse_spec("limit:0.5,scope=block", bench=True)
    assert parse_spec("tome:0.5,scope=block").limit.label == "limit 0.5 scope=block"
    for spec in ("todo:2x2x2", "todo:1x2x2,mode=avg", "tome:0.5,st=2"):
        assert parse_spec(parse_spec(spec).text) == parse_spec(spec)
    for bad, words in [("todo:2x2x2x2", "factor per axis"), ("tome:2x2", "must be a number"),
                       ("todo:2,downsample=(2,2,2)", "given twice"), ("todo:0x2x2", "downsample"),
                       ("todo,downsample=yes", "downsample must be")]:
        with pytest.raises(ValueError, match=words):
            parse_spec(bad, bench=True)


def test_slice_plan_shares_one_pattern_and_keeps_positions():
    """The limit on families with one merge pattern per batch (rotary positions): one pattern for any batch size,
    and the positions of the tokens it keeps."""
    import torch

    from tokenmerge.tools.limits import SlicePlan, slice_match

    plan = slice_match(torch.zeros(1, 24, 4), (2, 3, 4), (1, 2, 2), 12)
    assert isinstance(plan, SlicePlan) and plan.num_slots == 12 and plan.batch == 1
    assert plan.representatives().tolist() == [list(range(12))]
    x = torch.randn(3, 24, 5)
    assert torch.equal(plan.merge(x), x[:, :12]) and plan.unmerge(plan.merge(x)).shape == x.shape


def test_phase_timer_times_nested_phases_exclusively(monkeypatch):
    from tokenmerge.bench import breakdown

    clock = iter(range(100))
    monkeypatch.setattr(breakdown.time, "perf_counter", lambda: float(next(clock)))
    timer = breakdown.PhaseTimer("cpu")
    timer.begin("block")      # 0
    timer.begin("self")       # 1
    timer.begin("merge")      # 2: self paused (1 s)
    timer.end("merge")        # 3: merge 1 s, self resumes
    timer.end("self")         # 4: self 1 + 1 s
    timer.begin("merge")      # 5
    timer.begin("merge")      # 6: nested merge in merge (a UNet's pooling inside the merge hook)
    timer.end("merge")        # 7
    timer.end("merge")        # 8
    timer.end("unmerge")      # 9: never begun: ignored
    timer.end("block")        # 10
    assert timer.totals() == {"self": 2.0, "merge": 4.0, "block": 10.0}


def test_z_image_preset_inputs_as_the_pipeline_makes_them():
    """Without building the model: one call, per-sample lists, the prompt's and the negative prompt's lengths."""
    import torch

    from tokenmerge.bench.presets import resolve

    z = resolve("z-image")
    assert z.name == "z-image-1+1" and z.unet["dim"] == 3840 and z.unet["n_layers"] == 1
    call = z.inputs(1, 1024, torch.float32, torch.device("cpu"))
    assert [tuple(x.shape) for x in call["x"]] == [(16, 1, 128, 128)] * 2
    assert [c.shape for c in call["cap_feats"]] == [(64, 2560), (6, 2560)]
    assert torch.equal(call["t"], torch.full((2,), 0.5))
    assert z.grid(1024) == (64, 64)


# ---- full-size presets (the GPU's): configs checked on the meta device, inputs without building ------------------
# published parameter counts (billions): a wrong width or block count moves them by far more than the tolerance
FULL_SIZE = {"sd15": 0.86, "sd21": 0.866, "sdxl": 2.567, "sd3": 2.03, "pixart-alpha-1024": 0.611,
             "pixart-sigma-1024": 0.611, "flux1-dev": 11.9, "wan2.1-1.3b": 1.42, "wan2.1-14b": 14.29,
             "hunyuan-video-13b": 12.8, "ltx-video-2b": 1.92, "cogvideox-5b": 5.57, "qwen-image-20b": 20.4,
             "sana-1600m": 1.60, "z-image-6b": 6.15, "flux2-dev": 32.2}


@pytest.mark.parametrize("name, billions", sorted(FULL_SIZE.items()))
def test_full_size_presets_have_the_published_parameter_counts(name, billions):
    """Built on the meta device (no memory), in bfloat16 as on a GPU: every parameter in that dtype, but those
    of the modules the class keeps in float32 (as from_pretrained(torch_dtype=torch.bfloat16) loads them)."""
    import torch

    from tokenmerge.bench.presets import PRESETS, resolve

    _skip_without_class(name)
    preset = resolve(name)
    assert preset.full_size or name in ("sd15", "sd21", "sdxl", "sd3")
    model = preset.build(torch.bfloat16, "meta")
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    params = list(model.parameters())
    for param_name, p in model.named_parameters():
        kept = any(k in param_name.split(".") for k in keep)
        assert p.dtype == (torch.float32 if kept else torch.bfloat16), param_name
    assert {p.device.type for p in params} == {"meta"}
    assert sum(p.numel() for p in params) / 1e9 == pytest.approx(billions, rel=0.02), name
    assert torch.get_default_dtype() == torch.float32  # restored after the build
    if preset.full_size:
        assert "full size, random weights" in preset.description and preset.sizes
        assert all(preset.check_resolution(size) is None for size in preset.sizes)
        assert "REDUCED" not in preset.description
    assert PRESETS[preset.name] is preset


def test_full_size_inputs_as_the_pipelines_make_them():
    """The step inputs of the full-size presets at their usual sizes, without building the models."""
    import torch

    from tokenmerge.bench.presets import resolve

    cpu = torch.device("cpu")
    wan = resolve("wan2.1-14b")
    assert wan.default_frames == 81 and wan.grid("480x832", 81) == (21, 30, 52)
    assert wan.grid("720x1280", 81) == (21, 45, 80)
    pixart = resolve("pixart-alpha-1024").inputs(1, 1024, torch.float16, cpu)
    assert pixart["added_cond_kwargs"]["resolution"].tolist() == [[1024.0, 1024.0]] * 2  # the batch doubled
    assert pixart["added_cond_kwargs"]["aspect_ratio"].dtype == torch.float16
    assert resolve("pixart-sigma-1024").inputs(1, 1024, torch.float16, cpu)["added_cond_kwargs"]["resolution"] is None
    flux = resolve("flux1-dev").inputs(1, 1024, torch.bfloat16, cpu)
    assert tuple(flux["hidden_states"].shape) == (1, 4096, 64) and tuple(flux["img_ids"].shape) == (4096, 3)
    cog = resolve("cogvideox-5b")
    if _has_class("CogVideoXTransformer3DModel"):
        call = cog.inputs(1, "480x720", torch.bfloat16, cpu, frames=49)
        assert tuple(call["hidden_states"].shape) == (2, 13, 16, 60, 90)  # frames before channels, CFG doubled
        assert tuple(call["image_rotary_emb"][0].shape) == (13 * 30 * 45, 64)
        assert tuple(call["encoder_hidden_states"].shape) == (2, 226, 4096)
    assert resolve("hunyuan-video-13b").grid("720x1280", 61) == (16, 45, 80)
    assert resolve("ltx-video-2b").grid("480x704", 161) == (21, 15, 22)


def _has_class(name: str) -> bool:
    import diffusers

    return hasattr(diffusers, name)


def test_merged_resolution_is_the_grid_limit_of_whole_block_merging():
    """grid-limit: the same model at the merged token count (rows x (1 - ratio), the width kept)."""
    from tokenmerge.bench.presets import resolve

    flux = resolve("flux1-dev")
    assert flux.merged_resolution(1024, 0.5) == "512x1024" and flux.grid("512x1024") == (32, 64)  # 2,048 tokens
    assert resolve("wan2.1-14b").merged_resolution("480x832", 0.5, 81) == "240x832"
    assert resolve("hunyuan-video-13b").merged_resolution("720x1280", 0.5, 61) == "352x1280"  # 22 of 45 rows
    assert resolve("pixart-alpha-1024").merged_resolution(1024, 0.25) == "768x1024"
    with pytest.raises(ValueError, match="UNet"):
        resolve("sd15").merged_resolution(512, 0.5)


# ---- the GPU columns: kernels per call, host time, compiled modes, grid-limit, --gpu, --summarize ----------------
def test_kernels_per_call_and_the_grid_limit(tmp_path, fast_cpu):
    """--kernels counts each mode's operators per denoiser call (two calls per step for Wan: per call); grid-limit
    runs the unpatched model on the merged token count and is the reference of whole-block merging."""
    _skip_without_class("tiny-wan")
    out = tmp_path / "res"
    assert main(["bench", "--preset", "tiny-wan", "--resolutions", "64x96", "--frames", "9", "--modes", "vanilla",
                 "tokenmerge", "limit", "grid-limit", "--methods", "tome:0.5,scope=block", "--kernels", "--repeats",
                 "1", "--warmup", "0", "--out", str(out), "--no-progress"]) == 0
    steps = {r["label"]: r for r in _records(out) if r["kind"] == "step"}
    vanilla, tome, grid = steps["vanilla"], steps["tokenmerge 0.5"], steps["grid-limit 0.5"]
    assert vanilla["kernels_per_call"] > 10 and vanilla["syncs_per_call"] is not None
    assert tome["kernels_per_call"] > vanilla["kernels_per_call"]  # the merge's own operators
    assert tome["kernels_vs_vanilla"] == pytest.approx(tome["kernels_per_call"] / vanilla["kernels_per_call"])
    assert grid["kernels_per_call"] == vanilla["kernels_per_call"]  # no hooks at all: the same operators
    assert (grid["tokens"], grid["limit_tokens"], grid["limit_grid"]) == (72, 36, "3x2x6")
    assert steps["tokenmerge 0.5 scope=block"]["limit_label"] == "grid-limit 0.5"  # not the hooks' limit
    assert tome["limit_label"] == "limit 0.5" and vanilla["launch_bound"] is None  # CPU: no launch-bound flag
    md = (out / "bench.md").read_text()
    assert "kernels per denoiser call and host time" in md and "kernels/call (" in md


def test_grid_limit_is_refused_for_unets(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--preset", "tiny", "--modes", "vanilla", "grid-limit", "--out", str(tmp_path / "r")])
    assert "grid-limit runs a transformer" in capsys.readouterr().err


def test_each_compiled_mode_is_compiled_by_itself(tmp_path, monkeypatch, fast_cpu):
    """Without inductor's minutes: torch.compile stubbed (it records its calls and returns the model). Every mode
    is compiled after a reset, fullgraph first, in each compile mode, and compared with compiled vanilla of the
    same compile mode; --compiled-only leaves the eager rounds out."""
    import torch

    from tokenmerge.bench import steps

    compiled, resets = [], []
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, fullgraph=False: compiled.append(
        (mode, fullgraph)) or model)
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1))
    out = tmp_path / "res"
    assert main(["bench", "--preset", "tiny", "--resolutions", "64", "--modes", "vanilla", "tokenmerge",
                 "--compile", "default", "reduce-overhead", "--compiled-only", "--kernels", "--repeats", "2",
                 "--out", str(out), "--no-progress"]) == 0
    records = [r for r in _records(out) if r["kind"] == "step"]
    assert [(r["label"], r["compile_mode"]) for r in records] == [
        ("vanilla compiled", "default"), ("tokenmerge 0.5 compiled", "default"),
        ("vanilla compiled reduce-overhead", "reduce-overhead"),
        ("tokenmerge 0.5 compiled reduce-overhead", "reduce-overhead")]
    assert compiled == [(None, True), (None, True), ("reduce-overhead", True), ("reduce-overhead", True)]
    assert len(resets) >= 2 * len(records)  # before and after each compiled mode
    assert all(r["status"] == "ok" and r["runs"] == 2 and r["fullgraph"] is True for r in records)
    assert records[1]["speedup_vs_compiled"] == pytest.approx(records[0]["median_s"] / records[1]["median_s"])
    assert records[3]["speedup_vs_compiled"] == pytest.approx(records[2]["median_s"] / records[3]["median_s"])
    # the "compiled" model is the patched one here: its output is the eager patched output
    assert records[1]["compiled_vs_eager"] == 0.0
    assert "vs vanilla compiled reduce-overhead" in (out / "bench.md").read_text()
    assert steps.compile_suffix("default") == " compiled"


def test_compiled_only_needs_compile(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--preset", "tiny", "--compiled-only", "--out", str(tmp_path / "r")])
    assert "--compiled-only needs --compile" in capsys.readouterr().err


def _tiny_rows(monkeypatch):
    from tokenmerge.bench import gpu

    rows = {"tiny-unet": gpu.Row("tiny", 64, None, "float32", ("vanilla", "tome:0.5", "tome:0.5,scope=block",
                                                                "todo:2", "limit:0.5", "limit:0.5,scope=block",
                                                                "todo-limit:2"), repeats=1, full_size=False),
            "tiny-wan": gpu.Row("tiny-wan", "64x96", 9, "float32", ("vanilla", "tome:0.5", "tome:0.5,scope=block",
                                                                   "todo:2x2x2", "grid-limit:0.5",
                                                                   "todo-limit:2x2x2"), repeats=1, full_size=False)}
    monkeypatch.setattr(gpu, "ROWS", rows)
    return rows


def test_gpu_table_rows_and_summary(tmp_path, monkeypatch, capsys, fast_cpu):
    """--gpu runs each row (its own preset, size, frames, dtype, methods) with kernels; its table has one row per
    cell and a column per method, in four figures; --summarize rebuilds the table from the JSONL."""
    _skip_without_class("tiny-wan")
    _tiny_rows(monkeypatch)
    out = tmp_path / "res"
    assert main(["bench", "--gpu", "tiny-unet", "tiny-wan", "--device", "cpu", "--warmup", "0", "--out", str(out),
                 "--stem", "gpu", "--no-progress"]) == 0
    printed = capsys.readouterr().out  # each record is printed as it is made (a run cut short keeps its log)
    assert "  done: tokenmerge 0.5 scope=block: " in printed
    assert printed.index("  done: ") < printed.index("## GPU table")
    md = (out / "gpu.md").read_text()
    assert md.startswith("## GPU table") and "## Every cell" in md
    for heading in ("speed-up over vanilla", "kernels launched per denoiser call", "host time to issue"):
        assert heading in md
    assert "peak memory (GB" not in md  # the CUDA allocator's: none on a CPU
    assert "| tiny 64 (float32) |" in md and "| tiny-wan 64x96 x 9 (float32) |" in md
    assert "| whole-block 0.5 |" in md and "| ToDo 2x2x2 |" in md
    assert "of grid-limit 0.5)" in md  # whole-block merging of the transformer row is measured against it
    records = [r for r in _records_of(out / "gpu.jsonl") if r["kind"] == "step"]
    assert {r["gpu_row"] for r in records} == {"tiny-unet", "tiny-wan"}
    assert all(r["kernels_per_call"] for r in records if r["status"] == "ok")
    # --methods replaces each row's own (vanilla always runs)
    assert main(["bench", "--gpu", "tiny-wan", "--methods", "grid-limit:0.5", "--device", "cpu", "--warmup", "0",
                 "--out", str(out), "--stem", "few", "--no-progress"]) == 0
    assert [r["label"] for r in _records_of(out / "few.jsonl")] == ["vanilla", "grid-limit 0.5"]
    capsys.readouterr()
    summary = tmp_path / "sum"
    assert main(["bench", "--summarize", str(out / "gpu.jsonl"), "--out", str(summary), "--stem", "table"]) == 0
    text = (summary / "table.md").read_text()
    assert "| tiny-wan 64x96 x 9 (float32) |" in text and "Command: `tokenmerge bench" in text


def test_gpu_rows_time_whole_generations_of_accelerate(tmp_path, monkeypatch, capsys, fast_cpu):
    """--gpu ROW --steps N (the GPU lane's gen15): each method's whole generations beside its steps; accelerate's
    speeds and the step cache's computed and skipped steps, and how many steps each generation computed."""
    _skip_without_class("tiny-wan")
    _tiny_rows(monkeypatch)
    out = tmp_path / "res"
    assert main(["bench", "--gpu", "tiny-wan", "--methods", "auto,speed=fast", "stepcache:1", "--steps", "10",
                 "--device", "cpu", "--warmup", "0", "--repeats", "1", "--out", str(out), "--stem", "gen",
                 "--no-progress"]) == 0
    records = {r["label"]: r for r in _records_of(out / "gen.jsonl") if r["kind"] == "step"}
    assert set(records) == {"vanilla", "auto speed=fast", "stepcache 1"}
    assert all(r["generate_s"] for r in records.values())
    assert records["stepcache 1"]["step_timed"] == "skipped" and records["stepcache 1"]["full_median_s"]
    # rounds of 1 after a warm-up of 3: 1110101010, told by the loop's scheduler
    assert records["stepcache 1"]["generate_ran"] == {"steps": 10, "computed": 0.6}
    assert "generate_ran" not in records["vanilla"]
    assert "6 of 10 steps computed" in (out / "gen.md").read_text()
    capsys.readouterr()


def _records_of(path):
    return [json.loads(line) for line in path.open()]


@pytest.mark.parametrize("args, words", [
    (["--gpu", "sd15-512", "--device", "cpu"], "need a CUDA device"),
    (["--gpu", "--preset", "sd15"], "leave out --preset"),
    (["--gpu", "--resolutions", "1024", "--frames", "9"], "leave out --resolutions, --frames"),
    (["--gpu", "nope"], "invalid choice"),
    (["--gpu", "sd15-512", "--methods", "grid-limit:0.5"], "row sd15-512: grid-limit:0.5: grid-limit is for"),
    (["--gpu", "flux1-dev-1024", "--methods", "todo:2x2x2"], "3 factors"),
    (["--gpu", "hunyuan-video-720p", "--steps", "2"], "times denoiser steps only"),
])
def test_gpu_argument_errors(args, words, capsys, tmp_path):
    with pytest.raises(SystemExit) as err:
        main(["bench", *args, "--out", str(tmp_path / "res")])
    assert err.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "res").exists()


def test_summarize_refuses_what_is_not_bench_records(tmp_path, capsys):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"a": 1}\n')
    with pytest.raises(SystemExit):
        main(["bench", "--summarize", str(bad), "--out", str(tmp_path / "o")])
    assert "holds no bench records" in capsys.readouterr().err


def test_a_half_precision_preset_compiles_as_one_graph():
    """A preset built in half precision holds tensors made in that dtype, not float32 ones whose ``.data`` was
    swapped: dynamo traces the module's tensors by the dtype they were made with, and PixArt's position table
    (made from NumPy in float64) failed every compile of the H200 table that way ('torch.float32 !=
    torch.float16', vanilla included). Checked with dynamo alone (backend "eager"), on a 2-block PixArt."""
    import diffusers
    import torch

    if not hasattr(diffusers, "PixArtTransformer2DModel"):
        pytest.skip(f"diffusers {diffusers.__version__} has no PixArtTransformer2DModel")
    from tokenmerge.bench.configs import PIXART_512
    from tokenmerge.bench.preset import Preset

    preset = Preset("pixart-test", "PixArt-alpha, 2 blocks", dict(PIXART_512, num_layers=2, num_attention_heads=2,
                                                                    attention_head_dim=16, cross_attention_dim=32,
                                                                    caption_channels=32, sample_size=16),
                    text_tokens=8, family="pixart", text_dim=32, patch=2)
    model = preset.build(torch.bfloat16, "cpu")
    assert {t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()} == {torch.bfloat16}
    inputs = preset.inputs(1, 128, torch.bfloat16, "cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(**inputs).sample
    torch._dynamo.reset()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_token_reuse_times_its_partial_step(tmp_path, monkeypatch, fast_cpu):
    """Token reuse compiled (dynamo's eager backend: no inductor minutes): its host decision breaks fullgraph, so it
    is compiled with graph breaks; each timed call is a partial step after a full one, as eagerly; its output as
    eager's."""
    import functools

    import torch

    real = torch.compile
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, fullgraph=False: calls.append(fullgraph) or
                        functools.partial(real, backend="eager")(model, fullgraph=fullgraph))
    from tokenmerge.engine.techniques.reuse import block as technique

    partial, spread = [], technique.spread  # called in a partial step only (traced or run)
    monkeypatch.setattr(technique, "spread", lambda *a: partial.append(1) or spread(*a))
    out = tmp_path / "res"
    assert main(["bench", "--preset", "tiny-wan", "--resolutions", "64x64", "--frames", "5", "--modes", "vanilla",
                 "--methods", "reuse:0.5", "--compile", "default", "--compiled-only", "--repeats", "2", "--out",
                 str(out), "--no-progress"]) == 0
    records = {(r["label"], r["compiled"]): r for r in _records(out) if r["kind"] == "step"}
    reuse = records[("reuse 0.5 compiled", True)]
    assert reuse["status"] == "ok" and reuse["fullgraph"] is False and reuse["step_timed"] == "partial"
    assert len(reuse["full_times_s"]) == 2 and reuse["full_median_s"] > 0
    assert reuse["compiled_vs_eager"] == pytest.approx(0.0, abs=1e-5)
    assert records[("vanilla compiled", True)]["fullgraph"] is True and calls.count(True) == 2  # both tried it
    assert partial


def test_a_later_steps_inputs_keep_the_unchanged_tensors():
    """The partial step's inputs carry the full step's ids, masks and text (the same objects, as a pipeline passes
    them), so a count of a steady call does not include the host reads of new ids; changed tensors stay new."""
    from tokenmerge.bench.steps import _unchanged

    ids, t0, t1 = torch.zeros(4, 3), torch.tensor([1.0]), torch.tensor([0.45])
    first = {"img_ids": ids, "timestep": t0, "hidden_states": torch.ones(1, 4, 8)}
    later = _unchanged({"img_ids": ids.clone(), "timestep": t1, "hidden_states": torch.ones(1, 4, 8)}, first)
    assert later["img_ids"] is ids and later["hidden_states"] is first["hidden_states"] and later["timestep"] is t1
    pair = _unchanged([dict(later), {"img_ids": torch.ones(4, 3)}], [first, first])
    assert pair[0]["img_ids"] is ids and pair[1]["img_ids"] is not ids


def test_a_table_made_from_another_of_its_store():
    """A build marked ``takes_tables`` gets the store: token reuse's round-robin window is made from the order
    table of its grid, built once per store (not again for every window)."""
    from tokenmerge.merge import recompute
    from tokenmerge.merge.plan import Tables

    tables, made = Tables(), []
    real = recompute._order
    try:
        recompute._order = lambda *key: made.append(key) or real(*key)
        windows = [recompute.select((4, 4), "grid", 4, 0, start, "cpu", tables) for start in (0, 4, 8)]
    finally:
        recompute._order = real
    assert len(made) == 1 and len(tables) == 4
    assert sorted(torch.cat(windows).tolist()) == sorted(set(torch.cat(windows).tolist()))  # no token twice


def test_whole_generations_run_as_the_pipelines_do():
    """The bench's generation loop: the scheduler of the pipeline the preset stands for (Flux.1: flow-matching
    Euler at its resolution's dynamic shift, e^mu with mu from the image tokens), and a cache applied to the loop
    tells the steps from that scheduler's host state, as under a pipeline (no timestep read per call)."""
    import math

    import diffusers
    import torch
    from tiny_models import make_flux

    import tokenmerge
    from tokenmerge.bench.generation import Loop, generate, scheduler_for
    from tokenmerge.bench.presets import Preset

    if not hasattr(diffusers, "FluxTransformer2DModel"):
        pytest.skip(f"diffusers {diffusers.__version__} has no FluxTransformer2DModel")
    model = make_flux()
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    preset = Preset("tiny-flux", "test", config, text_tokens=5, family="flux", text_dim=32)
    inputs = preset.inputs(1, 64, torch.float32, torch.device("cpu"))
    scheduler = scheduler_for(preset, inputs)
    tokens = inputs["hidden_states"].shape[1]
    assert scheduler.config.shift == pytest.approx(math.exp(0.5 + 0.65 * (tokens - 256) / 3840))
    loop = Loop(model, scheduler, preset)
    tokenmerge.apply_step_cache(loop, warmup=2, skip=1, min_steps=0)
    generate(loop, None, preset, inputs, 10)
    info = tokenmerge.describe_patch(loop)
    assert info.ran == {"steps": 10, "computed": 0.6} and "steps told by the pipeline's scheduler" in str(info)
    tokenmerge.remove_patch(loop)
