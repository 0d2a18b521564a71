"""The ``Preset`` record: an architecture with random weights, how to build it and make one step's inputs.

A preset names a diffusers class (``family``, see ``_CLASSES``) and its config, the text the pipeline passes
(tokens, width, mask), how the pipeline runs guidance (``GUIDANCE``), and the latent geometry (VAE scale, patch,
frames per latent frame for video). The registry of presets is ``presets.py``; the published configs are in
``configs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tools.pipelines import load_pipeline
from .cell import size as _size
from .inputs import BUILDERS

__all__ = ["Preset", "GUIDANCE", "load_model"]


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
    guidance: str | None = None  # how a pipeline step runs guidance: one of GUIDANCE (None: Flux.1 "distilled",
    # the others "batch")
    negative_tokens: int | None = None  # guidance "calls": text tokens of the unconditional call (None: text_tokens)
    prompt_tokens: int | None = None  # the prompt's tokens in a padded, masked text (None: no mask passed)
    frames_per_latent: int | None = None  # video: pixel frames per latent frame (the VAE's temporal compression)
    default_frames: int = 33  # video: pixel frames when --frames is not given
    patch: int = 1  # spatial patch size after the VAE (2x2 latent pixels per token: 2)
    multiple: int = 8  # resolutions must be multiples of this (the VAE's scale x the patch size)
    sizes: tuple = ()  # full-size presets: the model's usual resolutions (pixels, or "HxW")
    full_size: bool = False  # every block of the published model (the GPU presets): built in the target dtype

    def build(self, dtype=torch.float32, device="cpu"):
        """The model with random weights (seeded), on ``device`` in ``dtype``, in eval mode.

        Parameters are created on ``device`` in ``dtype`` directly (the default dtype is switched while the model is
        built, then restored): a 14B model never has a float32 or CPU copy. ``device="meta"`` builds the structure
        only (parameter counts without memory).

        Args:
            dtype: parameter dtype (float32, float16, bfloat16).
            device: where the parameters are created.
        """
        import diffusers

        if self.model is not None:
            return load_model(self.model, dtype)[0].to(device).eval()
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = getattr(diffusers, _CLASSES[self.family])(**self.unet)
        finally:
            torch.set_default_dtype(previous)
        # as from_pretrained(torch_dtype=...) loads it: floating tensors in ``dtype``, except, in half precision, the
        # modules the class keeps in float32 (``_keep_in_fp32_modules``: Wan's rotary tables and norms...); what
        # init made from NumPy (on the CPU) is moved. Set through ``.data``: diffusers warns on every ``.to(dtype)``
        # A tensor whose dtype changes is replaced in its module, not converted through ``.data``: dynamo keeps the
        # dtype a tensor was made with, and a ``.data`` of another dtype fails its trace (an AssertionError,
        # 'torch.float32 != torch.float16', seen compiling PixArt's float64-made position table on an H200)
        keep = (getattr(model, "_keep_in_fp32_modules", None) or []) if dtype in (torch.float16, torch.bfloat16) else []
        for module_name, module in model.named_modules():
            for store in (module._parameters, module._buffers):
                for name, tensor in list(store.items()):
                    path = f"{module_name}.{name}".split(".")
                    want = torch.float32 if any(k in path for k in keep) else dtype
                    if tensor is None or not tensor.is_floating_point() or tensor.dtype == want:
                        continue
                    converted = tensor.detach().to(want)
                    store[name] = torch.nn.Parameter(converted, tensor.requires_grad) \
                        if isinstance(tensor, torch.nn.Parameter) else converted
        if any(t.device.type != torch.device(device).type for t in [*model.parameters(), *model.buffers()]):
            model = model.to(device)
        return model.eval()

    def __post_init__(self):
        if self.guidance is None:
            object.__setattr__(self, "guidance", "distilled" if self.family == "flux" else "batch")
        if self.guidance not in GUIDANCE:
            raise ValueError(f"guidance must be one of {', '.join(GUIDANCE)}; got {self.guidance!r}")

    @property
    def video(self) -> bool:
        """Whether the preset is a video model (its inputs take ``frames``)."""
        return self.frames_per_latent is not None

    def latent_frames(self, frames: int | None) -> int:
        """Latent frames of ``frames`` pixel frames: ``(frames - 1) / temporal compression + 1``."""
        frames = self.default_frames if frames is None else frames
        return (frames - 1) // self.frames_per_latent + 1

    def check_frames(self, frames: int) -> str | None:
        """Why ``frames`` does not suit this preset (None if it does)."""
        if not self.video:
            return f"{self.name} is an image preset: --frames applies to video presets only"
        k = self.frames_per_latent
        if frames < 1 or (frames - 1) % k:
            return (f"{self.name} takes {k}k+1 frames (its VAE compresses {k} frames into one latent frame after the "
                    f"first): e.g. {k + 1}, {4 * k + 1}, {8 * k + 1}; got {frames}")
        return None

    def check_resolution(self, resolution: int | str) -> str | None:
        """Why ``resolution`` does not suit this preset (None if it does)."""
        h, w = _size(resolution)
        if h != w and self.family == "unet":
            return f"{self.name} takes square resolutions (one number); got {resolution}"
        if h % self.multiple or w % self.multiple:
            return (f"{self.name} needs sides that are multiples of {self.multiple} (the VAE's scale x the patch "
                    f"size); got {resolution}")
        return None

    def grid(self, resolution: int | str, frames: int | None = None) -> tuple[int, ...]:
        """The token grid of one call after patching: ``(frames, height, width)`` for video, else
        ``(height, width)`` (UNets: their finest level)."""
        h, w = _size(resolution)
        scale = self.vae_scale * self.patch
        spatial = (h // scale, w // scale)
        return ((self.latent_frames(frames),) + spatial) if self.video else spatial

    def merged_resolution(self, resolution: int | str, ratio: float, frames: int | None = None) -> str:
        """The resolution whose token grid holds what ``ratio`` leaves of this one's: the grid's rows times
        ``1 - ratio`` (rounded, at least one), the width kept: ``"HxW"`` (the ``grid-limit`` reference of
        whole-block merging; transformers only: a UNet's levels would all shrink).

        Args:
            resolution: pixels per side or ``"HxW"``.
            ratio: the merge ratio.
            frames: pixel frames (video).
        """
        if self.family == "unet":
            raise ValueError(f"grid-limit runs a transformer at the merged token count; {self.name} is a UNet, "
                             "whose every level would shrink (use limit with scope=block)")
        h, w = _size(resolution)
        rows = self.grid(resolution, frames)[-2]
        kept = max(1, round(rows * (1 - ratio)))
        return f"{h * kept // rows}x{w}"

    @property
    def guidance_text(self) -> str:
        return GUIDANCE[self.guidance]

    def inputs(self, batch: int, resolution: int | str, dtype, device, timestep: int = 500,
               frames: int | None = None) -> dict | list[dict]:
        """Keyword inputs of one denoising step for ``batch`` images or videos, as the pipeline makes them: one
        call with the batch doubled (guidance "batch": the denoiser sees ``2 * batch``), one call per
        conditional / unconditional prediction (guidance "calls": a list of two dicts), or one call
        (guidance-distilled). ``resolution``: pixels per side or ``"HxW"``; ``frames``: pixel frames (video)."""
        if frames is not None and not self.video:
            raise ValueError(f"{self.name} is an image preset: it takes no frames")
        g = torch.Generator().manual_seed(0)
        h, w = _size(resolution)
        n = 2 * batch if self.guidance == "batch" else batch

        def randn(*shape):
            return torch.randn(*shape, generator=g).to(device, dtype)

        t = torch.full((n,), float(timestep), device=device)
        if self.family in BUILDERS:
            calls = BUILDERS[self.family](self, n, h, w, frames, t, randn, device)
            return calls[0] if len(calls) == 1 else calls
        if isinstance(resolution, str) and h != w and self.family == "unet":
            raise ValueError(f"{self.name} takes square resolutions; got {resolution}")
        lh, lw = h // self.vae_scale, w // self.vae_scale
        if self.family == "unet":
            extra = {k: randn(n, *shape) for k, shape in self.added_cond.items()}
            inputs = dict(sample=randn(n, self.unet["in_channels"], lh, lw), timestep=t,
                          encoder_hidden_states=randn(n, self.text_tokens, self.unet["cross_attention_dim"]))
            return dict(inputs, added_cond_kwargs=extra) if extra else inputs
        text = randn(n, self.text_tokens, self.text_dim)
        if self.family == "pixart":
            conditions = {"resolution": None, "aspect_ratio": None}
            if self.unet.get("use_additional_conditions", self.unet.get("sample_size") == 128):
                # PixArtAlphaPipeline at 1024: the micro-conditions (height, width) and height / width
                conditions = {"resolution": torch.tensor([[float(h), float(w)]] * n).to(device, dtype),
                              "aspect_ratio": torch.tensor([[h / w]] * n).to(device, dtype)}
            return dict(hidden_states=randn(n, 4, lh, lw), timestep=t, encoder_hidden_states=text,
                        added_cond_kwargs=conditions)
        if self.family == "sd3":
            return dict(hidden_states=randn(n, self.unet["in_channels"], lh, lw), timestep=t,
                        encoder_hidden_states=text, pooled_projections=randn(n, self.unet["pooled_projection_dim"]))
        rows, cols = lh // 2, lw // 2  # Flux packs 2x2 latent pixels into one token
        ids = torch.zeros(rows, cols, 3)
        ids[..., 1], ids[..., 2] = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
        guidance = {"guidance": torch.full((n,), 3.5, device=device)} if self.unet.get("guidance_embeds") else {}
        return dict(hidden_states=randn(n, rows * cols, self.unet["in_channels"]), timestep=t / 1000,
                    encoder_hidden_states=text, pooled_projections=randn(n, self.unet["pooled_projection_dim"]),
                    img_ids=ids.reshape(-1, 3).to(device), txt_ids=torch.zeros(self.text_tokens, 3, device=device),
                    **guidance)

    @property
    def latent_channels(self) -> int:
        """Channels of the VAE latent (Flux packs 2x2 latent pixels into one token's channels)."""
        channels = self.unet.get("in_channels", 4)
        return channels // 4 if self.family == "flux" else channels


_CLASSES = {"unet": "UNet2DConditionModel", "pixart": "PixArtTransformer2DModel", "sd3": "SD3Transformer2DModel",
            "flux": "FluxTransformer2DModel", "wan": "WanTransformer3DModel",
            "hunyuan-video": "HunyuanVideoTransformer3DModel", "ltx": "LTXVideoTransformer3DModel",
            "flux2": "Flux2Transformer2DModel", "qwen-image": "QwenImageTransformer2DModel",
            "sana": "SanaTransformer2DModel", "z-image": "ZImageTransformer2DModel",
            "cogvideox": "CogVideoXTransformer3DModel"}

GUIDANCE = {
    "batch": "classifier-free guidance in one call, the batch doubled (the denoiser sees 2 x batch)",
    "calls": "classifier-free guidance as two calls of the batch, conditional then unconditional",
    "distilled": "guidance-distilled: one call of the batch (the guidance scale is an input)",
}


def load_model(path_or_id: str, dtype=torch.float32):
    """The UNet and VAE scale of a real diffusers pipeline; a clear ``FileNotFoundError`` when it is absent."""
    pipe = load_pipeline(path_or_id, dtype)
    unet = getattr(pipe, "unet", None)
    if unet is None:
        raise TypeError(f"{path_or_id!r} holds no UNet (components: {', '.join(pipe.components)})")
    return unet, getattr(pipe, "vae_scale_factor", 8)

