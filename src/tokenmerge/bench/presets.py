"""Architecture presets with random weights: real timings and memory, not images (no download needed).

The configurations are the published shapes of the SD 1.5, SD 2.1 (768-v) and SDXL base 1.0 UNets, and of the
PixArt-alpha 512 and SD3 medium transformers, written here. ``flux-2+4`` has Flux.1-dev's real block widths but 2
double-stream and 4 single-stream blocks (of 19 and 38): the full 12B model does not fit this machine in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tools.pipelines import load_pipeline

__all__ = ["PRESETS", "Preset", "load_model", "load_pipeline", "resolve"]


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    unet: dict
    text_tokens: int = 77
    added_cond: dict = field(default_factory=dict)  # name -> trailing shape of SDXL-style extra conditioning
    vae_scale: int = 8
    model: str | None = None  # a real pipeline (folder or hub id) instead of random weights
    family: str = "unet"  # which diffusers class ``unet`` (the denoiser's config) is for; see _CLASSES
    text_dim: int | None = None  # transformers: channels of the text embeddings they take

    def build(self, dtype=torch.float32, device="cpu"):
        import diffusers

        if self.model is not None:
            return load_model(self.model, dtype)[0].to(device).eval()
        torch.manual_seed(0)
        with torch.device(device):
            model = getattr(diffusers, _CLASSES[self.family])(**self.unet)
        # diffusers warns on every ``.to(dtype)`` of a UNet, even a no-op one: cast only when needed
        return (model if model.dtype == dtype else model.to(dtype)).eval()

    def inputs(self, batch: int, resolution: int, dtype, device, timestep: int = 500) -> dict:
        """Keyword inputs of one denoiser step for ``batch`` images; with classifier-free guidance (all but
        Flux, which is guidance-distilled) the denoiser sees ``2 * batch``."""
        g = torch.Generator().manual_seed(0)
        latent = resolution // self.vae_scale
        n = batch if self.family == "flux" else 2 * batch

        def randn(*shape):
            return torch.randn(*shape, generator=g).to(device, dtype)

        t = torch.full((n,), float(timestep), device=device)
        if self.family == "unet":
            extra = {k: randn(n, *shape) for k, shape in self.added_cond.items()}
            inputs = dict(sample=randn(n, self.unet["in_channels"], latent, latent), timestep=t,
                          encoder_hidden_states=randn(n, self.text_tokens, self.unet["cross_attention_dim"]))
            return dict(inputs, added_cond_kwargs=extra) if extra else inputs
        text = randn(n, self.text_tokens, self.text_dim)
        if self.family == "pixart":
            return dict(hidden_states=randn(n, 4, latent, latent), timestep=t, encoder_hidden_states=text,
                        added_cond_kwargs={"resolution": None, "aspect_ratio": None})
        if self.family == "sd3":
            return dict(hidden_states=randn(n, self.unet["in_channels"], latent, latent), timestep=t,
                        encoder_hidden_states=text, pooled_projections=randn(n, self.unet["pooled_projection_dim"]))
        side = latent // 2  # Flux packs 2x2 latent pixels into one token
        ids = torch.zeros(side, side, 3)
        ids[..., 1], ids[..., 2] = torch.arange(side)[:, None], torch.arange(side)[None, :]
        guidance = {"guidance": torch.full((n,), 3.5, device=device)} if self.unet.get("guidance_embeds") else {}
        return dict(hidden_states=randn(n, side * side, self.unet["in_channels"]), timestep=t / 1000,
                    encoder_hidden_states=text, pooled_projections=randn(n, self.unet["pooled_projection_dim"]),
                    img_ids=ids.reshape(-1, 3).to(device), txt_ids=torch.zeros(self.text_tokens, 3, device=device),
                    **guidance)

    @property
    def latent_channels(self) -> int:
        """Channels of the VAE latent (Flux packs 2x2 latent pixels into one token's channels)."""
        channels = self.unet.get("in_channels", 4)
        return channels // 4 if self.family == "flux" else channels


_CLASSES = {"unet": "UNet2DConditionModel", "pixart": "PixArtTransformer2DModel", "sd3": "SD3Transformer2DModel",
            "flux": "FluxTransformer2DModel"}


_SD = dict(
    in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
)

PRESETS = {
    "tiny": Preset(
        "tiny", "a tiny SD-1.x-shaped UNet for tests (seconds on a CPU)",
        dict(in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
             down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
             cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32, sample_size=32),
        text_tokens=8,
    ),
    "sd15": Preset("sd15", "Stable Diffusion 1.5 UNet (860M parameters)",
                   dict(_SD, cross_attention_dim=768, attention_head_dim=8, sample_size=64)),
    "sd21": Preset("sd21", "Stable Diffusion 2.1 768-v UNet (865M parameters)",
                   dict(_SD, cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20), use_linear_projection=True,
                        sample_size=96)),
    "sdxl": Preset(
        "sdxl", "SDXL base 1.0 UNet (2.6B parameters)",
        dict(in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
             down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
             up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
             transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
             use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
             projection_class_embeddings_input_dim=2816, sample_size=128),
        added_cond={"text_embeds": (1280,), "time_ids": (6,)},
    ),
    "pixart": Preset(
        "pixart", "PixArt-alpha 512 transformer (610M parameters, 28 blocks)",
        dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
             cross_attention_dim=1152, sample_size=64, patch_size=2, caption_channels=4096,
             norm_type="ada_norm_single", use_additional_conditions=False),
        text_tokens=120, family="pixart", text_dim=4096,
    ),
    "sd3": Preset(
        "sd3", "Stable Diffusion 3 medium MMDiT (2B parameters, 24 joint blocks)",
        dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
             num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
             pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192),
        text_tokens=333, family="sd3", text_dim=4096,
    ),
    "flux-2+4": Preset(
        "flux-2+4", "Flux.1-dev widths with 2 double- and 4 single-stream blocks (of 19 and 38; REDUCED)",
        dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
             num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
             axes_dims_rope=(16, 56, 56)),
        text_tokens=512, family="flux", text_dim=4096,
    ),
}


def load_model(path_or_id: str, dtype=torch.float32):
    """The UNet and VAE scale of a real diffusers pipeline; a clear ``FileNotFoundError`` when it is absent."""
    pipe = load_pipeline(path_or_id, dtype)
    unet = getattr(pipe, "unet", None)
    if unet is None:
        raise TypeError(f"{path_or_id!r} holds no UNet (components: {', '.join(pipe.components)})")
    return unet, getattr(pipe, "vae_scale_factor", 8)


def resolve(name: str | None = None, model: str | None = None, dtype=torch.float32) -> Preset:
    """A preset by name, or one that describes a real pipeline's UNet (loading it once to read its config)."""
    if model is None:
        return PRESETS[name]
    unet, vae_scale = load_model(model, dtype)
    config = dict(unet.config)
    added = {}
    if config.get("addition_embed_type") == "text_time":
        time_dim = 6 * config["addition_time_embed_dim"]
        added = {"text_embeds": (config["projection_class_embeddings_input_dim"] - time_dim,), "time_ids": (6,)}
    return Preset(model.rstrip("/").split("/")[-1], f"the UNet of {model}", config, added_cond=added,
                  vae_scale=vae_scale, model=model)
