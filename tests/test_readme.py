"""The README and the documentation site stay true to the code: the support table is the registry's (families as
data: made by docs/hooks.py when the site is built), the README stays a short guide whose links resolve, and every
page of the site's navigation exists (``bash scripts/docs.sh`` builds the site itself with ``--strict``)."""

import importlib.util
import re
from pathlib import Path

import pytest

from tokenmerge.families import BUILTIN, REFUSED, support_table

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_support_page_is_made_from_the_registry():
    page = (ROOT / "docs" / "support.md").read_text(encoding="utf-8")
    assert "<!-- families:table -->" in page
    table = _hooks().support_page_table()
    rows = table.split("\n")
    assert len(rows) == 2 + len(BUILTIN) + len(REFUSED) == len(support_table().split("\n"))
    assert [r.replace("\\|", "|") for r in rows] == support_table().split("\n")
    # a cell's "[text | image]" must not split the Markdown row: every row has the header's six cells
    assert {len(re.findall(r"(?<!\\)\|", r)) for r in rows} == {7}


def test_the_results_index_lists_every_table():
    index = _hooks().results_index()
    tables = sorted((ROOT / "benchmarks" / "results").rglob("*.md"))
    assert len(tables) > 10
    assert all(f"]({t.relative_to(ROOT).as_posix()})" in index for t in tables)


def test_the_readme_is_a_short_guide():
    assert len(README.encode("utf-8")) <= 12_500
    for heading in ("## GPU quick start", "## The speed you can expect", "## tokenmerge and tomesd"):
        assert heading in README
    # the setting that reproduces tomesd, as the parity tests pass it
    assert "match_radius=None, use_rand=False, share_plans=False" in README
    # the first screen shows the call we recommend, tomesd's just below it
    first = "\n".join(README.splitlines()[:40])
    assert "tokenmerge.accelerate(pipe)" in first and first.index("accelerate(pipe)") < first.index("apply_patch(")


def test_the_readme_commands_and_links():
    assert "bash scripts/setup.sh demo && .venv/bin/tokenmerge demo" in README
    assert "bash scripts/test.sh" in README
    links = re.findall(r"\]\(([^)#\s]+)\)", README)
    local = [link for link in links if "://" not in link]
    assert local, "the README links its documentation pages"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == []


def test_the_readme_layout_matches_the_tree():
    block = README[README.index("## Layout"):]
    block = block[block.index("```") + 3: block.index("```", block.index("```") + 3)]
    families = {p.stem for p in (ROOT / "src" / "tokenmerge" / "families").glob("*.py")} - {"__init__"}
    assert {name for name in families if not re.search(rf"\b{name}\b", block)} == set()
    for folder in ("families", "engine", "merge", "tools", "bench", "quality", "fashion", "cli"):
        assert (ROOT / "src" / "tokenmerge" / folder).is_dir() and f"{folder}/" in block
    for script in re.findall(r"\b([\w*]+\.(?:py|sh))\b", block):
        if "*" not in script:
            assert list(ROOT.rglob(script)), script


@pytest.mark.parametrize("page", re.findall(r":\s+([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
def test_every_page_of_the_site_exists(page):
    assert (ROOT / "docs" / page).is_file()
