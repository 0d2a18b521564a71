"""Frozen, validated configuration of a token-merging patch."""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass

__all__ = ["ToMeConfig", "DEFAULT_SEED"]

# Used when ``seed=None``: the merge pattern is reproducible by default (tomesd drew it from the global RNG,
# so it changed from run to run and consumed the user's random numbers).
DEFAULT_SEED = 0


def _check_int(name: str, value, minimum: int, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be {allowed}; got {value!r}")
    return int(value)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")
    return value


@dataclass(frozen=True)
class ToMeConfig:
    """Settings of ToMe for Stable Diffusion (same names and meanings as ``tomesd.apply_patch``).

    Args:
        ratio: fraction of the tokens of a patched block to merge away, in ``[0, 1 - 1/(sx*sy)]``.
            0 is an exact no-op; 0.5 halves the tokens the merged sub-modules see.
        max_downsample: merge in the levels whose downsampling factor is at most this (1, 2, 4, 8 for SD's
            four levels). ``None`` (default) means "the highest-resolution level that has attention":
            1 on SD 1.x/2.x (what tomesd's default does there), 2 on SDXL (where tomesd's 1 matches nothing).
        sx, sy: size of the window in which one destination token is chosen (stride of the paper).
        use_rand: choose each window's destination at random (True) or always top-left (False).
            Forced off for an odd batch size, as in tomesd.
        merge_attn: merge before self-attention (``attn1``) and unmerge after it.
        merge_crossattn: merge the queries of cross-attention (``attn2``).
        merge_mlp: merge before the feed-forward (``ff``).
        seed: seed of the random destination choice. The pattern is a pure function of
            (seed, block, timestep), so runs are reproducible and no global RNG is touched.
            ``None`` means ``DEFAULT_SEED``.
    """

    ratio: float = 0.5
    max_downsample: int | None = None
    sx: int = 2
    sy: int = 2
    use_rand: bool = True
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        sx = _check_int("sx", self.sx, 1, "an integer >= 1")
        sy = _check_int("sy", self.sy, 1, "an integer >= 1")
        if sx * sy < 2:
            raise ValueError(f"sx * sy must be at least 2 so that a window has a token to merge; got sx={sx}, sy={sy}")
        ratio = self.ratio
        upper = 1.0 - 1.0 / (sx * sy)
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not (0.0 <= float(ratio) <= upper):
            raise ValueError(
                f"ratio must be a number in [0, 1 - 1/(sx*sy)] = [0, {upper:g}] for sx={sx}, sy={sy}; got {ratio!r}"
            )
        if self.max_downsample is not None:
            _check_int("max_downsample", self.max_downsample, 1, "None (auto) or an integer >= 1 such as 1, 2, 4 or 8")
        for name in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp"):
            _check_bool(name, getattr(self, name))
        if not (self.merge_attn or self.merge_crossattn or self.merge_mlp):
            raise ValueError(
                "merge_attn, merge_crossattn and merge_mlp are all False: the patch would merge nothing; "
                "enable at least one (merge_attn=True is the recommended one)"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, 0, "None or an integer >= 0")
        object.__setattr__(self, "ratio", float(ratio))

    @property
    def effective_seed(self) -> int:
        return DEFAULT_SEED if self.seed is None else int(self.seed)

    def to_dict(self) -> dict:
        return asdict(self)
