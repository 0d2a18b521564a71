"""Hooks that merge and unmerge at the boundaries of a block's sub-modules, and their exact removal.

Per patched denoiser:
- a forward pre-hook on the denoiser reads the latent's size and the timestep (by argument name);
- a forward pre-hook on each selected transformer block builds its merge plan from the block's input
  ``hidden_states`` (tomesd's metric), and a forward hook (always called) drops it;
- forward pre-hooks / hooks on ``attn1``, ``attn2`` and ``ff`` merge their input and unmerge their output.

No block ``forward`` is copied, so every ``norm_type``, GLIGEN, chunked feed-forward and future block code
keep working: adaptive norms modulate per channel and gates multiply per channel, which commutes with
averaging tokens. Run-time state is thread-local, so one patched model may serve several threads.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import torch
from torch import nn

from .adapters import ArgSpec, BlockSite, DenoiserSite
from .config import ToDoConfig, ToMeConfig
from .merge import bipartite_soft_matching_2d, random_offsets
from .merge.downsample import downsample_tokens
from .merge.bipartite import _MASK32, _mix32

__all__ = ["DenoiserPatch", "PATCH_ATTR"]

# The attribute a patched denoiser carries; its presence is what "patched" means.
PATCH_ATTR = "_tokenmerge_patch"


class _CallState:
    """What one denoiser call tells its blocks. ``reset()`` forgets it (end of call, or an error).

    One per thread (``DenoiserPatch.state``), and one for code that ``torch.compile`` traces: dynamo follows
    mutations of a plain object, not of a ``threading.local``.

    ``kept`` (plans kept across calls for ``reuse_steps``) and ``calls`` survive ``reset()``.
    """

    def __init__(self) -> None:
        self.reset()
        self.calls = 0
        self.last_t: float | None = None
        self.kept: dict[int, tuple] = {}  # key -> (plan, batch, tokens, call it was made at)

    def reset(self, blocks: "list[BlockSite] | None" = None) -> None:
        """Forget the call; give back any feed-forward chunking a block set aside (``blocks``: the patch's)."""
        for index, chunk_size in getattr(self, "unchunked", {}).items():
            if blocks is not None:
                blocks[index].module._chunk_size = chunk_size
        self.size: tuple[int, int] | None = None
        self.step_key = None
        self.active = True  # the schedule's verdict for this call
        self.ratio = 0.0
        self.plans: dict[int, object] = {}
        self.grids: dict[int, tuple[int, int]] = {}  # token grid of each block in this call
        self.shared: dict[int, tuple] = {}  # share_plans: level -> (plan, batch, tokens)
        self.unchunked: dict[int, int] = {}  # feed-forward chunk sizes set aside during a block call
        self.prefixes: dict[int, int] = {}  # joint attention: text tokens before the image's in this call


@dataclass(frozen=True)
class _Target:
    """A sub-module to wrap (``attn1``, ``attn2`` or ``ff``) and how its input is found."""

    attr: str
    arg: ArgSpec
    kind: str  # "self", "cross", "mlp" or "joint" (see adapters.base.BASIC_TARGETS)
    context: ArgSpec | None = None  # where self-attention takes other keys/values (ToDo passes them there)


class _Hook:
    """A hook that calls ``patch.<method>(index, module, *hook_args)``.

    An object rather than a closure, so that ``copy.deepcopy`` of a patched model gives a copy whose hooks
    all point at the copied patch (and so at the copied modules), and so that a patched model pickles.
    """

    __slots__ = ("patch", "method", "index")

    def __init__(self, patch: "DenoiserPatch", method: str, index: int = -1):
        self.patch, self.method, self.index = patch, method, index

    def __call__(self, module, *hook_args):
        return getattr(self.patch, self.method)(self.index, module, *hook_args)


class DenoiserPatch:
    """The installed patch of one denoiser: its config, the selected blocks, and the hook handles."""

    def __init__(self, site: DenoiserSite, config: ToMeConfig | ToDoConfig, blocks: list[BlockSite], matcher=None,
                 downsampler=None):
        """``matcher(metric, h, w, sx, sy, r, offsets) -> plan`` replaces ToMe's matching and
        ``downsampler(x, h, w, factor, mode)`` ToDo's pooling (the bench's zero-overhead limits)."""
        if matcher is None:
            matcher = bipartite_soft_matching_2d
            if config.match_radius is not None:
                matcher = functools.partial(matcher, radius=config.match_radius)
        self.matcher = matcher
        self.downsampler = downsampler or downsample_tokens
        self.timer = None  # the bench's phase timer (bench.breakdown), None in normal use
        self.site = site
        self.config = config
        self.todo = isinstance(config, ToDoConfig) and config.downsample > 1
        self.blocks = blocks
        self._local, self._traced = threading.local(), _CallState()
        self._handles: list = []
        self._targets: list[list[_Target]] = []
        self._inputs: list[ArgSpec] = []  # where each block's forward takes its tokens
        self._grid_cache: tuple = (None, None)  # Flux: (img_ids identity, grid) read once per generation
        self._seed_key = _mix32((config.effective_seed * 0x85EBCA6B) & _MASK32)

    def __getstate__(self):  # run-time state is per thread and per call: never copied
        return {k: v for k, v in self.__dict__.items() if k not in ("_local", "_traced")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local, self._traced = threading.local(), _CallState()

    @property
    def state(self) -> _CallState:
        """This thread's call state (or, while torch.compile traces, the traced code's)."""
        if torch.compiler.is_compiling():
            return self._traced
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _CallState()
        return state

    # ---- installation -------------------------------------------------------------------------------------
    def install(self) -> None:
        try:
            denoiser = self.site.module
            self._handles.append(denoiser.register_forward_pre_hook(_Hook(self, "_denoiser_pre"), with_kwargs=True))
            self._handles.append(denoiser.register_forward_hook(_Hook(self, "_denoiser_post"), always_call=True))
            for index, block in enumerate(self.blocks):
                self._install_block(index, block)
            setattr(denoiser, PATCH_ATTR, self)
        except BaseException:
            self.remove()
            raise

    def _install_block(self, index: int, site: BlockSite) -> None:
        block = site.module
        wanted = {"self": self.config.merge_attn, "joint": self.config.merge_attn,
                  "cross": self.config.merge_crossattn, "mlp": self.config.merge_mlp}
        targets = []
        for attr, kind in site.targets:
            sub = getattr(block, attr, None)
            if wanted[kind] and isinstance(sub, nn.Module):
                arg = ArgSpec.of(sub, ("hidden_states", "x"), default_index=0)
                context = ArgSpec.of(sub, ("encoder_hidden_states", "context")) if kind == "self" else None
                if self.todo and kind == "joint":
                    raise ValueError(
                        f"tokenmerge: ToDo cannot patch {site.path}.{attr}: it is joint attention over image and "
                        "text tokens (SD3/Flux), whose keys and values are made inside one attention call; pooling "
                        "the image tokens there would pool their queries too. Use ToMe (apply_patch) on this model")
                if self.todo and kind == "self" and context is None:
                    raise TypeError(f"tokenmerge: {site.path}.{attr} takes no encoder_hidden_states/context "
                                    "argument to pass downsampled keys and values through (ToDo)")
                targets.append(_Target(attr, arg, kind, context))
        self._targets.append(targets)
        self._inputs.append(ArgSpec.of(block, ("hidden_states", "x"), default_index=0))
        self._handles.append(block.register_forward_pre_hook(_Hook(self, "_block_pre", index), with_kwargs=True))
        self._handles.append(block.register_forward_hook(_Hook(self, "_block_post", index), always_call=True))
        for t, target in enumerate(targets):
            sub = getattr(block, target.attr)
            key = index * 4 + t  # block index and target index in one int
            self._handles.append(sub.register_forward_pre_hook(_Hook(self, "_merge_input", key), with_kwargs=True))
            self._handles.append(sub.register_forward_hook(_Hook(self, "_unmerge_output", key)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._targets.clear()
        self._inputs.clear()
        self.state.reset(self.blocks)
        if getattr(self.site.module, PATCH_ATTR, None) is self:
            delattr(self.site.module, PATCH_ATTR)

    # ---- denoiser -----------------------------------------------------------------------------------------
    def _denoiser_pre(self, _, module, args, kwargs):
        sample = self.site.sample.read(args, kwargs)
        state = self.state
        state.reset(self.blocks)  # a call cut short by a KeyboardInterrupt skips the always-called hooks
        state.size = self._grid(module, sample)
        timestep = self.site.timestep.read(args, kwargs) if self.site.timestep is not None else None
        state.step_key = _step_key(timestep, sample.device)
        cfg = self.config
        state.ratio = cfg.ratio
        state.calls += 1
        if not (cfg.scheduled or cfg.reuse_steps > 1):
            return None
        # one host read per denoiser call (not per block): schedules and reuse are host-side control flow
        t = _host_timestep(timestep)
        if cfg.reuse_steps > 1:
            if t is not None and state.last_t is not None and t > state.last_t:
                state.kept.clear()  # the timestep went up: a new generation, nothing to reuse
            state.last_t = t
        if cfg.scheduled:
            if t is None:
                raise TypeError(f"tokenmerge: a start/stop/ratio_end schedule needs the timestep, and "
                                f"{type(module).__name__}.forward got none")
            progress = 1.0 - t * self.site.timestep_scale / cfg.num_train_timesteps
            state.active = cfg.start <= progress <= cfg.stop
            state.ratio = cfg.ratio_at(progress)
        return None

    def _grid(self, module, sample) -> tuple[int, int]:
        """The token grid (height, width) of the finest level, from the latent or (Flux) the image ids."""
        site = self.site
        if site.grid_from_ids:
            if not isinstance(sample, torch.Tensor) or sample.dim() not in (2, 3) or sample.shape[-1] < 3:
                raise TypeError(f"tokenmerge: {type(module).__name__}.forward got no img_ids tensor "
                                f"(tokens, 3) to read the image grid from; got {type(sample).__name__}")
            key = (sample.data_ptr(), tuple(sample.shape), sample.device)
            if self._grid_cache[0] != key:  # one host read per new img_ids (once per generation), not per step
                ids = sample.reshape(-1, sample.shape[-1])[: sample.shape[-2]]
                h, w = (int(v) + 1 for v in (ids[:, 1].max() - ids[:, 1].min(), ids[:, 2].max() - ids[:, 2].min()))
                if h * w != ids.shape[0]:
                    raise RuntimeError(f"tokenmerge: img_ids of {ids.shape[0]} tokens do not form a {h}x{w} grid")
                self._grid_cache = (key, (h, w))
            return self._grid_cache[1]
        if not isinstance(sample, torch.Tensor) or sample.dim() < 3:
            raise TypeError(
                f"tokenmerge: {type(module).__name__}.forward got no image-like '{site.sample.name}' tensor "
                f"(expected (batch, channels, height, width)); got {type(sample).__name__}"
            )
        h, w = int(sample.shape[-2]), int(sample.shape[-1])
        return (h // site.patch, w // site.patch) if site.patch > 1 else (h, w)

    def _denoiser_post(self, _, module, args, output):
        self.state.reset(self.blocks)
        return None

    # ---- blocks -------------------------------------------------------------------------------------------
    def _block_pre(self, index: int, block, args, kwargs):
        if self.timer is not None:
            self.timer.begin("block")
        cfg, site, state = self.config, self.blocks[index], self.state
        if state.size is None:
            raise RuntimeError(
                f"tokenmerge: block {site.path} was called outside its denoiser's forward, so the image size "
                "is unknown; call the denoiser (or remove the patch first)"
            )
        if not state.active:
            return None
        x = self._inputs[index].read(args, kwargs)
        h, w = state.size
        for _ in range(site.level):
            h, w = math.ceil(h / 2), math.ceil(w / 2)
        batch, tokens = x.shape[0], x.shape[1]
        if tokens > h * w and any(t.kind == "joint" for t in self._targets[index]):
            x, tokens = x[:, -h * w:], h * w  # text tokens first, then the image's (older Flux single blocks)
        if tokens != h * w:
            raise RuntimeError(
                f"tokenmerge: block {site.path} (level {site.level}) got {tokens} tokens, but a latent of "
                f"{state.size[0]}x{state.size[1]} gives a {h}x{w} grid at that level"
            )
        if self.site.shared_plan:  # one pattern for the batch: a merged token has one position for all images
            x, batch = x.mean(0, keepdim=True), 1
        plan = self._reused_plan(index, site, batch, tokens)
        if plan is None:
            offsets = None
            # odd batch: no cond/uncond pairs, tomesd turns rand off (a shared plan keeps it)
            if cfg.use_rand and (batch % 2 == 0 or self.site.shared_plan):
                windows = (h // cfg.sy) * (w // cfg.sx)
                salt = self._seed_key ^ ((index * 0xC2B2AE35) & _MASK32)
                offsets = random_offsets(windows, cfg.sx * cfg.sy, _mix32(state.step_key ^ salt), x.device)
            if self.timer is not None:
                self.timer.begin("similarity")
            plan = self.matcher(x, h, w, cfg.sx, cfg.sy, int(tokens * state.ratio), offsets)
            if self.timer is not None:
                self.timer.end("similarity")
            if self.site.shared_plan and plan.num_merged:
                plan = _SharedPlan(plan)
            self._keep_plan(index, site, plan, batch, tokens)
        state.plans[index] = plan
        state.grids[index] = (h, w)
        if cfg.merge_mlp and plan.num_merged and getattr(block, "_chunk_size", None) is not None:
            # diffusers' chunked feed-forward would hand ``ff`` slices of the tokens, which cannot be merged
            # on their own: run ``ff`` whole on the (smaller) merged tokens for this call instead.
            state.unchunked[index] = block._chunk_size
            block._chunk_size = None
        return None

    def _reuse_key(self, index: int, site: BlockSite) -> int:
        return -1 - site.level if self.config.share_plans else index

    def _reused_plan(self, index: int, site: BlockSite, batch: int, tokens: int):
        cfg, state = self.config, self.state
        key = self._reuse_key(index, site)
        for store, fresh in ((state.shared, True), (state.kept, False)):
            entry = store.get(key)
            if entry is not None and entry[1] == batch and entry[2] == tokens:
                if fresh or (state.calls - entry[3] < cfg.reuse_steps and entry[4] == state.ratio):
                    return entry[0]
        return None

    def _keep_plan(self, index: int, site: BlockSite, plan, batch: int, tokens: int) -> None:
        cfg, state = self.config, self.state
        key = self._reuse_key(index, site)
        if cfg.share_plans:
            state.shared[key] = (plan, batch, tokens)
        if cfg.reuse_steps > 1:
            state.kept[key] = (plan, batch, tokens, state.calls, state.ratio)

    def _block_post(self, index: int, block, args, output):
        if self.timer is not None:
            self.timer.end("block")
        self.state.plans.pop(index, None)
        self.state.grids.pop(index, None)
        if index in self.state.unchunked:
            block._chunk_size = self.state.unchunked.pop(index)
        return None

    # ---- sub-modules --------------------------------------------------------------------------------------
    def _merge_input(self, key: int, module, args, kwargs):
        if self.timer is None:
            return self._merge_input_now(key, args, kwargs)
        self.timer.begin("merge")
        out = self._merge_input_now(key, args, kwargs)
        self.timer.end("merge")
        self.timer.begin(self._targets[key // 4][key % 4].kind)
        return out

    def _merge_input_now(self, key: int, args, kwargs):
        plan = self.state.plans.get(key // 4)
        if plan is None:
            return None
        target = self._targets[key // 4][key % 4]
        context = target.context.read(args, kwargs) if target.context is not None else None
        downsample = self.todo and target.kind == "self" and context is None
        if plan.num_merged == 0 and not downsample:
            return None
        if target.kind == "self" and context is None and kwargs.get("attention_mask") is not None:
            raise RuntimeError(
                "tokenmerge: self-attention with an attention_mask over image tokens cannot be merged or "
                "downsampled; apply the patch with merge_attn=False for this model"
            )
        x = target.arg.read(args, kwargs)
        if target.kind == "joint":
            return self._merge_joint(key, plan, target, x, args, kwargs)
        if downsample:  # ToDo: keys and values from the pooled grid of the full (unmerged) tokens
            h, w = self.state.grids[key // 4]
            pooled = self.downsampler(x, h, w, self.config.downsample, self.config.mode)
            args, kwargs = _replace(args, kwargs, target.context, pooled)
        if plan.num_merged:
            args, kwargs = _replace(args, kwargs, target.arg, plan.merge(x))
        return args, kwargs

    def _merge_joint(self, key: int, plan, target: _Target, x: torch.Tensor, args, kwargs):
        """Joint attention: merge the image tokens (after a text prefix, if any) and their rotary positions."""
        prefix = x.shape[1] - plan.num_tokens
        merged = plan.merge(x[:, prefix:])
        self.state.prefixes[key] = prefix
        args, kwargs = _replace(args, kwargs, target.arg, torch.cat([x[:, :prefix], merged], 1) if prefix else merged)
        rotary = kwargs.get("image_rotary_emb")
        if rotary is not None:
            if not isinstance(plan, _SharedPlan):
                raise RuntimeError("tokenmerge: rotary positions need one merge pattern for the batch (shared_plan)")
            # positions cover the text tokens (all of them, whatever is in this call's prefix), then the image's
            text = _rows(rotary) - plan.num_tokens
            keep = torch.cat([torch.arange(text, device=merged.device), text + plan.representatives()])
            kwargs = {**kwargs, "image_rotary_emb": _take_rows(rotary, keep)}
        return args, kwargs

    def _unmerge_output(self, key: int, module, args, output):
        if self.timer is None:
            return self._unmerge_output_now(key, output)
        self.timer.end(self._targets[key // 4][key % 4].kind)
        self.timer.begin("unmerge")
        out = self._unmerge_output_now(key, output)
        self.timer.end("unmerge")
        return out

    def _unmerge_output_now(self, key: int, output):
        plan = self.state.plans.get(key // 4)
        if plan is None or plan.num_merged == 0:
            return None
        target = self._targets[key // 4][key % 4]
        if target.kind == "joint":
            prefix = self.state.prefixes.pop(key, 0)
            if isinstance(output, (tuple, list)):  # (image, text[, ...]): the image part is first
                return type(output)([plan.unmerge(output[0]), *output[1:]])
            if prefix:
                return torch.cat([output[:, :prefix], plan.unmerge(output[:, prefix:])], 1)
        if not isinstance(output, torch.Tensor):
            raise RuntimeError(
                f"tokenmerge: {target.attr} returned a {type(output).__name__}, expected a tensor to unmerge"
            )
        return plan.unmerge(output)


class _SharedPlan:
    """One batch-1 merge pattern applied to every image of the batch (expanded once per batch size)."""

    def __init__(self, plan):
        self.plan = plan
        self.num_tokens, self.num_slots, self.num_merged = plan.num_tokens, plan.num_slots, plan.num_merged
        self._by_batch: dict[int, object] = {}
        self._reps = None

    def _for(self, batch: int):
        plan = self._by_batch.get(batch)
        if plan is None:
            plan = self._by_batch[batch] = self.plan.expand(batch)
        return plan

    def representatives(self) -> torch.Tensor:  # (M,)
        if self._reps is None:
            self._reps = self.plan.representatives()[0]
        return self._reps

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        return self._for(x.shape[0]).merge(x)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        return self._for(x.shape[0]).unmerge(x)


def _rows(rotary) -> int:
    return (rotary[0] if isinstance(rotary, (tuple, list)) else rotary).shape[-2]


def _take_rows(rotary, index: torch.Tensor):
    """Rotary embeddings (a tensor, or a (cos, sin) pair) at the token rows ``index`` (dimension -2)."""
    if isinstance(rotary, (tuple, list)):
        return type(rotary)(r.index_select(-2, index) for r in rotary)
    return rotary.index_select(-2, index)


def _replace(args: tuple, kwargs: dict, spec: ArgSpec, value):
    """The call's arguments with ``spec``'s argument set to ``value`` (where the caller put it)."""
    if spec.name not in kwargs and spec.index is not None and spec.index < len(args):
        return args[: spec.index] + (value,) + tuple(args[spec.index + 1:]), kwargs
    return args, {**kwargs, spec.name: value}


def _host_timestep(timestep) -> float | None:
    if timestep is None:
        return None
    return float(timestep.reshape(-1)[0]) if isinstance(timestep, torch.Tensor) else float(timestep)


def _step_key(timestep, device: torch.device):
    """An integer identifying the denoising step, without reading device memory on the host."""
    if timestep is None:  # no timestep to key on: one fixed pattern, still reproducible
        return 0
    if isinstance(timestep, torch.Tensor):
        t = timestep.reshape(-1)[:1].to(device=device, dtype=torch.float32)
        return (t * 64).round().to(torch.int64) & _MASK32
    return int(round(float(timestep) * 64)) & _MASK32
