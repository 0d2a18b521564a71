"""What users combine a patch with: offloading, attention processors, fused QKV, LoRA, dtype/device moves,
saving, copying, pickling, threads, and errors in the middle of a call."""

import copy
import pickle
import threading

import pytest
import torch
from tiny_models import make_sd_pipeline, make_unet, unet_inputs

import tokenmerge


def run(unet, inp):
    with torch.no_grad():
        return unet(**inp).sample


def generate(pipe, seed=0):
    out = pipe("a red cube", num_inference_steps=2, height=32, width=32, output_type="np",
               generator=torch.Generator().manual_seed(seed))
    return torch.from_numpy(out.images)


@pytest.fixture
def pipe(tmp_path):
    p = make_sd_pipeline(tmp_path)
    p.set_progress_bar_config(disable=True)
    return p


def test_model_cpu_offload_after_and_before_patching(pipe):
    vanilla = generate(pipe)
    tokenmerge.apply_patch(pipe)
    merged = generate(pipe)
    pipe.enable_model_cpu_offload(device="cpu")
    assert torch.equal(generate(pipe), merged)
    tokenmerge.remove_patch(pipe)
    assert torch.equal(generate(pipe), vanilla)
    tokenmerge.apply_patch(pipe)  # patching an offloaded pipeline
    assert torch.equal(generate(pipe), merged)


def test_accelerate_forward_wrapping_hooks(pipe):
    """What sequential offload relies on: accelerate replaces ``module.forward`` by a wrapper (hooks on every
    sub-module). diffusers' own ``enable_sequential_cpu_offload`` fails on a CPU-only machine even unpatched,
    so the interplay is tested with accelerate's hooks directly."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    unet = make_unet()
    inp = unet_inputs()
    vanilla = run(unet, inp)
    tokenmerge.apply_patch(unet)
    merged = run(unet, inp)
    try:
        for module in unet.modules():
            add_hook_to_module(module, ModelHook())
        assert torch.equal(run(unet, inp), merged)
        tokenmerge.apply_patch(unet)  # re-applied on wrapped forwards: arguments are still found by name
        assert torch.equal(run(unet, inp), merged)
        tokenmerge.remove_patch(unet)
        assert torch.equal(run(unet, inp), vanilla)
    finally:
        # old diffusers share activation modules between models (a global nn.SiLU()): unwrap them all again
        remove_hook_from_module(unet, recurse=True)


def test_attention_processors_and_fused_qkv():
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    unet = make_unet()
    inp = unet_inputs()
    tokenmerge.apply_patch(unet)
    merged_sdpa = run(unet, inp)
    unet.set_attn_processor(AttnProcessor())  # swapped after patching
    torch.testing.assert_close(run(unet, inp), merged_sdpa, rtol=1e-4, atol=1e-5)
    tokenmerge.remove_patch(unet)
    vanilla_plain = run(unet, inp)
    assert not torch.allclose(vanilla_plain, merged_sdpa, atol=1e-4)
    unet.set_attn_processor(AttnProcessor2_0())
    vanilla = run(unet, inp)
    tokenmerge.apply_patch(unet)
    unet.fuse_qkv_projections()
    fused = run(unet, inp)
    torch.testing.assert_close(fused, merged_sdpa, rtol=1e-4, atol=1e-5)
    tokenmerge.remove_patch(unet)
    torch.testing.assert_close(run(unet, inp), vanilla, rtol=1e-4, atol=1e-5)
    unet.unfuse_qkv_projections()
    assert torch.equal(run(unet, inp), vanilla)


def _lora_config():
    try:
        from peft import LoraConfig
    except Exception as err:  # peft absent, or too new for an old transformers
        pytest.skip(f"peft not usable here: {err}")
    return LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                      init_lora_weights=False)


def test_lora_after_and_before_patching():
    unet = make_unet()
    inp = unet_inputs()
    tokenmerge.apply_patch(unet)
    merged = run(unet, inp)
    torch.manual_seed(5)
    unet.add_adapter(_lora_config())
    merged_lora = run(unet, inp)
    assert not torch.allclose(merged_lora, merged, atol=1e-4)  # the LoRA acts
    tokenmerge.remove_patch(unet)
    vanilla_lora = run(unet, inp)
    assert not torch.allclose(vanilla_lora, merged_lora, atol=1e-4)  # and so does the patch, beside it
    tokenmerge.apply_patch(unet)  # patch a UNet that has a LoRA
    assert torch.equal(run(unet, inp), merged_lora)
    tokenmerge.remove_patch(unet)
    assert torch.equal(run(unet, inp), vanilla_lora)


def test_load_lora_weights_into_a_patched_pipeline(pipe, tmp_path):
    """A LoRA file made here (random, non-zero), loaded with the pipeline's own ``load_lora_weights``."""
    from diffusers import StableDiffusionPipeline
    try:
        from peft.utils import get_peft_model_state_dict
    except Exception as err:
        pytest.skip(f"peft not usable here: {err}")
    donor = make_unet()
    torch.manual_seed(7)
    donor.add_adapter(_lora_config())
    StableDiffusionPipeline.save_lora_weights(tmp_path / "lora", unet_lora_layers=get_peft_model_state_dict(donor))
    vanilla = generate(pipe)
    tokenmerge.apply_patch(pipe)
    merged = generate(pipe)
    pipe.load_lora_weights(tmp_path / "lora")
    merged_lora = generate(pipe)
    assert (merged_lora - merged).abs().max() > 1e-4  # the LoRA acts on the patched pipeline
    tokenmerge.remove_patch(pipe)
    vanilla_lora = generate(pipe)
    assert (vanilla_lora - merged_lora).abs().max() > 1e-4
    pipe.unload_lora_weights()
    assert torch.equal(generate(pipe), vanilla)


def test_fused_qkv_before_patching():
    unet = make_unet()
    inp = unet_inputs()
    tokenmerge.apply_patch(unet)
    merged = run(unet, inp)
    tokenmerge.remove_patch(unet)
    unet.fuse_qkv_projections()
    vanilla_fused = run(unet, inp)
    tokenmerge.apply_patch(unet)
    torch.testing.assert_close(run(unet, inp), merged, rtol=1e-4, atol=1e-5)
    tokenmerge.remove_patch(unet)
    assert torch.equal(run(unet, inp), vanilla_fused)


def test_ip_adapter_style_cross_attention_processor():
    """An extra processor on attn2 that reads more tokens than the text (as IP-Adapter does) still works."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    class ExtraTokens(AttnProcessor2_0):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, *args, **kwargs):
            if encoder_hidden_states is not None:
                encoder_hidden_states = torch.cat([encoder_hidden_states, encoder_hidden_states[:, :2] * 0.5], 1)
            return super().__call__(attn, hidden_states, encoder_hidden_states, *args, **kwargs)

    unet = make_unet()
    inp = unet_inputs()
    procs = {name: ExtraTokens() if "attn2" in name else AttnProcessor2_0() for name in unet.attn_processors}
    unet.set_attn_processor(procs)
    vanilla = run(unet, inp)
    tokenmerge.apply_patch(unet, merge_crossattn=True)
    assert (run(unet, inp) - vanilla).abs().max() > 1e-4
    tokenmerge.remove_patch(unet)
    assert torch.equal(run(unet, inp), vanilla)


def test_dtype_and_device_moves_keep_the_patch(pipe, tmp_path):
    (tmp_path / "ref").mkdir()
    never_patched = make_sd_pipeline(tmp_path / "ref").to(torch.bfloat16)
    never_patched.set_progress_bar_config(disable=True)
    reference = generate(never_patched)
    tokenmerge.apply_patch(pipe)
    pipe.to(torch.bfloat16)
    pipe.to("cpu")
    merged = generate(pipe)
    assert merged.dtype == reference.dtype and (merged.float() - reference.float()).abs().max() > 0
    tokenmerge.remove_patch(pipe)
    assert torch.equal(generate(pipe), reference)


def test_save_pretrained_of_a_patched_model_is_the_unpatched_one(tmp_path):
    from safetensors.torch import load_file

    unet = make_unet()
    unet.save_pretrained(tmp_path / "plain")
    tokenmerge.apply_patch(unet, ratio=0.6, merge_mlp=True)
    unet.save_pretrained(tmp_path / "patched")
    assert (tmp_path / "plain" / "config.json").read_text() == (tmp_path / "patched" / "config.json").read_text()
    a = load_file(tmp_path / "plain" / "diffusion_pytorch_model.safetensors")
    b = load_file(tmp_path / "patched" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert set(unet.state_dict()) == set(a)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_are_independent_patched_models(how):
    unet = make_unet()
    inp = unet_inputs()
    vanilla = run(unet, inp)
    tokenmerge.apply_patch(unet, ratio=0.5, seed=3)
    merged = run(unet, inp)
    twin = copy.deepcopy(unet) if how == "deepcopy" else pickle.loads(pickle.dumps(unet))
    assert torch.equal(run(twin, inp), merged)
    assert tokenmerge.describe_patch(twin).config.seed == 3
    tokenmerge.remove_patch(twin)
    assert torch.equal(run(twin, inp), vanilla)
    assert torch.equal(run(unet, inp), merged)  # the original keeps its patch
    tokenmerge.remove_patch(unet)
    assert torch.equal(run(unet, inp), vanilla)


def test_two_pipelines_sharing_one_unet(tmp_path):
    from diffusers import StableDiffusionImg2ImgPipeline

    pipe = make_sd_pipeline(tmp_path)
    other = StableDiffusionImg2ImgPipeline(**pipe.components)
    for p in (pipe, other):
        p.set_progress_bar_config(disable=True)
    tokenmerge.apply_patch(pipe)
    assert tokenmerge.describe_patch(other) is not None  # the same UNet object
    tokenmerge.apply_patch(other, ratio=0.3)  # replaces, not stacks
    assert tokenmerge.describe_patch(pipe).config.ratio == 0.3
    tokenmerge.remove_patch(other)
    assert tokenmerge.describe_patch(pipe) is None


def test_threads_do_not_share_call_state():
    """Two threads run one patched UNet at different sizes at once; each gets its single-threaded result."""
    unet = make_unet()
    tokenmerge.apply_patch(unet, max_downsample=2)
    jobs = {"a": unet_inputs(batch=2, h=16, w=16), "b": unet_inputs(batch=3, h=12, w=20, seed=1)}
    expected = {k: run(unet, v) for k, v in jobs.items()}
    results, errors = {k: [] for k in jobs}, []
    barrier = threading.Barrier(2)

    def work(key):
        try:
            barrier.wait()
            for _ in range(3):
                results[key].append(run(unet, jobs[key]))
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for key, outs in results.items():
        assert len(outs) == 3 and all(torch.equal(o, expected[key]) for o in outs)
    tokenmerge.remove_patch(unet)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_interrupted_call_leaves_no_state_behind(error):
    unet = make_unet()
    inp = unet_inputs()
    tokenmerge.apply_patch(unet, merge_mlp=True)
    block = unet.down_blocks[0].attentions[0].transformer_blocks[0]
    block.set_chunk_feed_forward(8, 1)
    expected = run(unet, inp)

    def boom(module, args):
        raise error("interrupted")

    handle = block.ff.register_forward_pre_hook(boom)
    with pytest.raises(error):
        run(unet, inp)
    handle.remove()
    if error is RuntimeError:  # torch runs the always-called hooks on an Exception: clean at once
        assert block._chunk_size == 8
        with pytest.raises(ValueError, match="called outside its denoiser's forward"):  # no call's grid is left
            block(torch.randn(2, 64, 32), encoder_hidden_states=torch.randn(2, 5, 32))
    # a KeyboardInterrupt skips them (torch catches Exception only): the next call cleans up first
    assert torch.equal(run(unet, inp), expected)
    assert block._chunk_size == 8
    with pytest.raises(error):
        handle = block.ff.register_forward_pre_hook(boom)
        run(unet, inp)
    handle.remove()
    tokenmerge.remove_patch(unet)  # ... and so does removal
    assert block._chunk_size == 8


def test_a_failure_while_installing_leaves_nothing_half_patched(monkeypatch):
    from tokenmerge.engine.techniques import around

    unet = make_unet()
    inp = unet_inputs()
    vanilla = run(unet, inp)
    tokenmerge.apply_patch(unet, ratio=0.3)
    before = run(unet, inp)
    calls = {"n": 0}
    real = around.bind

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("registration failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(around, "bind", flaky)  # the technique's binding of its targets' arguments
    with pytest.raises(RuntimeError, match="registration failed"):
        tokenmerge.apply_patch(unet, ratio=0.6)
    monkeypatch.undo()
    # the failed patch left no hook behind, and the previous patch is back as it was
    assert tokenmerge.describe_patch(unet).config.ratio == 0.3
    assert torch.equal(run(unet, inp), before)
    tokenmerge.remove_patch(unet)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in unet.modules())
    assert torch.equal(run(unet, inp), vanilla)
