"""Full-size presets for the GPU: every block of the published model, named by the model, with random weights.

Built on the device in the target dtype (``Preset.build``: no float32 or CPU copy of a 14B model); the parameter
counts are checked on the meta device against the published ones (tests/test_cli_bench.py). Each has the model's
usual sizes (``sizes``) and frames (``default_frames``) and the pipeline's text and guidance. The GPU table
(``gpu.py``, ``tokenmerge bench --gpu``) runs them.
"""

from __future__ import annotations

from .configs import (
    COGVIDEOX_5B,
    FLUX1_DEV,
    FLUX2_DEV,
    HUNYUAN_VIDEO,
    IMAGE16,
    IMAGE32,
    LTX_2B,
    LTX_VIDEO,
    PIXART_512,
    PIXART_SIGMA_1024,
    QWEN_IMAGE,
    SANA_1600M,
    VIDEO,
    WAN_1_3B,
    WAN_14B,
    Z_IMAGE,
)
from .preset import Preset

__all__ = ["FULL_SIZE", "FULL_SIZE_NAMES"]


def _full(name: str, description: str, config: dict, **fields) -> Preset:
    return Preset(name, description + " (full size, random weights)", config, full_size=True, **fields)


FULL_SIZE = {
    "pixart-alpha-1024": _full(
        "pixart-alpha-1024", "PixArt-alpha XL/2 1024 (PixArt-alpha/PixArt-XL-2-1024-MS: 28 blocks, 1152 wide; "
        "micro-conditions on); T5 text 120 x 4096; guidance: batch doubled; usual size 1024",
        dict(PIXART_512, sample_size=128, use_additional_conditions=True), text_tokens=120, family="pixart",
        text_dim=4096, patch=2, sizes=(1024,)),
    "pixart-sigma-1024": _full(
        "pixart-sigma-1024", "PixArt-Sigma XL/2 1024 (28 blocks, 1152 wide); T5 text 300 x 4096; guidance: batch "
        "doubled; usual size 1024", PIXART_SIGMA_1024, text_tokens=300, family="pixart", text_dim=4096, patch=2,
        sizes=(1024,)),
    "flux1-dev": _full(
        "flux1-dev", "Flux.1 [dev] (19 double- and 38 single-stream blocks, 3072 wide); T5 text 512 x 4096; "
        "guidance-distilled; usual sizes 1024, 2048", FLUX1_DEV, text_tokens=512, family="flux", text_dim=4096,
        patch=2, sizes=(1024, 2048)),
    "wan2.1-1.3b": _full(
        "wan2.1-1.3b", "Wan 2.1 T2V 1.3B (30 blocks, 1536 wide); umT5 text 512 x 4096; guidance: cond + uncond "
        "calls; usual size 480x832, 81 frames", WAN_1_3B, text_tokens=512, family="wan", text_dim=4096,
        guidance="calls", sizes=("480x832",), **dict(VIDEO, default_frames=81)),
    "wan2.1-14b": _full(
        "wan2.1-14b", "Wan 2.1 T2V 14B (40 blocks, 5120 wide, ffn 13824); umT5 text 512 x 4096; guidance: cond + "
        "uncond calls; usual sizes 480x832 and 720x1280, 81 frames", WAN_14B, text_tokens=512, family="wan",
        text_dim=4096, guidance="calls", sizes=("480x832", "720x1280"), **dict(VIDEO, default_frames=81)),
    "hunyuan-video-13b": _full(
        "hunyuan-video-13b", "HunyuanVideo (20 double- and 40 single-stream blocks, 3072 wide); LLaMA text 256 x "
        "4096 (64 prompt tokens, masked); guidance-distilled; usual sizes 720x1280 and 544x960, 129 frames",
        HUNYUAN_VIDEO, text_tokens=256, prompt_tokens=64, family="hunyuan-video", text_dim=4096,
        guidance="distilled", sizes=("720x1280", "544x960"), **dict(VIDEO, default_frames=129)),
    "ltx-video-2b": _full(
        "ltx-video-2b", "LTX-Video 2B 0.9 (28 blocks, 2048 wide); T5 text 128 x 4096 (64 prompt tokens, masked); "
        "guidance: batch doubled; usual size 480x704, 161 frames", LTX_2B, text_tokens=128, prompt_tokens=64,
        family="ltx", text_dim=4096, guidance="batch", sizes=("480x704",), **dict(LTX_VIDEO, default_frames=161)),
    "cogvideox-5b": _full(
        "cogvideox-5b", "CogVideoX-5B (42 blocks, 48 heads x 64, 3-D rotary); T5 text 226 x 4096; guidance: batch "
        "doubled; usual size 480x720, 49 frames", COGVIDEOX_5B, text_tokens=226, family="cogvideox",
        text_dim=4096, guidance="batch", sizes=("480x720",), **dict(VIDEO, default_frames=49)),
    "qwen-image-20b": _full(
        "qwen-image-20b", "Qwen-Image (60 blocks, 3072 wide); Qwen2.5-VL text 128 x 3584 (negative prompt 6 "
        "tokens); true guidance: cond + uncond calls; bfloat16 (20B: 41 GB); usual sizes 1328, 1024",
        QWEN_IMAGE, text_tokens=128, negative_tokens=6, family="qwen-image", text_dim=3584, guidance="calls",
        sizes=(1328, 1024), **IMAGE16),
    "sana-1600m": _full(
        "sana-1600m", "SANA 1600M 1024px (20 blocks, 2240 wide, linear attention); Gemma-2 text 300 x 2304 (64 "
        "prompt tokens, masked); guidance: batch doubled; usual size 1024", SANA_1600M, text_tokens=300,
        prompt_tokens=64, family="sana", text_dim=2304, guidance="batch", sizes=(1024,), **IMAGE32),
    "z-image-6b": _full(
        "z-image-6b", "Z-Image (30 layers, 2 noise- and 2 caption-refiner layers, 3840 wide); Qwen3 caption 64 x "
        "2560 (negative prompt 6); guidance: batch doubled; usual size 1024", Z_IMAGE, text_tokens=64,
        prompt_tokens=64, negative_tokens=6, family="z-image", text_dim=2560, guidance="batch", sizes=(1024,),
        **IMAGE16),
    "flux2-dev": _full(
        "flux2-dev", "Flux.2 [dev] (8 double- and 48 single-stream blocks, 6144 wide); Mistral text 512 x 15360; "
        "guidance-distilled; bfloat16 only: its 32.2B parameters take 60 GiB, which leaves an 80 GB card (H100, "
        "79 GiB) about 18 GiB for activations: enough for eager steps at 1024 by estimate (not measured; CUDA "
        "graphs' memory pools may not fit), while a 141 GB card (H200) holds it at every size; usual size 1024",
        FLUX2_DEV, text_tokens=512, family="flux2", text_dim=15360, guidance="distilled", sizes=(1024,), **IMAGE16),
}
# the published models that the CPU presets (presets.py) already hold at full size, under their model names
FULL_SIZE_NAMES = {"sd1.5": "sd15", "sd2.1": "sd21", "sdxl-base": "sdxl", "sd3-medium": "sd3"}
