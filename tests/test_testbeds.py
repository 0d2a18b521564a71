"""The testbeds nearer real token counts (fashion-mosaic, fashion-video-long) and the distribution metric
(the shipped classifier's Fréchet distance and prompt adherence).

Token counts are taken from the transformer's own inputs on randomly initialised models (no weights needed); the
tests that need trained weights or the Fashion-MNIST files skip, saying which, when they are absent.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("diffusers")

from tokenmerge.fashion import data  # noqa: E402
from tokenmerge.fashion.classifier import FashionClassifier, load_classifier  # noqa: E402
from tokenmerge.quality.distribution import FashionScorer, crops, feature_stats, frechet_distance  # noqa: E402


def _needs(*names):
    """Skip (with the reason) on a diffusers without these model classes (the oldest supported one)."""
    import diffusers

    missing = [n for n in names if not hasattr(diffusers, n)]
    return pytest.mark.skipif(bool(missing), reason=f"diffusers {diffusers.__version__} has no {', '.join(missing)}")


def _random_mosaic():
    from tokenmerge.fashion.mosaic import FashionMosaic, SentenceEncoder, build_mosaic

    torch.manual_seed(0)
    return FashionMosaic(build_mosaic().eval(), SentenceEncoder().eval())


def _inputs_of(module: torch.nn.Module, call):
    """The keyword inputs of every forward of ``module`` during ``call()``."""
    seen = []
    handle = module.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True)
    try:
        call()
    finally:
        handle.remove()
    return seen


@_needs("FluxTransformer2DModel")
def test_mosaic_tokens_per_call():
    pipe = _random_mosaic()
    prompt = "a bag at the top left and a sneaker at the bottom right"
    calls = _inputs_of(pipe.transformer, lambda: pipe([prompt, "nothing"], num_inference_steps=2,
                                                      guidance_scale=2.0, output_type="pt"))
    assert len(calls) == 2  # one per step, the guided batch in one call
    for kwargs in calls:
        assert kwargs["hidden_states"].shape == (4, 1024, 4)  # 2 prompts x (unconditional, conditional)
        assert kwargs["encoder_hidden_states"].shape[:2] == (4, 32)
        assert kwargs["img_ids"].shape == (1024, 3) and kwargs["txt_ids"].shape == (32, 3)


def test_mosaic_image_ids_cover_the_grid():
    from tokenmerge.fashion.mosaic import image_ids, pack, unpack

    ids = image_ids()
    assert torch.equal(ids[:, 1:].unique(dim=0), torch.cartesian_prod(torch.arange(32.0), torch.arange(32.0)))
    x = torch.randn(2, 1, 64, 64)
    assert torch.equal(unpack(pack(x)), x)
    assert torch.equal(pack(x)[0, 33], x[0, 0, 2:4, 2:4].reshape(-1))  # token (row 1, col 1)


@_needs("WanTransformer3DModel")
def test_video_long_tokens_per_call():
    from tokenmerge.fashion.video import ClassTokens, build_video
    from tokenmerge.fashion.video_long import FashionVideoLong

    torch.manual_seed(0)
    pipe = FashionVideoLong(build_video().eval(), ClassTokens().eval())
    model = pipe.transformer
    grids = []
    handle = model.patch_embedding.register_forward_hook(lambda m, a, out: grids.append(out.shape[2:]))
    try:
        out = pipe("a sneaker", num_inference_steps=1, guidance_scale=1.0, output_type="pt")
    finally:
        handle.remove()
    assert [tuple(g) for g in grids] == [(32, 8, 8)]
    assert grids[0].numel() >= 2048
    assert out.frames.shape == (1, 32, 1, 32, 32) and out.images.shape == (1, 1, 32, 32 * 32)


def test_sentences_fit_and_tokenize_apart():
    from tokenmerge.fashion.mosaic import PAD, TEXT_TOKENS, UNK, tokenize

    longest = data.mosaic_sentence([9, 9, 9, 9])  # four "an ankle boot": the longest sentence
    ids = tokenize([longest])
    assert int((ids != PAD).sum()) <= TEXT_TOKENS and not (ids == UNK).any()
    a, b = tokenize(["a bag at the top left", "a bag at the top right"])
    assert a.shape == (TEXT_TOKENS,) and not torch.equal(a, b)
    assert torch.equal(tokenize([""])[0], torch.full((TEXT_TOKENS,), PAD))


@_needs("FluxTransformer2DModel")
def test_text_encoder_tells_sentences_apart():
    pipe = _random_mosaic()
    from tokenmerge.fashion.mosaic import tokenize

    sentences = ["a bag at the top left", "a bag at the top right", "a dress at the top left",
                 "a bag at the top left and a coat at the bottom right"]
    with torch.no_grad():
        tokens, pooled = pipe.text(tokenize(sentences))
    assert tokens.shape == (4, 32, 64) and pooled.shape == (4, 64)
    for i, j in itertools.combinations(range(4), 2):
        assert (tokens[i] - tokens[j]).abs().max() > 1e-3, (sentences[i], sentences[j])


def test_sentence_round_trip():
    g = torch.Generator().manual_seed(0)
    layouts = data.random_layouts(200, generator=g)
    for layout, sentence in zip(layouts.tolist(), data.random_sentences(layouts, g)):
        assert data.parse_mosaic(sentence) == layout, sentence
    assert data.parse_mosaic("nothing") == [data.EMPTY] * 4
    with pytest.raises(ValueError, match="not 'a <class> at the"):
        data.parse_mosaic("a bag in the middle")
    with pytest.raises(ValueError, match="twice"):
        data.parse_mosaic("a bag at the top left and a coat at the top left")
    prompts = data.mosaic_prompts(32)
    assert prompts == data.mosaic_prompts(32) and len(set(prompts)) == 32


def test_mosaic_cells_round_trip():
    cells = torch.randn(3, 4, 1, 32, 32)
    m = data.mosaic(cells)
    assert m.shape == (3, 1, 64, 64) and torch.equal(m[1, 0, 32:, :32], cells[1, 2, 0])  # bottom left
    assert torch.equal(data.cells_of(m), cells)
    assert torch.equal(crops(m[1], "mosaic"), cells[1])


def test_frechet_distance_zero_for_identical_and_growing_with_shift():
    torch.manual_seed(0)
    a = torch.randn(400, 8)
    assert frechet_distance(*feature_stats(a), *feature_stats(a)) == pytest.approx(0.0, abs=1e-8)
    distances = [frechet_distance(*feature_stats(a), *feature_stats(a + s)) for s in (0.0, 0.25, 0.5, 1.0)]
    assert distances == sorted(distances) and distances[1] > 0
    assert distances[2] == pytest.approx(8 * 0.5 ** 2, rel=1e-6)  # a shift moves the mean only
    # closed form for Gaussians with commuting covariances: |m|^2 + sum (a + b - 2 sqrt(a b))
    d1, d2 = torch.tensor([1.0, 4.0, 9.0]), torch.tensor([4.0, 1.0, 9.0])
    want = 1.0 + (1 + 4 - 2 * 2) + (4 + 1 - 2 * 2) + 0.0
    assert frechet_distance(torch.zeros(3), torch.diag(d1), torch.tensor([1.0, 0, 0]), torch.diag(d2)) == \
        pytest.approx(want, rel=1e-9)


class _ByBrightness(FashionClassifier):
    """A stand-in classifier: label = round(10 x the crop's mean), features = the mean (so FD is computable)."""

    def features(self, x):
        return x.mean((1, 2, 3))[:, None].repeat(1, 2)

    def forward(self, x):
        return self.head(self.features(x))


def _stub_scorer(layout: str, frames: int = 0) -> FashionScorer:
    scorer = FashionScorer.__new__(FashionScorer)
    scorer.layout, scorer.frames = layout, frames
    scorer.model = _ByBrightness()
    head = torch.nn.Linear(2, 11)
    with torch.no_grad():  # logit_k = -(10 m - k)^2 up to terms constant in k: 20 k m - k^2
        head.weight.copy_(torch.stack([torch.arange(11.0) * 20, torch.zeros(11)], 1))
        head.bias.copy_(-torch.arange(11.0) ** 2)
    scorer.model.head = head
    scorer.ref_mean, scorer.ref_cov = torch.zeros(11, 2, dtype=torch.float64), torch.zeros(11, 2, 2,
                                                                                       dtype=torch.float64)
    return scorer


def test_adherence_on_a_constructed_case():
    scorer = _stub_scorer("mosaic")
    prompt = "a bag at the top left, a coat at the bottom right and a dress at the top right"  # [8, 3, EMPTY, 4]
    values = [[0.8, 0.3, 1.0, 0.4], [0.8, 0.3, 0.2, 0.4]]  # first: bottom left says 10 (EMPTY); second: 2 (wrong)
    images = [data.mosaic(torch.tensor(v).view(1, 4, 1, 1, 1).expand(1, 4, 1, 32, 32))[0] for v in values]
    out = scorer.score([prompt, prompt], {"vanilla": [images[0], images[0]], "other": images})
    assert out["vanilla"]["per_image"] == [1.0, 1.0] and out["vanilla"]["adherence"] == 1.0
    assert out["other"]["per_image"] == [1.0, 0.75] and out["other"]["adherence"] == pytest.approx(0.875)
    assert out["vanilla"]["fd_vanilla"] == pytest.approx(0.0, abs=1e-12) and out["other"]["fd_vanilla"] > 1e-3
    frames = _stub_scorer("frames", frames=4)
    clip = torch.cat([torch.full((1, 32, 32), v) for v in (0.7, 0.7, 0.6, 0.7)], -1)  # "sneaker" is 7
    assert frames.score(["a sneaker"], {"vanilla": [clip]})["vanilla"]["adherence"] == 0.75
    single = _stub_scorer("image")
    assert single.score(["a bag", "a bag"], {"m": [torch.full((1, 32, 32), 0.8), torch.full((1, 32, 32), 0.1)]}
                        )["m"]["per_image"] == [1.0, 0.0]


def test_quality_table_has_the_distribution_columns():
    from tokenmerge.quality.report import markdown

    method = dict(psnr_ci95=float("nan"), ssim_mean=1.0, ssim_ci95=float("nan"), seconds_median=1.0, speedup=1.0,
                  linear_work=None)
    report = {"model": "m", "prompts": 1, "seeds": [0], "steps": 2, "frames": 0,
              "methods": [dict(method, label="vanilla", psnr_mean="inf", fd=3.25, adherence=0.9,
                               adherence_ci95=0.05),
                          dict(method, label="tome 0.5", psnr_mean=20.0, fd=7.5, adherence=0.5, adherence_ci95=0.1)]}
    text = markdown(report)
    assert "| method | PSNR (dB) | SSIM | FD | adherence | s / image (median) | speed-up |" in text
    assert "| 3.250 | 90.0% ± 5.0% |" in text and "| 7.500 | 50.0% ± 10.0% |" in text
    for m in report["methods"]:
        del m["adherence"]
    assert "adherence" not in markdown(report).split("\n\n")[1]


@_needs("FluxTransformer2DModel", "WanTransformer3DModel")
def test_missing_weights_name_the_training_command(tmp_path):
    from tokenmerge.fashion.mosaic import load_fashion_mosaic
    from tokenmerge.fashion.video_long import load_fashion_video_long

    with pytest.raises(FileNotFoundError, match="train_fashion_mosaic.py"):
        load_fashion_mosaic(tmp_path / "none.safetensors")
    with pytest.raises(FileNotFoundError, match="train_fashion_video_long.py"):
        load_fashion_video_long(tmp_path / "none.safetensors")
    with pytest.raises(FileNotFoundError, match="train_fashion_classifier.py"):
        load_classifier(tmp_path / "none.safetensors")


def test_classifier_weights_load_and_classify():
    model, ref = load_classifier()
    for form in ("item", "frame"):
        assert ref[f"{form}.mean"].shape == (11, 64) and ref[f"{form}.cov"].shape == (11, 64, 64)
    if not (data.DATA / "t10k-images-idx3-ubyte.gz").exists():
        pytest.skip("Fashion-MNIST is not at /usr/share/datasets/fashion-mnist (apt-get install dataset-fashion-mnist)")
    images, labels = data.load_split("test")
    with torch.no_grad():
        predicted = model((images[:1000] + 1) / 2).argmax(-1)
        blank = model(torch.zeros(4, 1, 32, 32)).argmax(-1)
    assert float((predicted == labels[:1000]).float().mean()) > 0.85
    assert blank.tolist() == [data.EMPTY] * 4


@_needs("FluxTransformer2DModel", "WanTransformer3DModel")
def test_trained_testbeds_load():
    from tokenmerge.fashion.mosaic import MOSAIC_WEIGHTS, load_fashion_mosaic
    from tokenmerge.fashion.video_long import VIDEO_LONG_WEIGHTS, load_fashion_video_long

    assert MOSAIC_WEIGHTS.is_file() and VIDEO_LONG_WEIGHTS.is_file()  # shipped, not downloaded
    mosaic, video = load_fashion_mosaic(), load_fashion_video_long()
    assert not mosaic.transformer.training and not video.transformer.training
    x = mosaic("a bag at the top left", num_inference_steps=1, output_type="pt").images
    assert x.shape == (1, 1, 64, 64) and torch.isfinite(x).all()


def test_testbed_configs():
    from tokenmerge.fashion.dit import DIT_CONFIG
    from tokenmerge.fashion.mosaic import MOSAIC_CONFIG

    assert MOSAIC_CONFIG == DIT_CONFIG  # the mosaic model's transformer starts from fashion-dit's weights


def test_quality_cli_knows_the_testbeds():
    from tokenmerge.cli.quality import EMBEDDED, default_prompts
    from tokenmerge.quality.prompts import load_prompts

    assert {"fashion-mosaic", "fashion-video-long"} <= set(EMBEDDED)

    class Args:
        model = "fashion-mosaic"

    assert default_prompts(Args) == "mosaics"
    prompts = load_prompts("mosaics", count=5)
    assert prompts == data.mosaic_prompts(5) and all(data.parse_mosaic(p) for p in prompts)


def test_collect_puts_the_scores_in_the_report(tmp_path):
    from PIL import Image

    from tokenmerge.quality.images import ImageCache
    from tokenmerge.quality.report import markdown
    from tokenmerge.quality.run import VANILLA, QualityJob, collect
    from tokenmerge.tools.methods import parse_spec

    spec = parse_spec("tome:0.5")
    job = QualityJob("m", ["a bag", "a coat"], [0], [spec], 2, cache=tmp_path)
    items = [("a bag", 0), ("a coat", 0)]
    cache = ImageCache(tmp_path)
    shade = {("a bag", "vanilla"): 204, ("a coat", "vanilla"): 102, ("a bag", spec.label): 204,
             ("a coat", spec.label): 26}  # 0.8 -> bag (8); 0.4 -> coat (4); 0.1 -> 1: the merged coat is wrong
    for prompt, _ in items:
        for s in (VANILLA, spec):
            cache.store(job.key(s, prompt, 0), Image.new("L", (32, 32), shade[(prompt, s.label)]), {"seconds": 1.0})
    report = collect(job, items, scorer=_stub_scorer("image"))
    by_label = {m["label"]: m for m in report["methods"]}
    assert by_label["vanilla"]["adherence"] == 1.0 and by_label[spec.label]["adherence"] == 0.5
    assert [r["adherence"] for r in report["images"] if r["label"] == spec.label] == [1.0, 0.0]
    assert report["distribution"] == {"crops": "image", "per_method": 2}
    text = markdown(report)
    assert "| 100.0% ± 0.0% |" in text and "| 50.0% ± " in text
    skipped = collect(job, items, scorer=_stub_scorer("mosaic"))  # "a bag" is no mosaic sentence
    assert skipped["distribution"].startswith("skipped:") and "adherence" not in skipped["methods"][0]
    assert "FD and prompt adherence: skipped" in markdown(skipped)
    assert "distribution" not in collect(job, items)


@_needs("FluxTransformer2DModel", "WanTransformer3DModel")
def test_the_testbeds_sample_on_their_pipelines_time_grids():
    """Each flow testbed's transformer is called at the time grid of the pipeline it stands for, computed here from
    the shift's formula (sigma' = s sigma / (1 + (s - 1) sigma)) independently of diffusers: the mosaic at Flux.1-dev
    1024's (Flux's grid, shift e^1.15), the DiT at SD3's (shift 3), the video testbeds at Wan 2.1 480p's (UniPC on
    flow sigmas, shift 3); a shift given by ``schedulers.swap`` reaches the calls; shift 1 is the linear grid."""
    import math

    from tokenmerge.fashion import schedulers
    from tokenmerge.fashion.dit import ClassText, FashionDiT, build_dit
    from tokenmerge.fashion.video import ClassTokens, FashionVideo, build_video

    def flux_grid(steps, shift):  # Flux's sigmas linspace(1, 1/N, N), shifted
        return [shift * s / (1 + (shift - 1) * s) for s in (1 - k / steps for k in range(steps))]

    def called(pipe, steps, scale, prompt="a bag"):
        calls = _inputs_of(pipe.transformer, lambda: pipe([prompt], num_inference_steps=steps, output_type="pt"))
        return [float(c["timestep"][0]) / scale for c in calls]

    torch.manual_seed(0)
    mosaic, dit = _random_mosaic(), FashionDiT(build_dit().eval(), ClassText().eval())
    video = FashionVideo(build_video().eval(), ClassTokens().eval())
    assert called(mosaic, 7, 1.0, "a bag at the top left") == pytest.approx(flux_grid(7, math.exp(1.15)), abs=1e-6)
    assert called(dit, 7, 1.0) == pytest.approx(flux_grid(7, 3.0), abs=1e-6)
    wan = [3.0 * s / (1 + 2.0 * s) for s in (1 - k / 7 * (1 - 1 / 1000) for k in range(7))]  # Wan's UniPC grid
    assert called(video, 7, 1000.0) == pytest.approx(wan, abs=1.5e-3)  # (its timesteps are integers)
    schedulers.swap(mosaic, shift=1.0)
    assert called(mosaic, 7, 1.0, "a bag at the top left") == pytest.approx(flux_grid(7, 1.0), abs=1e-6)
    schedulers.swap(mosaic, "unipc", 5.0)
    assert type(mosaic.scheduler).__name__ == "UniPCMultistepScheduler" and schedulers.describe(mosaic.scheduler) \
        == "unipc shift 5"
    with pytest.raises(ValueError, match="shift must be a finite number > 0"):
        schedulers.swap(mosaic, shift=0.0)
    with pytest.raises(ValueError, match="scheduler must be one of euler, unipc"):
        schedulers.swap(mosaic, "ddim")
