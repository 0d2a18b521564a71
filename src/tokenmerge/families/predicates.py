"""Structural predicates that recognise a model family: attributes, forward arguments, config keys.

Plain objects, not lambdas, so that a patched model (which refers to its family) pickles and deep-copies.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

__all__ = ["Predicate", "has", "has_list", "takes", "config_has", "config_is", "block_has", "config", "params"]


def params(module: nn.Module) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []


class Predicate:
    """A structural test on a module, composable with ``&``, ``|`` and ``~``; ``str()`` says what it tests."""

    def __call__(self, module: nn.Module) -> bool:
        raise NotImplementedError

    def __and__(self, other: "Predicate") -> "Predicate":
        return _All((self, other))

    def __or__(self, other: "Predicate") -> "Predicate":
        return _Any((self, other))

    def __invert__(self) -> "Predicate":
        return _Not(self)


@dataclass(frozen=True)
class _All(Predicate):
    parts: tuple

    def __call__(self, module):
        return all(p(module) for p in self.parts)

    def __str__(self):
        return " & ".join(map(str, self.parts))


@dataclass(frozen=True)
class _Any(Predicate):
    parts: tuple

    def __call__(self, module):
        return any(p(module) for p in self.parts)

    def __str__(self):
        return "(" + " | ".join(map(str, self.parts)) + ")"


@dataclass(frozen=True)
class _Not(Predicate):
    part: Predicate

    def __call__(self, module):
        return not self.part(module)

    def __str__(self):
        return f"~{self.part}"


@dataclass(frozen=True)
class has(Predicate):
    """The module has these attributes, each an ``nn.Module`` (a ``ModuleList`` counts)."""

    attrs: tuple

    def __init__(self, *attrs: str):
        object.__setattr__(self, "attrs", attrs)

    def __call__(self, module):
        return all(isinstance(getattr(module, a, None), nn.Module) for a in self.attrs)

    def __str__(self):
        return f"has({', '.join(self.attrs)})"


@dataclass(frozen=True)
class has_list(Predicate):
    """The module has these attributes, each an ``nn.ModuleList``."""

    attrs: tuple

    def __init__(self, *attrs: str):
        object.__setattr__(self, "attrs", attrs)

    def __call__(self, module):
        return all(isinstance(getattr(module, a, None), nn.ModuleList) for a in self.attrs)

    def __str__(self):
        return f"has_list({', '.join(self.attrs)})"


@dataclass(frozen=True)
class takes(Predicate):
    """``forward`` has parameters with these names."""

    names: tuple

    def __init__(self, *names: str):
        object.__setattr__(self, "names", names)

    def __call__(self, module):
        names = {p.name for p in params(module)}
        return all(n in names for n in self.names)

    def __str__(self):
        return f"takes({', '.join(self.names)})"


def config(module: nn.Module) -> dict:
    cfg = getattr(module, "config", None)  # diffusers' FrozenDict; a transformers config is not a dict
    return cfg if isinstance(cfg, dict) else {}


@dataclass(frozen=True)
class config_has(Predicate):
    """The module's (diffusers) config has ``key``, of type ``kind``."""

    key: str
    kind: object = object

    def __call__(self, module):
        cfg = config(module)
        return self.key in cfg and isinstance(cfg[self.key], self.kind)

    def __str__(self):
        return f"config_has({self.key})"


@dataclass(frozen=True)
class config_is(Predicate):
    """The module's config has ``key`` equal to ``value``."""

    key: str
    value: object

    def __call__(self, module):
        cfg = config(module)
        return self.key in cfg and cfg[self.key] == self.value

    def __str__(self):
        return f"config_is({self.key}={self.value!r})"


@dataclass(frozen=True)
class block_has(Predicate):
    """The first block of the ``blocks`` list (``index``: that block, ``-1`` the last) has these sub-modules."""

    blocks: str
    attrs: tuple
    index: int = 0

    def __init__(self, blocks: str, *attrs: str, index: int = 0):
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "attrs", attrs)
        object.__setattr__(self, "index", index)

    def __call__(self, module):
        seq = getattr(module, self.blocks, None)
        return isinstance(seq, nn.ModuleList) and -len(seq) <= self.index < len(seq) \
            and has(*self.attrs)(seq[self.index])

    def __str__(self):
        return f"{self.blocks}[{self.index}].has({', '.join(self.attrs)})"
