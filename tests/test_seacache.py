"""diffusers' SeaCache (``diffusers.hooks.SeaCacheConfig``, diffusers >= 0.42) as the ``seacache`` method of
``tokenmerge quality`` (``tools/peers.py``): its spec and options; that it skips steps where the pipeline passes
``cache_context(name, step_index=, sigma=, num_inference_steps=)`` (a tiny diffusers ``WanPipeline``: its built-in
Wan T2V adapter; the embedded fashion-video-long; the fashion-mosaic testbed, a ``FluxTransformer2DModel``, with this
library's adapter for the packed Flux layout), counted by its own gate and by the ``nn.Linear`` work; vanilla's
output bit for bit once removed; the adapter's grid read from ``img_ids``; and the refusals with their reasons (no
adapter for the model; a pipeline that does not pass the fields, where SeaCache would cache nothing). The long
video and the report run under ``-m slow`` (for the suite's time)."""

from __future__ import annotations

import pytest
import torch

from tokenmerge.tools.methods import parse_spec

pytestmark = pytest.mark.usefixtures("fast_cpu")
MOSAIC_PROMPT = "a sneaker at the top right and a dress at the bottom left"


@pytest.fixture(scope="module")
def hooks():
    hooks = pytest.importorskip("diffusers.hooks", reason="this diffusers has no hooks (diffusers >= 0.32)")
    if not hasattr(hooks, "SeaCacheConfig"):
        pytest.skip("this diffusers has no SeaCache (diffusers.hooks.SeaCacheConfig: diffusers >= 0.42)")
    return hooks


def _case(name: str):
    from tiny_pipelines import CASES

    case = CASES[name]
    reason = case.available()
    if reason is not None:
        pytest.skip(reason)
    return case


@pytest.fixture(scope="module")
def wan(hooks):
    """A tiny diffusers WanPipeline (random weights; guidance on: a cond and an uncond call a step)."""
    case = _case("wan-t2v")
    return case, *case.build()


@pytest.fixture(scope="module")
def mosaic(hooks):
    import diffusers

    if not hasattr(diffusers, "FluxTransformer2DModel"):
        pytest.skip("this diffusers has no FluxTransformer2DModel")
    from tokenmerge.fashion import load_fashion_mosaic

    return load_fashion_mosaic()


@pytest.fixture(scope="module")
def plain(mosaic):
    """fashion-mosaic's unpatched image at 8 steps, and its nn.Linear work."""
    from tokenmerge.quality.run import linear_work

    with linear_work(mosaic) as work:
        image = _gen(mosaic)
    return image, work[0]


def _gen(pipe, steps: int = 8, prompt: str = MOSAIC_PROMPT):
    return pipe(prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="pt").images


def _run(pipe, text: str, generate):
    """(output, SeaCache's count, nn.Linear work) of one generation under ``text``, removed after."""
    from tokenmerge.quality.run import linear_work
    from tokenmerge.tools.peers import computed_share

    with parse_spec(text).applied(pipe), linear_work(pipe) as work:
        out = generate()
        counted = computed_share(pipe)
    return out, counted, work[0]


def test_spec_options_map_to_sea_cache_config_fields(hooks):
    spec = parse_spec("seacache")
    assert spec.is_cache and spec.value == 0.25 and spec.label == "seacache 0.25"
    text = "seacache:0.4,residual_order=0,retention_steps=2,cache_end_steps=3,max_consecutive_cached=0,power_exp=2.5"
    spec = parse_spec(text)
    assert parse_spec(spec.text) == spec and spec.value == 0.4
    from tokenmerge.tools.peers import cache_config

    config = cache_config(spec.name, spec.value, spec.kwargs())
    assert isinstance(config, hooks.SeaCacheConfig) and config.raw_vision_callback is None  # no model yet
    assert (config.threshold, config.residual_order, config.retention_steps, config.cache_end_steps,
            config.max_consecutive_cached, config.power_exp) == (0.4, 0, 2, 3, 0, 2.5)


@pytest.mark.parametrize("text, named", [
    ("seacache:0.2,foo=1", "foo"), ("seacache:-0.1", "threshold"), ("seacache:0.2,residual_order=2", "residual_order"),
    ("seacache:0.2,retention_steps=-1", "retention_steps"), ("seacache:0.2,cache_end_steps=1.5", "cache_end_steps"),
    ("seacache:0.2,max_consecutive_cached=true", "max_consecutive_cached"), ("seacache:0.2,power_exp=0", "power_exp"),
    ("seacache:0.2,raw_vision_callback=x", "raw_vision_callback"), ("seacache:x", "number"),
])
def test_a_bad_option_is_refused_by_name(hooks, text, named):
    with pytest.raises(ValueError, match=named):
        parse_spec(text)


def test_the_bench_refuses_it():
    with pytest.raises(ValueError, match="cache"):
        parse_spec("seacache:0.25", bench=True)


def test_it_skips_steps_on_a_wan_pipeline_that_passes_the_fields(wan):
    """diffusers' own WanPipeline enters cache_context with step_index, sigma and num_inference_steps: SeaCache (its
    built-in Wan T2V adapter) skips steps, each of the two guidance calls gated in its own context."""
    from tokenmerge.quality.run import linear_work

    case, pipe, kwargs = wan

    def generate():
        return case.generate(pipe, kwargs, num_inference_steps=8)

    with linear_work(pipe) as base:
        plain = generate()
    out, counted, work = _run(pipe, "seacache:0.5", generate)
    assert counted["steps"] == 8 and len(counted["cached"]) > 0 and 0 < counted["computed"] < 1
    assert 0 not in counted["cached"] and 7 not in counted["cached"]  # retention_steps=1, cache_end_steps=1
    assert work < base[0] and abs(work / base[0] - counted["computed"]) < 0.05  # the blocks are the linear work
    assert not torch.equal(out, plain) and torch.isfinite(out).all()
    assert torch.equal(_run(pipe, "seacache:0.5", generate)[0], out)  # its state reset between generations
    assert torch.equal(generate(), plain)  # removed: vanilla's output bit for bit
    assert _run(pipe, "seacache:0", generate)[1]["cached"] == []  # threshold 0: every step computed


@pytest.mark.slow
def test_it_skips_steps_on_the_embedded_long_video(hooks):
    """fashion-video-long (a WanTransformer3DModel, 2,048 tokens a call) passes the fields: steps skipped, the
    linear work of the steps it computed (a skipped step runs the embeddings and the output projection only)."""
    from tokenmerge.fashion.video_long import load_fashion_video_long
    from tokenmerge.quality.run import linear_work

    pipe = load_fashion_video_long()
    with linear_work(pipe) as one:  # one step's work
        _gen(pipe, 1, "a sneaker")
    _, counted, work = _run(pipe, "seacache:0.5", lambda: _gen(pipe, 5, "a sneaker"))
    assert counted["steps"] == 5 and len(counted["cached"]) > 0
    ran = round(counted["computed"] * 5)
    assert ran < 5 and ran * one[0] <= work < (ran + 0.2) * one[0]


def test_on_the_mosaic_with_the_flux_adapter(mosaic, plain):
    """fashion-mosaic's FluxTransformer2DModel: SeaCache gets the packed tokens' grid from this library's adapter;
    at its default threshold it skips steps (counted, and in the linear work), and the testbed is vanilla again
    once it is removed."""
    image, counted, work = _run(mosaic, "seacache:0.25", lambda: _gen(mosaic))
    assert counted["steps"] == 8 and len(counted["cached"]) > 0
    assert abs(work / plain[1] - counted["computed"]) < 0.02 and work < plain[1]
    assert not torch.equal(image, plain[0]) and torch.isfinite(image).all()
    assert torch.equal(_gen(mosaic), plain[0])
    from tokenmerge.tools import peers as caches

    assert mosaic not in caches._SEA and mosaic.transformer._cache_config is None  # its hooks and count gone


def test_the_flux_adapter_reads_the_grid_from_img_ids(hooks):
    from tokenmerge.tools.peers import flux_raw_vision

    class Flux(torch.nn.Module):
        def forward(self, hidden_states=None, encoder_hidden_states=None, img_ids=None, txt_ids=None):
            return hidden_states

    grid = torch.randn(2, 5, 3, 4)  # (B, C, H, W)
    rows, cols = torch.meshgrid(torch.arange(3), torch.arange(4), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows + 7, cols + 2], -1).reshape(-1, 3).float()  # offsets: any
    tokens = grid.flatten(2).transpose(1, 2)  # (B, 12, C), row-major
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))  # any token order
    reference = torch.randn(2, 6, 5)  # a reference image's tokens (first id 1): a condition, not the output
    ref_ids = torch.cat([torch.ones(6, 1), torch.zeros(6, 2)], 1)
    hidden = torch.cat([tokens[:, order], reference], 1)
    latents = flux_raw_vision(Flux(), (hidden,), {"img_ids": torch.cat([ids[order], ref_ids])})
    assert len(latents) == 2 and all(x.shape == (5, 1, 3, 4) for x in latents)
    assert torch.equal(torch.stack(latents)[:, :, 0], grid)
    square = flux_raw_vision(Flux(), (), {"hidden_states": tokens[:, :9]})  # no ids: a square grid of sqrt(N)
    assert square[0].shape == (5, 1, 3, 3)
    with pytest.raises(ValueError, match="no square grid"):
        flux_raw_vision(Flux(), (tokens,), {})
    with pytest.raises(ValueError, match="full grid"):
        flux_raw_vision(Flux(), (tokens[:, :11],), {"img_ids": ids[:11]})


def test_a_model_without_an_adapter_is_refused_with_the_reason(hooks):
    from diffusers import WanTransformer3DModel

    class Pipe:
        transformer = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="^tokenmerge: SeaCache needs a vision adapter .* has a Linear"):
        parse_spec("seacache").apply(Pipe())

    class UNetPipe:
        unet = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="^tokenmerge: SeaCache needs .* denoiser is a Linear"):
        parse_spec("seacache").apply(UNetPipe())
    torch.manual_seed(0)
    i2v = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=8,
                                out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2)

    class WanI2V:
        transformer = i2v

    with pytest.raises(ValueError, match="^tokenmerge: SeaCache .* 8 channels for 4 .*image-to-video"):
        parse_spec("seacache").apply(WanI2V())
    assert i2v._cache_config is None  # refused before any hook was set


def test_a_pipeline_without_the_fields_is_refused_not_run_open(hooks):
    """diffusers' Flux pipelines enter cache_context("cond") without step_index, sigma, num_inference_steps:
    SeaCache would run "fail-open" (cache nothing); the call is refused with that reason."""
    from diffusers import FluxPipeline

    case = _case("flux-kontext")
    kontext, kwargs = case.build()
    none = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    pipe = FluxPipeline(scheduler=kontext.scheduler, vae=kontext.vae, transformer=kontext.transformer, **none)
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt_embeds=kwargs["prompt_embeds"], pooled_prompt_embeds=kwargs["pooled_prompt_embeds"],
                height=32, width=32, num_inference_steps=2, guidance_scale=2.5, output_type="pt")

    def generate():
        return pipe(generator=torch.Generator().manual_seed(0), **call).images

    plain = generate()
    with parse_spec("seacache").applied(pipe):
        with pytest.raises(RuntimeError, match="^tokenmerge: SeaCache cannot gate .* without step_index, sigma, "
                                               "num_inference_steps"):
            generate()
        with pytest.raises(RuntimeError, match="outside transformer.cache_context"):  # Kontext's enters none
            case.generate(kontext, kwargs)
        with pytest.raises(RuntimeError, match="outside transformer.cache_context"):  # a bare call
            with torch.no_grad():
                pipe.transformer(**_flux_inputs(pipe.transformer))
    assert pipe.transformer._cache_config is None
    assert torch.equal(generate(), plain)  # and the pipeline runs again as it did


def _flux_inputs(model):
    c = model.config
    return dict(hidden_states=torch.randn(1, 16, c.in_channels), img_ids=_ids(4),
                encoder_hidden_states=torch.randn(1, 3, c.joint_attention_dim), txt_ids=torch.zeros(3, 3),
                pooled_projections=torch.randn(1, c.pooled_projection_dim), timestep=torch.tensor([0.5]),
                **({"guidance": torch.tensor([3.5])} if c.guidance_embeds else {}))


def _ids(side: int) -> torch.Tensor:
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()


@pytest.mark.slow
def test_the_quality_report_carries_the_steps_it_computed(mosaic, tmp_path):
    from tokenmerge.quality.report import markdown
    from tokenmerge.quality.run import QualityJob, run_job

    job = QualityJob("embedded mosaic", [MOSAIC_PROMPT], [0], [parse_spec("seacache:0.25")], 8,
                     cache=tmp_path / "cache")
    report = run_job(mosaic, job, torch.device("cpu"), progress=False, scorer=None)
    vanilla, cached = report["methods"]
    assert vanilla["steps_computed"] is None and 0 < cached["steps_computed"] < 1
    assert abs(cached["linear_work"] - cached["steps_computed"]) < 0.02
    assert f"| {cached['steps_computed']:.0%} |" in markdown(report)
