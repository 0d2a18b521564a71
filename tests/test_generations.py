"""Where a generation starts, and which kept state a call finds: the step clock every technique shares
(``engine.call.Clock``).

- A call whose grid differs from the kept state's (tiles of another size, a stopped generation followed by one at
  another size whose first timestep is below the last one seen) runs a full step: never an error.
- A stopped generation (``callback_on_step_end``) followed by an img2img one at a lower strength: the second never
  sees the first's residuals (a patched pipeline: its scheduler's new timesteps; a bare model:
  ``tokenmerge.new_generation``).
- Several calls per step (tiles of two sizes, batched and unbatched calls): each call's kept state is found by its
  grid and its place in the step, so each equals a run of that call alone. ToMe's ``plan_steps`` plans too.
"""

from __future__ import annotations

import pytest
import torch
from tiny_denoisers import CATALOGUE, all_tensors
from tiny_denoisers import skip_unavailable as _skip

import tokenmerge

pytestmark = pytest.mark.usefixtures("fast_cpu")


def _call(model, inputs, t: float):
    """One denoiser call at timestep ``t`` (0..1, Flux's scale), its outputs flattened."""
    kw = dict(inputs, timestep=torch.full_like(inputs["timestep"], t))
    with torch.no_grad():
        return torch.cat([x.flatten().float() for x in all_tensors(model(**kw))])


def _tiled_and_alone(model, tiles, times, patch) -> tuple[list, list]:
    """Each tile's outputs at each time, called tile after tile at every time under one ``patch(model)``, and
    called alone (a patch of its own) at every time."""
    patch(model)
    tiled = [[_call(model, tile, t) for tile in tiles] for t in times]  # (time, tile)
    tokenmerge.remove_patch(model)
    alone = []
    for tile in tiles:
        patch(model)
        alone.append([_call(model, tile, t) for t in times])
        tokenmerge.remove_patch(model)
    return [list(per_tile) for per_tile in zip(*tiled)], alone


def _flux():
    _skip("flux")
    entry = CATALOGUE["flux"]
    return entry, entry.build()


def test_a_grid_change_mid_generation_runs_a_full_step_not_an_error():
    entry, model = _flux()
    big, small = entry.inputs(batch=2, grid=(4, 4)), entry.inputs(batch=2, grid=(2, 4), seed=1)
    vanilla = _call(model, small, 0.7)
    tokenmerge.apply_reuse(model, 0.5, warmup=1)
    _call(model, big, 1.0)
    _call(model, big, 0.9)  # a partial step of the 4x4 grid
    # a call at another grid, its timestep below the last one seen: no kept state serves it, so a full step
    assert torch.equal(_call(model, small, 0.7), vanilla)
    tokenmerge.remove_patch(model)


def test_tiles_of_two_sizes_per_step_each_equal_a_run_of_that_tile_alone():
    """MultiDiffusion-style tiling: at each timestep, two 4x4 tiles and one 2x4 edge tile; each tile's outputs
    equal those of a generation of that tile alone (its kept state found by its grid and its place in the step)."""
    entry, model = _flux()
    tiles = [entry.inputs(batch=2, grid=(4, 4), seed=0), entry.inputs(batch=2, grid=(4, 4), seed=1),
             entry.inputs(batch=2, grid=(2, 4), seed=2)]
    times = [1.0, 0.8, 0.6, 0.4, 0.2]
    tiled, alone = _tiled_and_alone(model, tiles, times, lambda m: tokenmerge.apply_reuse(m, 0.5, warmup=1))
    for k in range(len(tiles)):
        assert all(torch.equal(a, b) for a, b in zip(tiled[k], alone[k])), k
    assert not torch.equal(tiled[0][-1], _call(model, tiles[0], times[-1]))  # the reuse acted


def test_batched_and_unbatched_calls_keep_their_own_state():
    """A step of one batched call and one unbatched call (two signatures): each its own kept state."""
    entry, model = _flux()
    both, one = entry.inputs(batch=2, seed=0), entry.inputs(batch=1, seed=3)
    times = [1.0, 0.75, 0.5]
    tokenmerge.apply_reuse(model, 0.5, warmup=1)
    mixed = [(_call(model, both, t), _call(model, one, t)) for t in times]
    tokenmerge.remove_patch(model)
    for k, inputs in enumerate((both, one)):
        tokenmerge.apply_reuse(model, 0.5, warmup=1)
        alone = [_call(model, inputs, t) for t in times]
        tokenmerge.remove_patch(model)
        assert all(torch.equal(m[k], a) for m, a in zip(mixed, alone))


def test_new_generation_forgets_a_stopped_one_on_a_bare_model():
    """A custom sampler stops a generation at t=0.7 and starts an img2img-like one at t=0.5 (below: by the timestep
    alone the same generation): after ``tokenmerge.new_generation`` its first call is a full step."""
    entry, model = _flux()
    first, second = entry.inputs(batch=2, seed=0), entry.inputs(batch=2, seed=5)
    vanilla = _call(model, second, 0.5)
    tokenmerge.apply_reuse(model, 0.5, warmup=1)
    for t in (1.0, 0.85, 0.7):
        _call(model, first, t)
    leaked = _call(model, second, 0.5)  # without the call: taken as the next (partial) step of the stopped one
    assert not torch.equal(leaked, vanilla)
    for t in (1.0, 0.85, 0.7):
        _call(model, first, t)
    tokenmerge.new_generation(model)
    assert torch.equal(_call(model, second, 0.5), vanilla)
    tokenmerge.remove_patch(model)


def _img2img():
    """FluxImg2ImgPipeline of tiny parts (no text encoders: seeded prompt embeddings)."""
    import diffusers
    from tiny_pipelines import _image, _pipe, _vae_kl

    if not hasattr(diffusers, "FluxImg2ImgPipeline"):
        pytest.skip(f"diffusers {diffusers.__version__} has no FluxImg2ImgPipeline")
    _skip("flux")
    g = torch.Generator().manual_seed(1)
    none = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    pipe = _pipe("FluxImg2ImgPipeline", scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
                 vae=_vae_kl(shift_factor=0.0), transformer=CATALOGUE["flux"].build(), **none)
    kwargs = dict(image=_image(32), prompt_embeds=torch.randn(1, 5, 32, generator=g),
                  pooled_prompt_embeds=torch.randn(1, 16, generator=g), height=32, width=32, guidance_scale=3.5,
                  output_type="pt")
    return pipe, kwargs


@pytest.mark.parametrize("method", ["reuse", "tome-reuse-steps"])
def test_a_stopped_pipeline_generation_leaves_nothing_to_the_next_one(method):
    """The pipeline stops a generation through ``callback_on_step_end`` (after 2 of 6 steps, strength 1), then runs
    img2img at strength 0.5: its first timestep is below the last one seen, yet it starts a new generation (the
    scheduler's new timesteps), so it equals the same img2img run right after the patch was applied."""
    pipe, kwargs = _img2img()

    def stop(pipe, step, t, outputs):
        if step == 1:
            pipe._interrupt = True
        return outputs

    def patch():
        if method == "reuse":
            tokenmerge.apply_reuse(pipe, 0.5, warmup=1)
        else:
            tokenmerge.apply_patch(pipe, 0.5, plan_steps=3)

    def img2img():
        out = pipe(**kwargs, strength=0.5, num_inference_steps=6, generator=torch.Generator().manual_seed(2))
        return out.images

    patch()
    expected = img2img()  # a first generation after the patch: nothing kept before it
    pipe(**kwargs, strength=1.0, num_inference_steps=6, generator=torch.Generator().manual_seed(0),
         callback_on_step_end=stop)
    assert torch.equal(img2img(), expected)
    tokenmerge.remove_patch(pipe)


def test_tome_kept_plans_follow_each_tile():
    """ToMe's ``plan_steps``: plans kept per call's branch, so tiles of two sizes each reuse their own plans (as a run
    of the tile alone does), and a new generation makes new ones."""
    entry, model = _flux()
    tiles = [entry.inputs(batch=2, grid=(4, 4), seed=0), entry.inputs(batch=2, grid=(2, 4), seed=2)]
    times = [1.0, 0.8, 0.6, 0.4]
    tiled, alone = _tiled_and_alone(model, tiles, times, lambda m: tokenmerge.apply_patch(m, 0.5, plan_steps=2))
    for k in range(len(tiles)):
        assert all(torch.equal(a, b) for a, b in zip(tiled[k], alone[k])), k


def test_the_clock_tells_steps_places_and_generations():
    from tokenmerge.engine.call import Clock
    from tokenmerge.engine.clock import Where

    clock = Clock()
    a, b = ("grid a",), ("grid b",)
    assert clock.tick(Where(None, 0.0), a, 0) == (a, 0) and clock.step == 0 and clock.generation == 1
    assert clock.tick(Where(None, 0.0), a, 0) == (a, 1)  # another call of the step (a guidance branch, a second tile)
    assert clock.tick(Where(None, 0.0), b, 0) == (b, 0)  # another grid: its own place
    from tokenmerge.engine.techniques.step_cache import StepBranch as Kept

    kept = clock.kept[(a, 0)] = Kept(at=0.0)
    assert clock.tick(Where(None, 0.3), a, 0) == (a, 0) and clock.step == 1 and clock.kept[(a, 0)] is kept
    clock.tick(Where(None, 0.2), a, 0)  # back towards noise: a new generation, each kept state reset and dropped
    assert clock.generation == 2 and clock.step == 0 and not clock.kept and kept.at is None
    clock.tick(Where(None, 0.5), a, 1)  # new_generation() was called
    assert clock.generation == 3
    steps = torch.arange(3)
    clock.tick(Where(None, 0.6, grid=steps), a, 1)  # a pipeline's scheduler set up again
    assert clock.generation == 4 and clock.steps == 3
    clock.tick(Where(None, 0.7, grid=steps), a, 1)
    assert clock.generation == 4 and clock.step == 1
    clock.tick(Where(0, 0.1, steps=20, source="context"), a, 1)  # the pipeline's cache_context: its step count
    assert clock.generation == 5 and clock.steps == 20
    clock.tick(Where(1, 0.1, steps=20, source="context"), a, 1)  # the step index moved: the next step
    assert clock.generation == 5 and clock.step == 1
