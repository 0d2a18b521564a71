"""torch.compile (inductor, CPU) of patched models: one graph, no breaks caused by our hooks, same results."""

import pytest

import torch

import tokenmerge
from tiny_models import make_unet

pytest.importorskip("torch._inductor")
pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# the default ToMe patch compiles in the conformance suite (test_compile_fullgraph_matches_eager); these add the
# other targets and radius 0 (a minute each: slow) and ToDo
@pytest.mark.parametrize("apply", [
    pytest.param(lambda m: tokenmerge.apply_patch(m, ratio=0.5, merge_crossattn=True, merge_mlp=True),
                 marks=pytest.mark.slow),
    lambda m: tokenmerge.apply_todo(m, downsample=2),
    pytest.param(lambda m: tokenmerge.apply_patch(m, ratio=0.5, match_radius=0), marks=pytest.mark.slow),
], ids=["tome-all-targets", "todo", "tome-local-matching"])
def test_compiled_patched_unet_is_one_graph_and_matches_eager(apply):
    unet = make_unet("sd")
    apply(unet)
    x, t, ctx = torch.randn(2, 4, 16, 12), torch.tensor([500, 500]), torch.randn(2, 8, 32)
    with torch.no_grad():
        eager = unet(x, t, encoder_hidden_states=ctx).sample
        # fullgraph=True: any graph break (a host sync, an untraceable op in our hooks) is an error
        compiled = torch.compile(unet, fullgraph=True)(x, t, encoder_hidden_states=ctx).sample
        tokenmerge.remove_patch(unet)
        plain = unet(x, t, encoder_hidden_states=ctx).sample
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(eager, plain)  # the patch did something in the compiled graph too
