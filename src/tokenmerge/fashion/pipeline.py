"""`FashionPipeline`: the embedded model as a real diffusers pipeline (prompt in, PIL images out)."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ConfigMixin, DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from .model import CLASS_NAMES, CONTEXT_DIM, CONTEXT_TOKENS, NULL_CLASS, WEIGHTS, build_unet, class_ids

__all__ = ["ClassEncoder", "FashionPipeline", "load_fashion_pipeline", "as_output"]


class ClassEncoder(ModelMixin, ConfigMixin):
    """The pipeline's "text encoder": a learned table, class id -> (tokens, dim) context for cross-attention."""

    @register_to_config
    def __init__(self, num_classes: int = NULL_CLASS + 1, tokens: int = CONTEXT_TOKENS, dim: int = CONTEXT_DIM):
        super().__init__()
        self.table = nn.Parameter(torch.randn(num_classes, tokens, dim) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B,) -> (B, T, D)
        return self.table[ids]


def load_fashion_pipeline(weights: str | Path | None = None):
    """The embedded Fashion-MNIST pipeline with its shipped weights (or ``weights``, a safetensors file).

    Args:
        weights: a file written by ``scripts/train_fashion.py``; default the one inside the package.

    The scheduler is DDIM with sample clipping: in pixel space DPM-Solver++ without clipping saturated the
    images (seen in trials), DDIM gives clean ones in 20 steps; ``schedulers.swap`` gives it another
    (``schedulers.UNET``).
    """
    from safetensors.torch import load_file

    from .schedulers import unet_scheduler

    path = Path(weights) if weights is not None else WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(
            f"the embedded model's weights are not at {path}: reinstall tokenmerge, or train them with "
            "`python scripts/train_fashion.py` from the repository"
        )
    state = load_file(str(path))
    unet, encoder = build_unet(), ClassEncoder()
    unet.load_state_dict({k[5:]: v.float() for k, v in state.items() if k.startswith("unet.")})
    encoder.load_state_dict({k[8:]: v.float() for k, v in state.items() if k.startswith("encoder.")})
    return FashionPipeline(unet=unet.eval(), encoder=encoder.eval(), scheduler=unet_scheduler("ddim"))


class FashionPipeline(DiffusionPipeline):
    """Class-conditional 32 x 32 pixel-space diffusion with classifier-free guidance.

    A prompt names a Fashion-MNIST class ("a sneaker", "Ankle boot"); see ``CLASS_NAMES``.
    """

    class_names = CLASS_NAMES

    def __init__(self, unet, encoder, scheduler):
        super().__init__()
        self.register_modules(unet=unet, encoder=encoder, scheduler=scheduler)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        num_inference_steps: int = 20,
        guidance_scale: float = 2.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
    ):
        from diffusers.utils.torch_utils import randn_tensor

        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if output_type not in ("pil", "pt", "np"):
            raise ValueError(f"output_type must be 'pil', 'pt' or 'np', got {output_type!r}")
        if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be a positive int, got {num_inference_steps!r}")
        device, dtype = self.unet.device, self.unet.dtype
        ids = torch.tensor(class_ids(prompts), device=device)
        cond = self.encoder(ids).to(dtype)
        uncond = self.encoder(torch.full_like(ids, NULL_CLASS)).to(dtype)
        shape = (len(prompts), 1, self.unet.config.sample_size, self.unet.config.sample_size)
        x = latents.to(device, dtype) if latents is not None else randn_tensor(shape, generator, device, dtype)
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        x = x * self.scheduler.init_noise_sigma
        guided = guidance_scale != 1.0
        context = torch.cat([uncond, cond]) if guided else cond
        for t in self.progress_bar(self.scheduler.timesteps):
            inp = self.scheduler.scale_model_input(torch.cat([x, x]) if guided else x, t)
            eps = self.unet(inp, t, encoder_hidden_states=context).sample
            if guided:
                eps_u, eps_c = eps.chunk(2)
                eps = eps_u + guidance_scale * (eps_c - eps_u)
            x = self.scheduler.step(eps, t, x).prev_sample
        return as_output((x.float().clamp(-1, 1) + 1) / 2, output_type)  # (B, 1, H, W) in [0, 1]


def as_output(images: torch.Tensor, output_type: str):
    """``(B, 1, H, W)`` in [0, 1] as a pipeline output of ``output_type`` ("pt", "np" or "pil")."""
    from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

    if output_type == "pt":
        return ImagePipelineOutput(images=images)
    arrays = images.permute(0, 2, 3, 1).cpu().numpy()
    if output_type == "np":
        return ImagePipelineOutput(images=arrays)
    from PIL import Image

    return ImagePipelineOutput(images=[Image.fromarray((a[..., 0] * 255).round().astype("uint8"), "L") for a in arrays])
