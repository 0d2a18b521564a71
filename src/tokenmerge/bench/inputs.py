"""Step inputs of the video and 2025-2026 image transformer presets, as their diffusers pipelines make them.

Each builder takes the preset, the batch the denoiser sees per call ``n``, the pixel size, the pixel frames
(video), the timestep tensor, a seeded ``randn`` and the device, and returns the calls of one denoising step
(one dict, or the conditional and unconditional calls of pipelines that run guidance as two calls).
"""

from __future__ import annotations

import torch

__all__ = ["BUILDERS"]


def _mask(preset, n: int, tokens: int, device):
    """The pipeline's text mask: the prompt's tokens, then padding (``prompt_tokens`` of ``tokens`` are real)."""
    mask = torch.zeros(n, tokens, dtype=torch.long, device=device)
    mask[:, : min(tokens, preset.prompt_tokens or tokens)] = 1
    return mask


def _texts(preset) -> list[int]:
    """Text tokens of each call of a step: the prompt's, and the negative prompt's when guidance is two calls."""
    if preset.guidance == "calls":
        return [preset.text_tokens, preset.negative_tokens or preset.text_tokens]
    return [preset.text_tokens]


def _wan(preset, n, h, w, frames, t, randn, device):
    """WanPipeline: latent (B, 16, F, H/8, W/8), umT5 embeddings zero-padded to 512 tokens (no mask), timestep on
    0..1000; the conditional and unconditional predictions are two calls."""
    c = preset.unet["in_channels"]
    latent = randn(n, c, preset.latent_frames(frames), h // preset.vae_scale, w // preset.vae_scale)
    return [dict(hidden_states=latent, timestep=t, encoder_hidden_states=randn(n, tokens, preset.text_dim))
            for tokens in _texts(preset)]


def _hunyuan_video(preset, n, h, w, frames, t, randn, device):
    """HunyuanVideoPipeline: latent (B, 16, F, H/8, W/8), LLaMA embeddings padded to 256 tokens with their mask,
    CLIP pooled embeddings, embedded guidance (scale x 1000); one call."""
    c = preset.unet["in_channels"]
    latent = randn(n, c, preset.latent_frames(frames), h // preset.vae_scale, w // preset.vae_scale)
    tokens = preset.text_tokens
    return [dict(hidden_states=latent, timestep=t, encoder_hidden_states=randn(n, tokens, preset.text_dim),
                 encoder_attention_mask=_mask(preset, n, tokens, device),
                 pooled_projections=randn(n, preset.unet["pooled_projection_dim"]),
                 guidance=torch.full((n,), 6000.0, device=device))]


def _ltx(preset, n, h, w, frames, t, randn, device):
    """LTXPipeline: packed tokens (B, F*H/32*W/32, 128), T5 embeddings padded to 128 tokens with their mask,
    the batch doubled for guidance, the grid and the rope scale (8 / 25 fps, 32, 32) as arguments."""
    f, lh, lw = preset.latent_frames(frames), h // preset.vae_scale, w // preset.vae_scale
    tokens = preset.text_tokens
    return [dict(hidden_states=randn(n, f * lh * lw, preset.unet["in_channels"]), timestep=t,
                 encoder_hidden_states=randn(n, tokens, preset.text_dim),
                 encoder_attention_mask=_mask(preset, n, tokens, device), num_frames=f, height=lh, width=lw,
                 rope_interpolation_scale=(preset.frames_per_latent / 25, preset.vae_scale, preset.vae_scale))]


def _crop_region(grid, width, height):
    """The region of a ``height x width`` base grid that ``grid`` (rows, columns) is resized and centred into:
    ``((top, left), (bottom, right))``, as the CogVideoX pipeline's ``get_resize_crop_region_for_grid`` (not
    imported: its module imports transformers, which the bench does not need)."""
    rows, cols = grid
    if rows / cols > height / width:
        new_rows, new_cols = height, int(round(height / rows * cols))
    else:
        new_rows, new_cols = int(round(width / cols * rows)), width
    top, left = int(round((height - new_rows) / 2.0)), int(round((width - new_cols) / 2.0))
    return (top, left), (top + new_rows, left + new_cols)


def _cogvideox(preset, n, h, w, frames, t, randn, device):
    """CogVideoXPipeline (1.0, 5B): latent (B, F, 16, H/8, W/8) (frames before channels), T5 embeddings padded to
    226 tokens (no mask), the batch doubled for guidance, timestep on 0..1000, and the 3-D rotary (cos, sin) the
    pipeline computes for the grid (``_prepare_rotary_positional_embeddings``: the grid cropped to the training
    size's region)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    cfg, f = preset.unet, preset.latent_frames(frames)
    lh, lw = h // preset.vae_scale, w // preset.vae_scale
    rows, cols = lh // cfg["patch_size"], lw // cfg["patch_size"]
    crops = _crop_region((rows, cols), cfg["sample_width"] // cfg["patch_size"],
                         cfg["sample_height"] // cfg["patch_size"])
    cos, sin = get_3d_rotary_pos_embed(embed_dim=cfg["attention_head_dim"], crops_coords=crops,
                                       grid_size=(rows, cols), temporal_size=f)
    return [dict(hidden_states=randn(n, f, cfg["in_channels"], lh, lw),
                 encoder_hidden_states=randn(n, preset.text_tokens, preset.text_dim), timestep=t,
                 image_rotary_emb=(cos.to(device), sin.to(device)))]


def _flux2(preset, n, h, w, frames, t, randn, device):
    """Flux2Pipeline (dev): packed 2x2 tokens (B, H/16*W/16, 128), ids (t, row, col, layer), Mistral embeddings
    (3 layers stacked: 15360 wide) padded to 512 tokens, guidance embedded; timestep t / 1000; one call."""
    rows, cols = h // (preset.vae_scale * 2), w // (preset.vae_scale * 2)
    tokens = preset.text_tokens
    img_ids = torch.zeros(rows, cols, 4)
    img_ids[..., 1], img_ids[..., 2] = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    txt_ids = torch.zeros(tokens, 4)
    txt_ids[:, 3] = torch.arange(tokens)
    return [dict(hidden_states=randn(n, rows * cols, preset.unet["in_channels"]),
                 encoder_hidden_states=randn(n, tokens, preset.text_dim), timestep=t / 1000,
                 img_ids=img_ids.reshape(1, -1, 4).expand(n, -1, -1).to(device),
                 txt_ids=txt_ids.unsqueeze(0).expand(n, -1, -1).to(device),
                 guidance=torch.full((n,), 4.0, device=device))]


def _qwen_image(preset, n, h, w, frames, t, randn, device):
    """QwenImagePipeline: packed 2x2 tokens (B, H/16*W/16, 64), img_shapes, Qwen2.5-VL embeddings of the prompt's
    length (no padding at batch 1, so no mask); true classifier-free guidance: two calls, the negative prompt
    with its own length; timestep t / 1000."""
    rows, cols = h // (preset.vae_scale * 2), w // (preset.vae_scale * 2)
    latent = randn(n, rows * cols, preset.unet["in_channels"])
    return [dict(hidden_states=latent, encoder_hidden_states=randn(n, tokens, preset.text_dim), timestep=t / 1000,
                 img_shapes=[[(1, rows, cols)]] * n) for tokens in _texts(preset)]


def _sana(preset, n, h, w, frames, t, randn, device):
    """SanaPipeline: latent (B, 32, H/32, W/32), Gemma-2 embeddings padded to 300 tokens with their mask, the
    batch doubled for guidance, timestep on 0..1000."""
    tokens = preset.text_tokens
    return [dict(hidden_states=randn(n, preset.unet["in_channels"], h // preset.vae_scale, w // preset.vae_scale),
                 encoder_hidden_states=randn(n, tokens, preset.text_dim), timestep=t,
                 encoder_attention_mask=_mask(preset, n, tokens, device))]


def _z_image(preset, n, h, w, frames, t, randn, device):
    """ZImagePipeline: lists of per-sample latents (16, 1, H/8, W/8) and Qwen3 caption embeddings of each prompt's
    own length (no padding; the prompt's and the negative prompt's differ), classifier-free guidance in one call
    (the batch doubled: prompts then negative prompts); timestep (1000 - t) / 1000."""
    c, half = preset.unet["in_channels"], n // 2
    latents = [randn(c, 1, h // preset.vae_scale, w // preset.vae_scale) for _ in range(n)]
    lengths = [preset.prompt_tokens or preset.text_tokens] * (n - half) + [preset.negative_tokens or 1] * half
    return [dict(x=latents, t=(1000 - t) / 1000, cap_feats=[randn(k, preset.text_dim) for k in lengths])]


BUILDERS = {"wan": _wan, "z-image": _z_image, "hunyuan-video": _hunyuan_video, "ltx": _ltx, "flux2": _flux2,
            "qwen-image": _qwen_image, "sana": _sana, "cogvideox": _cogvideox}
