"""One denoiser's patch: installed, removed, and nothing else.

``install`` registers, on the denoiser, its ``CallHook`` (the call's grid, where it stands and its decision,
``call.py``), then the technique's hooks (``technique.py``: the protocol; ``techniques/``: each technique), then what
the guards need: the watch on diffusers' hook registries of the modules it changes (``registries.py``), the per-call
checks (``call.Watch``); and it drops what torch.compile compiled for the denoiser (``compiled.py``). An install that
fails removes what it did. ``remove`` undoes all of it and releases what the technique built and kept: the model
computes exactly what it did before. No ``forward`` is copied.
"""

from __future__ import annotations

from ..families.spec import Arg, BlockSite
from ..merge import downsample
from .call import CallHook, Watch
from .compiled import forget_compiled
from .discover import SUPPORTED, DenoiserSite, bind, held_modules
from .grids import GridReader
from .parallel import check_install, shard_of
from .registries import unwatch, watch_registries
from .technique import Technique, technique_for

__all__ = ["Patch", "PATCH_ATTR", "patches_of"]

# The attribute a patched denoiser carries; its presence is what "patched" means.
PATCH_ATTR = "_tokenmerge_patch"
_SAMPLE = Arg("hidden_states", also=("x", "sample"), fallback_index=0)


class Patch:
    """The patch of one denoiser: its config, the selected blocks, the technique and the hook handles.

    Args:
        site: the denoiser and its family.
        config: a technique's config (``ToMeConfig``, ``ToDoConfig``, ``ReuseConfig``, ``StepCacheConfig``).
        blocks: the blocks to patch.
        matcher: ``matcher(metric, shape, windows, r, offsets, radius) -> plan`` replaces ToMe's matching.
        downsampler: ``downsampler(x, shape, factors, mode)`` replaces ToDo's pooling.
        observer: ``begin(phase)`` / ``end(phase)`` around each phase ("block", "similarity", "merge", the target
            kinds, "unmerge"), and ``plan(block_path, plan)`` when a block gets its plan, if it has one; ``None`` in
            normal use (``tokenmerge.observe``).
        code_paths: "cpu" or "cuda": run the matching the way that device does (``merge.match.Matching``).
        pipeline: a weak reference to the pipeline the patch was applied through (a new run of its scheduler
            starts a new generation), or ``None``.
    """

    def __init__(self, site: DenoiserSite, config, blocks: list[BlockSite], matcher=None, downsampler=None,
                 observer=None, code_paths: str | None = None, pipeline=None):
        self.site, self.config, self.blocks = site, config, blocks
        self.matcher, self.downsampler = matcher, downsampler or downsample
        self.observer, self.code_paths = observer, code_paths
        kind = technique_for(config)
        self.calls = CallHook(self, GridReader(site.family.grid, site.module), kind.decides_on_host,
                              kind.end is not Technique.end, bind(_SAMPLE, site.module), pipeline)
        self.technique = kind(self)
        self.watch: Watch | None = None
        self.registries: list = []  # diffusers hook registries watched (caches.py)
        self.parallel: tuple | None = None  # (the model's context-parallel config, its Split): parallel.py
        self.chosen: str | None = None  # what tokenmerge.accelerate chose, and why (describe_patch's first note)
        self.tuned_for = None  # a tuned setting's TunedFor (tuned_for.py): checked at each generation's first call
        self._handles: list = []

    def install(self) -> None:
        denoiser = self.site.module
        try:
            check_install(self)  # context parallelism enabled already: refuse what cannot be right under it
            self._handles.append(denoiser.register_forward_pre_hook(self.calls.pre, with_kwargs=True))
            self._handles.append(denoiser.register_forward_hook(self.calls.post, always_call=True))
            self._handles += self.technique.install()
            setattr(denoiser, PATCH_ATTR, self)
            kind = type(self.technique)
            region = kind.region(self.config, self.blocks)
            watch_registries(self, region, kind.routed(self.config, self.blocks))
            self.watch = Watch(self.technique, self.blocks, region)
        except BaseException:
            self.remove()
            raise
        forget_compiled(denoiser, *self.hook_codes())  # compiled code does not see hooks added after it

    def shard(self, grid: tuple[int, ...], trailing: int, args, kwargs):
        """This rank's slice of a call under context parallelism (``parallel.shard_of``)."""
        return shard_of(self, grid, trailing, args, kwargs)

    @property
    def planner(self):
        """ToMe's and ToDo's merge plans (``planner.Planner``), ``None`` for the other techniques."""
        return self.technique.planner

    def hook_codes(self) -> list:
        """The code of every hook the patch registers (dynamo may keep compiled continuations of them)."""
        return [CallHook.pre.__code__, CallHook.post.__code__, *self.technique.hook_codes()]

    def remove(self) -> None:
        unwatch(self)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.calls.state.reset()
        self.calls.state.clock.clear()
        if getattr(self.site.module, PATCH_ATTR, None) is self:
            delattr(self.site.module, PATCH_ATTR)
        self.technique.release()
        forget_compiled(self.site.module, *self.hook_codes())


def patches_of(model) -> list:
    """The patches installed on the denoisers ``model`` holds (a pipeline, a bare model, an LDM-style model)."""
    held = held_modules(model)
    if not held:
        raise TypeError(f"tokenmerge: a {type(model).__name__} holds no model; expected {SUPPORTED}")
    modules = (m for c in held.values() for m in c.modules())
    seen, found = set(), []
    for module in modules:
        patch = getattr(module, PATCH_ATTR, None)
        if isinstance(patch, Patch) and id(patch) not in seen:
            seen.add(id(patch))
            found.append(patch)
    return found
