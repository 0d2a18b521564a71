"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text}")
    return value


def pick_device(text: str, parser):
    """``auto`` -> cuda, else mps, else cpu; anything torch cannot parse is an argument error."""
    import torch

    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    try:
        return torch.device(text)
    except RuntimeError:
        parser.error(f"--device must be cpu, cuda, cuda:N, mps or auto; got {text!r}")
