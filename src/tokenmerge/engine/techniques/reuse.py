"""Token reuse (``tokenmerge.apply_reuse``): one technique, in one file, with its hooks.

A partial step of one block reads merge -> work -> unmerge as:

    block pre-hook        keep x, the block's image input                                     # (B, N, C)
    attention targets     every token goes in (fresh keys and values of all N tokens); inside the
                          attention call (SDPA) only the query rows of the recomputed tokens S
                          are kept, so the attention and its output projection run on S      # (B, |S|, C) out
                          -> scattered back to N rows (zeros elsewhere)
    per-token targets     cross-attention, feed-forward, the block's pointwise layers: the
                          rows of S in, scattered back out                                    # (B, |S|, C)
    block post-hook       y = x + R, where R[S] = (out - x)[S] and R is this block's cache    # (B, N, C)

A full step (the first ``warmup`` steps, every ``every``-th after) runs the block untouched and stores
``R = out - x``. So the recomputed tokens see every token in attention, and the others carry their own last
computed block residual: one stored tensor of the block's image output size per block (and per branch of a step:
guidance run as two calls keeps two). Everything the technique knows about a family comes from its records: the
blocks' targets and their kinds (``SELF``/``JOINT`` attention, ``CROSS``/``MLP`` per-token), where text sits beside
the image (``sides``), where a block returns its image stream (``Whole.output``) and its per-token layers outside
the targets (``Blocks.pointwise``).

Steps are told apart on the host from the timestep (one read per denoiser call, as ToMe's schedules do): the same
timestep as the last call's is another branch of the same step, an earlier (noisier) one a new generation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...families.spec import JOINT, MLP, SELF, TEXT_BEFORE, TEXT_NONE, TEXT_STREAM, Arg, BlockSite
from ...merge.plan import TABLES, Tables, sided_rows
from ..caches import REGISTRY_ATTR, bad_hook, cache_message, unwatch, watch_registries
from ..call import host_timestep, image_part, join, sides, take_mask, take_rotary
from ..compiled import compiled_in_place, forget_compiled, regional_message
from ..discover import DenoiserSite, resolve
from ..grids import GridReader, NoGrid
from ..parallel import PARALLEL_ATTR
from ..planner import coarsen
from .around import ChainHook
from .todo import other_function, sdpa_arguments

__all__ = ["ReusePatch", "QueryRows", "BLOCK", "select", "COMPILE_REFUSED"]

BLOCK = -1  # the "target" index of a block's own hooks (what caches.route calls them by)
_HIDDEN = Arg("hidden_states", also=("x",), fallback_index=0)
_SDPA = F.scaled_dot_product_attention
PARALLEL_REFUSED = ("token reuse does not run under diffusers' context parallelism yet (each rank would hold a "
                    "slice of the tokens whose cached residuals and recomputed rows the all-to-all attention does "
                    "not follow): use apply_patch or apply_todo there, or run the model on one GPU")
COMPILE_REFUSED = ("tokenmerge: token reuse (apply_reuse) decides at each denoiser call, on the host, whether the step "
                   "is full or partial and which tokens it recomputes (from the timestep): compile the denoiser "
                   "without fullgraph=True (this decision is its one graph break, at the call's start), or run it "
                   "eagerly")


def _on_host(fn):
    """``fn`` run eagerly under torch.compile: a graph break with ``COMPILE_REFUSED`` as its reason."""
    try:
        return torch.compiler.disable(fn, reason=COMPILE_REFUSED)
    except TypeError:  # a torch without the reason argument
        return torch.compiler.disable(fn)


class QueryRows(TorchFunctionMode):
    """While active, every SDPA call keeps only the query rows of the recomputed image tokens (and every text or
    reference row); keys and values pass whole. A mask with a row per query keeps the same rows.

    Args:
        image: image tokens in the sequence; index: ``(|S|,)`` the recomputed ones, sorted;
        keys: where text sits in the attention call's sequence (``Target.keys``); trailing: reference tokens.
    """

    def __init__(self, image: int, index: torch.Tensor, keys: str, trailing: int, tables: Tables = TABLES):
        self.image, self.index, self.keys, self.trailing, self.tables = image, index, keys, trailing, tables
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not _SDPA:
            return other_function(func, args, dict(kwargs or {}))
        kwargs = sdpa_arguments(args, kwargs)
        query = kwargs["query"]  # (B, H, L, D)
        rows = self._rows(query.shape[-2], query.device)
        if rows is None:  # not a call over the image's queries (e.g. a second attention over other tokens)
            return func(**kwargs)
        self.calls += 1
        kwargs["query"] = query.index_select(-2, rows)
        mask = kwargs.get("attn_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() >= 2 and mask.shape[-2] == query.shape[-2] > 1:
            kwargs["attn_mask"] = mask.index_select(-2, rows)
        return func(**kwargs)

    def _rows(self, length: int, device) -> torch.Tensor | None:
        if length < self.image:
            return None
        before, after = sides(length, self.image, self.keys or TEXT_NONE, self.trailing)
        return sided_rows(self.index, before, self.image, after, self.tables)


class CachedKeys(TorchFunctionMode):
    """``keys="cached"``: while active, the SDPA call over the image's keys keeps (at a full step, ``index`` None)
    a copy of its keys and values in ``slot``, or (at a partial step: the block runs on the ``index`` tokens alone)
    writes their fresh rows (and the text's, whole) into the kept ones, in place, and attends to all of them.

    Args: as ``QueryRows``; slot: a list holding this attention's kept ``[keys, values]`` (B, H, L, D), every row
    of the call's sequence (text, image and reference rows); text: ``reuse text``: the recomputed text tokens
    (sorted indices; ``None``: every text row is fresh).
    """

    def __init__(self, image: int, index: torch.Tensor | None, keys: str, trailing: int, slot: list,
                 tables: Tables = TABLES, text: torch.Tensor | None = None):
        self.image, self.index, self.keys, self.trailing, self.slot = image, index, keys, trailing, slot
        self.tables, self.text = tables, text
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not _SDPA:
            return other_function(func, args, dict(kwargs or {}))
        kwargs = sdpa_arguments(args, kwargs)
        key, value = kwargs["key"], kwargs["value"]
        count = self.image if self.index is None else self.index.shape[0]
        before, after = _sides_or_none(key.shape[-2], count, self.keys or TEXT_NONE, self.trailing)
        if before is None or self.calls:  # not the call over the image's keys (or a second one): untouched
            return func(**kwargs)
        self.calls += 1
        if self.index is None:
            self.slot[:] = [key.contiguous().clone(), value.contiguous().clone()]
            return func(**kwargs)
        total = before + self.image + after
        mask = kwargs.get("attn_mask")  # a mask made by the model over every token: its key columns fit the spliced
        if isinstance(mask, torch.Tensor) and mask.dim() >= 2 and mask.shape[-1] > 1:  # keys, its rows the queries
            if mask.shape[-1] != total:
                raise ValueError("tokenmerge: token reuse with keys='cached' got an attention mask over the keys of "
                                 "the recomputed tokens only, which it cannot extend; use keys='fresh'")
            if mask.shape[-2] == total:
                rows = sided_rows(self.index, before, self.image, after, self.tables)
                kwargs["attn_mask"] = mask.index_select(-2, rows)
        kwargs["key"], kwargs["value"] = (_splice(kept, fresh, before, self.image, after, self.index, self.text)
                                          for kept, fresh in zip(self.slot, (key, value)))
        return func(**kwargs)


def _splice(kept: torch.Tensor, fresh: torch.Tensor, before: int, image: int, after: int,
            index: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
    """The kept keys (or values) ``kept`` (..., L, D) with ``fresh``'s rows written in: its image rows at ``index``,
    its text rows (``before`` them) whole or at ``text``, its reference rows (``after``) whole. In place where the
    kept sequence has this call's layout (else a new one, with every text row fresh: the text's length changed)."""
    axis = fresh.dim() - 2
    count = index.shape[0]
    kept_before = before if text is None else kept.shape[axis] - image - after
    if kept.shape[axis] != kept_before + image + after or kept.shape[:axis] != fresh.shape[:axis] or (
            text is not None and text.shape[0] != before):
        image_rows = kept.narrow(axis, kept.shape[axis] - image - after, image).index_copy(
            axis, index, fresh.narrow(axis, before, count))
        return join(fresh, image_rows, before, after, dim=axis)
    if text is not None:
        kept.narrow(axis, 0, kept_before).index_copy_(axis, text, fresh.narrow(axis, 0, before))
        before = kept_before
    elif before:
        kept.narrow(axis, 0, before).copy_(fresh.narrow(axis, 0, before))
    fresh_before = fresh.shape[axis] - count - after
    if after:
        kept.narrow(axis, before + image, after).copy_(fresh.narrow(axis, fresh_before + count, after))
    kept.narrow(axis, before, image).index_copy_(axis, index, fresh.narrow(axis, fresh_before, count))
    return kept


class _Call:
    """One block's call in flight: its image input, whether it is partial, its level's image token count and
    recomputed tokens, and the query modes of its attention targets."""

    __slots__ = ("x", "partial", "ran", "image", "index", "grid", "modes", "rows", "text", "text_index", "picked")

    def __init__(self, x: torch.Tensor, partial: bool, image: int, index: torch.Tensor | None, grid: tuple):
        self.x, self.partial, self.ran, self.image, self.index, self.grid = x, partial, False, image, index, grid
        self.text: torch.Tensor | None = None  # reuse text: the block's text-stream input (B, T, C)
        self.text_index: torch.Tensor | None = None  # reuse text, a partial step: the recomputed text tokens
        self.picked: torch.Tensor | None = None  # keys="cached", a partial step: x at the recomputed tokens
        self.modes: dict[int, QueryRows] = {}
        self.rows: dict[int, tuple[int, int]] = {}  # target -> (text before, after) of its gathered input

    def close(self) -> None:
        while self.modes:
            self.modes.popitem()[1].__exit__(None, None, None)


class _State:
    """A thread's run state: the step bookkeeping and the caches (which outlive calls), and the call in flight."""

    def __init__(self) -> None:
        self.last: float | None = None  # the last call's denoising progress
        self.step, self.branch = 0, 0
        self.caches: dict[tuple[int, int], torch.Tensor] = {}  # (branch, block) -> (B, N, C) block residual
        self.text_caches: dict[tuple[int, int], torch.Tensor] = {}  # reuse text: (branch, block) -> (B, T, C)
        self.kv: dict[tuple[int, int, int], list] = {}  # keys="cached": (branch, block, target) -> [keys, values]
        self.first: float | None = None  # the progress of the generation's first partial step
        self.offsets: dict[int, int] = {}  # level -> tokens of its order walked so far (round-robin)
        self.counted = -1  # the step whose recomputed tokens the offsets last advanced past
        self.read = None  # the generation's (grid, device, trailing), read at its first call
        self.reset()

    def reset(self) -> None:
        for call in getattr(self, "blocks", {}).values():
            call.close()
        self.active = False
        self.trailing, self.partial = 0, False
        self.levels: dict[int, tuple[int, torch.Tensor | None, tuple]] = {}  # level -> (tokens, recomputed, grid)
        self.blocks: dict[int, _Call] = {}
        self.advance = False  # this call starts a step (its recomputed tokens move on)
        self.fraction = 1.0  # the share of tokens this call recomputes
        self.text_rows: dict[int, torch.Tensor] = {}  # reuse text: text tokens -> the recomputed ones, this call
        self.taken: list = []  # keys="cached": (rotary value, its rows at the recomputed tokens) of this call
        self.weights: dict = {}  # spread: (grid, dtype, device) -> each token's share of its neighbours' change

    def forget(self) -> None:
        """A new generation: nothing to reuse."""
        self.caches.clear()
        self.text_caches.clear()
        self.kv.clear()
        self.offsets.clear()
        self.step = self.branch = 0
        self.first, self.counted = None, -1


class _Hook:
    """``patch.<method>(block, target, module, *hook_args)``: an object, so that deepcopy and pickle follow it."""

    __slots__ = ("patch", "method", "block", "target")

    def __init__(self, patch, method: str, block: int = BLOCK, target: int = BLOCK):
        self.patch, self.method, self.block, self.target = patch, method, block, target

    def __call__(self, module, *hook_args):
        return getattr(self.patch, self.method)(self.block, self.target, module, *hook_args)


class _Site:
    """A hooked sub-module of a block: its spec (a ``Target``), its input argument, whether it is attention, and
    whether it is optional (an attention's query projection: a call whose rows are not laid out as the attention's
    input passes untouched)."""

    __slots__ = ("spec", "arg", "attention", "optional")

    def __init__(self, spec, arg, attention: bool, optional: bool = False):
        self.spec, self.arg, self.attention, self.optional = spec, arg, attention, optional


class ReusePatch:
    """The installed token reuse of one denoiser (see the module docstring).

    Args:
        site: the denoiser and its family. config: a ``ReuseConfig``. blocks: the blocks to patch.
    """

    def __init__(self, site: DenoiserSite, config, blocks: list[BlockSite]):
        self.site, self.config, self.blocks = site, config, blocks
        self.family = site.family
        self._local = threading.local()
        self._current = _State()  # the state of the call in flight, for the block hooks' compiled code
        self._handles: list = []
        self.target_handles: dict = {}  # (block, BLOCK) -> the block's torch hooks' handles (caches.route)
        self.technique = self  # what caches.route asks for the hooks it moves into a diffusers hook chain
        self.registries: list = []  # diffusers hook registries watched (caches.py)
        self.tables = Tables()  # the recomputed tokens' indices and row tables, released at removal
        self._targets: list[list[_Site]] = []
        self._inputs: list = []
        self._outputs: list = []  # per block: where its output holds the image stream (Whole.output)
        self._grid_reader = GridReader(site.family.grid, site.module)
        self._levels = sorted({b.level for b in blocks})
        self.cached = config.keys == "cached"
        self._wholes: list = []  # keys="cached": per block, its bound (rotary, mask, per-token, refuse_if) arguments
        self._texts: list = []  # reuse text: per block, its bound text-stream argument (None: text whole)
        self._text_arg = None  # reuse text: the denoiser's argument named as the blocks' text stream
        self._refusals: list = []  # per block, its (bound argument, reason) pairs that refuse a call
        self._warned = False  # a call ran untouched, and the user was told (once per patch)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    @property
    def state(self) -> _State:
        """This thread's state; in compiled code, the state of the call in flight (which the denoiser's hooks,
        run on the host, keep in ``_current``)."""
        if torch.compiler.is_compiling():
            return self._current
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _State()
        return state

    # ---- installation -------------------------------------------------------------------------------------
    @staticmethod
    def check(site: DenoiserSite, blocks: list[BlockSite]) -> None:
        """Refuse, with the reason, a denoiser whose blocks this technique cannot follow."""
        name = f"{site.path or type(site.module).__name__} ({site.family.name})"
        if site.timestep is None:
            raise TypeError(f"tokenmerge: {name} takes no timestep argument, which token reuse needs to tell the "
                            "denoising steps apart")
        for block in blocks:
            if block.whole is None:
                raise ValueError(f"tokenmerge: token reuse needs to know where {block.path} returns its image tokens "
                                 f"(its family {site.family.name} declares no whole-block layout), so it cannot "
                                 "patch this model")
            if block.seq_first:
                raise ValueError(f"tokenmerge: token reuse does not support the sequence-first blocks of {name}")
            if not any(t.kind in (SELF, JOINT) for t in block.targets):
                raise ValueError(f"tokenmerge: {block.path} declares no attention over its image tokens, which token "
                                 "reuse needs")
            for spec in block.targets:
                if spec.refuse is not None:  # a sub-module that mixes tokens (a convolution over the grid, MoE routing)
                    raise ValueError(f"tokenmerge: token reuse cannot patch {block.path}: its {spec.attr} mixes tokens "
                                     f"outside attention ({spec.refuse})")
                if spec.reuse is not None:
                    raise ValueError(f"tokenmerge: token reuse cannot patch {block.path}: {spec.reuse}")

    def check_text(self) -> None:
        """``text=True``: refuse blocks none of which has a separate text stream whose rows lead its rotary table."""
        if not self.config.text:
            return
        streams = [b for b in self.blocks if b.whole is not None and b.whole.text is not None
                   and Arg(b.whole.text).bind(b.module) is not None]
        if not streams:
            raise ValueError(f"tokenmerge: token reuse's text=True recomputes part of a separate text stream, and the "
                             f"blocks of {self.family.name} have none that it knows of (Flux.1 and its kin do); leave "
                             "text=False")
        for b in streams:
            rotary = b.whole.rotary
            if rotary is not None and (rotary.layout != "tensor" or rotary.text != TEXT_BEFORE):
                raise ValueError(f"tokenmerge: token reuse's text=True cannot follow the rotary table of {b.path} "
                                 "(its text rows do not lead one tensor); leave text=False")

    def check_hooks(self) -> None:
        """Refuse what would be wrong before anything is installed: a block compiled in place, a diffusers hook that
        returns kept outputs on a module inside a block (it would see only the recomputed tokens)."""
        inside = [(f"{b.path}.{n}", m) for b in self.blocks for n, m in b.module.named_modules() if n]
        regional = compiled_in_place([(b.path, b.module) for b in self.blocks] + inside)
        if regional is not None:
            raise ValueError(regional_message(regional, later=False))
        for path, module in inside:
            registry = module.__dict__.get(REGISTRY_ATTR)
            what = bad_hook(registry) if registry is not None else None
            if what is not None:
                raise ValueError(cache_message(path, what, self.config, later=False, why=""))

    def chain_hook(self, index: int, t: int) -> ChainHook:
        """The block's hooks as a diffusers hook, run below a cache's hook on the block (``caches.route``)."""
        return ChainHook(self, index, t)

    def target_pre(self, index: int, t: int, module, args, kwargs):
        return self._merge_input(index, t, module, args, kwargs)

    def target_post(self, index: int, t: int, module, args, output):
        return self._unmerge_output(index, t, module, args, output)

    def _watch(self) -> None:
        """Watch diffusers' hook registries: a cache on a block (First Block Cache, MagCache) runs outside the
        reuse (its hooks are lifted above the block's, in either order of enabling); one on a module inside a
        block is refused at its registration."""
        region = [(f"{b.path}.{n}" if n else b.path, m) for b in self.blocks for n, m in b.module.named_modules()]
        watch_registries(self, region, {id(b.module): (i, BLOCK) for i, b in enumerate(self.blocks)})

    def install(self) -> None:
        if getattr(self.site.module, PARALLEL_ATTR, None) is not None:  # enabled before the patch: refused here
            raise ValueError(f"tokenmerge: {PARALLEL_REFUSED} (parallelism is enabled on "
                             f"{type(self.site.module).__name__})")
        try:
            denoiser = self.site.module
            self._handles.append(denoiser.register_forward_pre_hook(_Hook(self, "_denoiser_pre"), with_kwargs=True))
            self._handles.append(denoiser.register_forward_hook(_Hook(self, "_denoiser_post"), always_call=True))
            for index, block in enumerate(self.blocks):
                self._install_block(index, block)
            names = {b.whole.text for b in self.blocks if self.config.text and b.whole is not None and b.whole.text}
            self._text_arg = Arg(names.pop()).bind(denoiser) if len(names) == 1 else None
            from ..install import PATCH_ATTR

            setattr(denoiser, PATCH_ATTR, self)
            self._watch()
        except BaseException:
            self.remove()
            raise
        forget_compiled(denoiser, _Hook.__call__.__code__)

    def _install_block(self, index: int, site: BlockSite) -> None:
        block = site.module
        sites = []
        for spec in (*site.targets, *site.pointwise):
            sub = _sub(block, spec.attr)
            if sub is None:
                continue
            attention = spec.kind in (SELF, JOINT) and spec in site.targets
            if self.cached and not attention:  # the whole block runs on the recomputed tokens: nothing to gather
                continue
            sites.append(_Site(spec, _HIDDEN.bind(sub), attention))
            if self.cached:
                continue
            query = _sub(sub, spec.query) if attention and spec.query else None
            if query is not None:  # the queries of the tokens that are not recomputed are never attended
                sites.append(_Site(dataclasses.replace(spec, attr=f"{spec.attr}.{spec.query}", kind=MLP),
                                   _HIDDEN.bind(query), False, optional=True))
        self._targets.append(sites)
        self._inputs.append(_HIDDEN.bind(block))
        self._outputs.append(site.whole.output)
        self._refusals.append(tuple((b, reason) for b, reason in ((Arg(n).bind(block), r) for n, r in site.refuse_if)
                                    if b is not None))
        whole = site.whole
        self._texts.append(Arg(whole.text).bind(block) if self.config.text and whole.text is not None else None)
        self._wholes.append((
            Arg(whole.rotary.kwarg, also=whole.rotary.also).bind(block) if whole.rotary is not None else None,
            Arg(whole.mask.kwarg).bind(block) if whole.mask is not None else None,
            tuple((b, p) for b, p in ((Arg(p.name).bind(block), p) for p in whole.per_token) if b is not None),
            tuple(b for b in (Arg(n).bind(block) for n in whole.refuse_if) if b is not None)))
        pre = block.register_forward_pre_hook(_Hook(self, "_merge_input", index, BLOCK), with_kwargs=True)
        post = block.register_forward_hook(_Hook(self, "_unmerge_output", index, BLOCK), always_call=True)
        self.target_handles[(index, BLOCK)] = (pre, post)
        self._handles += [pre, post]
        for t, hooked in enumerate(sites):
            sub = _sub(block, hooked.spec.attr)
            handles = (sub.register_forward_pre_hook(_Hook(self, "_merge_input", index, t), with_kwargs=True),
                       sub.register_forward_hook(_Hook(self, "_unmerge_output", index, t)))
            self._handles += handles

    def remove(self) -> None:
        from ..install import PATCH_ATTR

        unwatch(self)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.target_handles.clear()
        self._targets.clear()
        self._inputs.clear()
        self._outputs.clear()
        self._wholes.clear()
        self._texts.clear()
        self._text_arg = None
        self._refusals.clear()
        self.state.reset()
        self.state.forget()
        if getattr(self.site.module, PATCH_ATTR, None) is self:
            delattr(self.site.module, PATCH_ATTR)
        self.tables.clear()
        forget_compiled(self.site.module, _Hook.__call__.__code__)

    # ---- denoiser: which step, which tokens ---------------------------------------------------------------
    @_on_host
    def _denoiser_pre(self, _b, _t, module, args, kwargs):
        state, cfg = self.state, self.config
        self._current = state
        state.reset()
        if getattr(module, PARALLEL_ATTR, None) is not None:  # enabled after the patch: runs untouched, one warning
            self._warn_once(PARALLEL_REFUSED)
            return None
        t = host_timestep(self.site.timestep.read(args, kwargs))
        if t is None:
            raise TypeError(f"tokenmerge: token reuse needs the timestep to tell the steps apart, and "
                            f"{type(module).__name__}.forward got none")
        progress = self.site.timestep.progress(t, 1000)
        new = state.last is None or progress < state.last  # the first call, or the progress went back: a generation
        if new or state.read is None:  # the grid, read once per generation (position ids: on the host)
            try:
                read = self._grid_reader.read(args, kwargs)
            except NoGrid:
                return None  # a call whose grid cannot be read runs untouched (and is not counted as a step)
        else:  # the generation's grid: its cached residuals hold its tokens
            read = state.read
        grid, device, state.trailing = read
        state.read = read
        if new:
            state.forget()
        elif progress == state.last:  # the same step again: guidance's other branch (called separately)
            state.branch += 1
        else:
            state.step += 1
            state.branch = 0
        state.last = progress
        state.active = True
        state.partial = cfg.partial_at(state.step)
        if state.partial and state.first is None:
            state.first = progress
        fraction = state.fraction = cfg.fraction_at(progress, state.first) if state.partial else 1.0
        advance = state.partial and state.counted != state.step  # a step's other branch takes the same tokens
        for level in self._levels:  # one grid for transformers; a UNet's levels halve it
            level_grid = coarsen(tuple(grid), level)
            image = math.prod(level_grid)
            index = None
            if state.partial:
                count = _recomputed(fraction, image)
                if advance:
                    state.offsets[level] = state.offsets.get(level, -count) + count
                index = select(level_grid, cfg.order, count, cfg.effective_seed, state.offsets[level], device,
                               self.tables)
            state.levels[level] = (image, index, level_grid)
        if advance:
            state.counted = state.step
        state.advance = advance
        text = self._text_arg.read(args, kwargs) if state.partial and self._text_arg is not None else None
        if isinstance(text, torch.Tensor) and text.dim() == 3:  # reuse text: its tokens chosen here, on the host
            self._choose_text(text.shape[1], text.device)
        return None

    def _warn_once(self, reason: str) -> None:
        """Warn, once per patch, that calls run untouched (no tokens reused), and why."""
        if self._warned:
            return
        self._warned = True
        name = self.site.path or type(self.site.module).__name__
        warnings.warn(f"tokenmerge: {name}: {reason}. The generation goes on with every token computed; later calls "
                      "run so too, without another warning", RuntimeWarning, stacklevel=4)

    @_on_host
    def _denoiser_post(self, _b, _t, module, args, output):
        self.state.reset()
        return None

    # ---- hooks: a block (t == BLOCK) or one of its sub-modules -------------------------------------------
    def _merge_input(self, index: int, t: int, module, args, kwargs):
        if t == BLOCK:
            return self._block_pre(index, args, kwargs)
        call = self.state.blocks.get(index)
        if call is None:
            return None
        call.ran = True
        site, state = self._targets[index][t], self.state
        if self.cached:  # keep every token's keys and values (full step), or splice the kept ones in (partial)
            slot = state.kv.setdefault((state.branch, index, t), [])
            mode = CachedKeys(call.image, call.index if call.partial else None, site.spec.keys, state.trailing, slot,
                              self.tables, call.text_index)
            call.modes[t] = mode
            mode.__enter__()
            return None
        if not call.partial:
            return None
        if site.attention:  # every token in; only the recomputed tokens' queries inside the attention call
            mode = QueryRows(call.image, call.index, site.spec.keys, state.trailing, self.tables)
            call.modes[t] = mode
            mode.__enter__()
            return None
        x = site.arg.read(args, kwargs)  # a per-token sub-module: the recomputed rows in
        if site.optional:
            if not isinstance(x, torch.Tensor) or x.dim() != 3:
                return None
            before, after = _sides_or_none(x.shape[1], call.image, _layout(site.spec.text), state.trailing)
            if before is None:
                return None
        else:
            before, after = sides(x.shape[1], call.image, _layout(site.spec.text), state.trailing)
        call.rows[t] = (before, after)
        rows = image_part(x, call.image, before).index_select(1, call.index)
        return site.arg.replace(args, kwargs, join(x, rows, before, after))

    def _unmerge_output(self, index: int, t: int, module, args, output):
        if t == BLOCK:
            return self._block_post(index, output)
        call = self.state.blocks.get(index)
        if call is None:
            return None
        site = self._targets[index][t]
        mode = call.modes.pop(t, None)
        if mode is not None:
            mode.__exit__(None, None, None)
            if mode.calls == 0:
                raise ValueError(
                    f"tokenmerge: token reuse found no scaled_dot_product_attention call over the image tokens in "
                    f"{self.blocks[index].path}.{site.spec.attr}: its attention backend computes attention another "
                    "way (token reuse works with PyTorch's SDPA, diffusers' default 'native' backend)")
        if self.cached or not call.partial:
            return None
        if not site.attention and call.rows.pop(t, None) is None:  # an optional one that passed untouched
            return None
        return self._scatter(index, site, call, output)

    def _scatter(self, index: int, site: _Site, call: _Call, output):
        """The sub-module's output with its image rows (the recomputed tokens') scattered back to all N rows."""
        state, spec = self.state, site.spec
        which = None
        seq = output
        if isinstance(output, (tuple, list)):
            which = spec.output_image
            seq = output[which]
        if not isinstance(seq, torch.Tensor) or seq.dim() < 3:
            raise TypeError(f"tokenmerge: {self.blocks[index].path}.{spec.attr} returned a "
                            f"{type(seq).__name__}, not the (batch, tokens, channels) tensor token reuse expects")
        count = call.index.shape[0]
        before, after = _sides_or_none(seq.shape[1], count, _layout(spec.text), state.trailing)
        if before is None:
            raise ValueError(f"tokenmerge: {self.blocks[index].path}.{spec.attr} returned {seq.shape[1]} tokens for "
                             f"{count} recomputed image tokens: it lays its output out in a way token reuse cannot "
                             "follow (e.g. an attention that splits its output at its input's token count)")
        rows = image_part(seq, count, before)
        full = rows.new_zeros(rows.shape[0], call.image, *rows.shape[2:])
        full.index_copy_(1, call.index, rows)
        seq = join(seq, full, before, after)
        return seq if which is None else _replace(output, which, seq)

    def _block_pre(self, index: int, args, kwargs):
        state = self.state
        if not state.active:
            return None
        site = self.blocks[index]
        image, chosen, grid = state.levels[site.level]
        x = self._inputs[index].read(args, kwargs)
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise TypeError(f"tokenmerge: {site.path} got hidden states that are not a (batch, tokens, channels) "
                            "tensor, which token reuse needs")
        if x.shape[1] < image:
            raise ValueError(f"tokenmerge: block {site.path} got {x.shape[1]} tokens, but the call's grid has "
                             f"{image} image tokens at its level")
        for bound, reason in self._refusals[index]:
            if bound.read(args, kwargs) is not None:
                raise ValueError(f"tokenmerge: {site.path} got {bound.name!r}: {reason}")
        full = x
        before, after = sides(x.shape[1], image, site.text, state.trailing)
        x = image_part(x, image, before)
        cache = state.caches.get((state.branch, index))
        fits = cache is not None and cache.shape == x.shape and cache.dtype == x.dtype and cache.device == x.device
        if self.cached:
            for t, hooked in enumerate(self._targets[index]):
                kept = state.kv.get((state.branch, index, t))
                fits = fits and bool(kept) and kept[0].shape[0] == x.shape[0] and kept[0].shape[-2] >= image
        text_arg = self._texts[index] if self._texts else None
        text = text_arg.read(args, kwargs) if text_arg is not None else None
        if not isinstance(text, torch.Tensor) or text.dim() != 3:
            text = None
        if text is not None:
            kept = state.text_caches.get((state.branch, index))
            fits = fits and kept is not None and kept.shape == text.shape and kept.dtype == text.dtype
        state.blocks[index] = call = _Call(x, state.partial and fits, image, chosen, grid)
        call.text = text
        if not (self.cached and call.partial):
            return None
        # keys="cached": the whole block on the recomputed tokens (text and reference rows whole), rotary rows too
        rotary, mask, per_token, refuse_if = self._wholes[index]
        for bound in refuse_if:
            if bound.read(args, kwargs) is not None:
                raise ValueError(f"tokenmerge: {site.path} got {bound.name!r}, which a block run on some tokens would "
                                 "make wrong; use keys='fresh'")
        for bound, per in per_token:
            if per.holds(bound.read(args, kwargs), image, full.shape[1]):
                raise ValueError(f"tokenmerge: {site.path} got a per-token {bound.name!r}, which token reuse with "
                                 "keys='cached' does not follow; use keys='fresh'")
        call.picked = x.index_select(1, chosen)
        args, kwargs = self._inputs[index].replace(args, kwargs, join(full, call.picked, before, after))
        masked = mask.read(args, kwargs) if mask is not None else None
        if text is not None and masked is None:  # reuse text (a mask over the text keeps every text row fresh)
            call.text_index = self._text_rows(text.shape[1], text.device)
            args, kwargs = text_arg.replace(args, kwargs, text.index_select(1, call.text_index))
        value = rotary.read(args, kwargs) if rotary is not None else None
        if value is not None:
            args, kwargs = rotary.replace(args, kwargs, self._rotary_rows(site, value, image, chosen, call.text_index))
        if isinstance(masked, torch.Tensor) and site.whole.mask.tokens:  # per-token entries: the tokens' own
            args, kwargs = mask.replace(args, kwargs, take_mask(site.whole.mask, masked, image, chosen, state.trailing))
        return args, kwargs  # an attention mask stays whole: the keys are spliced back to every token's

    def _rotary_rows(self, site: BlockSite, value, image: int, chosen: torch.Tensor, text: torch.Tensor | None):
        """The rotary table ``value`` at the recomputed tokens' rows (``text``: the recomputed text tokens, whose
        rows lead the table), once per table and call (Flux passes one table to every block)."""
        state = self.state
        for seen, spec, rows, taken in state.taken:
            if seen is value and spec is site.whole.rotary and rows is text:
                return taken
        taken = take_rotary(site.whole.rotary, value, image, chosen, state.trailing)
        if text is not None:
            taken = _lead_rows(taken, site.whole.rotary.token_axis, text, chosen.shape[0] + state.trailing,
                               self.tables)
        state.taken.append((value, site.whole.rotary, text, taken))
        return taken

    def _text_rows(self, tokens: int, device) -> torch.Tensor:
        """``reuse text``: the text tokens recomputed at this call (sorted), the same for each block; round-robin
        over the text in its order, moving on at each step as the image's do. Chosen on the host at the call's
        start where the denoiser's own argument of that name shows the text's length (``_denoiser_pre``)."""
        rows = self.state.text_rows.get(tokens)
        return rows if rows is not None else self._choose_text(tokens, device)

    @_on_host
    def _choose_text(self, tokens: int, device) -> torch.Tensor:
        state = self.state
        count = _recomputed(state.fraction, tokens)
        key = ("text", tokens)
        if state.advance or key not in state.offsets:
            state.offsets[key] = state.offsets.get(key, -count) + count
        rows = state.text_rows[tokens] = select((tokens,), "strided", count, 0, state.offsets[key], device,
                                                self.tables)
        return rows

    def _block_post(self, index: int, output):
        state = self.state
        call = state.blocks.pop(index, None)
        if call is None:
            return None
        call.close()
        if not call.ran or output is None:  # its forward did not run (a cache hook returned without it): untouched
            return None
        which = self._outputs[index]
        seq = output if which is None or isinstance(output, torch.Tensor) else output[which]
        x, key, chosen = call.x, (state.branch, index), call.index
        ran_on = chosen.shape[0] if self.cached and call.partial else call.image  # the image rows the block returns
        before, after = sides(seq.shape[1], ran_on, self.blocks[index].text, state.trailing)
        out = image_part(seq, ran_on, before)
        text = self._text_output(index, call, output)
        if not call.partial:
            state.caches[key] = out - x  # the block residual of every token
            return None
        cache = state.caches[key]
        fresh = (out if self.cached else out.index_select(1, chosen)) - (
            x.index_select(1, chosen) if call.picked is None else call.picked)
        if self.config.spread:  # the recomputed tokens' change since their last computation, given to their neighbours
            change = fresh - cache.index_select(1, chosen)
            cache.index_copy_(1, chosen, fresh)
            key = (call.grid, change.dtype, change.device)  # the weights: once per call and grid, not per block
            weight = state.weights.get(key)
            if weight is None:
                weight = state.weights[key] = _weights(chosen, call.grid, call.image, self.config.spread, change)
            _spread(cache, change, chosen, call.grid, call.image, weight)
        else:
            cache.index_copy_(1, chosen, fresh)
        seq = join(seq, x + cache, before, after)
        if which is None or isinstance(output, torch.Tensor):
            return seq
        return _replace(_replace(output, which, seq), self.blocks[index].whole.text_output, text)

    def _text_output(self, index: int, call: _Call, output):
        """``reuse text``: the block's text-stream output for every text token (the recomputed ones' fresh, the
        others' input plus their cached residual), its residual cache updated; ``None`` where text passes whole."""
        if call.text is None or isinstance(output, torch.Tensor):
            return None
        state, at = self.state, self.blocks[index].whole.text_output
        out, key, rows = output[at], (self.state.branch, index), call.text_index
        if rows is None:  # every text token computed (a full step, or a call with a mask): its residuals kept
            state.text_caches[key] = out - call.text
            return None
        cache = state.text_caches[key]
        cache.index_copy_(1, rows, out - call.text.index_select(1, rows))
        return call.text + cache


def _replace(output, at: int | None, value):
    """``output`` (a tuple or list) with its entry ``at`` replaced by ``value`` (``None``: as it is)."""
    if value is None or at is None:
        return output
    parts = list(output)
    parts[at] = value
    return type(output)(parts)


def _lead_rows(value, axis: int, text: torch.Tensor, rest: int, tables: Tables):
    """A rotary table (a tensor, or a tuple of them) of ``[text | rest]`` rows along ``axis`` at the rows ``text``
    of its text and every row of the rest."""
    if isinstance(value, (tuple, list)):
        return type(value)(_lead_rows(v, axis, text, rest, tables) for v in value)
    axis = axis % value.dim()
    return value.index_select(axis, sided_rows(text, 0, value.shape[axis] - rest, rest, tables))


def _weights(chosen: torch.Tensor, grid: tuple, image: int, alpha: float, like: torch.Tensor) -> torch.Tensor:
    """``(1, N, 1)``: ``alpha`` over the share of recomputed tokens in each token's 3x3 (video: 3x3x3) neighbourhood,
    0 where it has none and on the recomputed tokens themselves (the same for every block of a call)."""
    mask = like.new_zeros(1, image, 1)
    mask.index_fill_(1, chosen, 1.0)
    count = _box(mask, grid)  # a mean over the window, as the change's: their ratio is the recomputed tokens' mean
    return torch.where(count > 0, alpha / count.clamp_min(1e-6), 0.0) * (1 - mask)


def _spread(cache: torch.Tensor, change: torch.Tensor, chosen: torch.Tensor, grid: tuple, image: int,
            weight: torch.Tensor) -> None:
    """Add to ``cache`` ``(B, N, C)``, on each token not recomputed, ``alpha`` times the mean ``change`` of the
    recomputed tokens in its 3x3 (video: 3x3x3) neighbourhood of the grid (nothing where it has none, nor on the
    recomputed tokens themselves): ``weight`` from ``_weights``."""
    b, _, c = change.shape
    full = change.new_zeros(b, image, c)
    full.index_copy_(1, chosen, change)
    cache.addcmul_(_box(full, grid), weight)


def _box(x: torch.Tensor, grid: tuple) -> torch.Tensor:
    """``x`` ``(B, N, C)`` over ``grid``: the mean over each token's 3 x ... x 3 neighbourhood, the grid's edges
    padded with 0 (a pooling over the last two axes, channels last; the leading ones by shifted sums)."""
    b, n, c = x.shape
    h, w = (1, *grid)[-2:]
    y = F.avg_pool2d(x.reshape(-1, h, w, c).permute(0, 3, 1, 2), 3, stride=1, padding=1).permute(0, 2, 3, 1)
    y = y.reshape(b, *grid[:-2], h * w, c)
    for axis in range(1, len(grid) - 1):
        size = y.shape[axis]
        out = y.clone()
        out.narrow(axis, 1, size - 1).add_(y.narrow(axis, 0, size - 1))
        out.narrow(axis, 0, size - 1).add_(y.narrow(axis, 1, size - 1))
        y = out / 3
    return y.reshape(b, n, c)


# ---- which tokens -------------------------------------------------------------------------------------------
def _recomputed(fraction: float, image: int) -> int:
    return min(image, max(1, round(fraction * image)))


def select(grid: tuple[int, ...], order: str, count: int, seed: int, start: int, device,
           tables: Tables = TABLES) -> torch.Tensor:
    """``(count,)`` sorted indices of image tokens to recompute: the ``count`` tokens of the order from position
    ``start`` on (round-robin: each partial step starts where the last one ended, so every token is recomputed
    once every ``ceil(N / count)`` partial steps)."""
    n = math.prod(grid)
    return tables.get(_window, grid, order, count, seed, start % n, torch.device(device))


def _window(grid: tuple[int, ...], order: str, count: int, seed: int, start: int, device) -> torch.Tensor:
    n = math.prod(grid)
    walk = _order(grid, order, count, seed)
    picked = walk[(torch.arange(count) + start) % n]
    return picked.sort().values.to(device)


@functools.lru_cache(maxsize=64)
def _order(grid: tuple[int, ...], order: str, count: int, seed: int) -> torch.Tensor:
    """A permutation of the ``N`` image tokens (raster order over ``grid``) whose consecutive windows of ``count``
    are each spread over the image."""
    n = math.prod(grid)
    i = torch.arange(n)
    if order == "random":
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    if order == "strided":  # every c-th token in raster order, c = N / count: the residues one after another
        c = max(1, round(n / count))
        return torch.argsort((i % c) * n + i)
    # grid: each token's rank inside its 2x2 window (a Bayer pattern; on a video grid, frames in pairs too), then the
    # window's index, so that a window of the order holds the same ranks of every window of the grid
    coords = torch.stack(torch.meshgrid(*[torch.arange(g) for g in grid], indexing="ij"), -1).reshape(n, -1)
    rank = torch.tensor([[0, 2], [3, 1]])[coords[:, -2] % 2, coords[:, -1] % 2]
    halved = {len(grid) - 1, len(grid) - 2}
    if len(grid) > 2:
        rank = rank * 2 + coords[:, -3] % 2
        halved.add(len(grid) - 3)
    windows = torch.zeros(n, dtype=torch.long)
    for axis, size in enumerate(grid):
        s = 2 if axis in halved else 1
        windows = windows * -(-size // s) + coords[:, axis] // s
    return torch.argsort(rank * n + windows)


# ---- helpers ------------------------------------------------------------------------------------------------
def _sub(block: nn.Module, attr: str) -> nn.Module | None:
    sub = resolve(block, attr)
    return sub if isinstance(sub, nn.Module) else None


def _layout(text: str) -> str:
    """A target's text layout as ``sides`` reads it (a separate text stream: none beside the image)."""
    return TEXT_NONE if text == TEXT_STREAM else text


def _sides_or_none(total: int, image: int, text: str, trailing: int):
    try:
        return sides(total, image, text, trailing)
    except ValueError:
        return None, None
