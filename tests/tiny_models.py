"""Factories of tiny models with random weights, as diffusers' own tests build them."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json

import torch
from torch import nn

CROSS_DIM = 32


def make_unet(kind: str = "sd", seed: int = 0, **overrides):
    """A tiny ``UNet2DConditionModel``. ``kind="sd"``: attention from the first level (SD 1.x/2.x layout);
    ``kind="sdxl"``: no attention in the first level, two transformer layers deeper (SDXL layout)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    if kind == "sd":
        config = dict(
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            layers_per_block=2,
        )
    elif kind == "sdxl":
        config = dict(
            block_out_channels=(32, 64, 64),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 1, 2),
            layers_per_block=1,
        )
    else:
        raise ValueError(kind)
    config.update(sample_size=16, in_channels=4, out_channels=4, cross_attention_dim=CROSS_DIM,
                  attention_head_dim=8, norm_num_groups=32)
    config.update(overrides)
    return UNet2DConditionModel(**config).eval()


def make_controlnet(seed: int = 1):
    from diffusers import ControlNetModel

    torch.manual_seed(seed)
    net = ControlNetModel(
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        layers_per_block=2, in_channels=4, cross_attention_dim=CROSS_DIM, attention_head_dim=8,
        norm_num_groups=32, conditioning_embedding_out_channels=(16, 32),
    ).eval()
    # a trained ControlNet's zero-initialised output convolutions are not zero: make them random too
    for module in (net.controlnet_down_blocks, net.controlnet_mid_block):
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.1)
    return net


def unet_inputs(batch: int = 2, h: int = 16, w: int = 16, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return dict(
        sample=torch.randn(batch, 4, h, w, generator=g).to(dtype),
        timestep=torch.tensor(500),
        encoder_hidden_states=torch.randn(batch, 7, CROSS_DIM, generator=g).to(dtype),
    )


# ---- an LDM-style UNet, in the shape of CompVis' ldm.modules (names and structure, not its code) -----------
class CrossAttention(nn.Module):
    def __init__(self, dim, context_dim=None, heads=2):
        super().__init__()
        context_dim = context_dim or dim
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(context_dim, dim, bias=False)
        self.to_v = nn.Linear(context_dim, dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim, dim))

    def forward(self, x, context=None, mask=None):
        context = x if context is None else context
        b, n, c = x.shape
        q, k, v = (t.reshape(b, -1, self.heads, c // self.heads).transpose(1, 2)
                   for t in (self.to_q(x), self.to_k(context), self.to_v(context)))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, c))


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, context_dim):
        super().__init__()
        self.disable_self_attn = False
        self.attn1 = CrossAttention(dim)
        self.attn2 = CrossAttention(dim, context_dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x, context=None):
        return self._forward(x, context)

    def _forward(self, x, context=None):
        x = self.attn1(self.norm1(x), context=context if self.disable_self_attn else None) + x
        x = self.attn2(self.norm2(x), context=context) + x
        return self.ff(self.norm3(x)) + x


class SpatialTransformer(nn.Module):
    def __init__(self, channels, context_dim):
        super().__init__()
        self.norm = nn.GroupNorm(8, channels)
        self.proj_in = nn.Conv2d(channels, channels, 1)
        self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(channels, context_dim)])
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x, context=None):
        b, c, h, w = x.shape
        y = self.proj_in(self.norm(x)).flatten(2).transpose(1, 2)
        for block in self.transformer_blocks:
            y = block(y, context=context)
        return self.proj_out(y.transpose(1, 2).reshape(b, c, h, w)) + x


class ResBlock(nn.Module):
    def __init__(self, cin, cout, temb):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(cin, cout, 3, padding=1), nn.Conv2d(cout, cout, 3, padding=1)
        self.emb = nn.Linear(temb, cout)
        self.skip = nn.Conv2d(cin, cout, 1)

    def forward(self, x, emb):
        h = torch.nn.functional.silu(self.conv1(x)) + self.emb(emb)[:, :, None, None]
        return self.skip(x) + self.conv2(torch.nn.functional.silu(h))


class Downsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.op = nn.Conv2d(c, c, 3, stride=2, padding=1)

    def forward(self, x):
        return self.op(x)


class Upsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x, size):
        return self.conv(torch.nn.functional.interpolate(x, size=size, mode="nearest"))


class TimestepEmbedSequential(nn.Sequential):
    def forward(self, x, emb, context=None, size=None):
        for layer in self:
            if isinstance(layer, ResBlock):
                x = layer(x, emb)
            elif isinstance(layer, SpatialTransformer):
                x = layer(x, context)
            elif isinstance(layer, Upsample):
                x = layer(x, size)
            else:
                x = layer(x)
        return x


class UNetModel(nn.Module):
    """Two levels, attention at both; ``forward(x, timesteps, context)`` as in ldm."""

    def __init__(self, ch=32, context_dim=CROSS_DIM):
        super().__init__()
        t = 4 * ch
        self.time_embed = nn.Sequential(nn.Linear(ch, t), nn.SiLU(), nn.Linear(t, t))
        self.ch = ch
        self.input_blocks = nn.ModuleList([
            TimestepEmbedSequential(nn.Conv2d(4, ch, 3, padding=1)),
            TimestepEmbedSequential(ResBlock(ch, ch, t), SpatialTransformer(ch, context_dim)),
            TimestepEmbedSequential(Downsample(ch)),
            TimestepEmbedSequential(ResBlock(ch, ch, t), SpatialTransformer(ch, context_dim)),
        ])
        self.middle_block = TimestepEmbedSequential(ResBlock(ch, ch, t), SpatialTransformer(ch, context_dim))
        self.output_blocks = nn.ModuleList([
            TimestepEmbedSequential(ResBlock(2 * ch, ch, t), SpatialTransformer(ch, context_dim), Upsample(ch)),
            TimestepEmbedSequential(ResBlock(2 * ch, ch, t), SpatialTransformer(ch, context_dim)),
        ])
        self.out = nn.Sequential(nn.GroupNorm(8, ch), nn.SiLU(), nn.Conv2d(ch, 4, 3, padding=1))

    def forward(self, x, timesteps=None, context=None):
        half = self.ch // 2
        freqs = torch.exp(-torch.arange(half, dtype=torch.float32) * 9.2 / half)
        args = timesteps.float().reshape(-1, 1) * freqs[None]
        emb = self.time_embed(torch.cat([args.cos(), args.sin()], dim=-1).expand(x.shape[0], -1).to(x.dtype))
        skips, h = [], x
        for block in self.input_blocks:
            h = block(h, emb, context)
            skips.append(h)
        h = self.middle_block(h, emb, context)
        for i, block in enumerate(self.output_blocks):
            skip = skips[-1 - 2 * i] if i == 0 else skips[1]
            size = skips[1].shape[-2:]
            h = block(torch.cat([h, skip], dim=1), emb, context, size)
        return self.out(h)


class DiffusionWrapper(nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.diffusion_model = unet


class LatentDiffusion(nn.Module):
    """The object webuis hold: ``model.model.diffusion_model``."""

    def __init__(self, unet):
        super().__init__()
        self.model = DiffusionWrapper(unet)

    def apply_model(self, x, t, context):
        return self.model.diffusion_model(x, t, context=context)


def ldm_unet(seed: int = 0) -> LatentDiffusion:
    torch.manual_seed(seed)
    return LatentDiffusion(UNetModel()).eval()


# ---- pipelines from tiny components -------------------------------------------------------------------------
def _tiny_tokenizer(tmp_path):
    from transformers import CLIPTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {tok: i for i, tok in enumerate(["<|startoftext|>", "<|endoftext|>", "!"] + letters
                                             + [c + "</w>" for c in letters])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), model_max_length=16)


def make_vae(latent_channels: int = 4):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    extra = {}
    if "shift_factor" in inspect.signature(AutoencoderKL.__init__).parameters:
        extra["shift_factor"] = 0.0  # Flux pipelines read it; diffusers before 0.30 has no such argument
    return AutoencoderKL(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=latent_channels,
                         norm_num_groups=32, **extra).eval()


def make_sd_pipeline(tmp_path, controlnet: bool = False):
    """A ``StableDiffusionPipeline`` (or ``StableDiffusionControlNetPipeline``) of tiny random parts."""
    from diffusers import DDIMScheduler
    from transformers import CLIPTextConfig, CLIPTextModel

    vae = make_vae()
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=CROSS_DIM, intermediate_size=37,
        num_attention_heads=4, num_hidden_layers=2, vocab_size=64, max_position_embeddings=16,
        projection_dim=CROSS_DIM)).eval()
    parts = dict(unet=make_unet("sd"), vae=vae, text_encoder=text_encoder, tokenizer=_tiny_tokenizer(tmp_path),
                 scheduler=DDIMScheduler(clip_sample=False), safety_checker=None, feature_extractor=None,
                 requires_safety_checker=False)
    if controlnet:
        from diffusers import StableDiffusionControlNetPipeline

        return StableDiffusionControlNetPipeline(controlnet=make_controlnet(), **parts)
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline(**parts)


def make_clip_folder(tmp_path):
    """A folder holding a tiny random CLIP model and its processor, loadable with local_files_only."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37,
                         num_attention_heads=4, num_hidden_layers=2, vocab_size=64, max_position_embeddings=16),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                           image_size=32, patch_size=8),
        projection_dim=16)
    folder = tmp_path / "clip"
    CLIPModel(config).save_pretrained(folder)
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=_tiny_tokenizer(tmp_path))
    processor.save_pretrained(folder)
    return folder


# ---- patch transformers (DiT family) --------------------------------------------------------------------------
def _transformer_class(name: str, **legacy):
    """``diffusers.<name>``, or on diffusers before 0.28 (no such class) the generic ``Transformer2DModel``
    with the ``legacy`` settings that made it that model (how those versions' DiT/PixArt pipelines built it)."""
    import functools

    import diffusers

    if hasattr(diffusers, name):
        return getattr(diffusers, name)
    return functools.partial(diffusers.Transformer2DModel, **legacy)


def make_dit(seed: int = 0):
    cls = _transformer_class("DiTTransformer2DModel", norm_type="ada_norm_zero", num_embeds_ada_norm=1000)
    torch.manual_seed(seed)
    return cls(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
               num_layers=2, sample_size=8, patch_size=2, norm_num_groups=2).eval()


def make_pixart(seed: int = 0):
    cls = _transformer_class("PixArtTransformer2DModel", norm_type="ada_norm_single", num_embeds_ada_norm=1000,
                             use_linear_projection=False, norm_elementwise_affine=False, norm_eps=1e-6)
    torch.manual_seed(seed)
    return cls(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
               num_layers=2, sample_size=8, patch_size=2, cross_attention_dim=16,
               caption_channels=16, norm_num_groups=2).eval()


def make_sd3(seed: int = 0):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                 pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16,
                                 dual_attention_layers=(0,)).eval()


def make_flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval()


def dit_inputs(kind: str, batch: int = 2, h: int = 8, w: int = 8, seed: int = 0) -> dict:
    """Keyword inputs of a tiny transformer of ``kind`` for a latent of ``h`` x ``w`` (Flux: token grid)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.full((batch,), 500.0)
    if kind == "dit":
        return dict(hidden_states=torch.randn(batch, 4, h, w, generator=g), timestep=t.long(),
                    class_labels=torch.arange(batch) % 10)
    if kind == "pixart":
        return dict(hidden_states=torch.randn(batch, 4, h, w, generator=g), timestep=t.long(),
                    encoder_hidden_states=torch.randn(batch, 5, 16, generator=g),
                    added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    if kind == "sd3":
        return dict(hidden_states=torch.randn(batch, 4, h, w, generator=g), timestep=t,
                    encoder_hidden_states=torch.randn(batch, 5, 16, generator=g),
                    pooled_projections=torch.randn(batch, 16, generator=g))
    if kind == "flux":
        img_ids = torch.zeros(h, w, 3)
        img_ids[..., 1] = torch.arange(h)[:, None]
        img_ids[..., 2] = torch.arange(w)[None, :]
        return dict(hidden_states=torch.randn(batch, h * w, 16, generator=g), timestep=t / 1000,
                    encoder_hidden_states=torch.randn(batch, 5, 32, generator=g),
                    pooled_projections=torch.randn(batch, 32, generator=g),
                    img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(5, 3))
    raise ValueError(kind)


def make_dit_pipeline(kind: str):
    """(pipeline of tiny random parts, call kwargs) for ``kind`` in dit/pixart/sd3/flux; text encoders are left
    out and the prompt embeddings passed directly (no tokenizer files needed)."""
    import diffusers
    from diffusers import DDIMScheduler

    r = torch.Generator().manual_seed(1)
    common = dict(num_inference_steps=2, output_type="pt")
    if kind == "dit":
        pipe = diffusers.DiTPipeline(transformer=make_dit(), vae=make_vae(), scheduler=DDIMScheduler())
        return pipe, dict(common, class_labels=[1])
    size = dict(height=32, width=32)
    if kind == "pixart":
        pipe = diffusers.PixArtAlphaPipeline(tokenizer=None, text_encoder=None, transformer=make_pixart(),
                                             vae=make_vae(), scheduler=DDIMScheduler())
        return pipe, dict(common, **size, prompt=None, negative_prompt=None, use_resolution_binning=False,
                          prompt_embeds=torch.randn(1, 5, 16, generator=r), prompt_attention_mask=torch.ones(1, 5),
                          negative_prompt_embeds=torch.randn(1, 5, 16, generator=r),
                          negative_prompt_attention_mask=torch.ones(1, 5))
    from diffusers import FlowMatchEulerDiscreteScheduler

    none = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    if kind == "sd3":
        pipe = diffusers.StableDiffusion3Pipeline(transformer=make_sd3(), scheduler=FlowMatchEulerDiscreteScheduler(),
                                                  vae=make_vae(), text_encoder_3=None, tokenizer_3=None, **none)
        return pipe, dict(common, **size, prompt_embeds=torch.randn(1, 5, 16, generator=r),
                          pooled_prompt_embeds=torch.randn(1, 16, generator=r),
                          negative_prompt_embeds=torch.randn(1, 5, 16, generator=r),
                          negative_pooled_prompt_embeds=torch.randn(1, 16, generator=r))
    if kind == "flux":  # 4 latent channels packed 2x2 = the transformer's 16 input channels
        pipe = diffusers.FluxPipeline(transformer=make_flux(), scheduler=FlowMatchEulerDiscreteScheduler(),
                                      vae=make_vae(), **none)
        return pipe, dict(common, **size, prompt_embeds=torch.randn(1, 5, 32, generator=r),
                          pooled_prompt_embeds=torch.randn(1, 32, generator=r))
    raise ValueError(kind)


# ---- a model no built-in family knows: registered by the tests with register_family --------------------------
class ToyAttention(nn.Module):
    """Self-attention that takes other keys/values through ``encoder_hidden_states`` (so ToDo applies)."""

    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.q, self.kv, self.out = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states=None):
        b, n, c = hidden_states.shape
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        k, v = self.kv(context).chunk(2, -1)

        def heads(x):
            return x.view(b, -1, self.heads, c // self.heads).transpose(1, 2)

        out = torch.nn.functional.scaled_dot_product_attention(heads(self.q(hidden_states)), heads(k), heads(v))
        return self.out(out.transpose(1, 2).reshape(b, n, c))


class ToyBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ToyAttention(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, temb):
        x = hidden_states + self.attn(self.norm1(hidden_states) * (1 + temb[:, None]))
        return x + self.mlp(self.norm2(x))


class ToyVideoDiT(nn.Module):
    """A video DiT of its own shape: ``forward(latent, t)``, latent (B, C, F, H, W), 2x2 spatial patches."""

    def __init__(self, channels: int = 4, dim: int = 16, depth: int = 2):
        super().__init__()
        self.toy_patchify = nn.Conv3d(channels, dim, (1, 2, 2), stride=(1, 2, 2))
        self.time = nn.Linear(1, dim)
        self.my_blocks = nn.ModuleList([ToyBlock(dim) for _ in range(depth)])
        self.unpatchify = nn.ConvTranspose3d(dim, channels, (1, 2, 2), stride=(1, 2, 2))

    def forward(self, latent, t):
        x = self.toy_patchify(latent)
        b, c, f, h, w = x.shape
        x = x.flatten(2).transpose(1, 2)  # (B, F*H*W, C), frame-major
        temb = self.time(t.float().view(-1, 1) / 1000)
        for block in self.my_blocks:
            x = block(x, temb)
        return self.unpatchify(x.transpose(1, 2).reshape(b, c, f, h, w))


def toy_video_family():
    """The ``Family`` record a user would write for ``ToyVideoDiT`` (nothing of it is in the package)."""
    from tokenmerge.families import MLP, SELF, Arg, Blocks, Family, LatentGrid, Target, has, has_list

    return Family("toy-video", match=has_list("my_blocks") & has("toy_patchify"),
                  grid=LatentGrid(Arg("latent"), rank=3, patch=(1, 2, 2)), timestep=Arg("t"),
                  blocks=(Blocks("my_blocks", (Target("attn", SELF), Target("mlp", MLP))),))


def toy_video_inputs(batch: int = 2, grid=None, seed: int = 0) -> dict:
    f, h, w = grid or (3, 4, 4)
    g = torch.Generator().manual_seed(seed)
    return dict(latent=torch.randn(batch, 4, f, 2 * h, 2 * w, generator=g), t=torch.full((batch,), 500.0))


# ---- a "merge" that only reorders the tokens: every layout fact of a family (rotary rows, text beside the image,
# masks, outputs) must then leave the model's outputs unchanged up to rounding ---------------------------------
def permuting_matcher(metric, shape, windows, r, offsets=None, radius=None):
    """A matcher whose plan moves every token to another slot and merges none (it claims one merged token, so
    the engine applies it)."""
    from tokenmerge.merge.plan import MergePlan

    class Permutation(MergePlan):
        def __init__(self, dest, slots):
            super().__init__(dest, slots)
            self.num_merged = 1

        def expand(self, batch: int):
            return self if batch == 1 else Permutation(self.dest.expand(batch, -1), self.num_slots)

    batch, tokens = metric.shape[:2]
    dest = torch.randperm(tokens, generator=torch.Generator().manual_seed(tokens)).to(metric.device)
    return Permutation(dest.expand(batch, -1), tokens)


class PlanRecorder:
    """An observer (``tokenmerge.observe``) that keeps what the patched blocks merge: a ``tokenmerge.BlockPlan``
    per block call, in call order (``plans``)."""

    def __init__(self):
        self.plans = []

    def begin(self, phase: str) -> None:
        pass

    def end(self, phase: str) -> None:
        pass

    def plan(self, block_plan) -> None:
        self.plans.append(block_plan)

    def of(self, path_end: str) -> list:
        """The plans of the blocks whose path ends with ``path_end``."""
        return [p.plan for p in self.plans if p.path.endswith(path_end)]


def record_plans(model) -> PlanRecorder:
    """A ``PlanRecorder`` observing every patch on ``model`` (applied already)."""
    import tokenmerge

    recorder = PlanRecorder()
    tokenmerge.observe(model, recorder)
    return recorder


# ---- token reuse: the calls of a generation's later steps --------------------------------------------------
def later_step(model, inputs: dict, factor: float = 0.8) -> dict:
    """``inputs`` with the timestep moved one step further into denoising (scaled by ``factor`` or by its inverse,
    whichever raises the denoising progress as the model's family reads it: families called with 1000 - t, or
    with 0..1 timesteps where 0 is noise, go the other way)."""
    from tokenmerge.engine import find_denoisers

    bound = find_denoisers(model)[0].timestep
    t = bound.read((), inputs)
    value = float(t.max()) if isinstance(t, torch.Tensor) else float(t)
    for f in (factor, 1 / factor):
        if bound.progress(value * f, 1000) > bound.progress(value, 1000):
            return {**inputs, bound.name: t * f}
    raise ValueError(f"no later timestep than {value} for {type(model).__name__}")


def steps_of(model, inputs: dict, n: int) -> list[dict]:
    """``n`` calls of one generation from ``inputs``, each at the next timestep (``later_step``)."""
    calls = [inputs]
    for _ in range(n - 1):
        calls.append(later_step(model, calls[-1]))
    return calls


@contextlib.contextmanager
def counting_forwards(model):
    """Counts the runs of the model's blocks' own ``forward`` (their class's: a skipped call of a cache across steps
    runs none) while inside; yields ``count`` (``count[0]``: runs so far). Patch the model inside the block: a cache
    across steps calls the class's forward it finds when it is installed. Other modules of those classes (blocks
    the family does not patch) run uncounted."""
    from tokenmerge.engine import find_denoisers

    count = [0]
    sites = [b for site in find_denoisers(model) for b in site.blocks]
    blocks = {id(b.module) for b in sites}
    saved = {cls: cls.__dict__.get("forward") for cls in {type(b.module) for b in sites}}
    for cls in saved:
        @functools.wraps(cls.forward)  # (its signature: what binding an argument by name reads)
        def counted(self, *args, _forward=cls.forward, **kwargs):
            count[0] += id(self) in blocks
            return _forward(self, *args, **kwargs)
        cls.forward = counted
    try:
        yield count
    finally:
        for cls, forward in saved.items():
            if forward is None:
                del cls.forward
            else:
                cls.forward = forward


def runs_per_call(model, calls, count) -> list[int]:
    """Per call of ``calls``, the block runs ``count`` (``counting_forwards``) saw."""
    per_call = []
    with torch.no_grad():
        for c in calls:
            before = count[0]
            model(**c)
            per_call.append(count[0] - before)
    return per_call
