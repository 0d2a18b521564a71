"""The conformance suite: what "supported" means, run over every registered family x its tiny factories.

For every entry of the catalogue (tests/tiny_denoisers.py) whose model a family matches: off / on / removed
bit-identical, ratio 0 bit-identical, a non-square grid with an odd batch, a batch change between calls, a schedule
that leaves a call unmerged, plan reuse across calls, plan sharing, local matching, ToDo where the family allows it
(else its refusal), and exactly one family matching. ``EXPECTED`` is the support table: an entry that changes family
or stops being matched fails here. ``torch.compile(fullgraph=True)`` runs once per family (marked ``compile``).
"""

from __future__ import annotations

import pytest
import torch
from tiny_denoisers import CATALOGUE as _CATALOGUE
from tiny_denoisers import TinyDenoiser, all_tensors, output_tensor
from tiny_denoisers import available as _available
from tiny_models import ToyVideoDiT, later_step, ldm_unet, permuting_matcher, toy_video_family, toy_video_inputs

import tokenmerge
from tokenmerge.families import BUILTIN, match_family, registered_families

pytestmark = pytest.mark.usefixtures("fast_cpu")


def _ldm_inputs(batch=2, grid=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, w = grid or (8, 8)
    return dict(x=torch.randn(batch, 4, h, w, generator=g), timesteps=torch.full((batch,), 500.0),
                context=torch.randn(batch, 5, 32, generator=g))


def _toy():
    torch.manual_seed(0)
    return ToyVideoDiT().eval()


# the LDM-style UNet (CompVis/Stability code, not diffusers) from tiny_models, called at model.diffusion_model, and
# a video DiT the package has never seen, added by a user's register_family (the fixture below)
CATALOGUE = dict(_CATALOGUE, ldm=TinyDenoiser("ldm", "UNetModel", "image", lambda: ldm_unet().model.diffusion_model,
                                             _ldm_inputs, (8, 8), latent="x"),
                 toy=TinyDenoiser("toy", "ToyVideoDiT", "video", _toy, toy_video_inputs, (3, 4, 4), latent="latent"))


def available(name):
    return None if name in ("ldm", "toy") else _available(name)


@pytest.fixture(autouse=True, scope="module")
def _user_family():
    family = tokenmerge.register_family(toy_video_family())
    yield family
    tokenmerge.unregister_family(family.name)

# catalogue entry -> the family that must match it: each family's ``examples`` (the diffusers configurations it is
# tested on), and the toy family a user registers (register_family, the fixture below)
EXPECTED = {example: f.name for f in BUILTIN for example in f.examples} | {"toy": "toy-video"}
# matched, and failing with a clear tokenmerge error at the first call (not yet supported; never silently wrong)
CALL_ERRORS: dict[str, str] = {}


def _entries(kind=None):
    return [n for n, fam in EXPECTED.items() if fam is not None and (kind is None or fam == kind)]


def _skip_unavailable(name):
    reason = available(name)
    if reason is not None:
        pytest.skip(reason)


@torch.no_grad()
def _run(model, inputs):
    """Every output tensor, flattened into one (a ControlNet's residuals too)."""
    out = model(**inputs)
    return torch.cat([t.reshape(-1) for t in all_tensors(out)]) if not isinstance(out, torch.Tensor) else out.clone()


def _setup(name, batch=2, grid=None):
    _skip_unavailable(name)
    entry = CATALOGUE[name]
    model = entry.build()
    return entry, model, entry.inputs(batch=batch, grid=grid)


def _other_grid(entry):
    """A non-square grid the entry accepts (the same frame count: some video models have a fixed one)."""
    g = entry.grid
    return g if entry.fixed_grid else (*g[:-1], g[-1] + 2)


@pytest.mark.parametrize("name", _entries())
def test_exactly_one_family_matches(name):
    entry, model, _ = _setup(name)
    inner = getattr(model, "_orig_mod", model)
    matching = [f.name for f in registered_families() if f.match(inner)]
    assert matching == [EXPECTED[name]], f"{name}: families matching {matching}"
    assert match_family(inner).name == EXPECTED[name]
    info = tokenmerge.apply_patch(model, ratio=0.5) and tokenmerge.describe_patch(model)
    assert info.num_blocks > 0 and {d.family for d in info.denoisers} == {EXPECTED[name]}
    tokenmerge.remove_patch(model)


@pytest.mark.parametrize("name", _entries())
def test_off_on_removed_and_ratio_zero(name):
    entry, model, inputs = _setup(name)
    plain = _run(model, inputs)
    tokenmerge.apply_patch(model, ratio=0.0)
    assert torch.equal(_run(model, inputs), plain), "ratio 0 must be bit-identical"
    tokenmerge.apply_patch(model, ratio=0.5)
    merged = _run(model, inputs)
    assert merged.shape == plain.shape and torch.isfinite(merged).all()
    assert not torch.equal(merged, plain), "ratio 0.5 changed nothing"
    tokenmerge.remove_patch(model)
    assert torch.equal(_run(model, inputs), plain), "removal must be bit-identical"


@pytest.mark.parametrize("name", _entries())
def test_non_square_grid_odd_batch_and_batch_change(name):
    entry, model, _ = _setup(name)
    odd = entry.inputs(batch=3, grid=_other_grid(entry), seed=1)
    try:
        plain_odd = _run(model, odd)
    except (RuntimeError, ValueError):  # the model itself takes only its configured size (DiT unpatchifies so)
        odd = entry.inputs(batch=3, seed=1)
        plain_odd = _run(model, odd)
    even = entry.inputs(batch=2, seed=2)
    plain_even = _run(model, even)
    tokenmerge.apply_patch(model, ratio=0.5)
    try:
        merged_odd, merged_even = _run(model, odd), _run(model, even)  # one patch, two batch sizes and grids
    finally:
        tokenmerge.remove_patch(model)
    assert merged_odd.shape == plain_odd.shape and merged_even.shape == plain_even.shape
    assert not torch.equal(merged_odd, plain_odd) and not torch.equal(merged_even, plain_even)
    assert torch.isfinite(merged_odd).all() and torch.isfinite(merged_even).all()


@pytest.mark.parametrize("name", _entries())
def test_schedule_reuse_sharing_and_local_matching(name):
    entry, model, inputs = _setup(name)
    plain = _run(model, inputs)
    calls = []

    def counting(*args):
        calls.append(1)
        return tokenmerge.merge.bipartite_soft_matching(*args)

    # the inputs' timesteps are mid-schedule: a window at the very end leaves this call unmerged, bit for bit
    tokenmerge.apply_patch(model, ratio=0.5, start=0.999, stop=1.0)
    assert torch.equal(_run(model, inputs), plain), "a schedule that excludes this step must not merge"
    tokenmerge.apply_patch(model, ratio=0.5)
    exact = _run(model, inputs)
    tokenmerge.apply_config(model, tokenmerge.ToMeConfig(ratio=0.5, plan_steps=2), matcher=counting)
    first = _run(model, inputs)
    made = len(calls)
    later = inputs  # no timestep: every call is a step
    for factor in (0.8, 0.01):  # the next step (a call at the same timestep is another call of that step, with plans
        try:  # of its own); a timestep whose progress saturates (EDM's c_noise at 500) needs a large step
            later = later_step(getattr(model, "_orig_mod", model), inputs, factor)
            break
        except (ValueError, TypeError, AttributeError):
            pass
    second = _run(model, later)
    assert made > 0 and len(calls) == made, "plan_steps=2: the next step must reuse every plan"
    assert torch.equal(first, exact) and torch.isfinite(second).all()
    calls.clear()
    tokenmerge.apply_config(model, tokenmerge.ToMeConfig(ratio=0.5, share_plans=True), matcher=counting)
    shared = _run(model, inputs)
    blocks = tokenmerge.describe_patch(model).num_blocks
    assert 0 < len(calls) <= blocks and torch.isfinite(shared).all()
    tokenmerge.apply_patch(model, ratio=0.5, match_radius=0)
    local = _run(model, inputs)
    assert local.shape == plain.shape and torch.isfinite(local).all() and not torch.equal(local, plain)
    tokenmerge.remove_patch(model)
    assert torch.equal(_run(model, inputs), plain)


@pytest.mark.parametrize("name", _entries())
def test_todo_or_its_refusal(name):
    entry, model, inputs = _setup(name)
    family = match_family(getattr(model, "_orig_mod", model))
    if family.todo_refused is not None:
        with pytest.raises(ValueError) as err:
            tokenmerge.apply_todo(model, downsample=2)
        assert family.todo_refused[:40] in str(err.value)
        assert tokenmerge.describe_patch(model) is None  # nothing left behind
        return
    plain = _run(model, inputs)
    tokenmerge.apply_todo(model, downsample=1)
    assert torch.equal(_run(model, inputs), plain), "downsample=1 pools nothing"
    tokenmerge.apply_todo(model, downsample=2)
    pooled = _run(model, inputs)
    assert pooled.shape == plain.shape and torch.isfinite(pooled).all() and not torch.equal(pooled, plain)
    tokenmerge.remove_patch(model)
    assert torch.equal(_run(model, inputs), plain)


def test_register_family_rejects_a_second_family_of_the_same_name():
    with pytest.raises(ValueError, match="registered already"):
        tokenmerge.register_family(toy_video_family())
    with pytest.raises(ValueError, match="no blocks"):
        tokenmerge.register_family(tokenmerge.Family("empty", match=toy_video_family().match))


def test_every_builtin_family_has_a_factory():
    covered = set(EXPECTED.values())
    missing = {f.name for f in BUILTIN} - covered
    assert not missing, f"families without a tiny factory: {missing}"


def test_catalogue_entries_not_supported_are_refused_clearly():
    """Every other catalogue entry is refused with an error that names tokenmerge and the model (or, for a model
    of a known family without attention blocks, says there is none): at apply time, or (CALL_ERRORS: when only the
    call's inputs show the layout) at the first call. Never patched silently."""
    for name, entry in CATALOGUE.items():
        if name in EXPECTED or available(name) is not None:
            continue
        model = entry.build()
        if name in CALL_ERRORS:
            tokenmerge.apply_patch(model, ratio=0.5)
            with pytest.raises(ValueError, match=CALL_ERRORS[name]), torch.no_grad():
                model(**entry.inputs())
            tokenmerge.remove_patch(model)
            continue
        with pytest.raises((TypeError, ValueError)) as err:
            tokenmerge.apply_patch(model, ratio=0.5)
        message = str(err.value)
        assert (err.type is TypeError and "tokenmerge cannot patch" in message and type(model).__name__ in message) \
            or (err.type is ValueError and "no transformer block to merge in" in message), f"{name}: {message}"
        assert tokenmerge.describe_patch(model) is None, f"{name}: a refused patch left something behind"


# compiled in every run: a UNet (levels), Flux (ids grid + joint text + rotary), Wan (3-D grid + rotary
# self-attention) and a user's family; every other family is marked slow (pytest -m slow), to keep CI short
_COMPILE_CORE = {"diffusers-unet", "diffusers-flux", "wan"}  # a UNet, an image DiT with rotary, a video DiT
_COMPILE = sorted({(_entries(f.name)[0], f.name in _COMPILE_CORE) for f in BUILTIN if _entries(f.name)}
                  | {("toy", True)})


# models whose own forward breaks the graph (checked: the unpatched model fails fullgraph, else this entry is stale)
_BREAKS_WITHOUT_US = {
    "qwen-image-2.1": "diffusers' QwenImage21Rope reads its image mask with tolist()",
    "hidream": "diffusers' HiDream mixture-of-experts routing (moe_infer) sizes tensors by each expert's token count",
    "hunyuan-image-2.1": "diffusers' HunyuanImage 2.1 attention mask is built from the text lengths (data-dependent)",
    "hunyuan-video-1.5": "diffusers' HunyuanVideo 1.5 branches on torch.all(image_embeds == 0) (text or image to "
                         "video)",
    "lumina2": "diffusers' Lumina2 builds its joint sequence from the prompt mask's lengths (data-dependent slices)",
    "omnigen": "diffusers' OmniGen rotary embedding branches on torch.max(position_ids) (data-dependent)",
    "z-image": "diffusers' Z-Image rotary tables are built under `with torch.device('cpu')`, a context manager "
               "dynamo cannot enter",
    "bria-fibo2": "diffusers' Bria FIBO 2 rotary tables are built under `with torch.device('cpu')`, a context "
                  "manager dynamo cannot enter",
}


@pytest.mark.compile
@pytest.mark.parametrize("method, name", [  # the UNet's graph traces slowest: ToMe on it always, the rest in -m slow
    pytest.param(method, n, marks=() if core and (method == "tome" or n != "unet-sd") else pytest.mark.slow)
    for n, core in _COMPILE for method in ("tome", "block", "todo")])
def test_compile_fullgraph_from_the_first_call_matches_eager(method, name):
    """Patched first, then compiled as one graph (fullgraph: any graph break fails), with no eager call before the
    compiled one (a pipeline's first step is then the compiled call): the same outputs as eager. ToMe, whole-block
    ToMe and ToDo (pooled outside or inside the attention call). The dynamo front end is what our hooks meet; the
    inductor back end is exercised on UNets by test_compile.py."""
    entry, model, inputs = _setup(name)
    family = match_family(model)
    if method == "block" and not all(s.whole is not None for s in family.find_blocks(model, "")):
        pytest.skip("the family does not declare scope='block'")
    if method == "todo" and family.todo_refused is not None:
        pytest.skip(f"the family refuses ToDo: {family.todo_refused}")
    torch._dynamo.reset()
    if name in _BREAKS_WITHOUT_US:
        with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)), torch.no_grad():
            torch.compile(model, fullgraph=True, backend="eager")(**inputs)
        torch._dynamo.reset()
        pytest.skip(f"the model itself is not one graph: {_BREAKS_WITHOUT_US[name]}")
    if method == "todo":
        tokenmerge.apply_todo(model, downsample=(1, 2, 2) if entry.kind == "video" else 2)
    else:
        tokenmerge.apply_patch(model, ratio=0.5, scope="block" if method == "block" else "attention")
    try:
        with torch.no_grad():
            compiled = output_tensor(torch.compile(model, fullgraph=True, backend="eager")(**inputs))
            eager = output_tensor(model(**inputs))
    finally:
        tokenmerge.remove_patch(model)
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert not torch.allclose(output_tensor(model(**inputs)), eager), "the patch acted"


@pytest.mark.parametrize("name", _entries())
def test_whole_block_merging_or_its_refusal(name):
    entry, model, inputs = _setup(name)
    inner = getattr(model, "_orig_mod", model)
    if not all(site.whole is not None for site in match_family(inner).find_blocks(inner, "")):
        with pytest.raises(ValueError, match="scope='block' is not declared"):
            tokenmerge.apply_patch(model, ratio=0.5, scope="block")
        assert tokenmerge.describe_patch(model) is None
        return
    plain = _run(model, inputs)
    tokenmerge.apply_patch(model, ratio=0.0, scope="block")
    assert torch.equal(_run(model, inputs), plain), "ratio 0 must be bit-identical"
    tokenmerge.apply_patch(model, ratio=0.5, scope="block")
    try:
        merged = _run(model, inputs)
    except ValueError as err:  # a call whose per-token arguments the merge does not follow: a clear refusal
        assert "per-token" in str(err) or "would make" in str(err), str(err)
        merged = None
    tokenmerge.remove_patch(model)
    if merged is not None:
        assert merged.shape == plain.shape and torch.isfinite(merged).all() and not torch.equal(merged, plain)
    assert torch.equal(_run(model, inputs), plain), "removal must be bit-identical"


@pytest.mark.parametrize("name", _entries())
@pytest.mark.parametrize("scope", ["attention", "block"])
def test_a_permutation_of_the_image_tokens_changes_nothing(name, scope):
    """A "merge" that only reorders the image tokens (and the rows that follow them) must leave every output
    unchanged up to rounding: it fails if a family's rotary rows, text side, mask or output layout is wrong."""
    entry, model, _ = _setup(name)
    inner = getattr(model, "_orig_mod", model)
    family = match_family(inner)
    if scope == "block" and not all(s.whole is not None for s in family.find_blocks(inner, "")):
        pytest.skip("the family does not declare scope='block'")
    refused = {t.kind for b in family.blocks for t in b.targets if t.refuse is not None}
    inputs = entry.inputs(batch=2, seed=3)
    plain = _run(model, inputs)
    config = tokenmerge.ToMeConfig(ratio=0.5, merge_crossattn=True, merge_mlp="mlp" not in refused, scope=scope)
    tokenmerge.apply_config(model, config, matcher=permuting_matcher)
    try:
        permuted = _run(model, inputs)
    except ValueError as err:  # a call the family refuses (per-token arguments of a whole-block merge)
        assert "per-token" in str(err) or "would make" in str(err), str(err)
        return
    finally:
        tokenmerge.remove_patch(model)
    scale = plain.abs().max()
    torch.testing.assert_close(permuted / scale, plain / scale, rtol=0, atol=2e-5)
