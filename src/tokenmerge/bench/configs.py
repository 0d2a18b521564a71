"""The published configurations the presets build: the diffusers config (``transformer/config.json`` or
``unet/config.json``) of each model, or its conversion script where that is what sets it, cited beside each; and
the latent geometry of each VAE (pixel frames per latent frame, spatial scale, patch, the size multiple).

The presets (``presets.py``: the CPU ones, some REDUCED to fewer blocks; ``full_size.py``: the GPU ones) take these
and change at most the block counts.
"""

__all__ = ["SD_UNET", "PIXART_512", "WAN_1_3B", "WAN_14B", "HUNYUAN_VIDEO", "LTX_2B", "FLUX1_DEV", "FLUX2_DEV",
           "QWEN_IMAGE", "SANA_1600M", "Z_IMAGE", "COGVIDEOX_5B", "PIXART_SIGMA_1024", "VIDEO", "LTX_VIDEO",
           "IMAGE16", "IMAGE32"]

# Stable Diffusion 1.x / 2.x UNet (the levels; cross-attention width and heads per preset)
SD_UNET = dict(
    in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
)

# PixArt-alpha XL/2 512 (PixArt-alpha/PixArt-XL-2-512x512: 28 blocks)
PIXART_512 = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                  cross_attention_dim=1152, sample_size=64, patch_size=2, caption_channels=4096,
                  norm_type="ada_norm_single", use_additional_conditions=False)

# Wan 2.1 T2V 1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json)
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# HunyuanVideo 1.0 T2V (hunyuanvideo-community/HunyuanVideo, transformer/config.json)
HUNYUAN_VIDEO = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                     num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                     qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                     rope_theta=256.0, rope_axes_dim=(16, 56, 56))
# LTX-Video 2B 0.9 (Lightricks/LTX-Video, transformer/config.json)
LTX_2B = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
              attention_head_dim=64, cross_attention_dim=2048, num_layers=28, activation_fn="gelu-approximate",
              qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096,
              attention_bias=True, attention_out_bias=True)
# Flux.2 [dev] (black-forest-labs/FLUX.2-dev, transformer/config.json: diffusers' defaults)
FLUX2_DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                 num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True)
# Qwen-Image (Qwen/Qwen-Image, transformer/config.json)
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# SANA 1600M 1024px (Efficient-Large-Model/Sana_1600M_1024px_diffusers, transformer/config.json)
SANA_1600M = dict(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
                  num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                  caption_channels=2304, mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=32, patch_size=1,
                  norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None)

# Z-Image (Tongyi-MAI/Z-Image-Turbo, transformer/config.json)
Z_IMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
               n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
               t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])

VIDEO = dict(frames_per_latent=4, vae_scale=8, patch=2, multiple=16)  # Wan / HunyuanVideo: VAE 4x time, 8x space
LTX_VIDEO = dict(frames_per_latent=8, vae_scale=32, patch=1, multiple=32)  # LTX's VAE: 8x time, 32x space
IMAGE16 = dict(vae_scale=8, patch=2, multiple=16)  # Flux.2, Qwen-Image: 8x VAE, 2x2 latent pixels per token
IMAGE32 = dict(vae_scale=32, patch=1, multiple=32)  # SANA's DC-AE: 32x


# ---- models only the full-size presets (full_size.py) use ---------------------------------------------------------
# CogVideoX-5B (THUDM/CogVideoX-5b; scripts/convert_cogvideox_to_diffusers.py: 42 layers, 48 heads, rotary)
COGVIDEOX_5B = dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, num_layers=42,
                    text_embed_dim=4096, time_embed_dim=512, sample_width=90, sample_height=60, sample_frames=49,
                    patch_size=2, temporal_compression_ratio=4, max_text_seq_length=226,
                    use_rotary_positional_embeddings=True)
# Wan 2.1 T2V 14B (Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json): 40 heads x 128 (5120 wide), ffn 13824
WAN_14B = dict(WAN_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
# Flux.1 [dev] (black-forest-labs/FLUX.1-dev, transformer/config.json): 19 double- and 38 single-stream blocks
FLUX1_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56))
# PixArt-Sigma XL/2 1024 (PixArt-alpha/PixArt-Sigma-XL-2-1024-MS; scripts/convert_pixart_sigma_to_diffusers.py:
# interpolation scale 2 at 1024, no micro-conditions)
PIXART_SIGMA_1024 = dict(PIXART_512, sample_size=128, interpolation_scale=2, use_additional_conditions=False)
