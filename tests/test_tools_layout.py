"""The package's layout (issues 20 and 48): no import circle anywhere, layers, no source file above 450 lines
(the tool wing's above 400).

Layers: the core <- tools <- bench, quality (independent of each other) <- cli. Imports are read from the
sources (top-level and inside functions), so a lazy import inside a function counts too: it hides a circle, it
does not remove it.
"""

import ast
from pathlib import Path

import pytest

import tokenmerge

SRC = Path(tokenmerge.__file__).parent
WING = ("tokenmerge.tools", "tokenmerge.bench", "tokenmerge.quality", "tokenmerge.cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The longest module prefix of ``name`` (an imported name may be an attribute of a module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            head = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            found |= {_resolve(f"{head}.{a.name}") or _resolve(head) for a in node.names}
    return found - {None, module}


GRAPH = {m: _imports(m) for m in MODULES}


def _in(module: str, *areas: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in areas)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_imports():
    # function-level imports (``import tokenmerge`` inside ``attach``, the parsers' imports) are edges like any other
    assert "tokenmerge" in GRAPH["tokenmerge.bench.breakdown"]
    assert "tokenmerge.tools.methods" in GRAPH["tokenmerge.cli.bench"]


def test_the_tools_use_the_core_through_its_public_api():
    """The package (``apply_patch``, ``observe``...), the configs, the merge primitives that the zero-overhead
    limits (``tools/limits.py``) and the breakdown's timed pooling are built from, how a generation is measured
    (``measure``: float PSNR, timing) and the tune (its runs, for the command's report)."""
    public = {"tokenmerge", "tokenmerge.config", "tokenmerge.accelerate", "tokenmerge.merge",
              "tokenmerge.merge.downsample", "tokenmerge.merge.plan", "tokenmerge.measure", "tokenmerge.tuning"}
    wrong = {m: sorted(t for t in GRAPH[m] if not _in(t, *WING, "tokenmerge.fashion") and t not in public)
             for m in MODULES if _in(m, *WING)}
    assert {m: t for m, t in wrong.items() if t} == {}


def test_no_import_circle_in_the_whole_package():
    assert len(GRAPH) > 50 and GRAPH["tokenmerge.engine.call"]  # it read the package
    assert _cycles() == []


def test_the_circle_check_finds_a_circle(monkeypatch):
    monkeypatch.setitem(GRAPH, "tokenmerge.merge.plan", GRAPH["tokenmerge.merge.plan"] | {"tokenmerge.engine.call"})
    assert any("tokenmerge.merge.plan" in c and "tokenmerge.engine.call" in c for c in _cycles())


@pytest.mark.parametrize("area, forbidden", [
    ("tokenmerge.quality", ("tokenmerge.bench", "tokenmerge.cli")),
    ("tokenmerge.bench", ("tokenmerge.quality", "tokenmerge.cli")),
    ("tokenmerge.tools", ("tokenmerge.bench", "tokenmerge.quality", "tokenmerge.cli")),
])
def test_layers(area, forbidden):
    wrong = {m: sorted(t for t in GRAPH[m] if _in(t, *forbidden)) for m in MODULES if _in(m, area)}
    assert {m: t for m, t in wrong.items() if t} == {}


def test_the_core_does_not_import_the_tools():
    # ``python -m tokenmerge`` (``__main__``) is the command line's entry point, not the core
    core = [m for m in MODULES if not _in(m, *WING, "tokenmerge.fashion", "tokenmerge.__main__")]
    assert "tokenmerge.api" in core
    wrong = {m: sorted(t for t in GRAPH[m] if _in(t, *WING)) for m in core}
    assert {m: t for m, t in wrong.items() if t} == {}


def test_no_source_file_above_450_lines_and_none_of_the_tool_wing_above_400():
    sizes = {m: len(MODULES[m].read_text(encoding="utf-8").splitlines()) for m in MODULES}
    assert len(sizes) > 50
    assert {m: n for m, n in sizes.items() if n > 450} == {}
    assert {m: n for m, n in sizes.items() if _in(m, *WING) and n > 400} == {}
