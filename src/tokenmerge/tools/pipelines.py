"""Loading a real diffusers pipeline for the tools (``--model``), with errors that say what happened."""

from __future__ import annotations

import torch

__all__ = ["load_pipeline"]


def load_pipeline(path_or_id: str, dtype=torch.float32):
    """A real diffusers pipeline (local folder or cached hub id); a clear ``FileNotFoundError`` when absent."""
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.from_pretrained(path_or_id, torch_dtype=dtype)
    except Exception as err:  # hub errors, offline errors and missing files come in many types
        raise FileNotFoundError(
            f"could not load the pipeline {path_or_id!r}: {type(err).__name__}: {str(err).splitlines()[0][:300]}\n"
            "Its weights are not here: pass a local folder that holds model_index.json (a pipeline saved with "
            "save_pretrained, or downloaded beforehand with `huggingface-cli download ID --local-dir DIR`), "
            "or a hub id whose files are in the local cache."
        ) from None
