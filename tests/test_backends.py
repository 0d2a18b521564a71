"""The patch on the user's attention backend (#25): PyTorch SDPA's kernels and diffusers' ``set_attention_backend``.

- SDPA restricted to one kernel (``sdpa_kernel([FLASH_ATTENTION])``: PyTorch raises when a call cannot run on it)
  runs vanilla and every method: the patch never sends attention to another kernel (a strided key, an added mask
  or an unsupported dtype would). On a CPU: the flash and math kernels (the others are CUDA's).
- diffusers' backends that run on a CPU (``native``, ``_native_math``, ``_native_flash``, ``flex``): ToMe in both
  scopes gives what it gives on ``native``, and removal gives the backend's vanilla output bit for bit. ToDo
  inside the attention call and token reuse work inside SDPA's call: on the SDPA backends they give what they give on
  ``native``; ``flex`` (no SDPA call) is refused at apply time, and a backend chosen for the whole process
  (``attention_backend(...)``) at the first call, never halfway through a generation. The CUDA-only backends
  (flash-attn, sage, xformers...) are refused by the same apply-time check (their names are not SDPA's).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny_denoisers import CATALOGUE, available, output_tensor
from tiny_models import later_step

import tokenmerge

pytestmark = pytest.mark.usefixtures("fast_cpu")
MODELS = ("flux", "wan", "pixart")
METHODS = {"tome": lambda m: tokenmerge.apply_patch(m, ratio=0.5),
           "tome-block": lambda m: tokenmerge.apply_patch(m, ratio=0.5, scope="block"),
           "todo": lambda m: tokenmerge.apply_todo(m, downsample=2),
           "reuse": lambda m: tokenmerge.apply_reuse(m, 0.5, warmup=1)}


def _model(name):
    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    return entry.build(), entry.inputs(batch=2)


def _run(model, kw):
    with torch.no_grad():
        return output_tensor(model(**kw))


def _with(model, kw, method):
    """The method's output (token reuse: at its first partial step, after a full one)."""
    METHODS[method](model)
    try:
        if method == "reuse":
            _run(model, kw)
            kw = later_step(model, kw)
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
        # Flux and Wan pool ToDo's keys inside the attention call (PixArt passes them in), and their processors follow
        # the backend (PixArt's calls SDPA whatever the backend: token reuse works there on every backend)
        inside = name != "pixart"
        for method in ("todo", "reuse"):
            if backend == "flex" and inside:  # refused at apply time, with the reason
                with pytest.raises(ValueError, match="attention backend 'flex'"):
                    _with(model, kw, method)
                assert tokenmerge.describe_patch(model) is None
            else:
                torch.testing.assert_close(_with(model, kw, method), reference[method], rtol=1e-4, atol=1e-5)
        assert torch.equal(_run(model, kw), plain) and tokenmerge.describe_patch(model) is None


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_a_process_wide_backend_is_refused_at_the_first_call(name):
    """``attention_backend("flex")`` around the calls (not visible at apply time): token reuse refuses at its first
    call (a full step), with the reason; ToDo at its first call too."""
    model, kw = _model(name)
    try:
        from diffusers.models.attention_dispatch import attention_backend
    except ImportError:
        pytest.skip("this diffusers has no attention_backend")
    for method in ("reuse", "todo"):
        METHODS[method](model)
        try:
            with attention_backend("flex"), pytest.raises(ValueError, match="no scaled_dot_product_attention call"):
                _run(model, kw)
        finally:
            tokenmerge.remove_patch(model)
