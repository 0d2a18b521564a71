"""tokenmerge.tune: the fastest cache schedule that holds a target on the model (the trained embedded UNet, a
diffusers pipeline of tiny parts), verified on held-out prompts and seeds; its setting file; accelerate(setting=);
the command line. Small budgets and step counts keep each test to seconds."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from tiny_denoisers import CATALOGUE, available

import tokenmerge
from tokenmerge import Tuned, TunedSettingWarning
from tokenmerge.cli import main

PROMPTS = ["a sneaker", "a bag", "a dress", "a coat"]
STEPS = 10


@pytest.fixture(scope="module")
def unet():
    from tokenmerge.fashion import load_fashion_pipeline

    pipe = load_fashion_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def tuned(unet):
    """A tune of the trained UNet at 10 DDIM steps for 34 dB."""
    return tokenmerge.tune(unet, PROMPTS, target_psnr=34, steps=STEPS, budget=16, timing=0)


def _psnr(pipe, prompt: str, seed: int, setting=None, steps: int = STEPS) -> float:
    from tokenmerge.quality.metrics import psnr

    def run():
        with torch.no_grad():
            return pipe(prompt, num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed),
                        output_type="pt").images

    ref = run()
    tokenmerge.accelerate(pipe, setting=setting)
    try:
        return float(psnr(run(), ref)[0])
    finally:
        tokenmerge.remove_patch(pipe)


def test_the_choice_holds_the_target_on_items_the_search_never_saw(tuned, unet):
    """The verification's prompts and seeds are none of the search's; the held-out mean holds the target (or the
    result says it does not); the PSNR of the setting recomputed here, on one held-out item, is the one reported."""
    cal, held = tuned.calibration, tuned.held_out
    assert {p for p, _ in cal["items"]}.isdisjoint({p for p, _ in held["items"]}), (cal["items"], held["items"])
    assert {s for _, s in cal["items"]}.isdisjoint({s for _, s in held["items"]})
    assert held["n"] == len(held["items"]) == len(held["per_item"]) == 2
    assert tuned.holds is (held["mean"] >= 34) and cal["mean"] >= 34, (cal, held)
    prompt, seed = held["items"][0]
    assert _psnr(unet, prompt, seed, tuned) == pytest.approx(held["per_item"][0], abs=0.01)
    assert tuned.generations <= tuned.budget == 16


def test_a_target_is_what_decides_the_computed_steps(unet, tuned):
    """A lower target computes fewer steps than a higher one (the fastest setting is not returned whatever the
    target); every candidate faster than the chosen one fell short on the calibration items, and the cache's own
    count of the chosen setting's computed steps is its mask's."""
    low = tokenmerge.tune(unet, PROMPTS, target_psnr=24, steps=STEPS, budget=12, timing=0)
    assert low.computed < tuned.computed, (low.computed, tuned.computed)
    chosen = next(c for c in tuned.candidates if c["chosen"])
    assert chosen["mask"].count("1") == tuned.computed
    faster = [c for c in tuned.candidates if c["computed"] < tuned.computed and c["calibration"] is not None]
    assert faster and all(c["calibration"] < 34 or c["held_out"] is not None for c in faster), tuned.candidates
    assert tuned.step_speedup == pytest.approx(STEPS / tuned.computed, abs=1e-3)


def test_speed_computes_no_more_steps_than_it_allows(unet):
    """speed=2 at 10 steps: at most 5 computed, by the mask and by the cache's own count in a generation."""
    fast = tokenmerge.tune(unet, PROMPTS, speed=2.0, steps=STEPS, budget=12, timing=0)
    assert fast.computed <= 5 and fast.holds is None and fast.target == {"speed": 2.0}
    tokenmerge.accelerate(unet, setting=fast)
    unet("a bag", num_inference_steps=STEPS, generator=torch.Generator().manual_seed(3))
    ran = tokenmerge.describe_patch(unet).ran
    tokenmerge.remove_patch(unet)
    assert round(ran["computed"] * STEPS) == fast.computed <= 5, ran


def test_the_setting_file_round_trips_and_is_never_written_over(tuned, unet, tmp_path):
    path = tuned.save(tmp_path / "s.json")
    data = json.loads(path.read_text())
    assert data["format"] == "tokenmerge-tuned-setting" and data["version"] == 1
    assert Tuned.load(path) == tuned
    with pytest.raises(FileExistsError):
        tuned.save(path)
    tokenmerge.accelerate(unet, setting=str(path))
    info = tokenmerge.describe_patch(unet)
    tokenmerge.remove_patch(unet)
    assert info.config == tuned.make_config()
    assert "tuned by tokenmerge.tune for target_psnr=34 on UNet2DConditionModel" in info.notes[0], info.notes
    assert "verified on 2 held-out items" in info.notes[0]


def test_damaged_foreign_and_other_models_settings_are_refused(tuned, unet, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not a tuned setting file"):
        tokenmerge.accelerate(unet, setting=bad)
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a tuned setting of tokenmerge"):
        tokenmerge.accelerate(unet, setting=bad)
    data = tuned.to_json()
    bad.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        tokenmerge.accelerate(unet, setting=bad)
    bad.write_text(json.dumps({**data, "config": {**data["config"], "gap": 7}}))
    with pytest.raises(ValueError, match="is damaged"):
        tokenmerge.accelerate(unet, setting=bad)
    if available("unet-sd") is None:  # another UNet (another config): refused, and left unpatched
        other = CATALOGUE["unet-sd"].build()
        with pytest.raises(ValueError, match="tuned for a UNet2DConditionModel and this model's denoiser is "
                                             "UNet2DConditionModel of another config"):
            tokenmerge.accelerate(other, setting=tuned)
        assert tokenmerge.describe_patch(other) is None
    with pytest.raises(TypeError, match="setting must be a tokenmerge.Tuned"):
        tokenmerge.accelerate(unet, setting=3)
    with pytest.raises(ValueError, match="speed or setting, not both"):
        tokenmerge.accelerate(unet, speed="fast", setting=tuned)


def test_a_generation_it_was_not_tuned_for_warns_once_per_cause(tuned, unet):
    """At the tuned step count and scheduler: no warning; at another step count: one TunedSettingWarning, once; with
    another scheduler too: one more, naming it; the generation runs either way."""
    from tokenmerge.fashion.schedulers import swap

    tokenmerge.accelerate(unet, setting=tuned)
    try:
        def generate(steps):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                unet("a coat", num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="pt")
            return [str(w.message) for w in seen if issubclass(w.category, TunedSettingWarning)]

        assert generate(STEPS) == []
        said = generate(STEPS + 3)
        assert len(said) == 1 and f"runs at {STEPS + 3} steps" in said[0] and f"{STEPS} steps" in said[0], said
        assert generate(STEPS + 3) == []  # once per cause
        swap(unet, "dpm++2m")
        said = generate(STEPS)
        assert len(said) == 1 and "the scheduler DPMSolverMultistepScheduler" in said[0], said
    finally:
        swap(unet, "ddim")
        tokenmerge.remove_patch(unet)


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one of target_psnr"),
    (dict(target_psnr=34, speed=2), "exactly one of target_psnr"),
    (dict(target_psnr=math.nan), "target_psnr must be a finite number"),
    (dict(target_psnr=-3), "target_psnr must be a finite number"),
    (dict(target_psnr=True), "target_psnr must be a finite number"),
    (dict(target_psnr="34"), "target_psnr must be a finite number"),
    (dict(speed=1.0), "speed must be a finite number > 1"),
    (dict(speed=0.5), "speed must be a finite number > 1"),
    (dict(target_psnr=34, prompts=[]), "prompts must be a list"),
    (dict(target_psnr=34, prompts="a bag"), "prompts must be a list"),
    (dict(target_psnr=34, prompts=["a bag"]), "needs at least 2 prompts and 2 seeds"),
    (dict(target_psnr=34, seeds=[0]), "needs at least 2 prompts and 2 seeds"),
    (dict(target_psnr=34, seeds=[0, 0]), "needs at least 2 prompts and 2 seeds"),
    (dict(target_psnr=34, steps=6), "steps=6 is fewer than the cache can skip"),
    (dict(target_psnr=34, steps=0), "steps must be an integer >= 1"),
    (dict(target_psnr=34, budget=9), "budget=9 generations cannot"),
    (dict(target_psnr=34, budget=True), "budget must be an integer"),
])
def test_bad_arguments_are_refused_before_any_generation(unet, kwargs, match):
    calls = []
    handle = unet.unet.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            tokenmerge.tune(unet, kwargs.pop("prompts", PROMPTS), **{"steps": STEPS, **kwargs})
    finally:
        handle.remove()
    assert not calls


def test_a_model_no_cache_can_patch_and_a_patched_one_are_refused(unet):
    from tiny_models import ldm_unet

    with pytest.raises(ValueError, match="no cache can patch"):
        tokenmerge.tune(ldm_unet(), PROMPTS, target_psnr=34, steps=STEPS)
    with pytest.raises(TypeError, match="cannot patch a str"):
        tokenmerge.tune("pipe", PROMPTS, target_psnr=34, steps=STEPS)
    tokenmerge.accelerate(unet)
    try:
        with pytest.raises(ValueError, match="remove_patch"):
            tokenmerge.tune(unet, PROMPTS, target_psnr=34, steps=STEPS)
    finally:
        tokenmerge.remove_patch(unet)


def test_a_diffusers_pipeline_without_text_encoder_tunes_on_its_embeddings():
    """Wan 2.1's pipeline of tiny random parts (random weights: the mechanics, not the fidelity): prompts as call
    arguments, the step cache's setting within the speed asked, applied back and counted by the cache."""
    from tiny_pipelines import CASES

    case = CASES["wan-t2v"]
    if case.available() is not None:
        pytest.skip(case.available())
    pipe, kw = case.build()
    embeds = {k: v for k, v in kw.items() if "embeds" in k}
    prompts = [{k: v * (1 + 0.1 * i) for k, v in embeds.items()} for i in range(2)]
    call = {k: v for k, v in kw.items() if k not in embeds and k != "num_inference_steps"}
    out = tokenmerge.tune(pipe, prompts, speed=2.0, steps=10, call_kwargs=call, budget=12, timing=0)
    assert out.technique == "step cache" and out.computed <= 5
    assert out.held_out["items"][0][0].startswith("call arguments: ")
    tokenmerge.accelerate(pipe, setting=out)
    case.generate(pipe, {**kw, "num_inference_steps": 10})
    assert round(tokenmerge.describe_patch(pipe).ran["computed"] * 10) == out.computed
    tokenmerge.remove_patch(pipe)


def test_the_command_tunes_a_pipeline_folder_and_writes_only_its_own_files(tmp_path):
    """tokenmerge tune on a local diffusers pipeline folder (Stable Diffusion of tiny random parts): the report, the
    plot and the setting file in --out, the setting applied by accelerate; a file of the user's in the way stops it
    before any work."""
    from tiny_models import make_sd_pipeline

    folder = tmp_path / "pipe"
    make_sd_pipeline(tmp_path).save_pretrained(folder)
    out = tmp_path / "res"
    out.mkdir()
    (out / "tune.md").write_text("mine")
    args = ["tune", "--model", str(folder), "--steps", "10", "--speed", "2", "--budget", "14", "--timing", "0",
            "--size", "32", "--no-presets", "--no-progress", "--out", str(out), "--seeds", "0", "1"]
    with pytest.raises(SystemExit):
        main(args)
    assert (out / "tune.md").read_text() == "mine"
    (out / "tune.md").unlink()
    assert main(args) == 0
    report = json.loads((out / "tune.json").read_text())
    assert report["tuned"]["computed"] <= 5 and report["tuned"]["generations"] <= 14
    assert {p.name for p in out.iterdir()} == {"tune.md", "tune.json", "tune-plot.png", "tune-setting.json",
                                                ".tokenmerge-outputs.json"}
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    tokenmerge.accelerate(pipe, setting=out / "tune-setting.json")
    assert "tuned by tokenmerge.tune for speed=2" in tokenmerge.describe_patch(pipe).notes[0]


def test_the_command_refuses_both_goals():
    with pytest.raises(SystemExit):
        main(["tune", "--target-psnr", "30", "--speed", "2"])
    with pytest.raises(SystemExit):
        main(["tune"])
