"""The embedded transformers (tokenmerge/fashion/dit.py, video.py), their training data and the quality command's
clip scores. Random weights here: what the trained ones look like is in benchmarks/results (their sample grids)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import tokenmerge

pytestmark = pytest.mark.usefixtures("fast_cpu")
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _need(cls: str) -> None:
    import diffusers

    if not hasattr(diffusers, cls):
        pytest.skip(f"diffusers {diffusers.__version__} has no {cls} (the embedded transformer's class)")


@pytest.fixture(scope="module")
def dit():
    _need("FluxTransformer2DModel")
    from tokenmerge.fashion.dit import ClassText, FashionDiT, build_dit

    torch.manual_seed(0)
    return FashionDiT(build_dit().eval(), ClassText().eval())


@pytest.fixture(scope="module")
def video():
    _need("WanTransformer3DModel")
    from tokenmerge.fashion.video import ClassTokens, FashionVideo, build_video

    torch.manual_seed(0)
    return FashionVideo(build_video().eval(), ClassTokens().eval())


def _gen(pipe, steps=2, **kw):
    return pipe(["a sneaker", "Bag", "dress"], num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                output_type="pt", **kw)


@pytest.mark.parametrize("which", ["dit", "video"])
def test_embedded_transformers_merge_and_restore(which, request):
    pipe = request.getfixturevalue(which)
    plain = _gen(pipe).images
    assert plain.shape == ((3, 1, 32, 32) if which == "dit" else (3, 1, 32, 8 * 32))
    family = "diffusers-flux" if which == "dit" else "wan"
    for apply in (lambda: tokenmerge.apply_patch(pipe, ratio=0.5), lambda: tokenmerge.apply_todo(pipe, downsample=2),
                  lambda: tokenmerge.apply_patch(pipe, ratio=0.5, scope="block")):
        apply()
        assert tokenmerge.describe_patch(pipe).denoisers[0].family == family
        changed = _gen(pipe).images
        tokenmerge.remove_patch(pipe)
        assert torch.isfinite(changed).all() and not torch.equal(changed, plain)
        assert torch.equal(_gen(pipe).images, plain)


def test_video_frames_and_strips_agree(video):
    from tokenmerge.fashion.video import strip

    out = _gen(video)
    assert out.frames.shape == (3, 8, 1, 32, 32)
    assert torch.equal(strip(out.frames), out.images)
    assert torch.equal(out.images[..., 32:64], out.frames[:, 1])  # frame 1 is the strip's second square


def test_moving_clips_move_and_stay_in_frame():
    _need("WanTransformer3DModel")  # the script imports the video model's module
    sys.path.insert(0, str(SCRIPTS))
    from train_fashion_video import ITEM, clips

    from tokenmerge.fashion.data import bounce

    items = torch.full((6, 1, 28, 28), -1.0)
    items[:, :, 2:-2, 2:-2] = 1.0  # a bright 24 x 24 square
    c = clips(items, torch.Generator().manual_seed(1))
    assert c.shape == (6, 1, 8, 32, 32)
    bright = (c > 0).flatten(3).sum(-1)  # every frame shows the whole item
    assert (bright == ITEM * ITEM).all()
    moved = (c[:, :, 1:] != c[:, :, :-1]).flatten(2).any(-1)
    assert moved.float().mean() > 0.5  # most frame pairs differ (1-2 px a frame, rounded)
    p = bounce(torch.tensor([7.5]), torch.tensor([2.0]), 8, 8)
    assert p.min() >= 0 and p.max() <= 8 and torch.allclose(p[0, :3], torch.tensor([7.5, 6.5, 4.5]))


def test_video_scores():
    from tokenmerge.quality.metrics import psnr, video_scores

    g = torch.Generator().manual_seed(0)
    a = torch.rand(1, 16, 16 * 4, generator=g)
    frame_psnr, frame_ssim, temporal = video_scores(a, a.clone(), 4)
    assert frame_psnr == float("inf") and frame_ssim == pytest.approx(1.0) and temporal == float("inf")
    b = a + 0.05  # the same motion, every frame brighter: frames differ, motion does not
    frame_psnr, _, temporal = video_scores(b, a, 4)
    assert frame_psnr == pytest.approx(float(psnr(b, a)), abs=1e-4) and temporal > 100
    c = a.clone()
    c[..., 16:32] = a[..., 32:48]  # frame 1 replaced by frame 2: a jump in the motion
    assert video_scores(c, a, 4)[2] < video_scores(a + 0.05 * torch.rand(a.shape, generator=g), a, 4)[2]


def test_missing_weights_name_the_training_script(tmp_path):
    _need("WanTransformer3DModel")
    from tokenmerge.fashion import load_fashion_dit, load_fashion_video

    with pytest.raises(FileNotFoundError, match="train_fashion_dit"):
        load_fashion_dit(tmp_path / "none.safetensors")
    with pytest.raises(FileNotFoundError, match="train_fashion_video"):
        load_fashion_video(tmp_path / "none.safetensors")


@pytest.mark.slow  # two processes load the dataset and diffusers: about a minute
def test_training_resumes_and_writes_loadable_weights(tmp_path):
    """Two steps, then two more from the checkpoint; the weights load into the pipeline (the video script
    shares the loop, scripts/flow_training.py)."""
    import subprocess

    _need("FluxTransformer2DModel")
    from tokenmerge.fashion import load_fashion_dit

    if not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").is_file():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    cmd = [sys.executable, str(SCRIPTS / "train_fashion_dit.py"), "--batch", "2", "--save-every", "1",
           "--out", str(tmp_path / "w.safetensors"), "--checkpoint", str(tmp_path / "c.ckpt")]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    first = subprocess.run(cmd + ["--steps", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    second = subprocess.run(cmd + ["--steps", "3"], capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0 and "resumed at step 2" in second.stdout, second.stderr[-2000:]
    pipe = load_fashion_dit(tmp_path / "w.safetensors")
    assert _gen(pipe, steps=1).images.shape == (3, 1, 32, 32)
    assert (tmp_path / "fashion_dit_samples.png").stat().st_size > 0


def _need_cache(name: str) -> None:
    import diffusers

    try:
        import diffusers.hooks as hooks
    except ImportError:
        pytest.skip(f"diffusers {diffusers.__version__} has no cache hooks (diffusers.hooks)")
    if not hasattr(hooks, name):
        pytest.skip(f"diffusers {diffusers.__version__} has no {name}")


@pytest.mark.parametrize("which,spec", [("dit", "fbc:100"), ("dit", "taylorseer:2,disable_cache_before_step=1"),
                                        pytest.param("dit", "pab:2", marks=pytest.mark.slow), ("video", "fbc:100"),
                                        pytest.param("video", "pab:2", marks=pytest.mark.slow)])
def test_diffusers_caches_run_on_the_embedded_transformers_and_come_off(which, spec, request):
    """The embedded pipelines run their transformer as diffusers' pipelines do (cache_context, current_timestep,
    the cache state reset per generation): each cache changes the images, skips linear work, and comes off
    bit-identically; a second generation gives the first's images (no state left over). Thresholds are extreme:
    random weights change fast. (TaylorSeer's default patterns miss Wan's attn1/attn2: diffusers' own limit.)"""
    from tokenmerge.quality.run import linear_work
    from tokenmerge.tools.methods import parse_spec

    _need_cache({"fbc": "FirstBlockCacheConfig", "taylorseer": "TaylorSeerCacheConfig",
                 "pab": "PyramidAttentionBroadcastConfig"}[spec.split(":")[0]])
    pipe, method = request.getfixturevalue(which), parse_spec(spec)
    with linear_work(pipe) as plain_work:
        plain = _gen(pipe, steps=6).images
    with method.applied(pipe):
        with linear_work(pipe) as work:
            cached = _gen(pipe, steps=6).images
        again = _gen(pipe, steps=6).images
    assert torch.isfinite(cached).all() and not torch.equal(cached, plain)
    assert torch.equal(again, cached)
    assert 0 < work[0] < plain_work[0]
    assert torch.equal(_gen(pipe, steps=6).images, plain)


def test_a_cache_with_token_merging_runs_together_or_is_refused_by_name(dit):
    """First Block Cache keeps whole blocks' outputs in full token space: it runs with ToMe. Pyramid Attention
    Broadcast keeps an attention output, which merged tokens would make wrong: refused, naming it."""
    from tokenmerge.tools.methods import parse_spec

    _need_cache("FirstBlockCacheConfig")
    plain = _gen(dit, steps=4).images
    with parse_spec("tome:0.5+fbc:100").applied(dit):
        both = _gen(dit, steps=4).images
    with parse_spec("fbc:100").applied(dit):
        cache_only = _gen(dit, steps=4).images
    assert not torch.equal(both, cache_only) and not torch.equal(both, plain)
    assert torch.equal(_gen(dit, steps=4).images, plain)
    with pytest.raises(ValueError, match="Pyramid Attention Broadcast"):  # PAB inside blocks merged whole
        with parse_spec("tome:0.5,scope=block+pab:2").applied(dit):
            _gen(dit, steps=4)
    assert tokenmerge.describe_patch(dit) is None and torch.equal(_gen(dit, steps=4).images, plain)


def test_cache_specs_are_checked():
    from tokenmerge.tools.methods import parse_spec

    _need_cache("TaylorSeerCacheConfig")
    assert parse_spec("fbc").text == "fbc:0.05" and parse_spec("taylorseer").text == "taylorseer:5"
    assert parse_spec("fbc:0.1+tome:0.5,match_radius=1").label == "tome 0.5 match_radius=1 + fbc 0.1"
    for bad, words in (("fbc:0.1,nope=1", "nope"), ("taylorseer:0.5", "positive integer"),
                       ("tome:0.5+todo:2", "one cache"), ("fbc+pab", "one cache")):
        with pytest.raises(ValueError, match=words):
            parse_spec(bad)
    with pytest.raises(ValueError, match="across steps"):
        parse_spec("fbc", bench=True)
    with pytest.raises(ValueError, match="quality"):
        parse_spec("tome:0.5+fbc", bench=True)


def test_a_block_cache_with_whole_block_merging_is_refused(video):
    """With scope="block" a cache's hook on a block sees merged tokens (First Block Cache compared residuals of
    256 and 512 tokens across a schedule's boundary and crashed inside diffusers): refused, naming the cache."""
    from tokenmerge.tools.methods import parse_spec

    _need_cache("FirstBlockCacheConfig")
    plain = _gen(video, steps=2).images
    for spec in ("tome:0.5,scope=block,start=0.5+fbc:0.05", "tome:0.5,scope=block+fbc:100"):
        with pytest.raises(ValueError, match="First Block Cache"):
            with parse_spec(spec).applied(video):
                _gen(video, steps=2)
        assert tokenmerge.describe_patch(video) is None
    assert torch.equal(_gen(video, steps=2).images, plain)


def test_magcache_calibrates_once_then_skips_and_comes_off(dit):
    """MagCache without ratios: refused by name until calibrated; ``calibrate`` runs one generation in diffusers'
    calibration mode (it skips nothing), keeps one ratio per step for the transformer (once per step count), and
    the cache then skips linear work and comes off bit-identically."""
    from tokenmerge.quality.run import linear_work
    from tokenmerge.tools import peers as caches
    from tokenmerge.tools.methods import parse_spec

    _need_cache("MagCacheConfig")
    spec = parse_spec("magcache:100")
    assert spec.text == "magcache:100" and caches.needs_calibration(spec)
    assert not caches.needs_calibration(parse_spec("fbc:0.1"))
    assert caches.needs_calibration(parse_spec("reuse:0.5+magcache:0.1"))
    caches._RATIOS.pop(dit.transformer, None)
    with pytest.raises(ValueError, match="mag_ratios"):
        with spec.applied(dit):
            pass
    with linear_work(dit) as plain_work:
        plain = _gen(dit, steps=6).images
    runs = []
    ratios = caches.calibrate(dit, lambda: runs.append(_gen(dit, steps=6).images), 6)
    assert len(ratios) == 6 and all(r > 0 for r in ratios) and torch.equal(runs[0], plain)  # nothing skipped
    assert caches.calibrate(dit, lambda: runs.append(None), 6) is ratios and len(runs) == 1  # kept
    with spec.applied(dit):
        with linear_work(dit) as work:
            cached = _gen(dit, steps=6).images
    assert torch.isfinite(cached).all() and not torch.equal(cached, plain) and 0 < work[0] < plain_work[0]
    assert torch.equal(_gen(dit, steps=6).images, plain)
