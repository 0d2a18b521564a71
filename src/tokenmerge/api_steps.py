"""The public calls of the caches across steps: ``apply_step_cache`` (transformers). Each applies its technique's
config through ``api.apply_config`` (install, rollback, removal: the shared lifecycle)."""

from __future__ import annotations

from .api import apply_config
from .engine.techniques import StepCacheConfig

__all__ = ["apply_step_cache"]


def apply_step_cache(model, skip: int = 1, *, warmup: int = 4, skip_growth: int = 0, extrapolate: float = 1.0):
    """Patch a diffusion transformer with the step cache, in place: after ``warmup`` computed steps, steps come in
    rounds of skipped steps and one computed step; a skipped step runs no block of the denoiser's stack.

    For the stack of blocks ``y_k = x_k + r_k``, a skipped step gives ``x_0 + R + extrapolate * S * dt``: ``R`` the
    stack's residual (its last block's output minus its first block's input) at the last computed step, ``S`` its
    change per unit of denoising progress between the last two computed steps, ``dt`` the progress since the last
    computed step (read from the timestep). The denoiser's embeddings and final layers run at every step; what the
    model adds between blocks (ControlNet residuals, VACE hints) is added afresh at every step. Kept memory: two
    tensors of the stack's image-stream size per call of a step (guidance run as two calls keeps two sets), and two
    of a text stream's size where the blocks return one.

    Important args:
        model: a diffusers pipeline or a transformer denoiser (Flux.1, Wan, PixArt, SD3, HunyuanVideo, LTX-Video,
            Qwen-Image...). UNets are refused (their attention blocks sit between convolutions: use ToMe or
            ``tokenmerge.accelerate``); a pipeline's ControlNet is left unpatched (its outputs are read at every
            block) and runs every step.
        skip: the steps skipped in the first round after the warm-up (each round: its skipped steps, then one
            computed step).
        warmup: computed steps at the start of each generation (at least 1: the first fills the cache).

    Args to tinker with:
        skip_growth: each round skips this many more steps than the one before (0, the default: every round
            ``skip``): skipping more as the denoising settles. ``StepCacheConfig(...).schedule(steps)`` lists which
            steps are computed.
        extrapolate: the slope's factor in [0, 1] (1, the default: first order, as TaylorSeer; 0: the residual
            held).

    Steps are told apart by the timestep the model is called with: a call at the same timestep as the one before is
    another call of the same step (guidance run as two calls), one at an earlier (noisier) timestep starts a new
    generation, as does each run of a patched pipeline. torch.compile: compile without ``fullgraph=True`` (whether a
    step is skipped is decided on the host at each call: one graph break); a second generation compiles nothing.

    Returns:
        ``model``, patched (any earlier tokenmerge patch is replaced). ``tokenmerge.remove_patch`` removes it and
        gives back bit-identical outputs. Raises ``ValueError`` for bad arguments or a model whose stack it cannot
        skip, ``TypeError`` for a model it does not know; on any error the model is left as it was.

    Example:
        >>> tokenmerge.apply_step_cache(pipe, skip=1, warmup=4, skip_growth=1)  # doctest: +SKIP
        >>> image = pipe("a photo of an astronaut").images[0]                   # doctest: +SKIP
    """
    return apply_config(model, StepCacheConfig(warmup, skip, skip_growth, extrapolate))
