"""``tokenmerge.accelerate``: one call that picks the faithful setting, on every family of the catalogue.

A UNet gets the UNet cache (ToMe where it cannot be cut: a bare ControlNet), an image or video transformer the step
cache; where the step cache cannot patch a model (a bare transformer ControlNet) it is left unpatched with one
warning. Each case runs a generation long enough to leave the warm-up: the computed steps are the unpatched model's,
the skipped or cached ones are not (the patch acted; a skipped step runs no block), and the settings are the literal
ones the frontiers chose (not read back from the table the code uses). The fidelity of each speed on the trained
testbeds is checked against the PSNR committed when the settings were chosen.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from tiny_denoisers import CATALOGUE, available, schedule_of
from tiny_denoisers import outputs_of as _run
from tiny_models import counting_forwards, later_step, runs_per_call

import tokenmerge
from tokenmerge import StepCacheConfig, ToMeConfig, UNetCacheConfig
from tokenmerge.engine.techniques.presets import SPEEDS
from tokenmerge.families import BUILTIN, match_family
from tokenmerge.families.spec import grid_rank

pytestmark = pytest.mark.usefixtures("fast_cpu")
ENTRIES = sorted({example for f in BUILTIN for example in f.examples} & set(CATALOGUE))
# what accelerate(speed="fast") must pick (the frontiers' points, written out)
BANDS = ((27, 0.02, 0.2), (30, 0.02, 0.3))  # the image transformer's balanced point at 28-30 steps (Flux.1-dev: 28)
FAST_IMAGE = StepCacheConfig(warmup=3, gap=0.02, gap_growth=0.4, extrapolate=0.7, min_steps=9)
FAST_VIDEO = StepCacheConfig(warmup=3, gap=0.02, gap_growth=0.5, extrapolate=0.7, min_steps=9)
FAST_UNET = UNetCacheConfig(warmup=3, skip=1, skip_growth=1, extrapolate=0.7, depth=1, layers=0, min_steps=9)
# UNets the UNet cache takes with whole blocks only (their levels hold temporal layers), and those it cannot cut
WHOLE_BLOCKS = {"unet-3d", "unet-motion", "i2vgen-xl"}
TOME = {"controlnet", "controlnet-union", "sparsectrl", "controlnet-xs"}  # UNet ControlNets (left or refused)
LEFT = ("flux-controlnet", "flux-controlnet-union", "hunyuan-dit-controlnet", "qwen-image-controlnet",
        "sana-controlnet", "sd3-controlnet")  # bare ControlNets: their outputs are read after every block


@pytest.mark.parametrize("name", ENTRIES)
def test_accelerate_acts_on_every_family_or_says_why_not(name):
    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    model = entry.build()
    family = match_family(getattr(model, "_orig_mod", model))
    calls = [entry.inputs(batch=2)]
    try:
        for _ in range(5):
            calls.append(later_step(model, calls[-1]))
    except ValueError:  # a model whose timestep cannot move on in the tiny inputs (Cosmos 1.0): one call
        pass
    vanilla = _run(model, calls)
    with warnings.catch_warnings(record=True) as caught, counting_forwards(model) as count:
        warnings.simplefilter("always")
        tokenmerge.accelerate(model, speed="fast")
        info = tokenmerge.describe_patch(model)
        ran = runs_per_call(model, calls, count) if info is not None and family.kind != "unet" else None
    if name in LEFT:
        said = [str(w.message) for w in caught if "accelerate left" in str(w.message)]
        assert info is None and len(said) == 1 and "ControlNet" in said[0], said
        assert all(torch.equal(a, b) for a, b in zip(_run(model, calls), vanilla))
        return
    assert info is not None and info.notes[0].startswith("accelerate(speed='fast'): "), name
    if family.kind == "unet" and name in TOME:
        assert info.config == ToMeConfig(ratio=0.6), name
        out = _run(model, calls)
        assert any(not torch.equal(a, b) for a, b in zip(out, vanilla)), "ToMe changed nothing"
    elif family.kind == "unet":
        want = dataclasses.replace(FAST_UNET, layers=None) if name in WHOLE_BLOCKS else FAST_UNET
        assert info.config == want, name
        schedule = schedule_of(info.config, model, calls)
        assert not [w for w in caught if "cannot cache" in str(w.message)], [str(w.message) for w in caught]
        out = _run(model, calls)
        for k, (a, b) in enumerate(zip(out, vanilla)):
            if schedule[k]:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"computed step {k}")
            else:
                assert torch.isfinite(a).all() and not torch.allclose(a, b), f"cached step {k} is vanilla's"
        assert not all(schedule[:len(calls)]), name
    else:
        assert info.config == (FAST_VIDEO if grid_rank(family.grid) >= 3 else FAST_IMAGE)
        schedule = schedule_of(info.config, model, calls)
        assert not [w for w in caught if "cannot skip" in str(w.message)], "a block's layout could not be told"
        out = _run(model, calls)
        for k, (a, b) in enumerate(zip(out, vanilla)):
            if schedule[k]:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"computed step {k}")
                assert ran[k] > 0
            else:
                assert torch.isfinite(a).all() and not torch.allclose(a, b), f"skipped step {k} is vanilla's"
                assert ran[k] == 0, f"a block ran at skipped step {k}"
        assert len(calls) < 4 or not all(schedule[:len(calls)])
    tokenmerge.remove_patch(model)
    assert all(torch.equal(a, b) for a, b in zip(_run(model, calls), vanilla))


def test_each_speed_is_the_frontiers_point():
    """The settings written out (docs/guides/step-cache.md and unet-cache.md have where each was measured)."""
    common = dict(warmup=3, extrapolate=0.7, min_steps=9)
    want = {"unet": {"faithful": UNetCacheConfig(gap=0.02, gap_growth=0.1, depth=1, layers=0, **common),
                     "balanced": UNetCacheConfig(gap=0.04, gap_growth=0.1, depth=1, layers=0, **common),
                     "fast": FAST_UNET},
            "flux": {"faithful": StepCacheConfig(gap=0.02, gap_growth=0.1, **common),
                     "balanced": StepCacheConfig(gap=0.02, gap_growth=0.2, by_steps=BANDS, **common),
                     "fast": FAST_IMAGE},
            "wan": {"faithful": StepCacheConfig(gap=0.02, gap_growth=0.1, **common),
                    "balanced": StepCacheConfig(gap=0.02, gap_growth=0.3, **common),
                    "fast": FAST_VIDEO}}
    for name, speeds in want.items():
        if available("unet-sd" if name == "unet" else name) is not None:  # (diffusers 0.27: no Flux.1, no Wan)
            continue
        model = CATALOGUE["unet-sd" if name == "unet" else name].build()
        for speed, config in speeds.items():
            tokenmerge.accelerate(model, speed=speed)
            assert tokenmerge.describe_patch(model).config == config, (name, speed)
        tokenmerge.remove_patch(model)
    with pytest.raises(ValueError, match="speed must be one of faithful, balanced, fast"):
        tokenmerge.accelerate(model, speed="max")


def test_the_method_spec():
    from tokenmerge.tools.methods import parse_spec

    spec = parse_spec("auto,speed=fast")
    assert spec.stateful
    with pytest.raises(ValueError, match="speed= one of"):
        parse_spec("auto,speed=slow")


def test_the_arguments_page_gives_each_speeds_settings():
    """docs/arguments.md's table of accelerate's speeds is what accelerate picks (read through describe_patch on a
    UNet, an image and a video transformer)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "arguments.md").read_text()
    for name in ("flux", "wan"):
        if available(name) is not None:
            pytest.skip(available(name))
    models = {kind: CATALOGUE[name].build() for kind, name in (("unet", "unet-sd"), ("image", "flux"),
                                                                ("video", "wan"))}
    for speed in SPEEDS:
        row = next(line for line in page.splitlines() if line.startswith(f'| `"{speed}"`'))
        cells = [c.strip() for c in row.strip("|").split("|")]
        picked = {}
        for kind, model in models.items():
            tokenmerge.accelerate(model, speed=speed)
            picked[kind] = tokenmerge.describe_patch(model).config
            tokenmerge.remove_patch(model)
        assert cells[1] == _cell(picked["unet"]), row
        assert cells[2] == _cell(picked["image"]), row
        assert cells[3] == _cell(picked["video"]), row


def _cell(config: StepCacheConfig) -> str:
    assert (config.warmup, config.extrapolate) == (3, 0.7), config  # (said once, above the table)
    if config.kind == "rounds":
        return f"`skip={config.skip}, skip_growth={config.skip_growth}`"
    return f"`gap={config.gap:g}, gap_growth={config.gap_growth:g}`" + "".join(
        f" ({span} steps: `gap_growth={r:g}`)" for span, g, r in config.bands())


# the PSNR (dB, to the unpatched model's output) each speed gave on the trained testbeds in a 20-step generation on
# the time grid of the pipeline each stands for when these settings were chosen (seed 2; the first quality prompt, the
# mosaic's first two), and the tolerance
TESTBED_PSNR = {("unet", "faithful"): 35.9, ("unet", "balanced"): 35.7, ("unet", "fast"): 30.0,
                ("mosaic", "faithful"): 34.6, ("mosaic", "balanced"): 34.6, ("mosaic", "fast"): 30.9,
                ("video-long", "faithful"): 37.9, ("video-long", "balanced"): 36.0, ("video-long", "fast"): 32.5}
TOLERANCE_DB = 0.5


@pytest.mark.parametrize("testbed", ["unet", "mosaic", pytest.param("video-long", marks=pytest.mark.slow)])
def test_each_speed_keeps_its_fidelity_on_the_trained_testbeds(testbed):
    """A 20-step generation per speed against the unpatched model's (the same noise), on the testbed's pipeline and
    its time grid (the UNet: DDIM; the mosaic: Flux.1-dev's, shifted; the video: Wan's UniPC): at least the PSNR
    committed when the settings were chosen, less ``TOLERANCE_DB``; faster speeds compute fewer steps, and the
    fastest is the least faithful."""
    from tokenmerge.quality.metrics import psnr
    from tokenmerge.tools.peers import computed_share

    if testbed == "unet":
        from tokenmerge.fashion.pipeline import load_fashion_pipeline as load
    elif testbed == "mosaic":
        from tokenmerge.fashion.mosaic import load_fashion_mosaic as load
    else:
        from tokenmerge.fashion.video_long import load_fashion_video_long as load
    try:
        pipe = load()
    except ImportError as err:  # (the mosaic is a diffusers FluxTransformer2DModel: diffusers >= 0.30)
        pytest.skip(str(err))
    pipe.set_progress_bar_config(disable=True)
    prompts = pipe.prompts(2, seed=0) if testbed == "mosaic" else ["a sneaker"]

    def generate():
        with torch.no_grad():
            return pipe(prompts, num_inference_steps=20, generator=torch.Generator().manual_seed(2),
                        output_type="pt").images

    vanilla = generate()
    got, computed = {}, {}
    for speed in SPEEDS:
        tokenmerge.accelerate(pipe, speed=speed)
        got[speed] = psnr(generate(), vanilla).mean().item()
        computed[speed] = computed_share(pipe)["computed"]
        tokenmerge.remove_patch(pipe)
    for speed, value in got.items():
        assert value >= TESTBED_PSNR[testbed, speed] - TOLERANCE_DB, got
    assert computed["faithful"] > computed["balanced"] > computed["fast"], computed
    assert got["fast"] < min(got["faithful"], got["balanced"]), got


def test_an_ldm_style_unet_gets_tome_with_the_reason():
    """The founding documents' models (CompVis LDM-style UNetModel): the UNet cache cannot cut them, so accelerate
    picks ToMe and describe_patch says why."""
    from tiny_models import ldm_unet

    model = ldm_unet()
    tokenmerge.accelerate(model, speed="balanced")
    info = tokenmerge.describe_patch(model)
    assert info.config == ToMeConfig(ratio=0.5)
    assert "UNet cache cannot patch" in info.notes[0] and "LDM-style" in info.notes[0], info.notes[0]
    tokenmerge.remove_patch(model)


def test_hand_calls_default_to_what_accelerate_picks():
    """apply_step_cache and apply_unet_cache with no schedule argument run accelerate's balanced point for their kind
    of denoiser (written out here); their settings are their configs' fields (one place documents them), and one a
    config does not have is refused naming it."""
    common = dict(warmup=3, extrapolate=0.7, min_steps=9)
    assert StepCacheConfig() == StepCacheConfig(gap=0.02, gap_growth=0.2, by_steps=BANDS, **common)
    assert UNetCacheConfig(layers=0) == UNetCacheConfig(gap=0.04, gap_growth=0.1, depth=1, layers=0, **common)
    for call in (tokenmerge.apply_step_cache, tokenmerge.apply_unet_cache):
        with pytest.raises(TypeError, match=f"{call.__name__}\\(\\) got 'gap_grow': its settings are"):
            call(object(), gap_grow=0.3)
    if available("flux") is None:
        model = CATALOGUE["flux"].build()
        tokenmerge.apply_step_cache(model)
        by_hand = tokenmerge.describe_patch(model).config
        tokenmerge.accelerate(model)
        assert by_hand == tokenmerge.describe_patch(model).config
        tokenmerge.remove_patch(model)
    unet = CATALOGUE["unet-sd"].build()
    tokenmerge.apply_unet_cache(unet, layers=0)
    by_hand = tokenmerge.describe_patch(unet).config
    tokenmerge.accelerate(unet)
    assert by_hand == tokenmerge.describe_patch(unet).config
    tokenmerge.remove_patch(unet)
