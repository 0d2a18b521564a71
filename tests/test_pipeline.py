"""Pipelines built from tiny components generate with the patch on, off and on again."""

import pytest
import torch
from tiny_models import make_sd_pipeline

import tokenmerge


def generate(pipe, seed=0, **extra):
    out = pipe("a red cube", num_inference_steps=3, height=32, width=32, output_type="np",
               generator=torch.Generator().manual_seed(seed), guidance_scale=5.0, **extra)
    return torch.from_numpy(out.images)


@pytest.mark.parametrize("controlnet", [False, True])
def test_on_off_on(tmp_path, controlnet):
    pipe = make_sd_pipeline(tmp_path, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    extra = {"image": torch.rand(1, 3, 32, 32)} if controlnet else {}
    vanilla = generate(pipe, **extra)
    tokenmerge.apply_patch(pipe, ratio=0.5)
    info = tokenmerge.describe_patch(pipe)
    assert [d.path for d in info.denoisers] == (["unet", "controlnet"] if controlnet else ["unet"])
    merged = generate(pipe, **extra)
    assert (merged - vanilla).abs().max() > 1e-4
    assert torch.equal(generate(pipe, **extra), merged)  # the same seeded call gives the same image
    tokenmerge.remove_patch(pipe)
    assert torch.equal(generate(pipe, **extra), vanilla)
    tokenmerge.apply_patch(pipe, ratio=0.5)
    assert torch.equal(generate(pipe, **extra), merged)
    tokenmerge.remove_patch(pipe)


def test_patch_does_not_change_the_sampling_noise(tmp_path):
    """A seeded call draws the same latents patched or not (the global RNG is never consumed)."""
    pipe = make_sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    latents = []
    pipe.unet.register_forward_pre_hook(lambda m, a, k: latents.append(k.get("sample", a[0] if a else None).clone()),
                                        with_kwargs=True)
    generate(pipe)
    vanilla_start = latents[0]
    latents.clear()
    tokenmerge.apply_patch(pipe)
    state = torch.get_rng_state()
    generate(pipe)
    assert torch.equal(latents[0], vanilla_start)
    assert torch.equal(state, torch.get_rng_state())
    tokenmerge.remove_patch(pipe)


def test_a_pipeline_with_nothing_to_patch(tmp_path):
    class NotAPipeline:
        components = {"vae": torch.nn.Linear(2, 2)}

    with pytest.raises(TypeError, match="cannot patch a NotAPipeline"):
        tokenmerge.apply_patch(NotAPipeline())


@pytest.mark.parametrize("kind", ["img2img", "inpaint"])
def test_img2img_and_inpaint_pipelines(tmp_path, kind):
    import diffusers

    base = make_sd_pipeline(tmp_path)
    cls = {"img2img": diffusers.StableDiffusionImg2ImgPipeline,
           "inpaint": diffusers.StableDiffusionInpaintPipeline}[kind]
    pipe = cls(**base.components)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    extra = {"image": torch.rand(1, 3, 32, 32, generator=g), "strength": 0.7}
    if kind == "inpaint":
        extra.update(mask_image=(torch.rand(1, 1, 32, 32, generator=g) > 0.5).float(), height=32, width=32)

    def go():
        out = pipe("a red cube", num_inference_steps=4, output_type="np",
                   generator=torch.Generator().manual_seed(1), **extra)
        return torch.from_numpy(out.images)

    vanilla = go()
    with tokenmerge.patched(pipe, ratio=0.5):
        merged = go()
    assert (merged - vanilla).abs().max() > 1e-4
    assert torch.equal(go(), vanilla)


@pytest.mark.processes
def test_import_does_not_import_diffusers():
    import subprocess
    import sys

    code = "import sys, tokenmerge; assert 'diffusers' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
