"""The README's support table is the registry's (families as data: the table cannot drift from the code)."""

from pathlib import Path

from tokenmerge.families import support_table


def test_readme_support_table_matches_the_registry():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    start, end = text.index("<!-- families:start -->\n"), text.index("<!-- families:end -->")
    assert text[start + len("<!-- families:start -->\n"): end].strip() == support_table()
