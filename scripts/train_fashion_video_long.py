"""Train the embedded long-video testbed (tokenmerge/fashion/video_long.py): the Wan-style DiT on 32-frame clips
(2,048 tokens a call), started from the shipped 8-frame model's weights (--init; the architecture is the same).

Data: Debian's `dataset-fashion-mnist` package, read from /usr/share/datasets/fashion-mnist; clips synthesised on
the fly as scripts/train_fashion_video.py makes them (tokenmerge/fashion/data.py `moving_clips`), 32 frames long:
a train-split item shrunk to 24 x 24 moving at 1-2 px a frame in a random direction on a 32 x 32 frame, bouncing
off its edges; the label is the item's class. The loop (rectified flow, EMA, resumable checkpoints) is
scripts/flow_training.py. At the end: EMA weights (fp16) to --out, a JSON log, a frame-strip grid (one row per
class) and an animated GIF beside them.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_fashion_video_long.py [--steps 400] [--batch 8] [--lr 3e-4] \
        [--save-every 50] [--out PATH] [--checkpoint PATH] [--init fashion/weights/fashion_video.safetensors]

`--samples PNG`: no training; a frame-strip grid of the checkpoint's EMA model and exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flow_training import arguments, save_grid, train  # noqa: E402
from train_fashion_video import save_gif  # noqa: E402

from tokenmerge.fashion.data import load_split, moving_clips  # noqa: E402
from tokenmerge.fashion.model import CLASS_NAMES, NULL_CLASS  # noqa: E402
from tokenmerge.fashion.video import VIDEO_WEIGHTS, ClassTokens, build_video  # noqa: E402
from tokenmerge.fashion.video_long import LONG_FRAMES, VIDEO_LONG_WEIGHTS, FashionVideoLong  # noqa: E402

DATA = ("moving Fashion-MNIST, long: train-split items shrunk to 24x24 bouncing on a 32x32 frame, 32 frames, "
        "1-2 px/frame (synthesised by tokenmerge/fashion/data.py moving_clips)")


def samples(pipe: FashionVideoLong, grid: Path, gif: Path | None = None) -> None:
    prompts = [name for name in CLASS_NAMES for _ in range(2)]
    out = pipe(prompts, num_inference_steps=20, guidance_scale=2.0, generator=torch.Generator().manual_seed(0),
               output_type="pt")
    save_grid(out.images, len(CLASS_NAMES), grid)
    if gif is not None:
        save_gif(out.frames[::2], gif)


def main() -> None:
    where = sys.argv.index("--samples") if "--samples" in sys.argv else None
    sample_png = None
    if where is not None:
        sample_png = Path(sys.argv[where + 1])
        del sys.argv[where: where + 2]
    args = arguments(__doc__, 400, 8, VIDEO_LONG_WEIGHTS, "train-fashion-video-long.ckpt")
    if args.init is None:
        args.init = VIDEO_WEIGHTS
    torch.manual_seed(args.seed)
    model, text = build_video(), ClassTokens()
    if sample_png is not None:
        ck = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(ck["ema_transformer"]), text.load_state_dict(ck["ema_text"])
        samples(FashionVideoLong(model.eval(), text.eval()), sample_png, sample_png.with_suffix(".gif"))
        print(f"wrote {sample_png} (EMA of step {ck['step']})", flush=True)
        return
    images, labels = load_split("train")

    def batch(n):
        idx = torch.randint(0, len(images), (n,))
        return moving_clips(images[idx], LONG_FRAMES), labels[idx]

    live = FashionVideoLong(model, text)

    def velocity(model, text, xt, t, y):
        return live.velocity(xt, t, text(y))

    ema = train(args, model, text, batch, velocity, NULL_CLASS, DATA)
    pipe = FashionVideoLong(ema["transformer"], ema["text"])
    samples(pipe, args.grid or args.out.with_name("fashion_video_long_samples.png"),
            args.out.with_name("fashion_video_long_samples.gif"))
    print(f"wrote {args.out} and its samples", flush=True)


if __name__ == "__main__":
    main()
