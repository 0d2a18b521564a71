"""Frozen, validated configuration of a patch: ToMe, ToDo and token reuse."""

from __future__ import annotations

import numbers
import warnings
from dataclasses import KW_ONLY, dataclass

from .merge.kernels import KERNELS
from .merge.recompute import fraction_at

__all__ = ["ToMeConfig", "ToDoConfig", "ReuseConfig", "DEFAULT_SEED", "POOL_MODES", "CUDA_MIN_SIZE", "min_size_on",
           "ORDERS", "KEYS"]

POOL_MODES = ("nearest-exact", "avg", "bilinear", "trilinear")
# "attention": merge around the attention (and, if asked, cross-attention / feed-forward) of each block;
# "block": merge once at the block's entry, run the whole block on the merged tokens, unmerge its update.
SCOPES = ("attention", "block")

# ``min_size=None`` on CUDA: calls whose merged hidden states hold fewer elements per sample (tokens x channels) run
# unmerged, the size below which merging did not pay on the GPU table (docs/gpu.md, "Small calls").
CUDA_MIN_SIZE = 4096 * 1024


def min_size_on(min_size: int | None, device) -> int:
    """The smallest merged call (tokens x channels per sample) that ``min_size`` lets merge on ``device``: itself
    if given, else ``CUDA_MIN_SIZE`` on CUDA and 0 (every call) elsewhere (the CPU tables show merging paying at
    every size they measured)."""
    if min_size is not None:
        return min_size
    return CUDA_MIN_SIZE if getattr(device, "type", device) == "cuda" else 0


# Used when ``seed=None``: the merge pattern is reproducible by default (tomesd drew it from the global RNG,
# so it changed from run to run and consumed the user's random numbers).
DEFAULT_SEED = 0


def _check_int(name: str, value, minimum: int, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be {allowed}; got {value!r}")
    return int(value)


def _check_fraction(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0.0 <= float(value) <= 1.0):
        raise ValueError(f"{name} must be a number in [0, 1] (a fraction of the denoising schedule); got {value!r}")
    return float(value)


def _check_schedule(cfg) -> None:
    """``start``/``stop``: the part of the denoising process (0 = first step, pure noise; 1 = the end) in
    which the method is active. Read from the timestep: progress = 1 - t / num_train_timesteps."""
    start, stop = _check_fraction("start", cfg.start), _check_fraction("stop", cfg.stop)
    if start >= stop:
        raise ValueError(f"start must be below stop (the active part of the schedule); got start={start}, stop={stop}")
    _check_int("num_train_timesteps", cfg.num_train_timesteps, 1, "an integer >= 1 (1000 for SD)")
    object.__setattr__(cfg, "start", start)
    object.__setattr__(cfg, "stop", stop)


def _check_blocks(cfg, none_means: str, example: str) -> None:
    """``cfg.blocks``: ``None`` or a non-empty sequence of block indices, kept as a tuple."""
    if cfg.blocks is None:
        return
    try:
        picked = tuple(cfg.blocks)
    except TypeError:
        picked = None
    if not picked or not all(isinstance(i, int) and not isinstance(i, bool) for i in picked):
        raise ValueError(f"blocks must be None ({none_means}) or a non-empty sequence of block indices, e.g. "
                         f"{example}; got {cfg.blocks!r}")
    object.__setattr__(cfg, "blocks", picked)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")
    return value


@dataclass(frozen=True)
class _Schedule:
    """What ToMe and ToDo share, keyword-only (after each method's own fields): the schedule, plans kept across
    steps and the matching's reach."""

    _: KW_ONLY
    start: float = 0.0
    stop: float = 1.0
    ratio_end: float | None = None
    num_train_timesteps: int = 1000
    share_plans: bool | None = None
    plan_steps: int = 1
    match_radius: int | None = 1
    blocks: tuple[int, ...] | None = None
    st: int = 1
    min_size: int | None = None
    kernels: str = "torch"

    def head(self) -> str:
        """The technique and its own settings, as ``describe_patch``'s first line starts: ``ToMe patch:
        ratio=0.5``."""
        raise NotImplementedError

    @property
    def merges_around_attention_only(self) -> bool:
        """Whether it merges tokens around attention alone (ToMe's default scope, no feed-forward): what saves little
        on an image transformer at 1024 px and below."""
        return False

    def plans_shared(self, kind: str) -> bool:
        """Whether one plan per level and call serves the level's blocks, on a family of ``kind`` ("unet" or
        "transformer"): ``share_plans``, or where it is ``None`` (the default) on transformers only."""
        return self.share_plans if self.share_plans is not None else kind != "unet"

    def _check_shared(self, upper: float) -> None:
        _check_blocks(self, "every block the level rule selects", "range(0, 28, 2)")
        if self.ratio_end is not None:
            end = self.ratio_end
            if isinstance(end, bool) or not isinstance(end, numbers.Real) or not (0.0 <= float(end) <= upper):
                raise ValueError(f"ratio_end must be None or a number in [0, {upper:g}]; got {end!r}")
            object.__setattr__(self, "ratio_end", float(end))
        _check_schedule(self)
        if self.share_plans is not None:
            _check_bool("share_plans", self.share_plans)
        if self.min_size is not None:
            _check_int("min_size", self.min_size, 0, "None (on CUDA: calls of fewer than 4096 x 1024 tokens x channels "
                       "per sample run unmerged; elsewhere every call merges) or an integer >= 0 (0: merge every call)")
        _check_int("plan_steps", self.plan_steps, 1, "an integer >= 1 (1 = recompute the plan at every call)")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNELS))}; got {self.kernels!r}")
        if self.match_radius is not None:
            _check_int("match_radius", self.match_radius, 0,
                       "None (match every source with every destination) or an integer >= 0 (windows away)")

    def windows(self, rank: int) -> tuple[int, ...]:
        """ToMe's window per axis of a grid of ``rank`` axes: ``(sy, sx)``, or ``(st, sy, sx)`` for video."""
        if rank == 2:
            if self.st != 1:
                raise ValueError(f"st={self.st} (the temporal window) applies to video models, whose token grid has "
                                 "a frame axis; this model's grid is 2-D: leave st=1")
            return (self.sy, self.sx)
        if rank < 2:
            raise ValueError(f"a token grid of rank {rank} has no windows")
        return (self.st,) + (1,) * (rank - 3) + (self.sy, self.sx)

    def radius(self, rank: int):
        """The matcher's reach per axis: ``match_radius`` windows in space; on a video grid with ``st=1``, each
        frame matches within itself (reach 0 on the frame axis)."""
        if rank >= 3 and self.st == 1:
            return (0,) * (rank - 2) + (self.match_radius,) * 2
        return self.match_radius

    @property
    def effective_seed(self) -> int:
        return DEFAULT_SEED if self.seed is None else int(self.seed)

    @property
    def scheduled(self) -> bool:
        """Whether the timestep decides anything (then it is read on the host once per denoiser call)."""
        return self.start > 0.0 or self.stop < 1.0 or self.ratio_end is not None

    def ratio_at(self, progress: float) -> float:
        if self.ratio_end is None:
            return self.ratio
        span = (progress - self.start) / (self.stop - self.start)
        return self.ratio + (self.ratio_end - self.ratio) * min(max(span, 0.0), 1.0)



@dataclass(frozen=True)
class ToMeConfig(_Schedule):
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
        scope: ``"attention"`` (default, tomesd's): merge around the sub-modules above. ``"block"``: merge once
            at each patched block's entry, run the whole block (norms, attention, feed-forward, modulation) on
            the merged tokens and add the unmerged update to the full-resolution residual stream
            (``y = x + unmerge(block(merge(x)) - merge(x))``), so projections and feed-forward shrink too.
        seed: seed of the random destination choice. The pattern is a pure function of
            (seed, block, timestep), so runs are reproducible and no global RNG is touched.
            ``None`` means ``DEFAULT_SEED``.
        start, stop: merge only while the denoising progress ``1 - t / num_train_timesteps`` is in
            ``[start, stop]`` (0 = the first, noisiest step; 1 = the end). Default: the whole schedule.
        ratio_end: if set, the ratio moves linearly from ``ratio`` at ``start`` to ``ratio_end`` at ``stop``.
        num_train_timesteps: the scale of the timesteps the denoiser is called with (1000 for SD).
        share_plans: True: compute the merge plan once per level and call (at the level's first block) and reuse
            it in the level's other blocks; False: a plan in every block, from its own input. ``None`` (default):
            True on transformers, where it was as faithful on the shipped DiT (11.6 vs 11.8 dB) and faster on
            every row of the H200 table (Flux.1 1024: 1.25x vs 1.12x; PixArt 1024: 1.17x vs 0.74x); False on
            UNets, where it was no faster on the H200 (SD 1.5 512 0.83x both, SDXL 1024 0.91x vs 0.96x) and
            one plan per level was 0.7-3.8 dB less faithful on the embedded UNet (seeds 0-4: local
            matching 36.9 vs 37.5 dB, global 32.3 vs 35.5, whole-block 26.4 vs 30.0).
        min_size: merge a block's call only when its merged hidden states hold at least this many elements per
            sample (tokens x channels); smaller calls run unmerged. ``None`` (default): ``CUDA_MIN_SIZE``
            (4096 x 1024) on CUDA, where smaller calls were no faster merged on the H200 table (SD 1.5 at 512,
            SDXL at 1024), and 0 elsewhere. 0 merges every call. ``describe_patch`` lists the calls it left
            unmerged.
        kernels: ``"torch"`` (default): merge and unmerge are torch operators (1 to 4 kernels each, with the
            text tokens' join). ``"triton"``: each is one Triton kernel (``merge.kernels``), eager on CUDA; under
            ``torch.compile`` and on other devices the torch operators run. Its slots' means are float32 sums
            in a fixed order (deterministic; the torch path sums in the input's dtype with ``index_add``, in any
            order on CUDA). Needs the triton package. Not yet timed on a GPU: the default stays ``"torch"``.
        plan_steps: keep each plan for this many consecutive denoiser calls (1: recompute every call, the
            default). A new generation (the timestep going up) always recomputes.
        match_radius: an integer R (default 1): each source token is compared only with the destinations of the
            windows at most R windows away ((2R+1)^2 candidates), so the matching costs O(N) instead of O(N^2).
            ``None``: with every destination, tomesd's matching (its exact results, with ``use_rand=False,
            share_plans=False``).
            The default was chosen by measurement (README, "How it differs from tomesd"): on every trained model
            shipped it is as faithful or more, and on the transformers it is the faster.
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
    scope: str = "attention"

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(map(repr, SCOPES))}; got {self.scope!r}")
        sx = _check_int("sx", self.sx, 1, "an integer >= 1")
        sy = _check_int("sy", self.sy, 1, "an integer >= 1")
        st = _check_int("st", self.st, 1, "an integer >= 1 (the window along the frame axis of video models)")
        if sx * sy * st < 2:
            raise ValueError(f"sx * sy must be at least 2 so that a window has a token to merge; got sx={sx}, sy={sy}")
        ratio = self.ratio
        upper = 1.0 - 1.0 / (sx * sy * st)
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not (0.0 <= float(ratio) <= upper):
            size = f"sx={sx}, sy={sy}" + (f", st={st}" if st != 1 else "")
            formula = "1 - 1/(sx*sy" + ("*st" if st != 1 else "") + ")"
            raise ValueError(f"ratio must be a number in [0, {formula}] = [0, {upper:g}] for {size}; got {ratio!r}")
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
        self._check_shared(upper)

    def head(self) -> str:
        return f"ToMe patch: ratio={self.ratio:g} "

    @property
    def merges_around_attention_only(self) -> bool:
        return self.scope == "attention" and not self.merge_mlp


@dataclass(frozen=True)
class ToDoConfig(_Schedule):
    """Settings of ToDo (token downsampling, arXiv 2402.13573): self-attention's keys and values come from
    the token grid pooled by ``downsample`` per side; queries stay full (or are merged by ToMe: ``ratio``).

    Args:
        downsample: pooling factor per spatial side (2: 4x fewer keys/values; on video grids the frame axis
            is not pooled), or a tuple with one factor per grid axis: ``(2, 2)`` for images, ``(1, 2, 2)`` or
            ``(2, 2, 2)`` (frames pooled too) for video. 1 everywhere changes nothing.
        mode: "nearest-exact" (the paper's), "avg", "bilinear" (images; video: within each frame) or
            "trilinear" (video).
        max_downsample: the level rule of ``ToMeConfig`` (``None``: the finest level with attention).
        ratio: ToMe on the queries as well (0: off), with ``sx``, ``sy``, ``use_rand``, ``seed`` as in ToMe.
        start, stop, ratio_end, num_train_timesteps: the schedule, as in ``ToMeConfig``.
        share_plans, plan_steps, match_radius: reuse and reach of the query merging, as in ``ToMeConfig``.
        min_size: the smallest call that is pooled and merged, as in ``ToMeConfig``.
        kernels: the query merging's kernels, as in ``ToMeConfig``.
    """

    downsample: int | tuple[int, ...] = 2
    mode: str = "nearest-exact"
    max_downsample: int | None = None
    ratio: float = 0.0
    sx: int = 2
    sy: int = 2
    use_rand: bool = True
    seed: int | None = None

    # ToDo acts on self-attention only: what the hooks ask of a ToMe config
    merge_attn = True
    merge_crossattn = False
    merge_mlp = False

    def __post_init__(self) -> None:
        allowed = "an integer >= 1 (2 = 4x fewer keys and values) or a tuple of such, one per grid axis"
        if isinstance(self.downsample, (tuple, list)):
            if not 2 <= len(self.downsample) <= 3:
                raise ValueError(f"downsample must be {allowed} ((2, 2) for images, (1, 2, 2) or (2, 2, 2) for "
                                 f"video); got {self.downsample!r}")
            object.__setattr__(self, "downsample", tuple(_check_int("downsample", f, 1, allowed)
                                                         for f in self.downsample))
        else:
            _check_int("downsample", self.downsample, 1, allowed)
        if self.mode not in POOL_MODES:
            raise ValueError(f"mode must be one of {', '.join(POOL_MODES)}; got {self.mode!r}")
        # the query merging is ToMe's: validated as such
        tome = ToMeConfig(self.ratio, self.max_downsample, self.sx, self.sy, self.use_rand, seed=self.seed, st=self.st)
        object.__setattr__(self, "ratio", tome.ratio)
        self._check_shared(1.0 - 1.0 / (self.sx * self.sy * self.st))

    @property
    def pools(self) -> bool:
        """Whether the keys and values are pooled at all (a factor above 1 on some axis)."""
        factors = self.downsample if isinstance(self.downsample, tuple) else (self.downsample,)
        return any(f > 1 for f in factors)

    def factors(self, rank: int) -> tuple[int, ...]:
        """The pooling factor per axis of a grid of ``rank`` axes."""
        if isinstance(self.downsample, tuple):
            if len(self.downsample) != rank:
                raise ValueError(f"downsample={self.downsample} has {len(self.downsample)} factors, but this model's "
                                 f"token grid has {rank} axes ({'frames, ' if rank == 3 else ''}height, width)")
            return self.downsample
        return (1,) * (rank - 2) + (self.downsample, self.downsample)

    def head(self) -> str:
        return f"ToDo patch: downsample={self.downsample} mode={self.mode} query ratio={self.ratio:g} "


# how the recomputed tokens are chosen at each step (each is a fixed order of the image tokens, walked round-robin:
# every token is recomputed once every ceil(1 / fraction) partial steps)
ORDERS = ("strided", "grid", "random")
# where the other tokens' keys and values come from at a partial step: "fresh" (every token goes through the
# block's projections: exact attention for the recomputed tokens), "kept" (the block runs on the recomputed tokens
# alone and the others' keys and values are the ones kept from their last computation: less work, less faithful,
# two more stored tensors per block)
KEYS = ("fresh", "kept")  # ("cached", this setting's name before 0.1.0's glossary, still reads as "kept")


@dataclass(frozen=True)
class ReuseConfig:
    """Settings of ``apply_reuse`` (validated when made; see its docstring).

    Example:
        >>> ReuseConfig(fraction=0.35, warmup=2).schedule(4)
        [None, None, 0.35, 0.35]
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
    text: bool = False
    extrapolate: float = 0.0

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
        ex = self.extrapolate
        if isinstance(ex, bool) or not isinstance(ex, numbers.Real) or not 0.0 <= float(ex) <= 1.0:
            raise ValueError(f"extrapolate must be a number in [0, 1] (0: kept residuals held; 1: moved along their "
                             f"last change, first order); got {ex!r}")
        object.__setattr__(self, "extrapolate", float(ex))
        object.__setattr__(self, "warmup", _check_int("warmup", self.warmup, 1, "an integer >= 1 (the first step "
                                                      "fills the caches: it is always a full step)"))
        object.__setattr__(self, "every", _check_int("every", self.every, 0, "an integer >= 0"))
        if self.keys == "cached":  # the former name
            warnings.warn("tokenmerge: keys='cached' is now keys='kept' (docs/glossary.md: 'cache' names a cache "
                          "across steps only)", DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "keys", "kept")
        if self.keys not in KEYS:
            raise ValueError(f"keys must be one of {', '.join(KEYS)}; got {self.keys!r}")
        if not isinstance(self.text, bool):
            raise ValueError(f"text must be True or False; got {self.text!r}")
        if self.text and self.keys != "kept":
            raise ValueError("text=True needs keys='kept' (the text tokens that are not recomputed keep their keys "
                             "and values from their last computation, as the image's do)")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}; got {self.order!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be None or an integer; got {self.seed!r}")
        _check_blocks(self, "every block", "range(2, 19)")

    @property
    def effective_seed(self) -> int:
        return DEFAULT_SEED if self.seed is None else int(self.seed)

    @property
    def reuses(self) -> bool:
        """Whether any token is ever reused (``fraction=1`` recomputes every token: an exact no-op)."""
        return self.fraction < 1.0 or (self.fraction_end is not None and self.fraction_end < 1.0)

    def schedule(self, steps: int) -> list[float | None]:
        """The share recomputed at each of ``steps`` steps whose timesteps fall linearly from noise (progress
        ``k / steps``, as the embedded models' sampler): ``None`` for a full step (``merge.recompute.fraction_at``)."""
        out, first = [], None
        for k in range(steps):
            part = fraction_at(k, k / steps, first, self.fraction, self.fraction_end, self.warmup,
                         self.every) if self.reuses else None
            first = k / steps if part is not None and first is None else first
            out.append(part)
        return out
