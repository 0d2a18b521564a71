"""A cache never turns itself off for good (issue #70): on diffusers' pipelines of tiny random parts (Flux.1, Flux
Kontext, Qwen-Image and its img2img through ``from_pipe``, SD3, Stable Diffusion 1.5, SDXL, PixArt, Wan 2.1 and
2.2, LTX-Video, HunyuanVideo, CogVideoX), one patch lives through what users do between generations: another size,
another batch, a generation stopped midway, another step count, the scheduler swapped, ``state_dict`` read, the
patch applied twice. After each, the cache still skips (its own count) and a generation at the first setting gives
exactly what it gave before; removal gives exactly the unpatched output. Where the cache cannot stand in for a
generation (an output matching no input), it computes that generation only, and the next skips again."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from tiny_pipelines import CASES

import tokenmerge
from tokenmerge import StepCacheConfig, UNetCacheConfig

STEPS = 6
STEP = StepCacheConfig(warmup=2, skip=1, min_steps=0)  # computed, computed, skipped, computed, skipped, computed
UNET = UNetCacheConfig(warmup=2, skip=1, min_steps=0, layers=0)


def _dit(kind: str):
    def build():
        from tiny_models import make_dit_pipeline

        pipe, kw = make_dit_pipeline(kind)
        pipe.set_progress_bar_config(disable=True)
        return pipe, kw
    return build


def _sd(kind: str):
    def build():
        import tempfile
        from pathlib import Path

        from tiny_models import make_sd_pipeline, make_unet, make_vae

        if kind == "sd":
            pipe = make_sd_pipeline(Path(tempfile.mkdtemp()))
            kw = dict(prompt="a cat", height=32, width=32, output_type="pt")
        else:
            from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

            pipe = StableDiffusionXLPipeline(vae=make_vae(), text_encoder=None, text_encoder_2=None, tokenizer=None,
                                             tokenizer_2=None, scheduler=EulerDiscreteScheduler(),
                                             unet=make_unet("sdxl", addition_embed_type="text_time",
                                                            addition_time_embed_dim=8,
                                                            projection_class_embeddings_input_dim=32 + 6 * 8))
            g = torch.Generator().manual_seed(2)
            dim = pipe.unet.config.cross_attention_dim
            pooled = pipe.unet.add_embedding.linear_1.in_features - 6 * pipe.unet.config.addition_time_embed_dim
            kw = dict(prompt_embeds=torch.randn(1, 5, dim, generator=g),
                      pooled_prompt_embeds=torch.randn(1, pooled, generator=g),
                      negative_prompt_embeds=torch.randn(1, 5, dim, generator=g),
                      negative_pooled_prompt_embeds=torch.randn(1, pooled, generator=g),
                      height=32, width=32, output_type="pt")
        pipe.set_progress_bar_config(disable=True)
        return pipe, kw
    return build


def _case(name: str):
    def build():
        case = CASES[name]
        reason = case.available()
        if reason is not None:
            pytest.skip(reason)
        pipe, kw = case.build()
        return pipe, kw
    return build


def _wan22():
    pipe, kw = _case("wan-t2v")()
    if "transformer_2" not in getattr(pipe, "_optional_components", ()) and not hasattr(pipe, "transformer_2"):
        pytest.skip("this diffusers' WanPipeline has no second transformer (Wan 2.2)")
    from tiny_denoisers import CATALOGUE

    parts = dict(pipe.components, transformer_2=CATALOGUE["wan"].build())
    pipe = type(pipe)(**parts, boundary_ratio=0.6)
    pipe.set_progress_bar_config(disable=True)
    return pipe, kw


BUILDS = {"flux": _dit("flux"), "flux-kontext": _case("flux-kontext"), "qwen-image": _case("qwen-image"),
          "sd3": _dit("sd3"), "pixart": _dit("pixart"), "sd15": _sd("sd"), "sdxl": _sd("sdxl"),
          "wan-2.1": _case("wan-t2v"), "wan-2.2": _wan22, "ltx": _case("ltx"), "hunyuan-video": _case("hunyuan-video"),
          "cogvideox": _case("cogvideox")}


def _denoiser(pipe):
    return getattr(pipe, "transformer", None) or pipe.unet


def _config(pipe):
    return UNET if getattr(pipe, "unet", None) is not None else STEP


def _images(out) -> torch.Tensor:
    got = out.frames if hasattr(out, "frames") else out.images
    return got if isinstance(got, torch.Tensor) else torch.as_tensor(got)


def _run(pipe, kw, **more) -> torch.Tensor:
    args = {**kw, "num_inference_steps": STEPS, **more}
    with torch.no_grad():
        return _images(pipe(generator=torch.Generator().manual_seed(0), **args))


def _skipped(pipe) -> int:
    """The calls the caches on ``pipe`` skipped in its last generation, by their own count (Wan 2.2: both experts)."""
    from tokenmerge.engine.install import patches_of

    return sum(sum(p.technique.tally.cached.values()) for p in patches_of(pipe))


def _bigger(kw, pipe=None) -> dict:
    """Another size: 16 px more a side (LTX's: 32), 2 x 2 latent tokens more a side or more."""
    more = 32 if type(pipe).__name__.startswith("LTX") else 16
    return {k: v + more for k, v in kw.items() if k in ("height", "width")}


SLOW = ("wan-2.2", "cogvideox", "hunyuan-video")  # their tiny VAEs decode 9 frames: tens of seconds each


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in BUILDS])
def test_a_patch_lives_through_what_users_do_between_generations(name):
    try:
        pipe, kw = BUILDS[name]()
    except (ImportError, AttributeError, TypeError) as err:  # a pipeline this diffusers lacks (0.27: no Flux...)
        pytest.skip(f"{name}: {err}")
    kw = {k: v for k, v in kw.items() if k != "num_inference_steps"}
    vanilla = _run(pipe, kw)
    tokenmerge.apply_config(pipe, _config(pipe))
    tokenmerge.apply_config(pipe, _config(pipe))  # applied twice: the second replaces the first
    first = _run(pipe, kw)
    assert _skipped(pipe) > 0 and not torch.equal(first, vanilla)
    if _bigger(kw, pipe):  # another size, then the first again
        big = _run(pipe, kw, **_bigger(kw, pipe))
        assert _skipped(pipe) > 0, name
        assert torch.equal(_run(pipe, kw), first) and _skipped(pipe) > 0
        tokenmerge.remove_patch(pipe)
        tokenmerge.apply_config(pipe, _config(pipe))
        assert torch.equal(_run(pipe, kw, **_bigger(kw, pipe)), big)  # what a fresh patch gives at that size
    _run(pipe, _batch_of_two(kw))  # another batch: two prompts
    assert _skipped(pipe) > 0
    if "callback_on_step_end" in _params(pipe):  # a generation stopped after its third step
        def stop(p, i, t, tensors):
            if i == 1:
                p._interrupt = True
            return tensors
        with warnings.catch_warnings(record=True) as said:  # (said at the next generation's start, if at all)
            warnings.simplefilter("always")
            _run(pipe, kw, callback_on_step_end=stop)
            pipe._interrupt = False
            _run(pipe, kw, num_inference_steps=STEPS + 3)  # another step count
        assert not [w for w in said if "computed every step" in str(w.message)], "a stopped generation blamed"
    else:
        _run(pipe, kw, num_inference_steps=STEPS + 3)  # another step count
    assert _skipped(pipe) > 0
    before = {k: v.clone() for k, v in _denoiser(pipe).state_dict().items()}
    assert torch.equal(_run(pipe, kw), first) and _skipped(pipe) > 0
    assert before.keys() == _denoiser(pipe).state_dict().keys()
    original = pipe.scheduler
    pipe.scheduler = copy.deepcopy(original)  # the scheduler swapped for an equal one, then another one
    assert torch.equal(_run(pipe, kw), first) and _skipped(pipe) > 0
    pipe.scheduler = _another(original)
    _run(pipe, kw)
    assert _skipped(pipe) > 0
    pipe.scheduler = original
    tokenmerge.remove_patch(pipe)
    assert torch.equal(_run(pipe, kw), vanilla)


def _batch_of_two(kw) -> dict:
    """The call's prompt (or its embeddings and masks) twice: a batch of two."""
    out = dict(kw)
    for k, v in kw.items():
        if k == "prompt" and isinstance(v, str):
            out[k] = [v, v + " again"]
        elif isinstance(v, torch.Tensor) and ("embeds" in k or "mask" in k) and v.dim() >= 1:
            out[k] = torch.cat([v, v.flip(0) if v.shape[0] > 1 else v * 0.9 if v.is_floating_point() else v])
    return out


def _another(scheduler):
    """Another scheduler of the pipeline's kind: its grid moved (a flow shift, or another timestep spacing)."""
    config = dict(scheduler.config)
    if "shift" in config:
        return type(scheduler).from_config(config, shift=float(config["shift"]) + 1.0)
    if "flow_shift" in config and config.get("flow_shift"):
        return type(scheduler).from_config(config, flow_shift=float(config["flow_shift"]) + 1.0)
    return type(scheduler).from_config(config, timestep_spacing="trailing")


def _params(pipe) -> set:
    import inspect

    return set(inspect.signature(pipe.__call__).parameters)


def test_qwen_image_img2img_through_from_pipe_shares_the_patched_transformer():
    """Qwen-Image's text-to-image pipeline patched, then its img2img pipeline made with ``from_pipe`` on the same
    transformer (a generation at the input image's size): both skip, and text-to-image gives what it gave before."""
    pipe, kw = _case("qwen-image")()
    import diffusers

    if not hasattr(diffusers, "QwenImageImg2ImgPipeline"):
        pytest.skip("QwenImageImg2ImgPipeline is not in this diffusers")
    kw = {k: v for k, v in kw.items() if k != "num_inference_steps"}
    tokenmerge.apply_config(pipe, STEP)
    first = _run(pipe, kw)
    img2img = diffusers.QwenImageImg2ImgPipeline.from_pipe(pipe)
    img2img.set_progress_bar_config(disable=True)
    image = torch.rand(1, 3, 96, 96, generator=torch.Generator().manual_seed(3))
    args = {k: v for k, v in kw.items() if k not in ("height", "width")}
    _run(img2img, args, image=image, strength=0.9, num_inference_steps=STEPS + 2)
    assert _skipped(pipe) > 0
    assert torch.equal(_run(pipe, kw), first) and _skipped(pipe) > 0
    tokenmerge.remove_patch(pipe)


def test_text_and_image_streams_of_one_shape_then_another_size_skip_every_time():
    """Qwen-Image with as many text tokens as image tokens (16 and 4 x 4): its blocks' two outputs match both inputs
    by shape; each is matched to the input no other output took, so the layout holds at another size too, and the
    cache skips at both sizes, in turn, for good."""
    pipe, kw = _case("qwen-image")()
    g = torch.Generator().manual_seed(5)
    dim = kw["prompt_embeds"].shape[-1]
    kw = {k: v for k, v in kw.items() if k != "num_inference_steps"}
    ones = torch.ones(1, 16, dtype=torch.long)
    kw.update(prompt_embeds=torch.randn(1, 16, dim, generator=g), prompt_embeds_mask=ones,
              negative_prompt_embeds=torch.randn(1, 16, dim, generator=g),
              negative_prompt_embeds_mask=ones, height=32, width=32)
    tokenmerge.apply_config(pipe, STEP)
    with _no_warning():
        for size in (32, 64, 32, 64):
            _run(pipe, kw, height=size, width=size)
            assert _skipped(pipe) > 0, size
    tokenmerge.remove_patch(pipe)


class _no_warning:
    """Fails on a RuntimeWarning of tokenmerge's inside the block."""

    def __enter__(self):
        import warnings

        self.record = warnings.catch_warnings(record=True)
        self.seen = self.record.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self.record.__exit__(*exc)
        said = [str(w.message) for w in self.seen if "tokenmerge" in str(w.message)]
        assert not said, said


def test_a_generation_the_cache_cannot_stand_in_for_is_that_generation_only():
    """A refusal (what the cache cannot stand in for) computes the rest of its generation, with one warning; the next
    generation skips again and gives what it gave before (a planted permanent switch-off fails here)."""
    pipe, kw = _case("wan-t2v")()
    kw = {k: v for k, v in kw.items() if k != "num_inference_steps"}
    tokenmerge.apply_config(pipe, STEP)
    first = _run(pipe, kw)
    technique = pipe.transformer._tokenmerge_patch.technique

    def refuse_once(p, i, t, tensors):
        if i == 2:
            technique.refuse("a planted refusal")
        return tensors

    with pytest.warns(RuntimeWarning, match="cannot skip the steps of this generation: a planted refusal"):
        _run(pipe, kw, callback_on_step_end=refuse_once)
    assert technique.tally.fallbacks and _skipped(pipe) <= 2  # (step 2 of each branch skipped before it)
    assert torch.equal(_run(pipe, kw), first) and _skipped(pipe) > 0
    tokenmerge.remove_patch(pipe)


def test_a_generation_that_skips_nothing_says_why_once():
    """A cache asked to skip, in a generation that skips nothing: one warning per cause, in words a user can act on
    (fewer steps than min_steps; a schedule that computes every step of this grid)."""
    pipe, kw = _case("wan-t2v")()
    kw = {k: v for k, v in kw.items() if k != "num_inference_steps"}
    tokenmerge.apply_config(pipe, StepCacheConfig(min_steps=9))
    with pytest.warns(RuntimeWarning, match="a generation of 6 steps, fewer than min_steps=9, skips no step"):
        _run(pipe, kw, num_inference_steps=6)
    tokenmerge.apply_config(pipe, StepCacheConfig(gap=0.0, gap_growth=0.0, min_steps=0))  # every step computed
    with pytest.warns(RuntimeWarning, match=f"its schedule computed every step of a generation of {STEPS} steps"):
        _run(pipe, kw)
    tokenmerge.remove_patch(pipe)


def test_two_pipelines_on_two_threads_keep_their_own_steps():
    """Two patched pipelines (Wan, Flux), generating interleaved and on two threads at once: each skips as it does
    alone and gives what it gives alone."""
    wan, wan_kw = _case("wan-t2v")()
    try:
        flux, flux_kw = _dit("flux")()
    except (ImportError, AttributeError, TypeError) as err:
        pytest.skip(str(err))
    pairs = [(wan, {k: v for k, v in wan_kw.items() if k != "num_inference_steps"}),
             (flux, {k: v for k, v in flux_kw.items() if k != "num_inference_steps"})]
    for pipe, _ in pairs:
        tokenmerge.apply_config(pipe, STEP)
    alone = [_run(pipe, kw) for pipe, kw in pairs]
    got = [None, None]

    def work(k):
        pipe, kw = pairs[k]
        got[k] = _run(pipe, kw)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(got, alone))
    for pipe, _ in pairs:
        tokenmerge.remove_patch(pipe)
