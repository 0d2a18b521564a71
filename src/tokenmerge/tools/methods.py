"""Methods named by short text specs, for the command line: ``tome:0.5``, ``todo:2,stop=0.5``, ``tomesd:0.5``.

Grammar: ``NAME[:VALUE][,KEY=VALUE...]``. NAME is one of ``METHODS``; VALUE is ToMe's ratio or ToDo's factor;
KEY=VALUE pairs are keyword arguments of ``apply_patch`` / ``apply_todo`` / ``tomesd.apply_patch``
(``stop=0.5``, ``reuse_steps=2``, ``mode=avg``...). A spec is checked when parsed: a bad name or option raises
``ValueError`` naming it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..config import ToDoConfig, ToMeConfig
from .text import cap_message, quote

__all__ = ["METHODS", "BENCH_METHODS", "MethodSpec", "parse_spec"]

METHODS = {
    "vanilla": "no merging",
    "tome": "this library's ToMe; VALUE = ratio (default 0.5)",
    "todo": "token downsampling of self-attention keys/values; VALUE = factor per side (default 2)",
    "tomesd": "the reference tomesd package, on the same blocks as ours; VALUE = ratio (default 0.5)",
}
# Speed references for the bench only: their outputs are meaningless as images.
BENCH_METHODS = {
    "limit": "ToMe's zero-overhead limit: attention on the merged token count, merge = a slice, unmerge = a repeat; "
             "VALUE = ratio",
    "todo-limit": "ToDo's zero-overhead limit: keys/values = a slice of the pooled token count; VALUE = factor",
}
_FACTOR_METHODS = ("todo", "todo-limit")


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
    return text


@dataclass(frozen=True)
class MethodSpec:
    name: str
    value: float | int | None = None
    options: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        head = self.name if self.value is None else f"{self.name} {self.value:g}"
        return " ".join([head] + [f"{k}={v}" for k, v in self.options])

    @property
    def text(self) -> str:
        """The spec as ``parse_spec`` reads it back."""
        head = self.name if self.value is None else f"{self.name}:{self.value:g}"
        return ",".join([head] + [f"{k}={v}" for k, v in self.options])

    @property
    def is_factor(self) -> bool:
        """Whether ``value`` is a ToDo factor (else a ToMe ratio, or nothing for vanilla)."""
        return self.name in _FACTOR_METHODS

    def kwargs(self) -> dict:
        return dict(self.options)

    def check(self) -> None:
        """Raise ``ValueError``/``TypeError`` (naming the option) if the method would refuse these settings."""
        if self.name in ("tome", "limit"):
            ToMeConfig(ratio=self.value, **self.kwargs())
        elif self.name in _FACTOR_METHODS:
            ToDoConfig(downsample=self.value, **self.kwargs())
        elif self.name == "tomesd":
            ToMeConfig(ratio=self.value)
            unknown = set(self.kwargs()) - {"sx", "sy", "use_rand", "merge_attn", "merge_crossattn", "merge_mlp",
                                            "max_downsample"}
            if unknown:
                raise ValueError(f"tomesd takes no option {sorted(unknown)}")

    def apply(self, model) -> None:
        import tokenmerge

        if self.name == "tome":
            tokenmerge.apply_patch(model, ratio=self.value, **self.kwargs())
        elif self.name == "todo":
            tokenmerge.apply_todo(model, downsample=self.value, **self.kwargs())
        elif self.name == "limit":
            from ..merge.plan import slice_match  # the engine's N-D matcher signature

            tokenmerge.apply_config(model, ToMeConfig(ratio=self.value, **self.kwargs()), matcher=slice_match)
        elif self.name == "todo-limit":
            from ..merge.downsample import slice_downsample  # the engine's N-D downsampler signature

            tokenmerge.apply_config(model, ToDoConfig(downsample=self.value, **self.kwargs()),
                                    downsampler=slice_downsample)
        elif self.name == "tomesd":
            import tomesd

            kwargs = self.kwargs()
            kwargs.setdefault("max_downsample", auto_downsample(model))  # tomesd's own default misses SDXL
            tomesd.apply_patch(model, ratio=self.value, **kwargs)

    @contextlib.contextmanager
    def applied(self, model):
        """``with spec.applied(model):`` the method is on inside the block and removed after, whatever happens."""
        self.apply(model)
        try:
            yield model
        finally:
            self.remove(model)

    def remove(self, model) -> None:
        if self.name == "tomesd":
            import tomesd

            tomesd.remove_patch(model)
        elif self.name != "vanilla":
            import tokenmerge

            tokenmerge.remove_patch(model)


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


def parse_spec(text: str, bench: bool = False) -> MethodSpec:
    """``"tome:0.5,stop=0.5"`` -> ``MethodSpec("tome", 0.5, (("stop", 0.5),))``, checked.

    ``bench=True`` also accepts the bench's speed references ``limit`` and ``todo-limit``.
    """
    head, *pairs = [part.strip() for part in text.split(",")]
    name, _, value = head.partition(":")
    name = name.strip().lower()
    allowed = {**METHODS, **BENCH_METHODS} if bench else METHODS
    if name not in allowed:
        raise ValueError(f"method spec {quote(text)}: method must be one of {', '.join(allowed)}; got {quote(name, 40)}")
    if name == "vanilla":
        if value or pairs:
            raise ValueError(f"method spec {quote(text)}: vanilla takes no value or options")
        return MethodSpec("vanilla")
    number = _value(value) if value else (2 if name in _FACTOR_METHODS else 0.5)
    if not isinstance(number, (int, float)) or isinstance(number, bool):
        raise ValueError(f"method spec {quote(text)}: the value after ':' must be a number, got {quote(value, 40)}")
    options = []
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"method spec {quote(text)}: options are KEY=VALUE, got {quote(pair, 40)}")
        options.append((key.strip(), _value(raw.strip())))
    try:
        spec = MethodSpec(name, number if name in _FACTOR_METHODS else float(number), tuple(options))
        spec.check()
    except (TypeError, ValueError, ArithmeticError) as err:  # an unknown keyword, a value out of range or too big
        raise ValueError(f"method spec {quote(text)}: {cap_message(str(err))}") from None
    return spec
