"""Metrics that need weights from elsewhere: CLIP score, FID/KID, LPIPS.

Each runs only when its library and weights are on this machine; otherwise it reports which package or file is
missing, and the rest of the report is made as usual. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .metrics import to_tensor

__all__ = ["EXTRA_METRICS", "make_extra_metrics"]

EXTRA_METRICS = ("clip", "fid", "kid", "lpips")
_INCEPTION = "pt_inception-2015-12-05-6726825d.pth"  # torch-fidelity's FID Inception weights
_ALEXNET = "alexnet-owt-7be5be79.pth"  # torchvision's AlexNet, LPIPS's backbone


def _hub_file(name: str) -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints" / name


def _clip(model_id: str, images: dict, prompts: list[str]) -> dict | str:
    try:
        from transformers import CLIPModel, CLIPProcessor
    except ImportError:
        return "skipped: needs the transformers package"
    try:
        model = CLIPModel.from_pretrained(model_id, local_files_only=True).eval()
        processor = CLIPProcessor.from_pretrained(model_id, local_files_only=True)
    except (OSError, ValueError) as err:
        return (f"skipped: no local CLIP weights at {model_id!r} ({type(err).__name__}); pass --clip-model with a "
                "folder holding a CLIP model (config.json, weights, tokenizer and preprocessor files)")
    scores = {}
    with torch.no_grad():
        text = processor(text=prompts, return_tensors="pt", padding=True, truncation=True)
        for label, imgs in images.items():
            pix = processor(images=[i.convert("RGB") for i in imgs], return_tensors="pt")
            out = model(input_ids=text["input_ids"], attention_mask=text.get("attention_mask"),
                        pixel_values=pix["pixel_values"])  # forward's embeddings: stable across versions
            t = torch.nn.functional.normalize(out.text_embeds, dim=-1)
            v = torch.nn.functional.normalize(out.image_embeds, dim=-1)
            scores[label] = round(float((100 * (v * t).sum(-1)).clamp(min=0).mean()), 3)
    return scores


def _fid_kid(which: str, images: dict) -> dict | str:
    try:
        from torchmetrics.image.fid import FrechetInceptionDistance
        from torchmetrics.image.kid import KernelInceptionDistance
    except ImportError:
        return "skipped: needs torchmetrics[image] (pip install 'torchmetrics[image]')"
    if not _hub_file(_INCEPTION).is_file():
        return f"skipped: the Inception weights {_hub_file(_INCEPTION)} are not on this machine"
    ref = images.pop("vanilla")
    n = len(ref)
    out = {}
    for label, imgs in images.items():
        metric = FrechetInceptionDistance(normalize=True) if which == "fid" else \
            KernelInceptionDistance(subset_size=min(50, n), normalize=True)
        metric.update(torch.stack([to_tensor(i.convert("RGB")) for i in ref]), real=True)
        metric.update(torch.stack([to_tensor(i.convert("RGB")) for i in imgs]), real=False)
        value = metric.compute()
        out[label] = round(float(value[0] if isinstance(value, tuple) else value), 4)
    return out


def _lpips(images: dict) -> dict | str:
    try:
        import lpips
    except ImportError:
        return "skipped: needs the lpips package (pip install lpips) and torchvision"
    if not _hub_file(_ALEXNET).is_file():
        return f"skipped: LPIPS's AlexNet weights {_hub_file(_ALEXNET)} are not on this machine"
    net = lpips.LPIPS(net="alex", verbose=False)
    ref = torch.stack([to_tensor(i.convert("RGB")) for i in images["vanilla"]]) * 2 - 1
    out = {}
    with torch.no_grad():
        for label, imgs in images.items():
            if label != "vanilla":
                x = torch.stack([to_tensor(i.convert("RGB")) for i in imgs]) * 2 - 1
                out[label] = round(float(net(x, ref).mean()), 4)
    return out


def make_extra_metrics(names: list[str], clip_model: str | None):
    """A ``collect`` hook computing the named extra metrics; each value is a dict per method or a message."""
    unknown = set(names) - set(EXTRA_METRICS)
    if unknown:
        raise ValueError(f"metrics must be among {', '.join(EXTRA_METRICS)}; got {sorted(unknown)}")

    def compute(job, items, images: dict) -> dict:
        prompts = [p for p, _ in items]
        out = {}
        for name in names:
            if name == "clip":
                out["CLIP score"] = _clip(clip_model or "openai/clip-vit-base-patch16", images, prompts)
            elif name in ("fid", "kid"):
                out[name.upper()] = _fid_kid(name, dict(images))
            elif name == "lpips":
                out["LPIPS"] = _lpips(images)
        return out

    return compute
