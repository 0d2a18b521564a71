"""cache-dit's DBCache (the cache-dit package, ``tools/cachedit.py``) as the ``cachedit`` method of ``tokenmerge
quality``: its spec and options, and on the trained fashion-mosaic testbed (a FluxTransformer2DModel, two block
lists) and the fashion-video one (a WanTransformer3DModel): steps skipped at a loose threshold and none at 0, the
same image twice in a row (its state reset between generations), vanilla's bit for bit once removed, its
calibrators (TaylorSeer, FoCa, DMD), its step masks (a 1/0 mask, its predefined policies slow/medium/fast/ultra and
a budget of N computed steps, built for each generation's step count), and the steps it counted carried into the
quality report. Skipped without cache-dit (the ``bench`` extra). The calibrators, the named masks, the video and the
report run under ``-m slow`` (for the suite's time; the threshold, the reset, the removal and a mask run always)."""

from __future__ import annotations

import pytest
import torch

from tokenmerge.tools.methods import parse_spec

pytestmark = pytest.mark.usefixtures("fast_cpu")
MOSAIC_PROMPT = "a sneaker at the top right and a dress at the bottom left"


@pytest.fixture(scope="module")
def cache_dit():
    return pytest.importorskip("cache_dit")


@pytest.fixture(scope="module")
def mosaic(cache_dit):
    import diffusers

    if not hasattr(diffusers, "FluxTransformer2DModel"):
        pytest.skip("this diffusers has no FluxTransformer2DModel")
    from tokenmerge.fashion import load_fashion_mosaic

    return load_fashion_mosaic()


def _gen(pipe, steps: int = 10, prompt: str = MOSAIC_PROMPT):
    return pipe(prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="pt").images


@pytest.fixture(scope="module")
def vanilla(mosaic):
    """fashion-mosaic's unpatched image at 10 steps."""
    return _gen(mosaic)


def _run(pipe, text: str, steps: int = 10, prompt: str = MOSAIC_PROMPT):
    """(image, the steps cache-dit counted) of one generation under ``text``, removed after."""
    from tokenmerge.tools.peers import computed_share

    with parse_spec(text).applied(pipe):
        image = _gen(pipe, steps, prompt)
        counted = computed_share(pipe)
    return image, counted


def test_spec_options_map_to_dbcache_fields(cache_dit):
    spec = parse_spec("cachedit")
    assert spec.is_cache and spec.value == 0.08 and spec.label == "cachedit 0.08"
    text = "cachedit:0.2,Fn=2,Bn=1,warmup=3,cached=6,continuous=2,mask=1110101,policy=static,taylorseer=true,order=2"
    spec = parse_spec(text)
    assert parse_spec(spec.text) == spec
    from tokenmerge.tools.cachedit import configs

    config, calibrator, fused = configs(spec.value, spec.kwargs())
    assert isinstance(config, cache_dit.DBCacheConfig) and not fused
    assert (config.residual_diff_threshold, config.Fn_compute_blocks, config.Bn_compute_blocks) == (0.2, 2, 1)
    assert (config.max_warmup_steps, config.max_cached_steps, config.max_continuous_cached_steps) == (3, 6, 2)
    assert config.steps_computation_mask == [1, 1, 1, 0, 1, 0, 1] and config.steps_computation_policy == "static"
    assert isinstance(calibrator, cache_dit.TaylorSeerCalibratorConfig) and calibrator.taylorseer_order == 2
    config, calibrator, fused = configs(0, {"mask": (1, 0, 1), "fused": True})
    assert config.steps_computation_mask == [1, 0, 1] and calibrator is None and fused
    assert (config.Fn_compute_blocks, config.max_warmup_steps) == (1, 8)  # Fn 1 here; cache-dit's warmup default


def test_calibrator_specs_map_to_cache_dit_configs(cache_dit):
    from tokenmerge.tools.cachedit import configs

    def calibrator(text):
        spec = parse_spec(text)
        assert parse_spec(spec.text) == spec
        return configs(spec.value, spec.kwargs())[1]

    seer = calibrator("cachedit:0.2,calibrator=taylorseer,order=2")
    assert type(seer) is cache_dit.TaylorSeerCalibratorConfig and seer.taylorseer_order == 2
    assert seer == calibrator("cachedit:0.2,taylorseer=true,order=2")  # the older spelling, the same config
    assert calibrator("cachedit:0.2,calibrator=taylorseer,taylorseer=true").taylorseer_order == 1
    foca = calibrator("cachedit:0.2,calibrator=foca")
    assert type(foca) is cache_dit.FoCaCalibratorConfig and foca.calibrator_type == "foca"
    dmd = calibrator("cachedit:0.2,calibrator=dmd")
    assert type(dmd) is cache_dit.DMDCalibratorConfig and (dmd.dmd_history, dmd.dmd_svd_precision) == (6, "medium")
    dmd = calibrator("cachedit:0.2,calibrator=dmd,history=5,rank=3,ridge=0.001,svd=low,order=2")
    assert (dmd.dmd_history, dmd.dmd_rank, dmd.dmd_ridge, dmd.dmd_svd_precision) == (5, 3, 0.001, "low")
    assert dmd.to_kwargs()["n_derivatives"] == 2  # its Taylor fallback's order, through calibrator_kwargs
    assert calibrator("cachedit:0.2") is None and calibrator("cachedit:0.2,taylorseer=false") is None


def test_mask_policies_and_budgets_are_cache_dits_masks(cache_dit):
    from tokenmerge.tools.cachedit import MASK_POLICIES, computed_mask, configs, mask_plan

    spec = parse_spec("cachedit:0.2,mask=fast")
    assert parse_spec(spec.text) == spec
    config, _, _ = configs(spec.value, spec.kwargs())
    assert config.steps_computation_mask is None and config.steps_computation_policy == "dynamic"  # per generation
    plan = mask_plan(spec.kwargs())
    assert plan(28) == cache_dit.steps_mask(total_steps=28, mask_policy="fast")
    assert [sum(mask_plan({"mask": m})(28)) for m in MASK_POLICIES] == [18, 15, 11, 8]  # cache-dit's 28-step budgets
    assert mask_plan({"mask": "fast"})(2) == [1, 1]  # 1 or 2 steps: nothing can be cached
    with pytest.raises(ValueError, match="tokenmerge: cachedit's mask=fast .* none for 5 steps"):
        mask_plan({"mask": "fast"})(5)
    config, _, _ = configs(0.2, {"steps": 11})
    assert config.steps_computation_policy == "static" and config.steps_computation_mask is None  # exactly N
    assert configs(0.2, {"steps": 11, "policy": "dynamic"})[0].steps_computation_policy == "dynamic"
    for total, computed in ((28, 11), (28, 2), (50, 17), (10, 4), (9, 8), (5, 5), (4, 9)):
        mask = mask_plan({"steps": computed})(total)
        assert len(mask) == total and sum(mask) == min(computed, total) and mask[0] == mask[-1] == 1
    assert computed_mask(28, 11) == [1] * 6 + [0] * 3 + [1] + [0] * 3 + [1] + [0] * 3 + [1] + [0] * 4 + [1] + \
        [0] * 4 + [1]  # a head of ceil(N/2), then single steps, the cached ones spread evenly


@pytest.mark.parametrize("text, named", [
    ("cachedit:0.1,calibrator=foo", "calibrator"), ("cachedit:0.1,calibrator=foca,order=2", "order"),
    ("cachedit:0.1,calibrator=dmd,taylorseer=true", "contradict"), ("cachedit:0.1,history=6", "history"),
    ("cachedit:0.1,calibrator=dmd,history=3", "history"), ("cachedit:0.1,calibrator=dmd,svd=fast", "svd"),
    ("cachedit:0.1,calibrator=dmd,rank=-1", "rank"), ("cachedit:0.1,calibrator=dmd,ridge=-1", "ridge"),
    ("cachedit:0.1,mask=rapid", "mask"), ("cachedit:0.1,steps=1", "steps"), ("cachedit:0.1,steps=2.5", "steps"),
    ("cachedit:0.1,steps=4,mask=fast", "steps"), ("cachedit:0.1,steps=4,policy=fast", "policy"),
    ("cachedit:0.1,foo=1", "foo"), ("cachedit:-0.1", "threshold"), ("cachedit:0.1,Fn=0", "Fn"),
    ("cachedit:0.1,Bn=-1", "Bn"), ("cachedit:0.1,warmup=1.5", "warmup"), ("cachedit:0.1,cached=-2", "cached"),
    ("cachedit:0.1,continuous=x", "continuous"), ("cachedit:0.1,mask=1021", "mask"),
    ("cachedit:0.1,mask=(0,1)", "mask"),
    ("cachedit:0.1,policy=static", "policy"), ("cachedit:0.1,mask=11,policy=fast", "policy"),
    ("cachedit:0.1,order=2", "order"), ("cachedit:0.1,taylorseer=yes", "taylorseer"),
    ("cachedit:0.1,taylorseer=true,order=0", "order"), ("cachedit:0.1,fused=1", "fused"),
])
def test_a_bad_option_is_refused_by_name(cache_dit, text, named):
    with pytest.raises(ValueError, match=named):
        parse_spec(text)


def test_the_bench_refuses_it():
    with pytest.raises(ValueError, match="cache"):
        parse_spec("cachedit:0.1", bench=True)


def test_it_skips_steps_at_a_loose_threshold_and_none_at_zero(mosaic, vanilla):
    image, counted = _run(mosaic, "cachedit:0.3,warmup=2")
    assert counted["steps"] == 10 and set(counted["cached"]) == {"transformer_blocks", "single_transformer_blocks"}
    assert all(len(steps) > 0 and min(steps) >= 2 for steps in counted["cached"].values())  # none in the warmup
    assert 0 < counted["computed"] < 1 and not torch.equal(image, vanilla)
    image, counted = _run(mosaic, "cachedit:0,warmup=2")
    assert counted == {"steps": 10, "cached": {"transformer_blocks": [], "single_transformer_blocks": []},
                       "computed": 1.0}
    assert torch.equal(image, vanilla)  # nothing cached: the blocks ran as unpatched


def test_it_counts_each_generation_afresh_and_comes_off_bit_for_bit(mosaic, vanilla):
    transformer, call = mosaic.transformer, type(mosaic).__call__
    order = list(transformer._modules)
    spec = parse_spec("cachedit:0.3,warmup=2")
    from tokenmerge.tools.peers import computed_share

    with spec.applied(mosaic):
        assert computed_share(mosaic) is None  # before any generation
        first, counted = _gen(mosaic, steps=8), computed_share(mosaic)
        short = _gen(mosaic, steps=3)  # a shorter one between: its own count
        assert computed_share(mosaic)["steps"] == 3
        again = _gen(mosaic, steps=8)
        assert torch.equal(first, again) and computed_share(mosaic) == counted
        assert short.shape == first.shape
    assert computed_share(mosaic) is None and torch.equal(_gen(mosaic), vanilla)
    # what cache-dit wraps or sets is gone: the class's __call__, the transformer's forward, its state
    assert type(mosaic).__call__ is call and "forward" not in vars(transformer)
    assert not any(hasattr(x, "_context_manager") for x in (mosaic, transformer))
    assert not hasattr(type(mosaic), "_is_cached") and not hasattr(type(mosaic), "_original_call")
    assert list(transformer._modules) == order  # (its block lists set again, then put back where they were)


@pytest.mark.slow
def test_at_28_steps_its_default_warmup_still_leaves_steps_to_cache(mosaic):
    _, counted = _run(mosaic, "cachedit:0.2", steps=28)
    cached = counted["cached"]["single_transformer_blocks"]
    assert counted["steps"] == 28 and len(cached) > 0 and min(cached) >= 8  # its 8 warmup steps computed


@pytest.mark.slow
def test_taylorseer_calibrator_runs(mosaic):
    plain, plain_counted = _run(mosaic, "cachedit:0.3,warmup=2")
    seer, counted = _run(mosaic, "cachedit:0.3,warmup=2,taylorseer=true,order=2")
    assert len(counted["cached"]["single_transformer_blocks"]) > 0
    assert not torch.equal(seer, plain) and torch.isfinite(seer).all()  # cached steps forecast, not reused


@pytest.mark.slow
def test_the_fused_lists_run(mosaic, vanilla):
    fused, counted = _run(mosaic, "cachedit:0.3,warmup=2,fused=true")
    assert list(counted["cached"]) == ["transformer_blocks"] and len(counted["cached"]["transformer_blocks"]) > 0
    assert torch.equal(_gen(mosaic), vanilla)


def test_a_mask_decides_its_steps(mosaic):
    _, counted = _run(mosaic, "cachedit:0.3,warmup=2,mask=1110110101,policy=static")
    assert counted["cached"]["transformer_blocks"] == [3, 6, 8]  # static: every 0 of the mask cached, no other


@pytest.mark.slow
def test_a_named_mask_and_a_budget_follow_each_generations_steps(mosaic):
    """mask=fast and steps=N are cache-dit masks of the call's own step count: static, exactly their 0 steps cached,
    another count the next generation; the class's call (wrapped for it) put back once removed."""
    from tokenmerge.tools.peers import computed_share

    call = type(mosaic).__call__
    with parse_spec("cachedit:0.3,mask=fast,policy=static").applied(mosaic):
        _gen(mosaic)  # 10 steps: 1110100101
        assert computed_share(mosaic)["cached"]["single_transformer_blocks"] == [3, 5, 6, 8]
        _gen(mosaic, steps=8)  # 8 steps: 11101001
        assert computed_share(mosaic)["cached"]["transformer_blocks"] == [3, 5, 6]
    with parse_spec("cachedit:0.3,steps=4").applied(mosaic):
        _gen(mosaic)  # 4 of 10 computed: 1100010001
        counted = computed_share(mosaic)
        assert counted["cached"]["transformer_blocks"] == [2, 3, 4, 6, 7, 8] and counted["computed"] == 0.4
    assert type(mosaic).__call__ is call and not hasattr(type(mosaic), "_original_call")


@pytest.mark.slow
def test_foca_and_dmd_calibrators_run(mosaic):
    """The same cached steps (steps=4, static), forecast by each calibrator: different images, all finite."""
    images = {name: _run(mosaic, f"cachedit:0.3,steps=4,calibrator={name}", steps=8)[0] for name in ("foca", "dmd")}
    plain = _run(mosaic, "cachedit:0.3,steps=4", steps=8)[0]
    for image in images.values():
        assert torch.isfinite(image).all() and not torch.equal(image, plain)
    assert not torch.equal(images["foca"], images["dmd"])


def test_refusals_name_the_reason(mosaic, cache_dit):
    with pytest.raises(ValueError, match="tokenmerge: cachedit's Fn=2 \\+ Bn=1 exceed the 2 blocks"):
        parse_spec("cachedit:0.1,Fn=2,Bn=1").apply(mosaic)
    from tokenmerge.tools import cachedit

    assert not cachedit.active(mosaic) and "forward" not in vars(mosaic.transformer)

    class NotAFlux:
        unet = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="tokenmerge: cachedit adapts .* denoiser is a Linear"):
        parse_spec("cachedit:0.1").apply(NotAFlux())


@pytest.mark.slow
def test_on_the_wan_video_testbed(cache_dit):
    import diffusers

    if not hasattr(diffusers, "WanTransformer3DModel"):
        pytest.skip("this diffusers has no WanTransformer3DModel")
    from tokenmerge.fashion.video import ClassTokens, FashionVideo, build_video

    torch.manual_seed(0)
    pipe = FashionVideo(build_video().eval(), ClassTokens().eval())
    plain = _gen(pipe, 8, "a sneaker")
    image, counted = _run(pipe, "cachedit:0.3,warmup=2", 8, "a sneaker")
    assert counted["steps"] == 8 and len(counted["cached"]["blocks"]) > 0 and not torch.equal(image, plain)
    assert torch.equal(_run(pipe, "cachedit:0.3,warmup=2", 8, "a sneaker")[0], image)
    assert torch.equal(_gen(pipe, 8, "a sneaker"), plain)
    with pytest.raises(ValueError, match="fused=true is for Flux"):
        parse_spec("cachedit:0.3,fused=true").apply(pipe)
    # fashion-video-long's class inherits its __call__: cache-dit's wrapper, put into that class, is taken out again
    from tokenmerge.fashion.video_long import FashionVideoLong

    long = FashionVideoLong(pipe.transformer, pipe.text)
    assert "__call__" not in vars(FashionVideoLong)
    _, counted = _run(long, "cachedit:0.3,warmup=1", 3, "a sneaker")
    assert counted["steps"] == 3 and "__call__" not in vars(FashionVideoLong)
    _, counted = _run(long, "cachedit:0.3,steps=2", 3, "a sneaker")  # its per-generation mask wrapper too: 101
    assert counted["cached"] == {"blocks": [1]} and "__call__" not in vars(FashionVideoLong)


@pytest.mark.slow
def test_the_quality_report_carries_the_steps_it_computed(mosaic, tmp_path):
    from tokenmerge.quality.report import markdown
    from tokenmerge.quality.run import QualityJob, run_job

    job = QualityJob("embedded mosaic", [MOSAIC_PROMPT], [0], [parse_spec("cachedit:0.3,warmup=2")], 10,
                     cache=tmp_path / "cache")
    report = run_job(mosaic, job, torch.device("cpu"), progress=False, scorer=None)
    vanilla, cached = report["methods"]
    assert vanilla["steps_computed"] is None and 0 < cached["steps_computed"] < 1
    text = markdown(report)
    assert "steps computed |" in text and f"| {cached['steps_computed']:.0%} |" in text
