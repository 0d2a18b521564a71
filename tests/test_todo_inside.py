"""ToDo inside the attention call (keys and values pooled after the rotary embedding, engine/techniques/todo.py):
exact on a toy joint attention, the key counts every family's attention receives, and a clear error where no SDPA
runs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_denoisers import CATALOGUE, available
from tiny_models import record_plans
from torch import nn
from torch.overrides import TorchFunctionMode

import tokenmerge
from tokenmerge.families import JOINT, MLP, TEXT_BEFORE, Arg, Blocks, Family, LatentGrid, Rotary, Target, has, has_list
from tokenmerge.merge import downsample

pytestmark = pytest.mark.usefixtures("fast_cpu")


class JointAttention(nn.Module):
    """[text, image] joint attention with a rotary table over both, as Flux computes it (SDPA, or by hand)."""

    def __init__(self, dim=16, heads=2, sdpa=True):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.qkv, self.add_qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states=None, image_rotary_emb=None):
        b, n, c = hidden_states.shape
        x = torch.cat([self.add_qkv(encoder_hidden_states), self.qkv(hidden_states)], 1)
        q, k, v = (t.view(b, -1, self.heads, c // self.heads).transpose(1, 2) for t in x.chunk(3, -1))
        cos, sin = image_rotary_emb
        q, k = q * cos + q.roll(1, -1) * sin, k * cos + k.roll(1, -1) * sin
        if self.sdpa:
            o = F.scaled_dot_product_attention(q, k, v)
        else:  # an attention backend that is not SDPA
            o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
        o = self.out(o.transpose(1, 2).reshape(b, -1, c))
        return o[:, encoder_hidden_states.shape[1]:], o[:, :encoder_hidden_states.shape[1]]


class Block(nn.Module):
    def __init__(self, sdpa=True):
        super().__init__()
        self.attn, self.ff = JointAttention(sdpa=sdpa), nn.Linear(16, 16)

    def forward(self, hidden_states, encoder_hidden_states, image_rotary_emb):
        img, txt = self.attn(hidden_states, encoder_hidden_states, image_rotary_emb)
        return hidden_states + img + self.ff(hidden_states), encoder_hidden_states + txt


class ToyJointDiT(nn.Module):
    def __init__(self, sdpa=True):
        super().__init__()
        torch.manual_seed(0)
        self.joint_patchify = nn.Conv2d(4, 16, 1)
        self.joint_blocks = nn.ModuleList([Block(sdpa)])

    def forward(self, latent, text, t):
        x = self.joint_patchify(latent).flatten(2).transpose(1, 2)
        rows = text.shape[1] + x.shape[1]
        angle = torch.arange(rows, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1, 8)[None]
        rotary = (angle.cos(), angle.sin())
        for block in self.joint_blocks:
            x, text = block(x, text, rotary)
        return x


FAMILY = Family("toy-joint", match=has_list("joint_blocks") & has("joint_patchify"), grid=LatentGrid(Arg("latent")),
                timestep=Arg("t"), batch_pattern=True,
                blocks=(Blocks("joint_blocks", (Target("attn", JOINT, rotary=Rotary("image_rotary_emb"),
                                                       keys=TEXT_BEFORE), Target("ff", MLP))),))


@pytest.fixture
def toy_family():
    tokenmerge.register_family(FAMILY)
    yield
    tokenmerge.unregister_family(FAMILY.name)


def _inputs(h=4, w=6):
    g = torch.Generator().manual_seed(0)
    return dict(latent=torch.randn(2, 4, h, w, generator=g), text=torch.randn(2, 3, 16, generator=g),
                t=torch.full((2,), 500.0))


@pytest.mark.parametrize("mode", ["nearest-exact", "avg"])
def test_keys_and_values_are_pooled_after_the_rotary_embedding(toy_family, mode):
    model, inputs = ToyJointDiT(), _inputs()
    text = inputs["text"].shape[1]

    class Reference(TorchFunctionMode):  # what the pooling must give: the image keys/values pooled on the grid
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                q, k, v = args
                pool = [torch.cat([x[:, :, :text], downsample(x[:, :, text:].reshape(-1, 24, 8), (4, 6), (2, 2), mode)
                                   .reshape(2, 2, 6, 8)], 2) for x in (k, v)]
                return func(q, *pool)
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        with Reference():
            expected = model(**inputs)
        tokenmerge.apply_todo(model, downsample=2, mode=mode)
        pooled = model(**inputs)
        tokenmerge.remove_patch(model)
        plain = model(**inputs)
    assert torch.equal(pooled, expected) and not torch.equal(pooled, plain)


def test_an_attention_that_is_not_sdpa_is_an_error(toy_family):
    model = ToyJointDiT(sdpa=False)
    tokenmerge.apply_todo(model, downsample=2)
    with pytest.raises(ValueError, match="found no scaled_dot_product_attention"), torch.no_grad():
        model(**_inputs())
    tokenmerge.remove_patch(model)


def test_query_merging_with_pooling_inside_is_refused(toy_family):
    with pytest.raises(ValueError, match="ratio=0.3 on toy-joint"):
        tokenmerge.apply_todo(ToyJointDiT(), downsample=2, ratio=0.3)


class KeyCounts(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            key = kwargs.get("key", args[1] if len(args) > 1 else None)
            self.seen.append(key.shape[-2])
        return func(*args, **kwargs)


INSIDE = ["wan", "ltx", "flux", "flux-kontext", "sd3.5", "hunyuan-video", "cogvideox-5b", "qwen-image-edit", "flux2",
          "flux2-klein-ref"]


@pytest.mark.parametrize("name", INSIDE)
def test_every_image_key_block_is_pooled_and_nothing_else(name):
    """Each SDPA call either keeps its keys (cross-attention, text-only) or loses exactly N - pooled(N) of them."""
    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    model, inputs = entry.build(), entry.inputs(batch=2)
    counts = []
    for patch in (False, True):
        if patch:
            tokenmerge.apply_todo(model, downsample=2)
            recorder = record_plans(model)
        with torch.no_grad(), KeyCounts() as mode:
            model(**inputs)
        counts.append(mode.seen)
    tokenmerge.remove_patch(model)
    grid = recorder.plans[0].call_grid
    plain, pooled = counts
    n = math.prod(grid)
    kept = math.prod(grid[:-2]) * math.ceil(grid[-2] / 2) * math.ceil(grid[-1] / 2)
    assert len(plain) == len(pooled) and plain != pooled
    assert all(a == b or a - b == n - kept for a, b in zip(plain, pooled)), list(zip(plain, pooled))
