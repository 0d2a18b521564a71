"""`tokenmerge quality` and `tokenmerge demo`: metrics on known images, prompt sets, method specs, the embedded
model, the commands end to end (cache reuse, missing weights, a 2-process accelerate run)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tokenmerge.cli import main
from tokenmerge.quality.metrics import mean_ci, psnr, ssim
from tokenmerge.quality.prompts import load_prompts, parti_categories
from tokenmerge.tools.methods import MethodSpec, parse_spec


# ---- metrics --------------------------------------------------------------------------------------------------
def test_psnr_of_a_known_offset():
    a = torch.full((1, 16, 16), 0.3)
    assert float(psnr(a, a + 0.1)) == pytest.approx(20.0, abs=1e-4)  # mse 0.01 -> 10 log10(1 / 0.01)
    assert float(psnr(a, a + 0.01)) == pytest.approx(40.0, abs=1e-3)
    assert math.isinf(float(psnr(a, a)))


def test_ssim_of_constant_images_matches_the_formula():
    a, b = torch.full((3, 16, 16), 0.2), torch.full((3, 16, 16), 0.4)
    c1 = 0.01**2  # variances and covariance are 0, so only the luminance term is left
    expected = (2 * 0.2 * 0.4 + c1) / (0.2**2 + 0.4**2 + c1)
    assert float(ssim(a, b)) == pytest.approx(expected, rel=1e-5)
    x = torch.rand(2, 1, 20, 20, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(ssim(x, x), torch.ones(2))
    assert torch.allclose(ssim(x, x.flip(0)), ssim(x.flip(0), x))  # symmetric
    assert float(ssim(x[0], 1 - x[0])) < 0  # an inverted image is anti-correlated


def test_mean_ci():
    mean, half = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))  # t(0.975, 2) * sd 1 / sqrt(3)
    assert math.isnan(mean_ci([5.0])[1])
    assert math.isinf(mean_ci([1.0, float("inf")])[0])
    with pytest.raises(ValueError):
        mean_ci([])


# ---- prompts and method specs ---------------------------------------------------------------------------------
def test_parti_prompts_spread_over_categories():
    assert len(load_prompts("parti")) == 1632
    assert len(parti_categories()) == 12
    first = load_prompts("parti", count=12)
    assert len(first) == 12 and len(set(first)) == 12
    vehicles = load_prompts("parti", categories=["vehicles"], count=3)
    assert len(vehicles) == 3
    with pytest.raises(ValueError, match="categories.*not in the prompt set"):
        load_prompts("parti", categories=["Spaceships"])
    with pytest.raises(ValueError, match="count"):
        load_prompts("parti", count=0)


def test_user_prompt_files(tmp_path):
    (tmp_path / "p.txt").write_text("a red bag\n\n  a blue coat \n")
    assert load_prompts(str(tmp_path / "p.txt")) == ["a red bag", "a blue coat"]
    (tmp_path / "p.tsv").write_text("Prompt\tCategory\nx\tA\ny\tB\n")
    assert load_prompts(str(tmp_path / "p.tsv"), categories=["b"]) == ["y"]
    (tmp_path / "bad.tsv").write_text("Text\nx\n")
    with pytest.raises(ValueError, match="Prompt"):
        load_prompts(str(tmp_path / "bad.tsv"))
    with pytest.raises(ValueError, match="parti"):
        load_prompts(str(tmp_path / "missing.txt"))


def test_method_specs():
    assert parse_spec("tome:0.5,stop=0.5,use_rand=false") == \
        MethodSpec("tome", 0.5, (("stop", 0.5), ("use_rand", False)))
    assert parse_spec("todo").value == 2 and parse_spec("tome").value == 0.5
    assert parse_spec("todo:4,mode=avg").label == "todo 4 mode=avg"
    for bad, words in [("magic:1", "method must be one of"), ("tome:0.9", "ratio"), ("tome:x", "number"),
                       ("tome:0.5,bogus=1", "bogus"), ("todo:2,mode=cubic", "mode"), ("vanilla:1", "vanilla"),
                       ("tome:0.5,stop", "KEY=VALUE"), ("tomesd:0.5,stop=0.5", "tomesd takes no option")]:
        with pytest.raises(ValueError, match=words):
            parse_spec(bad)


# ---- the embedded model ---------------------------------------------------------------------------------------
def test_class_names_in_prompts():
    from tokenmerge.fashion import class_ids

    assert class_ids(["a photo of an ankle boot", "T-shirt", "a shirt", "Sneaker", "", "two bags"]) == \
        [9, 0, 6, 7, 10, 8]
    with pytest.raises(ValueError, match="names no class.*Ankle boot"):
        class_ids(["a castle"])


@pytest.fixture(scope="module")
def fashion():
    from tokenmerge.fashion import load_fashion_pipeline

    pipe = load_fashion_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_embedded_pipeline_is_patchable_at_1024_tokens(fashion):
    import tokenmerge

    info = tokenmerge.apply_patch(fashion, ratio=0.5) and tokenmerge.describe_patch(fashion)
    try:
        assert info.num_blocks >= 2
        gen = torch.Generator().manual_seed(0)
        merged = fashion("Sneaker", num_inference_steps=3, generator=gen, output_type="pt").images
    finally:
        tokenmerge.remove_patch(fashion)
    tokens = []
    hook = fashion.unet.down_blocks[0].attentions[0].transformer_blocks[0].register_forward_pre_hook(
        lambda m, a: tokens.append(a[0].shape[1]))
    try:
        plain = fashion("Sneaker", num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                        output_type="pt").images
    finally:
        hook.remove()
    assert min(tokens) >= 32 * 32
    assert plain.shape == (1, 1, 32, 32) and 0 <= float(plain.min()) and float(plain.max()) <= 1
    assert not torch.equal(plain, merged)  # merging ran
    again = fashion("Sneaker", num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="pt")
    assert torch.equal(plain, again.images)  # and was removed


def test_missing_weights_are_named(tmp_path):
    from tokenmerge.fashion import load_fashion_pipeline

    with pytest.raises(FileNotFoundError, match="weights are not at .*train_fashion"):
        load_fashion_pipeline(tmp_path / "nothing.safetensors")


# ---- the commands ---------------------------------------------------------------------------------------------
def _report(out, stem="quality"):
    return json.loads((out / f"{stem}.json").read_text())


def test_quality_end_to_end_and_cache(tmp_path, capsys):
    out = tmp_path / "q"
    args = ["quality", "--steps", "2", "--count", "3", "--seeds", "0", "1", "--out", str(out), "--no-progress"]
    assert main(args + ["--methods", "tome:0.5"]) == 0
    report = _report(out)
    assert [m["label"] for m in report["methods"]] == ["vanilla", "tome 0.5"]
    assert report["generated"] == 3 * 2 * 2 and len(report["images"]) == 12
    vanilla, tome = report["methods"]
    assert vanilla["psnr_mean"] == "inf" and vanilla["ssim_mean"] == 1.0
    assert isinstance(tome["psnr_mean"], float) and 10 < tome["psnr_mean"] < 80 and tome["ssim_mean"] < 1
    for name in ("quality.md", "quality-grid.png", "quality-plot.png"):
        assert (out / name).stat().st_size > 0
    assert "| tome 0.5 |" in (out / "quality.md").read_text()
    # one more method: only its images are generated, the rest come from the cache unchanged
    assert main(args + ["--methods", "tome:0.5", "todo:2"]) == 0
    again = _report(out)
    assert again["generated"] == 3 * 2
    assert again["methods"][1]["psnr_mean"] == tome["psnr_mean"]
    assert "todo 2" in capsys.readouterr().out


def test_quality_extra_metrics_offline(tmp_path, monkeypatch):
    from tiny_models import make_clip_folder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))  # no Inception / AlexNet weights there
    out = tmp_path / "q"
    base = ["quality", "--steps", "2", "--count", "2", "--methods", "tome:0.5", "--out", str(out), "--no-progress"]
    assert main(base + ["--metrics", "clip", "fid", "kid", "lpips", "--clip-model", str(tmp_path / "no-clip")]) == 0
    extra = _report(out)["extra"]
    assert "no local CLIP weights" in extra["CLIP score"]
    for name in ("FID", "KID", "LPIPS"):
        assert extra[name].startswith("skipped: ") and ("not on this machine" in extra[name] or "needs" in extra[name])
    assert len(_report(out)["methods"]) == 2  # the rest ran
    assert main(base + ["--metrics", "clip", "--clip-model", str(make_clip_folder(tmp_path))]) == 0
    clip = _report(out)["extra"]["CLIP score"]
    assert set(clip) == {"vanilla", "tome 0.5"} and all(v >= 0 for v in clip.values())


def test_demo_end_to_end(tmp_path, capsys):
    import diffusers

    out = tmp_path / "demo"
    assert main(["demo", "--steps", "2", "--out", str(out), "--no-progress", "--no-speed"]) == 0
    report = _report(out, "demo")
    assert [m["label"] for m in report["methods"]] == ["vanilla", "auto", "tome 0.5", "todo 2"]
    assert [row["prompt"] for row in report["images"][::4]] == ["T-shirt", "Trouser", "Dress", "Sneaker", "Bag"]
    assert (out / "demo-grid.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| todo 2 |" in printed and "demo-grid.png" in printed
    assert "not what a real one gets" in printed  # the embedded models' timings are not real-model ones
    if not hasattr(diffusers, "WanTransformer3DModel"):  # diffusers 0.27: the transformers are skipped, said so
        assert "fashion-dit: skipped" in printed and "fashion-video: skipped" in printed
        return
    dit, video = _report(out, "demo-dit"), _report(out, "demo-video")
    assert [m["label"] for m in dit["methods"]] == ["vanilla", "auto", "auto speed=fast", "tome 0.5",
                                                     "tome 0.5 start=0.5", "todo 2"]
    assert [m["label"] for m in video["methods"]] == ["vanilla", "auto", "auto speed=fast", "tome 0.5",
                                                       "tome 0.5 start=0.5", "todo 1x2x2"]
    assert video["frames"] == 8 and "temporal_psnr_mean" in video["methods"][1]
    assert dit["prompts"] == video["prompts"] == 5
    assert not (out / "demo-speed.md").exists()
    from PIL import Image

    with Image.open(out / "demo-video.gif") as gif:  # the cached clips, 8 frames, the 6 methods side by side, 4x
        assert gif.n_frames == 8 and gif.size == (6 * 32 * 4, 32 * 4)
        gif.seek(3)
        frame = gif.convert("L").resize((6 * 32, 32), Image.NEAREST)
    with Image.open(video["images"][0]["image"]) as strip:  # vanilla's clip of the first prompt, as cached
        assert frame.crop((0, 0, 32, 32)).tobytes() == strip.convert("L").crop((3 * 32, 0, 4 * 32, 32)).tobytes()


@pytest.mark.parametrize("argv, words", [
    (["quality", "--methods", "tome:0.9"], "ratio"),
    (["quality", "--methods", "fast"], "method must be one of"),
    (["quality", "--prompts", "parti", "--count", "1"], "names no class"),
    (["quality", "--category", "Nope"], "categories"),
    (["quality", "--size", "64"], "--size applies to --model"),
    (["quality", "--model", "/nonexistent/pipeline"], "Its weights are not here"),
    (["demo", "--steps", "0"], "must be an integer >= 1"),
    (["demo", "--device", "warp9"], "--device"),
])
def test_bad_arguments(argv, words, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--out", str(tmp_path)])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.processes
def test_two_process_accelerate_run(tmp_path):
    out = tmp_path / "q"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "tokenmerge", "quality", "--device", "cpu", "--steps", "2", "--count", "4",
           "--methods", "tome:0.5", "--out", str(out), "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(out)
    assert report["processes"] == 2
    assert {row["process"] for row in report["images"]} == {0, 1}  # both processes generated
    assert len(report["images"]) == 4 * 2
    assert proc.stdout.count("| tome 0.5 |") == 1  # one report, from the main process


def test_grid_column_heads_are_wrapped_not_cut():
    from PIL import Image

    from tokenmerge.quality.report import make_grid

    cell = 128  # the default: a head of 20 characters fits
    tile = Image.new("L", (8, 8), 128)
    labels = ["tome 0.5 match_radius=1", "tome 0.5 match_radius=2"]
    grid = make_grid([[tile, tile]], ["a row"], labels, cell=cell)
    head = grid.height - cell
    first = grid.crop((150, 0, 150 + cell, head)).tobytes()
    second = grid.crop((150 + cell, 0, 150 + 2 * cell, head)).tobytes()
    assert first != second  # cut to the same "tome 0.5 [...]", the two heads would be identical


def test_demo_speed_figure_on_a_tiny_preset(tmp_path, capsys, monkeypatch):
    """The real-width speed part, with the tiny Wan preset in its place (the real one takes about a minute)."""
    import diffusers

    from tokenmerge.cli import demo

    if not hasattr(diffusers, "WanTransformer3DModel"):
        pytest.skip(f"diffusers {diffusers.__version__} has no WanTransformer3DModel")
    monkeypatch.setattr(demo, "SPEED", dict(demo.SPEED, preset="tiny-wan", resolution="64x96"))
    monkeypatch.setattr(demo, "TRANSFORMERS", ())
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "1", "--out", str(out), "--no-progress", "--methods", "tome:0.5"]) == 0
    text = (out / "demo-speed.md").read_text()
    assert "tiny-wan" in text and "tokenmerge 0.5 scope=block" in text and "| tokenmerge 0.5 |" in text
    assert "| stepcache 1 |" in text and "full step" in text  # the step cache: its skipped step, and a full one
    assert "RANDOM weights" in capsys.readouterr().out


def test_quality_names_a_refused_combination_instead_of_crashing(tmp_path, capsys):
    import diffusers

    if not hasattr(diffusers, "FluxTransformer2DModel") or not hasattr(diffusers, "PyramidAttentionBroadcastConfig"):
        pytest.skip("this diffusers lacks the embedded DiT's class or the cache")
    args = ["quality", "--model", "fashion-dit", "--steps", "2", "--count", "1", "--out", str(tmp_path / "q"),
            "--no-progress", "--methods", "tome:0.5,scope=block+pab:2"]  # PAB inside blocks run on merged tokens
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--methods tome:0.5,scope=block+pab:2" in err and "Pyramid Attention Broadcast" in err
    assert not (tmp_path / "q" / "quality.md").exists()
