"""Prompt sets: the Parti prompts (shipped, Apache-2.0, see data/PartiPrompts.LICENSE), the embedded model's
class names, or a user file (one prompt a line, or a TSV with a ``Prompt`` column)."""

from __future__ import annotations

import csv
from itertools import zip_longest
from pathlib import Path

__all__ = ["PARTI", "parti_categories", "load_prompts"]

PARTI = Path(__file__).with_name("data") / "PartiPrompts.tsv"


def _read_tsv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if rows and "Prompt" not in rows[0]:
        raise ValueError(f"{path}: a TSV prompt file needs a 'Prompt' column; it has {list(rows[0])}")
    return rows


def parti_categories() -> list[str]:
    return sorted({row["Category"] for row in _read_tsv(PARTI)})


def _spread(rows: list[dict], count: int | None) -> list[dict]:
    """Take prompts round-robin over categories (in file order), so a few prompts still cover many kinds."""
    if count is None or count >= len(rows):
        return rows
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(row.get("Category", ""), []).append(row)
    order = [row for group in zip_longest(*by_category.values()) for row in group if row is not None]
    return order[:count]


def load_prompts(source: str = "parti", categories: list[str] | None = None, count: int | None = None) -> list[str]:
    """Prompts from ``source``: ``"parti"``, ``"classes"`` (the embedded model's), or a file path.

    Args:
        categories: Parti categories to keep (case-insensitive); an unknown one raises ``ValueError``.
        count: at most this many prompts, spread over the categories.
    """
    if count is not None and count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if source == "classes":
        from ..fashion.model import CLASS_NAMES

        rows = [{"Prompt": name} for name in CLASS_NAMES]
    elif source == "parti":
        rows = _read_tsv(PARTI)
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"prompts must be 'parti', 'classes' or a file of prompts; {source!r} is none of these")
        if path.suffix.lower() == ".tsv":
            rows = _read_tsv(path)
        else:
            rows = [{"Prompt": line.strip()} for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if categories:
        known = {row.get("Category", "").lower(): row.get("Category", "") for row in rows}
        unknown = [c for c in categories if c.lower() not in known]
        if unknown:
            raise ValueError(f"categories {unknown} are not in the prompt set; it has: "
                             f"{', '.join(sorted(v for v in known.values() if v)) or 'no categories'}")
        wanted = {c.lower() for c in categories}
        rows = [row for row in rows if row.get("Category", "").lower() in wanted]
    prompts = [row["Prompt"] for row in _spread(rows, count)]
    if not prompts:
        raise ValueError(f"no prompts in {source!r}")
    return prompts
