"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import math

from ..tools.outputs import OutputError, Outputs, check_folder, check_stem
from ..tools.text import cap_message, quote

OUT_HELP = ("Files this command wrote there before (recorded with their checksums in OUT/.tokenmerge-outputs.json) "
            "are replaced when it runs again; any other file in the way (yours, or one of ours changed since) is "
            "never overwritten: the command stops before it runs and names it")
STEM_HELP = "a plain file name: letters, digits and . _ - +, no folder part"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose error messages quote at most 200 characters of any argument."""

    def error(self, message: str):
        super().error(cap_message(message))


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {quote(text, 40)}")
    return value


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number; got {quote(text, 40)}")
    return value


def seed(text: str) -> int:
    """A seed ``torch.Generator.manual_seed`` takes: -2**63 to 2**64 - 1."""
    value = int(text)
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"seeds are integers from -2**63 to 2**64-1; got {quote(text, 40)}")
    return value


def stem(text: str) -> str:
    try:
        return check_stem(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check_outputs(parser, outputs: Outputs, *cache_folders) -> None:
    """Before any work: the outputs (and the cache folders, as ``(path, option)``) are usable, or an argument
    error names the path and how to go on."""
    try:
        outputs.check()
        for folder, option in cache_folders:
            check_folder(folder, option)
    except OutputError as err:
        parser.error(str(err))


def pick_device(text: str, parser):
    """``auto`` -> cuda, else mps, else cpu; anything torch cannot parse is an argument error."""
    import torch

    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    try:
        return torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        parser.error(f"--device must be cpu, cuda, cuda:N, mps or auto; got {quote(text, 40)}")
