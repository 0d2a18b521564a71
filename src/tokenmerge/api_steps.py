"""The public calls of the caches across steps: ``apply_step_cache`` (transformers), ``apply_unet_cache`` (UNets). Each
applies its technique's config through ``api.apply_config`` (install, rollback, removal: the shared lifecycle)."""

from __future__ import annotations

from .api import apply_config
from .engine.techniques import StepCacheConfig, UNetCacheConfig

__all__ = ["apply_step_cache", "apply_unet_cache"]


def apply_step_cache(model, skip: int | None = None, *, warmup: int = 3, gap: float | None = None,
                     gap_growth: float | None = None, skip_growth: int = 0, mask: str | None = None,
                     extrapolate: float = 0.7, min_steps: int = 9):
    """Patch a diffusion transformer with the step cache, in place: after ``warmup`` computed steps, a step is
    computed only once the denoising has moved far enough since the last computed one; a skipped step runs no block
    of the denoiser's stack.

    For the stack of blocks ``y_k = x_k + r_k``, a skipped step gives ``x_0 + R + extrapolate * S * dt``: ``R`` the
    stack's residual (its last block's output minus its first block's input) at the last computed step, ``S`` its
    change per unit of denoising progress between the last two computed steps, ``dt`` the progress since the last
    computed step. The denoiser's embeddings and final layers run at every step; what the model adds between blocks
    (ControlNet residuals, VACE hints) is added afresh at every step. Kept memory: two tensors of the stack's
    image-stream size per call of a step (guidance run as two calls keeps two sets), and two of a text stream's size
    where the blocks return one.

    Important args:
        model: a diffusers pipeline or a transformer denoiser (Flux.1, Wan, PixArt, SD3, HunyuanVideo, LTX-Video,
            Qwen-Image...). UNets are refused (use ``apply_unet_cache`` or ``tokenmerge.accelerate``); a pipeline's
            ControlNet is left unpatched (its outputs are read at every block) and runs every step.
        gap, gap_growth: the schedule (the default, and ``tokenmerge.accelerate``'s): a step is computed once the
            denoising progress (0 at pure noise, 1 at the end, from the scheduler's timestep) since the last computed
            one exceeds ``gap + gap_growth x`` that one's progress. It follows the time grid, whatever the scheduler,
            its shift and the step count (``None``: 0.02 and 0.2, ``accelerate``'s balanced point on image
            transformers).
        warmup: computed steps at the start of each generation (at least 1: the first fills the cache).

    Args to tinker with:
        skip, skip_growth: the schedule counted in steps instead: rounds of ``skip`` skipped steps and a computed
            one, each round ``skip_growth`` longer (right on the time grid they were chosen on only).
        mask: a static schedule instead: a string of ``1`` (computed) and ``0`` (skipped) per step, starting with 1.
        extrapolate: the slope's factor in [0, 1] (0.7, the default; 1: first order, as TaylorSeer; 0: held).
        min_steps: a generation of fewer steps (a distilled model's few, as a pipeline's scheduler tells) skips none.

    ``StepCacheConfig(...).schedule(steps, shift)`` lists the steps computed on Flux's grid; ``describe_patch`` says
    what the last generation computed. Under a pipeline the step and its progress come from the scheduler's host
    state (one read of its timesteps per generation, none per call); a bare model's calls are told apart by their
    timestep (read once per call): one at the same timestep as the one before is another call of the same step
    (guidance run as two calls), one at an earlier (noisier) timestep starts a new generation. torch.compile: the
    blocks compiled in place (``compile_repeated_blocks(fullgraph=True)``), before or after the patch; the whole
    denoiser with ``fullgraph=True`` where the pipeline enters its ``cache_context`` (Flux.1, Wan...; refused with
    the reason elsewhere: compile without it, one graph break); a second generation compiles nothing.

    Returns:
        ``model``, patched (any earlier tokenmerge patch is replaced). ``tokenmerge.remove_patch`` removes it and
        gives back bit-identical outputs. Raises ``ValueError`` for bad arguments or a model whose stack it cannot
        skip, ``TypeError`` for a model it does not know; on any error the model is left as it was.

    Example:
        >>> tokenmerge.apply_step_cache(pipe)                                   # doctest: +SKIP
        >>> image = pipe("a photo of an astronaut").images[0]                   # doctest: +SKIP
    """
    return apply_config(model, StepCacheConfig(warmup=warmup, gap=gap, gap_growth=gap_growth, skip=skip,
                                               skip_growth=skip_growth, mask=mask, extrapolate=extrapolate,
                                               min_steps=min_steps))


def apply_unet_cache(model, skip: int | None = None, *, warmup: int = 3, gap: float | None = None,
                     gap_growth: float | None = None, depth: int = 1, layers: int | None = None,
                     skip_growth: int = 0, mask: str | None = None, extrapolate: float = 0.7, min_steps: int = 9):
    """Patch a UNet with the UNet cache (DeepCache's idea), in place: after ``warmup`` computed steps, a step is
    computed only once the denoising has moved far enough since the last computed one; the others run only the
    UNet's shallow path.

    A cached step runs ``conv_in``, the first ``depth`` down blocks, the last ``depth`` up blocks (with the skip
    connections they own, fresh from this step) and ``conv_out``; the input of the first of those up blocks (the
    output of ``up_blocks[-depth - 1]``) is the one of the last computed step, ``F + extrapolate * S * dt`` (``S`` its
    change per unit of denoising progress between the last two computed steps, ``dt`` the progress since the last
    computed step). With ``layers``, the cut falls inside ``down_blocks[depth - 1]`` (as DeepCache's branch of a
    layer): a cached step runs its first ``layers`` layers and, of ``up_blocks[-depth]``, the layers that read their
    skip connections and the one before's. No deep block or layer runs at a cached step. Kept memory: that feature
    (and its slope with ``extrapolate``) per call of a step; guidance as two calls keeps two.

    Important args:
        model: a diffusers pipeline or UNet of the UNet2DConditionModel kind (SD 1.x/2.x, SDXL and its refiner, the
            video UNets); a pipeline's ControlNet is left unpatched and runs every step: at a cached step the UNet
            adds its residuals to the shallow skip connections as usual, while its deep and mid residuals act only
            through the feature kept from the last computed step. Transformers (use ``apply_step_cache``),
            LDM-style ``UNetModel`` and ControlNet-XS are refused with the reason.
        gap, gap_growth: the schedule, as ``apply_step_cache``'s (``None``: 0.04 and 0.1, ``accelerate``'s balanced
            point on UNets).
        warmup: computed steps at the start of each generation (at least 1: the first fills the cache).
        depth: the down and up blocks a cached step runs at each end of the UNet (1: the finest level only, the
            cheapest cached step; larger: more faithful, slower).
        layers: ``None`` (default): whole blocks; an integer: the layers of ``down_blocks[depth - 1]`` a cached step
            runs (0: none: at depth 1 only ``conv_in``, the last up block's last layer and ``conv_out``), for a
            cheaper cached step where a level has several layers (SD 1.x/2.x and SDXL: 2).

    Args to tinker with:
        skip, skip_growth: rounds counted in steps instead (``warmup=1, skip=N - 1``: DeepCache's uniform
            schedule, a full step every N).
        mask: a static schedule instead: a string of ``1`` (computed) and ``0`` (cached) per step, starting with 1.
        extrapolate: the slope's factor in [0, 1] (0.7, the default; 0: the feature held, as DeepCache).
        min_steps: a generation of fewer steps caches none.

    Steps are told apart as in ``apply_step_cache``. torch.compile: the blocks compiled in place, before or after the
    patch (a cached step runs only the compiled blocks of its shallow path); the whole UNet with ``fullgraph=True``
    where the pipeline enters its ``cache_context`` (Stable Diffusion's do not: compile without it, one graph break
    at the call's start); a second generation compiles nothing.

    Returns:
        ``model``, patched (any earlier tokenmerge patch is replaced). ``tokenmerge.remove_patch`` removes it and
        gives back bit-identical outputs. Raises ``ValueError`` for bad arguments or a model it cannot cut,
        ``TypeError`` for a model it does not know; on any error the model is left as it was.

    Example:
        >>> tokenmerge.apply_unet_cache(pipe)                    # doctest: +SKIP
        >>> image = pipe("a photo of an astronaut").images[0]    # doctest: +SKIP
    """
    return apply_config(model, UNetCacheConfig(warmup=warmup, gap=gap, gap_growth=gap_growth, skip=skip,
                                               skip_growth=skip_growth, mask=mask, extrapolate=extrapolate,
                                               min_steps=min_steps, depth=depth, layers=layers))
