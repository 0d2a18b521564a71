"""One call that picks the faithful setting for what a user holds: ``tokenmerge.accelerate(pipe)``.

Per kind of denoiser it takes the setting the committed frontiers chose (speed measured by the bench, fidelity on the
trained embedded models: ``docs/guides/reuse.md``, ``benchmarks/results/frontier/``): a UNet gets ToMe (faithful
there, and its usual sizes left unmerged on CUDA by ``min_size``); a transformer token reuse's step cache (full steps
in rounds that skip more steps as the denoising settles, each skipped step carrying every token's kept block
residual along its slope; keys cached, extrapolated). On an image transformer (text too where the blocks have a
text stream) ``speed="faithful"`` is >= 36 dB on both image testbeds (the 1,024-token mosaic and the 256-token DiT),
``"balanced"`` the fastest point at >= 32 dB on both, ``"fast"`` the fastest at >= 30 dB; on a video transformer
the same on the 2,048- and 512-token videos. Where token reuse cannot follow a model's blocks, the model is left
unpatched with one warning saying why (merging every step is not faithful on a transformer). ``describe_patch``
says what was chosen and why.
"""

from __future__ import annotations

import warnings

from .api import apply_config
from .config import ReuseConfig, ToMeConfig
from .engine import find_denoisers
from .engine.install import patches_of
from .families.spec import grid_rank

__all__ = ["accelerate", "SPEEDS"]

SPEEDS = ("faithful", "balanced", "fast")
# the frontiers' points (docs/guides/reuse.md has their speed and PSNR): per kind and speed
_UNET = {"faithful": 0.3, "balanced": 0.5, "fast": 0.6}  # ToMe's ratio on the UNets' finest level
# token reuse's step cache (a skipped step carries every kept residual along its slope), keys="cached",
# extrapolate=1 (on an image transformer text=True where the blocks have a text stream)
_IMAGE = {"faithful": dict(fraction=1.0, warmup=4, skip=1),
          "balanced": dict(fraction=1.0, warmup=4, skip=1, skip_growth=1),
          "fast": dict(fraction=1.0, warmup=3, skip=1, skip_growth=1)}
_VIDEO = {"faithful": dict(fraction=1.0, warmup=4, skip=1, skip_growth=1),
          "balanced": dict(fraction=1.0, warmup=3, skip=1, skip_growth=1),
          "fast": dict(fraction=1.0, warmup=3, skip=2, skip_growth=1)}


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
        ratio = _UNET[speed]
        return [(ToMeConfig(ratio=ratio), f"a UNet: ToMe at ratio {ratio:g} (faithful on UNets: they merge at their "
                                          "finest level only; on CUDA, calls too small to pay run unmerged)")]
    if kind == "image":
        base = {**_IMAGE[speed], "keys": "cached", "extrapolate": 1.0}
        why = f"an image transformer: token reuse at the image frontier's {speed} point ({_setting(base)}, extrapolated"
        return [(ReuseConfig(**base, text=True), why + ", text too)"),
                (ReuseConfig(**base), why + "; its blocks have no separate text stream)")]
    base = {**_VIDEO[speed], "keys": "cached", "extrapolate": 1.0}
    why = f"a video transformer: token reuse at the video frontier's {speed} point ({_setting(base)}, extrapolated"
    return [(ReuseConfig(**base), why + ")"),
            (ReuseConfig(**{**base, "keys": "fresh"}), why + "; keys fresh: its blocks cannot run on some tokens' "
                                                              "rows)")]


def _setting(base: dict) -> str:
    """A preset's settings in words: ``warmup 4, 3 skipped steps a round, keys cached``."""
    words = [] if base["fraction"] == 1.0 else [f"fraction {base['fraction']:g}" + (
        f" to {base['fraction_end']:g}" if "fraction_end" in base else "")]
    words.append(f"warmup {base['warmup']}")
    words += [f"skipping {base['skip']} steps a round"] if base.get("skip") else []
    words += [f"{base['skip_growth']} more each round"] if base.get("skip_growth") else []
    return ", ".join(words + [f"keys {base['keys']}"] * ("keys" in base))


def accelerate(model, speed: str = "balanced"):
    """Make ``model`` generate faster with the faithful setting for it, in place: ToMe on a UNet, token reuse on an
    image or video transformer, at the settings the frontiers chose; ``describe_patch(model)`` says which and why.

    Args:
        model: what ``apply_patch`` accepts (a diffusers pipeline, a bare denoiser, an LDM-style model).
        speed: ``"faithful"``, ``"balanced"`` (default) or ``"fast"``: the one knob, from closest to the unpatched
            outputs to fastest (docs/guides/reuse.md has each point's speed and fidelity).

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
        except ValueError as err:  # this setting cannot follow the model's blocks: the next one, if any
            refusals.append(str(err))
            continue
        for patch in patches_of(model):
            patch.chosen = f"accelerate(speed={speed!r}): {why}"
        return model
    warnings.warn(f"tokenmerge.accelerate left {type(model).__name__} unpatched: {refusals[-1]} (merging tokens at "
                  "every step is not faithful on a transformer; apply_patch(..., scope='block') is the fast, "
                  "unfaithful choice)", RuntimeWarning, stacklevel=2)
    return model
