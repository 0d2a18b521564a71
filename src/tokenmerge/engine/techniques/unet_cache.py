"""The UNet cache (``tokenmerge.apply_unet_cache``): DeepCache's idea on the engine. Some steps are computed; the
others run only the UNet's shallow path (``conv_in``, the first ``depth`` down and last ``depth`` up blocks, or a cut
inside them, ``conv_out``) and take the deep path's output from the last computed step, moved along its slope. The
cut, the placeholders and ControlNets: docs/design.md ("The caches across steps, inside")"""

from __future__ import annotations

import dataclasses
import numbers

import torch

from ...families.spec import Arg
from ..discover import bind
from .across import Across, BranchState, Bypass, moved
from .presets import SCHEDULES
from .schedule import Scheduled

__all__ = ["UNetCacheConfig", "UNetCache", "UNetBranch"]

# what the UNet adds in place to a deep block's output (T2I-Adapter's residuals: ``sample += ...``)
_IN_PLACE = (Arg("down_intrablock_additional_residuals"),)


@dataclasses.dataclass(frozen=True)
class UNetCacheConfig(Scheduled):
    """Settings of ``apply_unet_cache``, validated when made: the schedule's fields (``Scheduled``'s, documented there)
    and where the cut falls.

    Fields:
        depth: the down and up blocks a cached step runs at each end of the UNet (1: the finest level only, the
            cheapest cached step; larger: more faithful, slower).
        layers: ``None`` (default): whole blocks; an integer: the layers of ``down_blocks[depth - 1]`` a cached step
            runs (0: none: at depth 1 only ``conv_in``, the last up block's last layer and ``conv_out``), for a
            cheaper cached step where a level has several layers (SD 1.x/2.x and SDXL: 2).

    Example:
        >>> "".join("1" if c else "0" for c in UNetCacheConfig(warmup=1, skip=2).schedule(10))  # DeepCache's N=3
        '1001001001'
    """

    DEFAULT = SCHEDULES["unet"]["balanced"]
    KEPT = "feature"

    depth: int = 1
    layers: int | None = None

    def __post_init__(self):
        super().__post_init__()
        d = self.depth
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1:
            raise ValueError(f"depth must be an integer >= 1 (the down and up blocks a cached step runs at each end "
                             f"of the UNet); got {d!r}")
        object.__setattr__(self, "depth", int(d))
        m = self.layers
        if m is not None and (isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0):
            raise ValueError(f"layers must be None (every layer of the cut's down block) or an integer >= 0 (its "
                             f"first layers a cached step runs); got {m!r}")
        object.__setattr__(self, "layers", None if m is None else int(m))


@dataclasses.dataclass(slots=True)
class UNetBranch(BranchState):
    """One branch's kept state (``across.BranchState``): the feature F (the deepest cached module's output) and its
    slope S, updated in place at each computed step, the deep modules' output outlines, their placeholders once
    made."""

    feature: torch.Tensor | None = None
    slope: torch.Tensor | None = None
    outlines: dict = dataclasses.field(default_factory=dict)
    blanks: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class UNetCall:
    """One call in flight: cached (``outs``: what each deep module returns) or computed (``seen``: each deep module's
    output, the feature's copy at the last index)."""

    kept: UNetBranch
    cached: bool
    progress: float
    outs: dict = dataclasses.field(default_factory=dict)
    seen: dict = dataclasses.field(default_factory=dict)
    feature: torch.Tensor | None = None  # computed: a copy of the feature (the feature module's first tensor)

    def close(self) -> None:
        self.outs = {}
        self.seen = {}
        self.feature = None


def _outline(value):
    """What a placeholder of ``value`` needs: ``(shape, dtype, device)`` per tensor, the structure of a tuple;
    ``False`` for what cannot be told."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype, value.device
    if isinstance(value, (tuple, list)):
        parts = tuple(_outline(v) for v in value)
        return False if any(p is False for p in parts) else (type(value), parts)
    return None if value is None else False


def _blank(outline, writable: bool):
    """A placeholder of ``outline``: a zero-stride view of one zero (``writable``: a tensor of zeros)."""
    if outline is None:
        return None
    if isinstance(outline[0], type):
        return outline[0](_blank(o, writable) for o in outline[1])
    shape, dtype, device = outline
    if writable:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _layers(down, layers: int | None) -> int:
    """The layers of the cut's down block that a cached step runs."""
    return len(down.resnets) if layers is None else layers


def _layer(block, i: int) -> list:
    """Layer ``i`` of a block: its resnet and, where it has them, its attention."""
    attentions = getattr(block, "attentions", None)
    return [("resnets", block.resnets[i])] + ([("attentions", attentions[i])] if attentions is not None else [])


_PLAIN = {"resnets", "attentions", "downsamplers", "upsamplers"}  # what a block cut inside may hold as lists


def _holding(outline, feature: torch.Tensor, writable: bool):
    """The feature module's output at a cached step: ``feature`` where it returned a tensor, first in the tuple it
    returned (an attention's ``(output,)``) otherwise."""
    if not isinstance(outline[0], type):
        return feature
    return outline[0]((feature, *(_blank(o, writable) for o in outline[1][1:])))


def _skip_connections(block) -> int:
    """The skip connections a diffusers down block returns: one per resnet, one for its downsampler."""
    return len(block.resnets) + (getattr(block, "downsamplers", None) is not None)


class UNetCache(Across):
    """The UNet cache on a diffusers UNet's deep path.

    Args:
        patch: the installed patch (config, site, its ``CallHook``).
    """

    name = "UNet cache"
    Branch = UNetBranch
    controlnet = ("controlnet_down_blocks",  # diffusers' ControlNets: an output read at every level
                  "a ControlNet's outputs are read at every level (its residuals), so it runs every step; at a cached "
                  "step the UNet adds this step's residuals to the shallow skip connections it reads, and the deep "
                  "ones' effect is the last computed step's, carried in the cached feature")
    keeps = "the UNet cache does not run the deep path at cached steps, and keeps its own feature"
    clash_message = ("tokenmerge: {what} {when} on {path}, under the UNet cache ({why}): two caches across steps on "
                     "one denoiser would each reuse the other's stale outputs; use one of them")

    def __init__(self, patch):
        super().__init__(patch)
        self.deep, self.paths = self.deep_path(patch.site.module, patch.config.depth, patch.config.layers)
        self.bypassed = self.deep
        unet = patch.site.module
        cut = unet.down_blocks[patch.config.depth - 1]
        # a cut inside the blocks: FreeU's in-place scaling of the cached layers' inputs in the up block that mirrors
        # it needs writable placeholders
        partial = _layers(cut, patch.config.layers) < len(cut.resnets)
        self.mirror = unet.up_blocks[len(unet.down_blocks) - patch.config.depth] if partial else None
        self.in_place = [b for b in (bind(a, unet) for a in _IN_PLACE) if b is not None]

    @staticmethod
    def deep_path(unet, depth: int, layers: int | None) -> tuple[list, list[str]]:
        """The modules a cached step does not run, in call order, the deepest cached one (the feature's) last: the
        layers of ``down_blocks[depth - 1]`` from ``layers`` on and its downsampler, the deeper down blocks, the mid
        block, the up blocks before ``up_blocks[-depth]``, and the layers of that one that read the skips of those
        down layers."""
        n = len(unet.down_blocks)
        down, up = unet.down_blocks[depth - 1], unet.up_blocks[n - depth]
        base = f"down_blocks.{depth - 1}"
        deep = [(m, f"{base}.{part}.{i}") for i in range(_layers(down, layers), len(down.resnets))
                for part, m in _layer(down, i)]
        deep += [(m, f"{base}.downsamplers.{i}") for i, m in enumerate(getattr(down, "downsamplers", None) or ())]
        deep += [(unet.down_blocks[i], f"down_blocks.{i}") for i in range(depth, n)]
        deep += [(unet.mid_block, "mid_block")] if getattr(unet, "mid_block", None) is not None else []
        deep += [(unet.up_blocks[i], f"up_blocks.{i}") for i in range(n - depth)]
        deep += [(m, f"up_blocks.{n - depth}.{part}.{i}") for i in range(len(down.resnets) - _layers(down, layers))
                 for part, m in _layer(up, i)]
        return [m for m, _ in deep], [p for _, p in deep]

    # ---- the protocol's static parts ------------------------------------------------------------------------
    @classmethod
    def check(cls, site, blocks, config) -> None:
        unet, name = site.module, f"{site.path or type(site.module).__name__} ({site.family.name})"
        if site.family.kind != "unet":
            raise ValueError(f"tokenmerge: the UNet cache reuses a UNet's deep path, and {name} is a transformer "
                             "(one stack of blocks): use tokenmerge.apply_step_cache on it")
        if site.family.name == "ldm-unet":
            raise ValueError(f"tokenmerge: the UNet cache cannot patch {name}: an LDM-style UNetModel's forward "
                             "(CompVis ldm, sgm, cldm, the webuis' forks) decides which skip connection each output "
                             "block reads and adds ControlNet residuals in place, and differs between forks; the UNet "
                             "cache follows diffusers' UNet2DConditionModel (load the model with diffusers, or use "
                             "apply_patch)")
        down, up = getattr(unet, "down_blocks", None), getattr(unet, "up_blocks", None)
        if site.family.name == "controlnet-xs" or up is None or len(up) != len(down) or \
                not all(hasattr(b, "resnets") for b in (*down, *up)):
            raise ValueError(f"tokenmerge: the UNet cache cannot patch {name}: it follows UNets whose down and up "
                             "blocks pair level by level with skip connections (UNet2DConditionModel and its video "
                             "kin); this one's blocks do not (ControlNet-XS runs a control UNet beside the base one)")
        n, depth, layers = len(down), config.depth, config.layers
        if depth > n or (depth == n and layers is None and getattr(unet, "mid_block", None) is None):
            raise ValueError(f"tokenmerge: depth={depth} leaves no deep path to cache in {name}: it has {n} levels "
                             f"(down blocks){'' if depth > n else ' and no mid block'}; use depth < {n}")
        reads = sum(len(b.resnets) for b in up[n - depth:])
        gives = 1 + sum(_skip_connections(b) for b in down[:depth]) - (
            getattr(down[depth - 1], "downsamplers", None) is not None)
        if reads != gives:
            raise ValueError(f"tokenmerge: the UNet cache cannot cut {name} at depth={depth}: its last {depth} up "
                             f"block(s) read {reads} skip connections, where conv_in and the first {depth} down "
                             f"block(s) give {gives}; the shallow path would read the deep path's")
        cut, mirror = down[depth - 1], up[n - depth]
        if layers is not None and layers > len(cut.resnets):
            raise ValueError(f"tokenmerge: layers={layers}, where down_blocks.{depth - 1} of {name} has "
                             f"{len(cut.resnets)} layers")
        if layers is not None and layers < len(cut.resnets):
            odd = [f"{i} ({type(b).__name__}) holds {', '.join(sorted(lists - _PLAIN))}" for i, b in
                   ((f"down_blocks.{depth - 1}", cut), (f"up_blocks.{n - depth}", mirror))
                   for lists in [{k for k, v in b.named_children() if isinstance(v, torch.nn.ModuleList)}]
                   if lists - _PLAIN or len(getattr(b, "attentions", None) or b.resnets) != len(b.resnets)]
            if odd or len(mirror.resnets) != len(cut.resnets) + 1:
                raise ValueError(f"tokenmerge: layers={layers} cuts inside down_blocks.{depth - 1} and up_blocks."
                                 f"{n - depth} of {name}, which needs layers of a resnet and an attention each, the up "
                                 "block reading the down block's layers and one more skip; "
                                 + ("; ".join(odd) if odd else f"the up block has {len(mirror.resnets)} layers")
                                 + ": use layers=None (whole blocks)")
        cls.needs_timestep(site, name)

    # ---- the denoiser's call (on the host) ----------------------------------------------------------------------
    def call(self, kept: UNetBranch, computed: bool, info) -> UNetCall:
        """The call's state: computed, or cached with each deep module's output."""
        work = UNetCall(kept, not computed, info.where.progress)
        if computed:
            return work
        last = len(self.deep) - 1
        writable = any(b.read(info.args, info.kwargs) is not None for b in self.in_place) or (
            self.mirror is not None and all(getattr(self.mirror, k, None) for k in ("s1", "s2", "b1", "b2")))
        weight = self.weight(kept, info.where.progress) if kept.slope is not None else None
        # a new tensor either way: a later block may scale its input in place
        feature = kept.feature.clone() if weight is None else torch.addcmul(kept.feature, kept.slope, weight)
        work.outs[last] = _holding(kept.outlines[last], feature, writable)
        for index in range(last):
            if writable:  # added to in place (T2I-Adapter, FreeU inside a block cut): fresh zeros
                work.outs[index] = _blank(kept.outlines[index], True)
                continue
            blank = kept.blanks.get(index)
            if blank is None:  # made once per branch: views of one zero
                blank = kept.blanks[index] = _blank(kept.outlines[index], False)
            work.outs[index] = blank
        return work

    # ---- a deep module ------------------------------------------------------------------------------------------
    def forward(self, bypass: Bypass, args: tuple, kwargs: dict):
        """The module's call: its placeholder (or the kept feature) at a cached step, its own forward otherwise."""
        work = self.calls.state.work
        if work is None:
            return bypass.inner(*args, **kwargs)
        if work.cached:
            return work.outs[bypass.index]
        out = bypass.inner(*args, **kwargs)
        index = bypass.index
        work.seen[index] = out
        if index == len(self.deep) - 1:
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor):  # kept apart: the next up layer's FreeU scales its input in place
                work.feature = first.clone()
        return out

    # ---- after the denoiser's call (on the host) ----------------------------------------------------------------
    def end(self, state) -> None:
        """A computed call that ran every deep module once: its feature kept, in place (made at the branch's first
        computed call, or where its shape changed), its slope measured against the feature kept before it over the
        progress between them (``kept.span``: ``Across.begin``), the deep outputs' outlines kept for the
        placeholders."""
        work = state.work
        if work.cached:
            return
        seen, last = work.seen, len(self.deep) - 1
        if len(seen) != len(self.deep):
            missing = [self.paths[i] for i in range(len(self.deep)) if i not in seen]
            return self.refuse(f"{', '.join(missing)} did not run in a call of the UNet")
        outlines = {i: _outline(seen[i]) for i in range(len(self.deep))}
        odd = [self.paths[i] for i, o in outlines.items() if o is False]
        if odd or work.feature is None:
            return self.refuse(f"{(odd or [self.paths[last]])[0]} returns what the UNet cache cannot stand in for "
                                "(tensors, or tuples of them, expected)")
        kept, feature = work.kept, work.feature
        if kept.outlines != outlines:
            kept.blanks.clear()
            kept.outlines = outlines
        old = kept.feature
        if old is not None and old.shape == feature.shape and old.dtype == feature.dtype:
            return moved(old, feature, kept.slope, kept.span)
        kept.feature, kept.slope = feature, torch.zeros_like(feature) if self.config.extrapolate else None
        kept.made(feature, work.progress)

    # ---- describe_patch -------------------------------------------------------------------------------------------
    def scope(self) -> str:
        return f"a cached step runs none of its {len(self.deep)} deep modules ({self.paths[0]} to {self.paths[-1]})"

    def summary(self) -> str:
        c = self.config
        return (f"tokenmerge UNet cache: depth={c.depth} layers={c.layers} {c.words()}; a cached step runs only the "
                f"path shallower than {self.paths[-1]}, whose output it takes from the last computed step")

    def notes(self) -> list[str]:
        note = (f"the UNet cache keeps, per call of a step (guidance run as two calls keeps two), the output of "
                f"{self.paths[-1]} (batch x channels x height x width at its level)")
        return [note + (", and its slope beside it: two such tensors" if self.config.extrapolate else ""),
                self.report()]
