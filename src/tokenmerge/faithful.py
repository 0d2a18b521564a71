"""One call that picks the faithful setting for what a user holds: ``tokenmerge.accelerate(pipe)``.

Per kind of denoiser it takes the setting the committed frontiers chose (speed measured by the bench, fidelity on the
trained embedded models: ``docs/guides/step-cache.md``, ``docs/guides/unet-cache.md``, ``benchmarks/results/
frontier/``): a UNet gets the UNet cache (cached steps run its shallow path only, the deep path's output taken from
the last computed step, moved along its slope); a UNet the UNet cache cannot cut (an LDM-style ``UNetModel``,
ControlNet-XS) gets ToMe; a transformer the step cache (a skipped step runs no block, the stack's kept residual moved
along its slope). Both compute a step once the denoising has moved far enough since the last computed one, so a
preset holds on the time grids real pipelines run (a flow shift, another scheduler, another step count). ``speed=
"faithful"`` keeps the most fidelity, ``"fast"`` the most speed, ``"balanced"`` between (the selection seeds' figures
per testbed and grid: ``benchmarks/results/frontier/select/README.md``; the held-out seeds' in the guides). A
generation of fewer than 9 steps (a distilled model's) caches none. Where no technique can patch a model, it is left
unpatched with one warning saying why (merging every step is not faithful on a transformer). ``describe_patch`` says
what was chosen and why.
"""

from __future__ import annotations

import warnings

from .api import apply_config
from .config import ToMeConfig
from .engine import find_denoisers
from .engine.install import patches_of
from .engine.techniques import StepCacheConfig, UNetCacheConfig
from .families.spec import grid_rank

__all__ = ["accelerate", "SPEEDS"]

SPEEDS = ("faithful", "balanced", "fast")
# the presets, per kind of denoiser and speed (docs/guides/step-cache.md and unet-cache.md have each point's speed and
# PSNR): the gap schedule (schedule.py: a step computed once the denoising progress since the last computed one passes
# gap + gap_growth x its progress, so the same points hold on a shifted time grid and at any step count), warmup 3,
# the kept residual or feature moved along its slope at 0.7. Chosen on seeds 0-1 of the trained testbeds on the time
# grids of the pipelines they stand for (benchmarks/results/frontier/select/README.md): the image transformer on
# Flux.1-dev's (28 and 50 steps, shift e^1.15) and the linear grid, the video transformer on Wan 2.1's UniPC (50
# steps, shifts 3, 5, 7), the UNet under DDIM and DPM-Solver++ 2M (25 and 50 steps).
_UNET = {"faithful": dict(gap=0.02, gap_growth=0.1), "balanced": dict(gap=0.04, gap_growth=0.1),
         "fast": dict(skip=1, skip_growth=1)}  # (rounds: a UNet's solvers step uniformly in the timestep)
_UNET_CUT = dict(depth=1, layers=0)  # a cached step runs conv_in, the last up block's last layer and conv_out
_TOME = {"faithful": 0.3, "balanced": 0.5, "fast": 0.6}  # ToMe's ratio on a UNet the UNet cache cannot cut
_IMAGE = {"faithful": dict(gap=0.02, gap_growth=0.1), "balanced": dict(gap=0.02, gap_growth=0.2),
          "fast": dict(gap=0.02, gap_growth=0.4)}
_VIDEO = {"faithful": dict(gap=0.02, gap_growth=0.1), "balanced": dict(gap=0.02, gap_growth=0.3),
          "fast": dict(gap=0.02, gap_growth=0.5)}
_COMMON = dict(warmup=3, extrapolate=0.7, min_steps=9)  # a generation of fewer than 9 steps (a distilled model's)
# caches none


def _kind(model) -> str:
    """``"unet"``, ``"image"`` or ``"video"``: the kind of the first denoiser ``model`` holds that has blocks."""
    for site in find_denoisers(model):
        if site.blocks:
            if site.family.kind == "unet":
                return "unet"
            return "video" if grid_rank(site.family.grid) >= 3 else "image"
    return "unet"  # (no blocks anywhere: apply_patch's own error says so)


def _attempts(kind: str, speed: str) -> list[tuple]:
    """The settings to try, the first that the model takes wins: ``(config, why)``."""
    if kind == "unet":
        setting, ratio = _UNET[speed], _TOME[speed]
        return [(UNetCacheConfig(**setting, **_COMMON, **_UNET_CUT),
                 f"a UNet: the UNet cache at the UNet frontier's {speed} point ({_setting(setting)}; a cached step "
                 f"runs the shallow path only: conv_in, the last up block's last layer, conv_out; a generation of "
                 f"fewer than {_COMMON['min_steps']} steps caches none)"),
                (UNetCacheConfig(**setting, **_COMMON, depth=1),
                 f"a UNet whose levels the UNet cache cannot cut inside (a video UNet's temporal layers): the UNet "
                 f"cache at the UNet frontier's {speed} point ({_setting(setting)}) with whole blocks: a cached step "
                 f"runs conv_in, the first down and last up block, conv_out"),
                (ToMeConfig(ratio=ratio), f"a UNet the UNet cache cannot cut: ToMe at ratio {ratio:g} (faithful on "
                                          "UNets: they merge at their finest level only; on CUDA, calls too small "
                                          "to pay run unmerged)")]
    setting = (_IMAGE if kind == "image" else _VIDEO)[speed]
    return [(StepCacheConfig(**setting, **_COMMON),
             f"{'an' if kind == 'image' else 'a'} {kind} transformer: the step cache at the {kind} frontier's "
             f"{speed} point ({_setting(setting)}; a generation of fewer than {_COMMON['min_steps']} steps skips "
             "none)")]


def _setting(base: dict) -> str:
    """A preset's settings in words: ``a step computed once the progress since the last computed one passes 0.02 +
    0.2 x its progress, warmup 3, the slope at 0.7``."""
    schedule = (f"rounds of {base['skip']} cached step and a computed one, each round {base['skip_growth']} longer"
                if "skip" in base else f"a step computed once the denoising progress since the last computed one "
                f"passes {base['gap']:g} + {base['gap_growth']:g} x its progress")
    return f"{schedule}, warmup {_COMMON['warmup']}, the slope at {_COMMON['extrapolate']:g}"


def accelerate(model, speed: str = "balanced"):
    """Make ``model`` generate faster with the faithful setting for it, in place: the UNet cache on a UNet (ToMe
    where the UNet cache cannot cut it), the step cache on an image or video transformer, at the settings the
    frontiers chose; ``describe_patch(model)`` says which and why.

    Args:
        model: what ``apply_patch`` accepts (a diffusers pipeline, a bare denoiser, an LDM-style model).
        speed: ``"faithful"``, ``"balanced"`` (default) or ``"fast"``: the one knob, from closest to the unpatched
            outputs to fastest (docs/guides/step-cache.md has each point's speed and fidelity).

    Returns:
        ``model``: patched, or left as it was where no faithful setting applies to its blocks (one
        ``RuntimeWarning`` says why). ``remove_patch`` undoes it; ``apply_patch`` keeps tomesd's meaning.

    Example:
        >>> tokenmerge.accelerate(pipe)  # doctest: +SKIP
        >>> print(tokenmerge.describe_patch(pipe))  # doctest: +SKIP
    """
    if speed not in SPEEDS:
        raise ValueError(f"speed must be one of {', '.join(SPEEDS)}; got {speed!r}")
    kind = _kind(model)
    refusals = []
    for config, why in _attempts(kind, speed):
        try:
            apply_config(model, config)
        except (ValueError, TypeError) as err:  # this setting cannot follow the model: the next one, if any
            refusals.append(str(err))
            continue
        because = f" ({refusals[-1]})" if refusals else ""  # why the earlier setting was not taken
        for patch in patches_of(model):
            patch.chosen = f"accelerate(speed={speed!r}): {why}{because}"
        return model
    warnings.warn(f"tokenmerge.accelerate left {type(model).__name__} unpatched: {refusals[-1]} (merging tokens at "
                  "every step is not faithful on a transformer; apply_patch(..., scope='block') is the fast, "
                  "unfaithful choice)", RuntimeWarning, stacklevel=2)
    return model
