"""Token layouts of joint sequences: where the image tokens sit beside text and reference tokens, and the rotary
rows and mask entries that follow the image tokens when they are merged.

A sequence is ``[before | image | after]``: text declared before the image (``TEXT_BEFORE``), the image's tokens,
then text declared after it (``TEXT_AFTER``) or the reference-image tokens a call carries after the image's
(``trailing``: Flux Kontext, Flux.2 edits). Everything but the image passes whole.
"""

from __future__ import annotations

import torch

from ..families.spec import TEXT_AFTER, TEXT_BEFORE, Mask, Rotary
from ..merge.windows import arange

__all__ = ["sides", "image_part", "join", "keep_index", "take_rotary", "take_mask"]


def sides(total: int, image: int, text: str, trailing: int = 0) -> tuple[int, int]:
    """``(before, after)``: the tokens before and after the ``image`` ones in a sequence of ``total``."""
    extra = total - image
    if extra < 0:
        raise ValueError(f"tokenmerge: a sequence of {total} tokens cannot hold the {image} image tokens of the "
                         "call's grid; the model was called with a token layout its family does not declare")
    if extra == 0:  # the image's tokens alone (an image-only stream of a call that has references elsewhere)
        return 0, 0
    if text == TEXT_BEFORE:
        after = min(trailing, extra)
        return extra - after, after
    if text == TEXT_AFTER or extra == trailing:
        return 0, extra
    raise ValueError(f"tokenmerge: {total} tokens where the image grid has {image}"
                     + (f" and {trailing} reference tokens follow it" if trailing else "")
                     + ", and this sequence is not declared to hold text beside the image; the model was called "
                       "with a token layout its family does not declare")


def image_part(x: torch.Tensor, image: int, before: int) -> torch.Tensor:
    """The ``image`` tokens of ``x`` ``(B, S, C)`` that start at ``before``, as a view."""
    return x if x.shape[1] == image else x[:, before: before + image]


def join(whole: torch.Tensor, image: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """``whole`` with its image part replaced by ``image`` (of any length): the rest passes untouched."""
    if not (before or after):
        return image
    parts = ([whole[:, :before]] if before else []) + [image] + ([whole[:, whole.shape[1] - after:]] if after else [])
    return torch.cat(parts, 1)


def keep_index(rows: int, image: int, reps: torch.Tensor, text: str, trailing: int) -> torch.Tensor:
    """Rows to keep of a per-token table of ``rows`` rows whose ``image`` rows are merged to ``reps``."""
    before, after = sides(rows, image, text, trailing)
    if not (before or after):
        return reps
    every = arange(rows, reps.device)
    return torch.cat([every[:before], reps + before, every[before + image:]])


def take_rotary(spec: Rotary, value, image: int, reps: torch.Tensor, trailing: int = 0):
    """The rotary embedding ``value`` (``spec.layout``) at the rows of the merged tokens' positions.

    ``reps`` ``(M,)``: for each merged image token, the image token whose position it keeps.
    """
    if spec.layout == "tables_positions":  # (per-axis tables, per-token positions): only the positions follow
        tables, positions = value
        return type(value)((tables, take_rotary(Rotary(spec.kwarg, "tensor", spec.token_axis, spec.text), positions,
                                                image, reps, trailing)))
    if spec.layout == "image_text_pair":  # (image table, text table): only the first has image rows
        img, txt = value
        return type(value)((take_rotary(Rotary(spec.kwarg, "tensor", spec.token_axis, spec.text), img, image, reps,
                                        trailing), txt))
    if isinstance(value, (tuple, list)):
        return type(value)(take_rotary(spec, v, image, reps, trailing) for v in value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"tokenmerge: rotary embedding {spec.kwarg!r} is a {type(value).__name__}, expected a "
                        "tensor or a tuple of tensors whose rows can follow the merged tokens")
    if value.shape[spec.token_axis] == 1:  # one row broadcast over every token: the merged tokens' too
        return value
    index = keep_index(value.shape[spec.token_axis], image, reps.to(value.device), spec.text, trailing)
    return value.index_select(spec.token_axis, index)


def take_mask(spec: Mask, mask: torch.Tensor, image: int, reps: torch.Tensor, trailing: int = 0) -> torch.Tensor:
    """An attention mask at the rows/columns of the merged tokens: each of its last two axes that spans the
    tokens keeps the text (and reference) entries and the merged tokens' first tokens'."""
    if not spec.image:
        return mask
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"tokenmerge: attention mask {spec.kwarg!r} is a {type(mask).__name__}, not a tensor "
                        "whose rows and columns can follow the merged tokens (a flex attention BlockMask: use an "
                        "attention processor or backend that takes a tensor mask)")
    for axis in (-2, -1):  # a (B, S) key mask's axis -2 is the batch, never tokens
        if axis == -2 and mask.dim() == 2 and mask.shape[0] != mask.shape[1]:
            continue
        if mask.dim() >= -axis and mask.shape[axis] >= image and mask.shape[axis] > 1:
            index = keep_index(mask.shape[axis], image, reps.to(mask.device), spec.text, trailing)
            mask = mask.index_select(axis, index)
    return mask
