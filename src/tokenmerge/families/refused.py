"""Denoisers tokenmerge recognises and refuses with their reason: audio and other 1-D models, the unCLIP prior,
sub-modules that are not a whole denoiser, image models whose attention takes the (B, C, H, W) feature map (no
token sequence to merge), and multimodal models without an image grid in a fixed place (facts: docs/family-facts.md).
Refusals that belong to a supported line sit beside its families (``video``, ``kandinsky``, ``sana_video``...).
"""

from __future__ import annotations

from .spec import Refused, config_has, has, has_list, takes

__all__ = ["FAMILIES", "REFUSED"]

FAMILIES: tuple = ()

_AUDIO = "no image grid: its tokens are an audio sequence"

REFUSED: tuple = (
    Refused("unet-1d", has_list("down_blocks", "up_blocks") & has("mid_block") & ~has("conv_in")
            & config_has("extra_in_channels") & takes("sample", "timestep"),
            "no image grid: UNet1DModel (Dance Diffusion) denoises a 1-D audio signal, attending only at its lowest "
            "resolution"),
    Refused("stable-audio", has("preprocess_conv", "postprocess_conv", "global_proj") & has_list("transformer_blocks")
            & takes("global_hidden_states", "rotary_embedding"),
            _AUDIO + " (Stable Audio Open; a global token is prepended)"),
    Refused("stable-audio-3", has("preprocess_conv", "postprocess_conv", "rotary_pos_emb")
            & has_list("transformer_blocks") & takes("global_hidden_states", "local_add_cond"),
            _AUDIO + " (Stable Audio 3; learned memory tokens are prepended)"),
    Refused("minimax-music3", has("preprocess_conv", "postprocess_conv", "rotary_emb", "time_embed")
            & has_list("transformer_blocks") & ~takes("global_hidden_states"),
            _AUDIO + " (MiniMax-Music 3)"),
    Refused("ace-step", has("proj_in_conv", "proj_out_conv", "time_embed_r") & has_list("layers")
            & takes("timestep_r", "context_latents"),
            _AUDIO + " (ACE-Step music)"),
    Refused("longcat-audio-dit", has("input_embed", "text_embed", "latent_cond_embedder") & has_list("blocks")
            & takes("latent_cond"),
            _AUDIO + " (LongCat-Audio-DiT)"),
    Refused("t5-film", has("continuous_inputs_projection", "position_encoding") & has_list("decoders")
            & takes("decoder_input_tokens", "decoder_noise_time"),
            "no image grid: T5FilmDecoder (spectrogram diffusion) denoises a fixed-length sequence of mel frames"),
    Refused("prior", has("proj_to_clip_embeddings", "embedding_proj") & has_list("transformer_blocks")
            & takes("proj_embedding"),
            "no image grid: the unCLIP / Kandinsky 2 / Shap-E prior denoises one embedding; its sequence is text "
            "tokens, embeddings and a time token"),
    Refused("transformer-temporal", has("norm", "proj_in", "proj_out") & has_list("transformer_blocks")
            & takes("num_frames", "class_labels"),
            "temporal attention only: TransformerTemporalModel's tokens are the frames of each pixel, not a spatial "
            "grid (the video UNet that holds it is patched in its spatial blocks)"),
    Refused("dual-transformer-2d", has_list("transformers") & ~has("conv_in")
            & takes("hidden_states", "encoder_hidden_states", "cross_attention_kwargs"),
            "DualTransformer2DModel is a part of Versatile Diffusion's UNet (two Transformer2DModels over two "
            "conditions, mixed); patch the UNet that holds it"),
    Refused("rfd4-proteina", has("pair_repr_builder", "ca_linear") & has_list("transformer_layers")
            & takes("bb_ca", "local_latents"),
            "no image grid: RFD4-Proteina denoises a protein's residue tokens (backbone coordinates and local latents, "
            "with a pair representation over every two residues), not an image or video"),
    Refused("cosmos3-omni", has("embed_tokens", "lm_head") & has_list("layers")
            & takes("vision_tokens", "vision_sequence_indexes"),
            "Cosmos 3 Omni is a mixture-of-transformers LLM over one packed, unbatched sequence of text, vision, sound "
            "and action tokens at caller-given indexes: no image grid in a fixed place"),
    Refused("kandinsky3-unet", has("add_time_condition", "encoder_hid_proj", "conv_in") & has_list("down_blocks"),
            "Kandinsky 3's attention blocks take the (B, C, H, W) feature map and flatten it inside, and its "
            "self-attention passes the same tokens as queries and keys: no sub-module takes a token sequence to merge"),
    Refused("stable-cascade", has("clip_txt_mapper", "embedding") & has_list("down_blocks", "up_blocks")
            & takes("timestep_ratio"),
            "Stable Cascade's attention blocks take the (B, C, H, W) feature map, flattened inside the attention "
            "call with the image's own tokens among the keys: no sub-module takes a token sequence to merge"),
    Refused("unet-2d", has("conv_in", "mid_block", "time_embedding") & has_list("down_blocks", "up_blocks")
            & takes("sample", "class_labels") & ~takes("encoder_hidden_states"),
            "UNet2DModel (DDPM) attends inside its resolution blocks on the (B, C, H, W) feature map, flattened inside "
            "the attention call: no sub-module takes a token sequence to merge"),
    Refused("uvit2d", has("mlm_layer", "embed") & has_list("transformer_layers") & takes("input_ids", "micro_conds"),
            "aMUSEd's U-ViT is a masked-token model over VQ ids, called without a timestep (no denoising schedule "
            "to merge by); not supported"),
    Refused("minimax-h3", takes("token_tags", "position_ids", "video_indices", "audio_indices")
            & has_list("transformer_blocks"),
            "MiniMax-H3 runs one caller-built sequence of text, audio and video rows at caller-given positions "
            "(video_indices), conditioning and generated video rows mixed: its video tokens are not one grid in "
            "one place"),
)
