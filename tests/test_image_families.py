"""The image families of 2025-2026 (``tokenmerge.families``: ``cogview``, ``hunyuan_image``, ``dual_stream``; Krea 2,
Ideogram 4 and Qwen-Image 2.1 of ``unified_stream``; ControlNet-XS of ``unet``) lay out their tokens right: a "merge"
that only permutes the image tokens (every other token, rotary row and mask entry where the family says it is) leaves
the model's output unchanged up to rounding, since attention and feed-forwards are equivariant to a permutation of
their tokens when the positions and masks follow them. A wrong text side, rotary axis or mask layout moves text rows
or positions and changes the output by far more than rounding."""

from __future__ import annotations

import pytest
import torch
from tiny_denoisers import CATALOGUE, available, output_tensor

import tokenmerge
from tokenmerge.families import cogview, dual_stream, hunyuan_image, unet, unified_stream

pytestmark = pytest.mark.usefixtures("fast_cpu")

FAMILIES = (cogview.FAMILIES + hunyuan_image.FAMILIES + dual_stream.FAMILIES
            + (unified_stream.KREA2, unified_stream.IDEOGRAM4, unified_stream.QWEN_IMAGE_21, unet.CONTROLNET_XS))
EXAMPLES = [name for family in FAMILIES for name in family.examples]


def _out(model, inputs, entry):
    with torch.no_grad():
        return output_tensor(model(**inputs), entry).clone()


class _IdsModel(torch.nn.Module):
    def forward(self, hidden_states, position_ids, encoder_hidden_states=None, image_cond_ids=None):
        return hidden_states


def _ids(h, w, first=0):
    rows = torch.zeros(h * w, 3)
    rows[:, 0] = first
    rows[:, 1] = torch.arange(h).repeat_interleave(w)
    rows[:, 2] = torch.arange(w).repeat(h)
    return rows


def test_ids_grid_skips_leading_rows_and_counts_references_given_apart():
    from tokenmerge.engine.grids import GridReader
    from tokenmerge.families.spec import Arg, IdsGrid

    source = IdsGrid(Arg("position_ids"), axes=(1, 2), leading=Arg("encoder_hidden_states"),
                     refs=Arg("image_cond_ids"))
    reader = GridReader(source, _IdsModel())
    text = torch.zeros(2, 5, 3, 8)  # (B, L, layers, D): 5 text rows before the image's ids, all zero
    ids = torch.cat([torch.zeros(5, 3), _ids(3, 4), _ids(2, 2, first=1)])  # a reference after the image too
    grid, _, trailing = reader.read((), dict(position_ids=ids, encoder_hidden_states=text))
    assert grid == (3, 4) and trailing == 4
    refs = torch.zeros(6, 4)  # (Nr, 4) ids of 6 reference tokens given in another argument
    grid, _, trailing = reader.read((), dict(position_ids=ids, encoder_hidden_states=text, image_cond_ids=refs))
    assert grid == (3, 4) and trailing == 4 + 6
    from tokenmerge.engine.grids import NoGrid

    with pytest.raises(NoGrid, match="do not form"):  # without skipping the text rows: no grid (the call runs unmerged)
        GridReader(IdsGrid(Arg("position_ids"), axes=(1, 2)), _IdsModel()).read((), dict(position_ids=ids))


def test_shapes_grid_reads_one_shape_per_sample_or_a_list_per_sample():
    from tokenmerge.engine.grids import GridReader
    from tokenmerge.families.spec import Arg, ShapesGrid

    class Model(torch.nn.Module):
        def forward(self, hidden_states, img_shapes):
            return hidden_states

    reader = GridReader(ShapesGrid(Arg("img_shapes"), rank=2), Model())
    assert reader.read((), dict(img_shapes=[(1, 4, 6)] * 3))[::2] == ((4, 6), 0)  # NucleusMoE: one shape a sample
    assert reader.read((), dict(img_shapes=[[(1, 4, 6), (1, 2, 2)]] * 3))[::2] == ((4, 6), 4)  # Qwen edit
    assert reader.read((), dict(img_shapes=(1, 4, 6)))[::2] == ((4, 6), 0)


def test_a_sequence_of_the_image_tokens_alone_has_nothing_beside_them():
    from tokenmerge.engine.call import sides
    from tokenmerge.families.spec import TEXT_BEFORE, TEXT_NONE

    assert sides(16, 16, TEXT_NONE, trailing=8) == (0, 0)  # Flux 3's image-only blocks of a call with references
    assert sides(24, 16, TEXT_NONE, trailing=8) == (0, 8)
    assert sides(30, 16, TEXT_BEFORE, trailing=8) == (6, 8)



@pytest.mark.parametrize("name,reason", [("z-image-controlnet", "control blocks"),
                                         ("kandinsky3-unet", "feature map"),
                                         ("stable-cascade-prior", "feature map"), ("unet-2d", "feature map"),
                                         ("uvit2d", "without a timestep")])
def test_refused_image_models_say_why(name, reason):
    if available(name) is not None:
        pytest.skip(available(name))
    model = CATALOGUE[name].build()
    with pytest.raises(TypeError, match=reason) as err:
        tokenmerge.apply_patch(model, ratio=0.5)
    assert type(model).__name__ in str(err.value) and tokenmerge.describe_patch(model) is None


def test_hidream_called_with_patchified_tokens_is_refused_not_misread():
    if available("hidream") is not None:
        pytest.skip(available("hidream"))
    entry = CATALOGUE["hidream"]
    model, inputs = entry.build(), entry.inputs(batch=2)
    tokenmerge.apply_patch(model, ratio=0.5)
    tokens = inputs["hidden_states"].flatten(2).transpose(1, 2)  # (B, N, C): not the (B, C, H, W) latent
    try:
        with pytest.raises(TypeError, match="latent tensor"), torch.no_grad():
            model(**{**inputs, "hidden_states": tokens})
    finally:
        tokenmerge.remove_patch(model)


def test_a_protein_denoiser_is_refused_with_its_reason():
    import diffusers

    if not hasattr(diffusers, "RFD4ProteinaTransformer"):
        pytest.skip(f"RFD4ProteinaTransformer is not in diffusers {diffusers.__version__}")
    model = diffusers.RFD4ProteinaTransformer(nlayers=1, token_dim=16, nheads=2, dim_cond=8, pair_repr_dim=8)
    with pytest.raises(TypeError, match="no image grid: RFD4-Proteina"):
        tokenmerge.apply_patch(model, ratio=0.5)
    assert tokenmerge.describe_patch(model) is None
