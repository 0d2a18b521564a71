"""Whole generations (``tokenmerge bench --steps N``): a denoising loop with a real scheduler and guidance, and
the VAE decode (images; a video preset's loop is timed without its decode, the same for every mode), timed per
mode, interleaved."""

from __future__ import annotations

import torch

from ..measure import timed
from ..tools.methods import MethodSpec
from ..tools.peers import computed_share
from .cell import Cell, step
from .presets import Preset, load_pipeline

__all__ = ["GENERATION_FAMILIES", "Loop", "scheduler_for", "vae_for", "generate", "time_generation"]

# the preset families whose denoising loop (and VAE) ``generate`` knows
GENERATION_FAMILIES = ("unet", "pixart", "sd3", "flux", "wan")


def vae_for(preset: Preset, dtype, device):
    """The preset's VAE: the pipeline's own for --model, else the SD/SD3/Flux VAE architecture, random weights;
    ``None`` for a video preset (its loop is timed without the decode)."""
    if preset.video:
        return None
    if preset.model is not None:
        return load_pipeline(preset.model, dtype).vae.to(device).eval()
    from diffusers import AutoencoderKL

    channels = preset.latent_channels
    torch.manual_seed(0)
    if preset.name.startswith("tiny"):
        return AutoencoderKL(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=channels,
                             norm_num_groups=32).to(device, dtype).eval()
    return AutoencoderKL(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2,
                         latent_channels=channels).to(device, dtype).eval()


class Loop:
    """What a pipeline holds for the patch (its scheduler, its denoiser as ``unet`` or ``transformer``): methods are
    applied to it, so the caches tell the steps from the scheduler's host state, as under a real pipeline."""

    def __init__(self, model, scheduler, preset: Preset):
        self.scheduler = scheduler
        setattr(self, "unet" if preset.family == "unet" else "transformer", model)


def scheduler_for(preset: Preset, inputs: dict | list):
    """The scheduler of the pipeline the preset stands for: Flux.1's flow-matching Euler with its resolution's
    dynamic shift (mu from the image tokens: 1.15 at 4,096), SD3's shift 3, Wan 2.1's UniPC on flow sigmas (shift
    3 at 480p, 5 at 720p and above), DDIM for UNets and PixArt."""
    import math

    import diffusers

    first = inputs[0] if isinstance(inputs, list) else inputs
    if preset.family == "flux":
        tokens = first["hidden_states"].shape[1]
        mu = 0.5 + (1.15 - 0.5) * (tokens - 256) / (4096 - 256)
        return diffusers.FlowMatchEulerDiscreteScheduler(shift=math.exp(mu))
    if preset.family == "sd3":
        return diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    if preset.family == "wan":
        height = first["hidden_states"].shape[-2] * 8  # latent rows -> pixels (Wan's VAE: 8x spatially)
        return diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                 flow_shift=3.0 if height < 720 else 5.0)
    return diffusers.DDIMScheduler()


@torch.no_grad()
def generate(loop: Loop, vae, preset: Preset, inputs: dict, steps: int, guidance: float = 7.5):
    """A text-to-image denoising loop of ``steps`` steps and the VAE decode, as a pipeline runs them, on the
    bench's inputs (prompt embeddings given: the text encoder's few milliseconds are left out), with the loop's
    scheduler (Flux.1's grid for Flux: sigmas ``linspace(1, 1/N, N)``, shifted)."""
    unet, scheduler = getattr(loop, "unet", None) or loop.transformer, loop.scheduler
    if type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler":
        scheduler.set_timesteps(sigmas=[1.0 - k / steps for k in range(steps)])
    else:
        scheduler.set_timesteps(steps)
    calls = inputs if isinstance(inputs, list) else [inputs]  # guidance "calls": conditional, unconditional
    key = "sample" if "sample" in calls[0] else "hidden_states"
    batched = preset.guidance == "batch"
    n = calls[0][key].shape[0]
    x = calls[0][key][: n // 2] if batched else calls[0][key]
    rests = [{k: v for k, v in c.items() if k not in (key, "timestep")} for c in calls]
    for t in scheduler.timesteps:
        model_in = torch.cat([x, x]) if batched else x
        step_t = (t / (1000 if preset.family == "flux" else 1)).expand(n).to(x.device)
        outs = [step(unet, {key: model_in, "timestep": step_t, **rest}).sample for rest in rests]
        if batched:
            uncond, cond = outs[0].chunk(2)
            out = uncond + guidance * (cond - uncond)
        elif len(outs) == 2:
            cond, uncond = outs
            out = uncond + guidance * (cond - uncond)
        else:
            out = outs[0]
        out = out[:, : x.shape[1]]  # PixArt predicts a variance too
        x = scheduler.step(out, t, x).prev_sample
    if vae is None:
        return x
    if preset.family == "flux":  # unpack 2x2 latent pixels per token
        side = int(round(x.shape[1] ** 0.5))
        c = preset.latent_channels
        x = x.view(x.shape[0], side, side, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(x.shape[0], c, 2 * side, 2 * side)
    return vae.decode(x / vae.config.scaling_factor).sample


def time_generation(unet, preset, cell: Cell, modes: list[MethodSpec], repeats: int, steps: int, device, dtype,
                    progress=None) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Seconds of ``generate`` per mode, interleaved, after one VAE warm-up (the steps were warmed by
    ``time_cell``); each mode applied to the loop (``Loop``: the scheduler and the denoiser, as a pipeline). With
    them, per mode whose cache counts its calls, what its last generation computed (``tools.peers.computed_share``:
    ``{"steps", "computed"}``, the share of the calls that ran the blocks)."""
    vae = vae_for(preset, dtype, device)
    inputs = preset.inputs(cell.batch, cell.resolution, dtype, device, frames=cell.frames)
    loop = Loop(unet, scheduler_for(preset, inputs), preset)
    generate(loop, vae, preset, inputs, 1)  # warms the scheduler and the VAE at this size
    times: dict[str, list[float]] = {m.text: [] for m in modes}
    ran: dict[str, dict] = {}
    for _ in range(repeats):
        for mode in modes:
            with mode.applied(loop):
                times[mode.text].append(timed(device, generate, loop, vae, preset, inputs, steps)[1])
                counted = computed_share(loop)
            if counted is not None:
                ran[mode.text] = counted
            if progress is not None:
                progress.update(1)
    return times, ran
