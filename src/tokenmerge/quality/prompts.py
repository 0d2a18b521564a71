"""Prompt sets: the Parti prompts (shipped, Apache-2.0, see data/PartiPrompts.LICENSE), the embedded model's
class names, the mosaic model's sentences, or a user file (one prompt a line, or a TSV with a ``Prompt`` column)."""

from __future__ import annotations

import csv
import io
from itertools import zip_longest
from pathlib import Path

from ..tools.text import quote

__all__ = ["PARTI", "parti_categories", "load_prompts", "load_prompt_items"]

PARTI = Path(__file__).with_name("data") / "PartiPrompts.tsv"
MOSAIC_PROMPTS = 32  # the mosaic model's default prompt count (``fashion.data.mosaic_prompts``, seed 0)


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; ``ValueError`` naming the file and the line of a byte that is not UTF-8."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read the prompt file {quote(str(path))}: {err.strerror or err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{quote(str(path))}, line {line}: not UTF-8 text (byte 0x{data[err.start]:02x}); prompt "
                         "files are UTF-8 text, one prompt a line, or a TSV with a Prompt column") from None


def _read_tsv(path: Path) -> list[dict]:
    """Rows of a TSV file, each with its place in the file under ``"_where"``."""
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""), delimiter="\t")
    rows = []
    try:
        for row in reader:
            rows.append(dict(row, _where=f"line {reader.line_num} of {quote(str(path))}"))
    except csv.Error as err:
        raise ValueError(f"{quote(str(path))}, line {reader.reader.line_num}: not a readable TSV ({err})") from None
    columns = reader.fieldnames or []
    if rows and "Prompt" not in columns:
        shown = ", ".join(quote(c, 40) for c in columns[:10]) + \
            (f" and {len(columns) - 10} more" if len(columns) > 10 else "")
        raise ValueError(f"{quote(str(path))}: a TSV prompt file needs a 'Prompt' column; it has {shown}")
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


def load_prompt_items(source: str = "parti", categories: list[str] | None = None,
                      count: int | None = None) -> list[tuple[str, str]]:
    """``(prompt, where)`` pairs: ``where`` says where the prompt comes from ("line 3 of 'p.txt'"), for
    messages about one prompt. Arguments as ``load_prompts``."""
    if count is not None and count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if source == "classes":
        from ..fashion.model import CLASS_NAMES

        rows = [{"Prompt": name, "_where": f"class name {i}"} for i, name in enumerate(CLASS_NAMES)]
    elif source == "mosaics":
        from ..fashion.data import mosaic_prompts

        rows = [{"Prompt": text, "_where": f"mosaic sentence {i}"}
                for i, text in enumerate(mosaic_prompts(count or MOSAIC_PROMPTS), 1)]
    elif source == "parti":
        rows = [dict(row, _where=f"Parti prompt {i}") for i, row in enumerate(_read_tsv(PARTI), 1)]
    else:
        path = Path(source)
        try:
            is_file = path.is_file()
        except (OSError, ValueError) as err:
            raise ValueError(f"prompts {quote(source)}: cannot read it ({getattr(err, 'strerror', None) or err})") \
                from None
        if not is_file:
            raise ValueError(f"prompts must be 'parti', 'classes', 'mosaics' or a file of prompts; {quote(source)} is "
                             "none of these")
        if path.suffix.lower() == ".tsv":
            rows = _read_tsv(path)
        else:
            lines = _read_text(path).split("\n")
            rows = [{"Prompt": line.strip(), "_where": f"line {n} of {quote(str(path))}"}
                    for n, line in enumerate(lines, 1) if line.strip()]
    rows = [row for row in rows if isinstance(row.get("Prompt"), str) and row["Prompt"].strip()]  # no blank rows
    if categories:
        known = {(row.get("Category") or "").lower(): row.get("Category") or "" for row in rows}
        unknown = [c for c in categories if c.lower() not in known]
        if unknown:
            names = sorted(v for v in known.values() if v)
            has = ", ".join(quote(v, 40) for v in names[:30]) + \
                (f" and {len(names) - 30} more" if len(names) > 30 else "")
            raise ValueError(f"categories {', '.join(quote(c, 40) for c in unknown[:10])} are not in the prompt set; "
                             f"it has: {has or 'no categories'}")
        wanted = {c.lower() for c in categories}
        rows = [row for row in rows if (row.get("Category") or "").lower() in wanted]
    items = [(row["Prompt"], row["_where"]) for row in _spread(rows, count)]
    if not items:
        raise ValueError(f"no prompts in {quote(source)}")
    return items


def load_prompts(source: str = "parti", categories: list[str] | None = None, count: int | None = None) -> list[str]:
    """Prompts from ``source``: ``"parti"``, ``"classes"`` (the embedded model's), ``"mosaics"`` (the mosaic model's
    sentences: ``count`` of them, 32 by default, the same everywhere), or a file path.

    Args:
        categories: Parti categories to keep (case-insensitive); an unknown one raises ``ValueError``.
        count: at most this many prompts, spread over the categories.

    A file that is not UTF-8, a TSV that does not parse, or one without a ``Prompt`` column raises
    ``ValueError`` naming the file (and the line); errors quote at most 200 characters of any user text.

    Example:
        >>> load_prompts("parti", categories=["Vehicles"], count=2)  # doctest: +SKIP
        ['A red bus is driving on the road', ...]
    """
    return [prompt for prompt, _ in load_prompt_items(source, categories, count)]
