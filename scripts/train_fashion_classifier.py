"""Train the Fashion-MNIST classifier that `tokenmerge quality` scores generated images with
(tokenmerge/fashion/classifier.py), and compute its reference statistics of real data.

Data: Debian's `dataset-fashion-mnist` package, read from /usr/share/datasets/fashion-mnist. Training images are
the train split's, each shifted by up to 4 px, shrunk to 80-105%, flipped left-right at random and dimmed to 70-100%;
a tenth of each batch is "no item" (background with faint noise: an empty mosaic cell). At the end: the weights (fp16)
and, per form ("item": the test split as it is; "frame": each test item shrunk to 24 px at a random place in a 32 px
frame, as the video models draw it) and class, the mean and covariance of the 64 penultimate features (float32), to
--out; a JSON log beside it with the test accuracy.

    .venv/bin/python scripts/train_fashion_classifier.py [--epochs 4] [--batch 128] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tokenmerge.fashion.classifier import CLASSIFIER_WEIGHTS, FORMS, FashionClassifier  # noqa: E402
from tokenmerge.fashion.data import EMPTY, load_split, moving_clips  # noqa: E402


def augment(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(n, 1, 32, 32)`` in [-1, 1] -> shifted, shrunk, flipped, dimmed copies in [0, 1]."""
    n = x.shape[0]
    scale = 1 / (0.8 + 0.25 * torch.rand(n, generator=generator))  # the grid's scale: > 1 shrinks the item
    flip = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    shift = (torch.rand(n, 2, generator=generator) * 2 - 1) * (4 / 16)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 1, 1] = scale * flip, scale
    theta[:, :, 2] = shift
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample((x + 1) / 2, grid, align_corners=False, padding_mode="zeros")
    return out * (0.7 + 0.3 * torch.rand(n, 1, 1, 1, generator=generator))


def blanks(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    noise = torch.rand(n, 1, 1, 1, generator=generator) * 0.08
    return (torch.randn(n, 1, 32, 32, generator=generator) * noise).abs()


@torch.no_grad()
def evaluate(model, x01: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    preds = torch.cat([model(x01[i:i + 1000]).argmax(-1) for i in range(0, len(x01), 1000)])
    return float((preds == labels).float().mean())


@torch.no_grad()
def moments(model, x01: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per class 0..EMPTY: count, mean and covariance of the features (float64, then stored float32)."""
    model.eval()
    feats = torch.cat([model.features(x01[i:i + 1000]) for i in range(0, len(x01), 1000)]).double()
    count, mean, cov = [], [], []
    for c in range(EMPTY + 1):
        f = feats[labels == c]
        count.append(len(f))
        mean.append(f.mean(0))
        cov.append(torch.cov(f.T) if len(f) > 1 else torch.zeros(f.shape[1], f.shape[1], dtype=f.dtype))
    return {"count": torch.tensor(count, dtype=torch.float32), "mean": torch.stack(mean).float(),
            "cov": torch.stack(cov).float()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=float, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=CLASSIFIER_WEIGHTS)
    args = ap.parse_args()
    from safetensors.torch import save_file

    torch.manual_seed(args.seed)
    images, labels = load_split("train")
    test_images, test_labels = load_split("test")
    model = FashionClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    steps = int(args.epochs * len(images) / args.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) *
                                              0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    started, losses, log = time.time(), [], []
    n_blank = args.batch // 10
    for step in range(1, steps + 1):
        model.train()
        idx = torch.randint(0, len(images), (args.batch - n_blank,))
        x = torch.cat([augment(images[idx]), blanks(n_blank)])
        y = torch.cat([labels[idx], torch.full((n_blank,), EMPTY)])
        loss = F.cross_entropy(model(x), y, label_smoothing=0.05)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps:
            acc = evaluate(model, (test_images[:2000] + 1) / 2, test_labels[:2000])
            line = f"step {step}/{steps} loss {np.mean(losses[-100:]):.4f} test acc (2000) {acc:.4f} " \
                   f"{(time.time() - started) / 60:.1f} min"
            log.append(line)
            print(line, flush=True)

    g = torch.Generator().manual_seed(1)
    test01 = (test_images + 1) / 2
    frames = moving_clips(test_images, 8, generator=g)  # (n, 1, 8, 32, 32): one random frame of each clip
    pick = torch.randint(0, 8, (len(frames),), generator=g)
    frames01 = (frames[torch.arange(len(frames)), :, pick] + 1) / 2
    blank01 = torch.zeros(500, 1, 32, 32)
    accuracy = {"test (10000, as is)": evaluate(model, test01, test_labels),
                "test as video frames (24 px, moved)": evaluate(model, frames01, test_labels),
                "test augmented (shifted, shrunk, flipped, dimmed)": evaluate(model, augment(test_images, g),
                                                                               test_labels),
                "empty cells (faint noise)": evaluate(model, blanks(500, g), torch.full((500,), EMPTY))}
    print(accuracy, flush=True)
    state = {f"model.{k}": (v.half() if v.is_floating_point() else v).contiguous()
             for k, v in model.state_dict().items()}
    for form, x in zip(FORMS, (test01, frames01)):
        stats = moments(model, torch.cat([x, blank01]), torch.cat([test_labels, torch.full((500,), EMPTY)]))
        state.update({f"ref.{form}.{k}": v.contiguous() for k, v in stats.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"steps": str(steps), "batch": str(args.batch)})
    os.replace(tmp, args.out)
    info = {"epochs": args.epochs, "steps": steps, "batch": args.batch, "lr": args.lr, "seed": args.seed,
            "minutes": round((time.time() - started) / 60, 1), "torch_threads": torch.get_num_threads(),
            "accuracy": {k: round(v, 4) for k, v in accuracy.items()},
            "data": "Fashion-MNIST train split (Debian dataset-fashion-mnist), augmented; reference statistics: "
                    "the test split as is ('item') and as video frames ('frame'), plus 500 black images (EMPTY)",
            "log": log}
    args.out.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
