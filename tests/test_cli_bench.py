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


@pytest.mark.parametrize("args, words", [
    (["--resolutions", "100"], "multiple of 8"),
    (["--resolutions", "32"], ">= 64"),
    (["--ratios", "0.9"], "(0, 0.75]"),
    (["--batch-sizes", "0"], ">= 1"),
    (["--preset", "sd99"], "invalid choice"),
    (["--modes", "fast"], "invalid choice"),
    (["--memory-limit", "lots"], "512MB"),
    (["--attention", "xformers"], "xformers"),
    (["--device", "tpu"], "--device"),
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
