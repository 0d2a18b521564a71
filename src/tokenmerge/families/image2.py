"""More image families, and the image models recognised and refused (layout facts: docs/family-facts.md).

- CogView3-Plus / CogView4 / GLM-Image: ``transformer_blocks`` whose ``attn1`` joins the image and text streams as
  ``[text | image]`` inside the call and returns ``(image, text)``. CogView3-Plus runs its feed-forward on
  ``[text | image]`` (only the image part is merged); CogView4 and GLM-Image call one ``ff`` module twice (image
  rows, then text rows), so it is not merged; their rotary ``(cos, sin)`` ``(N, d)`` covers the image rows only and
  their mask ``(B, L)`` the text only. GLM-Image's key/value cache of condition images sits before the text keys.
- AuraFlow: MMDiT ``joint_transformer_blocks`` (text a separate stream), then ``single_transformer_blocks`` on
  ``[register + text | image]``.
- HunyuanDiT (+ ControlNet): ``blocks`` of self-attention ``attn1`` (rotary on the image rows), cross-attention
  ``attn2`` (rotary on its queries) and ``ff``; the long skips join whole tokens between blocks.
- HunyuanImage 2.1: HunyuanVideo's layout on an image latent: both block kinds' ``attn`` take the image and text
  streams and join them ``[image | text]``; key mask ``(B, 1, 1, N + L)``, rotary on the image rows.
- HiDream-I1: each block list entry wraps its block (``.block``); double-stream ``attn1`` joins ``[image | text]``,
  single-stream blocks run on ``[image | text]``; rotary ``(B, S, 1, d/2, 2, 2)`` over the same rows. A non-square
  latent is padded to a fixed token count after the image (``hidden_states_masks``): the padding passes whole, as
  text does.
- PRX: ``attention`` queries the image tokens over ``[text | image]`` keys; rotary ``(B, 1, N, d/2, 2, 2)``.
- NucleusMoE-Image: ``attn`` queries the image tokens over ``[image | text]`` keys; rotary ``(image, text)`` pair;
  its expert-choice MoE feed-forward routes over the whole sequence and is not merged.
- Krea 2: one ``[text | image]`` sequence from the first block; ``position_ids`` ``(L + N, 3)`` start with the text's
  rows.
- Ideogram 4: one packed ``[left padding | text | image]`` sequence per sample, each token tagged by ``indicator``
  (2: image); the image's rows are found by the tag, their grid by the (offset) position ids.
- JoyImage-Edit (+ Plus): Qwen-like dual-stream ``double_blocks``; the target image's tokens come first in the image
  stream, the reference images' after them (they pass whole, with their rotary rows).
- Flux 3: image-only ``mode_blocks.image`` (self-attention and feed-forward, parallel), then
  ``single_transformer_blocks`` that join ``[text | image | reference]`` for attention and feed-forward.
- ControlNet-XS (``UNetControlNetXSModel``): the base and control UNets' transformer blocks, level by level.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .spec import (CROSS, JOINT, MLP, SELF, TEXT_AFTER, TEXT_BEFORE, TEXT_NONE, Arg, Blocks, BlockSite, Family,
                   IdsGrid, LatentGrid, Mask, Refused, Rotary, ShapesGrid, Target, Whole, block_has, has, has_list,
                   takes)
from .unet import BASIC_TARGETS, transformer_blocks_in

__all__ = ["COGVIEW3PLUS", "COGVIEW4", "GLM_IMAGE", "AURAFLOW", "HUNYUAN_DIT", "HUNYUAN_IMAGE", "HIDREAM", "PRX",
           "NUCLEUS_MOE", "KREA2", "IDEOGRAM4", "QWEN_IMAGE_21", "JOYIMAGE_EDIT", "JOYIMAGE_EDIT_PLUS", "FLUX3", "CONTROLNET_XS", "FAMILIES",
           "REFUSED"]

_PATCH = ("patch_size", "patch_size")


@dataclass(frozen=True)
class _Lists:
    """Block lists reached by a dotted path (``mode_blocks.image``: a ``ModuleDict`` entry), whose entries may wrap
    their block in an attribute (``inner``: HiDream's ``HiDreamBlock.block``). Used as a family's ``levels``: every
    block at level 0. ``None`` when a listed block lacks its ``requires`` (not this family)."""

    lists: tuple[Blocks, ...]
    inner: str = ""

    def __call__(self, module: nn.Module, path: str) -> list[BlockSite] | None:
        sites = []
        for spec in self.lists:
            seq = module
            for part in spec.attr.split("."):
                seq = getattr(seq, part, None)
            if not isinstance(seq, nn.ModuleList):
                continue
            for i, entry in enumerate(seq):
                block = getattr(entry, self.inner, None) if self.inner else entry
                if not isinstance(block, nn.Module) or not has(*spec.requires)(block):
                    return None
                where = f"{spec.attr}.{i}" + (f".{self.inner}" if self.inner else "")
                targets = tuple(t for t in spec.targets if isinstance(getattr(block, t.attr, None), nn.Module))
                sites.append(BlockSite(f"{path}.{where}" if path else where, block, 0, targets, spec.text,
                                       spec.whole))
        return sites


# ---- CogView3-Plus, CogView4, GLM-Image ----------------------------------------------------------------------
_COGVIEW = has("patch_embed", "time_condition_embed") & has_list("transformer_blocks") \
    & takes("original_size", "target_size", "crop_coords") \
    & block_has("transformer_blocks", "attn1", "ff", "norm2_context")
_FF_TWICE = ("calls one feed-forward module on the image rows and then on the text rows, so it cannot be merged "
             "around; use merge_mlp=False")
# attn1 joins [text | image] inside; rotary (cos, sin) (N, d) on the image rows; the mask (B, L) covers the text
_COGVIEW4_ATTN = Target("attn1", JOINT, rotary=Rotary("image_rotary_emb", text=TEXT_NONE),
                        mask=Mask("attention_mask", image=False), keys=TEXT_BEFORE)

COGVIEW3PLUS = Family(
    "cogview3plus",
    match=_COGVIEW & ~has("rope"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("transformer_blocks", (Target("attn1", JOINT, keys=TEXT_BEFORE),
                                          Target("ff", MLP, text=TEXT_BEFORE)), requires=("attn1", "ff")),),
    description="CogView3-Plus (joint [text | image] attention and feed-forward)",
    examples=("cogview3plus",),
)

COGVIEW4 = Family(
    "cogview4",
    match=_COGVIEW & has("rope") & takes("image_rotary_emb"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("transformer_blocks", (_COGVIEW4_ATTN, Target("ff", MLP, refuse="CogView4 " + _FF_TWICE)),
                   requires=("attn1", "ff")),),
    shared_plan=True,
    description="CogView4 (joint [text | image] attention; the feed-forward is not merged)",
    examples=("cogview4",),
)

GLM_IMAGE = Family(
    "glm-image",
    match=has("image_projector", "time_condition_embed", "prior_token_embedding", "rope") & has_list("transformer_blocks")
    & takes("prior_token_id", "target_size") & block_has("transformer_blocks", "attn1", "ff"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("transformer_blocks", (_COGVIEW4_ATTN, Target("ff", MLP, refuse="GLM-Image " + _FF_TWICE)),
                   requires=("attn1", "ff")),),
    shared_plan=True,
    description="GLM-Image (CogView4's layout; condition images' cached keys pass whole; the feed-forward is not "
                "merged)",
    examples=("glm-image",),
)

# ---- AuraFlow -------------------------------------------------------------------------------------------------
AURAFLOW = Family(
    "auraflow",
    match=has("pos_embed", "time_step_embed", "context_embedder")
    & has_list("joint_transformer_blocks", "single_transformer_blocks")
    & block_has("joint_transformer_blocks", "attn", "ff", "ff_context"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(
        Blocks("joint_transformer_blocks", (Target("attn", JOINT, keys=TEXT_BEFORE), Target("ff", MLP)),
               requires=("attn", "ff")),
        Blocks("single_transformer_blocks", (Target("attn", JOINT, text=TEXT_BEFORE, keys=TEXT_BEFORE),
                                             Target("ff", MLP, text=TEXT_BEFORE)),
               text=TEXT_BEFORE, requires=("attn", "ff")),
    ),
    timestep=Arg("timestep", scale=1000.0),
    description="AuraFlow (MMDiT blocks, then single blocks on [registers + text | image]; 0..1 timesteps)",
    examples=("aura-flow",),
)

# ---- HunyuanDiT, HunyuanImage ---------------------------------------------------------------------------------
_HYDIT_ROTARY = Rotary("image_rotary_emb", text=TEXT_NONE)  # (cos, sin) each (N, d), from the pipeline
HUNYUAN_DIT = Family(
    "hunyuan-dit",
    match=has("pos_embed", "time_extra_emb", "text_embedder") & has_list("blocks")
    & takes("encoder_hidden_states_t5", "image_meta_size") & block_has("blocks", "attn1", "attn2", "ff"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("blocks", (Target("attn1", SELF, rotary=_HYDIT_ROTARY, keys=TEXT_NONE),
                              Target("attn2", CROSS, rotary=_HYDIT_ROTARY), Target("ff", MLP)),
                   requires=("attn1", "ff")),),
    shared_plan=True,
    description="HunyuanDiT 1.x (+ ControlNet)",
    examples=("hunyuan-dit", "hunyuan-dit-controlnet"),
)

_HYIMAGE_ATTN = Target("attn", JOINT, rotary=Rotary("image_rotary_emb", text=TEXT_NONE),
                       mask=Mask("attention_mask", text=TEXT_AFTER), keys=TEXT_AFTER)
HUNYUAN_IMAGE = Family(
    "hunyuan-image",
    match=has("x_embedder", "context_embedder", "time_guidance_embed", "rope")
    & has_list("transformer_blocks", "single_transformer_blocks")
    & block_has("single_transformer_blocks", "attn", "proj_mlp", "act_mlp"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("transformer_blocks", (_HYIMAGE_ATTN, Target("ff", MLP)), requires=("attn", "ff")),
            Blocks("single_transformer_blocks", (_HYIMAGE_ATTN,), requires=("attn", "proj_mlp"))),
    shared_plan=True,
    description="HunyuanImage 2.1 (+ refiner): HunyuanVideo's double and single blocks on an image",
    examples=("hunyuan-image-2.1",),
)

# ---- HiDream-I1 -----------------------------------------------------------------------------------------------
# [image | padding | text] everywhere: what follows the image passes whole, its rotary rows and mask entries too
_HIDREAM_ATTN = Target("attn1", JOINT, text=TEXT_AFTER,
                       rotary=Rotary("image_rotary_emb", token_axis=1, text=TEXT_AFTER),
                       mask=Mask("hidden_states_masks", text=TEXT_AFTER), keys=TEXT_AFTER)
_HIDREAM_FF = Target("ff_i", MLP, text=TEXT_AFTER)
HIDREAM = Family(
    "hidream",
    match=has("x_embedder", "t_embedder", "p_embedder", "pe_embedder")
    & has_list("double_stream_blocks", "single_stream_blocks") & takes("encoder_hidden_states_llama3"),
    grid=LatentGrid(Arg("hidden_states", fallback_index=0), patch=_PATCH, axes=(2, 3)),  # (B, C, H, W) only
    levels=_Lists((Blocks("double_stream_blocks", (_HIDREAM_ATTN, _HIDREAM_FF), text=TEXT_AFTER,
                          requires=("attn1", "ff_i")),
                   Blocks("single_stream_blocks", (_HIDREAM_ATTN, _HIDREAM_FF), text=TEXT_AFTER,
                          requires=("attn1", "ff_i"))), inner="block"),
    timestep=Arg("timesteps", also=("timestep",)),
    shared_plan=True,
    description="HiDream-I1 (double and single stream blocks, MoE feed-forwards; a non-square latent's padding "
                "passes whole)",
    examples=("hidream",),
)

# ---- PRX, NucleusMoE-Image ------------------------------------------------------------------------------------
PRX = Family(
    "prx",
    match=has("img_in", "txt_in", "pe_embedder") & has_list("blocks") & block_has("blocks", "attention", "img_pre_norm"),
    grid=LatentGrid(patch=_PATCH),
    blocks=(Blocks("blocks", (Target("attention", JOINT, rotary=Rotary("image_rotary_emb", token_axis=2,
                                                                          text=TEXT_NONE),
                                     mask=Mask("attention_mask", image=False), keys=TEXT_BEFORE),),
                   requires=("attention",)),),
    timestep=Arg("timestep", scale=1000.0),
    shared_plan=True,
    description="PRX (image queries over [text | image] keys; 0..1 timesteps; the gated MLP is not a sub-module)",
    examples=("prx",),
)

NUCLEUS_MOE = Family(
    "nucleus-moe-image",
    match=has("img_in", "pos_embed", "time_text_embed") & has_list("transformer_blocks") & takes("img_shapes")
    & block_has("transformer_blocks", "attn", "img_mlp", "encoder_proj"),
    grid=ShapesGrid(Arg("img_shapes"), rank=2),
    blocks=(Blocks("transformer_blocks", (
        Target("attn", JOINT, rotary=Rotary("image_rotary_emb", layout="image_text_pair", text=TEXT_AFTER),
               mask=Mask("attention_mask", text=TEXT_AFTER), keys=TEXT_AFTER),
        Target("img_mlp", MLP, refuse="NucleusMoE-Image's expert-choice MoE feed-forward picks tokens over the whole "
                                      "sequence and reads the unmodulated tokens too; use merge_mlp=False")),
        requires=("attn", "img_mlp")),),
    timestep=Arg("timestep", scale=1000.0),
    shared_plan=True,
    description="NucleusMoE-Image (image queries over [image | text] keys; the MoE feed-forward is not merged)",
    examples=("nucleus-moe-image",),
)

# ---- Krea 2 ---------------------------------------------------------------------------------------------------
KREA2 = Family(
    "krea2",
    match=has("text_fusion", "rotary_emb", "img_in", "txt_in") & has_list("transformer_blocks")
    & takes("position_ids", "encoder_attention_mask") & block_has("transformer_blocks", "attn", "ff"),
    grid=IdsGrid(Arg("position_ids"), axes=(1, 2), leading=Arg("encoder_hidden_states")),
    blocks=(Blocks("transformer_blocks", (
        Target("attn", JOINT, text=TEXT_BEFORE, rotary=Rotary("image_rotary_emb", text=TEXT_BEFORE),
               mask=Mask("attention_mask", text=TEXT_BEFORE), keys=TEXT_BEFORE),
        Target("ff", MLP, text=TEXT_BEFORE)), text=TEXT_BEFORE, requires=("attn", "ff")),),
    timestep=Arg("timestep", scale=1000.0),
    shared_plan=True,
    description="Krea 2 (one [text | image] sequence; 0..1 timesteps)",
    examples=("krea2",),
)

# ---- Ideogram 4 ----------------------------------------------------------------------------------------------
# One packed sequence per sample from the input on, tagged per token: [left padding | text | image] (the pipeline's
# layout; the unconditional transformer gets the image alone). The image's rows are those tagged 2; their position
# ids (t, h, w) are offset by 65536 (the span is what counts). Rotary (cos, sin) (B, S, d) and the segment mask
# (B, 1, S, S), made inside the call, are indexed like the tokens.
_I4_ROTARY = Rotary("image_rotary_emb", text=TEXT_BEFORE)
_I4_MASK = Mask("attention_mask", text=TEXT_BEFORE)

IDEOGRAM4 = Family(
    "ideogram4",
    match=takes("indicator", "segment_ids", "position_ids") & has_list("layers")
    & block_has("layers", "attention", "feed_forward"),
    grid=IdsGrid(Arg("position_ids"), axes=(1, 2), image_axis=None, tag=Arg("indicator"), tag_value=2),
    blocks=(Blocks("layers", (
        Target("attention", JOINT, text=TEXT_BEFORE, rotary=_I4_ROTARY, mask=_I4_MASK, keys=TEXT_BEFORE),
        Target("feed_forward", MLP, text=TEXT_BEFORE)), text=TEXT_BEFORE, requires=("attention", "feed_forward"),
        whole=Whole(rotary=_I4_ROTARY, mask=_I4_MASK, per_token=("adaln_input",))),),
    timestep=Arg("timestep", scale=1000.0, reverse=True),  # model time 0..1, 0 = noise
    shared_plan=True,
    description="Ideogram 4 (one packed [text | image] sequence tagged per token; conditional and unconditional "
                "transformers)",
    examples=("ideogram4",),
)

# ---- Qwen-Image 2.1 -------------------------------------------------------------------------------------------
# One single-stream sequence from the first block: the VLM's text with condition images spliced in (each image slot
# expanded to its 2x2 latent tokens), then the target image's tokens in raster order, last. The default processor
# runs the block-causal prefill as one SDPA call per prefix segment plus one for the target rows, over a (B, S) key
# mask ``key_valid``; a prefix KV cache holds the prefix's keys, which the target never changes (causal).
_Q21_MASK = Mask("attention_mask", text=TEXT_BEFORE, same=("key_valid",))

QWEN_IMAGE_21 = Family(
    "qwen-image-2.1",
    match=has("img_in", "txt_in", "modulation") & has_list("transformer_blocks") & takes("img_mask", "img_shapes"),
    grid=ShapesGrid(Arg("img_shapes"), rank=2, last=True),
    blocks=(Blocks("transformer_blocks", (
        Target("attn", JOINT, text=TEXT_BEFORE, rotary=Rotary("rotary_emb", text=TEXT_BEFORE), mask=_Q21_MASK),
        Target("img_mlp", MLP, text=TEXT_BEFORE)), text=TEXT_BEFORE, requires=("attn", "img_mlp")),),
    timestep=Arg("timestep", scale=1000.0),  # 0..1, 1 = noise
    shared_plan=True,
    todo="its attention processor splits the block-causal prefill into one attention call per prefix segment, "
         "most of which hold no image keys to pool; use ToMe (apply_patch)",
    description="Qwen-Image 2.1 (one block-causal [text and condition images | target image] sequence; the "
                "target merged, its key mask and rotary rows with it; prefix KV cache)",
    examples=("qwen-image-2.1",),
)

# ---- JoyImage-Edit (+ Plus) -----------------------------------------------------------------------------------
_JOY = has("img_in", "condition_embedder") & has_list("double_blocks") \
    & block_has("double_blocks", "attn", "img_mlp", "txt_mlp")
_JOY_MLP = Target("img_mlp", MLP, text=TEXT_AFTER)  # [target | references]: the references pass whole

JOYIMAGE_EDIT = Family(
    "joyimage-edit",
    match=_JOY & ~takes("shape_list"),
    grid=LatentGrid(rank=3, patch=("patch_size", "patch_size", "patch_size")),
    blocks=(Blocks("double_blocks", (
        Target("attn", JOINT, text=TEXT_AFTER, rotary=Rotary("image_rotary_emb", layout="image_text_pair",
                                                             text=TEXT_AFTER), keys=TEXT_AFTER),
        _JOY_MLP), text=TEXT_AFTER, requires=("attn", "img_mlp")),),
    shared_plan=True,
    description="JoyImage-Edit (target first, reference images pass whole)",
    examples=("joyimage-edit",),
)

JOYIMAGE_EDIT_PLUS = Family(
    "joyimage-edit-plus",
    match=_JOY & takes("shape_list"),
    grid=ShapesGrid(Arg("shape_list"), rank=3),
    blocks=(Blocks("double_blocks", (
        Target("attn", JOINT, text=TEXT_AFTER, rotary=Rotary("image_rotary_emb", text=TEXT_AFTER),
               mask=Mask("attention_mask", text=TEXT_AFTER), keys=TEXT_AFTER),
        _JOY_MLP), text=TEXT_AFTER, requires=("attn", "img_mlp")),),
    shared_plan=True,
    description="JoyImage-Edit-Plus (pre-patchified items: target first, references and padding pass whole)",
    examples=("joyimage-edit-plus",),
)

# ---- Flux 3 ---------------------------------------------------------------------------------------------------
_FLUX3_JOINT = Rotary("image_rotary_emb", text=TEXT_BEFORE)  # (cos, sin) over [text | image | references]
FLUX3 = Family(
    "flux3",
    match=has("x_embedders", "mode_blocks", "pos_embed") & has_list("single_transformer_blocks", "txt_mode_blocks")
    & takes("img_ids", "image_cond_ids"),
    grid=IdsGrid(Arg("img_ids"), axes=(1, 2), refs=Arg("image_cond_ids")),
    levels=_Lists((
        Blocks("mode_blocks.image", (Target("attn", SELF, rotary=Rotary("image_rotary_emb", text=TEXT_NONE),
                                            keys=TEXT_NONE), Target("ff", MLP)), requires=("attn", "ff")),
        Blocks("single_transformer_blocks", (Target("attn", JOINT, text=TEXT_BEFORE, rotary=_FLUX3_JOINT,
                                                    keys=TEXT_BEFORE),
                                             Target("ff", MLP, text=TEXT_BEFORE)), requires=("attn", "ff")),
    )),
    timestep=Arg("timestep", scale=1000.0),
    shared_plan=True,
    description="Flux 3 (image mode blocks, then single blocks on [text | image | references]; 0..1 timesteps)",
    examples=("flux3", "flux3-ref"),
)


# ---- ControlNet-XS --------------------------------------------------------------------------------------------
def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def _xs_levels(module: nn.Module, path: str) -> list[BlockSite]:
    """UNetControlNetXSModel: base and control transformer blocks of each level (the two UNets run side by side,
    at the same resolution)."""
    blocks, level = [], 0
    for i, block in enumerate(module.down_blocks):
        blocks += transformer_blocks_in(block, _join(path, f"down_blocks.{i}"), level)
        if getattr(block, "base_downsamplers", None) is not None:
            level += 1
    blocks += transformer_blocks_in(module.mid_block, _join(path, "mid_block"), level)
    for i, block in enumerate(module.up_blocks):
        blocks += transformer_blocks_in(block, _join(path, f"up_blocks.{i}"), level)
        if getattr(block, "upsamplers", None) is not None:
            level -= 1
    return blocks


CONTROLNET_XS = Family(
    "controlnet-xs",
    match=has("base_conv_in", "ctrl_conv_in", "mid_block") & has_list("down_blocks", "up_blocks")
    & takes("sample", "controlnet_cond"),
    grid=LatentGrid(Arg("sample", fallback_index=0)),
    levels=_xs_levels,
    description="ControlNet-XS (UNetControlNetXSModel: the base and control UNets' transformer blocks)",
    examples=("controlnet-xs",),
)

FAMILIES: tuple = (COGVIEW3PLUS, COGVIEW4, GLM_IMAGE, AURAFLOW, HUNYUAN_DIT, HUNYUAN_IMAGE, HIDREAM, PRX, NUCLEUS_MOE,
                   KREA2, IDEOGRAM4, QWEN_IMAGE_21, JOYIMAGE_EDIT, JOYIMAGE_EDIT_PLUS, FLUX3, CONTROLNET_XS)

# ---- recognised and refused -----------------------------------------------------------------------------------
REFUSED: tuple = (
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
)
