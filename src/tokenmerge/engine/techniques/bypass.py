"""What the caches across steps share (the step cache, the UNet cache): each wraps the ``forward`` of the modules it
may not run (``Bypass``, an instance attribute as diffusers' hook registry sets one; the model's code is not copied),
decides on the host at each call whether the call is computed, and keeps its state per slot in the step clock."""

from __future__ import annotations

import inspect
import warnings

from ..technique import Technique

__all__ = ["Bypass", "Bypassing"]


class Bypass:
    """A module's ``forward`` while a cache is installed (an instance attribute, as diffusers' hook registry sets
    one): the cache's ``forward`` with the module's own (``previous``: the forward it replaced, ``None`` for the
    class's); ``detach()`` makes it the module's own forward."""

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


class Bypassing(Technique):
    """A cache whose modules' forwards are ``Bypass``es: ``self.bypassed`` (set by the subclass) lists the modules,
    in the order of the ``index`` each ``Bypass`` passes to the subclass's ``forward(bypass, args, kwargs)``."""

    clocked = timed = host = True  # computed or not: decided on the host at each call

    def __init__(self, patch):
        super().__init__(patch)
        self.bypassed: list = []
        self.bypasses: list[Bypass] = []
        self.warned = False

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

    def kept(self, state, info, make):
        """The call's slot's kept state in the step clock (``make()`` where the slot has none yet), or ``None`` for
        a call without a timestep (one warning: such calls compute everything)."""
        if info.progress is None:
            self._warn_once(f"a call got no timestep, which the {self.name} needs to tell the steps apart; such calls "
                            "are computed whole", depth=6)
            return None
        kept = state.clock.kept.get(state.slot)
        if kept is None:
            kept = state.clock.kept[state.slot] = make()
        return kept

    def _warn_once(self, reason: str, depth: int = 5) -> None:
        if self.warned:
            return
        self.warned = True
        name = self.patch.site.path or type(self.patch.site.module).__name__
        warnings.warn(f"tokenmerge: {name}: {reason}. The generation goes on", RuntimeWarning, stacklevel=depth)
