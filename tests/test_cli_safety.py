"""The command line never loses or overwrites what the user had (issue 21, items 5 and 6).

Each test stops the command before any model runs where it can (``run_grid``, ``load`` replaced by a function
that fails the test), so a refusal is proven to come before the work, and the tests take seconds.
"""

import fractions
import json
import os
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

from tokenmerge.cli import main

MANIFEST = ".tokenmerge-outputs.json"  # tools.outputs.MANIFEST: where the files a command wrote are recorded


class Reached(Exception):
    """The command got past its validation to the work itself."""


def _never(*args, **kwargs):
    raise Reached


@pytest.fixture
def no_work(monkeypatch):
    """Running the measurement, or loading a model, fails the command with ``Reached``."""
    from tokenmerge.bench import runner
    from tokenmerge.cli import demo, quality

    monkeypatch.setattr(runner, "run_grid", _never)
    monkeypatch.setattr(quality, "load", _never)
    monkeypatch.setattr(demo, "load", _never)


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


BENCH = ["bench", "--preset", "tiny", "--resolutions", "64", "--modes", "vanilla", "--repeats", "1", "--no-progress"]
QUALITY = ["quality", "--steps", "1", "--count", "1", "--no-progress"]


# ---- --stem: a file name, never a path --------------------------------------------------------------------------
@pytest.mark.parametrize("stem", ["../x", "/tmp/x", "a/b", "a\\b", "", ".", "..", "x\x00", "x" * 101])
@pytest.mark.parametrize("command", [BENCH, QUALITY])
def test_a_stem_with_a_folder_part_is_refused(command, stem, tmp_path, capsys, no_work):
    mine = tmp_path / "x.md"
    mine.write_text("my notes")
    err = _refused(command + ["--out", str(tmp_path / "res"), "--stem", stem], capsys)
    assert "--stem" in err and "plain file name stem" in err and "no folder part" in err
    assert mine.read_text() == "my notes" and not (tmp_path / "res").exists()


# ---- outputs checked before the run -----------------------------------------------------------------------------
@pytest.mark.parametrize("command", [BENCH, QUALITY, ["demo", "--steps", "1", "--no-progress"]])
@pytest.mark.parametrize("below", [False, True])
def test_out_that_is_a_file_is_refused_before_running(command, below, tmp_path, capsys, no_work):
    mine = tmp_path / "results.txt"
    mine.write_text("my notes")
    out = mine / "sub" if below else mine
    err = _refused(command + ["--out", str(out)], capsys)
    assert "--out" in err and "results.txt" in err and "is a file, not a folder" in err
    assert mine.read_text() == "my notes"


@pytest.mark.parametrize("command, name", [(BENCH, "bench.md"), (BENCH, "bench.png"), (QUALITY, "quality.json"),
                                           (QUALITY, "quality-grid.png"), (["demo", "--steps", "1"], "demo.md")])
def test_a_file_of_the_user_in_the_way_is_never_overwritten(command, name, tmp_path, capsys, no_work):
    out = tmp_path / "res"
    out.mkdir()
    (out / name).write_text("my notes")
    err = _refused(command + ["--out", str(out)], capsys)
    assert str(out / name) in err and "never overwritten" in err and "--out" in err
    assert ("--stem" in err) == (command[0] != "demo")  # the demo has no --stem to offer
    assert (out / name).read_text() == "my notes"


def _fake_grid(*args, **kwargs):
    cell = dict(kind="step", preset="tiny", attention="sdpa", resolution=64, batch=1, status="ok", ratio=0.0,
                factor=0, compiled=False, mode="vanilla", label="vanilla", spec="vanilla", median_s=1.0,
                times_s=[1.0], runs=1)
    meta = dict(device_name="x", device="cpu", threads=2, dtype="float32", torch="t", diffusers="d",
                tokenmerge="m", repeats=1, warmup=1, memory="not measured")
    return [cell], meta


def test_bench_replaces_its_own_outputs_and_no_other_file(tmp_path, capsys, monkeypatch):
    from tokenmerge.bench import runner

    monkeypatch.setattr(runner, "run_grid", _fake_grid)
    out = tmp_path / "res"
    assert main(BENCH + ["--out", str(out)]) == 0
    record = json.loads((out / MANIFEST).read_text())["files"]
    assert set(record) == {"bench.md", "bench.csv", "bench.jsonl", "bench.png"}
    assert main(BENCH + ["--out", str(out)]) == 0  # a rerun replaces what it wrote
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")] == []  # no temporary file left
    (out / "bench.csv").write_text("edited by hand")
    capsys.readouterr()
    err = _refused(BENCH + ["--out", str(out)], capsys)
    assert "bench.csv" in err and (out / "bench.csv").read_text() == "edited by hand"
    assert main(BENCH + ["--out", str(out), "--stem", "second"]) == 0  # another stem goes beside it
    assert (out / "second.md").exists() and (out / "bench.csv").read_text() == "edited by hand"


def test_a_file_appearing_during_the_run_is_kept_and_the_output_goes_beside_it(tmp_path):
    from tokenmerge.tools.outputs import Outputs

    out = Outputs(tmp_path / "res", ["run.md"])
    out.check()
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "run.md").write_text("appeared meanwhile")
    with pytest.warns(UserWarning, match="appeared while this command ran"):
        path = out.write_text("run.md", "results")
    assert path.name == "run.1.md" and path.read_text() == "results"
    assert (tmp_path / "res" / "run.md").read_text() == "appeared meanwhile"


def test_a_foreign_record_file_is_not_taken_for_ours(tmp_path):
    from tokenmerge.tools.outputs import MANIFEST as RECORD
    from tokenmerge.tools.outputs import OutputError, Outputs

    assert RECORD == MANIFEST

    (tmp_path / MANIFEST).write_text("not json")
    with pytest.raises(OutputError, match="not such a record"):
        Outputs(tmp_path, ["a.md"]).check()


@pytest.mark.slow
def test_the_demo_reruns_into_its_default_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["demo", "--steps", "1", "--methods", "tome:0.5", "--no-progress", "--no-speed"]  # speed: test_quality
    assert main(argv) == 0
    first = json.loads((tmp_path / "tokenmerge-demo" / "demo.json").read_text())
    assert main(argv) == 0  # its own files are replaced, its cache reused
    again = json.loads((tmp_path / "tokenmerge-demo" / "demo.json").read_text())
    assert first["generated"] == 10 and again["generated"] == 0  # 5 classes x (vanilla, tome 0.5)


# ---- the image cache --------------------------------------------------------------------------------------------
class FakePipe:
    """A pipeline that makes one grey 8x8 image per call (vanilla only: nothing is patched)."""

    def __init__(self, image_factory=None):
        self.calls = 0
        self.image_factory = image_factory

    def __call__(self, prompt, **kwargs):
        from PIL import Image

        self.calls += 1
        image = self.image_factory() if self.image_factory else Image.new("L", (8, 8), 100 + self.calls)
        return SimpleNamespace(images=[image])


def _job(tmp_path):
    from tokenmerge.quality.run import QualityJob

    return QualityJob("fake", ["a bag", "a coat"], [0], [], steps=1, cache=tmp_path / "cache")


def _run(pipe, job):
    from tokenmerge.quality.run import run_job

    return run_job(pipe, job, torch.device("cpu"), progress=False)


def test_a_damaged_cached_image_is_regenerated_with_a_warning(tmp_path):
    job = _job(tmp_path)
    assert _run(FakePipe(), job)["generated"] == 2
    damaged = job.cache / f"{job.key(job.all_specs[0], 'a coat', 0)}.png"
    damaged.write_bytes(damaged.read_bytes()[:20])  # cut short
    with pytest.warns(UserWarning, match=f"damaged cache entry {re.escape(str(damaged))}"):
        report = _run(FakePipe(), job)
    assert report["generated"] == 1 and len(report["images"]) == 2


@pytest.mark.parametrize("content", ["{", "[]", '{"seconds": "fast"}', ""])
def test_a_corrupt_cache_record_is_regenerated_with_a_warning(tmp_path, content):
    job = _job(tmp_path)
    _run(FakePipe(), job)
    record = job.cache / f"{job.key(job.all_specs[0], 'a bag', 0)}.json"
    record.write_text(content)
    with pytest.warns(UserWarning, match=f"damaged cache entry {re.escape(str(record))}"):
        assert _run(FakePipe(), job)["generated"] == 1


def test_an_image_without_its_record_is_generated_again(tmp_path):
    """The record is written last: an image without one was interrupted, and is not trusted."""
    job = _job(tmp_path)
    _run(FakePipe(), job)
    (job.cache / f"{job.key(job.all_specs[0], 'a bag', 0)}.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing was damaged: no warning
        assert _run(FakePipe(), job)["generated"] == 1


def test_an_interrupted_write_leaves_no_half_file(tmp_path):
    from PIL import Image

    class Interrupted(Image.Image):
        def save(self, fp, format=None, **params):
            with open(fp, "wb") as f:
                f.write(b"\x89PNG\r\n\x1a\n half")
            raise KeyboardInterrupt

    job = _job(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        _run(FakePipe(lambda: Interrupted()), job)
    assert sorted(p.name for p in job.cache.iterdir()) == []  # neither a half image nor a temporary file
    report = _run(FakePipe(), job)
    assert report["generated"] == 2 and len(report["images"]) == 2


# ---- what errors quote ------------------------------------------------------------------------------------------
def test_a_huge_prompt_line_is_quoted_capped_with_its_line_number(tmp_path, capsys, no_work):
    prompts = tmp_path / "prompts.txt"
    line = " ".join(["castle"] * 150_000)  # about 1 MB, and no class the embedded model knows
    prompts.write_text(f"a bag\n\n{line}\n")
    err = _refused(["quality", "--prompts", str(prompts), "--out", str(tmp_path / "q")], capsys)
    assert "line 3 of" in err and "prompts.txt" in err and f"({len(line)} characters)" in err
    assert "names no class" in err
    assert len(err) < 2000


@pytest.mark.parametrize("content, words", [
    (b"a bag\n\xff\xfe binary\n", ["line 2", "not UTF-8", "prompts.txt"]),
])
def test_a_binary_prompt_file_is_named(tmp_path, capsys, no_work, content, words):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(content)
    err = _refused(QUALITY + ["--prompts", str(prompts), "--out", str(tmp_path / "q")], capsys)
    assert all(w in err for w in words), err


@pytest.mark.parametrize("content, words", [
    ("Prompt\n" + "x" * 200_000 + "\n", ["line 2", "field larger than field limit"]),
    ("Text\n" + "x" * 1000 + "\n", ["needs a 'Prompt' column"]),
])
def test_a_broken_tsv_prompt_file_is_named(tmp_path, capsys, no_work, content, words):
    prompts = tmp_path / "prompts.tsv"
    prompts.write_text(content)
    err = _refused(QUALITY + ["--prompts", str(prompts), "--out", str(tmp_path / "q")], capsys)
    assert all(w in err for w in words) and "prompts.tsv" in err and len(err) < 2000, err


@pytest.mark.parametrize("argv", [
    BENCH + ["--methods", "tome:0.5,mode=" + "x" * 100_000],
    BENCH + ["--methods", "x" * 100_000],
    BENCH + ["--preset", "x" * 100_000],
    BENCH + ["--memory-limit", "9" * 100_000 + "GB"],
    BENCH + ["--resolutions", "1" * 5000],
    QUALITY + ["--category", "x" * 100_000],
    QUALITY + ["--prompts", "x" * 100_000],
])
def test_errors_quote_at_most_200_characters_of_an_argument(argv, tmp_path, capsys, no_work):
    err = _refused(argv + ["--out", str(tmp_path / "o")], capsys)
    assert len(err) < 3000 and "characters)" in err, err[:3000]


# ---- --model: a refused file is not a missing one ---------------------------------------------------------------
@pytest.fixture(scope="module")
def pickled_pipeline(tmp_path_factory):
    """A pipeline folder whose UNet weights are a pickle holding more than tensors (a ``fractions.Fraction``)."""
    from tiny_models import make_sd_pipeline

    tmp = tmp_path_factory.mktemp("pickled")
    folder = tmp / "pipe"
    make_sd_pipeline(tmp).save_pretrained(folder, safe_serialization=False)
    weights = folder / "unet" / "diffusion_pytorch_model.bin"
    state = torch.load(weights, weights_only=True)
    torch.save({**state, "extra": fractions.Fraction(1, 3)}, weights)
    return folder


@pytest.mark.parametrize("command", [BENCH, QUALITY])
def test_a_refused_pickle_in_a_model_folder_says_so(command, pickled_pipeline, tmp_path, capsys, monkeypatch):
    from tokenmerge.bench import runner

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(runner, "run_grid", _never)
    err = _refused(command + ["--model", str(pickled_pipeline), "--out", str(tmp_path / "o")], capsys)
    assert "--model" in err and "was found" in err and "refused" in err
    assert os.path.join("unet", "diffusion_pytorch_model.bin") in err and "fractions.Fraction" in err
    assert "not here" not in err


def test_load_pipeline_names_the_refused_file(pickled_pipeline):
    from tokenmerge.tools.pipelines import PipelineLoadError, load_pipeline

    with pytest.raises(PipelineLoadError, match="weights_only=True") as exc:
        load_pipeline(str(pickled_pipeline))
    assert exc.value.path == str(pickled_pipeline / "unet" / "diffusion_pytorch_model.bin")


def test_a_folder_without_model_index_is_not_here(tmp_path, monkeypatch):
    from tokenmerge.tools.pipelines import load_pipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not here"):
        load_pipeline(str(tmp_path))
