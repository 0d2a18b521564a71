"""Train the embedded mosaic testbed (tokenmerge/fashion/mosaic.py): a Flux.1-style DiT with 1,024 image tokens
and a small text encoder of 32 tokens, trained together.

Data: Debian's `dataset-fashion-mnist` package, read from /usr/share/datasets/fashion-mnist, synthesised on the
fly (tokenmerge/fashion/data.py): 64 x 64 mosaics of 2 x 2 cells of 32 px, each cell empty with probability 0.3
or else a train-split item of a uniformly drawn class (28 px centred in the cell, flipped left-right at random);
the prompt is the mosaic's sentence, its cells said in a random order ("a bag at the top left and a sneaker at
the bottom right"; empty cells not said). A tenth of the prompts are dropped to all padding for classifier-free
guidance. The loop (rectified flow, EMA, resumable checkpoints, fp16 EMA weights, JSON log) is
scripts/flow_training.py. At the end: the weights to --out, the log beside them, a sample grid and its sentences.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_fashion_mosaic.py [--steps 1600] [--batch 16] [--out PATH] \
        [--checkpoint PATH]

`--init-transformer PATH` (default: the shipped fashion-dit weights, fashion/weights/fashion_dit.safetensors, a
transformer of the same configuration; `none`: random): the transformer starts from those weights (it knows how to
draw an item in a 16 x 16 token grid), the text encoder from random ones; the JSON log records it.

`--samples PNG`: no training; a grid of the checkpoint's EMA model (the sentences beside it, .txt) and exit: the way
to look at a run in progress.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flow_training import arguments, save_grid, train  # noqa: E402

from tokenmerge.fashion import data as fd  # noqa: E402
from tokenmerge.fashion.dit import DIT_WEIGHTS  # noqa: E402
from tokenmerge.fashion.mosaic import MOSAIC_WEIGHTS, PAD, FashionMosaic, SentenceEncoder  # noqa: E402
from tokenmerge.fashion.mosaic import build_mosaic as build_mosaic  # noqa: E402
from tokenmerge.fashion.mosaic import tokenize as tokenize  # noqa: E402

DATA = ("mosaics of Fashion-MNIST train-split items (Debian dataset-fashion-mnist): 64x64, 2x2 cells of 32 px, each "
        "empty with p=0.3 or an item of a uniform class (random flips), described by a sentence in random cell order "
        "(synthesised by tokenmerge/fashion/data.py)")


def sample_grid(pipe: FashionMosaic, path: Path, count: int = 16) -> None:
    """``count`` sentences of ``mosaic_prompts(count, seed=1)`` (4 per row), 20 Euler steps, guidance 3."""
    prompts = fd.mosaic_prompts(count, seed=1)
    images = pipe(prompts, num_inference_steps=20, guidance_scale=3.0, generator=torch.Generator().manual_seed(0),
                  output_type="pt").images
    save_grid(images, count // 4, path)
    path.with_suffix(".txt").write_text("\n".join(f"{i // 4},{i % 4}: {p}" for i, p in enumerate(prompts)) + "\n")


def _take(option: str, default: str | None = None) -> str | None:
    """The value of ``option`` on the command line (removed from it), or ``default``."""
    if option not in sys.argv:
        return default
    where = sys.argv.index(option)
    value = sys.argv[where + 1]
    del sys.argv[where: where + 2]
    return value


def main() -> None:
    samples = _take("--samples")
    samples = Path(samples) if samples is not None else None
    init = _take("--init-transformer", str(DIT_WEIGHTS))
    args = arguments(__doc__, 1600, 16, MOSAIC_WEIGHTS, "train-fashion-mosaic.ckpt")
    torch.manual_seed(args.seed)
    model, text = build_mosaic(), SentenceEncoder()
    if samples is not None:
        ck = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(ck["ema_transformer"]), text.load_state_dict(ck["ema_text"])
        sample_grid(FashionMosaic(model.eval(), text.eval()), samples)
        print(f"wrote {samples} (EMA of step {ck['step']})", flush=True)
        return
    if init != "none":
        from safetensors.torch import load_file

        state = load_file(init)
        model.load_state_dict({k[12:]: v.float() for k, v in state.items() if k.startswith("transformer.")})
        print(f"transformer initialised from {init}", flush=True)
    images, labels = fd.load_split("train")
    by_class = [torch.nonzero(labels == c)[:, 0] for c in range(fd.EMPTY)]

    def batch(n):
        layouts = fd.random_layouts(n, empty=0.3)
        cells = torch.full((n, fd.CELLS, 1, 32, 32), -1.0)
        for c in range(fd.EMPTY):
            where = layouts == c
            k = int(where.sum())
            if k:
                items = images[by_class[c][torch.randint(0, len(by_class[c]), (k,))]]
                flip = torch.rand(k) < 0.5
                items[flip] = items[flip].flip(-1)
                cells[where] = items
        return fd.mosaic(cells), tokenize(fd.random_sentences(layouts))

    live = FashionMosaic(model, text)

    def velocity(model, text, xt, t, y):
        return live.velocity(xt, t, *text(y))

    ema = train(args, model, text, batch, velocity, PAD, DATA)
    log_path = args.out.with_suffix(".json")
    log = json.loads(log_path.read_text())
    log["init_transformer"] = Path(init).name if init != "none" else None
    log_path.write_text(json.dumps(log, indent=1) + "\n")
    sample_grid(FashionMosaic(ema["transformer"], ema["text"]),
                args.grid or args.out.with_name("fashion_mosaic_samples.png"))
    print(f"wrote {args.out} and its sample grid", flush=True)


if __name__ == "__main__":
    main()
