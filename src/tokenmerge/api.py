"""The public lifecycle: apply, remove, and a report of what was patched (``scoped.patched``: around a with-block)."""

from __future__ import annotations

import warnings
import weakref

from .config import ReuseConfig, ToDoConfig, ToMeConfig
from .describe import DenoiserInfo, PatchInfo, describe_patch
from .engine import Patch, find_denoisers
from .engine.discover import nothing_matched
from .engine.install import patches_of
from .engine.planner import BlockPlan
from .engine.refusals import check_apply
from .engine.technique import technique_for

__all__ = ["apply_patch", "apply_todo", "apply_reuse", "apply_config", "remove_patch", "describe_patch",
           "new_generation", "observe", "PatchInfo", "DenoiserInfo", "BlockPlan"]


def apply_patch(
    model,
    ratio: float = 0.5,
    max_downsample: int | None = None,
    sx: int = 2,
    sy: int = 2,
    use_rand: bool = True,
    merge_attn: bool = True,
    merge_crossattn: bool = False,
    merge_mlp: bool = False,
    *,
    seed: int | None = None,
    start: float = 0.0,
    stop: float = 1.0,
    ratio_end: float | None = None,
    num_train_timesteps: int = 1000,
    share_plans: bool | None = None,
    plan_steps: int = 1,
    match_radius: int | None = 1,
    blocks=None,
    st: int = 1,
    scope: str = "attention",
    min_size: int | None = None,
    kernels: str = "torch",
    reuse_steps: int | None = None,
):
    """Patch a diffusion model with ToMe (Token Merging for Stable Diffusion), in place.

    Important args:
        model: a diffusers pipeline (every UNet / ControlNet in it is patched), a bare
            ``UNet2DConditionModel`` / ``ControlNetModel`` / ``MultiControlNetModel``, or an LDM-style model
            (``.model.diffusion_model``, ``.diffusion_model``, or the ``UNetModel`` itself).
        ratio: fraction of tokens to merge, in ``[0, 1 - 1/(sx*sy)]`` (0.75 for the default 2x2). Higher is
            faster with more quality loss; 0.5 or less is recommended. 0 is an exact no-op.

    Args to tinker with:
        max_downsample: merge in the levels downsampled at most this much (1, 2, 4, 8 on SD). ``None``
            (default): the highest-resolution level that has attention (1 on SD 1.x/2.x, 2 on SDXL).
            An explicit integer keeps tomesd's meaning, and must match at least one block.
        sx, sy: window in which one destination token is chosen; need not divide the image size.
        st: the window along the frame axis of video models (token grids (frames, height, width)): 1 (default)
            merges each frame within itself; 2 lets a token merge with its neighbours in the next frame too
            (windows (st, sy, sx), ratio up to 1 - 1/(sx*sy*st)). Images: 1.
        use_rand: random destination in each window (off for odd batch sizes, as in tomesd).
        merge_attn: merge for self-attention (recommended).
        merge_crossattn: merge the queries of cross-attention (not recommended).
        merge_mlp: merge for the feed-forward (very not recommended).
        scope: ``"attention"`` (default): merge around the sub-modules the ``merge_*`` flags select.
            ``"block"``: merge once at each block's entry, run the whole block on the merged tokens and add its
            unmerged update to the residual stream (faster on transformers, whose feed-forward and projections
            then shrink too; changes results more). Families that declare it: see the README.
        seed: seed of the random destinations; the pattern depends only on (seed, block, timestep), so it is
            reproducible and the global RNG is untouched. ``None``: a fixed default seed.
        start, stop: merge only in this part of the denoising process, as fractions of it read from the
            timestep (progress = 1 - t / num_train_timesteps: 0 is the first, noisiest step, 1 the end).
        ratio_end: the ratio moves linearly from ``ratio`` at ``start`` to ``ratio_end`` at ``stop``.
        num_train_timesteps: the timestep scale of the model (1000 for SD).
        share_plans: ``True``: one merge plan per level and call, made at its first block and reused by the
            level's other blocks; ``False``: a plan per block, from its own input (as tomesd). ``None`` (default):
            one per level on transformers (as faithful there, and faster on a GPU: a plan costs about 25 small
            kernels), one per block on UNets (as fast there, and 0.7-3.8 dB more faithful on the embedded UNet).
        min_size: merge a call only where its hidden states hold at least this many elements per sample (tokens
            x channels). ``None`` (default): 4096 x 1024 on CUDA, where smaller calls were no faster merged (SD 1.5
            at 512 and SDXL at 1024 on an H200 run unmerged), 0 elsewhere. 0: merge every call.
        plan_steps: keep plans for this many consecutive denoiser calls (1, the default: recompute).
            ``reuse_steps``, its former name, still works (with a ``DeprecationWarning``).
        match_radius: an integer R (default 1): each source token is matched only against the destinations of
            the windows at most R windows away, so the matching's cost grows with the token count instead of its
            square. ``None``: against every destination, as in tomesd (its exact results with ``use_rand=False``;
            on a transformer ``share_plans=False`` too).
        blocks: which of the blocks the level rule selects to patch, by index (negative from the end):
            ``range(0, 28, 2)`` every other block, ``range(4, 20)`` a range. ``None`` (default): all of them.
            For DiT-family transformers (one resolution) this is the way to choose blocks.
        kernels: ``"torch"`` (default) or ``"triton"``: merge, unmerge and the whole-block update each as one
            Triton kernel, eager on CUDA (torch operators under ``torch.compile`` and elsewhere); needs triton.

    Returns:
        ``model``, patched. Applying again replaces the previous patch. Raises ``ValueError`` for bad
        arguments or a level setting that matches no block, ``TypeError`` for an unsupported model; on any
        error the model is left as it was.
    """
    plan_steps = _former(plan_steps, reuse_steps)
    config = ToMeConfig(ratio, max_downsample, sx, sy, use_rand, merge_attn, merge_crossattn, merge_mlp, seed,
                        start=start, stop=stop, ratio_end=ratio_end, num_train_timesteps=num_train_timesteps,
                        share_plans=share_plans, plan_steps=plan_steps, match_radius=match_radius,
                        blocks=blocks, st=st, scope=scope, min_size=min_size, kernels=kernels)
    return apply_config(model, config)


def apply_todo(
    model,
    downsample: int = 2,
    mode: str = "nearest-exact",
    max_downsample: int | None = None,
    *,
    ratio: float = 0.0,
    sx: int = 2,
    sy: int = 2,
    use_rand: bool = True,
    seed: int | None = None,
    start: float = 0.0,
    stop: float = 1.0,
    ratio_end: float | None = None,
    num_train_timesteps: int = 1000,
    share_plans: bool | None = None,
    plan_steps: int = 1,
    match_radius: int | None = 1,
    blocks=None,
    st: int = 1,
    min_size: int | None = None,
    kernels: str = "torch",
    reuse_steps: int | None = None,
):
    """Patch a diffusion model with ToDo (token downsampling, arXiv 2402.13573), in place.

    Self-attention's keys and values are computed from the token grid pooled by ``downsample`` per side;
    queries stay full, so the output keeps every token. Cross-attention is untouched.

    Args:
        model: what ``apply_patch`` accepts.
        downsample: pooling factor per spatial side (2: 4x fewer keys/values; 1 changes nothing), or one factor
            per grid axis: ``(1, 2, 2)`` pools each video frame, ``(2, 2, 2)`` pools frames too.
        mode: "nearest-exact" (the paper's choice), "avg", "bilinear" or (video) "trilinear".
        max_downsample: the levels, as in ``apply_patch`` (``None``: the finest level with attention).
        ratio: also merge the queries with ToMe at this ratio (0: off); ``sx``, ``sy``, ``use_rand`` and
            ``seed``, ``st`` as in ``apply_patch``. Keys and values are pooled from the unmerged tokens.
        start, stop, ratio_end, num_train_timesteps: the schedule, as in ``apply_patch``.
        share_plans, plan_steps, match_radius: reuse and reach of the query merging, as in ``apply_patch``.
        blocks: which blocks, by index, as in ``apply_patch``.
        min_size: the smallest call that is pooled, as in ``apply_patch`` (``None``: 4096 x 1024 on CUDA).
        kernels: the query merging's kernels, as in ``apply_patch``.

    ToDo needs self-attention that takes separate keys/values (UNets, DiT, PixArt); the joint attention of
    SD3 and Flux is refused with a ``ValueError`` that says why.

    Returns:
        ``model``, patched (replacing any earlier tokenmerge patch). ``remove_patch`` removes it.
    """
    plan_steps = _former(plan_steps, reuse_steps)
    config = ToDoConfig(downsample, mode, max_downsample, ratio, sx, sy, use_rand, seed, start=start, stop=stop,
                        ratio_end=ratio_end, num_train_timesteps=num_train_timesteps, share_plans=share_plans,
                        plan_steps=plan_steps, match_radius=match_radius, blocks=blocks, st=st, min_size=min_size,
                        kernels=kernels)
    return apply_config(model, config)


def _former(plan_steps: int, reuse_steps: int | None) -> int:
    """``plan_steps``, or ``reuse_steps`` (its name before docs/glossary.md gave "reuse" to token reuse alone)."""
    if reuse_steps is None:
        return plan_steps
    warnings.warn("tokenmerge: reuse_steps is now plan_steps (docs/glossary.md: 'reuse' names token reuse alone)",
                  DeprecationWarning, stacklevel=3)
    return reuse_steps


def apply_reuse(model, fraction: float = 0.5, *, warmup: int = 4, fraction_end: float | None = None,
                spread: float = 0.3, keys: str = "fresh", text: bool = False, every: int = 0, order: str = "grid",
                seed: int | None = None, blocks=None, extrapolate: float = 0.0):
    """Patch a diffusion transformer with token reuse, in place: after ``warmup`` full steps, each step recomputes
    ``fraction`` of the image tokens in every block and reuses the rest.

    In a partial step, every token still enters each block's attention, so the recomputed tokens attend to fresh
    keys and values of all tokens (their queries alone are attended: the attention itself, its output projection,
    the cross-attention and the feed-forward run on the recomputed tokens only); the other tokens leave the block
    as their input plus their block residual (output minus input) from the step they were last computed in. The
    recomputed tokens move every step, round-robin over the image, so no token is stale for longer than
    ``ceil(1 / fraction)`` steps. Extra memory: one tensor of the block's image output size per patched block (per
    call of a step: twice where guidance runs as two calls). Steps are told apart by the timestep the model is
    called with: a call with the same timestep as the one before is another branch of the same step (guidance run
    as two calls), one with an earlier (noisier) timestep starts a new generation.

    Important args:
        model: a diffusers pipeline or a transformer denoiser of a family whose blocks declare their layout for
            whole-block merging (Flux.1, Wan, PixArt/DiT, HunyuanVideo, LTX-Video, CogVideoX, Qwen-Image...;
            refused with the reason elsewhere).
        fraction: the share of image tokens recomputed at a partial step, in (0, 1]: the speed knob (0.5 about
            1.5x, 0.35 about 1.8x on a transformer whose attention is a large part of its step). 1: an exact no-op.
        warmup: full steps at the start of each generation (at least 1: the first fills the caches). Early steps
            set the layout: 4 of 20 kept the embedded models within 31-36 dB of vanilla.
        fraction_end: the share moves linearly (with the denoising progress read from the timestep) from
            ``fraction`` at the first partial step to this at the end (``None``: constant). Recomputing more
            early and less late (0.55 to 0.15) was more faithful than a constant 0.35 at the same work.

    Args to tinker with:
        spread: give each token that is not recomputed this share of the mean change of the recomputed tokens
            around it (3x3 on the grid, 3x3x3 on video) since they were last computed, added to its kept residual
            (ClusCa's idea: a computed token's change stands for its neighbours'); 0: off. No memory is kept for
            it. The default 0.3 was 0.6-2.2 dB more faithful than 0 on the embedded models.
        keys: ``"fresh"`` (default): every token goes through the block's projections, so the recomputed tokens
            attend to this step's keys and values of all tokens, as described above. ``"kept"``: the whole block
            runs on the recomputed tokens alone (its feed-forward, projections and norms too; rotary rows follow),
            and inside its attention the other tokens' keys and values are the ones kept from their last
            computation: less work per partial step (about ``fraction`` of a full one), 1.5-2.5 dB less faithful
            at the same fraction on the embedded models, and two more stored tensors per attention (keys and
            values of every token). Blocks whose per-token arguments would have to follow are refused with
            ``"kept"`` (``"cached"``, its former name, reads as ``"kept"``).
        text: with ``keys="kept"``, on blocks with a separate text stream (Flux.1 and its kin): recompute the
            same share of the text tokens too (round-robin), the others taking their kept text residual and
            keys and values, as the image tokens do. Flux.1 at 1024 px has 512 text tokens beside 4096 image ones:
            recomputing all of them is a quarter of a partial step's work at ``fraction=0.4``. One more stored
            tensor of the text stream's size per block. A call with an attention mask (Chroma's) recomputes every
            text token. ``False`` (default): every text token is recomputed at every step.
        extrapolate: move each kept residual along its token's last measured change (a first-order step in the
            denoising progress read from the timestep, TaylorSeer's idea per token), times this factor in [0, 1];
            with ``keys="kept"`` the kept keys and values move half as far, and with ``text=True`` the text
            stream's too. A token's change is measured each time it is recomputed (at least two computations: one
            full step and one partial one, or two full steps); 0 (default): kept residuals held as computed. Twice
            the kept memory. On the mosaic testbed (1,024 image tokens) 1 was 2-4 dB more faithful at the same
            work.
        every: after the warm-up, every ``every``-th step is a full one again (0, the default: none).
        order: how the recomputed tokens are chosen: ``"grid"`` (default: the same ranks of every 2x2 window of the
            token grid, frames in pairs on video), ``"strided"`` (every k-th token in raster order), ``"random"`` (a
            seeded random order); each is walked round-robin, so the set moves every step.
        seed: the random order's seed (``None``: a fixed default).
        blocks: which blocks, by index over the denoiser's blocks (``None``: all).

    Returns:
        ``model``, patched (any earlier tokenmerge patch is replaced). ``tokenmerge.remove_patch`` removes it and
        gives back bit-identical outputs. Raises ``ValueError`` for bad arguments or a model whose blocks it cannot
        follow, ``TypeError`` for a model it does not know; on any error the model is left as it was.

    Example:
        >>> tokenmerge.apply_reuse(pipe, fraction=0.35, warmup=4)  # doctest: +SKIP
        >>> image = pipe("a photo of an astronaut").images[0]       # doctest: +SKIP
        >>> tokenmerge.remove_patch(pipe)                            # doctest: +SKIP
    """
    return apply_config(model, ReuseConfig(fraction, warmup, every, order, seed,
                                           tuple(blocks) if blocks is not None else None, fraction_end, spread,
                                           keys, text, extrapolate))


def apply_config(model, config, *, matcher=None, downsampler=None,
                 observer=None, code_paths: str | None = None):
    """Patch ``model`` with any technique, from its ready config (what ``apply_patch``, ``apply_todo``,
    ``apply_reuse``, ``apply_step_cache`` and ``apply_unet_cache`` build from their arguments).

    Args:
        model: what ``apply_patch`` accepts.
        config: a ``ToMeConfig`` (ToMe), ``ToDoConfig`` (ToDo), ``ReuseConfig`` (token reuse), ``StepCacheConfig``
            (the step cache) or ``UNetCacheConfig`` (the UNet cache).
        matcher, downsampler: replace ToMe's matching and ToDo's pooling (the bench's zero-overhead limits;
            see ``tokenmerge.engine.Patch``).
        observer: what ``observe`` takes; ``None`` in normal use.
        code_paths: ``"cpu"`` or ``"cuda"``: run the matching the way that device does, whatever the model's device
            (the kernels a CUDA call launches, counted on a CPU: ``benchmarks/kernels_per_call.py``); ``None``: the
            device's.

    Example:
        >>> tokenmerge.apply_config(pipe, tokenmerge.ToMeConfig(ratio=0.5))  # doctest: +SKIP
    """
    kind = technique_for(config)
    sites = find_denoisers(model)
    levels = kind.levels(config)
    selected = [(site, kind.select(site, config)) for site in sites]
    if not any(blocks for _, blocks in selected):
        raise ValueError(nothing_matched(sites, levels))
    left = {id(site): kind.leave(site, config) for site, blocks in selected if blocks}
    if all(left.values()):  # the technique leaves every denoiser that has blocks: refused, with its reason
        name = next(site.path or type(site.module).__name__ for site, blocks in selected if blocks)
        raise ValueError(f"tokenmerge: {kind.name} cannot patch {name}: {next(iter(left.values()))}")
    for site, blocks in selected:
        name = site.path or type(site.module).__name__
        if not blocks:
            warnings.warn(f"tokenmerge: {name} is left unpatched: " + nothing_matched([site], levels),
                          stacklevel=3)
        elif left[id(site)]:
            warnings.warn(f"tokenmerge: {name} is left unpatched by the {kind.name}: {left[id(site)]}", stacklevel=3)
    selected = [(site, blocks if blocks and not left[id(site)] else []) for site, blocks in selected]
    if code_paths is not None and code_paths not in ("cpu", "cuda"):
        raise ValueError(f"code_paths must be 'cpu', 'cuda' or None (the device's); got {code_paths!r}")
    check_apply(model, config, selected, kind)  # what cannot be right, before anything is installed
    pipeline = weakref.ref(model) if getattr(model, "scheduler", None) is not None else None
    previous = _snapshot(model)
    remove_patch(model)
    installed = []
    try:
        for site, blocks in selected:
            if blocks:
                patch = Patch(site, config, blocks, matcher, downsampler, observer, code_paths, pipeline)
                patch.install()
                installed.append(patch)
    except BaseException:
        for patch in installed:
            patch.remove()
        _restore(previous)
        raise
    return model


def _snapshot(model) -> list:
    return [(p.site, p.config, p.blocks, p.matcher, p.downsampler, p.observer, p.code_paths, p.calls.pipeline)
            for p in patches_of(model)]


def _restore(snapshot: list) -> None:
    for args in snapshot:
        Patch(*args).install()


def remove_patch(model):
    """Remove every tokenmerge patch from ``model`` (a no-op if there is none). Returns ``model``.

    Afterwards the model computes exactly what it computed before it was patched.
    """
    for patch in patches_of(model):
        patch.remove()
    return model


def new_generation(model) -> None:
    """Start a new generation at the next denoiser call of ``model``'s patches: what they keep across the steps of
    a generation (token reuse's residuals and keys, ToMe's ``plan_steps`` plans) is forgotten, and the next call
    is a generation's first step (a full one for token reuse).

    A patched pipeline needs no call: each run of its scheduler's ``set_timesteps`` (every pipeline call) starts a
    generation. Without one, a new generation starts when the timestep goes back towards noise, and a call whose
    grid, batch or dtype no kept state serves computes every token. Call this between generations of a custom
    sampler that calls a patched denoiser directly, e.g. after stopping one early and before another at a lower
    noise level (img2img at a lower strength).

    Example:
        >>> tokenmerge.apply_reuse(transformer, 0.5)  # doctest: +SKIP
        >>> for image in batches:                     # doctest: +SKIP
        ...     tokenmerge.new_generation(transformer)
        ...     my_sampler(transformer, image, strength=0.5)
    """
    for patch in patches_of(model):
        patch.calls.marks += 1


def observe(model, observer) -> None:
    """Give every tokenmerge patch on ``model`` an observer: ``observer.begin(phase)`` / ``observer.end(phase)``
    are called around each phase inside the patched blocks ("block", "similarity", "merge", the target kinds
    "self"/"cross"/"mlp"/"joint", "unmerge"), and, if it has one, ``observer.plan(block_plan)`` when a block gets
    its merge plan at a call (a ``BlockPlan``: the block's path, the plan, its grid, the call's grid, the reference
    tokens after the image's). ``None`` detaches. For profiling (``tokenmerge bench --breakdown``) and inspection:
    an observer that synchronises the device slows every step.

    Example:
        >>> tokenmerge.observe(pipe, my_timer)  # doctest: +SKIP
    """
    for patch in patches_of(model):
        patch.observer = observer

