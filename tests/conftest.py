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


# ---- the CUDA lane (tests marked ``cuda``; tests/test_cuda_lane.py) --------------------------------------------
# TOKENMERGE_LANE_DEVICE picks the lane's device: unset, the first CUDA device; "cuda:N"; or "cpu", which runs the
# lane's test bodies on the CPU as a self-check of their logic (the CUDA-only checks, such as CUDA graphs and the
# CUDA sync debug mode, skip themselves there). Without CUDA and without "cpu", every ``cuda`` test is skipped
# with the reason, so CI on a CPU stays green.
LANE_ENV = "TOKENMERGE_LANE_DEVICE"


def lane_device_name() -> str | None:
    """The lane's device as a string, or None when the lane cannot run here."""
    import os

    wanted = os.environ.get(LANE_ENV, "").strip()
    if wanted == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        return None
    return wanted or "cuda"


def pytest_collection_modifyitems(config, items):
    if lane_device_name() is not None:
        return
    skip = pytest.mark.skip(reason=f"no CUDA device here (the CUDA lane; {LANE_ENV}=cpu runs its logic on the "
                                   "CPU as a self-check)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def lane_device():
    """The CUDA lane's device (``torch.device``); see ``lane_device_name``."""
    name = lane_device_name()
    if name is None:  # pragma: no cover - collection skipped these already
        pytest.skip("no CUDA device here")
    return torch.device(name)
