"""The embedded long-video testbed: the Wan-style video DiT of ``video.py`` on 32-frame clips, 2,048 tokens a call.

The same diffusers ``WanTransformer3DModel`` (4 blocks, 128 wide, 4 heads, 3-D rotary positions, cross-attention to
the "text") and the same clips as ``video.py`` (one Fashion-MNIST item shrunk to 24 x 24 moving in a straight line
across a 32 x 32 frame at 1-2 px a frame, bouncing off the edges), four times as long: 32 frames, patched (1, 4, 4)
into 32 x 8 x 8 = **2,048 tokens** per call. The "text" is the class table of ``video.py`` (4 learned tokens per
class, chosen by the class name the prompt contains), not a sentence. Trained by
``scripts/train_fashion_video_long.py`` from the 8-frame model's weights (rectified flow, the loop of
``scripts/flow_training.py``); timesteps go to the model on Wan's 0..1000 scale.
Weights: ``weights/fashion_video_long.safetensors`` (fp16).
"""

from __future__ import annotations

from pathlib import Path

from .flow import load_parts
from .video import ClassTokens, FashionVideo, build_video

__all__ = ["LONG_FRAMES", "VIDEO_LONG_WEIGHTS", "FashionVideoLong", "load_fashion_video_long"]

VIDEO_LONG_WEIGHTS = Path(__file__).with_name("weights") / "fashion_video_long.safetensors"
LONG_FRAMES = 32


class FashionVideoLong(FashionVideo):
    """Prompt -> clips: ``.frames`` ``(B, 32, 1, 32, 32)`` in [0, 1]; ``.images``: each clip as a frame strip.

    Example:
        >>> pipe = load_fashion_video_long()  # doctest: +SKIP
        >>> pipe("a sneaker", output_type="pt").frames.shape
        torch.Size([1, 32, 1, 32, 32])
    """

    frames = LONG_FRAMES  # what ``tokenmerge quality`` reads to score clips per frame


def load_fashion_video_long(weights: str | Path | None = None) -> FashionVideoLong:
    """The embedded long-video model with its shipped weights (or ``weights``, from
    ``scripts/train_fashion_video_long.py``).

    Example:
        >>> pipe = load_fashion_video_long()  # doctest: +SKIP
    """
    path = Path(weights) if weights is not None else VIDEO_LONG_WEIGHTS
    return FashionVideoLong(*load_parts(path, build_video(), ClassTokens(), "long-video model",
                                        "train_fashion_video_long.py"))
