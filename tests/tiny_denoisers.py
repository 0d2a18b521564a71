"""A catalogue of tiny, random-weight instances of every denoiser class diffusers ships, with their inputs.

Each entry builds its model in well under a second on a CPU (seeded, float32, ``.eval()``) and makes the keyword
arguments of one forward call for any batch and token grid, the way the model's pipeline makes them (latent shape
from the grid and patch sizes, ``img_ids``/``img_shapes``/position ids consistent with the grid, the timestep on the
scale the pipeline passes). Configs are the smallest the model allows: 1-2 blocks of each kind, a few heads, tiny
widths. Layout facts for each family are in ``docs/family-facts.md``.

Example:
    >>> from tiny_denoisers import CATALOGUE, available, output_tensor
    >>> entry = CATALOGUE["wan"]
    >>> if available("wan") is None:
    ...     model = entry.build()
    ...     out = output_tensor(model(**entry.inputs(batch=1, grid=(2, 4, 6))))
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch

# --------------------------------------------------------------------------------------------------------------
# the record


@dataclass(frozen=True)
class TinyDenoiser:
    """One tiny denoiser and how to call it.

    Args:
        name: short id ("wan", "flux2-klein", "unet-sdxl", ...).
        cls: the diffusers class name.
        kind: "image" | "video" | "audio" | "other".
        build: returns the seeded tiny model (float32, eval mode).
        inputs: ``inputs(batch=2, grid=None, seed=0) -> dict`` of forward kwargs; ``grid`` is in tokens after
            patchifying: (H, W) for images, (F, H, W) for video (F latent frames after temporal patching),
            (L,) for 1-D models.
        grid: the default token grid.
        notes: what is special about this entry.
        latent: the forward argument that holds the noisy latent (or its packed tokens).
        expect: ``expect(inputs) -> shape`` of the main output for those inputs; None = the shape of
            ``inputs[latent]``.
        since: the first diffusers version with this class and config ("0.33.0"); older ones are skipped.
        fixed_grid: the model only accepts its default grid (learned position tables of a fixed size).
        alt_grid: a second valid grid for tests; None = the default grid one wider on its last axis (or the
            default grid itself when ``fixed_grid``).
        per_sample: the model returns a list with one tensor per batch item (``output_tensor`` stacks it).
        requires: modules the model's forward imports (e.g. "torchvision"); missing ones make it unavailable.
    """

    name: str
    cls: str
    kind: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[..., dict]
    grid: tuple[int, ...]
    notes: str = ""
    latent: str = "hidden_states"
    expect: Callable[[dict], tuple[int, ...]] | None = field(default=None, repr=False)
    since: str = ""
    fixed_grid: bool = False
    alt_grid: tuple[int, ...] | None = None
    per_sample: bool = False
    requires: tuple[str, ...] = ()

    def second_grid(self) -> tuple[int, ...]:
        """A second valid grid, non-square where the model allows it."""
        if self.alt_grid is not None:
            return tuple(self.alt_grid)
        if self.fixed_grid:
            return self.grid
        return (*self.grid[:-1], self.grid[-1] + 1)

    def expected_shape(self, inputs: dict) -> tuple[int, ...]:
        """The shape the main output must have for ``inputs``."""
        if self.expect is not None:
            return tuple(self.expect(inputs))
        x = inputs[self.latent]
        if isinstance(x, (list, tuple)):
            return (len(x), *x[0].shape)
        return tuple(x.shape)


CATALOGUE: dict[str, TinyDenoiser] = {}


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def available(name: str) -> str | None:
    """None if the entry ``name`` can be built on the installed diffusers, else the reason it cannot.

    Example:
        >>> available("unet-sd") is None
        True
    """
    entry = CATALOGUE[name]
    try:
        import diffusers
    except ImportError:  # pragma: no cover
        return "diffusers is not installed"
    try:
        _cls(entry.cls)
    except Exception:
        return f"class {entry.cls} not in diffusers {diffusers.__version__}"
    for module in entry.requires:
        if importlib.util.find_spec(module) is None:
            return f"{entry.cls} needs {module}, which is not installed"
    if entry.since and _version_tuple(diffusers.__version__) < _version_tuple(entry.since):
        return f"{entry.cls} as built here needs diffusers>={entry.since} (installed {diffusers.__version__})"
    return None


def all_tensors(out) -> list:
    """Every tensor of a forward call's output, in order (a ControlNet's residuals of every level too).

    Example:
        >>> [t.shape[0] for t in all_tensors(([torch.zeros(1)], {"b": torch.zeros(2)}))]
        [1, 2]
    """
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    return [t for o in out for t in all_tensors(o)] if isinstance(out, (list, tuple)) else []


def skip_unavailable(name: str) -> None:
    """Skip the test where the entry ``name`` cannot be built on this diffusers (``available``'s reason)."""
    import pytest

    reason = available(name)
    if reason is not None:
        pytest.skip(reason)


def outputs_of(model, calls) -> list:
    """Each call's outputs, every tensor of them flattened into one (float), without gradients."""
    with torch.no_grad():
        return [torch.cat([t.flatten().float() for t in all_tensors(model(**c))]) for c in calls]


def progress_of(model, call) -> float:
    """The denoising progress the patch reads from ``call``'s timestep (in [0, 1], 1000 training timesteps)."""
    import tokenmerge

    bound = tokenmerge.engine.find_denoisers(model)[0].timestep
    return bound.progress(bound.read((), call), 1000)


def schedule_of(config, model, calls) -> list[bool]:
    """Which of ``calls`` (one generation, a call a step) a cache's ``config`` computes, at the progress each call's
    timestep gives (its schedule may follow the progress: ``gap``)."""
    out, last = [], None
    for k, call in enumerate(calls):
        progress = progress_of(model, call)
        computed = config.computes(k, progress, last)
        out.append(computed)
        last = progress if computed else last
    return out


def stopped_and_restarted(model, calls) -> bool:
    """Whether a generation over ``calls``, then one stopped after its first two calls, then the whole one again give
    the first generation's outputs (a patch's state starts over at each generation)."""
    first = outputs_of(model, calls)
    outputs_of(model, calls[:2])  # stopped after its second step
    again = outputs_of(model, calls)
    return all(torch.equal(a, b) for a, b in zip(first, again))


def lora_after_the_patch(model, calls) -> tuple:
    """A patched ``model`` over ``calls``, then with a LoRA loaded after the patch (on the attention projections),
    then unpatched with the LoRA: ``(patched, patched with the LoRA, unpatched with the LoRA)`` outputs."""
    import pytest

    pytest.importorskip("peft")
    from peft import LoraConfig

    import tokenmerge

    plain = outputs_of(model, calls)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                 init_lora_weights=False))
    with_lora = outputs_of(model, calls)
    tokenmerge.remove_patch(model)
    return plain, with_lora, outputs_of(model, calls)


def compiled_twice(model, calls) -> tuple:
    """``model`` compiled (``backend="eager"``) run over ``calls`` twice: ``(first outputs, second outputs, graph
    breaks)``; asserts that the second generation compiled nothing and broke no graph again."""
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    got = outputs_of(compiled, calls)
    frames, breaks = counters["frames"]["total"], dict(counters["graph_break"])
    again = outputs_of(compiled, calls)
    assert counters["frames"]["total"] == frames, "a second generation compiled again"
    assert dict(counters["graph_break"]) == breaks, "a second generation broke the graph again"
    return got, again, breaks


def output_tensor(out, entry: TinyDenoiser | str | None = None) -> torch.Tensor:
    """The main output of a forward call.

    ``out.sample`` / ``out[0]`` for denoisers (the video for LTX-2's ``(video, audio)``); the first residual for
    ControlNets (``down_block_res_samples[0]``, ``controlnet_block_samples[0]``, the first value of Z-Image
    ControlNet's ``{layer: residual}``); per-sample lists (Z-Image's list of ``(C, F, H, W)``) are stacked. Lists
    of equal-shape tensors of 4 or more dimensions count as per-sample; pass ``entry`` to be explicit.

    Args:
        out: what the model's forward returned.
        entry: the catalogue entry (or its name); its ``per_sample`` flag decides whether a list is stacked.

    Example:
        >>> output_tensor((torch.zeros(1, 2),)).shape
        torch.Size([1, 2])
    """
    if isinstance(entry, str):
        entry = CATALOGUE[entry]
    per_sample = None if entry is None else entry.per_sample
    if isinstance(out, torch.Tensor):
        return out
    for attr in ("sample", "predicted_image_embedding", "down_block_res_samples", "controlnet_block_samples",
                 "noise_pred", "hidden_states"):
        value = getattr(out, attr, None)
        if value is not None:
            return _main(value, per_sample)
    return _main(out, per_sample)


def _main(out, per_sample):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return _main(next(iter(out.values())), per_sample)
    if isinstance(out, list) and out and all(isinstance(o, torch.Tensor) for o in out):
        same = all(o.shape == out[0].shape for o in out)
        if per_sample or (per_sample is None and same and out[0].dim() >= 4):
            return torch.stack(out)  # one tensor per batch item (Z-Image)
    if isinstance(out, (list, tuple)):
        if out and isinstance(out[0], list):
            return _main(out[0], per_sample)  # (list of per-sample tensors,) from return_dict=False
        return _main(out[0], per_sample)
    raise TypeError(f"cannot find the main tensor in {type(out).__name__}")


@contextlib.contextmanager
def cpu_fast():
    """A context manager for running the catalogue on a shared CPU: one intra-op thread, oneDNN off.

    The models are so small that thread hand-offs dominate: on a loaded 2-core machine a 4-token matmul waits
    ~10 ms for its second thread, and with oneDNN on the first call of each new convolution shape builds a
    primitive (~2 s for a tiny UNet). With one thread and oneDNN off the forwards take milliseconds.

    Example:
        >>> with cpu_fast():
        ...     pass
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.backends.mkldnn.flags(enabled=False):
            yield
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------------------
# helpers


_CLASS_MODULES = ("diffusers", "diffusers.models", "diffusers.models.transformers", "diffusers.models.unets",
                  "diffusers.models.controlnets")


def _cls(name: str):
    """The diffusers class ``name`` (top-level or only in ``diffusers.models.*``), or AttributeError."""
    for module in _CLASS_MODULES:
        try:
            value = getattr(importlib.import_module(module), name, None)
        except ImportError:
            value = None
        if value is not None:
            return value
    raise AttributeError(name)


def _make(cls_name: str, seed: int = 0, post: Callable[[torch.nn.Module], None] | None = None, **config):
    """Build ``diffusers.<cls_name>(**config)`` seeded, float32, eval."""

    def build() -> torch.nn.Module:
        torch.manual_seed(seed)
        model = _cls(cls_name)(**config).float().eval()
        if post is not None:
            with torch.no_grad():
                post(model)
        return model

    return build


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _t(batch: int, value: float) -> torch.Tensor:
    return torch.full((batch,), float(value))


def _randomize(*module_names: str, std: float = 0.1):
    """A post-build step: give zero-initialised modules (ControlNet outputs, final layers) random weights."""

    def post(model):
        for name in module_names:
            module = model.get_submodule(name)
            for p in module.parameters():
                p.normal_(0.0, std)

    return post


def _add(name, cls, kind, grid, build, inputs, notes="", latent="hidden_states", expect=None, since="",
         fixed_grid=False, alt_grid=None, per_sample=False, requires=()):
    if name in CATALOGUE:
        raise ValueError(f"duplicate catalogue entry {name!r}")
    CATALOGUE[name] = TinyDenoiser(name=name, cls=cls, kind=kind, build=build, inputs=inputs, grid=tuple(grid),
                                   notes=notes, latent=latent, expect=expect, since=since,
                                   fixed_grid=fixed_grid, alt_grid=alt_grid, per_sample=per_sample,
                                   requires=tuple(requires))


def _grid(grid, default):
    return tuple(default if grid is None else grid)


def _cartesian_ids(*axes: torch.Tensor) -> torch.Tensor:
    return torch.cartesian_prod(*axes) if len(axes) > 1 else axes[0][:, None]


def _flux_img_ids(h: int, w: int, first: int = 0) -> torch.Tensor:
    """Flux.1-style (H*W, 3) ids: (first, row, col), as FluxPipeline._prepare_latent_image_ids."""
    ids = torch.zeros(h, w, 3)
    ids[..., 0] = first
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def _pack2x2(x: torch.Tensor) -> torch.Tensor:
    """(B, C, 2h, 2w) -> (B, h*w, 4C), as Flux/Qwen pipelines' _pack_latents."""
    b, c, hh, ww = x.shape
    x = x.view(b, c, hh // 2, 2, ww // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (hh // 2) * (ww // 2), c * 4)


# ==============================================================================================================
# Flux.2 (dev: guidance-embedded; Klein: no guidance embedding), packed tokens, 4-axis ids (T, H, W, L)

TXT = 5  # text tokens in every entry (odd on purpose: no accidental divisibility)


def _flux2_ids(h: int, w: int, t: int = 0) -> torch.Tensor:
    """(H*W, 4) ids (t, row, col, 0), as Flux2Pipeline._prepare_latent_ids / _prepare_image_ids."""
    return _cartesian_ids(torch.tensor([t]), torch.arange(h), torch.arange(w), torch.arange(1))


def _flux2_inputs(default, in_ch=16, text_dim=32, guidance=True, refs=0):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        ids = [_flux2_ids(h, w)] + [_flux2_ids(h, w, t=10 + 10 * i) for i in range(refs)]
        img_ids = torch.cat(ids).unsqueeze(0).expand(batch, -1, -1)
        txt_ids = _cartesian_ids(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(TXT))
        kw = dict(
            hidden_states=_randn(g, batch, h * w * (1 + refs), in_ch),  # [image | reference images]
            encoder_hidden_states=_randn(g, batch, TXT, text_dim),
            timestep=_t(batch, 0.6),  # the pipeline passes t / 1000
            img_ids=img_ids,
            txt_ids=txt_ids.unsqueeze(0).expand(batch, -1, -1),
        )
        if guidance:
            kw["guidance"] = torch.full((batch,), 4.0)
        return kw

    return inputs


_FLUX2 = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32, mlp_ratio=3.0,
              axes_dims_rope=(4, 4, 4, 4))
_add("flux2", "Flux2Transformer2DModel", "image", (4, 4),
     _make("Flux2Transformer2DModel", guidance_embeds=True, **_FLUX2), _flux2_inputs((4, 4)),
     notes="Flux.2 [dev]: 1 double + 2 parallel single blocks; latent = packed 2x2 tokens (B, H*W, 4C)",
     since="0.36.0")
_add("flux2-klein", "Flux2Transformer2DModel", "image", (4, 4),
     _make("Flux2Transformer2DModel", guidance_embeds=False, **_FLUX2), _flux2_inputs((4, 4), guidance=False),
     notes="Flux.2 Klein: no guidance embedding", since="0.36.0")
_add("flux2-klein-ref", "Flux2Transformer2DModel", "image", (4, 4),
     _make("Flux2Transformer2DModel", guidance_embeds=False, **_FLUX2),
     _flux2_inputs((4, 4), guidance=False, refs=1),
     notes="Klein edit: one reference image's tokens appended after the image's (ids T=10); the pipeline keeps "
           "the first H*W output rows", since="0.36.0")


# ==============================================================================================================
# Qwen-Image (+ Edit, Edit-2511 zero_cond_t, Layered): packed 2x2 tokens, img_shapes, (image, text) complex rope


def _qwen_inputs(default, in_ch=16, text_dim=32, refs=0, layers=0, additional_t=False):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        shapes = [(1, h, w)] * (1 + layers + refs)
        kw = dict(
            hidden_states=_randn(g, batch, h * w * len(shapes), in_ch),  # [image | layers | references]
            encoder_hidden_states=_randn(g, batch, TXT, text_dim),
            encoder_hidden_states_mask=torch.ones(batch, TXT, dtype=torch.long),
            timestep=_t(batch, 0.6),  # the pipeline passes t / 1000
            img_shapes=[list(shapes)] * batch,
        )
        if additional_t:
            kw["additional_t_cond"] = torch.zeros(batch, dtype=torch.long)
        return kw

    return inputs


_QWEN = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
_add("qwen-image", "QwenImageTransformer2DModel", "image", (4, 4),
     _make("QwenImageTransformer2DModel", **_QWEN), _qwen_inputs((4, 4)),
     notes="2 dual-stream blocks; latent = packed 2x2 tokens (B, H*W, 4C)", since="0.35.0")
_add("qwen-image-edit", "QwenImageTransformer2DModel", "image", (4, 4),
     _make("QwenImageTransformer2DModel", **_QWEN), _qwen_inputs((4, 4), refs=1),
     notes="Edit / Edit-Plus: reference-image tokens appended after the image's; img_shapes lists both "
           "(the reference gets rope frame index 1)", since="0.35.0")
_add("qwen-image-edit-2511", "QwenImageTransformer2DModel", "image", (4, 4),
     _make("QwenImageTransformer2DModel", zero_cond_t=True, **_QWEN), _qwen_inputs((4, 4), refs=1),
     notes="zero_cond_t=True: reference tokens are modulated with t=0 through a per-token modulate_index "
           "built from img_shapes", since="0.36.0")
_add("qwen-image-layered", "QwenImageTransformer2DModel", "image", (4, 4),
     _make("QwenImageTransformer2DModel", use_layer3d_rope=True, use_additional_t_cond=True, **_QWEN),
     _qwen_inputs((4, 4), layers=1, refs=1, additional_t=True),
     notes="Layered: layers+1 output images then the condition image, each H*W tokens; Layer3D rope "
           "(condition image at layer index -1); additional_t_cond", since="0.36.0")


# ==============================================================================================================
# Z-Image: lists of per-sample (C, F, H, W) latents; one unified stream [image (padded to 32) | caption]


def _zimage_inputs(default, in_ch=16, cap_dim=16, patch=2):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        return dict(
            x=[_randn(g, in_ch, 1, h * patch, w * patch) for _ in range(batch)],
            t=_t(batch, 0.4),  # the pipeline passes (1000 - t) / 1000: 1 = clean
            cap_feats=[_randn(g, TXT, cap_dim) for _ in range(batch)],
        )

    return inputs


_ZIMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
               n_heads=2, n_kv_heads=2, qk_norm=True, cap_feat_dim=16, axes_dims=[8, 4, 4], axes_lens=[64, 32, 32])
_add("z-image", "ZImageTransformer2DModel", "image", (4, 8),
     _make("ZImageTransformer2DModel", **_ZIMAGE), _zimage_inputs((4, 8)), latent="x", per_sample=True,
     notes="forward(x=list of (C, 1, H, W), t, cap_feats=list of (L, D)); returns a list (stacked by "
           "output_tensor); image tokens are padded to a multiple of 32", since="0.36.0")


# ==============================================================================================================
# SANA: (B, C, H, W), linear attention + cross-attention + GLUMBConv (a conv on the token grid)


def _latent_inputs(default, channels, patch, text_dim, t=500.0, text_key="encoder_hidden_states", mask=None,
                   extra=None, time_key="timestep"):
    """(B, C, H*p, W*p) latent, text, timestep; ``mask`` names a (B, L) text-mask argument."""

    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        ph, pw = (patch, patch) if isinstance(patch, int) else patch
        kw = {"hidden_states": _randn(g, batch, channels, h * ph, w * pw),
              text_key: _randn(g, batch, TXT, text_dim), time_key: _t(batch, t)}
        if mask is not None:
            kw[mask] = torch.ones(batch, TXT, dtype=torch.bool)
        if extra is not None:
            kw.update(extra(batch, g, h, w))
        return kw

    return inputs


_SANA = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
             num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=8,
             mlp_ratio=2.5, sample_size=8, patch_size=1)
_add("sana", "SanaTransformer2DModel", "image", (8, 8), _make("SanaTransformer2DModel", **_SANA),
     _latent_inputs((8, 8), 4, 1, 8, t=500.0),
     notes="SANA: timestep 0..1000 times config.timestep_scale; GLUMBConv feed-forward reshapes tokens to the "
           "grid", since="0.32.0")
_add("sana-sprint", "SanaTransformer2DModel", "image", (8, 8),
     _make("SanaTransformer2DModel", guidance_embeds=True, qk_norm="rms_norm_across_heads", **_SANA),
     _latent_inputs((8, 8), 4, 1, 8, t=0.5, extra=lambda b, g, h, w: {"guidance": torch.full((b,), 4.5)}),
     notes="SANA-Sprint: guidance embedding, qk-norm; the pipeline passes a trigflow timestep (0..1.57)",
     since="0.33.0")


# ==============================================================================================================
# Lumina-Image 2.0 and Lumina-Next


_LUMINA2 = dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
                num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6),
                axes_lens=(64, 32, 32), cap_feat_dim=16)
_add("lumina2", "Lumina2Transformer2DModel", "image", (4, 4), _make("Lumina2Transformer2DModel", **_LUMINA2),
     _latent_inputs((4, 4), 4, 2, 16, t=0.4, mask="encoder_attention_mask"),
     notes="timestep = 1 - t/1000 (0 = noise, 1 = image)", since="0.33.0")


def _lumina_next_extra(head_dim):
    def extra(batch, g, h, w):
        from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

        # cross_attention_kwargs must be a dict: the blocks unpack it with ** (None fails)
        return {"image_rotary_emb": get_2d_rotary_pos_embed_lumina(head_dim, 32, 32), "cross_attention_kwargs": {}}

    return extra


_add("lumina-next", "LuminaNextDiT2DModel", "image", (4, 4),
     _make("LuminaNextDiT2DModel", sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=2,
           num_attention_heads=2, num_kv_heads=1, multiple_of=16, learn_sigma=True, qk_norm=True,
           cross_attention_dim=16),
     _latent_inputs((4, 4), 4, 2, 16, t=0.4, mask="encoder_mask", extra=_lumina_next_extra(16)),
     expect=lambda kw: (kw["hidden_states"].shape[0], 8, *kw["hidden_states"].shape[2:]),
     notes="learn_sigma: 2C output channels; the pipeline passes a (384, 384, head_dim/2) complex rope table",
     since="0.29.0")


# ==============================================================================================================
# HiDream-I1: double-stream then single-stream blocks with MoE feed-forwards


def _hidream_extra(batch, g, h, w):
    return {"encoder_hidden_states_t5": _randn(g, batch, TXT, 8),
            "encoder_hidden_states_llama3": _randn(g, 2, batch, TXT, 4),  # (llama layers, B, L, D)
            "pooled_embeds": _randn(g, batch, 8)}


_add("hidream", "HiDreamImageTransformer2DModel", "image", (4, 4),
     _make("HiDreamImageTransformer2DModel", patch_size=2, in_channels=4, out_channels=4, num_layers=1,
           num_single_layers=1, attention_head_dim=8, num_attention_heads=2, caption_channels=[8, 4], text_emb_dim=8,
           num_routed_experts=2, num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(16, 16),
           llama_layers=(0, 1), force_inference_output=True),
     lambda batch=2, grid=None, seed=0: {
         k: v for k, v in _latent_inputs((4, 4), 4, 2, 8, t=500.0, text_key="encoder_hidden_states_t5",
                                         time_key="timesteps", extra=_hidream_extra)(batch, grid, seed).items()},
     notes="non-square latents are padded to max_resolution^2/p^2 tokens (64 here) with a mask",
     since="0.33.0")


# ==============================================================================================================
# Wan 2.x and its relatives: (B, C, F, H, W) latent, patch (1, 2, 2), blocks[i].attn1 / attn2 / ffn

WAN_TEXT = 512  # Wan-style I2V cross-attention takes the LAST 512 context tokens as text: text must be 512 long


def _video_inputs(default, channels, patch, text_dim, t=500.0, text_len=TXT, extra=None, mask=None,
                  time_key="timestep", text_key="encoder_hidden_states", timestep=None):
    """(B, C, F*pt, H*ph, W*pw) latent + text + timestep; ``extra(batch, g, f, h, w)`` adds more kwargs."""

    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        pt, ph, pw = patch
        g = _gen(seed)
        kw = {"hidden_states": _randn(g, batch, channels, f * pt, h * ph, w * pw),
              text_key: _randn(g, batch, text_len, text_dim),
              time_key: _t(batch, t) if timestep is None else timestep(batch, f, h, w)}
        if mask is not None:
            kw[mask] = torch.ones(batch, text_len, dtype=torch.bool)
        if extra is not None:
            kw.update(extra(batch, g, f, h, w))
        return kw

    return inputs


def _out_channels(c, key="hidden_states"):
    """expect(): the latent's shape with ``c`` channels (models whose input carries condition channels)."""
    return lambda kw: (kw[key].shape[0], c, *kw[key].shape[2:])


_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
_add("wan", "WanTransformer3DModel", "video", (3, 4, 4), _make("WanTransformer3DModel", **_WAN),
     _video_inputs((3, 4, 4), 4, (1, 2, 2), 16), notes="Wan 2.1/2.2 T2V (timestep 0..1000)", since="0.33.0")


def _wan_image_embeds(n=3, dim=16):
    return lambda batch, g, f, h, w: {"encoder_hidden_states_image": _randn(g, batch, n, dim)}


_WAN_I2V = dict(_WAN, in_channels=12, image_dim=16, added_kv_proj_dim=24)
_add("wan-i2v", "WanTransformer3DModel", "video", (3, 4, 4), _make("WanTransformer3DModel", **_WAN_I2V),
     _video_inputs((3, 4, 4), 12, (1, 2, 2), 16, text_len=WAN_TEXT, extra=_wan_image_embeds()),
     expect=_out_channels(4),
     notes="Wan 2.1 I2V: latent = [noise | mask | first-frame condition] on channels; CLIP image tokens "
           "prepended to the text (text must be 512 tokens: the processor splits at len - 512)", since="0.33.0")
_add("wan-ti2v", "WanTransformer3DModel", "video", (3, 4, 4), _make("WanTransformer3DModel", **_WAN),
     _video_inputs((3, 4, 4), 4, (1, 2, 2), 16,
                   timestep=lambda b, f, h, w: torch.cat(
                       [torch.zeros(b, h * w), torch.full((b, (f - 1) * h * w), 500.0)], dim=1)),
     notes="Wan 2.2 TI2V-5B (expand_timesteps): a per-token timestep (B, F*H*W), 0 on the first (clean) frame, "
           "so every block gets per-token modulation (B, N, 6, D)", since="0.35.0")


def _vace_extra(ch=8):
    return lambda batch, g, f, h, w: {"control_hidden_states": _randn(g, batch, ch, f, 2 * h, 2 * w)}


_add("wan-vace", "WanVACETransformer3DModel", "video", (3, 4, 4),
     _make("WanVACETransformer3DModel", vace_layers=[0], vace_in_channels=8, **_WAN),
     _video_inputs((3, 4, 4), 4, (1, 2, 2), 16, extra=_vace_extra()),
     notes="VACE: vace_blocks run first over control tokens (same grid), their hints are added after blocks "
           "in config.vace_layers", since="0.33.0")


def _animate_extra(batch, g, f, h, w):
    return {"encoder_hidden_states_image": _randn(g, batch, 3, 16),
            "pose_hidden_states": _randn(g, batch, 4, f - 1, 2 * h, 2 * w),
            "face_pixel_values": _randn(g, batch, 3, 4 * (f - 1) - 3, 16, 16)}


_add("wan-animate", "WanAnimateTransformer3DModel", "video", (3, 4, 4),
     _make("WanAnimateTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
           in_channels=12, latent_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2,
           image_dim=16, rope_max_seq_len=32, motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16},
           motion_encoder_size=16, motion_style_dim=8, motion_dim=4, motion_encoder_dim=16,
           face_encoder_hidden_dim=16, face_encoder_num_heads=2, inject_face_latents_blocks=2),
     _video_inputs((3, 4, 4), 12, (1, 2, 2), 16, text_len=WAN_TEXT, extra=_animate_extra),
     expect=_out_channels(4),
     notes="Wan 2.2 Animate: frame 0 is the reference image, pose latents are added to frames 1..F-1, a face "
           "adapter after every inject_face_latents_blocks-th block attends per frame (reshapes tokens to F "
           "groups)", since="0.36.0")

_add("skyreels-v2", "SkyReelsV2Transformer3DModel", "video", (3, 4, 4),
     _make("SkyReelsV2Transformer3DModel", **_WAN), _video_inputs((3, 4, 4), 4, (1, 2, 2), 16),
     notes="SkyReels-V2 T2V: the Wan layout", since="0.35.0")
_add("skyreels-v2-df", "SkyReelsV2Transformer3DModel", "video", (2, 4, 4),
     _make("SkyReelsV2Transformer3DModel", num_frame_per_block=2, **_WAN),
     _video_inputs((2, 4, 4), 4, (1, 2, 2), 16,
                   timestep=lambda b, f, h, w: torch.linspace(0, 900, f).expand(b, f).contiguous(),
                   extra=lambda b, g, f, h, w: {"enable_diffusion_forcing": True}),
     notes="Diffusion forcing: per-frame timestep (B, F) -> per-token modulation (B, 6, N, D); "
           "num_frame_per_block=2 adds a block-causal (1, 1, N, N) mask (F must be a multiple of 2). "
           "inject_sample_info (fps) is left off: with diffusion forcing it only broadcasts at batch 1",
     since="0.35.0")
_add("chronoedit", "ChronoEditTransformer3DModel", "video", (2, 4, 4),
     _make("ChronoEditTransformer3DModel", **_WAN_I2V),
     _video_inputs((2, 4, 4), 12, (1, 2, 2), 16, text_len=WAN_TEXT, extra=_wan_image_embeds()),
     expect=_out_channels(4),
     notes="ChronoEdit: the Wan I2V layout; with 2 latent frames the temporal rope uses positions 0 and "
           "rope_temporal_skip_len - 1", since="0.36.0")


# ==============================================================================================================
# HunyuanVideo 1.0 (T2V, I2V latent_concat / token_replace), Framepack, 1.5: (B, C, F, H, W), patch (1, 2, 2)


def _hyv_extra(pooled=8, guidance=True):
    def extra(batch, g, f, h, w):
        kw = {"pooled_projections": _randn(g, batch, pooled)}
        if guidance:
            kw["guidance"] = torch.full((batch,), 6000.0)  # the pipeline passes guidance_scale * 1000
        return kw

    return extra


_HYV = dict(out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1, num_single_layers=1,
            num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
            rope_axes_dim=(2, 4, 4))
_add("hunyuan-video", "HunyuanVideoTransformer3DModel", "video", (3, 4, 4),
     _make("HunyuanVideoTransformer3DModel", in_channels=4, **_HYV),
     _video_inputs((3, 4, 4), 4, (1, 2, 2), 16, mask="encoder_attention_mask", extra=_hyv_extra()),
     notes="1 double + 1 single block; single blocks concatenate [image | text] inside the block",
     since="0.32.0")
_add("hunyuan-video-i2v", "HunyuanVideoTransformer3DModel", "video", (3, 4, 4),
     _make("HunyuanVideoTransformer3DModel", in_channels=9, image_condition_type="latent_concat",
           guidance_embeds=False, **_HYV),
     _video_inputs((3, 4, 4), 9, (1, 2, 2), 16, mask="encoder_attention_mask", extra=_hyv_extra(guidance=False)),
     expect=_out_channels(4),
     notes="I2V latent_concat: latent = [noise C | image C | mask 1] on channels; the pipeline puts the "
           "image's LLaVA tokens before the prompt's in encoder_hidden_states", since="0.33.0")
_add("hunyuan-video-i2v-token-replace", "HunyuanVideoTransformer3DModel", "video", (3, 4, 4),
     _make("HunyuanVideoTransformer3DModel", in_channels=4, image_condition_type="token_replace", **_HYV),
     _video_inputs((3, 4, 4), 4, (1, 2, 2), 16, mask="encoder_attention_mask", extra=_hyv_extra()),
     notes="I2V token_replace: frame 0 is the clean image latent; its first_frame_num_tokens tokens get their "
           "own (t=0) modulation inside every block", since="0.33.0")


def _framepack_extra(batch, g, f, h, w):
    kw = _hyv_extra()(batch, g, f, h, w)
    hh, ww = 2 * h, 2 * w
    kw.update(
        image_embeds=_randn(g, batch, 3, 16),
        indices_latents=torch.arange(7, 7 + f),
        latents_clean=_randn(g, batch, 4, 2, hh, ww), indices_latents_clean=torch.tensor([0, 6]),
        latents_history_2x=_randn(g, batch, 4, 2, hh, ww), indices_latents_history_2x=torch.tensor([4, 5]),
        latents_history_4x=_randn(g, batch, 4, 4, hh, ww), indices_latents_history_4x=torch.arange(4),
    )
    return kw


_add("hunyuan-video-framepack", "HunyuanVideoFramepackTransformer3DModel", "video", (3, 4, 4),
     _make("HunyuanVideoFramepackTransformer3DModel", in_channels=4, image_condition_type=None, has_image_proj=True,
           image_proj_dim=16, has_clean_x_embedder=True, **_HYV),
     _video_inputs((3, 4, 4), 4, (1, 2, 2), 16, mask="encoder_attention_mask", extra=_framepack_extra),
     notes="Framepack (vanilla sampling): image stream = [history 4x | history 2x | clean (prefix + 1x) | "
           "latents]; SigLIP image tokens prepended to the text; output = the last F*H*W tokens",
     since="0.34.0")


def _hyv15_extra(image=True):
    def extra(batch, g, f, h, w):
        return {"encoder_hidden_states_2": _randn(g, batch, 4, 8),
                "encoder_attention_mask_2": torch.ones(batch, 4, dtype=torch.bool),
                "image_embeds": _randn(g, batch, 3, 12) if image else torch.zeros(batch, 3, 12)}

    return extra


_HYV15 = dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=2,
              num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=8,
              image_embed_dim=12, rope_axes_dim=(2, 4, 4))
_add("hunyuan-video-1.5", "HunyuanVideo15Transformer3DModel", "video", (3, 4, 4),
     _make("HunyuanVideo15Transformer3DModel", **_HYV15),
     _video_inputs((3, 4, 4), 9, (1, 1, 1), 16, mask="encoder_attention_mask", extra=_hyv15_extra(image=False)),
     expect=_out_channels(4),
     notes="HunyuanVideo 1.5 T2V: patch 1, double-stream blocks only; latent = [noise C | cond C | mask 1]; "
           "all-zero image_embeds = text-to-video (their tokens masked out)", since="0.36.0")
_add("hunyuan-video-1.5-i2v", "HunyuanVideo15Transformer3DModel", "video", (3, 4, 4),
     _make("HunyuanVideo15Transformer3DModel", **_HYV15),
     _video_inputs((3, 4, 4), 9, (1, 1, 1), 16, mask="encoder_attention_mask", extra=_hyv15_extra(image=True)),
     expect=_out_channels(4),
     notes="HunyuanVideo 1.5 I2V: SigLIP image tokens join the context as [image | byT5 | MLLM]", since="0.36.0")


# ==============================================================================================================
# LTX-Video and LTX-2: packed tokens (B, F*H*W, C), patch 1 (a 32x spatial / 8x temporal VAE does the patching)


def _ltx_inputs(default, ch=8, text_dim=16, per_token_t=False):
    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        g = _gen(seed)
        t = _t(batch, 500.0)
        if per_token_t:  # image-to-video: conditioning (first-frame) tokens at t=0, the rest at t
            t = torch.cat([torch.zeros(batch, h * w), torch.full((batch, (f - 1) * h * w), 500.0)], dim=1)
        return dict(hidden_states=_randn(g, batch, f * h * w, ch),
                    encoder_hidden_states=_randn(g, batch, TXT, text_dim),
                    timestep=t, encoder_attention_mask=torch.ones(batch, TXT, dtype=torch.long),
                    num_frames=f, height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32))

    return inputs


_LTX = dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, num_layers=2, caption_channels=16)
_add("ltx", "LTXVideoTransformer3DModel", "video", (3, 4, 4), _make("LTXVideoTransformer3DModel", **_LTX),
     _ltx_inputs((3, 4, 4)), notes="LTX-Video T2V: forward takes num_frames/height/width (the token grid) and "
                                   "rope_interpolation_scale", since="0.32.0")
_add("ltx-i2v", "LTXVideoTransformer3DModel", "video", (3, 4, 4), _make("LTXVideoTransformer3DModel", **_LTX),
     _ltx_inputs((3, 4, 4), per_token_t=True),
     notes="LTX I2V: per-token timestep (B, N), 0 on the first frame's tokens -> per-token modulation",
     since="0.32.0")


def _ltx2_inputs(default, audio_frames=5):
    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        g = _gen(seed)
        return dict(hidden_states=_randn(g, batch, f * h * w, 4), audio_hidden_states=_randn(g, batch, audio_frames, 4),
                    encoder_hidden_states=_randn(g, batch, TXT, 16),
                    audio_encoder_hidden_states=_randn(g, batch, TXT, 16),
                    timestep=_t(batch, 500.0), encoder_attention_mask=torch.ones(batch, TXT, dtype=torch.bool),
                    audio_encoder_attention_mask=torch.ones(batch, TXT, dtype=torch.bool),
                    num_frames=f, height=h, width=w, audio_num_frames=audio_frames, fps=25.0)

    return inputs


_add("ltx2", "LTX2VideoTransformer3DModel", "video", (2, 4, 4),
     _make("LTX2VideoTransformer3DModel", in_channels=4, out_channels=4, patch_size=1, patch_size_t=1,
           num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4,
           audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
           num_layers=2, caption_channels=16, rope_double_precision=False),
     _ltx2_inputs((2, 4, 4)),
     notes="LTX-2 audio+video: returns (video, audio); output_tensor takes the video", since="0.37.0")


# ==============================================================================================================
# CogVideoX 1.0 / 1.5 (patch_size_t=2) / I2V: latent (B, F, C, H, W) -- frames BEFORE channels


def _crop_region(src, tgt_width, tgt_height):
    """The centred crop of a (h, w) grid resized into the base grid (as CogVideoX pipelines compute it)."""
    h, w = src
    if h / w > tgt_height / tgt_width:
        rh, rw = tgt_height, int(round(tgt_height / h * w))
    else:
        rw, rh = tgt_width, int(round(tgt_width / w * h))
    top, left = int(round((tgt_height - rh) / 2.0)), int(round((tgt_width - rw) / 2.0))
    return (top, left), (top + rh, left + rw)


def _cogvideox_inputs(default, ch, pt, head_dim, rope, sample=(8, 8), i2v=False, ofs=False):
    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        g = _gen(seed)
        kw = dict(hidden_states=_randn(g, batch, f * (pt or 1), ch, 2 * h, 2 * w),
                  encoder_hidden_states=_randn(g, batch, TXT, 16), timestep=_t(batch, 500.0))
        if rope:
            from diffusers.models.embeddings import get_3d_rotary_pos_embed

            if pt is None:
                crops = _crop_region((h, w), sample[1] // 2, sample[0] // 2)
                kw["image_rotary_emb"] = get_3d_rotary_pos_embed(embed_dim=head_dim, crops_coords=crops,
                                                                 grid_size=(h, w), temporal_size=f)
            else:
                kw["image_rotary_emb"] = get_3d_rotary_pos_embed(embed_dim=head_dim, crops_coords=None,
                                                                 grid_size=(h, w), temporal_size=f, grid_type="slice",
                                                                 max_size=(sample[0] // 2, sample[1] // 2))
        if ofs:
            kw["ofs"] = torch.full((batch,), 2.0)
        return kw

    return inputs


_COG = dict(num_attention_heads=2, attention_head_dim=16, out_channels=4, time_embed_dim=8, text_embed_dim=16,
            num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
            max_text_seq_length=TXT)
_add("cogvideox", "CogVideoXTransformer3DModel", "video", (3, 4, 4),
     _make("CogVideoXTransformer3DModel", in_channels=4, **_COG), _cogvideox_inputs((3, 4, 4), 4, None, 16, False),
     notes="CogVideoX 1.0 (2B): sin-cos position embedding, no rope; text must be max_text_seq_length tokens",
     since="0.30.0")
_add("cogvideox-5b", "CogVideoXTransformer3DModel", "video", (3, 4, 4),
     _make("CogVideoXTransformer3DModel", in_channels=4, use_rotary_positional_embeddings=True, **_COG),
     _cogvideox_inputs((3, 4, 4), 4, None, 16, True),
     notes="CogVideoX 1.0 5B: 3-D rope (cos, sin) from the pipeline covering the video rows only",
     since="0.30.0")
_add("cogvideox-i2v", "CogVideoXTransformer3DModel", "video", (3, 4, 4),
     _make("CogVideoXTransformer3DModel", in_channels=8, use_rotary_positional_embeddings=True,
           use_learned_positional_embeddings=True, **_COG),
     _cogvideox_inputs((3, 4, 4), 8, None, 16, True),
     expect=lambda kw: (*kw["hidden_states"].shape[:2], 4, *kw["hidden_states"].shape[3:]),
     notes="CogVideoX I2V: latent = [noise | image latent] on channels (dim 2); learned position embeddings "
           "of the config's sample size: only that grid works", since="0.30.0", fixed_grid=True)
_add("cogvideox-1.5", "CogVideoXTransformer3DModel", "video", (2, 4, 4),
     _make("CogVideoXTransformer3DModel", in_channels=4, patch_size_t=2, use_rotary_positional_embeddings=True,
           patch_bias=False, ofs_embed_dim=8,
           **dict(_COG, sample_height=16, sample_width=16)),
     _cogvideox_inputs((2, 4, 4), 4, 2, 16, True, sample=(16, 16), ofs=True),
     notes="CogVideoX 1.5: patch_size_t=2 (grid F = latent frames / 2), rope grid_type='slice', ofs embedding",
     since="0.32.0")


# ==============================================================================================================
# Mochi, Allegro


_add("mochi", "MochiTransformer3DModel", "video", (3, 4, 4),
     _make("MochiTransformer3DModel", patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2,
           pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=4, max_sequence_length=16),
     _video_inputs((3, 4, 4), 4, (1, 2, 2), 16, mask="encoder_attention_mask"),
     notes="Mochi: the pipeline passes a reversed timestep (1000 - t); joint attention is a per-sample loop "
           "over valid text tokens", since="0.31.0")


def _allegro_extra(head_dim):
    def extra(batch, g, f, h, w):
        from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

        ft, fh, fw, gt, gh, gw = get_3d_rotary_pos_embed_allegro(
            embed_dim=head_dim, crops_coords=((0, 0), (h, w)), grid_size=(h, w), temporal_size=f,
            interpolation_scale=(2.2, 2.0, 2.0))
        pos = torch.cartesian_prod(gt.long(), gh.long(), gw.long()).reshape(-1, 3).transpose(0, 1)
        pos = pos.reshape(3, 1, -1).contiguous()
        return {"image_rotary_emb": ((ft, fh, fw), tuple(pos))}

    return extra


_add("allegro", "AllegroTransformer3DModel", "video", (3, 4, 4),
     _make("AllegroTransformer3DModel", num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
           num_layers=2, cross_attention_dim=24, sample_height=8, sample_width=8, sample_frames=3, caption_channels=16),
     _video_inputs((3, 4, 4), 4, (1, 2, 2), 16, mask="encoder_attention_mask", extra=_allegro_extra(12)),
     notes="Allegro: rope ((freqs_t, freqs_h, freqs_w), (grid_t, grid_h, grid_w)) from the pipeline; frames are "
           "flattened into one (B, F*H*W, D) sequence", since="0.32.0")


# ==============================================================================================================
# EasyAnimate, Cosmos (Predict 1/2), SANA-Video

_add("easyanimate", "EasyAnimateTransformer3DModel", "video", (2, 4, 4),
     _make("EasyAnimateTransformer3DModel", attention_head_dim=16, num_attention_heads=2, in_channels=4,
           mmdit_layers=2, num_layers=2, out_channels=4, patch_size=2, sample_height=60, sample_width=90,
           text_embed_dim=16, time_embed_dim=8, time_position_encoding_type="3d_rope"),
     _video_inputs((2, 4, 4), 4, (1, 2, 2), 16), notes="EasyAnimate V5.1: MMDiT-style joint blocks",
     since="0.33.0")


def _cosmos_extra(cond=False):
    def extra(batch, g, f, h, w):
        kw = {"attention_mask": torch.ones(batch, TXT), "fps": 30}
        if cond:
            kw["condition_mask"] = torch.ones(batch, 1, f, 2 * h, 2 * w)
        return kw

    return extra


_COSMOS = dict(out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2, mlp_ratio=2,
               text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
               rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=False, extra_pos_embed_type="learnable")
# Real Cosmos checkpoints set concat_padding_mask=True: the model then resizes padding_mask with torchvision (not a
# dependency here) and repeats a (1, 1, H, W) mask over the batch; the tiny entries leave it off.
_add("cosmos", "CosmosTransformer3DModel", "video", (2, 4, 4),
     _make("CosmosTransformer3DModel", in_channels=4, **_COSMOS),
     _video_inputs((2, 4, 4), 4, (1, 2, 2), 16, extra=_cosmos_extra()),
     notes="Cosmos-1.0 text-to-world; grid bounded by max_size; concat_padding_mask off (needs torchvision)",
     since="0.33.0")
_add("cosmos-v2w", "CosmosTransformer3DModel", "video", (2, 4, 4),
     _make("CosmosTransformer3DModel", in_channels=5, **_COSMOS),
     _video_inputs((2, 4, 4), 4, (1, 2, 2), 16, extra=_cosmos_extra(cond=True)),
     notes="Cosmos video-to-world: condition_mask (B, 1, F, H, W) concatenated as a channel", since="0.33.0")
_add("cosmos-predict2", "CosmosTransformer3DModel", "video", (2, 4, 4),
     _make("CosmosTransformer3DModel", in_channels=4, **dict(_COSMOS, extra_pos_embed_type=None)),
     _video_inputs((2, 4, 4), 4, (1, 2, 2), 16, t=0.5, extra=_cosmos_extra()),
     notes="Cosmos-Predict2: no learnable extra position embedding; the pipeline passes sigma-based timesteps "
           "(c_noise)", since="0.34.0")

_add("sana-video", "SanaVideoTransformer3DModel", "video", (2, 4, 4),
     _make("SanaVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12,
           num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24,
           caption_channels=16, mlp_ratio=2.5, sample_size=8, patch_size=(1, 2, 2), qk_norm="rms_norm_across_heads",
           rope_max_seq_len=32),
     _video_inputs((2, 4, 4), 4, (1, 2, 2), 16),
     notes="SANA-Video: linear attention with Wan-style 3-D rope; GLUMBConv feed-forward on the (F, H, W) grid",
     since="0.36.0")


# ==============================================================================================================
# UNets (SD 1.x/2.x, SDXL), ControlNet, video UNets. grid = the latent (H, W) = the first attention level's grid.

CROSS = 32


def _unet_inputs(default, channels=4, cross=CROSS, t=500.0, sdxl=False, extra=None, video=False, frames_first=False):
    def inputs(batch=2, grid=None, seed=0):
        g = _gen(seed)
        dims = _grid(grid, default)
        if video:
            f, h, w = dims
            shape = (batch, f, channels, h, w) if frames_first else (batch, channels, f, h, w)
        else:
            h, w = dims
            shape = (batch, channels, h, w)
        kw = dict(sample=_randn(g, *shape), timestep=torch.tensor(t),
                  encoder_hidden_states=_randn(g, batch, TXT, cross))
        if sdxl:
            kw["added_cond_kwargs"] = {"text_embeds": _randn(g, batch, 32), "time_ids": _randn(g, batch, 6)}
        if extra is not None:
            kw.update(extra(batch, g, dims))
        return kw

    return inputs


_UNET_SD = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                cross_attention_dim=CROSS, attention_head_dim=8, norm_num_groups=32)
_add("unet-sd", "UNet2DConditionModel", "image", (8, 8), _make("UNet2DConditionModel", **_UNET_SD),
     _unet_inputs((8, 8)), latent="sample",
     notes="SD 1.x/2.x layout: attention from the first (full-resolution) level; grid = latent (H, W)")
_add("unet-sdxl", "UNet2DConditionModel", "image", (8, 8),
     _make("UNet2DConditionModel", sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64, 64),
           layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
           up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
           transformer_layers_per_block=(1, 1, 2),
           cross_attention_dim=CROSS, attention_head_dim=8, norm_num_groups=32, addition_embed_type="text_time",
           addition_time_embed_dim=8, projection_class_embeddings_input_dim=32 + 6 * 8),
     _unet_inputs((8, 8), sdxl=True), latent="sample",
     notes="SDXL layout: no attention at full resolution, 2 transformer layers at the deepest level; "
           "added_cond_kwargs text_embeds/time_ids")


def _controlnet_extra(factor):
    def extra(batch, g, dims):
        h, w = dims
        return {"controlnet_cond": _randn(g, batch, 3, h * factor, w * factor)}

    return extra


def _cn_expect(c0):
    return lambda kw: (kw["sample"].shape[0], c0, *kw["sample"].shape[2:])


_add("controlnet", "ControlNetModel", "image", (8, 8),
     _make("ControlNetModel", block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
           layers_per_block=1, in_channels=4, cross_attention_dim=CROSS, attention_head_dim=8, norm_num_groups=32,
           conditioning_embedding_out_channels=(16, 32),
           post=_randomize("controlnet_down_blocks", "controlnet_mid_block")),
     _unet_inputs((8, 8), extra=_controlnet_extra(2)), latent="sample", expect=_cn_expect(32),
     notes="ControlNet (SD layout): controlnet_cond in pixel space (2x the latent here: 2 conditioning levels); "
           "output_tensor = the first down-block residual; zero-initialised outputs made random")


def _video_unet_extra(kind):
    def extra(batch, g, dims):
        f, h, w = dims
        if kind == "svd":
            return {"added_time_ids": torch.tensor([[6.0, 127.0, 0.02]]).repeat(batch, 1)}
        if kind == "i2vgen":
            return {"fps": torch.tensor([8] * batch), "image_latents": _randn(g, batch, 4, f, h, w),
                    "image_embeddings": _randn(g, batch, CROSS)}
        return {}

    return extra


_UNET3D = dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=32, in_channels=4, out_channels=4,
               cross_attention_dim=CROSS, attention_head_dim=8, sample_size=8,
               down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
               up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"))
_add("unet-3d", "UNet3DConditionModel", "video", (3, 8, 8), _make("UNet3DConditionModel", **_UNET3D),
     _unet_inputs((3, 8, 8), video=True), latent="sample",
     notes="ModelScope/Zeroscope: spatial Transformer2DModel on (B*F, H*W) + TransformerTemporalModel on (B*H*W, F)")
_add("unet-svd", "UNetSpatioTemporalConditionModel", "video", (3, 8, 8),
     _make("UNetSpatioTemporalConditionModel", sample_size=8, in_channels=8, out_channels=4,
           block_out_channels=(32, 64),
           layers_per_block=1, cross_attention_dim=CROSS, num_attention_heads=(2, 4), addition_time_embed_dim=8,
           projection_class_embeddings_input_dim=24,
           down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
           up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal")),
     lambda batch=2, grid=None, seed=0: {**_unet_inputs((3, 8, 8), channels=8, video=True, frames_first=True,
                                                        extra=_video_unet_extra("svd"))(batch, grid, seed),
                                         "encoder_hidden_states": _randn(_gen(seed + 1), batch, 1, CROSS)},
     latent="sample", expect=lambda kw: (*kw["sample"].shape[:2], 4, *kw["sample"].shape[3:]), alt_grid=(3, 8, 10),
     notes="Stable Video Diffusion (grid axes even on diffusers 0.27): sample (B, F, C, H, W) = [noise | image "
           "latent] on channels; one CLIP image "
           "token as context")
def _motion_extra(batch, g, dims):
    """Newer UNetMotionModel expects the text repeated per frame (the AnimateDiff pipeline does it); older ones
    repeat it themselves."""
    import inspect

    ctx = _randn(g, batch, TXT, CROSS)
    if "encoder_hidden_states.repeat_interleave" in inspect.getsource(_cls("UNetMotionModel").forward):
        return {"encoder_hidden_states": ctx}
    return {"encoder_hidden_states": ctx.repeat_interleave(dims[0], dim=0)}


_add("unet-motion", "UNetMotionModel", "video", (3, 8, 8),
     _make("UNetMotionModel", block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=32, in_channels=4,
           out_channels=4, cross_attention_dim=CROSS, num_attention_heads=4, sample_size=8,
           down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
           up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion")),
     _unet_inputs((3, 8, 8), video=True, extra=_motion_extra), latent="sample",
     notes="AnimateDiff: SD UNet + motion modules (temporal transformers on (B*H*W, F)); encoder_hidden_states "
           "(B*F, L, D) on diffusers 0.42 (the pipeline repeats the prompt per frame)")
_add("i2vgen-xl", "I2VGenXLUNet", "video", (3, 8, 8),
     _make("I2VGenXLUNet", sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
           layers_per_block=1,
           norm_num_groups=32, cross_attention_dim=CROSS, attention_head_dim=4, num_attention_heads=None,
           down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
           up_block_types=("UpBlock3D", "CrossAttnUpBlock3D")),
     _unet_inputs((3, 8, 8), video=True, extra=_video_unet_extra("i2vgen")), latent="sample",
     notes="I2VGen-XL: image latents concatenated on channels inside; image embedding tokens prepended to the "
           "text context")


# ==============================================================================================================
# DiT, PixArt, Transformer2DModel (the UNets' inner transformer), SD3 / 3.5


def _dit_extra(batch, g, dims):
    return {"class_labels": torch.arange(batch) % 10}


_add("dit", "DiTTransformer2DModel", "image", (4, 4),
     _make("DiTTransformer2DModel", num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
           num_layers=2, sample_size=8, patch_size=2, norm_num_groups=32, num_embeds_ada_norm=10),
     lambda batch=2, grid=None, seed=0: {
         "hidden_states": _randn(_gen(seed), batch, 4, 2 * _grid(grid, (4, 4))[0], 2 * _grid(grid, (4, 4))[1]),
         "timestep": _t(batch, 500).long(), "class_labels": torch.arange(batch) % 10},
     expect=_out_channels(8), alt_grid=(5, 5),
     notes="DiT: class-conditional, learn_sigma (2C out); square grids only (unpatchify takes sqrt(N))",
     since="0.28.0")
_add("pixart", "PixArtTransformer2DModel", "image", (4, 4),
     _make("PixArtTransformer2DModel", num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
           num_layers=2, cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=16),
     _latent_inputs((4, 4), 4, 2, 16, t=500.0,
                    extra=lambda b, g, h, w: {"added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}),
     expect=_out_channels(8), notes="PixArt-alpha/sigma: adaLN-single, cross-attention to T5; learn_sigma",
     since="0.28.0")
_add("transformer-2d", "Transformer2DModel", "other", (8, 8),
     _make("Transformer2DModel", num_attention_heads=2, attention_head_dim=8, in_channels=32, norm_num_groups=32,
           cross_attention_dim=CROSS, num_layers=1),
     lambda batch=2, grid=None, seed=0: {
         "hidden_states": _randn(_gen(seed), batch, 32, *_grid(grid, (8, 8))),
         "encoder_hidden_states": _randn(_gen(seed + 1), batch, TXT, CROSS)},
     notes="the continuous-input Transformer2DModel the SD UNets use inside (proj_in/proj_out around "
           "BasicTransformerBlocks)")


def _sd3_extra(batch, g, h, w):
    return {"pooled_projections": _randn(g, batch, 16)}


_SD3 = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=16)
_add("sd3", "SD3Transformer2DModel", "image", (4, 4), _make("SD3Transformer2DModel", **_SD3),
     _latent_inputs((4, 4), 4, 2, 16, t=500.0, extra=_sd3_extra),
     notes="SD3 MMDiT: joint attention [image | text]; position embedding cropped from a pos_embed_max_size grid",
     since="0.29.0")
_add("sd3.5", "SD3Transformer2DModel", "image", (4, 4),
     _make("SD3Transformer2DModel", dual_attention_layers=(0,), qk_norm="rms_norm", **_SD3),
     _latent_inputs((4, 4), 4, 2, 16, t=500.0, extra=_sd3_extra),
     notes="SD3.5: qk-norm; dual_attention_layers add an image-only attn2 in those blocks", since="0.31.0")


# ==============================================================================================================
# Flux.1 (dev, schnell, Kontext, Fill/Control), Chroma, Bria, Bria-FIBO, LongCat-Image, Ovis-Image:
# packed 2x2 tokens (B, H*W, 4C), img_ids (N, 3) = (index, row, col), txt_ids (L, 3) zeros


def _flux_inputs(default, in_ch=16, text_dim=32, pooled=16, guidance=True, refs=0, t=0.6, mask=False,
                 extra=None):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        ids = torch.cat([_flux_img_ids(h, w)] + [_flux_img_ids(h, w, first=1) for _ in range(refs)])
        kw = dict(hidden_states=_randn(g, batch, h * w * (1 + refs), in_ch),
                  encoder_hidden_states=_randn(g, batch, TXT, text_dim),
                  timestep=_t(batch, t), img_ids=ids, txt_ids=torch.zeros(TXT, 3))
        if pooled:
            kw["pooled_projections"] = _randn(g, batch, pooled)
        if guidance:
            kw["guidance"] = torch.full((batch,), 3.5)
        if mask:
            kw["attention_mask"] = torch.ones(batch, TXT + h * w * (1 + refs), dtype=torch.bool)
        if extra is not None:
            kw.update(extra(batch, g, h, w))
        return kw

    return inputs


_FLUX = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
_add("flux", "FluxTransformer2DModel", "image", (4, 4), _make("FluxTransformer2DModel", guidance_embeds=True, **_FLUX),
     _flux_inputs((4, 4)), notes="Flux.1 [dev]: 1 double + 2 single blocks; timestep t/1000, raw guidance",
     since="0.30.0")
_add("flux-schnell", "FluxTransformer2DModel", "image", (4, 4),
     _make("FluxTransformer2DModel", guidance_embeds=False, **_FLUX), _flux_inputs((4, 4), guidance=False),
     notes="Flux.1 [schnell]: no guidance embedding", since="0.30.0")
_add("flux-kontext", "FluxTransformer2DModel", "image", (4, 4),
     _make("FluxTransformer2DModel", guidance_embeds=True, **_FLUX), _flux_inputs((4, 4), refs=1),
     notes="Kontext: reference tokens appended after the image's, their ids' first column = 1", since="0.30.0")
_add("flux-fill", "FluxTransformer2DModel", "image", (4, 4),
     _make("FluxTransformer2DModel", guidance_embeds=True, **dict(_FLUX, in_channels=48, out_channels=16)),
     _flux_inputs((4, 4), in_ch=48), expect=lambda kw: (*kw["hidden_states"].shape[:2], 16),
     notes="Fill / Control (depth, canny): condition latents concatenated on channels (in 384 / 128, out 64)",
     since="0.30.0")
_add("chroma", "ChromaTransformer2DModel", "image", (4, 4),
     _make("ChromaTransformer2DModel", patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
           approximator_num_channels=8, approximator_hidden_dim=32, approximator_layers=1),
     _flux_inputs((4, 4), pooled=0, guidance=False, mask=True),
     notes="Chroma: attention_mask (B, L+N) over [text | image] -> (B, 1, S, S) in every block", since="0.35.0")
_BRIA = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 6, 6])
_add("bria", "BriaTransformer2DModel", "image", (4, 4), _make("BriaTransformer2DModel", **_BRIA),
     _flux_inputs((4, 4), pooled=0, guidance=False, t=500.0),
     notes="Bria 3.2: the Flux layout, timestep 0..1000", since="0.35.0")
_add("bria-fibo", "BriaFiboTransformer2DModel", "image", (4, 4),
     _make("BriaFiboTransformer2DModel", text_encoder_dim=8, **_BRIA),
     _flux_inputs((4, 4), pooled=0, guidance=False, t=500.0,
                  extra=lambda b, g, h, w: {"text_encoder_layers": [_randn(g, b, TXT, 8) for _ in range(3)]}),
     notes="Bria FIBO: each block's text = [shared half | that block's text-encoder layer]", since="0.36.0")
_add("longcat-image", "LongCatImageTransformer2DModel", "image", (4, 4),
     _make("LongCatImageTransformer2DModel", patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
           axes_dims_rope=[4, 6, 6]),
     _flux_inputs((4, 4), pooled=0, guidance=False), notes="LongCat-Image: the Flux layout", since="0.36.0")
_add("ovis-image", "OvisImageTransformer2DModel", "image", (4, 4),
     _make("OvisImageTransformer2DModel", patch_size=1, in_channels=16, out_channels=16, num_layers=1,
           num_single_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
           axes_dims_rope=(4, 6, 6)),
     _flux_inputs((4, 4), pooled=0, guidance=False), notes="Ovis-Image: the Flux layout", since="0.36.0")


# ==============================================================================================================
# Latte: spatial blocks on (B*F, H*W) and temporal blocks on (B*H*W, F)

_add("latte", "LatteTransformer3DModel", "video", (3, 4, 4),
     _make("LatteTransformer3DModel", num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
           num_layers=1, cross_attention_dim=16, sample_size=8, patch_size=2, norm_type="ada_norm_single",
           caption_channels=16, video_length=3, activation_fn="gelu-approximate", norm_elementwise_affine=False,
           num_embeds_ada_norm=1000),
     _video_inputs((3, 4, 4), 4, (1, 2, 2), 16),
     expect=_out_channels(8), notes="Latte: learn_sigma (2C out); temp_pos_embed sized video_length (F fixed)",
     since="0.30.0", fixed_grid=False)


# ==============================================================================================================
# HunyuanDiT (+ ControlNet)


def _randomize_zeros(std: float = 0.1):
    """A post-build step: give every all-zero parameter (zero-initialised ControlNet projections) random values."""

    def post(model):
        for p in model.parameters():
            if p.numel() and not p.any():
                p.normal_(0.0, std)

    return post


def _hunyuandit_inputs(default, head_dim=8, control=False):
    def inputs(batch=2, grid=None, seed=0):
        from diffusers.models.embeddings import get_2d_rotary_pos_embed

        h, w = _grid(grid, default)
        g = _gen(seed)
        kw = dict(hidden_states=_randn(g, batch, 4, 2 * h, 2 * w), timestep=_t(batch, 500.0),
                  encoder_hidden_states=_randn(g, batch, TXT, 8), text_embedding_mask=torch.ones(batch, TXT),
                  encoder_hidden_states_t5=_randn(g, batch, TXT, 8), text_embedding_mask_t5=torch.ones(batch, TXT),
                  image_meta_size=torch.tensor([[16.0, 16.0, 16.0, 16.0, 0.0, 0.0]]).repeat(batch, 1),
                  style=torch.zeros(batch, dtype=torch.long),
                  image_rotary_emb=get_2d_rotary_pos_embed(head_dim, _crop_region((h, w), 8, 8), (h, w),
                                                           output_type="pt"))
        if control:
            kw["controlnet_cond"] = _randn(g, batch, 4, 2 * h, 2 * w)
        return kw

    return inputs


_HDIT = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=8, hidden_size=16,
             mlp_ratio=2.0, cross_attention_dim=8, cross_attention_dim_t5=8, pooled_projection_dim=8, text_len=TXT,
             text_len_t5=TXT)
_add("hunyuan-dit", "HunyuanDiT2DModel", "image", (4, 4), _make("HunyuanDiT2DModel", num_layers=2, **_HDIT),
     _hunyuandit_inputs((4, 4)), expect=_out_channels(8),
     notes="HunyuanDiT: U-shaped skips between the first and second half of blocks; 2-D rope (cos, sin) from the "
           "pipeline; learn_sigma", since="0.28.0")
_add("hunyuan-dit-controlnet", "HunyuanDiT2DControlNetModel", "image", (4, 4),
     _make("HunyuanDiT2DControlNetModel", conditioning_channels=4, transformer_num_layers=4, post=_randomize_zeros(),
           **_HDIT),
     _hunyuandit_inputs((4, 4), control=True),
     expect=lambda kw: (kw["hidden_states"].shape[0],
                        (kw["hidden_states"].shape[2] // 2) * (kw["hidden_states"].shape[3] // 2), 16),
     notes="HunyuanDiT ControlNet: transformer_num_layers/2 - 1 blocks; controlnet_cond in latent space; "
           "output_tensor = the first block residual (B, N, D)", since="0.29.0")


# ==============================================================================================================
# Transformer ControlNets: Flux, SD3, Qwen-Image, SANA, Z-Image


def _cn_tokens(dim):
    """expect(): (B, N, dim) residuals where N = the latent's token count."""
    return lambda kw: (kw["hidden_states"].shape[0], kw["hidden_states"].shape[1], dim)


def _flux_cn_extra(ch):
    return lambda b, g, h, w: {"controlnet_cond": _randn(g, b, h * w, ch)}


_add("flux-controlnet", "FluxControlNetModel", "image", (4, 4),
     _make("FluxControlNetModel", guidance_embeds=True, post=_randomize_zeros(), **_FLUX),
     _flux_inputs((4, 4), extra=_flux_cn_extra(16)), expect=_cn_tokens(32),
     notes="Flux ControlNet (packed controlnet_cond tokens added after x_embedder); returns per-block residuals",
     since="0.30.0")
_add("flux-controlnet-union", "FluxControlNetModel", "image", (4, 4),
     _make("FluxControlNetModel", guidance_embeds=True, num_mode=4, post=_randomize_zeros(), **_FLUX),
     _flux_inputs((4, 4), extra=lambda b, g, h, w: {**_flux_cn_extra(16)(b, g, h, w),
                                                     "controlnet_mode": torch.zeros(b, 1, dtype=torch.long)}),
     expect=_cn_tokens(32),
     notes="Flux ControlNet-Union: a mode embedding token is PREPENDED to the text tokens (L + 1)", since="0.30.0")


def _sd3_cn_extra(b, g, h, w):
    return {"pooled_projections": _randn(g, b, 16), "controlnet_cond": _randn(g, b, 4, 2 * h, 2 * w)}


_add("sd3-controlnet", "SD3ControlNetModel", "image", (4, 4),
     _make("SD3ControlNetModel", post=_randomize_zeros(), **dict(_SD3, num_layers=2)),
     _latent_inputs((4, 4), 4, 2, 16, t=500.0, extra=_sd3_cn_extra),
     expect=lambda kw: (kw["hidden_states"].shape[0], kw["hidden_states"].shape[2] * kw["hidden_states"].shape[3] // 4,
                        16),
     notes="SD3 ControlNet: controlnet_cond latent (B, C, H, W) through pos_embed_input", since="0.29.0")


def _qwen_cn_inputs(default):
    base = _qwen_inputs(default)

    def inputs(batch=2, grid=None, seed=0):
        kw = base(batch, grid, seed)
        kw["controlnet_cond"] = _randn(_gen(seed + 7), *kw["hidden_states"].shape)
        return kw

    return inputs


_add("qwen-image-controlnet", "QwenImageControlNetModel", "image", (4, 4),
     _make("QwenImageControlNetModel", post=_randomize_zeros(),
           **{k: v for k, v in _QWEN.items()}),
     _qwen_cn_inputs((4, 4)), expect=_cn_tokens(32),
     notes="Qwen-Image ControlNet: packed controlnet_cond tokens added after img_in", since="0.36.0")


def _sana_cn_extra(b, g, h, w):
    return {"controlnet_cond": _randn(g, b, 4, h, w)}


_add("sana-controlnet", "SanaControlNetModel", "image", (8, 8),
     _make("SanaControlNetModel", post=_randomize_zeros(),
           **{k: v for k, v in _SANA.items() if k != "num_layers"}, num_layers=2),
     _latent_inputs((8, 8), 4, 1, 8, t=500.0, extra=_sana_cn_extra),
     expect=lambda kw: (kw["hidden_states"].shape[0], kw["hidden_states"].shape[2] * kw["hidden_states"].shape[3], 16),
     notes="SANA ControlNet: controlnet_cond latent through the patch embed; GLUMBConv blocks like SANA",
     since="0.33.0")


def _build_zimage_controlnet():
    torch.manual_seed(0)
    transformer = _cls("ZImageTransformer2DModel")(**_ZIMAGE)
    controlnet = _cls("ZImageControlNetModel")(
        control_layers_places=[0, 1], control_refiner_layers_places=[0], control_in_dim=16,
        add_control_noise_refiner="control_noise_refiner", all_patch_size=(2,), all_f_patch_size=(1,), dim=32,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, qk_norm=True)
    controlnet = _cls("ZImageControlNetModel").from_transformer(controlnet, transformer)
    with torch.no_grad():
        _randomize_zeros()(controlnet)
    return controlnet.float().eval()


def _zimage_cn_inputs(default):
    base = _zimage_inputs(default)

    def inputs(batch=2, grid=None, seed=0):
        kw = base(batch, grid, seed)
        g = _gen(seed + 7)
        kw["control_context"] = [_randn(g, *x.shape) for x in kw["x"]]
        return kw

    return inputs


def _zimage_cn_expect(kw):
    c, f, hh, ww = kw["x"][0].shape
    pad = lambda n: -(-n // 32) * 32  # noqa: E731
    return (len(kw["x"]), pad(hh * ww // 4) + pad(kw["cap_feats"][0].shape[0]), 32)


_add("z-image-controlnet", "ZImageControlNetModel", "image", (4, 8), _build_zimage_controlnet,
     _zimage_cn_inputs((4, 8)), latent="x", expect=_zimage_cn_expect,
     notes="Z-Image ControlNet: shares the transformer's embedders/refiners (from_transformer); returns "
           "{layer index: residual (B, S_unified, D)}", since="0.36.0")


# ==============================================================================================================
# UNet-side ControlNets: Union (SDXL), ControlNet-XS, SparseCtrl; Cosmos ControlNet


def _union_extra(batch, g, dims):
    h, w = dims
    return {"controlnet_cond": [_randn(g, batch, 3, 2 * h, 2 * w)],
            "control_type": torch.tensor([[1.0, 0.0, 0.0]]).repeat(batch, 1), "control_type_idx": [0],
            "added_cond_kwargs": {"text_embeds": _randn(g, batch, 32), "time_ids": _randn(g, batch, 6)}}


_add("controlnet-union", "ControlNetUnionModel", "image", (8, 8),
     _make("ControlNetUnionModel", block_out_channels=(32, 64),
           down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
           layers_per_block=1, in_channels=4, cross_attention_dim=CROSS, attention_head_dim=8, norm_num_groups=32,
           transformer_layers_per_block=(1, 1), conditioning_embedding_out_channels=(16, 32),
           addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=32 + 6 * 8,
           num_control_type=3, num_trans_channel=32, num_trans_head=2, num_trans_layer=1, num_proj_channel=32,
           post=_randomize_zeros()),
     _unet_inputs((8, 8), extra=_union_extra), latent="sample", expect=_cn_expect(32),
     notes="ControlNet-Union (SDXL): a list of condition images with control_type / control_type_idx; a small "
           "transformer fuses the condition features", since="0.31.0")


def _xs_extra(batch, g, dims):
    h, w = dims
    return {"controlnet_cond": _randn(g, batch, 3, 2 * h, 2 * w)}


_add("controlnet-xs", "UNetControlNetXSModel", "image", (8, 8),
     _make("UNetControlNetXSModel", sample_size=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
           up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64), norm_num_groups=32,
           cross_attention_dim=CROSS, num_attention_heads=2, ctrl_conditioning_embedding_out_channels=(16, 32),
           ctrl_block_out_channels=(4, 8), ctrl_num_attention_heads=2, ctrl_max_norm_num_groups=4,
           post=_randomize_zeros()),
     _unet_inputs((8, 8), extra=_xs_extra), latent="sample", alt_grid=(8, 10),
     notes="ControlNet-XS (grid axes must be even): the base UNet and a small control UNet run interleaved, "
           "exchanging features at every "
           "block (ControlNetXSCrossAttn*Block pairs)")


def _sparsectrl_extra(batch, g, dims):
    f, h, w = dims
    return {"controlnet_cond": _randn(g, batch, 4, f, h, w),
            "conditioning_mask": torch.ones(batch, 1, f, h, w),
            **_motion_extra(batch, g, dims)}


_add("sparsectrl", "SparseControlNetModel", "video", (3, 8, 8),
     _make("SparseControlNetModel", in_channels=4, conditioning_channels=4, block_out_channels=(32, 64),
           down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"), layers_per_block=1, norm_num_groups=32,
           cross_attention_dim=CROSS, attention_head_dim=8, conditioning_embedding_out_channels=(16, 32),
           motion_num_attention_heads=2, concat_conditioning_mask=True, use_simplified_condition_embedding=True,
           post=_randomize_zeros()),
     _unet_inputs((3, 8, 8), video=True, extra=_sparsectrl_extra), latent="sample",
     expect=lambda kw: (kw["sample"].shape[0] * kw["sample"].shape[2], 32, *kw["sample"].shape[3:]),
     notes="SparseCtrl (AnimateDiff): residuals come out frame-flattened (B*F, C, H, W); condition latents + mask",
     since="0.30.0")


def _cosmos_cn_inputs(default):
    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        g = _gen(seed)
        return dict(controls_latents=_randn(g, batch, 4, f, 2 * h, 2 * w), latents=_randn(g, batch, 4, f, 2 * h, 2 * w),
                    timestep=_t(batch, 500.0), encoder_hidden_states=_randn(g, batch, TXT, 16),
                    condition_mask=torch.zeros(batch, 1, f, 2 * h, 2 * w), padding_mask=torch.zeros(1, 1, 2 * h, 2 * w),
                    fps=30)

    return inputs


_add("cosmos-controlnet", "CosmosControlNetModel", "video", (2, 4, 4),
     _make("CosmosControlNetModel", n_controlnet_blocks=2, in_channels=4 + 1 + 1 + 1, latent_channels=4 + 1 + 1,
           model_channels=24, num_attention_heads=2, attention_head_dim=12, mlp_ratio=2.0, text_embed_dim=16,
           adaln_lora_dim=4, max_size=(4, 32, 32), post=_randomize_zeros()),
     _cosmos_cn_inputs((2, 4, 4)), latent="latents", requires=("torchvision",),
     expect=lambda kw: (kw["latents"].shape[0],
                        kw["latents"].shape[2] * kw["latents"].shape[3] * kw["latents"].shape[4] // 4, 24),
     notes="Cosmos-Transfer ControlNet: VACE-style control blocks over control tokens; resizes padding_mask with "
           "torchvision", since="0.37.0")


# ==============================================================================================================
# Qwen-Image 2.1 (single stream, image tokens in VLM slots), CogView 3+/4, AuraFlow, HunyuanImage 2.1, PRX,
# NucleusMoE, Kandinsky 5, Helios, Motif-Video


def _qwen21_inputs(default):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        slots = h * w // 4  # one VLM image slot per 2x2 group of target tokens
        img_mask = torch.zeros(batch, TXT + slots, dtype=torch.bool)
        img_mask[:, TXT:] = True
        return dict(hidden_states=_randn(g, batch, h * w, 4), encoder_hidden_states=_randn(g, batch, TXT, 8),
                    encoder_hidden_states_mask=torch.ones(batch, TXT, dtype=torch.long), timestep=_t(batch, 0.6),
                    img_shapes=[[(1, h, w)]] * batch, img_mask=img_mask)

    return inputs


_add("qwen-image-2.1", "QwenImage21Transformer2DModel", "image", (4, 4),
     _make("QwenImage21Transformer2DModel", patch_size=1, in_channels=4, out_channels=4, num_layers=2,
           attention_head_dim=16, num_attention_heads=2, context_in_dim=8, mlp_ratio=2, axes_dims_rope=(4, 6, 6)),
     _qwen21_inputs((4, 4)), alt_grid=(4, 6),
     expect=lambda kw: (kw["hidden_states"].shape[0], TXT + kw["hidden_states"].shape[1], 4),
     notes="Qwen-Image 2.1: returns the whole joint sequence (the pipeline keeps the last N rows); ONE stream = the "
           "VLM sequence with each image slot expanded to a 2x2 group of latent "
           "tokens (grid axes even); block-causal mask; target image last; timestep 0..1", since="0.38.0")


def _cogview_extra(batch, g, h, w):
    size = torch.tensor([[16.0 * h, 16.0 * w]]).repeat(batch, 1)
    return {"original_size": size, "target_size": size, "crop_coords": torch.zeros(batch, 2)}


_add("cogview3plus", "CogView3PlusTransformer2DModel", "image", (4, 4),
     _make("CogView3PlusTransformer2DModel", patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4,
           num_attention_heads=4, out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=2,
           pos_embed_max_size=8, sample_size=8),
     _latent_inputs((4, 4), 4, 2, 8, t=500.0, extra=_cogview_extra),
     notes="CogView3-Plus: joint [text | image] blocks, cropped sin-cos position table", since="0.31.0")
_add("cogview4", "CogView4Transformer2DModel", "image", (4, 4),
     _make("CogView4Transformer2DModel", patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4,
           num_attention_heads=4, out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=4,
           rope_axes_dim=(2, 2)),
     _latent_inputs((4, 4), 4, 2, 8, t=500.0, extra=_cogview_extra),
     notes="CogView4: joint [text | image], 2-D rope on image rows", since="0.33.0")
_add("aura-flow", "AuraFlowTransformer2DModel", "image", (4, 4),
     _make("AuraFlowTransformer2DModel", sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1,
           num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
           caption_projection_dim=16, out_channels=4, pos_embed_max_size=64),
     _latent_inputs((4, 4), 4, 2, 16, t=0.5),
     notes="AuraFlow: MMDiT blocks then single DiT blocks ([text | image]); register tokens", since="0.30.0")


def _hyimage_extra(batch, g, h, w):
    return {"encoder_attention_mask": torch.ones(batch, TXT, dtype=torch.bool),
            "encoder_hidden_states_2": _randn(g, batch, 4, 8),
            "encoder_attention_mask_2": torch.ones(batch, 4, dtype=torch.bool)}


_add("hunyuan-image-2.1", "HunyuanImageTransformer2DModel", "image", (4, 4),
     _make("HunyuanImageTransformer2DModel", in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
           num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1), text_embed_dim=16,
           text_embed_2_dim=8, rope_axes_dim=(4, 4)),
     _latent_inputs((4, 4), 4, 1, 16, t=500.0, extra=_hyimage_extra),
     notes="HunyuanImage 2.1: HunyuanVideo-style double + single blocks ([image | text]) on a 32x VAE latent, "
           "patch 1; byT5 glyph tokens as a second text", since="0.36.0")
_add("prx", "PRXTransformer2DModel", "image", (4, 4),
     _make("PRXTransformer2DModel", in_channels=4, patch_size=2, context_in_dim=16, hidden_size=32, mlp_ratio=2.0,
           num_heads=2, depth=2, axes_dim=[8, 8], post=_randomize_zeros()),
     _latent_inputs((4, 4), 4, 2, 16, t=0.5,
                    extra=lambda b, g, h, w: {"attention_mask": torch.ones(b, TXT, dtype=torch.bool)}),
     notes="PRX (Photoroom; zero-initialised modulation made random, else every block is the identity): timestep "
           "t/1000", since="0.36.0")
_add("nucleus-moe-image", "NucleusMoEImageTransformer2DModel", "image", (4, 4),
     _make("NucleusMoEImageTransformer2DModel", patch_size=2, in_channels=16, out_channels=4, num_layers=2,
           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
           mlp_ratio=2.0, moe_enabled=True, dense_moe_strategy="leave_first_three_and_last_block_dense", num_experts=4,
           moe_intermediate_dim=16, capacity_factors=8.0),
     lambda batch=2, grid=None, seed=0: {**_qwen_inputs((4, 4))(batch, grid, seed),
                                         "img_shapes": [(1, *_grid(grid, (4, 4)))] * batch},
     notes="NucleusMoE-Image: Qwen-style packed tokens + img_shapes, MoE feed-forwards", since="0.38.0")


def _k5_inputs(default, visual_cond=False):
    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        g = _gen(seed)
        c = 4 * 2 + 1 if visual_cond else 4
        return dict(hidden_states=_randn(g, batch, f, 2 * h, 2 * w, c), encoder_hidden_states=_randn(g, batch, TXT, 8),
                    timestep=_t(batch, 500.0), pooled_projections=_randn(g, batch, 8),
                    visual_rope_pos=[torch.arange(f), torch.arange(h), torch.arange(w)],
                    text_rope_pos=torch.arange(TXT))

    return inputs


_add("kandinsky5", "Kandinsky5Transformer3DModel", "video", (2, 4, 4),
     _make("Kandinsky5Transformer3DModel", in_visual_dim=4, in_text_dim=8, in_text_dim2=8, time_dim=16,
           out_visual_dim=4,
           patch_size=(1, 2, 2), model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6),
           post=_randomize_zeros()),
     _k5_inputs((2, 4, 4)),
     notes="Kandinsky 5: latent (B, F, H, W, C) channels LAST; text blocks first, then visual blocks with "
           "cross-attention; NABLA sparse attention reorders tokens 'fractally' when enabled; the zero-initialised "
           "modulations are made random (else every block is the identity)", since="0.36.0")


def _helios_extra(batch, g, f, h, w):
    hh, ww = 2 * h, 2 * w
    return {"indices_hidden_states": torch.arange(1, f + 1).float().expand(batch, f),
            "indices_latents_history_short": torch.zeros(batch, 1),
            "indices_latents_history_mid": torch.zeros(batch, 1),
            "indices_latents_history_long": torch.zeros(batch, 4),
            "latents_history_short": _randn(g, batch, 4, 1, hh, ww),
            "latents_history_mid": _randn(g, batch, 4, 1, hh, ww),
            "latents_history_long": _randn(g, batch, 4, 4, hh, ww)}


_add("helios", "HeliosTransformer3DModel", "video", (2, 4, 4),
     _make("HeliosTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
           in_channels=4,
           out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_dim=(4, 4, 4),
           has_multi_term_memory_patch=True, guidance_cross_attn=True, zero_history_timestep=True),
     _video_inputs((2, 4, 4), 4, (1, 2, 2), 16, extra=_helios_extra), alt_grid=(2, 4, 6),
     notes="Helios: Wan-style blocks; short/mid/long history latents are patch-embedded (coarser for mid/long) and "
           "prepended to the sequence (Framepack-like)", since="0.37.0")
_add("motif-video", "MotifVideoTransformer3DModel", "video", (2, 4, 4),
     _make("MotifVideoTransformer3DModel", in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=12,
           num_layers=1, num_single_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=16, rope_axes_dim=(4, 4, 4)),
     _video_inputs((2, 4, 4), 9, (1, 2, 2), 16, mask="encoder_attention_mask"), expect=_out_channels(4),
     notes="Motif-Video: HunyuanVideo-style double + single blocks; latent = [noise | cond | mask]",
     since="0.38.0")


# ==============================================================================================================
# Krea 2, Ideogram 4, GLM-Image, OmniGen: sequences with explicit position ids


def _krea2_inputs(default, text_layers=3, text_dim=16):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        pos = torch.zeros(TXT + h * w, 3)
        pos[TXT:, 1] = torch.arange(h).repeat_interleave(w)
        pos[TXT:, 2] = torch.arange(w).repeat(h)
        return dict(hidden_states=_randn(g, batch, h * w, 16),
                    encoder_hidden_states=_randn(g, batch, TXT, text_layers, text_dim),  # (B, L, LLM layers, D)
                    timestep=_t(batch, 0.5), position_ids=pos,
                    encoder_attention_mask=torch.ones(batch, TXT, dtype=torch.bool))

    return inputs


_add("krea2", "Krea2Transformer2DModel", "image", (4, 4),
     _make("Krea2Transformer2DModel", in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
           num_key_value_heads=2, intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=16, num_text_layers=3,
           text_num_attention_heads=2, text_num_key_value_heads=1, text_intermediate_size=16,
           num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2)),
     _krea2_inputs((4, 4)),
     notes="Krea 2: packed tokens; position_ids (L + N, 3) = text rows (zeros) then image (0, row, col); "
           "encoder_hidden_states carries several LLM layers (B, L, layers, D); optional reference_hidden_states",
     since="0.38.0")


def _ideogram4_inputs(default, llm_dim=24):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        n, s = h * w, TXT + h * w
        x = torch.zeros(batch, s, 16)
        x[:, TXT:] = _randn(g, batch, n, 16)
        ctx = torch.zeros(batch, s, llm_dim)
        ctx[:, :TXT] = _randn(g, batch, TXT, llm_dim)
        off = 65536  # IMAGE_POSITION_OFFSET
        pos = torch.zeros(batch, s, 3, dtype=torch.long)
        pos[:, :TXT] = torch.arange(TXT)[:, None]
        pos[:, TXT:, 0] = off
        pos[:, TXT:, 1] = torch.arange(h).repeat_interleave(w) + off
        pos[:, TXT:, 2] = torch.arange(w).repeat(h) + off
        indicator = torch.full((batch, s), 2, dtype=torch.long)  # OUTPUT_IMAGE_INDICATOR
        indicator[:, :TXT] = 3  # LLM_TOKEN_INDICATOR
        segments = torch.ones(batch, s, dtype=torch.long)
        # the pipeline's [left padding | text | image]: the first sample's prompt is 2 tokens shorter
        indicator[0, :2], segments[0, :2], ctx[0, :2], pos[0, :2] = 0, -1, 0.0, 0
        return dict(hidden_states=x, timestep=_t(batch, 0.5), encoder_hidden_states=ctx, position_ids=pos,
                    segment_ids=segments, indicator=indicator)

    return inputs


_add("ideogram4", "Ideogram4Transformer2DModel", "image", (4, 4),
     _make("Ideogram4Transformer2DModel", in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
           intermediate_size=32, adaln_dim=16, llm_features_dim=24, rope_theta=10_000, mrope_section=(2, 1, 1)),
     _ideogram4_inputs((4, 4)),
     notes="Ideogram 4: ONE sequence [text rows | image rows] from the input on (hidden_states zero on text rows, "
           "encoder_hidden_states zero on image rows), indicator/segment_ids per token, M-RoPE with image positions "
           "offset by 65536; output covers the whole sequence", since="0.38.0")


def _glm_extra(batch, g, h, w):
    size = torch.tensor([[2.0 * h, 2.0 * w]]).repeat(batch, 1)
    return {"prior_token_id": torch.randint(0, 64, (batch, h * w), generator=g),
            "prior_token_drop": torch.zeros(batch, dtype=torch.bool), "target_size": size,
            "crop_coords": torch.zeros(batch, 2)}


_add("glm-image", "GlmImageTransformer2DModel", "image", (4, 4),
     _make("GlmImageTransformer2DModel", patch_size=2, in_channels=4, out_channels=4, num_layers=1,
           attention_head_dim=8,
           num_attention_heads=2, text_embed_dim=32, time_embed_dim=16, condition_dim=8,
           prior_vq_quantizer_codebook_size=64),
     _latent_inputs((4, 4), 4, 2, 32, t=500.0, extra=_glm_extra),
     notes="GLM-Image: CogView4-style joint blocks + per-token prior VQ token embeddings added to the image "
           "tokens (prior_token_id (B, N))", since="0.37.0")


def _omnigen_inputs(default, vocab=1000):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        n, L = h * w, 8
        s = L + 1 + n  # [text | time token | image]
        return dict(hidden_states=_randn(g, batch, 4, 2 * h, 2 * w), timestep=_t(batch, 0.6),
                    input_ids=torch.randint(1, 10, (batch, L), generator=g), input_img_latents=[],
                    input_image_sizes={}, attention_mask=torch.ones(batch, s, s),
                    position_ids=torch.arange(s).expand(batch, s).contiguous())

    return inputs


_add("omnigen", "OmniGenTransformer2DModel", "image", (4, 4),
     _make("OmniGenTransformer2DModel", hidden_size=16, num_attention_heads=4, num_key_value_heads=4,
           intermediate_size=32, num_layers=2, pad_token_id=0, vocab_size=1000, in_channels=4, time_step_dim=4,
           rope_scaling={"long_factor": [1, 2], "short_factor": [1, 2]}),
     _omnigen_inputs((4, 4)),
     notes="OmniGen (Phi-3 LLM): ONE sequence [text (image placeholders replaced by input-image latents) | time "
           "token | output image], a (B, S, S) attention mask and position_ids; timestep 0..1", since="0.32.0")


# ==============================================================================================================
# JoyImage-Edit (+Plus), ERNIE-Image, Bria FIBO 2, Flux 3


def _joy_inputs(default, plus=False, items=2):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        if plus:  # pre-patchified: (B, tokens, C, pt, ph, pw), item shapes in tokens
            x = _randn(g, batch, items * h * w, 16, 1, 2, 2)
        else:  # (B, items, C, T, H, W): [reference(s).., target]
            x = _randn(g, batch, items, 16, 1, 2 * h, 2 * w)
        kw = dict(hidden_states=x, encoder_hidden_states=_randn(g, batch, TXT, 16), timestep=_t(batch, 600.0))
        if plus:
            kw["shape_list"] = [[(1, h, w)] * items] * batch
        return kw

    return inputs


_JOY = dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=32, num_attention_heads=2, text_dim=16, num_layers=2,
            rope_dim_list=[4, 6, 6], theta=256)
_add("joyimage-edit", "JoyImageEditTransformer3DModel", "image", (2, 2),
     _make("JoyImageEditTransformer3DModel", **_JOY),
     _joy_inputs((2, 2)),
     notes="JoyImage-Edit: hidden_states (B, items, C, 1, H, W) = [reference(s).., target]; the model moves the "
           "target first and flattens items into the frame axis (tokens item-major)", since="0.38.0")
_add("joyimage-edit-plus", "JoyImageEditPlusTransformer3DModel", "image", (2, 2),
     _make("JoyImageEditPlusTransformer3DModel", **_JOY), _joy_inputs((2, 2), plus=True),
     notes="JoyImage-Edit-Plus: hidden_states are pre-patchified tokens (B, max_patches, C, 1, 2, 2) of all items; "
           "per-item token shapes in shape_list (items may differ in size)",
     since="0.38.0")
_add("ernie-image", "ErnieImageTransformer2DModel", "image", (8, 8),
     _make("ErnieImageTransformer2DModel", hidden_size=16, num_attention_heads=1, num_layers=1, ffn_hidden_size=16,
           in_channels=16, out_channels=16, patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=(8, 4, 4),
           post=_randomize_zeros()),
     _latent_inputs((8, 8), 16, 1, 16, t=600.0, text_key="text_bth",
                    extra=lambda b, g, h, w: {"text_lens": torch.full((b,), TXT)}),
     notes="ERNIE-Image (zero-initialised output layer made random): patch 1 on a 16x VAE latent (B, 128, H, W); text "
           "given as (B, L, D) + per-sample lengths; "
           "one shared adaLN", since="0.38.0")


def _fibo2_inputs(default, bundles=2, text_dim=24):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        return dict(hidden_states=_randn(g, batch, 4, 2 * h, 2 * w), timestep=_t(batch, 0.5),
                    encoder_hidden_states=_randn(g, batch, bundles, 6, text_dim))

    return inputs


_add("bria-fibo2", "BriaFibo2Transformer2DModel", "image", (4, 4),
     _make("BriaFibo2Transformer2DModel", in_channels=4, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1,
           n_heads=2,
           cap_feat_dim=24, injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=4,
           max_num_gist_tokens=8, gist_step=4, gist_min_text_len=4, gist_max_text_len=16, axes_dims=(4, 6, 6),
           axes_lens=(16, 16, 16)),
     _fibo2_inputs((4, 4)),
     notes="Bria FIBO 2: Z-Image-style unified stream; text compressed to Perceiver 'gist' tokens; text bundles "
           "(B, 1 + injections, L, D) re-injected by cross-attention in injection_layer_ids; per-token timesteps "
           "with context_latents (edit images)", since="0.39.0")


def _flux3_inputs(default, cond=False):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        kw = dict(hidden_states=_randn(g, batch, h * w, 16), encoder_hidden_states=_randn(g, batch, TXT, 32),
                  timestep=_t(batch, 0.6), img_ids=_flux2_ids(h, w),
                  txt_ids=_cartesian_ids(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(TXT)))
        if cond:
            kw["image_cond_hidden_states"] = _randn(g, batch, h * w, 16)
            kw["image_cond_ids"] = _flux2_ids(h, w, t=10)
        return kw

    return inputs


_FLUX3 = dict(in_channels=16, cond_in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, timestep_channels=32, mlp_ratio=3.0,
              axes_dims_rope=(4, 4, 4, 4))
_add("flux3", "Flux3Transformer2DModel", "image", (4, 4), _make("Flux3Transformer2DModel", **_FLUX3),
     _flux3_inputs((4, 4)),
     notes="Flux 3: Flux.2-style double + parallel single blocks, 4-axis ids, timestep 0..1", since="0.39.0")
_add("flux3-ref", "Flux3Transformer2DModel", "image", (4, 4), _make("Flux3Transformer2DModel", **_FLUX3),
     _flux3_inputs((4, 4), cond=True),
     notes="Flux 3 with a reference image: image_cond_hidden_states / image_cond_ids, a third token mode",
     since="0.39.0")


# ==============================================================================================================
# Older / smaller denoisers: UNet2DModel (unconditional), StableCascadeUNet, Kandinsky3UNet, UVit2D (aMUSEd),
# the UNets' inner transformers (Dual, Temporal), and 1-D / prior models (kind "audio" / "other")


_add("unet-2d", "UNet2DModel", "image", (8, 8),
     _make("UNet2DModel", sample_size=8, in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1,
           down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
           attention_head_dim=8, norm_num_groups=32),
     lambda batch=2, grid=None, seed=0: {"sample": _randn(_gen(seed), batch, 3, *_grid(grid, (8, 8))),
                                         "timestep": torch.tensor(500)},
     latent="sample", alt_grid=(8, 10),
     notes="UNet2DModel (DDPM, unconditional): attention only at the second level (AttnDownBlock2D); grid axes "
           "even")


def _cascade_inputs(default):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        return dict(sample=_randn(g, batch, 4, h, w), timestep_ratio=torch.full((batch,), 0.5),
                    clip_text_pooled=_randn(g, batch, 1, 16), clip_text=_randn(g, batch, TXT, 16),
                    clip_img=_randn(g, batch, 1, 16))

    return inputs


_add("stable-cascade-prior", "StableCascadeUNet", "image", (8, 8),
     _make("StableCascadeUNet", in_channels=4, out_channels=4, timestep_ratio_embedding_dim=8, patch_size=1,
           conditioning_dim=32, block_out_channels=(32, 32), num_attention_heads=(2, 2),
           down_num_layers_per_block=(1, 1),
           up_num_layers_per_block=(1, 1), clip_text_in_channels=16, clip_text_pooled_in_channels=16,
           clip_image_in_channels=16, clip_seq=2, kernel_size=3, dropout=(0.0, 0.0), self_attn=True,
           timestep_conditioning_type=("sca",), switch_level=(False,)),
     _cascade_inputs((8, 8)), latent="sample", alt_grid=(8, 10),
     notes="Stable Cascade stage C (prior): SDCascadeAttnBlock attends over [image tokens | CLIP tokens] "
           "(self_attn=True concatenates the image tokens to the keys); timestep_ratio 0..1", since="0.27.0")
_add("kandinsky3-unet", "Kandinsky3UNet", "image", (8, 8),
     _make("Kandinsky3UNet", in_channels=4, time_embedding_dim=32, groups=8, attention_head_dim=8, layers_per_block=2,
           block_out_channels=(16, 16, 32, 32), cross_attention_dim=16, encoder_hid_dim=16),
     lambda batch=2, grid=None, seed=0: {"sample": _randn(_gen(seed), batch, 4, *_grid(grid, (8, 8))),
                                         "timestep": _t(batch, 500).long(),
                                         "encoder_hidden_states": _randn(_gen(seed + 1), batch, TXT, 16),
                                         "encoder_attention_mask": torch.ones(batch, TXT)},
     latent="sample", alt_grid=(8, 16),
     notes="Kandinsky 3 UNet (4 levels and layers_per_block >= 2 are hard-coded): attention blocks reshape (B, C, H, "
           "W) <-> tokens inside Kandinsky3AttentionBlock")


def _uvit_inputs(default):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        return dict(input_ids=torch.randint(0, 32, (batch, h, w), generator=g),
                    encoder_hidden_states=_randn(g, batch, TXT, 16),
                    pooled_text_emb=_randn(g, batch, 16), micro_conds=torch.rand(batch, 5, generator=g))

    return inputs


_add("uvit2d", "UVit2DModel", "image", (4, 4),
     _make("UVit2DModel", hidden_size=32, cond_embed_dim=16, micro_cond_encode_dim=2, micro_cond_embed_dim=10,
           encoder_hidden_size=16, vocab_size=34, codebook_size=32, in_channels=16, block_out_channels=16,
           num_res_blocks=1, block_num_heads=2, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
           sample_size=4),
     _uvit_inputs((4, 4)), latent="input_ids",
     expect=lambda kw: (kw["input_ids"].shape[0], 32, *kw["input_ids"].shape[1:]),
     notes="aMUSEd U-ViT: masked-token model over VQ ids (B, H, W); returns logits (B, codebook, H, W); "
           "not a diffusion latent")
_add("dual-transformer-2d", "DualTransformer2DModel", "other", (8, 8),
     _make("DualTransformer2DModel", num_attention_heads=2, attention_head_dim=8, in_channels=32, num_layers=1,
           norm_num_groups=32, cross_attention_dim=CROSS),
     lambda batch=2, grid=None, seed=0: {"hidden_states": _randn(_gen(seed), batch, 32, *_grid(grid, (8, 8))),
                                         "encoder_hidden_states": _randn(_gen(seed + 1), batch, 77 + 257, CROSS)},
     notes="Versatile Diffusion's dual transformer: two Transformer2DModels over the text (first 77) and image "
           "(next 257) context tokens, mixed; context length fixed by condition_lengths")
_add("transformer-temporal", "TransformerTemporalModel", "other", (3, 8, 8),
     _make("TransformerTemporalModel", num_attention_heads=2, attention_head_dim=8, in_channels=32, norm_num_groups=32,
           num_layers=1),
     lambda batch=2, grid=None, seed=0: {
         "hidden_states": _randn(_gen(seed), batch * _grid(grid, (3, 8, 8))[0], 32, *_grid(grid, (3, 8, 8))[1:]),
         "num_frames": _grid(grid, (3, 8, 8))[0]},
     notes="the temporal transformer of video UNets: input (B*F, C, H, W), attention over F per pixel")


# ==============================================================================================================
# ConsisID, AnyFlow, MiniMax-H3 (audio + video), SANA-WM


def _consisid_extra(batch, g, f, h, w):
    return {"id_vit_hidden": [torch.ones(batch, 2, 2)], "id_cond": torch.ones(batch, 2)}


def _frames_first_inputs(default, ch, text_dim, extra=None, t=500.0, timestep=None):
    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        g = _gen(seed)
        kw = dict(hidden_states=_randn(g, batch, f, ch, 2 * h, 2 * w),
                  encoder_hidden_states=_randn(g, batch, TXT, text_dim),
                  timestep=_t(batch, t) if timestep is None else timestep(batch, f))
        if extra is not None:
            kw.update(extra(batch, g, f, h, w))
        return kw

    return inputs


_add("consisid", "ConsisIDTransformer3DModel", "video", (2, 4, 4),
     _make("ConsisIDTransformer3DModel", num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
           time_embed_dim=2, text_embed_dim=8, num_layers=1, sample_width=8, sample_height=8, sample_frames=5,
           patch_size=2, temporal_compression_ratio=4, max_text_seq_length=TXT, cross_attn_interval=1, is_kps=False,
           is_train_face=True, cross_attn_dim_head=1, cross_attn_num_heads=1, LFE_id_dim=2, LFE_vit_dim=2, LFE_depth=5,
           LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=1, LFE_num_querie=1, LFE_output_dim=10, LFE_ff_mult=1,
           LFE_num_scale=1),
     _frames_first_inputs((2, 4, 4), 4, 8, extra=_consisid_extra),
     notes="ConsisID: the CogVideoX layout ((B, F, C, H, W), [text | video]) + face cross-attention "
           "(perceiver identity tokens) after every cross_attn_interval blocks", since="0.33.0")
_add("anyflow", "AnyFlowTransformer3DModel", "video", (2, 4, 4),
     _make("AnyFlowTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
           in_channels=4,
           out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
     lambda batch=2, grid=None, seed=0: {
         **_frames_first_inputs((2, 4, 4), 4, 16, timestep=lambda b, f: torch.full((b, f), 500.0))(batch, grid, seed),
         "r_timestep": torch.full((batch, _grid(grid, (2, 4, 4))[0]), 250.0)},
     notes="AnyFlow: Wan-style blocks, latent (B, F, C, H, W) frames first, per-frame timestep and r_timestep (flow "
           "map)", since="0.39.0")


def _h3_inputs(default, audio=6, audio_ch=6, text_dim=8):
    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        g = _gen(seed)
        n = f * h * w
        s = TXT + audio + n  # [text | audio | video]
        text_i, audio_i, video_i = torch.arange(TXT), torch.arange(TXT, TXT + audio), torch.arange(TXT + audio, s)
        tags = torch.empty(s, dtype=torch.long)
        tags[text_i], tags[audio_i], tags[video_i] = 1, 2, 0
        t_idx = torch.zeros(s, dtype=torch.long)
        t_idx[audio_i] = 1
        pos = torch.zeros(s, 3)
        pos[:, 0] = torch.arange(s, dtype=torch.float32)
        pos[video_i, 0] = torch.arange(f).repeat_interleave(h * w).float() + TXT + audio
        pos[video_i, 1] = torch.arange(h).repeat_interleave(w).repeat(f).float()
        pos[video_i, 2] = torch.arange(w).repeat(f * h).float()
        return dict(hidden_states=_randn(g, batch, n, 16), audio_hidden_states=_randn(g, batch, audio, audio_ch),
                    encoder_hidden_states=_randn(g, batch, TXT, text_dim), timestep=torch.tensor([0.7, 0.3]),
                    timestep_indices=t_idx, token_tags=tags, position_ids=pos, video_indices=video_i,
                    audio_indices=audio_i, text_indices=text_i)

    return inputs


_add("minimax-h3", "MiniMaxH3Transformer3DModel", "video", (2, 2, 2),
     _make("MiniMaxH3Transformer3DModel", num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2,
           num_refiner_layers=2, ffn_dim=32, in_channels=4, audio_in_channels=6, patch_size=(1, 2, 2), text_dim=8,
           freq_dim=8, time_embed_hidden_dim=24, time_embed_dim=16, rope_freq_dim=2),
     _h3_inputs((2, 2, 2)),
     notes="MiniMax-H3: ONE packed sequence [text | audio | video] built by the caller, rows tagged by token_tags "
           "and timestep_indices (an AdaLN table per (timestep, modality)), 3-D position_ids; pre-patchified video "
           "tokens (B, N, C*p*p); returns (video, audio)", since="0.39.0")


def _sana_wm_inputs(default, ch=4, caption=8, plucker=8):
    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        g = _gen(seed)
        c2w = torch.eye(4).repeat(batch, f, 1, 1)
        c2w[..., 2, 3] = torch.arange(f, dtype=torch.float32) * 0.1
        intr = torch.tensor([float(w), float(h), w / 2, h / 2]).expand(batch, f, 4)
        return dict(hidden_states=_randn(g, batch, ch, f, h, w), timestep=torch.full((batch, 1, f), 500.0),
                    encoder_hidden_states=_randn(g, batch, 1, TXT, caption),
                    encoder_attention_mask=torch.ones(batch, TXT, dtype=torch.long),
                    camera_conditions=torch.cat([c2w.flatten(start_dim=-2), intr], dim=-1),
                    chunk_plucker=_randn(g, batch, plucker, f, h, w))

    return inputs


_add("sana-wm", "SanaWMTransformer3DModel", "video", (4, 8, 8),
     _make("SanaWMTransformer3DModel", in_channels=4, num_layers=2, hidden_size=32, num_attention_heads=2,
           patch_size=(1, 1, 1), softmax_every_n=2, linear_head_dim=16, t_kernel_size=3, conv_kernel_size=4,
           caption_channels=8, mlp_ratio=2.0, chunk_plucker_channels=8, chunk_plucker_post_attn_blocks=2),
     _sana_wm_inputs((4, 8, 8)), alt_grid=(4, 8, 10),
     notes="SANA-WM (world model): camera-conditioned video, per-frame timestep (B, 1, F), linear (gated delta) "
           "attention with temporal short convolutions and every n-th block softmax; convolutions over the token "
           "grid", since="0.39.0")


# ==============================================================================================================
# 1-D, audio and prior denoisers (kind "audio" / "other"); grid = (L,) sequence positions


def _build_unet1d():
    """UNet1D's fourier time features are concatenated to the input: 16 channels (0.27 hard-codes
    embedding_size=8; newer releases take time_embedding_dim, whose default grew to 2 * block_out_channels[0])."""
    import inspect

    config = dict(sample_size=16, in_channels=2, out_channels=2, extra_in_channels=16, block_out_channels=(32, 32, 64),
                  down_block_types=("DownBlock1DNoSkip", "DownBlock1D", "AttnDownBlock1D"),
                  up_block_types=("AttnUpBlock1D", "UpBlock1D", "UpBlock1DNoSkip"), mid_block_type="UNetMidBlock1D",
                  norm_num_groups=8, layers_per_block=1, use_timestep_embedding=False, time_embedding_type="fourier",
                  flip_sin_to_cos=True)
    if "time_embedding_dim" in inspect.signature(_cls("UNet1DModel").__init__).parameters:
        config["time_embedding_dim"] = 16
    return _make("UNet1DModel", **config)()


_add("unet-1d", "UNet1DModel", "audio", (16,), _build_unet1d,
     lambda batch=2, grid=None, seed=0: {"sample": _randn(_gen(seed), batch, 2, _grid(grid, (16,))[0] * 4),
                                         "timestep": torch.tensor(10)},
     latent="sample", alt_grid=(32,),
     notes="Dance Diffusion UNet1D: grid = sample length / 4; attention only at the lowest levels "
           "(AttnDownBlock1D / UNetMidBlock1D, over (B, C, L') reshaped inside); keep lengths powers of two")


def _stable_audio_inputs(default, ch=4, head_dim=8, cross=16, global_dim=8):
    def inputs(batch=2, grid=None, seed=0):
        from diffusers.models.embeddings import get_1d_rotary_pos_embed

        (length,) = _grid(grid, default)
        g = _gen(seed)
        return dict(hidden_states=_randn(g, batch, ch, length), timestep=_t(batch, 500.0),
                    encoder_hidden_states=_randn(g, batch, TXT, cross),
                    global_hidden_states=_randn(g, batch, 1, global_dim),
                    rotary_embedding=get_1d_rotary_pos_embed(head_dim // 2, length + 1, use_real=True,
                                                             repeat_interleave_real=False))

    return inputs


_add("stable-audio", "StableAudioDiTModel", "audio", (16,),
     _make("StableAudioDiTModel", sample_size=16, in_channels=4, num_layers=2, attention_head_dim=8,
           num_attention_heads=2,
           num_key_value_attention_heads=1, out_channels=4, cross_attention_dim=16, time_proj_dim=8,
           global_states_input_dim=8, cross_attention_input_dim=16),
     _stable_audio_inputs((16,)),
     notes="Stable Audio Open: latent (B, C, L); the global (duration) token is PREPENDED to the sequence "
           "([global | audio], rope over L + 1 rows, half the head dim); cross-attention to T5 + duration tokens",
     since="0.30.0")


def _prior_inputs(dim=16, n=3):
    def inputs(batch=2, grid=None, seed=0):
        g = _gen(seed)
        return dict(hidden_states=_randn(g, batch, dim), timestep=torch.tensor(10),
                    proj_embedding=_randn(g, batch, dim),
                    encoder_hidden_states=_randn(g, batch, n, dim),
                    attention_mask=torch.ones(batch, n, dtype=torch.bool))

    return inputs


_add("prior", "PriorTransformer", "other", (1,),
     _make("PriorTransformer", num_attention_heads=2, attention_head_dim=4, num_layers=2, embedding_dim=16,
           num_embeddings=3, additional_embeddings=4),
     _prior_inputs(), fixed_grid=True,
     notes="unCLIP / Kandinsky 2 / Shap-E prior: denoises ONE image embedding (B, D); the sequence is "
           "[text tokens | proj embedding | time | noisy embedding | prd]: nothing spatial to merge")


def _t5film_inputs(default, d_model=16):
    def inputs(batch=2, grid=None, seed=0):
        (length,) = _grid(grid, default)
        g = _gen(seed)
        enc = _randn(g, batch, 6, d_model)
        mask = torch.ones(batch, 6, dtype=torch.bool)
        return dict(encodings_and_masks=[(enc, mask)], decoder_input_tokens=_randn(g, batch, length, 8),
                    decoder_noise_time=torch.rand(batch, generator=g))

    return inputs


_add("t5-film", "T5FilmDecoder", "audio", (16,),
     _make("T5FilmDecoder", input_dims=8, targets_length=16, d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32,
           dropout_rate=0.0),
     _t5film_inputs((16,)), latent="decoder_input_tokens", fixed_grid=True,
     notes="Spectrogram Diffusion decoder (MIDI -> mel): a T5 decoder over targets_length mel frames with FiLM "
           "time conditioning; length fixed by targets_length")


# ==============================================================================================================
# Kandinsky 6 (video + audio)


def _k6_inputs(default, audio=True):
    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        g = _gen(seed)
        kw = dict(hidden_states=_randn(g, batch, f, 2 * h, 2 * w, 2 * 4 + 1),
                  encoder_hidden_states=_randn(g, batch, TXT, 8),
                  pooled_projections=_randn(g, batch, 8), timestep=_t(batch, 500.0))
        if audio:
            kw["audio_hidden_states"] = _randn(g, batch, 6, 4)
        return kw

    return inputs


_add("kandinsky6", "Kandinsky6Transformer3DModel", "video", (2, 2, 2),
     _make("Kandinsky6Transformer3DModel", in_visual_dim=4, out_visual_dim=4, in_text_dim=8, in_text_dim2=8,
           time_dim=16,
           patch_size=(1, 2, 2), model_dim=48, ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 4, 4),
           visual_cond=True, in_audio_dim=4, out_audio_dim=4),
     _k6_inputs((2, 2, 2)), expect=lambda kw: (*kw["hidden_states"].shape[:4], 4),
     notes="Kandinsky 6: latent (B, F, H, W, 2C+1) channels last ([noise | cond | mask]); video and audio text "
           "branches; fused video+audio visual blocks; returns (video, audio)", since="0.39.0")


# ==============================================================================================================
# Audio DiTs: Stable Audio 3, ACE-Step, LongCat-Audio-DiT, MiniMax-Music 3 (1-D latents; grid = (L,))


def _sa3_inputs(default):
    def inputs(batch=2, grid=None, seed=0):
        (length,) = _grid(grid, default)
        g = _gen(seed)
        return dict(hidden_states=_randn(g, batch, 8, length), timestep=torch.rand(batch, generator=g),
                    encoder_hidden_states=_randn(g, batch, TXT, 16), global_hidden_states=_randn(g, batch, 12))

    return inputs


_add("stable-audio-3", "StableAudio3DiTModel", "audio", (16,),
     _make("StableAudio3DiTModel", io_channels=8, patch_size=1, embed_dim=32, depth=2, num_heads=4, cond_token_dim=16,
           global_cond_dim=12, local_add_cond_dim=5, timestep_features_dim=16, ff_mult=2, num_memory_tokens=3,
           use_differential_attention=False),
     _sa3_inputs((16,)),
     notes="Stable Audio 3: latent (B, C, L); learned memory tokens prepended to the sequence; timestep 0..1",
     since="0.39.0")


def _ace_inputs(default):
    def inputs(batch=2, grid=None, seed=0):
        (length,) = _grid(grid, default)
        g = _gen(seed)
        return dict(hidden_states=_randn(g, batch, 2 * length, 8), timestep=torch.rand(batch, generator=g),
                    timestep_r=torch.rand(batch, generator=g), encoder_hidden_states=_randn(g, batch, 10, 32),
                    context_latents=_randn(g, batch, 2 * length, 16))

    return inputs


_add("ace-step", "AceStepTransformer1DModel", "audio", (4,),
     _make("AceStepTransformer1DModel", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, in_channels=24, audio_acoustic_hidden_dim=8, patch_size=2,
           rope_theta=10000.0, sliding_window=16),
     _ace_inputs((4,)),
     notes="ACE-Step 1.5: latent (B, T, C) (time first), patch 2 on T; context_latents concatenated on channels; "
           "sliding-window / full attention layers (layer_types)", since="0.39.0")
_add("longcat-audio-dit", "LongCatAudioDiTTransformer", "audio", (16,),
     _make("LongCatAudioDiTTransformer", dit_dim=64, dit_depth=2, dit_heads=4, dit_text_dim=32, latent_dim=8,
           text_conv=False, post=_randomize_zeros()),
     lambda batch=2, grid=None, seed=0: {
         "hidden_states": _randn(_gen(seed), batch, _grid(grid, (16,))[0], 8),
         "encoder_hidden_states": _randn(_gen(seed + 1), batch, 10, 32),
         "encoder_attention_mask": torch.ones(batch, 10, dtype=torch.bool),
         "attention_mask": torch.ones(batch, _grid(grid, (16,))[0], dtype=torch.bool), "timestep": _t(batch, 0.5)},
     notes="LongCat-Audio-DiT (zero-initialised output made random): latent (B, T, C); a long skip from the input to "
           "the last blocks (long_skip); "
           "self-attention key mask (B, T)", since="0.39.0")
_add("minimax-music3", "MiniMaxMusic3Transformer1DModel", "audio", (24,),
     _make("MiniMaxMusic3Transformer1DModel", in_channels=8, condition_dim=16, num_layers=2, num_attention_heads=2,
           attention_head_dim=8, ff_inner_dim=32, rotary_dim=4, fourier_embedding_dim=8),
     lambda batch=2, grid=None, seed=0: {
         "hidden_states": _randn(_gen(seed), batch, 8, _grid(grid, (24,))[0]),
         "encoder_hidden_states": _randn(_gen(seed + 1), batch, _grid(grid, (24,))[0], 16), "timestep": _t(batch, 0.5)},
     notes="MiniMax-Music 3: latent (B, C, L); the condition is frame-aligned (B, L, D) and concatenated on "
           "channels with the latent (no cross-attention)", since="0.39.0")


# ==============================================================================================================
# Kandinsky 6 super-resolution, Wan-Animate 2 (reference pass), DreamLite (UNet and its transformer)


def _k6sr_inputs(default):
    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        g = _gen(seed)
        return dict(hidden_states=_randn(g, batch, f, 2 * h, 2 * w, 2 * 4 + 1), timestep=_t(batch, 500.0))

    return inputs


_add("kandinsky6-sr", "Kandinsky6SRTransformer3DModel", "video", (2, 8, 8),
     _make("Kandinsky6SRTransformer3DModel", in_visual_dim=4, out_visual_dim=8, time_dim=16, patch_size=(1, 2, 2),
           model_dim=24, ff_dim=32, num_visual_blocks=2, axes_dims=(4, 4, 4)),
     _k6sr_inputs((2, 8, 8)), expect=lambda kw: (*kw["hidden_states"].shape[:4], 8), alt_grid=(2, 8, 16),
     notes="Kandinsky 6 video super-resolution: no text; latent (B, F, H, W, 2C+1) channels last; NABLA sparse "
           "flex attention over 8x8 token blocks (grid H, W multiples of 8)", since="0.39.0")


def _wan_animate2_inputs(default, latent=16, cond=20, text_dim=32):
    def inputs(batch=2, grid=None, seed=0):
        from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

        f, h, w = _grid(grid, default)
        g = _gen(seed)
        return dict(hidden_states=[_randn(g, latent, f, 2 * h, 2 * w) for _ in range(batch)],
                    timestep=torch.ones(batch),
                    encoder_hidden_states=[_randn(g, TXT, text_dim) for _ in range(batch)],
                    condition_latents=[_randn(g, cond, f, 2 * h, 2 * w) for _ in range(batch)],
                    encoder_hidden_states_image=_randn(g, batch, 4, 1280), kv_cache=WanAnimate2KVCache(2),
                    kv_cache_mode="extract", seq_len=f * h * w,
                    offset_grid_sizes=torch.tensor([[f, h, w]] * batch, dtype=torch.long))

    return inputs


_add("wan-animate-2", "WanAnimate2Transformer3DModel", "video", (2, 2, 2),
     _make("WanAnimate2Transformer3DModel", patch_size=(1, 2, 2), text_len=16, in_dim=36, dim=32, ffn_dim=64,
           freq_dim=16,
           text_dim=32, out_dim=16, num_heads=2, num_layers=2, cross_attn_norm=True, use_img_emb=True),
     _wan_animate2_inputs((2, 2, 2)), per_sample=True,
     expect=lambda kw: (len(kw["hidden_states"]), *kw["hidden_states"][0].shape),
     notes="Wan-Animate 2, the reference pass (kv_cache_mode='extract'): lists of per-sample (C, F, H, W) latents, "
           "every layer's K/V cached; the generation pass ('cached') attends [cached reference | current] and "
           "needs that cache. CLIP width 1280 is hard-coded", since="0.39.0")
_add("dreamlite-unet", "DreamLiteUNetModel", "image", (8, 8),
     _make("DreamLiteUNetModel", sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
           layers_per_block=1,
           down_block_types=("DreamLiteCrossAttnNoSelfAttnDownBlock2D", "DreamLiteCrossAttnDownBlock2D"),
           mid_block_type="DreamLiteUNetMidBlock2DCrossAttn",
           up_block_types=("DreamLiteCrossAttnUpBlock2D", "DreamLiteCrossAttnNoSelfAttnUpBlock2D"),
           cross_attention_dim=CROSS, attention_head_dim=8, norm_num_groups=32),
     _unet_inputs((8, 8)), latent="sample", alt_grid=(8, 10),
     notes="DreamLite UNet: SD-style levels; the first level has cross-attention only (no self-attention)",
     since="0.39.0")


# ==============================================================================================================
# SANA-WM LTX-2 refiner, AnyFlow-FAR, DreamLite's transformer


def _sana_refiner_inputs(default):
    def inputs(batch=2, grid=None, seed=0):
        from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMLTX2AudioVideoRotaryPosEmbed

        f, h, w = _grid(grid, default)
        g = _gen(seed)
        rope = SanaWMLTX2AudioVideoRotaryPosEmbed(dim=16, patch_size=1, patch_size_t=1, base_num_frames=20,
                                                  base_height=2048, base_width=2048, scale_factors=(8, 32, 32),
                                                  modality="video", double_precision=False, num_attention_heads=2)
        coords = rope.prepare_video_coords(batch, f, h, w, device=torch.device("cpu"), fps=24.0)
        return dict(hidden_states=_randn(g, batch, f * h * w, 4), encoder_hidden_states=_randn(g, batch, TXT, 16),
                    timestep=torch.full((batch, f * h * w), 500.0),
                    video_rotary_emb=rope(coords, device=torch.device("cpu")),
                    encoder_attention_mask=torch.ones(batch, TXT))

    return inputs


_add("sana-wm-refiner", "SanaWMLTX2RefinerTransformer3DModel", "video", (2, 4, 4),
     _make("SanaWMLTX2RefinerTransformer3DModel", in_channels=4, out_channels=4, patch_size=1, patch_size_t=1,
           num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4,
           audio_out_channels=4,
           audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
           caption_channels=16, rope_double_precision=False),
     _sana_refiner_inputs((2, 4, 4)),
     notes="SANA-WM stage-2 refiner (LTX-2 blocks, video path only): caller-made video_rotary_emb, per-token "
           "timestep (B, N); attention-sink KV cache for block-wise refinement", since="0.39.0")


def _far_inputs(default):
    def inputs(batch=2, grid=None, seed=0):
        f, h, w = _grid(grid, default)
        g = _gen(seed)
        return dict(hidden_states=_randn(g, batch, 2 * f, 4, 2 * h, 2 * w), timestep=torch.full((batch, 2 * f), 500.0),
                    r_timestep=torch.full((batch, 2 * f), 250.0), encoder_hidden_states=_randn(g, batch, TXT, 16),
                    chunk_partition=[f, f])

    return inputs


_add("anyflow-far", "AnyFlowFARTransformer3DModel", "video", (2, 8, 8),
     _make("AnyFlowFARTransformer3DModel", patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=3,
           num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16, freq_dim=32,
           ffn_dim=32, num_layers=2, rope_max_seq_len=32),
     _far_inputs((2, 8, 8)), alt_grid=(2, 8, 12),
     notes="AnyFlow-FAR (training-rollout path, two chunks of F frames): latent (B, 2F, C, H, W) split by "
           "chunk_partition; chunks beyond full_chunk_limit are patch-embedded coarser (compressed_patch_size); "
           "block-causal flex-attention BlockMask across chunks (eager flex attention: ~1 s)", since="0.39.0")
_add("dreamlite-transformer-2d", "DreamLiteTransformer2DModel", "other", (8, 8),
     _make("DreamLiteTransformer2DModel", num_attention_heads=2, attention_head_dim=8, in_channels=32,
           norm_num_groups=32,
           cross_attention_dim=CROSS, num_layers=1),
     lambda batch=2, grid=None, seed=0: {"hidden_states": _randn(_gen(seed), batch, 32, *_grid(grid, (8, 8))),
                                         "encoder_hidden_states": _randn(_gen(seed + 1), batch, TXT, CROSS)},
     notes="DreamLite's inner transformer (the Transformer2DModel shape; optional no-self-attention blocks)",
     since="0.39.0")


# ==============================================================================================================
# Cosmos 3 Omni: one packed, unbatched sequence [text | vision items...]; "batch" = vision items in the pack


def _cosmos3_inputs(default):
    def inputs(batch=2, grid=None, seed=0):
        h, w = _grid(grid, default)
        g = _gen(seed)
        n = h * w
        s = 2 + batch * n
        vision = torch.arange(2, s)
        return dict(input_ids=torch.tensor([1, 2]), text_indexes=torch.tensor([0, 1]),
                    position_ids=torch.zeros((3, s), dtype=torch.long), und_len=2, sequence_length=s,
                    vision_tokens=[_randn(g, 1, 2, 1, h, w) for _ in range(batch)],
                    vision_token_shapes=[(1, h, w)] * batch, vision_sequence_indexes=vision,
                    vision_mse_loss_indexes=vision, vision_timesteps=torch.full((batch * n,), 0.5),
                    vision_noisy_frame_indexes=[torch.tensor([0])] * batch)

    return inputs


_add("cosmos3-omni", "Cosmos3OmniTransformer", "other", (2, 2),
     _make("Cosmos3OmniTransformer", head_dim=6, hidden_act="relu2", hidden_size=12, intermediate_size=24,
           latent_channel=2,
           latent_patch_size=1, num_attention_heads=2, num_hidden_layers=2, num_key_value_heads=1, patch_latent_dim=2,
           qk_norm_for_text=False, rope_axes_dim=[1, 1, 1], rope_theta=1e8, vocab_size=32),
     _cosmos3_inputs((2, 2)), latent="vision_tokens", per_sample=True,
     expect=lambda kw: (len(kw["vision_tokens"]), *kw["vision_tokens"][0].shape),
     notes="Cosmos 3 Omni (LLM mixture-of-transformers): ONE packed, unbatched sequence of understanding (text) and "
           "generation (vision / sound / action) tokens at caller-given indexes, 3-D M-RoPE position_ids (3, S), "
           "per-token timesteps; und/gen streams have separate weights (MoT); here 'batch' = vision items",
     since="0.39.0")
