"""ToDo (token downsampling) and timestep schedules."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import PlanRecorder, ldm_unet, make_sd_pipeline, make_unet, record_plans, unet_inputs

import tokenmerge
from tokenmerge.merge.downsample import downsample_tokens, pooled_size


def run(unet, inp):
    with torch.no_grad():
        return unet(**inp).sample


def test_factor_one_changes_nothing_and_removal_is_exact():
    unet = make_unet()
    inp = unet_inputs()
    vanilla = run(unet, inp)
    tokenmerge.apply_todo(unet, downsample=1)
    assert torch.equal(run(unet, inp), vanilla)
    tokenmerge.apply_todo(unet, downsample=2)
    assert (run(unet, inp) - vanilla).abs().max() > 1e-4
    assert "ToDo patch: downsample=2" in str(tokenmerge.describe_patch(unet))
    tokenmerge.remove_patch(unet)
    assert torch.equal(run(unet, inp), vanilla)


@pytest.mark.parametrize("mode", ["nearest-exact", "avg", "bilinear"])
@pytest.mark.parametrize("h, w", [(8, 8), (7, 10)])
def test_pooling_matches_interpolate(mode, h, w):
    x = torch.randn(2, h * w, 5)
    out = downsample_tokens(x, h, w, 2, mode)
    grid = x.transpose(1, 2).reshape(2, 5, h, w)
    ph, pw = pooled_size(h, w, 2)
    if mode == "avg" and h % 2 == 0 and w % 2 == 0:
        ref = F.avg_pool2d(grid, 2)
    else:
        ref = F.interpolate(grid, size=(ph, pw), mode={"avg": "area"}.get(mode, mode))
    torch.testing.assert_close(out, ref.flatten(2).transpose(1, 2))
    if mode == "nearest-exact" and h % 2 == 0 and w % 2 == 0:  # the paper's choice: one token of each 2x2 window
        torch.testing.assert_close(out, grid[:, :, 1::2, 1::2].flatten(2).transpose(1, 2))


def test_todo_is_attention_against_pooled_keys_and_values():
    """On one block's attn1: the patched output equals attention computed by hand with pooled K/V."""
    unet = make_unet()
    attn = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    seen = {}

    def keep_input(module, args, kwargs):
        seen.setdefault("x", args[0] if args else kwargs["hidden_states"])

    def keep_output(module, args, out):
        seen.setdefault("out", out)

    attn.register_forward_pre_hook(keep_input, with_kwargs=True)
    attn.register_forward_hook(keep_output)
    tokenmerge.apply_todo(unet, downsample=2, mode="avg")
    run(unet, unet_inputs(h=16, w=16))
    tokenmerge.remove_patch(unet)
    x = seen["x"]  # attn1's input (the hook registered first sees it before ToDo's)
    kv = downsample_tokens(x, 16, 16, 2, "avg")
    heads = attn.heads
    q, k, v = attn.to_q(x), attn.to_k(kv), attn.to_v(kv)
    b, n, c = q.shape
    split = lambda t: t.reshape(b, -1, heads, c // heads).transpose(1, 2)  # noqa: E731
    ref = F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).reshape(b, n, c)
    ref = attn.to_out[0](ref)
    torch.testing.assert_close(seen["out"], ref, rtol=1e-5, atol=1e-5)


def test_todo_with_tome_on_the_queries_and_on_ldm():
    unet = make_unet()
    inp = unet_inputs()
    tokenmerge.apply_todo(unet, downsample=2)
    todo_only = run(unet, inp)
    tokenmerge.apply_todo(unet, downsample=2, ratio=0.5)
    both = run(unet, inp)
    assert not torch.equal(todo_only, both) and torch.isfinite(both).all()
    tokenmerge.remove_patch(unet)
    model = ldm_unet()
    x = torch.randn(2, 4, 16, 16)
    t, c = torch.full((2,), 10), torch.randn(2, 7, 32)
    with torch.no_grad():
        vanilla = model.apply_model(x, t, c)
        tokenmerge.apply_todo(model, downsample=2, max_downsample=2)
        todo = model.apply_model(x, t, c)
        tokenmerge.remove_patch(model)
        assert (todo - vanilla).abs().max() > 1e-4 and torch.equal(model.apply_model(x, t, c), vanilla)


@pytest.mark.parametrize("kwargs, words", [
    (dict(downsample=0), "downsample"), (dict(mode="max"), "mode must be one of"),
    (dict(ratio=0.9), "ratio"), (dict(start=0.5, stop=0.5), "start must be below stop"),
    (dict(stop=1.5), "stop"), (dict(max_downsample=0), "max_downsample"),
])
def test_todo_bad_arguments(kwargs, words):
    unet = make_unet()
    with pytest.raises(ValueError, match=words):
        tokenmerge.apply_todo(unet, **kwargs)
    assert tokenmerge.describe_patch(unet) is None


def test_schedule_bad_arguments():
    unet = make_unet()
    for kwargs, words in ((dict(start=-0.1), "start"), (dict(ratio_end=0.8), "ratio_end"),
                          (dict(num_train_timesteps=0), "num_train_timesteps")):
        with pytest.raises(ValueError, match=words):
            tokenmerge.apply_patch(unet, **kwargs)


@pytest.mark.parametrize("method", ["tome", "todo"])
def test_schedule_switches_at_the_right_steps_of_a_real_scheduler_loop(tmp_path, method):
    """Merge only in the first half of the denoising process: count the UNet calls that merged."""
    pipe = make_sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    merged_at = []  # per UNet call: whether its first patched block merged (got a plan)

    class Watch(PlanRecorder):
        def plan(self, block_plan):
            if block_plan.path.endswith("down_blocks.0.attentions.0.transformer_blocks.0"):
                merged_at[-1] = True

    pipe.unet.register_forward_pre_hook(lambda *_: merged_at.append(False))
    steps = 10
    timesteps = []
    pipe.unet.register_forward_pre_hook(lambda m, a, k: timesteps.append(float(k.get("timestep", a[1] if len(a) > 1
                                                                                       else 0))), with_kwargs=True)
    with tokenmerge.patched(pipe, method=method, start=0.0, stop=0.5, **({"downsample": 2} if method == "todo"
                                                                          else {})):
        tokenmerge.observe(pipe, Watch())
        pipe("a red cube", num_inference_steps=steps, height=32, width=32, output_type="np",
             generator=torch.Generator().manual_seed(0))
    # guidance batches both halves into one call per step: one UNet call per step
    assert len(merged_at) == steps == len(timesteps)
    expected = [1 - t / 1000 <= 0.5 for t in timesteps]
    assert merged_at == expected and any(expected) and not all(expected)


def test_ratio_ramp_and_img2img_partial_schedule(tmp_path):
    from diffusers import StableDiffusionImg2ImgPipeline

    base = make_sd_pipeline(tmp_path)
    pipe = StableDiffusionImg2ImgPipeline(**base.components)
    pipe.set_progress_bar_config(disable=True)
    tokenmerge.apply_patch(pipe, ratio=0.1, ratio_end=0.6, start=0.0, stop=1.0)
    recorder = record_plans(pipe)
    pipe("a red cube", image=torch.rand(1, 3, 32, 32), strength=0.6, num_inference_steps=10, output_type="np",
         generator=torch.Generator().manual_seed(0))
    tokenmerge.remove_patch(pipe)
    merged_counts = [p.num_merged for p in recorder.of("down_blocks.0.attentions.0.transformer_blocks.0")]
    # img2img runs the last 6 of 10 steps; the ratio grows with progress, so the merged count does too
    assert len(merged_counts) == 6
    assert merged_counts == sorted(merged_counts) and merged_counts[0] < merged_counts[-1]
    tokens = 16 * 16
    assert merged_counts[-1] <= int(tokens * 0.6) and merged_counts[0] >= int(tokens * 0.1)


def test_schedule_needs_a_timestep():
    from test_norm_types import OneBlockDenoiser, make_case

    model, kwargs = make_case("layer_norm")
    tokenmerge.apply_patch(model, stop=0.5)
    with pytest.raises(TypeError, match="needs the timestep"):
        with torch.no_grad():
            model(torch.randn(2, 32, 8, 12), **kwargs)
    tokenmerge.remove_patch(model)
    assert OneBlockDenoiser


def test_patched_context_manager_with_todo_and_bad_method():
    unet = make_unet()
    inp = unet_inputs()
    vanilla = run(unet, inp)
    with tokenmerge.patched(unet, method="todo", downsample=2):
        assert isinstance(tokenmerge.describe_patch(unet).config, tokenmerge.ToDoConfig)
        assert tokenmerge.describe_patch(unet).config.ratio == 0.0
        assert not torch.equal(run(unet, inp), vanilla)
    assert torch.equal(run(unet, inp), vanilla)
    with pytest.raises(ValueError, match="method must be one of 'tome', 'todo', 'reuse', 'step_cache', 'unet_cache', "
                                         "'accelerate'"):
        with tokenmerge.patched(unet, method="fast"):
            pass
    assert tokenmerge.describe_patch(unet) is None
