"""Hypothesis fuzz of the command line's arguments and their validation (issue 21): paths, stems, method specs,
numbers, prompt files with binary or huge lines. Every outcome is a clear error (argparse's exit 2 with a
message) or the start of the work, which is stopped right there: no model is built, nothing is written.

Deterministic (``derandomize=True``) and fast (a few seconds).
"""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmerge.cli import main

FUZZ = settings(derandomize=True, deadline=None, max_examples=150, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Reached(Exception):
    """Validation passed: the command would start its work here."""


def _never(*args, **kwargs):
    raise Reached


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A working folder with a user's file and a user's results in the way; the work replaced by ``Reached``."""
    from tokenmerge.bench import presets, runner
    from tokenmerge.cli import demo, quality

    for module, name in [(runner, "run_grid"), (presets, "resolve"), (quality, "load"), (demo, "load")]:
        monkeypatch.setattr(module, name, _never)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.txt").write_text("the user's file")
    (tmp_path / "res").mkdir()
    for name in ("bench.md", "quality.json", "demo.md"):
        (tmp_path / "res" / name).write_text("the user's results")
    return tmp_path


PATHS = st.one_of(
    st.sampled_from(["", ".", "..", "/", "../x", "/nonexistent/deep/x", "file.txt", "file.txt/sub", "res", "res/",
                     "a\\b", "x" * 300, "x/" * 200, "new/folder", "\x00", "\udcff", "/proc/1/root/x", "~"]),
    st.text(max_size=30),
)
STEMS = st.one_of(st.sampled_from(["bench", "quality", "demo", "../x", "/x", "a/b", ".", "..", "", "x" * 101,
                                   "ok-1", "\udcff", "x\x00"]), st.text(max_size=120))
NUMBERS = st.one_of(st.integers().map(str), st.floats().map(str), st.text(max_size=12),
                    st.sampled_from(["9" * 5000, "nan", "inf", "-1", "0", "1e400", "8GB", "99999999999999TB"]))
SPECS = st.one_of(
    st.sampled_from(["tome:0.5", "todo:2", "vanilla", "limit:0.5", "tome:0.5,stop=0.5", "tome:9" + "9" * 400,
                     "tome:0.5,mode=" + "x" * 5000, "tome:0.5,=1", "todo:2,mode=avg,ratio=0.3"]),
    st.text(max_size=40),
    st.tuples(st.sampled_from(["tome", "todo", "limit", "todo-limit", "tomesd", "x"]), NUMBERS,
              st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8)), max_size=2)).map(
        lambda t: f"{t[0]}:{t[1]}" + "".join(f",{k}={v}" for k, v in t[2])),
)
# a prompt file: its bytes, some binary, some with a line of up to a megabyte and more
PROMPT_BYTES = st.one_of(
    st.binary(max_size=100),
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.tuples(st.text(min_size=1, max_size=8), st.sampled_from([1, 1000, 150_000])).map(
        lambda t: ("a bag\n" + t[0] * t[1] + "\nPrompt\tCategory\n").encode("utf-8", "surrogatepass")),
    st.sampled_from([b"Prompt\n" + b"x" * 200_000 + b"\n", b"Prompt\tCategory\na bag\tA\n", b"\xff\xfe\x00\x01"]),
)

COMMON = {"--methods": SPECS, "--steps": NUMBERS, "--guidance": NUMBERS, "--size": NUMBERS,
          "--device": st.one_of(st.sampled_from(["cpu", "auto", "cuda:99", "tpu"]), st.text(max_size=12)),
          "--dtype": st.sampled_from(["float32", "float8", ""]), "--model": PATHS, "--out": PATHS}
OPTIONS = {
    "bench": {**COMMON, "--stem": STEMS, "--preset": st.sampled_from(["tiny", "sd15", "x" * 300]),
              "--resolutions": NUMBERS, "--batch-sizes": NUMBERS, "--ratios": NUMBERS, "--todo-factors": NUMBERS,
              "--modes": st.sampled_from(["vanilla", "tokenmerge", "tomesd", "todo", "fast"]),
              "--attention": st.sampled_from(["sdpa", "vanilla", "xformers", "x"]), "--repeats": NUMBERS,
              "--warmup": NUMBERS, "--memory-limit": NUMBERS},
    "quality": {**COMMON, "--stem": STEMS, "--images": PATHS, "--count": NUMBERS, "--seeds": NUMBERS,
                "--category": st.text(max_size=20), "--grid-rows": NUMBERS, "--prompts": PATHS,
                "--metrics": st.sampled_from(["clip", "fid", "x"]), "--clip-model": PATHS},
    "demo": COMMON,
}
FLAGS = {"bench": ["--compile", "--breakdown", "--memory", "--no-progress"], "quality": ["--no-progress"],
         "demo": ["--no-progress"]}


@st.composite
def command_lines(draw, command: str):
    """``(argv, prompt file bytes or None)``: some options of ``command`` with fuzzed values."""
    names = draw(st.lists(st.sampled_from(sorted(OPTIONS[command])), max_size=5, unique=True))
    argv = [command]
    prompt_file = None
    for name in names:
        if name == "--prompts" and draw(st.booleans()):
            prompt_file = draw(PROMPT_BYTES)
            value = draw(st.sampled_from(["prompts.txt", "prompts.tsv", "prompts"]))
        else:
            value = draw(OPTIONS[command][name])
        argv += [name, value]
    argv += draw(st.lists(st.sampled_from(FLAGS[command]), max_size=2, unique=True))
    return argv, prompt_file


def _check(argv, prompt_file, folder: Path, capsys) -> None:
    if prompt_file is not None:
        name = argv[argv.index("--prompts") + 1]
        (folder / name).write_bytes(prompt_file)
    try:
        main(argv)
    except Reached:
        return
    except SystemExit as exit:
        err = capsys.readouterr().err
        if exit.code == 0:  # --help
            return
        assert exit.code == 2, (argv, exit.code)
        assert "error:" in err and len(err) < 5000, err[:5000]
        return
    raise AssertionError(f"{argv} returned without reaching the work or an error")


@pytest.mark.parametrize("command", ["bench", "quality", "demo"])
def test_fuzzed_command_lines_fail_clearly_or_reach_the_work(command, sandbox, capsys):
    before = sorted(str(p.relative_to(sandbox)) for p in sandbox.rglob("*") if not p.name.startswith("prompts"))

    @FUZZ
    @given(command_lines(command))
    def run(case):
        _check(*case, sandbox, capsys)

    run()
    after = sorted(str(p.relative_to(sandbox)) for p in sandbox.rglob("*") if not p.name.startswith("prompts"))
    assert after == before  # nothing was created or removed before the work
    assert (sandbox / "file.txt").read_text() == "the user's file"
    assert all((sandbox / "res" / n).read_text() == "the user's results" for n in ("bench.md", "quality.json"))


@FUZZ
@given(st.text(max_size=200), st.text(max_size=60))
def test_output_validation_raises_only_clear_errors(stem, folder):
    """``check_stem`` and ``Outputs.check`` accept or raise ``ValueError`` naming the argument, nothing else."""
    from tokenmerge.tools.outputs import OutputError, Outputs, check_stem

    try:
        check_stem(stem)
    except ValueError as err:
        assert "plain file name stem" in str(err) and len(str(err)) < 600
    else:
        assert os.sep not in stem and "/" not in stem and "\\" not in stem and stem.strip(".")
    try:
        Outputs(Path("/nonexistent-tokenmerge-fuzz") / folder, ["a.md"]).check()
    except OutputError as err:
        assert "--out" in str(err) and len(str(err)) < 1000
