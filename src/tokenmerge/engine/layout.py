"""Token layouts of joint sequences: where the image tokens are beside the text's, and the rotary rows that
follow the image tokens when they are merged. One function per varying thing, each used in one place."""

from __future__ import annotations

import torch

from ..families.spec import TEXT_AFTER, TEXT_BEFORE, TEXT_NONE, Mask, Rotary

__all__ = ["split_text", "join_text", "image_part", "take_rotary", "take_mask"]


def image_part(x: torch.Tensor, image: int, text: str) -> torch.Tensor:
    """The ``image`` tokens of a sequence that may also hold text (``text``: where), as a view."""
    extra = x.shape[1] - image
    if extra <= 0:
        return x
    if text == TEXT_AFTER:
        return x[:, :image]
    if text == TEXT_BEFORE:
        return x[:, extra:]
    raise RuntimeError(f"token merging: {x.shape[1]} tokens where the image grid has {image}, and this sequence "
                       "is not declared to hold text beside the image")


def split_text(x: torch.Tensor, image: int, text: str) -> tuple[torch.Tensor, int]:
    """``(image tokens, number of text tokens)`` of a joint sequence."""
    return image_part(x, image, text), max(0, x.shape[1] - image)


def join_text(whole: torch.Tensor, image: torch.Tensor, extra: int, text: str) -> torch.Tensor:
    """``whole`` with its image part replaced by ``image`` (of any length): the text tokens pass untouched."""
    if extra == 0:
        return image
    if text == TEXT_AFTER:
        return torch.cat([image, whole[:, whole.shape[1] - extra:]], 1)
    return torch.cat([whole[:, :extra], image], 1)


def _rotary_index(rows: int, image: int, reps: torch.Tensor, text: str) -> torch.Tensor:
    """Rows to keep of a rotary table of ``rows`` rows whose ``image`` rows are merged to ``reps``."""
    extra = rows - image
    if extra == 0 or text == TEXT_NONE:
        if extra:
            raise RuntimeError(f"token merging: a rotary table of {rows} rows for {image} image tokens")
        return reps
    if text == TEXT_AFTER:
        return torch.cat([reps, image + torch.arange(extra, device=reps.device)])
    return torch.cat([torch.arange(extra, device=reps.device), extra + reps])


def take_rotary(spec: Rotary, value, image: int, reps: torch.Tensor):
    """The rotary embedding ``value`` (``spec.layout``) at the rows of the merged tokens' positions.

    ``reps`` ``(M,)``: for each merged image token, the image token whose position it keeps.
    """
    if spec.layout == "image_text_pair":
        img, txt = value
        return type(value)((take_rotary(Rotary(spec.kwarg, "tensor", spec.token_axis, TEXT_NONE), img, image, reps),
                            txt))
    if isinstance(value, (tuple, list)):
        return type(value)(take_rotary(spec, v, image, reps) for v in value)
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"token merging: rotary embedding {spec.kwarg!r} is a {type(value).__name__}, "
                           "expected a tensor or a tuple of tensors")
    index = _rotary_index(value.shape[spec.token_axis], image, reps.to(value.device), spec.text)
    return value.index_select(spec.token_axis, index)


def take_mask(spec: Mask, mask: torch.Tensor, image: int, reps: torch.Tensor) -> torch.Tensor:
    """An attention mask at the rows/columns of the merged tokens: each of its last two axes that spans the
    tokens (``image`` of them, plus any text) keeps the text entries and the merged tokens' first tokens'."""
    if not spec.image:
        return mask
    if not isinstance(mask, torch.Tensor):
        raise RuntimeError(f"token merging: attention mask {spec.kwarg!r} is a {type(mask).__name__}")
    for axis in (-2, -1):
        if mask.dim() >= -axis and mask.shape[axis] >= image and mask.shape[axis] > 1:
            index = _rotary_index(mask.shape[axis], image, reps.to(mask.device), spec.text)
            mask = mask.index_select(axis, index)
    return mask
