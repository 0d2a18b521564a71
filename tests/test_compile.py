"""torch.compile of patched models (inductor on the CPU; dynamo alone where inductor's minutes buy nothing
more): one graph, no breaks caused by our hooks, same results."""

import pytest
import torch
from tiny_models import make_unet

import tokenmerge

pytest.importorskip("torch._inductor")
pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# the default ToMe patch compiles in the conformance suite (test_compile_fullgraph_matches_eager); these add the
# other targets and radius 0, and ToDo. Inductor takes a minute a case on a CPU (cold caches): the default run
# traces ToDo with dynamo alone (one graph, the eager backend), the slow tests compile every case with inductor
# (the default run's inductor case is tests/test_inductor_cpu.py's)
_TOME_ALL = lambda m: tokenmerge.apply_patch(m, ratio=0.5, merge_crossattn=True, merge_mlp=True)  # noqa: E731
_TODO = lambda m: tokenmerge.apply_todo(m, downsample=2)  # noqa: E731
_TOME_LOCAL = lambda m: tokenmerge.apply_patch(m, ratio=0.5, match_radius=0)  # noqa: E731


@pytest.mark.parametrize("apply, backend", [
    pytest.param(_TOME_ALL, "inductor", marks=pytest.mark.slow),
    (_TODO, "eager"),
    pytest.param(_TODO, "inductor", marks=pytest.mark.slow),
    pytest.param(_TOME_LOCAL, "inductor", marks=pytest.mark.slow),
], ids=["tome-all-targets", "todo-dynamo", "todo", "tome-local-matching"])
def test_compiled_patched_unet_is_one_graph_and_matches_eager(apply, backend):
    unet = make_unet("sd")
    apply(unet)
    x, t, ctx = torch.randn(2, 4, 16, 12), torch.tensor([500, 500]), torch.randn(2, 8, 32)
    with torch.no_grad():
        eager = unet(x, t, encoder_hidden_states=ctx).sample
        # fullgraph=True: any graph break (a host sync, an untraceable op in our hooks) is an error
        compiled = torch.compile(unet, fullgraph=True, backend=backend)(x, t, encoder_hidden_states=ctx).sample
        tokenmerge.remove_patch(unet)
        plain = unet(x, t, encoder_hidden_states=ctx).sample
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(eager, plain)  # the patch did something in the compiled graph too


_INT32_MAX = 2**31 - 1


def _index_arithmetic_beyond_int32(gm) -> list[str]:
    """The nodes of a dynamo graph that compute, from ``arange`` values and Python ints alone (what inductor
    turns into index arithmetic of a kernel, int32 on CUDA for small tensors), with an int constant outside the
    int32 range: on CUDA such a kernel does not compile ('Scalar ... is out of range for type int32')."""
    import operator

    arithmetic = {operator.add, operator.mul, operator.sub, operator.and_, operator.xor, operator.or_,
                  operator.rshift, operator.lshift, operator.floordiv, operator.mod, torch.add, torch.mul,
                  torch.sub, torch.bitwise_and, torch.bitwise_xor, torch.remainder}
    methods = {"add", "mul", "sub", "__and__", "__xor__", "__rshift__", "__lshift__", "__mul__", "__add__",
               "remainder", "bitwise_and", "bitwise_xor"}
    index_like, found = set(), []
    for node in gm.graph.nodes:
        inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if node.op == "call_function" and node.target is torch.arange:
            index_like.add(node)
        elif ((node.op == "call_function" and node.target in arithmetic) or
              (node.op == "call_method" and node.target in methods)) and inputs and \
                all(a in index_like for a in inputs):
            index_like.add(node)
            if any(isinstance(a, int) and not isinstance(a, bool) and abs(a) > _INT32_MAX for a in node.args):
                found.append(node.format_node())
    return found


def test_no_index_arithmetic_beyond_int32_in_the_compiled_graph():
    """The random destination choice hashes window numbers with 32-bit constants; computed from an ``arange``
    inside the graph, inductor on CUDA made that its int32 kernel index and failed to compile the patched model
    (ToMe's default use_rand=True). The window hashes are now a constant of the graph: no such arithmetic is left
    in it (the scan finds the old ``arange * 0x9E3779B1``)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    unet = make_unet("sd")
    tokenmerge.apply_patch(unet, ratio=0.5)  # use_rand=True, batch 2: random destinations
    x, t, ctx = torch.randn(2, 4, 16, 12), torch.tensor([500, 500]), torch.randn(2, 8, 32)
    compiled = torch.compile(unet, fullgraph=True, backend=record)
    with torch.no_grad():
        for step in (500, 480, 460):  # the steps of a generation: no recompilation after the first
            eager = unet(x, t * 0 + step, encoder_hidden_states=ctx).sample
            torch.testing.assert_close(compiled(x, t * 0 + step, encoder_hidden_states=ctx).sample, eager)
            if step == 500:
                first = len(graphs)
    tokenmerge.remove_patch(unet)
    assert first >= 1 and len(graphs) == first  # (the denoiser's own hooks run as frames of their own: 2 graphs)
    assert [_index_arithmetic_beyond_int32(gm) for gm in graphs] == [[]] * first
