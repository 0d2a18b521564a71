"""Z-Image and Lumina-Image 2.0: one unified stream of image and caption tokens (families/unified_stream.py).

The conformance suite runs both (off / on / removed, ToDo, scope="block", a permutation of the image tokens). Here:
the layouts the catalogue's default inputs do not reach: Z-Image's padded image (tokens not a multiple of 32) and
cond + uncond captions of different lengths in one call (a key mask), Lumina2's captions of different lengths
(refused), per-sample latents of different sizes (run unmerged, with a warning), and the patch size chosen per call.
"""

from __future__ import annotations

import pytest
import torch
from tiny_denoisers import CATALOGUE, available, output_tensor
from tiny_models import permuting_matcher, record_plans

import tokenmerge

pytestmark = pytest.mark.usefixtures("fast_cpu")


def _need(name):
    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    return entry, entry.build()


def _run(model, kwargs):
    with torch.no_grad():
        return output_tensor(model(**kwargs))


def _permuted(model, kwargs, scope):
    """The output with a "merge" that only reorders the image tokens (must equal the unpatched output)."""
    config = tokenmerge.ToMeConfig(ratio=0.5, merge_crossattn=True, merge_mlp=True, scope=scope)
    tokenmerge.apply_config(model, config, matcher=permuting_matcher)
    try:
        return _run(model, kwargs)
    finally:
        tokenmerge.remove_patch(model)


def _seen_with_the_patch(model, kw, modules, look):
    """Run ``model`` patched (ToMe 0.5) with ``look`` as a forward pre-hook on ``modules``, registered after the
    patch's hooks so that it sees what the sub-module gets; everything removed after."""
    tokenmerge.apply_patch(model, ratio=0.5)
    handles = [m.register_forward_pre_hook(look, with_kwargs=True) for m in modules]
    try:
        _run(model, kw)
    finally:
        tokenmerge.remove_patch(model)
        for h in handles:
            h.remove()


def _seen_unpatched_then_patched(model, kw, modules, look):
    """Run ``model`` unpatched, then patched (ToMe 0.5), with ``look`` as a forward pre-hook on ``modules`` that
    sees what each gets (after the patch's own hook); everything removed after."""
    handles = [m.register_forward_pre_hook(look, with_kwargs=True) for m in modules]
    try:
        _run(model, kw)
        tokenmerge.apply_patch(model, ratio=0.5)
        for m, h in zip(modules, handles):
            m._forward_pre_hooks.move_to_end(h.id)  # after the merge's hook
        _run(model, kw)
    finally:
        tokenmerge.remove_patch(model)
        for h in handles:
            h.remove()


def _refused_at_the_call(model, kw, match, **patch):
    """Patched with ``patch`` (ToMe 0.5), the call raises a ValueError matching ``match``; removed after."""
    tokenmerge.apply_patch(model, ratio=0.5, **patch)
    try:
        with pytest.raises(ValueError, match=match):
            _run(model, kw)
    finally:
        tokenmerge.remove_patch(model)


def _unmerged_at_the_call(model, kw, match):
    """Patched (ToMe 0.5), the call runs unmerged (the unpatched output, bit for bit) with a warning matching
    ``match``; removed after."""
    plain = _run(model, kw)
    tokenmerge.apply_patch(model, ratio=0.5)
    try:
        with pytest.warns(RuntimeWarning, match=match):
            out = _run(model, kw)
    finally:
        tokenmerge.remove_patch(model)
    assert torch.equal(out, plain)


def _zimage_long_captions():
    """The catalogue's tiny Z-Image with room in its rotary tables for captions padded to 64 tokens."""
    from tiny_denoisers import _ZIMAGE, _cls

    entry, _ = _need("z-image")
    torch.manual_seed(0)
    return entry, _cls("ZImageTransformer2DModel")(**{**_ZIMAGE, "axes_lens": [128, 32, 32]}).eval()


def _zimage_inputs(entry, grid, caption_lengths, seed=0):
    kw = entry.inputs(batch=len(caption_lengths), grid=grid, seed=seed)
    g = torch.Generator().manual_seed(seed + 11)
    kw["cap_feats"] = [torch.randn(n, kw["cap_feats"][0].shape[1], generator=g) for n in caption_lengths]
    return kw


@pytest.mark.parametrize("scope", ["attention", "block"])
@pytest.mark.parametrize("grid,caps", [((3, 5), (7, 7)), ((3, 5), (7, 40)), ((4, 8), (5, 3))])
def test_zimage_padded_image_and_captions_of_different_lengths(grid, caps, scope):
    """(3, 5): 15 image tokens padded to 32 (the padding passes whole, after the image); captions of 7 and 40
    tokens (padded to 32 and 64): the samples' sequences differ in length, so a (B, S) key mask is passed and must
    follow the merge."""
    entry, model = _zimage_long_captions()
    kw = _zimage_inputs(entry, grid, caps)
    plain = _run(model, kw)
    scale = plain.abs().max()
    torch.testing.assert_close(_permuted(model, kw, scope) / scale, plain / scale, rtol=0, atol=2e-5)
    tokenmerge.apply_patch(model, ratio=0.5, scope=scope)
    merged = _run(model, kw)
    tokenmerge.remove_patch(model)
    assert torch.isfinite(merged).all() and not torch.equal(merged, plain)
    assert torch.equal(_run(model, kw), plain)


def test_zimage_todo_pools_image_keys_with_a_key_mask():
    entry, model = _zimage_long_captions()
    kw = _zimage_inputs(entry, (4, 6), (7, 40))
    plain = _run(model, kw)
    tokenmerge.apply_todo(model, downsample=2)
    pooled = _run(model, kw)
    tokenmerge.remove_patch(model)
    assert torch.isfinite(pooled).all() and not torch.equal(pooled, plain)
    tokenmerge.apply_todo(model, downsample=1)  # nothing pooled: the very same output
    same = _run(model, kw)
    tokenmerge.remove_patch(model)
    assert torch.equal(same, plain)


def test_zimage_latents_of_different_sizes_in_one_call_run_unmerged():
    entry, model = _need("z-image")
    kw = entry.inputs(batch=2)
    kw["x"] = [kw["x"][0], torch.randn(kw["x"][0].shape[0], 1, 6, 8)]
    _unmerged_at_the_call(model, kw, "different sizes")


def test_zimage_omni_layout_is_refused_by_name():
    from tokenmerge.engine.grids import GridReader
    from tokenmerge.families.unified_stream import Z_IMAGE

    _, model = _need("z-image")
    reader = GridReader(Z_IMAGE.grid, model)
    with pytest.raises(TypeError, match="Omni"):
        reader.read((), {"x": [[torch.zeros(16, 1, 8, 8)], [torch.zeros(16, 1, 8, 8)]]})
    assert reader.read((), {"x": [torch.zeros(16, 1, 8, 12)] * 3})[0] == (4, 6)
    assert reader.read((), {"x": [torch.zeros(16, 1, 8, 12)], "patch_size": 4})[0] == (2, 3)  # chosen per call


@pytest.mark.parametrize("scope", ["attention", "block"])
def test_lumina2_captions_of_one_length_merge_and_of_different_lengths_are_refused(scope):
    entry, model = _need("lumina2")
    kw = entry.inputs(batch=2)
    kw["encoder_attention_mask"][:, -3:] = False  # padded captions of one valid length: no joint mask
    plain = _run(model, kw)
    scale = plain.abs().max()
    torch.testing.assert_close(_permuted(model, kw, scope) / scale, plain / scale, rtol=0, atol=2e-5)
    kw["encoder_attention_mask"][1, -5:] = False  # sample 1's caption is shorter: its image sits elsewhere
    _refused_at_the_call(model, kw, "differ in length", scope=scope)


def test_lumina2_keys_are_the_merged_tokens():
    """Lumina's attention gets ``encoder_hidden_states=hidden_states``: with the merge, both are the merged tokens
    (the very same tensor), never the merged queries against unmerged keys."""
    entry, model = _need("lumina2")
    kw = entry.inputs(batch=2)
    seen = []

    def look(module, args, kwargs):
        seen.append((kwargs["hidden_states"].shape[1], kwargs["encoder_hidden_states"] is kwargs["hidden_states"]))

    _seen_with_the_patch(model, kw, [layer.attn for layer in (*model.noise_refiner, *model.layers)], look)
    plain_tokens = [16, 16 + kw["encoder_hidden_states"].shape[1]]
    assert len(seen) == len(model.noise_refiner) + len(model.layers)
    assert all(same for _, same in seen)
    assert seen[0][0] < plain_tokens[0] and seen[-1][0] < plain_tokens[1]


def _pairs_matcher(metric, shape, windows, r, offsets=None, radius=None):
    """A real merge that does not look at the tokens: token i goes to slot i // 2 (so the plan is the same for
    any batch, and a sample's output can be compared across batches)."""
    from tokenmerge.merge.plan import MergePlan

    batch, tokens = metric.shape[:2]
    dest = torch.arange(tokens, device=metric.device) // 2
    return MergePlan(dest.expand(batch, -1), int(dest[-1]) + 1)


@pytest.mark.parametrize("scope", ["attention", "block"])
def test_zimage_key_mask_follows_a_real_merge(scope):
    """The short sample of a batch whose sequences differ in length (a key mask hides the batch padding) gives, with
    tokens merged, what it gives alone (no mask): a key mask that did not follow the merge lets it attend to the
    padding (this test fails if the mask's image part is declared on the wrong side)."""
    entry, model = _zimage_long_captions()
    both = _zimage_inputs(entry, (3, 5), (7, 40))
    alone = {**both, "x": both["x"][:1], "cap_feats": both["cap_feats"][:1], "t": both["t"][:1]}
    config = tokenmerge.ToMeConfig(ratio=0.5, merge_mlp=True, scope=scope)
    tokenmerge.apply_config(model, config, matcher=_pairs_matcher)
    try:
        in_batch, by_itself = _run(model, both)[:1], _run(model, alone)
    finally:
        tokenmerge.remove_patch(model)
    assert not torch.equal(by_itself, _run(model, alone))  # the merge changed it
    scale = by_itself.abs().max()
    torch.testing.assert_close(in_batch / scale, by_itself / scale, rtol=0, atol=2e-5)


def test_lumina_next_keys_and_their_rotary_table_are_the_merged_ones():
    """Lumina-Next's self-attention gets the same tokens as queries and keys and the same rotary table twice: with
    the merge, both pairs are the very same merged tensors (never merged queries against whole keys or rows)."""
    entry, model = _need("lumina-next")
    kw = entry.inputs(batch=2)
    seen = []

    def look(module, args, kwargs):
        q, k = kwargs["query_rotary_emb"], kwargs["key_rotary_emb"]
        seen.append((kwargs["hidden_states"].shape[1], kwargs["encoder_hidden_states"] is kwargs["hidden_states"],
                     k is q, q.shape[1], kwargs["attention_mask"].shape[-1]))

    _seen_with_the_patch(model, kw, [layer.attn1 for layer in model.layers], look)
    tokens = kw["hidden_states"].shape[-1] * kw["hidden_states"].shape[-2] // model.config.patch_size ** 2
    assert len(seen) == len(model.layers)
    for n, same_keys, same_rotary, rows, mask in seen:
        assert n < tokens and same_keys and same_rotary and rows == n and mask == n


def _ernie_inputs(entry, lengths, seed=0):
    kw = entry.inputs(batch=len(lengths), seed=seed)
    g = torch.Generator().manual_seed(seed + 5)
    kw["text_bth"] = torch.randn(len(lengths), max(lengths), kw["text_bth"].shape[-1], generator=g)
    kw["text_lens"] = torch.tensor(lengths)
    return kw


@pytest.mark.parametrize("lengths", [(3, 7), (7, 7)])
def test_ernie_text_reaches_the_attention_unchanged(lengths):
    """ERNIE-Image's layers hold [image | caption] sequence-first; its attention gets it batch-first. With the
    merge, the caption rows the attention gets are the unpatched call's, bit for bit, after fewer image rows."""
    entry, model = _need("ernie-image")
    kw = _ernie_inputs(entry, lengths)
    seen = []

    def look(module, args, kwargs):
        seen.append(args[0] if args else kwargs["hidden_states"])

    _seen_unpatched_then_patched(model, kw, [model.layers[0].self_attention], look)
    plain, merged = seen
    text = kw["text_bth"].shape[1]
    assert merged.shape[1] < plain.shape[1]
    assert torch.equal(merged[:, -text:], plain[:, -text:])


def test_ernie_key_mask_follows_a_real_merge():
    """The short-caption sample of a batch (its padding masked) gives, with tokens merged, what it gives alone
    without padding: fails if the mask's image columns are taken on the wrong side."""
    entry, model = _need("ernie-image")
    both = _ernie_inputs(entry, (3, 7))
    alone = {**both, "hidden_states": both["hidden_states"][:1], "timestep": both["timestep"][:1],
             "text_bth": both["text_bth"][:1, :3], "text_lens": both["text_lens"][:1]}
    tokenmerge.apply_config(model, tokenmerge.ToMeConfig(ratio=0.5), matcher=_pairs_matcher)
    try:
        in_batch, by_itself = _run(model, both)[:1], _run(model, alone)
    finally:
        tokenmerge.remove_patch(model)
    assert not torch.equal(by_itself, _run(model, alone))
    scale = by_itself.abs().max()
    torch.testing.assert_close(in_batch / scale, by_itself / scale, rtol=0, atol=2e-5)


def test_ernie_refuses_whole_block_merging_with_the_reason():
    _, model = _need("ernie-image")
    with pytest.raises(ValueError, match="scope='block' is not declared"):
        tokenmerge.apply_patch(model, ratio=0.5, scope="block")
    assert tokenmerge.describe_patch(model) is None


@pytest.mark.parametrize("scope", ["attention", "block"])
def test_omnigen_mask_rows_and_columns_follow_a_real_merge(scope):
    """OmniGen's (B, S, S) mask over [condition | time | image]: condition tokens hidden by it must not reach the
    image, merged or not. Fails if the mask's image rows/columns are taken on the wrong side (the hidden
    columns would move onto other tokens)."""
    entry, model = _need("omnigen")
    kw = entry.inputs(batch=1)
    s = kw["attention_mask"].shape[-1]
    kw["attention_mask"] = torch.ones(1, s, s)
    kw["attention_mask"][:, :, 5:8] = 0  # condition tokens 5..7: hidden from every query
    other = {**kw, "input_ids": kw["input_ids"].clone()}
    other["input_ids"][:, 5:8] = (other["input_ids"][:, 5:8] + 3) % 9 + 1
    assert torch.equal(_run(model, kw), _run(model, other))  # the model itself ignores them
    config = tokenmerge.ToMeConfig(ratio=0.5, merge_mlp=True, scope=scope)
    tokenmerge.apply_config(model, config, matcher=_pairs_matcher)
    try:
        merged, merged_other = _run(model, kw), _run(model, other)
    finally:
        tokenmerge.remove_patch(model)
    assert not torch.equal(merged, _run(model, kw))
    torch.testing.assert_close(merged, merged_other, rtol=0, atol=1e-6)


# ---- Ideogram 4 (families/unified_stream.py): one packed sequence tagged per token -----------------------------
def test_ideogram4_text_and_padding_rows_reach_the_attention_unchanged():
    """[left padding | text | image]: with the image merged, the attention gets the unpatched call's padding and
    text rows bit for bit, then fewer image rows, and a mask and rotary rows of the merged length."""
    entry, model = _need("ideogram4")
    kw = entry.inputs(batch=2)
    before = int((kw["indicator"][0] != 2).sum())
    seen = []

    def look(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        seen.append((x, kwargs["attention_mask"], kwargs["image_rotary_emb"][0]))

    _seen_unpatched_then_patched(model, kw, [model.layers[0].attention], look)
    (plain, _, cos), (merged, mask, merged_cos) = seen
    n = plain.shape[1] - before
    assert merged.shape[1] == before + n // 2
    assert torch.equal(merged[:, :before], plain[:, :before])
    assert mask.shape[-2:] == (merged.shape[1], merged.shape[1]) and merged_cos.shape[1] == merged.shape[1]
    assert torch.equal(merged_cos[:, :before], cos[:, :before])


@pytest.mark.parametrize("scope", ["attention", "block"])
def test_ideogram4_segment_mask_follows_a_real_merge(scope):
    """The left-padded sample of a batch (its padding rows in segment -1, masked from the rest) gives, with tokens
    merged, what its unpadded sequence gives alone: a mask whose image rows/columns were taken on the wrong side
    would let it see the padding."""
    entry, model = _need("ideogram4")
    both = entry.inputs(batch=2)
    pad = int((both["indicator"][0] == 0).sum())
    assert pad > 0
    alone = {k: (v[:1, pad:] if k != "timestep" else v[:1]) for k, v in both.items()}
    config = tokenmerge.ToMeConfig(ratio=0.5, merge_mlp=True, scope=scope)
    tokenmerge.apply_config(model, config, matcher=_pairs_matcher)
    try:
        in_batch, by_itself = _run(model, both)[:1, pad:], _run(model, alone)
    finally:
        tokenmerge.remove_patch(model)
    assert not torch.equal(by_itself, _run(model, alone))
    scale = by_itself.abs().max()
    torch.testing.assert_close(in_batch / scale, by_itself / scale, rtol=0, atol=2e-5)


@pytest.mark.parametrize("layout,message", [("shifted", "different places in the samples"),
                                            ("split", "not one contiguous run")])
def test_ideogram4_image_tags_it_cannot_follow_run_unmerged(layout, message):
    entry, model = _need("ideogram4")
    kw = entry.inputs(batch=2)
    indicator = kw["indicator"].clone()
    if layout == "shifted":  # the second sample's image one token later: no single merge fits both
        indicator[1] = torch.roll(indicator[1], 1)
    else:  # a text token inside the image's run
        indicator[:, -3] = 3
    _unmerged_at_the_call(model, {**kw, "indicator": indicator}, message)


# ---- Bria FIBO 2: [gist | image | edit images] -----------------------------------------------------------------
def _fibo2_inputs(entry, lengths=None, context=()):
    """The catalogue's inputs with text of ``lengths`` (padded to 16 tokens, with a mask) and edit images of the
    latent sizes ``context``."""
    kw = entry.inputs(batch=2 if lengths is None else len(lengths))
    g = torch.Generator().manual_seed(7)
    if lengths is not None:
        b, bundles, _, d = kw["encoder_hidden_states"].shape
        kw["encoder_hidden_states"] = torch.randn(b, bundles, 16, d, generator=g)
        kw["encoder_attention_mask"] = torch.arange(16)[None] < torch.tensor(lengths)[:, None]
    channels = kw["hidden_states"].shape[1]
    kw["context_latents"] = [torch.randn(kw["hidden_states"].shape[0], channels, h, w, generator=g)
                             for h, w in context]
    return kw


@pytest.mark.parametrize("scope", ["attention", "block"])
@pytest.mark.parametrize("context", [(), ((8, 8), (4, 12))])
def test_fibo2_edit_images_pass_whole_and_a_permutation_changes_nothing(scope, context):
    """Edit images (two, of different sizes) add their tokens after the image's in the refiner and the layers:
    counted from ``context_latents`` and passed whole; the rotary rows and the noise mask follow."""
    entry, model = _need("bria-fibo2")
    kw = _fibo2_inputs(entry, context=context)
    plain = _run(model, kw)
    torch.testing.assert_close(_permuted(model, kw, scope), plain, rtol=0, atol=1e-5)
    tokenmerge.apply_patch(model, ratio=0.5, scope=scope)
    recorder = record_plans(model)
    try:
        merged = _run(model, kw)
    finally:
        tokenmerge.remove_patch(model)
    read = [(p.call_grid, p.trailing) for p in recorder.plans if p.path == "layers.0"]
    assert read == [((4, 4), sum(h * w // 4 for h, w in context))]
    assert torch.isfinite(merged).all() and not torch.equal(merged, plain)


def test_fibo2_gist_and_edit_image_rows_reach_the_attention_unchanged():
    """The first refiner block's attention gets the edit image's rows (after the image's), the first layer's the
    gist rows (before it), bit for bit as unpatched, beside fewer image rows."""
    entry, model = _need("bria-fibo2")
    kw = _fibo2_inputs(entry, lengths=(6, 12), context=((8, 8),))  # both prompts: 8 gist tokens, gist first
    modules = (model.noise_refiner[0].attention, model.layers[0].attention)
    seen = {m: [] for m in modules}

    def look(module, args, kwargs):
        seen[module].append(args[0] if args else kwargs["hidden_states"])

    _seen_unpatched_then_patched(model, kw, modules, look)
    (refiner, refiner_merged), (layer, layer_merged) = seen[modules[0]], seen[modules[1]]
    gist, context = 8, 16
    assert refiner_merged.shape[1] == refiner.shape[1] - 8 and layer_merged.shape[1] == layer.shape[1] - 8
    assert torch.equal(refiner_merged[:, -context:], refiner[:, -context:])
    assert torch.equal(layer_merged[:, :gist], layer[:, :gist])


@pytest.mark.parametrize("scope", ["attention", "block"])
def test_fibo2_prompts_with_different_gist_counts_are_refused_with_the_reason(scope):
    entry, model = _need("bria-fibo2")
    kw = _fibo2_inputs(entry, lengths=(4, 16))  # 4 and 8 gist tokens: the gist goes after the image, masked
    _refused_at_the_call(model, kw, "different numbers of gist tokens", scope=scope)


# ---- Qwen-Image 2.1: [text with condition images | target image], block-causal --------------------------------
def _qwen21_inputs(entry, seed=0):
    """One condition image (2x4 latent tokens: 2 VLM slots) spliced into the text after its first 2 tokens, the
    4x4 target last; the second prompt's last 2 text tokens padded (a key mask over the joint sequence)."""
    kw = entry.inputs(batch=2, seed=seed)
    g = torch.Generator().manual_seed(seed + 3)
    b, txt, d = kw["encoder_hidden_states"].shape
    cond_slots, target_slots = 2, 4
    vlm = txt + cond_slots
    img_mask = torch.zeros(b, vlm + target_slots, dtype=torch.bool)
    img_mask[:, 2:2 + cond_slots] = True
    img_mask[:, vlm:] = True
    text_mask = torch.ones(b, vlm, dtype=torch.long)
    text_mask[1, vlm - 2:] = 0
    channels = kw["hidden_states"].shape[-1]
    return {**kw, "encoder_hidden_states": torch.randn(b, vlm, d, generator=g), "encoder_hidden_states_mask": text_mask,
            "hidden_states": torch.randn(b, 4 * cond_slots + 16, channels, generator=g),
            "img_shapes": [[(1, 2, 4), (1, 4, 4)]] * b, "img_mask": img_mask}


def test_qwen21_condition_image_and_padded_text_pass_whole():
    """The target (last) is merged; the condition image's and the text's rows reach the attention bit for bit, and
    a permutation of the target's tokens changes nothing (the rotary rows and the key mask follow)."""
    entry, model = _need("qwen-image-2.1")
    kw = _qwen21_inputs(entry)
    plain = _run(model, kw)
    torch.testing.assert_close(_permuted(model, kw, "attention"), plain, rtol=0, atol=1e-5)
    seen = []
    _seen_unpatched_then_patched(model, kw, [model.transformer_blocks[0].attn],
                                 lambda m, args, kwargs: seen.append((kwargs["hidden_states"], kwargs["key_valid"])))
    (unpatched, _), (merged, key_valid) = seen
    prefix = plain.shape[1] - 16
    assert merged.shape[1] == prefix + 8 and key_valid.shape == (2, prefix + 8)
    assert not bool(key_valid[1, :prefix].all()) and bool(key_valid[:, prefix:].all())
    assert torch.equal(merged[:, :prefix], unpatched[:, :prefix])


def test_qwen21_prefix_kv_cache_with_the_target_merged():
    """The prefix KV cache (extract at the first step, cached after): the target never changes the prefix's keys
    (block-causal), so with the target merged, decoding from the cache gives the prefill's target rows."""
    entry, model = _need("qwen-image-2.1")
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    kw = _qwen21_inputs(entry)
    tokenmerge.apply_patch(model, ratio=0.5)
    try:
        prefill = _run(model, kw)
        cache = QwenImage21KVCache(len(model.transformer_blocks))
        extracted = _run(model, {**kw, "kv_cache": cache, "kv_cache_mode": "extract"})
        decoded = _run(model, {**kw, "kv_cache": cache, "kv_cache_mode": "cached"})
    finally:
        tokenmerge.remove_patch(model)
    assert not torch.equal(prefill, _run(model, kw))
    torch.testing.assert_close(extracted, prefill, rtol=0, atol=1e-6)
    torch.testing.assert_close(decoded[:, -16:], prefill[:, -16:], rtol=1e-5, atol=1e-5)


def test_qwen21_todo_is_refused_with_the_reason():
    _, model = _need("qwen-image-2.1")
    with pytest.raises(ValueError, match="prefix segment"):
        tokenmerge.apply_todo(model, downsample=2)
    assert tokenmerge.describe_patch(model) is None
