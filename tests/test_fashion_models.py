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
    from train_fashion_video import ITEM, bounce, clips

    items = torch.full((6, 1, 28, 28), -1.0)
    items[:, :, 2:-2, 2:-2] = 1.0  # a bright 24 x 24 square
    c = clips(items, torch.Generator().manual_seed(1))
    assert c.shape == (6, 1, 8, 32, 32)
    bright = (c > 0).flatten(3).sum(-1)  # every frame shows the whole item
    assert (bright == ITEM * ITEM).all()
    moved = (c[:, :, 1:] != c[:, :, :-1]).flatten(2).any(-1)
    assert moved.float().mean() > 0.5  # most frame pairs differ (1-2 px a frame, rounded)
    p = bounce(torch.tensor([7.5]), torch.tensor([2.0]), 8)
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
