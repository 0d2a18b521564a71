"""Train the embedded moving-Fashion-MNIST video transformer (tokenmerge/fashion/video.py): a small Wan-style DiT.

Data: Debian's `dataset-fashion-mnist` package (`apt-get install dataset-fashion-mnist`), read from
/usr/share/datasets/fashion-mnist. Clips are synthesised on the fly: an item of the train split, shrunk to
24 x 24, on a 32 x 32 background, moving in a straight line at 1-2 pixels a frame in a random direction and
bouncing off the frame's edges, 8 frames; the label is the item's class. The loop (rectified flow, EMA, resumable
checkpoints) is scripts/flow_training.py. At the end: EMA weights (fp16) to --out, a JSON log, a frame-strip grid
(one row per class) and an animated GIF of the first clip of each class beside them.

    .venv/bin/python scripts/train_fashion_video.py [--steps 2000] [--batch 16] [--out PATH] [--checkpoint PATH]

The shipped weights are two stages (logs: benchmarks/results/training/fashion-video{,-stage2}.log):

    # stage 1: 3000 steps at lr 5e-4 (run as --steps 2000, then resumed with --steps 3000)
    .venv/bin/python scripts/train_fashion_video.py --steps 3000 --out /tmp/fv1/fashion_video.safetensors \
        --checkpoint /tmp/fv1/train.ckpt
    # stage 2: 3500 more steps from stage 1's weights at lr 3e-4 (a fresh optimiser and cosine schedule)
    .venv/bin/python scripts/train_fashion_video.py --init /tmp/fv1/fashion_video.safetensors --steps 3500 \
        --lr 3e-4 --out /tmp/fv2/fashion_video.safetensors --checkpoint /tmp/fv2/train.ckpt
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flow_training import arguments, save_grid, train  # noqa: E402

from tokenmerge.fashion.data import load_split, moving_clips  # noqa: E402
from tokenmerge.fashion.model import CLASS_NAMES, NULL_CLASS  # noqa: E402
from tokenmerge.fashion.video import FRAMES, SIZE, VIDEO_WEIGHTS, ClassTokens, FashionVideo, build_video  # noqa: E402

ITEM = 24


def clips(items: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n, 1, 28, 28) items in [-1, 1] -> (n, 1, FRAMES, SIZE, SIZE) moving clips (integer pixel steps)."""
    return moving_clips(items, FRAMES, SIZE, ITEM, generator)


def save_gif(frames: torch.Tensor, path: Path) -> None:
    """(n, F, 1, H, W) in [0, 1] -> one animated GIF, the n clips side by side, 3x upscaled."""
    from PIL import Image

    n, f, _, h, w = frames.shape
    row = frames[:, :, 0].permute(1, 2, 0, 3).reshape(f, h, n * w)
    pics = [Image.fromarray((fr.clamp(0, 1).numpy() * 255).round().astype("uint8")).resize((n * w * 3, h * 3),
                                                                                           Image.NEAREST)
            for fr in row]
    pics[0].save(path, save_all=True, append_images=pics[1:], duration=150, loop=0)


def main() -> None:
    args = arguments(__doc__, 2000, 16, VIDEO_WEIGHTS, "train-fashion-video.ckpt")
    torch.manual_seed(args.seed)
    images, labels = load_split("train")

    def batch(n):
        idx = torch.randint(0, len(images), (n,))
        return clips(images[idx]), labels[idx]

    model, text = build_video(), ClassTokens()
    live = FashionVideo(model, text)

    def velocity(model, text, xt, t, y):
        return live.velocity(xt, t, text(y))

    ema = train(args, model, text, batch, velocity, NULL_CLASS,
                "moving Fashion-MNIST: train-split items shrunk to 24x24 bouncing on a 32x32 frame, 8 frames, "
                "1-2 px/frame (synthesised by scripts/train_fashion_video.py)")
    pipe = FashionVideo(ema["transformer"], ema["text"])
    prompts = [name for name in CLASS_NAMES for _ in range(2)]
    out = pipe(prompts, num_inference_steps=20, guidance_scale=2.0, generator=torch.Generator().manual_seed(0),
               output_type="pt")
    save_grid(out.images, len(CLASS_NAMES), args.grid or args.out.with_name("fashion_video_samples.png"))
    save_gif(out.frames[::2], args.out.with_name("fashion_video_samples.gif"))
    print(f"wrote {args.out} and its samples", flush=True)


if __name__ == "__main__":
    main()
