"""The mechanism the caches across steps share (the step cache, the UNet cache): each says what a cached step does
not run and what it keeps; this module does the rest once.

- ``Bypass``: the ``forward`` of a module a cached step may not run (an instance attribute, as diffusers' hook
  registry sets one; the model's code is not copied), calling the cache's ``forward(bypass, args, kwargs)``.
- ``Across``: the technique's shared part: the blocks it holds, install and release, the decision at each call (on
  the host: ``schedule.py``), the kept state per slot of the step clock, the slope and its weight, the refusal that
  turns the cache off with one warning, and ``Ran``: what the latest generation computed, for ``describe_patch``.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import torch

from ..technique import Technique

__all__ = ["Bypass", "Across", "Ran", "slope_of"]


class Bypass:
    """A module's ``forward`` while a cache is installed: the cache's ``forward`` with the module's own
    (``previous``: the forward it replaced, ``None`` for the class's); ``detach()`` makes it the module's own."""

    __slots__ = ("cache", "index", "block", "previous", "own")

    def __init__(self, cache, index: int, block, previous):
        self.cache, self.index, self.block, self.previous = cache, index, block, previous
        self.own = type(block).forward  # the class's forward, a plain function (what torch.compile traces)

    def inner(self, *args, **kwargs):
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return self.own(self.block, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if self.cache is None:
            return self.inner(*args, **kwargs)
        return self.cache.forward(self, args, kwargs)

    def detach(self) -> None:
        self.cache = None

    @property
    def __signature__(self):
        """The wrapped forward's signature (what binding an argument of the block by name reads)."""
        inner = self.previous if self.previous is not None else self.own.__get__(self.block)
        return inspect.signature(inner)


@dataclasses.dataclass
class Ran:
    """What a cache did in the latest generation it ran: per place of a call in its step (guidance as two calls:
    two places), the calls computed and cached; the calls computed for a fallback, by reason; how the steps were
    told (``scheduler``: the pipeline's scheduler's host state; ``timestep``: the call's timestep read)."""

    generation: int = -1
    steps: int | None = None
    computed: dict = dataclasses.field(default_factory=dict)
    cached: dict = dataclasses.field(default_factory=dict)
    fallbacks: dict = dataclasses.field(default_factory=dict)
    told: dict = dataclasses.field(default_factory=dict)

    def count(self, clock, place: int, computed: bool, why: str | None, told: str) -> None:
        if clock.generation != self.generation:
            self.__init__(clock.generation, clock.steps)
        tally = self.computed if computed else self.cached
        tally[place] = tally.get(place, 0) + 1
        if why is not None:
            self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        self.told[told] = self.told.get(told, 0) + 1

    def share(self) -> float | None:
        """The share of the calls computed (``None`` before any call)."""
        total = sum(self.computed.values()) + sum(self.cached.values())
        return sum(self.computed.values()) / total if total else None

    def words(self, cached: str) -> str:
        """``last generation (28 steps): 11 of 28 calls computed, 17 skipped; steps told by the scheduler...``."""
        if self.generation < 0:
            return "no generation has run yet"
        places = sorted(set(self.computed) | set(self.cached))
        parts = [f"{self.computed.get(p, 0)} of {self.computed.get(p, 0) + self.cached.get(p, 0)} computed, "
                 f"{self.cached.get(p, 0)} {cached}" for p in places]
        head = f"last generation ({self.steps} steps)" if self.steps else "last generation"
        lines = [f"{head}: " + ("; ".join(f"call {p + 1} of a step: {t}" for p, t in zip(places, parts))
                                if len(places) > 1 else parts[0] if parts else "no call")]
        lines += [f"{n} calls computed because {why}" for why, n in self.fallbacks.items()]
        how = {"scheduler": "the pipeline's scheduler (its step index; its timesteps read once per generation)",
               "timestep": "each call's timestep, read on the host (a bare model, or a scheduler that keeps no step "
                           "index)"}
        lines += [f"steps told by {how.get(t, t)}" for t in self.told]
        return "; ".join(lines)


def slope_of(new: torch.Tensor, old: torch.Tensor | None, gap: float | None) -> torch.Tensor | None:
    """``(new - old) / gap``: the kept value's change per unit of progress between two computed steps, or ``None``
    where it cannot be measured (no value before, another shape, no progress between them)."""
    if old is None or old.shape != new.shape or old.dtype != new.dtype or not gap or gap <= 0:
        return None
    return (new - old).div_(gap)


class Across(Technique):
    """A cache across steps: its modules' forwards are ``Bypass``es (``self.bypassed``, set by the subclass, in the
    order of the ``index`` each passes to the subclass's ``forward``). The subclass gives ``Kept`` (its state per
    slot: ``at``, the progress of the last computed step, ``None`` while nothing is kept; ``reset()``),
    ``call(kept, computed, info)`` (the call's state, ``state.work``), ``forward`` and ``end``."""

    clocked = timed = host = hosted = True  # computed or not: decided on the host at each call
    gridded = False  # (a cached step runs no block of the stack: no token grid needed, but under context parallelism)
    Kept: type = type(None)
    verb, cached = "cache", "cached"  # what it does to a step, in messages and reports

    @classmethod
    def levels(cls, config) -> None:
        return None

    @classmethod
    def select(cls, site, config) -> list:
        """Every block of the denoiser: a cache across steps keeps them all."""
        return list(site.blocks)

    def __init__(self, patch):
        super().__init__(patch)
        self.bypassed: list = []
        self.bypasses: list[Bypass] = []
        self.warned = False
        self.off: str | None = None  # why the cache computes every step (what it cannot stand in for)
        self.ran = Ran()

    def install(self) -> list:
        for index, module in enumerate(self.bypassed):
            bypass = Bypass(self, index, module, module.__dict__.get("forward"))
            module.forward = bypass
            self.bypasses.append(bypass)
        return []

    def release(self) -> None:
        for bypass in self.bypasses:
            module = bypass.block
            if module.__dict__.get("forward") is bypass:
                if bypass.previous is None:
                    del module.__dict__["forward"]
                else:
                    module.forward = bypass.previous
            else:  # wrapped since by another hook (diffusers' registry): passes through from now on
                bypass.detach()
        self.bypasses.clear()

    def hook_codes(self) -> list:
        return [type(self).forward.__code__, Bypass.__call__.__code__, Bypass.inner.__code__]

    # ---- the denoiser's call (on the host) ----------------------------------------------------------------------
    def begin(self, state, info) -> None:
        """Set up the call: the slot's kept state, computed or cached (``decide``), the technique's call state."""
        if info.progress is None:  # no timestep: the steps cannot be told apart
            self._warn_once(f"a call got no timestep, which the {self.name} needs to tell the steps apart; such calls "
                            "are computed whole", depth=5)
            return
        kept = state.clock.kept_for(state.slot, self.Kept)
        state.work = self.call(kept, self.decide(state, kept, info), info)

    def decide(self, state, kept, info) -> bool:
        """Whether the call is computed: its slot's first, every call while the cache is off or of a generation
        shorter than ``min_steps`` (a fallback, counted as such in ``self.ran``), else as the schedule says."""
        cfg, clock = self.config, state.clock
        fallback = (f"the {self.name} is off ({self.off})" if self.off is not None else
                    f"the generation has fewer than min_steps={cfg.min_steps} steps" if cfg.too_short(clock.steps)
                    else None)
        computed = fallback is not None or kept.at is None or cfg.computes(clock.step, info.progress, kept.at)
        self.ran.count(clock, state.slot[1], computed, fallback, info.told)
        return computed

    def weight(self, kept, progress: float):
        """The slope's weight at a cached step, ``extrapolate x`` the progress since the last computed one: a 0-d
        tensor of the kept state's, filled (compiled code sees one tensor, not a number per step), or ``None``."""
        if not self.config.extrapolate or getattr(kept, "weight", None) is None:
            return None
        return kept.weight.fill_(self.config.extrapolate * (progress - kept.at))

    def refuse(self, why: str) -> None:
        """Turn the cache off (every step computed from now on), with one warning saying why."""
        if not torch.compiler.is_compiling():
            self.off = why
            self._warn_once(f"the {self.name} cannot {self.verb} steps: {why}; every step is computed")

    def _warn_once(self, reason: str, depth: int = 5) -> None:
        if self.warned:
            return
        self.warned = True
        name = self.patch.site.path or type(self.patch.site.module).__name__
        warnings.warn(f"tokenmerge: {name}: {reason}. The generation goes on", RuntimeWarning, stacklevel=depth)

    # ---- describe_patch -------------------------------------------------------------------------------------------
    def report(self) -> str:
        """What the latest generation ran (``Ran.words``)."""
        return self.ran.words(self.cached)

    def counted(self) -> dict | None:
        share = self.ran.share()
        return None if share is None else {"steps": self.ran.steps, "computed": share}
