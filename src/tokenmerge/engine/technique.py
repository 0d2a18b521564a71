"""The protocol every technique of the engine implements, and the one place a technique is chosen for a config.

A technique (ToMe around the attention, whole-block ToMe, ToDo, token reuse, the step cache, the UNet cache) is one
class with these parts; the shared engine (``install.Patch``, ``call.CallHook``, the guards) calls them and knows no
technique by name:

    select(site, config)          the blocks of a denoiser it patches (``levels(config)``: its UNet levels)
    check(site, blocks, config)   at apply time, before anything is installed: refuse (``ValueError``, ``TypeError``)
                                  what cannot be right on these blocks
    leave(site, config)           why a denoiser of a pipeline is left unpatched while the others are (a ControlNet
                                  under the step cache), or ``None``
    __init__(patch) / install()   its hooks on the blocks and their sub-modules; ``install`` returns their handles
    begin(state, info)            each denoiser call's set-up, from the one place a call is decided
                                  (``CallHook.decide``: the call's grid, where it stands, its place in the step:
                                  ``call.CallState``, ``clock.CallInfo``); it sets ``state.work``, the call's own
                                  state (a class of the technique's, with ``close()``)
    end(state)                    after the denoiser's forward, before the call's state is forgotten
    release()                     at removal: its tables and kept tensors
    region()                      the modules that see changed tokens (what the guards watch)
    routed()                      ``{id(module): (block, target)}``: which of its hooks run below a diffusers cache's
    scope() / summary() / notes() what ``describe_patch`` says of it (``computed_share()``: a cache's last generation)

What a technique keeps across the calls of a generation lives in the thread's step clock (``call.Clock``): one object
of the technique's own state class per branch (``Clock.kept``), and one for the whole generation (``Clock.whole``),
each with ``reset()``; a new generation drops them.
"""

from __future__ import annotations

from .discover import select_blocks

__all__ = ["Technique", "technique_for", "register_technique"]


class Technique:
    """The base of every technique: the protocol's defaults (a technique that needs no step clock, decides nothing
    on the host, and keeps nothing).

    Class attributes:
        name: the technique in messages and ``describe_patch`` (``"ToMe"``, ``"step cache"``...).
        clocked: it keeps state across the calls of a generation (the step clock moves at each call).
        timed: it reads each call's timestep on the host (its denoising progress).
        reads_scheduler: under a pipeline it takes the step and its progress from the scheduler's host state
            instead (``clock.host_where``: no tensor read per call).
        gridded: it reads each call's token grid (position ids...); one that does not gets ``()``.
        regional: it stands its modules compiled in place (regional compilation); the others are refused there.
        decides_on_host: its ``begin`` decides on the host: under ``torch.compile`` the call's set-up is its one
            graph break.
        pools: a call whose grid fits no merge window still runs it (ToDo pools the keys of any grid).
        inside: what it does inside PyTorch's SDPA call, which ring attention does not make (``None``: nothing).
    """

    name = ""
    clocked = False
    timed = False
    reads_scheduler = False
    gridded = True
    regional = False
    decides_on_host = False
    pools = False
    inside: str | None = None
    planner = None  # ToMe's and ToDo's merge plans (``planner.Planner``)

    def __init__(self, patch):
        self.patch, self.config, self.blocks = patch, patch.config, patch.blocks
        self.calls = patch.calls
        self.target_handles: dict = {}  # (block, target) -> torch hook handles that caches.route may take over

    @classmethod
    def levels(cls, config) -> int | None:
        """The UNet levels the technique patches blocks in (``config.max_downsample``; ``None``: the finest)."""
        return config.max_downsample

    @classmethod
    def select(cls, site, config) -> list:
        """The blocks of ``site`` the technique patches: those of ``levels`` at the config's positions (``blocks``)."""
        return select_blocks(site, cls.levels(config), config.blocks)

    @classmethod
    def check(cls, site, blocks, config) -> None:
        """Refuse, at apply time, what this technique cannot do on ``blocks`` of ``site`` (nothing by default)."""

    @classmethod
    def leave(cls, site, config) -> str | None:
        """Why ``site`` is left unpatched while the model's other denoisers are patched (``None``: patch it)."""
        return None

    def install(self) -> list:
        """Register the technique's hooks; returns their handles (removed by the patch)."""
        return []

    def begin(self, state, call) -> None:
        """Set up one denoiser call (``call``: its ``CallInfo``); may leave it untouched (``state.work`` ``None``)."""

    def end(self, state) -> None:
        """After the denoiser's forward (its output computed)."""

    def release(self) -> None:
        """Drop what the technique built and kept (its device memory)."""

    @classmethod
    def changes(cls, config) -> bool:
        """Whether ``config`` can change an output at all (ToMe at ratio 0 cannot)."""
        return True

    @classmethod
    def region(cls, config, blocks) -> list:
        """``(path, module)`` of every module that sees changed tokens: the blocks and all inside them by default."""
        if not cls.changes(config):
            return []
        return [(f"{site.path}.{name}" if name else site.path, module)
                for site in blocks for name, module in site.module.named_modules()]

    @classmethod
    def routed(cls, config, blocks) -> dict:
        """``{id(module): (block, target)}`` of the modules whose technique hooks can run below a diffusers cache's
        hook (``caches.route``); none by default."""
        return {}

    @classmethod
    def refuses_cache(cls, config, is_target: bool) -> str | None:
        """Why a diffusers cache hook on a module of ``region()`` cannot see whole tokens (``None``: it can, below
        the technique's own hook: ``is_target``)."""
        return None if is_target else "it sits inside a module whose tokens the patch changes whichever way"

    @classmethod
    def cache_message(cls, path: str, what: str, when: str, why: str) -> str:
        """The refusal of the diffusers cache ``what`` on ``path`` (``when``: "is enabled" or "cannot be added after
        the patch")."""
        return (f"tokenmerge: {what} {when} on {path}, where {cls.name} changes tokens ({why}); disable one of them "
                "(e.g. model.disable_cache())")

    def hook_codes(self) -> list:
        """The code of the hooks it registers (dynamo may keep compiled continuations of them: ``compiled.py``)."""
        names = ("block_pre", "block_post", "target_pre", "target_post", "forward")
        return [getattr(type(self), n).__code__ for n in names if hasattr(type(self), n)]

    def scope(self) -> str:
        """What it does to the denoiser's blocks, in ``describe_patch``'s words: ``12/28 transformer blocks patched
        (12 at downsample 1)``."""
        by_level: dict[int, int] = {}
        for site in self.blocks:
            by_level[site.downsample] = by_level.get(site.downsample, 0) + 1
        levels = ", ".join(f"{n} at downsample {ds}" for ds, n in sorted(by_level.items()))
        return f"{len(self.blocks)}/{len(self.patch.site.blocks)} transformer blocks patched ({levels})"

    def summary(self) -> str:
        """``describe_patch``'s first line: the technique and its settings."""
        return f"tokenmerge {self.name}: {self.config}"

    def notes(self) -> list[str]:
        """``describe_patch``'s notes on what the settings cost or are known not to pay."""
        return []

    def computed_share(self) -> dict | None:
        """What the latest generation computed, ``{"steps": N, "computed": share of the calls}`` (a cache across
        steps), or ``None`` (a technique that computes every step)."""
        return None


_TECHNIQUES: dict = {}  # config class -> (config -> technique class)


def register_technique(config_type: type, choose) -> None:
    """Make ``choose(config)`` (a technique class) the technique of configs of ``config_type``."""
    _TECHNIQUES[config_type] = choose


def technique_for(config) -> type:
    """The technique class of ``config``."""
    for kind in type(config).__mro__:
        choose = _TECHNIQUES.get(kind)
        if choose is not None:
            return choose(config)
    raise TypeError(f"tokenmerge: {type(config).__name__} is not the config of any technique; expected one of "
                    f"{', '.join(sorted(k.__name__ for k in _TECHNIQUES))}")
