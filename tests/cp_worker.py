"""One rank of the two-process context-parallel check (tests/test_context_parallel.py starts two of them).

``python tests/cp_worker.py OUT RANK WORLD INIT_FILE FAMILY...``: joins a gloo process group (``file://INIT_FILE``),
then for each tiny catalogue family runs, with diffusers' ``ContextParallelConfig(ulysses_degree=WORLD)``:

- single process (no parallelism): vanilla, and patched with each method (ToMe, whole-block ToMe, ToDo);
- enable-then-patch: vanilla CP, then for each method: patched CP, then removed;
- patch-then-enable: for each method, a fresh model patched, then parallelised: patched CP, then removed;
- token reuse (``REUSE``, on ``REUSE_CASES``) and the step cache (``STEP_CACHE``: computed, skipped, computed): the
  same three ways, each over ``STEPS`` denoiser calls of a generation, every call recorded.

Per run it records the output and, through a ``TorchFunctionMode``, the query and key counts of every
``scaled_dot_product_attention`` call, and through pre-hooks on the attention modules whether the rotary rows each
one gets match its tokens. Each rank saves ``OUT/<family>.rank<RANK>.pt``. The device count is set to 1 because
diffusers places rank r on device ``r % device_count`` (there is none on a CPU).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).parent))

METHODS = {
    "tome": ("apply_patch", {"ratio": 0.5}),
    "block": ("apply_patch", {"ratio": 0.5, "scope": "block"}),
    "todo": ("apply_todo", {"downsample": 2}),
    # every source merged, each within its own window: per-slice merging is then the single-process merging
    # (the slices cut no window), so the outputs agree to float rounding
    "tome_all": ("apply_patch", {"ratio": 0.75, "match_radius": 0}),
    "block_all": ("apply_patch", {"ratio": 0.75, "match_radius": 0, "scope": "block"}),
}
REUSE = {
    "reuse": {"fraction": 0.5, "warmup": 1},
    "reuse_cached": {"fraction": 0.5, "warmup": 1, "keys": "cached"},
    "reuse_text": {"fraction": 0.5, "warmup": 1, "keys": "cached", "text": True},  # Flux.1 only
    "reuse_extrapolate": {"fraction": 0.5, "warmup": 1, "keys": "cached", "extrapolate": 1.0},
}
STEP_CACHE = {"stepcache": {"skip": 1, "warmup": 1}}  # the step cache: computed, skipped, computed
REUSE_CASES = ("wan", "flux", "ltx", "wan-3-frames")
STEPS = 3
# case -> (catalogue entry, token grid): grids that split into whole frames (the video families) or whole rows
# (the image families) over two ranks, and one whose halves run over a frame's end (1.5 frames a rank, merged as
# 12 rows of 8: the tall-grid case, as Wan's 21 latent frames of 81 pixel frames on 2 GPUs)
CASES = {"wan": ("wan", (4, 4, 4)), "flux": ("flux", (8, 8)), "qwen-image": ("qwen-image", (8, 8)),
         "flux2": ("flux2", (8, 8)), "ltx": ("ltx", (4, 4, 4)), "chronoedit": ("chronoedit", (2, 4, 4)),
         "wan-3-frames": ("wan", (3, 8, 8))}
TEXT = 4  # text tokens: diffusers splits Flux's, Qwen-Image's and LTX's text too, so an even count
SPLIT_TEXT = ("flux", "flux-kontext", "flux2", "qwen-image", "ltx")


_SDPA = F.scaled_dot_product_attention  # the function itself (token reuse routes the name while its modes are open)


class Spy(TorchFunctionMode):
    """Records ``(queries, keys)`` of each SDPA call (after any pooling by an inner mode)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            q = args[0] if args else kwargs["query"]
            k = args[1] if len(args) > 1 else kwargs["key"]
            self.calls.append((q.shape[-2], k.shape[-2]))
        return func(*args, **kwargs)


def _rows(value):
    """Token rows of a rotary value: the first tensor's token axis (tuples of (cos, sin) or (image, text))."""
    while isinstance(value, (tuple, list)):
        value = value[0]
    return value


def rotary_check(name):
    """``check(args, kwargs) -> bool``: the rotary rows an attention module gets match its tokens."""
    def hidden(args, kwargs):
        return kwargs.get("hidden_states", args[0] if args else None)

    if name in ("wan", "chronoedit"):  # attn1: rotary_emb (cos, sin) each (1, N, 1, d)
        def check(args, kwargs):
            rot = kwargs.get("rotary_emb")
            return rot is None or _rows(rot).shape[1] == hidden(args, kwargs).shape[1]
    elif name == "qwen-image":  # (image table (N, d), text table (L, d))
        def check(args, kwargs):
            rot = kwargs.get("image_rotary_emb")
            text = kwargs.get("encoder_hidden_states")
            return rot is None or (rot[0].shape[0] == hidden(args, kwargs).shape[1]
                                   and (text is None or rot[1].shape[0] == text.shape[1]))
    else:  # Flux.1 / Flux.2: (cos, sin) over [text, image] (single blocks get them joined already)
        def check(args, kwargs):
            rot = kwargs.get("image_rotary_emb")
            text = kwargs.get("encoder_hidden_states")
            tokens = hidden(args, kwargs).shape[1] + (text.shape[1] if text is not None else 0)
            return rot is None or _rows(rot).shape[-2] == tokens
    return check


def attention_modules(model):
    return [m for n, m in model.named_modules() if n.endswith((".attn1", ".attn"))]


def even_text(name: str, kw: dict) -> dict:
    """The catalogue's inputs, with ``TEXT`` text tokens where diffusers' plan splits the text too (its 5 do not
    split over two ranks), and LTX-Video without its text mask: diffusers 0.42.1's Ulysses attention fails on the
    native backend when a mask carries a head axis (LTX's does), vanilla too."""
    out = dict(kw)
    if name == "ltx":
        out["encoder_attention_mask"] = None
    if name not in SPLIT_TEXT:
        return out
    for key in ("encoder_hidden_states", "encoder_hidden_states_mask"):
        if key in out:
            out[key] = out[key][:, :TEXT]
    if "txt_ids" in out:
        ids = out["txt_ids"]
        out["txt_ids"] = ids[:TEXT] if ids.dim() == 2 else ids[:, :TEXT]
    return out


def run(model, name, inputs, entry):
    from tiny_denoisers import output_tensor

    checks = []
    check = rotary_check(name)
    handles = [m.register_forward_pre_hook(lambda m, a, k: checks.append(check(a, k)), with_kwargs=True)
               for m in attention_modules(model)]
    spy = Spy()
    try:
        with torch.no_grad(), spy, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = output_tensor(model(**inputs, return_dict=False), entry)
    finally:
        for h in handles:
            h.remove()
    tm_warnings = [str(w.message) for w in caught if "tokenmerge" in str(w.message)]
    return {"out": out, "sdpa": spy.calls, "rotary_ok": all(checks) and bool(checks), "warnings": tm_warnings}


def generation(model, name, inputs, entry) -> list:
    """``STEPS`` calls of one generation (the timestep moving on): each call's record."""
    from tiny_models import later_step

    calls = [inputs]
    for _ in range(STEPS - 1):
        calls.append(later_step(model, calls[-1]))
    return [run(model, name, c, entry) for c in calls]


def reuse(tokenmerge, parallel, name, family, entry, inputs) -> dict:
    """Token reuse and the step cache on one family: single process, enable then patch, patch then enable (each a
    generation)."""
    rec = {}
    methods = [m for m in REUSE if m != "reuse_text" or family == "flux"] + list(STEP_CACHE)

    def apply(model, method):
        if method in STEP_CACHE:
            tokenmerge.apply_step_cache(model, **STEP_CACHE[method])
        else:
            tokenmerge.apply_reuse(model, **REUSE[method])

    single = entry.build()
    rec["vanilla_steps_sp"] = generation(single, family, inputs, entry)
    for method in methods:
        apply(single, method)
        rec[f"{method}_sp"] = generation(single, family, inputs, entry)
        tokenmerge.remove_patch(single)
    model = parallel(entry.build())
    rec["vanilla_steps_cp"] = generation(model, family, inputs, entry)
    for method in methods:
        apply(model, method)
        rec[f"{method}_cp_enable_first"] = generation(model, family, inputs, entry)
        tokenmerge.remove_patch(model)
        rec[f"{method}_removed_enable_first"] = generation(model, family, inputs, entry)
    for method in methods:
        model = entry.build()
        apply(model, method)
        parallel(model)
        rec[f"{method}_cp_patch_first"] = generation(model, family, inputs, entry)
        tokenmerge.remove_patch(model)
        rec[f"{method}_removed_patch_first"] = generation(model, family, inputs, entry)
    return rec


def ltx_condition() -> dict:
    """An LTX-Video call as LTXConditionPipeline makes it: ``video_coords`` (B, 3, S) instead of the grid integers,
    a conditioning frame's 16 tokens before the video's 48 (as tests/test_never_break.py builds it)."""
    from tiny_denoisers import CATALOGUE

    kw = even_text("ltx", CATALOGUE["ltx"].inputs(batch=2, grid=(3, 4, 4)))
    f, h, w = torch.meshgrid(torch.arange(3) * 8.0, torch.arange(4) * 32.0, torch.arange(4) * 32.0, indexing="ij")
    video = torch.stack([(f - 7).clamp(min=0) / 25, h, w]).flatten(1)
    cond = torch.stack([f[:1] + 16, h[:1], w[:1]]).flatten(1) / torch.tensor([25.0, 1, 1])[:, None]
    coords = torch.cat([cond, video], 1)[None].expand(2, -1, -1).contiguous()
    x = torch.cat([torch.randn(2, 16, kw["hidden_states"].shape[-1], generator=torch.Generator().manual_seed(1)),
                   kw["hidden_states"]], 1)
    call = {k: v for k, v in kw.items() if k not in ("num_frames", "height", "width")}
    call.update(hidden_states=x, video_coords=coords)
    return call


def edges(tokenmerge, parallel, ContextParallelConfig, out_dir, rank, world):
    """What cannot be merged per slice: warned and unmerged, or refused at apply; and a partial block choice."""
    from tiny_denoisers import CATALOGUE

    rec = {}
    wan, kontext = CATALOGUE["wan"], CATALOGUE["flux-kontext"]
    cases = {
        # a 1 x 3 x 4 grid's half (6 tokens) holds no whole row
        "wan_half_rows": (wan, even_text("wan", wan.inputs(batch=2, grid=(1, 3, 4))), {}),
        # Kontext's reference tokens are split with the image's
        "flux_kontext": (kontext, even_text("flux-kontext", kontext.inputs(batch=2, grid=(4, 4))), {}),
        # LTXConditionPipeline's call: 16 conditioning tokens before the video's, split with them
        "ltx_condition": (CATALOGUE["ltx"], ltx_condition(), {}),
        # only block 1: the split (at blocks.0) comes before every patched block
        "wan_block1": (wan, even_text("wan", wan.inputs(batch=2, grid=(4, 4, 4))), {"blocks": [1]}),
    }
    for case, (entry, inputs, kw) in cases.items():
        model = parallel(entry.build())
        vanilla = run(model, entry.name, inputs, entry)
        tokenmerge.apply_patch(model, ratio=0.5, **kw)
        first = run(model, entry.name, inputs, entry)
        second = run(model, entry.name, inputs, entry)  # one warning per patch, not one per call
        tokenmerge.remove_patch(model)
        removed = run(model, entry.name, inputs, entry)
        model = entry.build()  # patch, then enable
        tokenmerge.apply_patch(model, ratio=0.5, **kw)
        later = run(parallel(model), entry.name, inputs, entry)
        rec[case] = {"vanilla": vanilla, "first": first, "second": second, "removed": removed, "patch_first": later}

    def refusal(fn):
        try:
            fn()
        except ValueError as err:
            return str(err)
        return None

    ring = wan.build()
    ring.enable_parallelism(config=ContextParallelConfig(ring_degree=world))
    rec["ring_todo"] = refusal(lambda: tokenmerge.apply_todo(ring, downsample=2))
    rec["ring_tome"] = refusal(lambda: tokenmerge.apply_patch(ring, ratio=0.5))
    tokenmerge.remove_patch(ring)
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    inside = wan.build()  # a plan that splits after the first block: blocks.0 would see the whole sequence
    plan = {"blocks.1": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}
    inside.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world), cp_plan=plan)
    rec["split_inside"] = refusal(lambda: tokenmerge.apply_patch(inside, ratio=0.5))
    rec["split_inside_block1"] = refusal(lambda: tokenmerge.apply_patch(inside, ratio=0.5, blocks=[1]))
    ring = wan.build()
    ring.enable_parallelism(config=ContextParallelConfig(ring_degree=world))
    rec["ring_reuse"] = refusal(lambda: tokenmerge.apply_reuse(ring, 0.5))
    torch.save(rec, out_dir / f"+edges.rank{rank}.pt")


def main():
    out_dir, rank, world, init_file, *names = sys.argv[1:]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    torch.accelerator.device_count = lambda: 1  # diffusers: device = rank % device_count
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from diffusers import ContextParallelConfig
    from tiny_denoisers import CATALOGUE

    import tokenmerge

    def parallel(model):
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        return model

    def patch(model, method):
        fn, kw = METHODS[method]
        getattr(tokenmerge, fn)(model, **kw)

    for name in names:
        if name == "+edges":
            edges(tokenmerge, parallel, ContextParallelConfig, Path(out_dir), rank, world)
            continue
        family, grid = CASES[name]
        entry = CATALOGUE[family]
        inputs = even_text(family, entry.inputs(batch=2, grid=grid))
        rec = {"grid": grid}
        single = entry.build()
        rec["vanilla_sp"] = run(single, family, inputs, entry)
        for method in METHODS:
            patch(single, method)
            rec[f"{method}_sp"] = run(single, family, inputs, entry)
            tokenmerge.remove_patch(single)
        for method in ("tome", "block"):  # a yardstick: how much another random draw changes the output
            fn, kw = METHODS[method]
            getattr(tokenmerge, fn)(single, **kw, seed=1)
            rec[f"{method}_sp_seed1"] = run(single, family, inputs, entry)
            tokenmerge.remove_patch(single)
        model = parallel(entry.build())  # enable, then patch
        rec["vanilla_cp"] = run(model, family, inputs, entry)
        for method in METHODS:
            patch(model, method)
            rec[f"{method}_cp_enable_first"] = run(model, family, inputs, entry)
            tokenmerge.remove_patch(model)
            rec[f"{method}_removed_enable_first"] = run(model, family, inputs, entry)
        for method in METHODS:  # patch, then enable
            model = entry.build()
            patch(model, method)
            parallel(model)
            rec[f"{method}_cp_patch_first"] = run(model, family, inputs, entry)
            tokenmerge.remove_patch(model)
            rec[f"{method}_removed_patch_first"] = run(model, family, inputs, entry)
        if name in REUSE_CASES:
            rec.update(reuse(tokenmerge, parallel, name, family, entry, inputs))
        torch.save(rec, Path(out_dir) / f"{name}.rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
