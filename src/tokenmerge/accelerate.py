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
from .engine.techniques.presets import COMMON, SCHEDULES, SPEEDS, TOME_RATIOS, UNET_CUT
from .families.spec import grid_rank

__all__ = ["accelerate", "SPEEDS", "kind_of", "attempts"]


def kind_of(model) -> str:
    """``"unet"``, ``"image"`` or ``"video"``: the kind of the first denoiser ``model`` holds that has blocks."""
    for site in find_denoisers(model):
        if site.blocks:
            if site.family.kind == "unet":
                return "unet"
            return "video" if grid_rank(site.family.grid) >= 3 else "image"
    return "unet"  # (no blocks anywhere: apply_patch's own error says so)


def attempts(kind: str, speed: str) -> list[tuple]:
    """The settings to try, the first that the model takes wins: ``(config, why)`` (``presets.py``'s numbers)."""
    setting, least = SCHEDULES[kind][speed], COMMON["min_steps"]
    if kind == "unet":
        ratio = TOME_RATIOS[speed]
        return [(UNetCacheConfig(**setting, **COMMON, **UNET_CUT),
                 f"a UNet: the UNet cache at the UNet frontier's {speed} point ({_setting(setting)}; a cached step "
                 f"runs the shallow path only: conv_in, the last up block's last layer, conv_out; a generation of "
                 f"fewer than {least} steps caches none)"),
                (UNetCacheConfig(**setting, **COMMON, depth=1),
                 f"a UNet whose levels the UNet cache cannot cut inside (a video UNet's temporal layers): the UNet "
                 f"cache at the UNet frontier's {speed} point ({_setting(setting)}) with whole blocks: a cached step "
                 f"runs conv_in, the first down and last up block, conv_out"),
                (ToMeConfig(ratio=ratio), f"a UNet the UNet cache cannot cut: ToMe at ratio {ratio:g} (faithful on "
                                          "UNets: they merge at their finest level only; on CUDA, calls too small "
                                          "to pay run unmerged)")]
    return [(StepCacheConfig(**setting, **COMMON),
             f"{'an' if kind == 'image' else 'a'} {kind} transformer: the step cache at the {kind} frontier's "
             f"{speed} point ({_setting(setting)}; a generation of fewer than {least} steps skips none)")]


def _setting(base: dict) -> str:
    """A preset's settings in words: ``a step computed once the progress since the last computed one passes 0.02 +
    0.2 x its progress (28-30 steps: 0.02 + 0.3 x), warmup 3, the slope at 0.7``."""
    schedule = (f"rounds of {base['skip']} cached step and a computed one, each round {base['skip_growth']} longer"
                if "skip" in base else f"a step computed once the denoising progress since the last computed one "
                f"passes {base['gap']:g} + {base['gap_growth']:g} x its progress" + "".join(
                    f" ({span} steps: {g:g} + {r:g} x)" for span, g, r in StepCacheConfig(**base).bands()))
    return f"{schedule}, warmup {COMMON['warmup']}, the slope at {COMMON['extrapolate']:g}"


def accelerate(model, speed: str | None = None, *, setting=None):
    """Make ``model`` generate faster with the faithful setting for it, in place: the UNet cache on a UNet (ToMe
    where the UNet cache cannot cut it), the step cache on an image or video transformer, at the settings the
    frontiers chose, or a setting ``tokenmerge.tune`` measured on this model; ``describe_patch(model)`` says which
    and why.

    Args:
        model: what ``apply_patch`` accepts (a diffusers pipeline, a bare denoiser, an LDM-style model).
        speed: ``"faithful"``, ``"balanced"`` (default) or ``"fast"``: the one knob, from closest to the unpatched
            outputs to fastest (docs/guides/step-cache.md has each point's speed and fidelity). The image
            transformer's balanced point follows the step count (a generation of at most 30 steps skips more).
        setting: instead of ``speed``, a tuned setting (``tokenmerge.tune``'s ``Tuned``, or the path of its file):
            refused with a ``ValueError`` on another model than it was tuned for; a generation at another step
            count, scheduler, shift or size than tuned for runs with one ``TunedSettingWarning``.

    Returns:
        ``model``: patched, or left as it was where no faithful setting applies to its blocks (one
        ``RuntimeWarning`` says why). ``remove_patch`` undoes it; ``apply_patch`` keeps tomesd's meaning.

    Example:
        >>> tokenmerge.accelerate(pipe)  # doctest: +SKIP
        >>> tokenmerge.accelerate(pipe, setting="tuned/flux-28.json")  # doctest: +SKIP
        >>> print(tokenmerge.describe_patch(pipe))  # doctest: +SKIP
    """
    if setting is not None:
        if speed is not None:
            raise ValueError(f"give speed or setting, not both: a tuned setting is its own speed; got speed={speed!r}")
        return _apply_tuned(model, setting)
    speed = "balanced" if speed is None else speed
    if speed not in SPEEDS:
        raise ValueError(f"speed must be one of {', '.join(SPEEDS)}; got {speed!r}")
    kind = kind_of(model)
    refusals = []
    for config, why in attempts(kind, speed):
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


def _apply_tuned(model, setting):
    """``accelerate(model, setting=...)``: the tuned setting checked against the model, applied, and told what
    generation it was tuned for (``engine/tuned_for.py``)."""
    import os

    from .tuning.tuned import Tuned

    if isinstance(setting, (str, os.PathLike)):
        tuned = Tuned.load(setting)
    elif isinstance(setting, dict):
        tuned = Tuned.from_json(setting)
    elif isinstance(setting, Tuned):
        tuned = setting
    else:
        raise TypeError(f"setting must be a tokenmerge.Tuned, a dict of one or the path of its file; got a "
                        f"{type(setting).__name__}")
    site = next((s for s in find_denoisers(model) if s.blocks), None)
    if site is None:
        raise ValueError(f"setting: {type(model).__name__} holds no denoiser with blocks to apply it to")
    tuned.check_model(site)
    apply_config(model, tuned.make_config())
    for patch in patches_of(model):
        patch.chosen = f"accelerate(setting=...): {tuned.words()}"
        patch.tuned_for = tuned.expects()
    return model
