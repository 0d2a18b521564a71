"""MkDocs hooks: the pages made from the code and the tree when the site is built, so they cannot go stale.

- ``support.md``: the support table, made from tokenmerge's family registry (``support_table``).
- ``results.md``: an index of ``benchmarks/results/`` (every table, grouped by folder), and the tables themselves,
  with their figures, published at the paths they have in the repository (``benchmarks/results/...``): a new result
  file shows up at the next build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
_PUBLISHED = (".md", ".png", ".gif")  # what the site shows; the .csv/.jsonl/.json/.log data stay in the repository


def support_page_table() -> str:
    """The registry's support table, with the ``|`` inside cells (``[text | image]``) escaped for Markdown tables."""
    sys.path.insert(0, str(ROOT / "src"))
    from tokenmerge.families import support_table

    rows = support_table().split("\n")
    escape = lambda cell: re.sub(r"\[[^\]]*\]", lambda m: m.group(0).replace("|", "\\|"), cell)  # noqa: E731
    return "\n".join(rows[:2] + [escape(r) for r in rows[2:]])


def _title(path: Path) -> str:
    """A table's title: its first Markdown heading, else its file name."""
    for line in path.read_text(encoding="utf-8").splitlines()[:5]:
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return path.stem


def results_index() -> str:
    """Markdown: every result file under ``benchmarks/results/``, folder by folder, tables linked."""
    out = []
    folders = sorted({p.parent for p in RESULTS.rglob("*") if p.is_file()}, key=lambda d: (d != RESULTS, str(d)))
    for folder in folders:
        rel = folder.relative_to(RESULTS)
        name = "benchmarks/results/" + ("" if rel == Path(".") else f"{rel.as_posix()}/")
        files = sorted(p for p in folder.iterdir() if p.is_file())
        out.append(f"\n### `{name}`\n")
        tables = [p for p in files if p.suffix == ".md"]
        for table in tables:
            link = table.relative_to(ROOT).as_posix()
            data = [p.suffix for p in files if p.stem == table.stem and p.suffix != ".md"]
            extra = f" ({', '.join(data)} beside it)" if data else ""
            out.append(f"- [{_title(table) if table.name != 'README.md' else 'README'}]({link}){extra}")
        stems = {p.stem for p in tables}
        others = [p.name for p in files if p.stem not in stems]
        if others:
            out.append(f"- other files: {', '.join(f'`{n}`' for n in others)}")
    return "\n".join(out) + "\n"


def on_files(files, config):
    """Publish ``benchmarks/results/`` (tables and figures) at its repository path."""
    from mkdocs.structure.files import File  # here: the tests import this module without mkdocs

    for path in sorted(RESULTS.rglob("*")):
        if path.is_file() and path.suffix in _PUBLISHED:
            rel = path.relative_to(ROOT).as_posix()  # benchmarks/results/...
            files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    """Fill the generated parts of ``support.md`` and ``results.md``."""
    if page.file.src_uri == "support.md":
        return markdown.replace("<!-- families:table -->", support_page_table())
    if page.file.src_uri == "results.md":
        return markdown.replace("<!-- results:index -->", "## Every table\n" + results_index())
    return markdown
