"""Train the embedded Fashion-MNIST image transformer (tokenmerge/fashion/dit.py): a small Flux.1-style DiT.

Data: Debian's `dataset-fashion-mnist` package (`apt-get install dataset-fashion-mnist`), read from
/usr/share/datasets/fashion-mnist (as scripts/train_fashion.py): 28 x 28 padded to 32 x 32, random flips.
The loop (rectified flow, EMA, resumable checkpoints) is scripts/flow_training.py. At the end: the EMA weights (fp16)
to --out, a JSON log beside them, and a sample grid (one row per class, 20 Euler steps, guidance 2).

    .venv/bin/python scripts/train_fashion_dit.py [--steps 1500] [--batch 64] [--out PATH] [--checkpoint PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flow_training import arguments, save_grid, train  # noqa: E402

from tokenmerge.fashion.data import load_split  # noqa: E402
from tokenmerge.fashion.dit import DIT_WEIGHTS, ClassText, FashionDiT, build_dit  # noqa: E402
from tokenmerge.fashion.model import CLASS_NAMES, NULL_CLASS  # noqa: E402


def main() -> None:
    args = arguments(__doc__, 1500, 64, DIT_WEIGHTS, "train-fashion-dit.ckpt")
    torch.manual_seed(args.seed)
    images, labels = load_split("train")

    def batch(n):
        idx = torch.randint(0, len(images), (n,))
        x0 = images[idx]
        flip = torch.rand(n) < 0.5
        x0[flip] = x0[flip].flip(-1)
        return x0, labels[idx]

    model, text = build_dit(), ClassText()
    live = FashionDiT(model, text)

    def velocity(model, text, xt, t, y):
        return live.velocity(xt, t, *text(y))

    ema = train(args, model, text, batch, velocity, NULL_CLASS,
                "Fashion-MNIST train split (Debian dataset-fashion-mnist), 28x28 padded to 32x32, random flips")
    pipe = FashionDiT(ema["transformer"], ema["text"])
    prompts = [name for name in CLASS_NAMES for _ in range(8)]
    grid = pipe(prompts, num_inference_steps=20, guidance_scale=2.0, generator=torch.Generator().manual_seed(0),
                output_type="pt").images
    save_grid(grid, len(CLASS_NAMES), args.grid or args.out.with_name("fashion_dit_samples.png"))
    print(f"wrote {args.out} and its sample grid", flush=True)


if __name__ == "__main__":
    main()
