"""The training loop shared by the embedded transformers (scripts/train_fashion_dit.py, train_fashion_video.py).

Rectified flow: t ~ logit-normal, x_t = (1 - t) x0 + t noise, loss = |velocity(x_t, t, class) - (noise - x0)|^2;
a fraction of the labels dropped to the "no class" slot for classifier-free guidance; AdamW with warm-up and a
cosine decay to 10%; EMA weights are what ships (fp16 safetensors, keys ``transformer.*`` and ``text.*``).

Warm start: ``--init WEIGHTS`` (a shipped ``.safetensors`` of the same model) starts the model, its text table and the
EMA from those weights instead of random ones (the log records it); the schedule is this run's own.

Resumable: every ``--save-every`` steps the whole state (model, EMA, optimiser, step, RNG, losses) goes to
``--checkpoint`` (a temporary file, then renamed); the same command continues from it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["arguments", "train", "save_grid"]


def arguments(doc: str, steps: int, batch: int, out: Path, checkpoint: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--ema", type=float, default=0.995)
    ap.add_argument("--uncond", type=float, default=0.1, help="fraction of labels dropped for guidance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--checkpoint", type=Path, default=Path(checkpoint))
    ap.add_argument("--grid", type=Path, default=None, help="sample grid PNG (default: beside --out)")
    ap.add_argument("--init", type=Path, default=None,
                    help="start from these weights (a .safetensors this script wrote) instead of random ones")
    return ap.parse_args()


def save_grid(images: torch.Tensor, rows: int, path: Path) -> None:
    """(rows * cols, 1, H, W) in [0, 1] -> one PNG, 2x upscaled, 2 px gaps."""
    from PIL import Image

    n, _, h, w = images.shape
    cols = n // rows
    canvas = np.ones((rows * (h + 2), cols * (w + 2)), np.uint8) * 255
    for i, img in enumerate(images[:, 0].clamp(0, 1).cpu().numpy()):
        r, c = divmod(i, cols)
        canvas[r * (h + 2): r * (h + 2) + h, c * (w + 2): c * (w + 2) + w] = (img * 255).round().astype(np.uint8)
    Image.fromarray(canvas).resize((canvas.shape[1] * 2, canvas.shape[0] * 2), Image.NEAREST).save(path)


def train(args, model: torch.nn.Module, text: torch.nn.Module, batch: Callable, velocity: Callable,
          null_class: int, data: str) -> dict:
    """Train ``model`` and ``text``; ``batch(n) -> (x0, labels)``; ``velocity(model, text, x_t, t, labels)``.

    Returns the EMA copies ``{"transformer": ..., "text": ...}`` after writing them to ``args.out``."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(args.seed)
    init = getattr(args, "init", None)
    if init is not None:
        if not init.is_file():
            raise SystemExit(f"--init: no weights file at {init}")
        state = load_file(str(init))
        model.load_state_dict({k[12:]: v.float() for k, v in state.items() if k.startswith("transformer.")})
        text.load_state_dict({k[5:]: v.float() for k, v in state.items() if k.startswith("text.")})
        prior = json.loads(init.with_suffix(".json").read_text()) if init.with_suffix(".json").is_file() else {}
    ema = {"transformer": copy.deepcopy(model).requires_grad_(False), "text": copy.deepcopy(text).requires_grad_(False)}
    params = list(model.parameters()) + list(text.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    start, losses, minutes = 0, [], 0.0
    if args.checkpoint.is_file():
        ck = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(ck["model"]), text.load_state_dict(ck["text"])
        ema["transformer"].load_state_dict(ck["ema_transformer"]), ema["text"].load_state_dict(ck["ema_text"])
        opt.load_state_dict(ck["opt"]), sched.load_state_dict(ck["sched"])
        torch.set_rng_state(ck["rng"])
        start, losses, minutes = ck["step"], ck["losses"], ck["minutes"]
        print(f"resumed at step {start} ({minutes:.1f} min so far)", flush=True)
    started = time.time()

    def elapsed() -> float:
        return minutes + (time.time() - started) / 60

    def checkpoint(step: int) -> None:
        tmp = args.checkpoint.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "text": text.state_dict(),
                    "ema_transformer": ema["transformer"].state_dict(), "ema_text": ema["text"].state_dict(),
                    "opt": opt.state_dict(), "sched": sched.state_dict(), "rng": torch.get_rng_state(), "step": step,
                    "losses": losses, "minutes": elapsed()}, tmp)
        os.replace(tmp, args.checkpoint)

    model.train()
    for step in range(start + 1, args.steps + 1):
        x0, y = batch(args.batch)
        y = y.clone()
        y[torch.rand(len(y)) < args.uncond] = null_class
        noise = torch.randn_like(x0)
        t = torch.sigmoid(torch.randn(len(y)))  # logit-normal: most steps in the middle of the path
        tt = t.view(-1, *([1] * (x0.dim() - 1)))
        loss = F.mse_loss(velocity(model, text, (1 - tt) * x0 + tt * noise, t, y), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for name, live in (("transformer", model), ("text", text)):
                for e, p in zip(ema[name].parameters(), live.parameters()):
                    e.lerp_(p, 1 - decay)
        if step % 25 == 0 or step == args.steps:
            print(f"step {step}/{args.steps} loss {np.mean(losses[-25:]):.4f} {elapsed():.1f} min", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            checkpoint(step)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    state = {f"transformer.{k}": v.half().contiguous() for k, v in ema["transformer"].state_dict().items()}
    state.update({f"text.{k}": v.half().contiguous() for k, v in ema["text"].state_dict().items()})
    tmp = args.out.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"steps": str(args.steps), "batch": str(args.batch)})
    os.replace(tmp, args.out)
    log = {"steps": args.steps, "batch": args.batch, "lr": args.lr, "ema": args.ema, "seed": args.seed,
           "minutes": round(elapsed(), 1), "torch_threads": torch.get_num_threads(),
           "loss_last_100": round(float(np.mean(losses[-100:])), 4),
           "loss_by_100": [round(float(np.mean(losses[i:i + 100])), 4) for i in range(0, len(losses), 100)],
           "data": data}
    if init is not None:  # the run this one started from, so the whole history stays in the log
        log["init"] = {"weights": init.name, **{k: prior[k] for k in ("steps", "batch", "lr", "minutes", "init")
                                                 if k in prior}}
    args.out.with_suffix(".json").write_text(json.dumps(log, indent=1) + "\n")
    return {name: m.eval().float() for name, m in ema.items()}
