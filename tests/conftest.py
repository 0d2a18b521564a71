"""Tiny random models (seconds on a CPU): diffusers UNets/ControlNets, an LDM-style UNet, pipelines."""

from __future__ import annotations

import pytest
import torch

from tiny_models import (  # noqa: F401  (re-exported fixtures' factories)
    ldm_unet,
    make_controlnet,
    make_sd_pipeline,
    make_unet,
    unet_inputs,
)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def fast_cpu():
    """One intra-op thread and oneDNN off, for the tiny catalogue models (see tiny_denoisers.cpu_fast)."""
    from tiny_denoisers import cpu_fast

    with cpu_fast():
        yield
