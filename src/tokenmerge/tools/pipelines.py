"""Loading a real diffusers pipeline for the tools (``--model``), with errors that say what happened.

Three outcomes are told apart: the pipeline is not here (``FileNotFoundError``: a folder without
``model_index.json``, a hub id not in the local cache); it is here but a file was refused (``PipelineLoadError``:
a pickle that ``torch.load(weights_only=True)`` will not unpickle, a folder asking to run its own code); it is
here but did not load for another reason (``PipelineLoadError``: a damaged file, a missing component...).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from .text import cap_message, quote

__all__ = ["PipelineLoadError", "load_pipeline"]

_WEIGHT_FILE = re.compile(r"""['"]?([^'"\s]+\.(?:bin|pt|pth|ckpt|safetensors|gguf))['"]?""")
_REFUSED = re.compile(r"weights only load failed|unsupported global|weights_only|trust_remote_code|"
                      r"vulnerability|allow_pickle", re.IGNORECASE)


class PipelineLoadError(ValueError):
    """A pipeline that is here but did not load; ``path`` is the file at fault when it is known."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and every exception it was raised from or while handling, outermost first."""
    out: list[BaseException] = []
    while err is not None and err not in out and len(out) < 50:
        out.append(err)
        err = err.__cause__ or err.__context__
    return out


def _first_line(err: BaseException) -> str:
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()  # no terminal colours
    return cap_message(lines[0] if lines else "", total=400)


def _explain(path_or_id: str, chain: list[BaseException]) -> PipelineLoadError | None:
    """A ``PipelineLoadError`` for a file that was refused (a pickle, code), or None if nothing was refused."""
    text = "\n".join(str(e) for e in chain)
    files = [m.group(1) for m in _WEIGHT_FILE.finditer(text)]
    file = files[0] if files else None
    unpickling = next((e for e in reversed(chain) if isinstance(e, pickle.UnpicklingError)), None)  # innermost
    if unpickling is not None or _REFUSED.search(text):
        where = f"its file {quote(file, 300)}" if file else "one of its files"
        if "trust_remote_code" in text:
            why = ("the folder asks to run Python code of its own (a custom pipeline or component), and tokenmerge "
                   "does not run code from a model folder")
        else:
            found = re.search(r"GLOBAL ([\w.]+)", text)
            what = f" (it needs {found.group(1)}, which no plain weights file holds)" if found else ""
            why = (f"torch.load(weights_only=True) refused to unpickle it{what}: loading it would run code from the "
                   "file. If you trust where it came from, re-save the pipeline as safetensors "
                   "(save_pretrained(..., safe_serialization=True)) from a trusted copy")
        return PipelineLoadError(f"the pipeline {quote(path_or_id)} was found, but {where} was refused: {why}. "
                                 f"({type(unpickling or chain[-1]).__name__}: {_first_line(unpickling or chain[-1])})",
                                 file)
    return None


def load_pipeline(path_or_id: str, dtype=torch.float32):
    """A real diffusers pipeline (local folder or cached hub id).

    Args:
        path_or_id: a folder holding ``model_index.json``, or a hub id whose files are in the local cache.
        dtype: the pipeline's torch dtype.

    Raises:
        FileNotFoundError: the pipeline is not here (the message says how to get it here).
        PipelineLoadError: it is here, but a file was refused or did not load (the message names it and why).

    Example:
        >>> pipe = load_pipeline("path/to/sd15-folder")  # doctest: +SKIP
    """
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.from_pretrained(path_or_id, torch_dtype=dtype)
    except Exception as err:  # hub errors, offline errors, missing and refused files come in many types
        chain = _chain(err)
        refused = _explain(path_or_id, chain)
        if refused is not None:
            raise refused from None
        try:
            here = (Path(path_or_id) / "model_index.json").is_file()
        except (OSError, ValueError):
            here = False
        if here:
            files = [m.group(1) for m in _WEIGHT_FILE.finditer("\n".join(str(e) for e in chain))]
            raise PipelineLoadError(
                f"the pipeline {quote(path_or_id)} was found (it has model_index.json), but it did not load: "
                f"{type(err).__name__}: {_first_line(err)}"
                + "".join(f"\ncaused by {type(e).__name__}: {_first_line(e)}" for e in chain[1:3]),
                files[0] if files else None) from None
        raise FileNotFoundError(
            f"could not load the pipeline {quote(path_or_id)}: {type(err).__name__}: {_first_line(err)[:300]}\n"
            "Its weights are not here: pass a local folder that holds model_index.json (a pipeline saved with "
            "save_pretrained, or downloaded beforehand with `huggingface-cli download ID --local-dir DIR`), "
            "or a hub id whose files are in the local cache."
        ) from None
