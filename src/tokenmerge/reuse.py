"""Token reuse (``apply_reuse``): faithful token reduction for transformers.

After a few full steps, each denoising step recomputes a moving share of the image tokens in every selected
block; those tokens still attend to fresh keys and values of every token, and the others take their block input
plus the block residual cached when they were last computed. The technique itself is ``engine/techniques/reuse.py``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = ["ReuseConfig", "apply_reuse", "ORDERS", "KEYS"]

# how the recomputed tokens are chosen at each step (each is a fixed order of the image tokens, walked round-robin:
# every token is recomputed once every ceil(1 / fraction) partial steps)
ORDERS = ("strided", "grid", "random")
# where the other tokens' keys and values come from at a partial step: "fresh" (every token goes through the
# block's projections: exact attention for the recomputed tokens), "cached" (the block runs on the recomputed tokens
# alone and the others' keys and values are the ones kept from their last computation: less work, less faithful,
# two more stored tensors per block)
KEYS = ("fresh", "cached")


@dataclass(frozen=True)
class ReuseConfig:
    """Settings of ``apply_reuse`` (validated when made; see its docstring).

    Example:
        >>> ReuseConfig(fraction=0.35, warmup=4).partial_at(10)
        True
    """

    fraction: float = 0.5
    warmup: int = 4
    every: int = 0
    order: str = "grid"
    seed: int | None = None
    blocks: tuple[int, ...] | None = None
    fraction_end: float | None = None
    spread: float = 0.3
    keys: str = "fresh"

    # what the other patches' configs say, read by the shared lifecycle (api.py) and guards
    max_downsample = None
    method_name = "token reuse"

    def __post_init__(self):
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0.0 < float(f) <= 1.0:
            raise ValueError(f"fraction must be a number in (0, 1] (the share of image tokens recomputed at a "
                             f"partial step; 1 recomputes every token: no reuse); got {f!r}")
        object.__setattr__(self, "fraction", float(f))
        end = self.fraction_end
        if end is not None:
            if isinstance(end, bool) or not isinstance(end, numbers.Real) or not 0.0 < float(end) <= 1.0:
                raise ValueError(f"fraction_end must be None or a number in (0, 1]; got {end!r}")
            object.__setattr__(self, "fraction_end", float(end))
        sp = self.spread
        if isinstance(sp, bool) or not isinstance(sp, numbers.Real) or not 0.0 <= float(sp) <= 1.0:
            raise ValueError(f"spread must be a number in [0, 1]; got {sp!r}")
        object.__setattr__(self, "spread", float(sp))
        for name, low in (("warmup", 1), ("every", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}" + (
                    " (the first step fills the caches: it is always a full step)" if name == "warmup" else ""))
            object.__setattr__(self, name, int(value))
        if self.keys not in KEYS:
            raise ValueError(f"keys must be one of {', '.join(KEYS)}; got {self.keys!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}; got {self.order!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be None or an integer; got {self.seed!r}")
        if self.blocks is not None:
            try:
                picked = tuple(self.blocks)
            except TypeError:
                picked = None
            if not picked or not all(isinstance(i, int) and not isinstance(i, bool) for i in picked):
                raise ValueError("blocks must be None (every block) or a non-empty sequence of block indices, e.g. "
                                 f"range(2, 19); got {self.blocks!r}")
            object.__setattr__(self, "blocks", picked)

    @property
    def effective_seed(self) -> int:
        return 0 if self.seed is None else int(self.seed)

    @property
    def reuses(self) -> bool:
        """Whether any token is ever reused (``fraction=1`` recomputes every token: an exact no-op)."""
        return self.fraction < 1.0 or (self.fraction_end is not None and self.fraction_end < 1.0)

    def fraction_at(self, progress: float, first: float) -> float:
        """The share recomputed at a partial step at denoising ``progress`` (0 = noise, 1 = the end), the
        generation's first partial step having been at ``first``: ``fraction`` there, moving linearly to
        ``fraction_end`` at the end."""
        if self.fraction_end is None or first >= 1.0:
            return self.fraction
        a = min(1.0, max(0.0, (progress - first) / (1.0 - first)))
        return self.fraction + (self.fraction_end - self.fraction) * a

    def schedule(self, steps: int) -> list[float | None]:
        """The share recomputed at each of ``steps`` steps whose timesteps fall linearly from noise (progress
        ``k / steps``, as the embedded models' sampler): ``None`` for a full step."""
        partial = [k for k in range(steps) if self.partial_at(k)]
        first = partial[0] / steps if partial else 0.0
        return [self.fraction_at(k / steps, first) if self.partial_at(k) else None for k in range(steps)]

    def partial_at(self, step: int) -> bool:
        """Whether step ``step`` (0 = the generation's first denoising step) is a partial one."""
        if not self.reuses or step < self.warmup:
            return False
        return not (self.every and (step - self.warmup + 1) % self.every == 0)

    def full_steps(self, steps: int) -> int:
        """How many of a generation's ``steps`` steps are full (every token recomputed)."""
        return sum(not self.partial_at(k) for k in range(steps))


def apply_reuse(model, fraction: float = 0.5, *, warmup: int = 4, fraction_end: float | None = None,
                spread: float = 0.3, keys: str = "fresh", every: int = 0, order: str = "grid",
                seed: int | None = None, blocks=None):
    """Patch a diffusion transformer with token reuse, in place: after ``warmup`` full steps, each step recomputes
    ``fraction`` of the image tokens in every block and reuses the rest.

    In a partial step, every token still enters each block's attention, so the recomputed tokens attend to fresh
    keys and values of all tokens (their queries alone are attended: the attention itself, its output projection,
    the cross-attention and the feed-forward run on the recomputed tokens only); the other tokens leave the block
    as their input plus their block residual (output minus input) from the step they were last computed in. The
    recomputed tokens move every step, round-robin over the image, so no token is stale for longer than
    ``ceil(1 / fraction)`` steps. Extra memory: one tensor of the block's image output size per patched block (per
    call of a step: twice where guidance runs as two calls). Steps are told apart by the timestep the model is
    called with: a call with the same timestep as the one before is another branch of the same step (guidance run
    as two calls), one with an earlier (noisier) timestep starts a new generation.

    Important args:
        model: a diffusers pipeline or a transformer denoiser of a family whose blocks declare their layout for
            whole-block merging (Flux.1, Wan, PixArt/DiT, HunyuanVideo, LTX-Video, CogVideoX, Qwen-Image...;
            refused with the reason elsewhere).
        fraction: the share of image tokens recomputed at a partial step, in (0, 1]: the speed knob (0.5 about
            1.5x, 0.35 about 1.8x on a transformer whose attention is a large part of its step). 1: an exact no-op.
        warmup: full steps at the start of each generation (at least 1: the first fills the caches). Early steps
            set the layout: 4 of 20 kept the embedded models within 31-36 dB of vanilla.
        fraction_end: the share moves linearly (with the denoising progress read from the timestep) from
            ``fraction`` at the first partial step to this at the end (``None``: constant). Recomputing more
            early and less late (0.55 to 0.15) was more faithful than a constant 0.35 at the same work.

    Args to tinker with:
        spread: give each token that is not recomputed this share of the mean change of the recomputed tokens
            around it (3x3 on the grid, 3x3x3 on video) since they were last computed, added to its cached residual
            (ClusCa's idea: a computed token's change stands for its neighbours'); 0: off. No memory is kept for
            it. The default 0.3 was 0.6-2.2 dB more faithful than 0 on the embedded models.
        keys: ``"fresh"`` (default): every token goes through the block's projections, so the recomputed tokens
            attend to this step's keys and values of all tokens, as described above. ``"cached"``: the whole block
            runs on the recomputed tokens alone (its feed-forward, projections and norms too; rotary rows follow),
            and inside its attention the other tokens' keys and values are the ones kept from their last
            computation: less work per partial step (about ``fraction`` of a full one), 1.5-2.5 dB less faithful
            at the same fraction on the embedded models, and two more stored tensors per attention (keys and
            values of every token). Blocks whose attention takes a mask, or whose per-token arguments would have to
            follow, are refused with ``"cached"``.
        every: after the warm-up, every ``every``-th step is a full one again (0, the default: none).
        order: how the recomputed tokens are chosen: ``"grid"`` (default: the same ranks of every 2x2 window of the
            token grid, frames in pairs on video), ``"strided"`` (every k-th token in raster order), ``"random"`` (a
            seeded random order); each is walked round-robin, so the set moves every step.
        seed: the random order's seed (``None``: a fixed default).
        blocks: which blocks, by index over the denoiser's blocks (``None``: all).

    Returns:
        ``model``, patched (any earlier tokenmerge patch is replaced). ``tokenmerge.remove_patch`` removes it and
        gives back bit-identical outputs. Raises ``ValueError`` for bad arguments or a model whose blocks it cannot
        follow, ``TypeError`` for a model it does not know; on any error the model is left as it was.

    Example:
        >>> tokenmerge.apply_reuse(pipe, fraction=0.35, warmup=4)  # doctest: +SKIP
        >>> image = pipe("a photo of an astronaut").images[0]       # doctest: +SKIP
        >>> tokenmerge.remove_patch(pipe)                            # doctest: +SKIP
    """
    from .api import apply_config

    return apply_config(model, ReuseConfig(fraction, warmup, every, order, seed,
                                           tuple(blocks) if blocks is not None else None, fraction_end, spread,
                                           keys))
