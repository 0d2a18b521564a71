"""Conformance compile cases with inductor on the CPU (not only dynamo's ``backend="eager"``).

``tests/test_conformance.py`` compiles every family with the eager backend: that checks the graph dynamo traces
(one graph, our hooks in it), not the kernels inductor generates from it. A bug there (an integer type, a hash
constant, a fused index) fails only when inductor compiles. Inductor takes minutes on a tiny diffusers model on
this project's 2-core CPU, so CI runs it on the smallest patched model, the user-registered toy video DiT (a
3-D grid, ToMe's random windows, local matching; global matching with the slow tests). Measured here, 2 busy
cores: 12 s with inductor's caches warm, about 100 s cold (the first run on a machine). The CUDA lane
(tests/test_cuda_lane.py) compiles every family with inductor on a GPU, where the int32 indices of a CUDA kernel
differ from the CPU's int64 ones.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ToyVideoDiT, toy_video_family, toy_video_inputs

import tokenmerge

pytest.importorskip("torch._inductor")
pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fast_cpu")]


@pytest.fixture
def toy():
    family = tokenmerge.register_family(toy_video_family())
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield ToyVideoDiT().eval()
    torch._dynamo.reset()
    tokenmerge.unregister_family(family.name)


@pytest.mark.slow
# the default (local matching) in every run; global matching (another matcher's kernels) with the slow tests
@pytest.mark.parametrize("options", [{}, pytest.param({"match_radius": None}, marks=pytest.mark.slow)],
                         ids=["local-matching", "global-matching"])
def test_inductor_compiles_the_patched_model_to_its_eager_outputs(toy, options):
    """ToMe with its defaults (random windows, ``use_rand=True``) compiled by inductor, one graph: the eager
    patched outputs, which are merged ones."""
    inputs = toy_video_inputs(batch=2, grid=(3, 4, 6))
    with torch.no_grad():
        plain = toy(**inputs)
        tokenmerge.apply_patch(toy, ratio=0.5, **options)
        try:
            eager = toy(**inputs)
            compiled = torch.compile(toy, fullgraph=True)(**inputs)
        finally:
            tokenmerge.remove_patch(toy)
    assert not torch.allclose(eager, plain), "the patch changed nothing"
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
