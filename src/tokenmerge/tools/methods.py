"""Methods named by short text specs, for the command line: ``tome:0.5``, ``todo:2,stop=0.5``, ``tomesd:0.5``.

Grammar: ``NAME[:VALUE][,KEY=VALUE...]``. NAME is one of ``METHODS``; VALUE is ToMe's ratio or ToDo's factor;
KEY=VALUE pairs are keyword arguments of ``apply_patch`` / ``apply_todo`` / ``tomesd.apply_patch``
(``stop=0.5``, ``plan_steps=2``, ``mode=avg``...). For ``tokenmerge quality`` only, diffusers' caches are methods
too (``fbc:0.05``, ``taylorseer:5``, ``pab:2``, ``magcache:0.06``, ``seacache:0.25``, cache-dit's
``cachedit:0.2,calibrator=foca,mask=fast``, ``cachedit:0.2,steps=11``: ``tools/peers.py``, ``tools/cachedit.py``),
and ``A+B`` runs two methods together (``tome:0.5+fbc:0.05``: a token reduction and a cache). ToDo's factor may be
one per grid axis: ``todo:1x2x2`` (each frame pooled 2x2), ``todo:2x2x2`` (frames too), ``todo,downsample=(2,2,2)``.
A spec is checked when parsed: a bad name or option raises ``ValueError`` naming it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..config import ReuseConfig, ToDoConfig, ToMeConfig
from .peers import CACHES, DEFAULTS
from .text import cap_message, quote, split_outside

__all__ = ["METHODS", "BENCH_METHODS", "MethodSpec", "Combined", "parse_spec"]

METHODS = {
    "vanilla": "no merging",
    "tome": "this library's ToMe; VALUE = ratio (default 0.5)",
    "todo": "token downsampling of self-attention keys/values; VALUE = factor per side (default 2), or one per "
            "axis: 1x2x2 (each video frame), 2x2x2 (frames too)",
    "tomesd": "the reference tomesd package, on the same blocks as ours; VALUE = ratio (default 0.5)",
    "reuse": "token reuse (apply_reuse): after warmup full steps, each step recomputes a moving share of the image "
             "tokens in every block, the others keep their kept block residual; VALUE = that share (default 0.5); "
             "options warmup=, fraction_end=, keys=kept, text=true, extrapolate=, spread=, every=, order=, seed=, "
             "blocks=(i,j,...)",
    "stepcache": "the step cache (apply_step_cache): a skipped step runs no block (the kept residual moved along its "
                 "slope); no VALUE: steps computed by the progress since the last one (gap=, gap_growth=), VALUE: "
                 "rounds of VALUE skipped steps (skip_growth=); warmup=, extrapolate=, min_steps=, mask=1101...",
    "unetcache": "the UNet cache (apply_unet_cache, DeepCache's idea): stepcache's schedules and options; a cached "
                 "step runs the UNet's first depth= down and last depth= up blocks only (layers=: of a level)",
    "auto": "tokenmerge.accelerate: the faithful setting for the model (the UNet cache on a UNet, the step cache on a "
            "transformer); no VALUE; option speed=faithful|balanced|fast (default balanced)",
}
# methods whose state carries across steps: the bench times their steady partial (or skipped) step after a full one
STEP_CACHES = ("stepcache", "unetcache")  # this library's caches across steps (VALUE: skip rounds; none: gap=)
STATEFUL = ("reuse", *STEP_CACHES, "auto")
# options that change no partial or skipped step's work (the schedule, which tokens): the bench's record omits them
SCHEDULE_OPTIONS = ("warmup", "every", "order", "seed", "fraction_end", "skip_growth", "mask", "gap", "gap_growth",
                    "min_steps")
# Speed references for the bench only: their outputs are meaningless as images.
BENCH_METHODS = {
    "limit": "ToMe's zero-overhead limit: attention on the merged token count, merge = a slice, unmerge = a repeat; "
             "VALUE = ratio",
    "todo-limit": "ToDo's zero-overhead limit: keys/values = a slice of the pooled token count; VALUE = factor "
                  "(or 1x2x2, 2x2x2)",
    "grid-limit": "whole-block merging's zero-overhead limit on transformers: the unpatched model at the merged "
                  "token count (the token grid's rows times 1 - VALUE; text unchanged), no hooks at all; VALUE = ratio",
}
_FACTOR_METHODS = ("todo", "todo-limit")
# carried to the limit: where tokens are merged, and which calls (min_size)
_WHERE = ("scope", "merge_attn", "merge_crossattn", "merge_mlp", "max_downsample", "min_size")


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    factors = _factors(text)
    return text if factors is None else factors


def _factors(text: str) -> tuple[int, ...] | None:
    """``"2x2x2"`` -> a tuple of 2 or 3 integers; ``"(1, 2, 2)"`` or ``"[2,3,4,5]"`` (a factor per axis, or block
    indices) -> a tuple of its integers; None if it is not one."""
    inner = text.strip()
    if len(inner) >= 2 and (inner[0], inner[-1]) in (("(", ")"), ("[", "]")):
        parts, fewest, most = inner[1:-1].rstrip().rstrip(",").split(","), 1, 1024
    else:
        parts, fewest, most = inner.lower().split("x"), 2, 3
    parts = [p.strip() for p in parts]
    if not fewest <= len(parts) <= most or not all(p.isdigit() and len(p) <= 6 for p in parts):
        return None
    return tuple(int(p) for p in parts)


def _format(value) -> str:
    """A spec's value as text: ``0.5``, ``2``, ``2x2x2`` (a factor per axis)."""
    if isinstance(value, tuple):
        return "x".join(str(v) for v in value)
    return f"{value:g}"


@dataclass(frozen=True)
class MethodSpec:
    name: str
    value: float | int | tuple[int, ...] | None = None  # a ratio, a factor, or a factor per grid axis
    options: tuple[tuple[str, object], ...] = ()

    @property
    def value_text(self) -> str:
        """The value as written in specs and labels: ``0.5``, ``2``, ``2x2x2``; empty for vanilla."""
        return "" if self.value is None else _format(self.value)

    @property
    def label(self) -> str:
        head = self.name if self.value is None else f"{self.name} {self.value_text}"
        return " ".join([head] + [f"{k}={_option_text(v)}" for k, v in self.options])

    @property
    def text(self) -> str:
        """The spec as ``parse_spec`` reads it back."""
        head = self.name if self.value is None else f"{self.name}:{self.value_text}"
        return ",".join([head] + [f"{k}={_option_text(v)}" for k, v in self.options])

    @property
    def limit(self) -> "MethodSpec | None":
        """The zero-overhead reference of this method's gain: ToMe's ``limit`` at its ratio, ToDo's ``todo-limit``
        at its factor (options that change the token count, such as ToDo's ``ratio``, are not carried). ToMe's
        options that say where tokens are merged (``scope``, ``merge_*``, ``max_downsample``) are: the limit of a
        whole-block merge runs the whole block on the merged tokens; so is ``min_size`` (which calls merge)."""
        if self.name == "tome":
            return MethodSpec("limit", self.value, tuple((k, v) for k, v in self.options if k in _WHERE))
        if self.name == "tomesd":
            return MethodSpec("limit", self.value)
        if self.name == "todo":
            return MethodSpec("todo-limit", self.value, tuple((k, v) for k, v in self.options if k == "min_size"))
        return None

    @property
    def stateful(self) -> bool:
        """Whether the method keeps state across steps (token reuse): one step alone does not show its cost."""
        return self.name in STATEFUL

    def steady(self) -> "MethodSpec":
        """The same method with the options that change no step's work left out (token reuse's schedule and
        order): what the bench times, and how the frontier finds it."""
        if not self.stateful:
            return self
        return MethodSpec(self.name, self.value, tuple((k, v) for k, v in self.options if k not in SCHEDULE_OPTIONS))

    def reuse_config(self):
        """The ``ReuseConfig`` of a token-reuse spec (its schedule: which steps are full)."""
        return ReuseConfig(fraction=self.value, **self.kwargs())

    def config(self):
        """The ``StepCacheConfig`` (``UNetCacheConfig``) of a step (UNet) cache spec."""
        kwargs = self.kwargs()
        if isinstance(kwargs.get("mask"), int) and not isinstance(kwargs["mask"], bool):  # read as a number
            kwargs["mask"] = str(kwargs["mask"])
        from .. import StepCacheConfig, UNetCacheConfig

        if self.value is not None:
            kwargs["skip"] = int(self.value)
        return (UNetCacheConfig if self.name == "unetcache" else StepCacheConfig)(**kwargs)

    @property
    def is_cache(self) -> bool:
        """Whether it is one of the caches of ``tools/peers.py`` (diffusers', cache-dit's)."""
        return self.name in CACHES

    @property
    def is_across_steps(self) -> bool:
        """Whether it is one of this library's caches across steps (the step cache, the UNet cache)."""
        return self.name in STEP_CACHES

    @property
    def is_factor(self) -> bool:
        """Whether ``value`` is a ToDo factor (else a ToMe ratio, or nothing for vanilla)."""
        return self.name in _FACTOR_METHODS

    def kwargs(self) -> dict:
        """The options as keyword arguments (``reuse_steps``, ``plan_steps``'s former name, read as it)."""
        return {("plan_steps" if k == "reuse_steps" else k): v for k, v in self.options}

    def check(self) -> None:
        """Raise ``ValueError``/``TypeError`` (naming the option) if the method would refuse these settings."""
        if self.name == "grid-limit":
            if self.options:
                raise ValueError("grid-limit takes no options (it runs the unpatched model)")
            if not 0 < self.value < 1:
                raise ValueError(f"grid-limit's ratio must be in (0, 1); got {self.value}")
        elif self.name in ("tome", "limit"):
            ToMeConfig(ratio=self.value, **self.kwargs())
        elif self.name in _FACTOR_METHODS:
            ToDoConfig(downsample=self.value, **self.kwargs())
        elif self.name == "reuse":
            self.reuse_config()
        elif self.is_across_steps:
            if self.value is not None and self.value != int(self.value):
                raise ValueError(f"{self.name}'s value (the steps skipped in a round) must be an integer, got "
                                 f"{self.value:g}")
            self.config()
        elif self.name == "auto":
            from ..accelerate import SPEEDS

            unknown = set(self.kwargs()) - {"speed"}
            if unknown or self.kwargs().get("speed", "balanced") not in SPEEDS:
                raise ValueError(f"auto takes one option, speed= one of {', '.join(SPEEDS)}")
        elif self.name == "tomesd":
            ToMeConfig(ratio=self.value)
            unknown = set(self.kwargs()) - {"sx", "sy", "use_rand", "merge_attn", "merge_crossattn", "merge_mlp",
                                            "max_downsample"}
            if unknown:
                raise ValueError(f"tomesd takes no option {sorted(unknown)}")
        elif self.is_cache:
            from .peers import cache_config

            cache_config(self.name, self.value, self.kwargs())

    def apply(self, model, code_paths: str | None = None) -> None:
        """Apply the method to ``model`` (``code_paths``: run this library's matching the way that device does,
        as ``apply_config`` takes it)."""
        import tokenmerge

        if self.name == "grid-limit":  # the unpatched model, called on smaller inputs (the bench's)
            return
        if self.is_cache:
            from .peers import enable

            enable(model, self.name, self.value, self.kwargs())
        elif self.name == "tome":
            tokenmerge.apply_config(model, ToMeConfig(ratio=self.value, **self.kwargs()), code_paths=code_paths)
        elif self.name == "todo":
            tokenmerge.apply_config(model, ToDoConfig(downsample=self.value, **self.kwargs()), code_paths=code_paths)
        elif self.name == "reuse":
            tokenmerge.apply_config(model, self.reuse_config())
        elif self.is_across_steps:
            tokenmerge.apply_config(model, self.config())
        elif self.name == "auto":
            tokenmerge.accelerate(model, **self.kwargs())
        elif self.name == "limit":
            from .limits import slice_match  # the engine's N-D matcher signature

            tokenmerge.apply_config(model, ToMeConfig(ratio=self.value, **self.kwargs()), matcher=slice_match)
        elif self.name == "todo-limit":
            from .limits import slice_downsample  # the engine's N-D downsampler signature

            tokenmerge.apply_config(model, ToDoConfig(downsample=self.value, **self.kwargs()),
                                    downsampler=slice_downsample)
        elif self.name == "tomesd":
            import tomesd

            kwargs = self.kwargs()
            kwargs.setdefault("max_downsample", auto_downsample(model))  # tomesd's own default misses SDXL
            tomesd.apply_patch(model, ratio=self.value, **kwargs)

    @contextlib.contextmanager
    def applied(self, model, code_paths: str | None = None):
        """``with spec.applied(model):`` the method is on inside the block and removed after, whatever happens."""
        self.apply(model, code_paths)
        try:
            yield model
        finally:
            self.remove(model)

    def remove(self, model) -> None:
        if self.is_cache:
            from .peers import disable

            disable(model, self.name)
        elif self.name == "tomesd":
            import tomesd

            tomesd.remove_patch(model)
        elif self.name not in ("vanilla", "grid-limit"):
            import tokenmerge

            tokenmerge.remove_patch(model)


def _option_text(value) -> str:
    """An option's value as ``parse_spec`` reads it back (a tuple as ``(1,2,2)``)."""
    return "(" + ",".join(str(v) for v in value) + ")" if isinstance(value, tuple) else str(value)


def auto_downsample(model) -> int:
    """The downsampling of the finest level with attention: the blocks our default (and so tomesd's) patches.

    Read through the public API: this library's default patch is applied, described and removed.
    """
    import tokenmerge

    tokenmerge.apply_patch(model, ratio=0.5)
    try:
        info = tokenmerge.describe_patch(model)
    finally:
        tokenmerge.remove_patch(model)
    return min(downsample for denoiser in info.denoisers for _, downsample in denoiser.blocks)


@dataclass(frozen=True)
class Combined:
    """Methods run together (``tome:0.5+fbc:0.05``): applied in order, removed in reverse."""

    parts: tuple[MethodSpec, ...]

    @property
    def name(self) -> str:
        return "+".join(p.name for p in self.parts)

    @property
    def label(self) -> str:
        return " + ".join(p.label for p in self.parts)

    @property
    def text(self) -> str:
        return "+".join(p.text for p in self.parts)

    @contextlib.contextmanager
    def applied(self, model):
        done = []
        try:
            for part in self.parts:
                part.apply(model)
                done.append(part)
            yield model
        finally:
            for part in reversed(done):
                part.remove(model)


def parse_spec(text: str, bench: bool = False) -> MethodSpec | Combined:
    """``"tome:0.5,stop=0.5"`` -> ``MethodSpec("tome", 0.5, (("stop", 0.5),))``, checked.

    ``bench=True`` also accepts the bench's speed references ``limit`` and ``todo-limit``, and refuses diffusers'
    caches and combinations (the bench times one step; a cache acts across steps). Without it, ``A+B`` gives a
    ``Combined`` of at most one token reduction and one cache.
    """
    pieces = split_outside(text, "+")
    if len(pieces) > 1:
        if bench:
            raise ValueError(f"method spec {quote(text)}: the bench times one step of one method; '+' combinations "
                             "(and caches) are for tokenmerge quality")
        parts = tuple(parse_spec(piece.strip()) for piece in pieces)
        caches = sum(p.is_cache for p in parts)
        if any(p.is_across_steps for p in parts):
            raise ValueError(f"method spec {quote(text)}: the step cache is a cache across steps of its own: it "
                             "combines with no other method")
        if len(parts) != 2 or caches != 1 or any(p.name == "vanilla" for p in parts):
            raise ValueError(f"method spec {quote(text)}: a combination is one token reduction (tome, todo, "
                             "tomesd, reuse) and one cache (fbc, taylorseer, pab), e.g. tome:0.5+fbc:0.05")
        return Combined(tuple(sorted(parts, key=lambda p: p.is_cache)))  # the patch first, then the cache
    head, *pairs = [part.strip() for part in split_outside(text)]
    name, _, value = head.partition(":")
    name = name.strip().lower()
    if bench and name in CACHES:
        raise ValueError(f"method spec {quote(text)}: the bench times one denoising step, and a cache acts across "
                         "steps; compare caches with tokenmerge quality")
    allowed = {**METHODS, **BENCH_METHODS} if bench else {**METHODS, **CACHES}
    if name not in allowed:
        raise ValueError(f"method spec {quote(text)}: method must be one of {', '.join(allowed)}; "
                         f"got {quote(name, 40)}")
    if name == "vanilla":
        if value or pairs:
            raise ValueError(f"method spec {quote(text)}: vanilla takes no value or options")
        return MethodSpec("vanilla")
    if name == "auto" and value:
        raise ValueError(f"method spec {quote(text)}: auto takes no value (its option speed= is the knob)")
    number = _value(value) if value else None if name in STEP_CACHES else DEFAULTS.get(
        name, 2 if name in _FACTOR_METHODS else 0.5)
    per_axis = isinstance(number, tuple) and name in _FACTOR_METHODS
    if number is not None and not per_axis and (not isinstance(number, (int, float)) or isinstance(number, bool)):
        hint = " (ToDo: or a factor per axis such as 1x2x2)" if name in _FACTOR_METHODS else ""
        raise ValueError(f"method spec {quote(text)}: the value after ':' must be a number{hint}, "
                         f"got {quote(value, 40)}")
    options = []
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"method spec {quote(text)}: options are KEY=VALUE, got {quote(pair, 40)}")
        options.append((key.strip(), _value(raw.strip())))
    if name in _FACTOR_METHODS and any(k == "downsample" for k, _ in options):  # the factor, written as an option
        if value:
            raise ValueError(f"method spec {quote(text)}: the factor is given twice (after ':' and as downsample=)")
        number = next(v for k, v in options if k == "downsample")
        options = [(k, v) for k, v in options if k != "downsample"]
        if not isinstance(number, (int, tuple)) or isinstance(number, bool):
            raise ValueError(f"method spec {quote(text)}: downsample must be an integer or a factor per axis "
                             "such as (1,2,2)")
    try:
        if name in CACHES and isinstance(DEFAULTS[name], int):
            if number != int(number) or number < 1:
                raise ValueError(f"{name}'s value must be a positive integer, got {value}")
            number = int(number)
        spec = MethodSpec(name, None if name == "auto" or number is None else number
                          if name in _FACTOR_METHODS or name in CACHES
                          else int(number) if name in STEP_CACHES and number == int(number)
                          else float(number),
                          tuple(options))
        spec.check()
    except ImportError as err:
        raise ValueError(f"method spec {quote(text)}: {err}") from None
    except (TypeError, ValueError, ArithmeticError) as err:  # an unknown keyword, a value out of range or too big
        raise ValueError(f"method spec {quote(text)}: {cap_message(str(err))}") from None
    return spec
