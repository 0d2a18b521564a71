"""Train the embedded Fashion-MNIST diffusion model that `tokenmerge demo` ships with.

Data: Debian's `dataset-fashion-mnist` package (`apt-get install dataset-fashion-mnist`), read from
/usr/share/datasets/fashion-mnist. Output: src/tokenmerge/fashion/weights/fashion.safetensors (EMA weights, fp16)
and a JSON log beside it. On 2 CPU cores the default run (1000 steps of 64 images) takes about 45 minutes.

    .venv/bin/python scripts/train_fashion.py [--steps 1000] [--batch 64] [--out PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tokenmerge.fashion.data import load_split  # noqa: E402
from tokenmerge.fashion.model import NULL_CLASS, WEIGHTS, build_unet  # noqa: E402
from tokenmerge.fashion.pipeline import ClassEncoder  # noqa: E402

DATA = Path("/usr/share/datasets/fashion-mnist")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ema", type=float, default=0.995)
    ap.add_argument("--uncond", type=float, default=0.1, help="fraction of labels dropped for classifier-free guidance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=WEIGHTS)
    args = ap.parse_args()

    from diffusers import DDPMScheduler
    from safetensors.torch import save_file

    torch.manual_seed(args.seed)
    images, labels = load_split("train")
    unet, encoder = build_unet(), ClassEncoder()
    ema = {"unet": copy.deepcopy(unet).requires_grad_(False), "encoder": copy.deepcopy(encoder).requires_grad_(False)}
    params = list(unet.parameters()) + list(encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = 50
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
    )
    noise_sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")

    def save(step: int, losses: list[float], started: float) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        state = {f"unet.{k}": v.half().contiguous() for k, v in ema["unet"].state_dict().items()}
        state.update({f"encoder.{k}": v.half().contiguous() for k, v in ema["encoder"].state_dict().items()})
        save_file(state, str(args.out), metadata={"steps": str(step), "batch": str(args.batch)})
        log = {"steps": step, "batch": args.batch, "lr": args.lr, "ema": args.ema, "seed": args.seed,
               "minutes": round((time.time() - started) / 60, 1), "torch_threads": torch.get_num_threads(),
               "loss_last_100": round(float(np.mean(losses[-100:])), 4)}
        args.out.with_suffix(".json").write_text(json.dumps(log, indent=1) + "\n")

    started, losses = time.time(), []
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(images), (args.batch,))
        x0, y = images[idx], labels[idx].clone()
        flip = torch.rand(args.batch) < 0.5
        x0[flip] = x0[flip].flip(-1)
        y[torch.rand(args.batch) < args.uncond] = NULL_CLASS
        noise = torch.randn_like(x0)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (args.batch,))
        xt = noise_sched.add_noise(x0, noise, t)
        loss = F.mse_loss(unet(xt, t, encoder(y)).sample, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for name, live in (("unet", unet), ("encoder", encoder)):
                for e, p in zip(ema[name].parameters(), live.parameters()):
                    e.lerp_(p, 1 - decay)
        if step % 50 == 0 or step == args.steps:
            print(f"step {step}/{args.steps} loss {np.mean(losses[-50:]):.4f} "
                  f"{(time.time() - started) / 60:.1f} min", flush=True)
        if step % 200 == 0 or step == args.steps:
            save(step, losses, started)


if __name__ == "__main__":
    main()
