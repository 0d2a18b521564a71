"""Token reuse (``tokenmerge.apply_reuse``): after a few full steps, each step recomputes a share of the image tokens in
every block and the others carry their kept block residual. A technique of the shared engine: the denoiser's
``CallHook`` decides each call (``CallHook.decide``: the step clock moved, ``begin`` here); the block and target hooks
here read merge -> work -> unmerge as:

    begin (host)      full or partial step, the recomputed tokens S of each level (round-robin, ``merge.recompute``)
    block pre-hook    keep x, the block's image input                                     # (B, N, C)
                      keys="kept": the block's input at S only (text and references whole, rotary rows too)
    attention         keys="fresh": every token in, only S's query rows attended (``attention.QueryRows``)
                      keys="kept": S's fresh keys and values written into the kept ones (``attention.CachedKeys``)
    per-token target  keys="fresh": cross-attention, feed-forward, pointwise layers run on S's rows
    block hook        full step: R = out - x kept; partial step: out[S] - x[S] into R, y = x + R   # (B, N, C)

Kept state (``state.ReuseBranch``) lives in the clock, by the call's branch (its grid, batch, dtype and place in
the step), so guidance branches and tiles of two sizes keep their own; the round-robin (``state.Walk``) is the
generation's; a new generation (the pipeline's scheduler set up again, ``tokenmerge.new_generation``, the timestep back
to noise) forgets both. A call whose branch has nothing kept (a new grid, batch or dtype) runs a full step. Family
knowledge comes from the records: targets and their kinds, text beside the image (``sides``), the block's output layout
(``Whole``), pointwise layers (``Blocks.pointwise``).
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from ....families.spec import TEXT_NONE, TEXT_STREAM, Arg, BlockSite
from ....merge.plan import Tables
from ....merge.recompute import (
    extrapolated,
    fraction_at,
    recomputed_at,
    settle,
    since,
    spread,
    spread_weights,
    write_kept,
)
from ...attention import CachedKeys, Probe, QueryRows, leave
from ...call import coarsen, image_part, join, sides, take_mask, take_rotary
from ...compiled import on_host
from ...discover import bind, bind_refusals, bind_whole
from ...registries import ChainHook
from ...technique import Technique
from .sites import NOTE_EXTRAPOLATE, NOTE_KEYS, NOTE_MEMORY, NOTE_TEXT, Site, check, hooked_sites, sub_module
from .state import TEXT, BlockCall, Recompute, ReuseBranch, Walk, spans_of

__all__ = ["TokenReuse"]

BLOCK = -1  # the "target" index of a block's own hooks (how caches.route names them)
NO_SDPA = ("tokenmerge: token reuse found no scaled_dot_product_attention call over the image tokens in {where}: its "
           "attention backend computes attention another way (token reuse works with PyTorch's SDPA, diffusers' "
           "default 'native' backend)")


class TokenReuse(Technique):
    """Token reuse on each patched block.

    Args:
        patch: the installed patch (config, blocks, family, its ``CallHook``).
    """

    name = "token reuse"
    clocked = timed = decides_on_host = True  # full or partial, and which tokens: decided on the host at each call
    inside = "token reuse works"

    @classmethod
    def levels(cls, config) -> None:
        return None  # a transformer's blocks (one level)

    def __init__(self, patch):
        super().__init__(patch)
        cfg = self.config
        self.cached, self.reuses = cfg.keys == "kept", cfg.reuses
        self.order, self.seed = cfg.order, cfg.effective_seed
        self.tables = Tables()  # the recomputed tokens' indices and row tables, released at removal
        self.levels = sorted({b.level for b in self.blocks})
        self.targets: list[list[Site]] = []  # per block, its hooked sub-modules
        self.bound: list[tuple] = []  # per block: input, output index, text arg, refusals, (rotary, mask, ...)
        self.text_arg = None  # text=True: the denoiser's argument named as the blocks' text stream
        self.routes: dict[tuple[int, int], bool] = {}  # (block, target) -> whether the SDPA route reaches its calls
        self.warned = False

    def install(self) -> list:
        """Register the hooks on every patched block and its sub-modules; returns their handles."""
        handles = []
        for index, site in enumerate(self.blocks):
            handles += self._install_block(index, site)
        names = {b.whole.text for b in self.blocks if self.config.text and b.whole.text}
        self.text_arg = bind(Arg(names.pop()), self.patch.site.module) if len(names) == 1 else None
        return handles

    def _install_block(self, index: int, site: BlockSite) -> list:
        block, whole = site.module, site.whole
        sites = hooked_sites(site, self.cached)
        self.targets.append(sites)
        arg, rotary, mask, per_token, refuse_if = bind_whole(site)
        text = bind(Arg(whole.text), block) if self.config.text and whole.text is not None else None
        self.bound.append((arg, whole.output, text, bind_refusals(site), rotary, mask, per_token, refuse_if))
        pre = block.register_forward_pre_hook(functools.partial(self.block_pre, index), with_kwargs=True)
        post = block.register_forward_hook(functools.partial(self.block_post, index), always_call=True)
        self.target_handles[(index, BLOCK)] = (pre, post)
        handles = [pre, post]
        for t, hooked in enumerate(sites):
            sub = sub_module(block, hooked.spec.attr)
            handles += [sub.register_forward_pre_hook(functools.partial(self.target_pre, index, t), with_kwargs=True),
                        sub.register_forward_hook(functools.partial(self.target_post, index, t))]
        return handles

    def chain_hook(self, index: int, t: int) -> ChainHook:
        """The block's hooks as a diffusers hook, run below a cache's hook on the block (``caches.route``)."""
        return ChainHook(functools.partial(self.block_pre, index), functools.partial(self.block_post, index))

    def release(self) -> None:
        self.tables.clear()

    # ---- the protocol's static parts ------------------------------------------------------------------------
    @classmethod
    def check(cls, site, blocks, config) -> None:
        """Refuse, with the reason, a denoiser whose blocks token reuse cannot follow (``sites.check``)."""
        check(site, blocks, config)

    @classmethod
    def changes(cls, config) -> bool:
        return config.reuses

    @classmethod
    def routed(cls, config, blocks) -> dict:
        """Its block hooks (target ``BLOCK``) run below a block cache's (First Block Cache, MagCache)."""
        return {id(site.module): (i, BLOCK) for i, site in enumerate(blocks)}

    @classmethod
    def refuses_cache(cls, config, is_target: bool) -> str | None:
        return None if is_target else "it sits inside a block where token reuse runs only some tokens' rows"

    @classmethod
    def cache_message(cls, path: str, what: str, when: str, why: str) -> str:
        return (f"tokenmerge: {what} {when} on {path}, inside a block where token reuse runs only some tokens' rows: "
                "a cached output there would hold another step's tokens. Use a cache on whole blocks (First Block "
                "Cache, MagCache), or disable one of them (e.g. model.disable_cache())")

    def summary(self) -> str:
        c = self.config
        end = "" if c.fraction_end is None else f" fraction_end={c.fraction_end:g}"
        return (f"tokenmerge token reuse: fraction={c.fraction:g} (recomputed per partial step){end} "
                f"warmup={c.warmup} every={c.every} keys={c.keys}" + (" text=True" if c.text else "")
                + f" spread={c.spread:g}" + (f" extrapolate={c.extrapolate:g}" if c.extrapolate else "")
                + f" order={c.order} seed={c.effective_seed}")

    def notes(self) -> list[str]:
        cfg = self.config
        return [NOTE_MEMORY] + [NOTE_KEYS] * (cfg.keys == "kept") + [NOTE_TEXT] * cfg.text \
            + [NOTE_EXTRAPOLATE] * bool(cfg.extrapolate)

    # ---- the denoiser's call: which step, which tokens (on the host) ---------------------------------------
    def begin(self, state, info) -> None:
        """Set up the call: full or partial, and each level's recomputed tokens (the same on every rank of a
        context-parallel split: a function of the generation's steps and the rank's grid)."""
        progress = info.where.progress
        if progress is None:
            self._warn_once("a call got no timestep, which token reuse needs to tell the steps apart")
            return
        cfg, clock, ex, device = self.config, state.clock, self.config.extrapolate, info.device
        kept = clock.kept.get(state.branch)  # the branch's kept tensors, the generation's round-robin
        if kept is None:
            kept = clock.kept[state.branch] = ReuseBranch()
        steps = clock.whole
        if steps is None:
            steps = clock.whole = Walk()
        step = clock.step  # its fraction (None: a full step; merge.recompute.fraction_at, unless constant)
        if not self.reuses or step < cfg.warmup or (cfg.every and (step - cfg.warmup + 1) % cfg.every == 0):
            part = None
        elif cfg.fraction_end is None:
            part = cfg.fraction
        else:
            part = fraction_at(step, progress, steps.first, cfg.fraction, cfg.fraction_end, cfg.warmup, cfg.every)
        if part is not None and steps.counted != clock.step:  # a new partial step (its other calls take the same)
            steps.first = progress if steps.first is None else steps.first
            if not steps.ran:  # the last one recomputed nothing (a cache skipped it): this one takes its tokens
                steps.fractions.pop()
            steps.fractions.append(part)
            steps.counted, steps.ran = clock.step, False
        segments = state.shard.split.ulysses if state.shard is not None else 1
        call = state.work = Recompute(kept, part is not None and bool(kept.residual), segments, device, walk=steps)
        for level in self.levels:  # one grid for transformers; a UNet's levels halve it
            grid = state.grid if level == 0 else coarsen(state.grid, level)
            image = math.prod(grid)
            index = recomputed_at(grid, steps.fractions, self.order, self.seed, device, self.tables) if call.partial \
                else None
            call.levels[level] = (image, index, grid)
            call.spans[level] = since(kept.when, level, image, index, progress, ex, call.moves) if ex else None
        text = self.text_arg.read(info.args, info.kwargs) if (call.partial or ex) and self.text_arg is not None \
            else None
        if isinstance(text, torch.Tensor) and text.dim() == 3 and state.shard is None:  # text=True: chosen here
            length = text.shape[1]
            if call.partial:
                call.text[length] = recomputed_at((length,), steps.fractions, "strided", 0, device, self.tables)
            call.spans[TEXT, length] = since(kept.when, (TEXT, length), length, call.text.get(length), progress, ex,
                                            call.moves) if ex else None

    def _warn_once(self, reason: str) -> None:
        """Warn, once per patch, that some calls compute every token, and why."""
        if self.warned:
            return
        self.warned = True
        name = self.patch.site.path or type(self.patch.site.module).__name__
        warnings.warn(f"tokenmerge: {name}: {reason}. The generation goes on; later such calls compute every token "
                      "too, without another warning", RuntimeWarning, stacklevel=4)

    # ---- a block --------------------------------------------------------------------------------------------
    def block_pre(self, index: int, block, args, kwargs):
        state = self.calls.state
        call = state.work
        if call is None:
            return None
        site = self.blocks[index]
        image, chosen, grid = call.levels[site.level]
        arg, _, text_arg, refusals, rotary, mask, per_token, refuse_if = self.bound[index]
        full = arg.read(args, kwargs)
        if not isinstance(full, torch.Tensor) or full.dim() != 3:
            raise TypeError(f"tokenmerge: {site.path} got hidden states that are not a (batch, tokens, channels) "
                            "tensor, which token reuse needs")
        split = state.shard.split if state.shard is not None and state.shard.split.block == index else None
        if split is not None:  # diffusers splits this block's input inside its forward (parallel.py)
            full = split.local(full)
        for bound, reason in refusals:
            if bound.read(args, kwargs) is not None:
                raise ValueError(f"tokenmerge: {site.path} got {bound.name!r}: {reason}")
        before, after = sides(full.shape[1], image, site.text, state.trailing)
        x = image_part(full, image, before)
        kept = call.kept
        residual = kept.residual.get(index)
        fits = residual is not None and residual.shape == x.shape and residual.dtype == x.dtype
        text = text_arg.read(args, kwargs) if text_arg is not None else None
        text = text if isinstance(text, torch.Tensor) and text.dim() == 3 else None
        if fits and text is not None:
            kept_text = kept.text.get(index)
            fits = kept_text is not None and kept_text.shape == text.shape and kept_text.dtype == text.dtype
        if fits and self.cached:  # (a batch of another size is another branch)
            for t in range(len(self.targets[index])):
                fits = fits and bool(kept.kv.get((index, t)))
        call.blocks[index] = entry = BlockCall(x, call.partial and fits, image, chosen, grid, text)
        if not (self.cached and entry.partial):
            return None
        # keys="kept": the block on the recomputed tokens (text, references and rotary rows follow); a call with
        for bound in refuse_if:  # arguments that cannot follow runs on every token (one warning)
            if bound.read(args, kwargs) is not None:
                return self._whole(entry, f"{site.path} got {bound.name!r}, which a block run on some tokens would "
                                          "make wrong (keys='fresh' can run it)")
        for bound, per in per_token:
            if per.holds(bound.read(args, kwargs), image, full.shape[1]):
                return self._whole(entry, f"{site.path} got a per-token {bound.name!r}, which token reuse with "
                                          "keys='kept' does not follow (keys='fresh' does)")
        entry.picked = x.index_select(1, chosen)
        joined = join(full, entry.picked, before, after)
        args, kwargs = arg.replace(args, kwargs, joined if split is None else split.hand_over(joined))
        masked = mask.read(args, kwargs) if mask is not None else None
        if text is not None and masked is None:  # text=True (a mask over the text keeps every text row fresh)
            entry.text_index = call.text.get(text.shape[1])
            if entry.text_index is None:  # a length the denoiser's own argument did not show (chosen here, on the host)
                entry.text_index = call.text[text.shape[1]] = self._text_rows(text, call.walk.fractions)
            args, kwargs = text_arg.replace(args, kwargs, text.index_select(1, entry.text_index))
        value = rotary.read(args, kwargs) if rotary is not None else None
        if value is not None:  # its rows at the recomputed tokens (and text rows), once per table and call (Flux
            taken = None  # passes one table to every block)
            for seen, spec, rows, done in call.taken:
                if seen is value and spec is site.whole.rotary and rows is entry.text_index:
                    taken = done
            if taken is None:
                taken = take_rotary(site.whole.rotary, value, image, chosen, state.trailing, self.tables,
                                    entry.text_index)
                call.taken.append((value, site.whole.rotary, entry.text_index, taken))
            args, kwargs = rotary.replace(args, kwargs, taken)
        if isinstance(masked, torch.Tensor) and site.whole.mask.tokens:  # per-token entries: the tokens' own
            args, kwargs = mask.replace(args, kwargs, take_mask(site.whole.mask, masked, image, chosen, state.trailing))
        return args, kwargs  # an attention mask stays whole: the keys are spliced back to every token's

    @on_host
    def _text_rows(self, text: torch.Tensor, fractions: list) -> torch.Tensor:
        """``text=True``: the recomputed text tokens of a text stream ``(B, T, C)`` (round-robin, as the image's)."""
        return recomputed_at((text.shape[1],), fractions, "strided", 0, text.device, self.tables)

    def _whole(self, entry: BlockCall, reason: str) -> None:
        """Run this block's call on every token (its kept residual refreshed), with the patch's one warning."""
        entry.partial = False
        self._warn_once(f"{reason}: such calls run the block on every token")
        return None

    def block_post(self, index: int, block, args, output):
        state = self.calls.state
        call = state.work
        entry = call.blocks.pop(index, None) if call is not None else None
        if entry is None:
            return None
        if entry.modes:  # a target's call that raised left its mode active
            entry.close()
        if not entry.ran or output is None:  # its forward did not run (a cache hook returned without it): untouched
            return None
        site = self.blocks[index]
        call.ran += 1
        if call.ran == len(self.blocks):  # every block ran: the call counts (a cache that cut it short leaves its
            call.walk.ran = True  # tokens to the next partial step, and their progress where it was)
            if call.moves:
                settle(call.kept.when, call.moves, call.device)
        at = self.bound[index][1]
        seq = output if at is None or isinstance(output, torch.Tensor) else output[at]
        x, chosen, kept = entry.x, entry.index, call.kept
        ran_on = chosen.shape[0] if self.cached and entry.partial else entry.image  # the image rows the block returns
        before, after = sides(seq.shape[1], ran_on, site.text, state.trailing)
        out = image_part(seq, ran_on, before)
        text = None  # text=True: the text stream's output (the recomputed tokens' fresh, the others' input + residual)
        spans, text_spans = spans_of(call, entry, site.level) if self.config.extrapolate else (None, None)
        if entry.text is not None and not isinstance(output, torch.Tensor):
            out_text, rows = output[site.whole.text_output], entry.text_index
            if rows is None:  # every text token computed (a full step, or a call with a mask): kept
                write_kept(kept.text, index, kept.slope, (TEXT, index), out_text - entry.text, None, text_spans)
            elif text_spans is None:
                kept.text[index].index_copy_(1, rows, out_text - entry.text.index_select(1, rows))
                text = entry.text + kept.text[index]
            else:  # extrapolate: the kept rows moved along their slopes
                slope = write_kept(kept.text, index, kept.slope, (TEXT, index), out_text - entry.text.index_select(
                    1, rows), rows, text_spans)
                text = entry.text + extrapolated(kept.text[index], slope, text_spans[1])
        if not entry.partial:  # the block residual of every token (extrapolate: and its change since it was kept)
            write_kept(kept.residual, index, kept.slope, index, out - x, None, spans)
            return None
        residual = kept.residual[index]
        fresh = (out if self.cached else out.index_select(1, chosen)) - (
            x.index_select(1, chosen) if entry.picked is None else entry.picked)
        if self.config.spread:  # the recomputed tokens' change since their last computation (extrapolate: since where
            slope = kept.slope.get(index) if spans is not None else None  # it had moved), given to their neighbours
            change = fresh - (residual.index_select(1, chosen) if slope is None else extrapolated(
                residual.index_select(1, chosen), slope.index_select(1, chosen), spans[2]))
        if spans is None:
            residual.index_copy_(1, chosen, fresh)
        slope = None if spans is None else write_kept(kept.residual, index, kept.slope, index, fresh, chosen, spans)
        if self.config.spread:
            weight = (self.tables.get if not torch.compiler.is_compiling() else lambda build, *key: build(*key))(
                spread_weights, chosen, entry.grid, self.config.spread, change.dtype, change.device)  # eager: a table
            spread(residual, change, chosen, entry.grid, weight)
        seq = join(seq, x + (residual if slope is None else extrapolated(residual, slope, spans[1])), before, after)
        if at is None or isinstance(output, torch.Tensor):
            return seq
        parts = list(output)
        parts[at] = seq
        if text is not None:
            parts[site.whole.text_output] = text
        return type(output)(parts)

    # ---- a block's sub-modules ------------------------------------------------------------------------------
    def target_pre(self, index: int, t: int, module, args, kwargs):
        state = self.calls.state
        call = state.work
        entry = call.blocks.get(index) if call is not None else None
        if entry is None:
            return None
        entry.ran = True
        hooked = self.targets[index][t]
        route = self.routes.get((index, t)) if hooked.attention else False
        if route is None and not torch.compiler.is_compiling():  # its first call: which way reaches its SDPA calls
            entry.modes[-1 - t] = Probe().open_both()
        if self.cached:  # keep every token's keys and values (full step), or write the fresh rows in (partial)
            pairs = call.kept.kv.setdefault((index, t), [])
            spans = spans_of(call, entry, self.blocks[index].level) if self.config.extrapolate else (None, None)
            mode = CachedKeys(entry.image, entry.index if entry.partial else None, hooked.spec.keys, state.trailing,
                              pairs, entry.text_index, call.segments, self.tables,
                              None if spans[0] is None else (*spans, call.spans))
        elif not entry.partial:
            return None
        elif hooked.attention:  # every token in; only the recomputed tokens' queries inside the attention call
            mode = QueryRows(entry.image, entry.index, hooked.spec.keys, state.trailing, call.segments, self.tables)
        else:
            return self._gather(entry, hooked, state.trailing, args, kwargs)
        entry.modes[t] = mode.open(route=bool(route))
        return None

    def _gather(self, entry: BlockCall, hooked: Site, trailing: int, args, kwargs):
        """A per-token sub-module's input at the recomputed rows (its text and reference rows whole)."""
        x = hooked.arg.read(args, kwargs)
        layout = TEXT_NONE if hooked.spec.text == TEXT_STREAM else hooked.spec.text
        if hooked.optional:  # a query projection: only a call laid out as its attention's input
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] < entry.image:
                return None
            try:
                before, after = sides(x.shape[1], entry.image, layout, trailing)
            except ValueError:
                return None
        else:
            before, after = sides(x.shape[1], entry.image, layout, trailing)
        entry.rows[id(hooked)] = (before, after)
        rows = image_part(x, entry.image, before).index_select(1, entry.index)
        return hooked.arg.replace(args, kwargs, join(x, rows, before, after))

    def target_post(self, index: int, t: int, module, args, output):
        state = self.calls.state
        entry = state.work.blocks.get(index) if state.work is not None else None
        if entry is None:
            return None
        hooked = self.targets[index][t]
        where = f"{self.blocks[index].path}.{hooked.spec.attr}"
        mode, probe = entry.modes.pop(t, None), entry.modes.pop(-1 - t, None)
        if mode is not None:
            mode.close()
        if probe is not None:  # the first call: an attention that makes no SDPA call is refused now, at its first step
            leave(probe, NO_SDPA.format(where=where))
            self.routes[(index, t)] = probe.routed > 0
        if mode is not None and mode.calls == 0:
            raise ValueError(NO_SDPA.format(where=where))
        if self.cached or not entry.partial:
            return None
        if not hooked.attention and entry.rows.pop(id(hooked), None) is None:  # an optional one left untouched
            return None
        return self._scatter(index, hooked, entry, output, state)

    def _scatter(self, index: int, hooked: Site, entry: BlockCall, output, state):
        """The sub-module's output with its image rows (the recomputed tokens') scattered back to all N rows."""
        spec = hooked.spec
        at = spec.output_image if isinstance(output, (tuple, list)) else None
        seq = output if at is None else output[at]
        if not isinstance(seq, torch.Tensor) or seq.dim() < 3:
            raise TypeError(f"tokenmerge: {self.blocks[index].path}.{spec.attr} returned a {type(seq).__name__}, "
                            "not the (batch, tokens, channels) tensor token reuse expects")
        if hooked.attention and state.work.segments > 1:  # under Ulysses the attention gave every row back
            return None
        count = entry.index.shape[0]
        layout = TEXT_NONE if spec.text == TEXT_STREAM else spec.text
        try:
            before, after = sides(seq.shape[1], count, layout, state.trailing)
        except ValueError:
            raise ValueError(f"tokenmerge: {self.blocks[index].path}.{spec.attr} returned {seq.shape[1]} tokens for "
                             f"{count} recomputed image tokens: it lays its output out in a way token reuse cannot "
                             "follow (e.g. an attention that splits its output at its input's token count)") from None
        rows = image_part(seq, count, before)
        full = rows.new_zeros(rows.shape[0], entry.image, *rows.shape[2:])
        full.index_copy_(1, entry.index, rows)
        seq = join(seq, full, before, after)
        if at is None:
            return seq
        parts = list(output)
        parts[at] = seq
        return type(output)(parts)


