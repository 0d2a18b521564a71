"""The public calls of the caches across steps: ``apply_step_cache`` (transformers), ``apply_unet_cache`` (UNets). Each
applies its technique's config through ``api.apply_config`` (install, rollback, removal: the shared lifecycle)."""

from __future__ import annotations

import dataclasses

from .api import apply_config
from .engine.techniques import StepCacheConfig, UNetCacheConfig

__all__ = ["apply_step_cache", "apply_unet_cache"]


def _config(kind, skip, fields: dict, call: str):
    """``kind(skip=skip, **fields)``, or a ``TypeError`` naming the argument ``call`` does not take."""
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"{call}() got {', '.join(repr(n) for n in unknown)}: its settings are {kind.__name__}'s "
                        f"fields ({', '.join(sorted(names))})")
    return kind(skip=skip, **fields)


def apply_step_cache(model, skip: int | None = None, **fields):
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

    Args:
        model: a diffusers pipeline or a transformer denoiser (Flux.1, Wan, PixArt, SD3, HunyuanVideo, LTX-Video,
            Qwen-Image...). UNets are refused (use ``apply_unet_cache`` or ``tokenmerge.accelerate``); a pipeline's
            ControlNet is left unpatched (its outputs are read at every block) and runs every step.
        skip, **fields: ``StepCacheConfig``'s fields, documented there (the schedule: ``gap`` and ``gap_growth``,
            the default, or ``skip`` rounds, or a ``mask``; ``warmup``, ``extrapolate``, ``min_steps``,
            ``by_steps``). With no schedule given: ``accelerate``'s balanced point on image transformers.

    ``StepCacheConfig(...).schedule(steps, shift)`` lists the steps computed on Flux's grid; ``describe_patch`` says
    what the last generation computed. Under a pipeline the step and its progress come from what it passes to the
    denoiser's ``cache_context`` (Wan's) or its scheduler's host state (one read of its timesteps per generation,
    none per call); a bare model's calls are told apart by their timestep (read once per call): one at the same
    timestep as the one before is another call of the same step (guidance run as two calls), one at an earlier
    (noisier) timestep starts a new generation. torch.compile: the blocks compiled in place
    (``compile_repeated_blocks(fullgraph=True)``), before or after the patch; the whole denoiser with
    ``fullgraph=True`` where the pipeline enters its ``cache_context`` (Flux.1, Wan...; refused with the reason
    elsewhere: compile without it, one graph break); a second generation compiles nothing.

    Returns:
        ``model``, patched (any earlier tokenmerge patch is replaced). ``tokenmerge.remove_patch`` removes it and
        gives back bit-identical outputs. Raises ``ValueError`` for bad settings or a model whose stack it cannot
        skip, ``TypeError`` for a model it does not know or a setting it does not take; on any error the model is
        left as it was.

    Example:
        >>> tokenmerge.apply_step_cache(pipe)                                   # doctest: +SKIP
        >>> tokenmerge.apply_step_cache(pipe, gap_growth=0.3, warmup=4)          # doctest: +SKIP
    """
    return apply_config(model, _config(StepCacheConfig, skip, fields, "apply_step_cache"))


def apply_unet_cache(model, skip: int | None = None, **fields):
    """Patch a UNet with the UNet cache (DeepCache's idea), in place: after ``warmup`` computed steps, a step is
    computed only once the denoising has moved far enough since the last computed one; the others run only the
    UNet's shallow path.

    A cached step runs ``conv_in``, the first ``depth`` down blocks, the last ``depth`` up blocks (with the skip
    connections they own, fresh from this step) and ``conv_out``; the input of the first of those up blocks (the
    output of ``up_blocks[-depth - 1]``) is the one of the last computed step, ``F + extrapolate * S * dt`` (``S`` its
    change per unit of denoising progress between the last two computed steps, ``dt`` the progress since the last
    computed step). With ``layers``, the cut falls inside ``down_blocks[depth - 1]`` (as DeepCache's branch of a
    layer). No deep block or layer runs at a cached step. Kept memory: that feature (and its slope with
    ``extrapolate``) per call of a step; guidance as two calls keeps two.

    Args:
        model: a diffusers pipeline or UNet of the UNet2DConditionModel kind (SD 1.x/2.x, SDXL and its refiner, the
            video UNets); a pipeline's ControlNet is left unpatched and runs every step: at a cached step the UNet
            adds its residuals to the shallow skip connections as usual, while its deep and mid residuals act only
            through the feature kept from the last computed step. Transformers (use ``apply_step_cache``),
            LDM-style ``UNetModel`` and ControlNet-XS are refused with the reason.
        skip, **fields: ``UNetCacheConfig``'s fields, documented there (the step cache's schedule fields, and
            ``depth``, ``layers``: where the cut falls). ``warmup=1, skip=N - 1``: DeepCache's uniform schedule.
            With no schedule given: ``accelerate``'s balanced point on UNets.

    Steps are told apart as in ``apply_step_cache``. torch.compile: the blocks compiled in place, before or after the
    patch (a cached step runs only the compiled blocks of its shallow path); the whole UNet with ``fullgraph=True``
    where the pipeline enters its ``cache_context`` (Stable Diffusion's do not: compile without it, one graph break
    at the call's start); a second generation compiles nothing.

    Returns:
        ``model``, patched (any earlier tokenmerge patch is replaced). ``tokenmerge.remove_patch`` removes it and
        gives back bit-identical outputs. Raises ``ValueError`` for bad settings or a model it cannot cut,
        ``TypeError`` for a model it does not know or a setting it does not take; on any error the model is left as
        it was.

    Example:
        >>> tokenmerge.apply_unet_cache(pipe)                    # doctest: +SKIP
        >>> tokenmerge.apply_unet_cache(pipe, layers=0)          # doctest: +SKIP
    """
    return apply_config(model, _config(UNetCacheConfig, skip, fields, "apply_unet_cache"))
