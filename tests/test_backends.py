"""The patch on the user's attention backend (#25): PyTorch SDPA's kernels and diffusers' ``set_attention_backend``.

- SDPA restricted to one kernel (``sdpa_kernel([FLASH_ATTENTION])``: PyTorch raises when a call cannot run on it)
  runs vanilla and every method: the patch never sends attention to another kernel (a strided key, an added mask
  or an unsupported dtype would). On a CPU: the flash and math kernels (the others are CUDA's).
- diffusers' backends that run on a CPU (``native``, ``_native_math``, ``_native_flash``, ``flex``): ToMe in both
  scopes gives what it gives on ``native``, and removal gives the backend's vanilla output bit for bit. ToDo
  inside the attention call pools SDPA's keys: on ``flex`` (no SDPA call) it raises, never runs unpooled.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny_denoisers import CATALOGUE, available, output_tensor

import tokenmerge

pytestmark = pytest.mark.usefixtures("fast_cpu")
MODELS = ("flux", "wan", "pixart")
METHODS = {"tome": lambda m: tokenmerge.apply_patch(m, ratio=0.5),
           "tome-block": lambda m: tokenmerge.apply_patch(m, ratio=0.5, scope="block"),
           "todo": lambda m: tokenmerge.apply_todo(m, downsample=2)}


def _model(name):
    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    return entry.build(), entry.inputs(batch=2)


def _run(model, kw):
    with torch.no_grad():
        return output_tensor(model(**kw))


def _with(model, kw, method):
    METHODS[method](model)
    try:
        return _run(model, kw)
    finally:
        tokenmerge.remove_patch(model)


@pytest.mark.parametrize("kernel", ["FLASH_ATTENTION", "MATH"])
@pytest.mark.parametrize("name", MODELS)
def test_every_method_runs_on_one_sdpa_kernel(name, kernel):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, kw = _model(name)
    with sdpa_kernel([getattr(SDPBackend, kernel)]):
        plain = _run(model, kw)
        for method in METHODS:
            out = _with(model, kw, method)
            assert torch.isfinite(out).all() and not torch.equal(out, plain), method
        assert torch.equal(_run(model, kw), plain)


@contextlib.contextmanager
def _backend(model, name):
    """``model.set_attention_backend(name)``, then the model's and diffusers' global backend restored (diffusers'
    ``reset_attention_backend`` leaves the global one set)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._active_backend
    model.set_attention_backend(name)
    try:
        yield
    finally:
        model.reset_attention_backend()
        _AttentionBackendRegistry.set_active_backend(before)


@pytest.mark.parametrize("backend", ["_native_math", "_native_flash", "flex"])
@pytest.mark.parametrize("name", MODELS)
def test_diffusers_attention_backends(name, backend):
    model, kw = _model(name)
    if not hasattr(model, "set_attention_backend"):
        pytest.skip("this diffusers has no set_attention_backend")
    with _backend(model, "native"):
        reference = {method: _with(model, kw, method) for method in METHODS}
    with _backend(model, backend):
        plain = _run(model, kw)
        for method in ("tome", "tome-block"):
            torch.testing.assert_close(_with(model, kw, method), reference[method], rtol=1e-4, atol=1e-5)
        inside = name != "pixart"  # Flux and Wan pool ToDo's keys inside the attention call; PixArt passes them in
        if backend == "flex" and inside:
            with pytest.raises(ValueError, match="no scaled_dot_product_attention call"):
                _with(model, kw, "todo")
        else:
            torch.testing.assert_close(_with(model, kw, "todo"), reference["todo"], rtol=1e-4, atol=1e-5)
        assert torch.equal(_run(model, kw), plain) and tokenmerge.describe_patch(model) is None
