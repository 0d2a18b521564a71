"""The mechanism the caches across steps share (the step cache, the UNet cache): each says what a cached step does
not run and what it keeps; this module does the rest once.

- ``Bypass``: the ``forward`` of a module a cached step may not run (an instance attribute, as diffusers' hook
  registry sets one; the model's code is not copied), calling the cache's ``forward(bypass, args, kwargs)``.
- ``CompiledBypass``: such a module compiled in place (``Module.compile()``, diffusers' ``compile_repeated_blocks``):
  its compiled call, wrapped; the cache decides there, eagerly, and runs the compiled code at a computed step only.
- ``DecidingContext``: the denoiser's ``cache_context`` (diffusers' pipelines enter it around each call): the call
  decided on the host before it (``clock.decide_ahead``), so that a denoiser compiled whole with ``fullgraph=True``
  reads only what was decided.
- ``Across``: the technique's shared part: the blocks it holds, install and release, the decision at each call (on
  the host: ``schedule.py``), the kept state per branch of the step clock (``BranchState``: tensors updated in place,
  the slope's weight and span 0-d tensors filled on the host), the refusal that turns the cache off with one warning,
  and ``Tally``: what the latest generation computed, for ``describe_patch``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import threading
import warnings

import torch

from ..clock import decide_ahead
from ..technique import Technique

__all__ = ["Bypass", "CompiledBypass", "DecidingContext", "Across", "BranchState", "Tally", "moved"]


class Bypass:
    """A module's ``forward`` while a cache is installed: the cache's ``forward`` with the module's own
    (``previous``: the forward it replaced, ``None`` for the class's); ``detach()`` makes it the module's own. Where
    the module is compiled in place, ``compiled`` (its ``CompiledBypass``) decides and this forward passes through."""

    __slots__ = ("cache", "index", "block", "previous", "own", "compiled")

    def __init__(self, cache, index: int, block, previous):
        self.cache, self.index, self.block, self.previous = cache, index, block, previous
        self.own = type(block).forward  # the class's forward, a plain function (what torch.compile traces)
        self.compiled = None

    def inner(self, *args, **kwargs):
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return self.own(self.block, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if self.cache is None or self.compiled is not None:  # removed, or run by its compiled code (it decided)
            return self.inner(*args, **kwargs)
        return self.cache.forward(self, args, kwargs)

    def detach(self) -> None:
        self.cache = None

    @property
    def __signature__(self):
        """The wrapped forward's signature (what binding an argument of the block by name reads)."""
        inner = self.previous if self.previous is not None else self.own.__get__(self.block)
        return inspect.signature(inner)


class CompiledBypass:
    """A bypassed module compiled in place (regional compilation): its ``_compiled_call_impl`` while the cache is
    installed. The cache's ``forward`` runs here, eagerly, as for a module not compiled (``inner``: the compiled call,
    the module's hooks and its forward, which passes through): a computed step runs the compiled code, one variant of
    it per block class (no state of the cache is read inside it), a cached step none of it."""

    __slots__ = ("bypass", "call", "index", "block")

    def __init__(self, bypass: Bypass, call):
        self.bypass, self.call, self.index, self.block = bypass, call, bypass.index, bypass.block

    def inner(self, *args, **kwargs):
        return self.call(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        cache = self.bypass.cache
        return self.call(*args, **kwargs) if cache is None else cache.forward(self, args, kwargs)


_EAGER_LOCK = threading.Lock()
_EAGER: dict = {"holders": 0, "stance": None}


@contextlib.contextmanager
def _forced_eager():
    """Compiled code runs eagerly while any thread is inside (``torch.compiler.set_stance("force_eager")``). The
    stance is the process's, not a thread's: two generations on two threads, each entering and leaving it in its own
    order, would each restore what the other set, and leave the stance forced for good. So the holders are counted
    under a lock: the first sets it, the last restores what was before (a thread's compiled calls in between run
    eagerly too: the same outputs, slower)."""
    with _EAGER_LOCK:
        if _EAGER["holders"] == 0:
            _EAGER["stance"] = torch.compiler.set_stance("force_eager")  # set now; its exit restores the previous
        _EAGER["holders"] += 1
    try:
        yield
    finally:
        with _EAGER_LOCK:
            _EAGER["holders"] -= 1
            if _EAGER["holders"] == 0:
                stance, _EAGER["stance"] = _EAGER["stance"], None
                stance.__exit__(None, None, None)


class DecidingContext:
    """A denoiser's ``cache_context`` while a cache is installed. diffusers' pipelines enter it around each denoiser
    call (``with transformer.cache_context("cond", step_index=i, sigma=...): ...``), on the host: the call is decided
    there (``clock.decide_ahead``), so that the call reads only what was decided (compiled whole with
    ``fullgraph=True``: a computed and a skipped variant, told apart by a bool of the call's state, compiled once
    each). The model's own ``cache_context`` (diffusers' caches) runs around it. A branch's first computed call,
    which makes what the cache keeps, runs eagerly (``torch.compiler.set_stance``), so that compiled code sees only
    the kept state of later calls."""

    def __init__(self, cache, module, previous):
        self.cache, self.module, self.previous = cache, module, previous

    @contextlib.contextmanager
    def __call__(self, name, **kwargs):
        own = self.previous or type(self.module).cache_context.__get__(self.module)
        with own(name, **kwargs):
            state = decide_ahead(self.cache.calls, kwargs)  # decided here (CallHook.decide), or None: at the call
            work = state.work if state is not None else None
            first = work is not None and work.kept.span is None and self.cache.off is None
            eager = first and "torch._dynamo" in sys.modules and hasattr(torch.compiler, "set_stance")
            try:
                with _forced_eager() if eager else contextlib.nullcontext():
                    yield
            finally:
                if state is not None and state.decided:  # decided, and not called
                    state.reset()


@dataclasses.dataclass(slots=True)
class BranchState:
    """What a cache keeps for one branch, its tensors made at the branch's first computed call and then updated in place
    (compiled code and CUDA graphs see the same tensors at every step): ``at``, the progress of the last computed
    call kept (``None`` while nothing of this generation is); ``weight``, the slope's weight at a cached call and
    ``span``, the progress between the last two computed calls (0-d tensors, filled on the host: ``Across.begin``);
    ``sloped``, whether the slope is measured (two computed calls of this generation kept)."""

    at: float | None = None
    weight: torch.Tensor | None = None
    span: torch.Tensor | None = None
    sloped: bool = False

    def reset(self) -> None:
        """A new generation: the values forgotten, the tensors kept for its calls (``Clock.restart``)."""
        self.at, self.sloped = None, False

    def made(self, like: torch.Tensor, progress: float) -> None:
        """The 0-d tensors made beside the kept ``like`` (a first computed call, or new shapes), at ``progress``."""
        self.weight, self.span = like.new_zeros(()), like.new_ones((), dtype=torch.float32)
        self.at, self.sloped = progress, False


@dataclasses.dataclass
class Tally:
    """What a cache did in the latest generation it ran: per place of a call in its step (guidance as two calls:
    two places), the calls computed and cached; the calls computed for a fallback, by reason; how the steps were
    told (``scheduler``: the pipeline's scheduler's host state; ``timestep``: the call's timestep read)."""

    generation: int = -1
    steps: int | None = None
    computed: dict = dataclasses.field(default_factory=dict)
    cached: dict = dataclasses.field(default_factory=dict)
    fallbacks: dict = dataclasses.field(default_factory=dict)
    sources: dict = dataclasses.field(default_factory=dict)
    said: bool = False  # a generation that skipped nothing was said (Across.skipped_nothing)

    def count(self, clock, place: int, computed: bool, why: str | None, source: str) -> None:
        if clock.generation != self.generation:
            self.__init__(clock.generation, clock.steps)
        tally = self.computed if computed else self.cached
        tally[place] = tally.get(place, 0) + 1
        if why is not None:
            self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        self.sources[source] = self.sources.get(source, 0) + 1

    def share(self) -> float | None:
        """The share of the calls computed (``None`` before any call)."""
        total = sum(self.computed.values()) + sum(self.cached.values())
        return sum(self.computed.values()) / total if total else None

    def words(self, word: str) -> str:
        """``last generation (28 steps): 11 of 28 calls computed, 17 skipped; steps told by the scheduler...``."""
        if self.generation < 0:
            return "no generation has run yet"
        places = sorted(set(self.computed) | set(self.cached))
        parts = [f"{self.computed.get(p, 0)} of {self.computed.get(p, 0) + self.cached.get(p, 0)} computed, "
                 f"{self.cached.get(p, 0)} {word}" for p in places]
        head = f"last generation ({self.steps} steps)" if self.steps else "last generation"
        lines = [f"{head}: " + ("; ".join(f"call {p + 1} of a step: {t}" for p, t in zip(places, parts))
                                if len(places) > 1 else parts[0] if parts else "no call")]
        lines += [f"{n} calls computed because {why}" for why, n in self.fallbacks.items()]
        how = {"context": "the pipeline's cache_context (the step index and sigma it passes)",
               "scheduler": "the pipeline's scheduler (its step index; its timesteps read once per generation)",
               "timestep": "each call's timestep, read on the host (a bare model, or a scheduler that keeps no step "
                           "index)"}
        lines += [f"steps told by {how.get(t, t)}" for t in self.sources]
        return "; ".join(lines)


def moved(old: torch.Tensor, new: torch.Tensor, slope: torch.Tensor | None, span: torch.Tensor) -> None:
    """``old`` made ``new`` in place, ``slope`` (where kept) its change per unit of progress: ``(new - old) / span``."""
    if slope is not None:
        slope.copy_(new - old).div_(span)
    old.copy_(new)


class Across(Technique):
    """A cache across steps: its modules' forwards are ``Bypass``es (``self.bypassed``, set by the subclass, in the
    order of the ``index`` each passes to the subclass's ``forward``). The subclass gives ``Branch`` (its state per
    branch, a ``BranchState``), ``call(kept, computed, info)`` (the call's state, ``state.work``), ``forward`` and
    ``end``. Modules compiled in place, before the patch or after it, are followed (``follow``: ``CompiledBypass``)."""

    clocked = timed = decides_on_host = reads_scheduler = True  # computed or not: decided on the host at each call
    regional = True  # it stands modules compiled in place (refusals.py, call.Watch)
    gridded = False  # (a cached step runs no block of the stack: no token grid needed, but under context parallelism)
    Branch: type = type(None)
    verb, word = "cache", "cached"  # what it does to a step, in messages and reports
    # the subclass's words, each whole: the attribute of a diffusers ControlNet and why it is left to run every step;
    # what a diffusers cache on its modules would miss; the refusal of such a cache (a template: what, when, path, why)
    controlnet: tuple[str, str] = ("", "")
    keeps, clash_message = "", ""

    @classmethod
    def levels(cls, config) -> None:
        return None

    @classmethod
    def needs_timestep(cls, site, name: str) -> None:
        """``TypeError`` where the denoiser ``name`` at ``site`` takes no timestep (the steps are told by it)."""
        if site.timestep is None:
            raise TypeError(f"tokenmerge: {name} takes no timestep argument, which the {cls.name} needs to tell the "
                            "denoising steps apart")

    @classmethod
    def leave(cls, site, config) -> str | None:
        attribute, why = cls.controlnet
        return why if hasattr(site.module, attribute) else None

    @classmethod
    def refuses_cache(cls, config, is_target: bool) -> str | None:
        return cls.keeps

    @classmethod
    def cache_message(cls, path: str, what: str, when: str, why: str) -> str:
        return cls.clash_message.format(what=what, when=when, path=path, why=why)

    @classmethod
    def select(cls, site, config) -> list:
        """Every block of the denoiser: a cache across steps keeps them all."""
        return list(site.blocks)

    def __init__(self, patch):
        super().__init__(patch)
        self.bypassed: list = []
        self.bypasses: list[Bypass] = []
        self.warned: set = set()  # the causes warned about (one warning each)
        # why the cache computes every step of this generation (what it cannot stand in for), and the generation it
        # was found in: the next one tries again
        self.off: str | None = None
        self.off_in = -1
        self.tally = Tally()
        self.context: DecidingContext | None = None  # the denoiser's cache_context, where its class has one

    def install(self) -> list:
        for index, module in enumerate(self.bypassed):
            bypass = Bypass(self, index, module, module.__dict__.get("forward"))
            module.forward = bypass
            self.bypasses.append(bypass)
            self.follow(bypass)
        denoiser = self.patch.site.module
        if callable(getattr(type(denoiser), "cache_context", None)):
            own = denoiser.__dict__.get("cache_context")
            self.context = denoiser.cache_context = DecidingContext(self, denoiser, own)
        return []

    def follow(self, bypass: Bypass) -> None:
        """Follow the module's compilation in place (``Module.compile()``, before the patch or since; ``call.Watch``
        checks at each call): its compiled call wrapped in a ``CompiledBypass``, or none where it is not compiled."""
        compiled = bypass.block.__dict__.get("_compiled_call_impl")
        if isinstance(compiled, CompiledBypass) or compiled is None:
            bypass.compiled = compiled
        else:
            bypass.compiled = bypass.block._compiled_call_impl = CompiledBypass(bypass, compiled)

    def release(self) -> None:
        self.calls.state.clock.spare.clear()  # the kept tensors set aside by the clock (Clock.clear)
        denoiser = self.patch.site.module
        if self.context is not None and denoiser.__dict__.get("cache_context") is self.context:
            del denoiser.__dict__["cache_context"]
            if self.context.previous is not None:
                denoiser.cache_context = self.context.previous
        for bypass in self.bypasses:
            module = bypass.block
            if bypass.compiled is not None and module.__dict__.get("_compiled_call_impl") is bypass.compiled:
                module._compiled_call_impl = bypass.compiled.call
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
        """Set up the call: the branch's kept state, computed or cached (``decide``), the technique's call state."""
        if info.where.progress is None:  # no timestep: the steps cannot be told apart
            self._warn_once(f"a call got no timestep, which the {self.name} needs to tell the steps apart; such calls "
                            "are computed whole", depth=5, cause="timestep")
            return
        kept = state.clock.kept_for(state.branch, self.Branch)
        computed = self.decide(state, kept, info)
        if computed and kept.span is not None:
            # something kept before: the slope is measured at the call's end, over the progress since the last
            # computed call
            span = info.where.progress - kept.at if kept.at is not None else 0.0
            kept.sloped = span > 0
            kept.span.fill_(span if span > 0 else 1.0)
            kept.at = info.where.progress
        state.work = self.call(kept, computed, info)

    def decide(self, state, kept, info) -> bool:
        """Whether the call is computed: its branch's first, every call of a generation the cache is off in or
        shorter than ``min_steps`` (a fallback, counted as such in ``self.tally``), else as the schedule says. A
        generation that skipped nothing is said once per cause (``skipped_nothing``)."""
        cfg, clock = self.config, state.clock
        if clock.generation != self.tally.generation:  # a new generation: the last one's tally, a fresh start
            self.skipped_nothing(self.tally)
            if self.off is not None and self.off_in != clock.generation:
                self.off = None
        fallback = (f"the {self.name} is off ({self.off})" if self.off is not None else
                    f"the generation has fewer than min_steps={cfg.min_steps} steps" if cfg.too_short(clock.steps)
                    else None)
        computed = fallback is not None or kept.at is None or cfg.computes(clock.step, info.where.progress, kept.at,
                                                                           clock.steps)
        self.tally.count(clock, state.branch[1], computed, fallback, info.where.source)
        if clock.steps is not None and clock.step == clock.steps - 1:  # its last step: said now, not at the next
            self.skipped_nothing(self.tally)
        return computed

    def skipped_nothing(self, tally: Tally) -> None:
        """Where the generation ``tally`` counts computed every call, one warning per cause saying what to change."""
        if tally.generation < 0 or tally.cached or not tally.computed or tally.said:
            return
        tally.said = True
        cfg, steps = self.config, tally.steps
        if any(why.startswith("the generation has fewer") for why in tally.fallbacks):
            self._warn_once(f"a generation of {steps} steps, fewer than min_steps={cfg.min_steps}, {self.verb}s no "
                            f"step (a distilled model's few steps lose the most to a skipped one); min_steps=0 "
                            f"{self.verb}s them anyway", cause="short")
        elif not tally.fallbacks and (steps is None or max(tally.computed.values()) >= steps):
            # (a generation stopped early reached no last step: its schedule is not why it computed them all)
            change = {"gap": "a larger gap_growth", "rounds": "a larger skip", "mask": "another mask"}[cfg.kind]
            self._warn_once(f"its schedule computed every step of a generation of {steps or 'these'} steps on this "
                            f"time grid ({cfg.setting_words()}): {change}, more steps, or a setting tuned for this "
                            f"generation (tokenmerge.tune) {self.verb}s some", cause="schedule")

    def weight(self, kept, progress: float):
        """The slope's weight at a cached step, ``extrapolate x`` the progress since the last computed one (0 while
        the slope is not measured): the kept 0-d tensor, filled (compiled code sees one tensor, not a number per
        step), or ``None``."""
        if not self.config.extrapolate or kept.weight is None:
            return None
        return kept.weight.fill_(self.config.extrapolate * (progress - kept.at) if kept.sloped else 0.0)

    def refuse(self, why: str) -> None:
        """Turn the cache off for the rest of this generation (every step computed; the next generation tries
        again, what the cache learned of the model's calls forgotten: ``forget``), with one warning per cause."""
        if not torch.compiler.is_compiling():
            self.off, self.off_in = why, self.calls.state.clock.generation
            self.forget()
            self._warn_once(f"the {self.name} cannot {self.verb} the steps of this generation: {why}; its steps are "
                            "computed, and the next generation tries again", cause=why)

    def forget(self) -> None:
        """Forget what was learned of the model's calls (a refusal: the next generation learns it again)."""

    def _warn_once(self, reason: str, depth: int = 5, cause: str | None = None) -> None:
        cause = reason if cause is None else cause
        if cause in self.warned:
            return
        self.warned.add(cause)
        name = self.patch.site.path or type(self.patch.site.module).__name__
        warnings.warn(f"tokenmerge: {name}: {reason}. The generation goes on", RuntimeWarning, stacklevel=depth)

    # ---- describe_patch -------------------------------------------------------------------------------------------
    def report(self) -> str:
        """What the latest generation ran (``Tally.words``)."""
        return self.tally.words(self.word)

    def computed_share(self) -> dict | None:
        share = self.tally.share()
        return None if share is None else {"steps": self.tally.steps, "computed": share}
