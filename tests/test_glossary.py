"""docs/glossary.md stays in step with the public names: every name ``tokenmerge`` exports is in its table of public
names (and nothing else is), every setting it names is a field of a public config, and the names retired for a
word's second meaning (``reuse_steps``, ``keys="cached"``, ``--cache``) appear only as former names."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import tokenmerge

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "glossary.md").read_text()


def _section(title: str) -> str:
    start = PAGE.index(f"## {title}")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start: end if end > 0 else None]


def test_the_public_names_are_the_exports():
    listed = set(re.findall(r"`(\w+)`", _section("Public names")))
    assert listed == set(tokenmerge.__all__) - {"__version__"}


def test_every_setting_it_names_is_a_field_of_a_public_config():
    configs = [getattr(tokenmerge, n) for n in tokenmerge.__all__ if n.endswith("Config")]
    fields = {f.name for c in configs for f in dataclasses.fields(c)}
    named = set(re.findall(r"`(\w+)=", PAGE)) | set(re.findall(r"`(\w+)`:", PAGE))
    assert named and named <= fields, named - fields


def test_retired_names_appear_only_as_former_names():
    for page in [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]:
        for line in page.read_text().splitlines():
            for old in ("reuse_steps", 'keys="cached"', "keys=cached", "--cache"):
                if old in line:
                    assert "former name" in line, f"{page.name}: {line.strip()}"
    assert "former name" in tokenmerge.apply_patch.__doc__ and "reuse_steps" in tokenmerge.apply_patch.__doc__
