"""User text quoted in error messages, capped: a 1 MB prompt line must not come back whole in an error."""

from __future__ import annotations

import re

__all__ = ["LIMIT", "quote", "cap_message", "split_outside"]

LIMIT = 200  # characters of user text an error quotes


def quote(text, limit: int = LIMIT) -> str:
    """``repr(text)`` of at most ``limit`` characters of it, with an ellipsis and the full length when cut.

    Args:
        text: what the user gave (a prompt, a path, an argument); anything else is ``str()``-ed first.
        limit: characters kept.

    Example:
        >>> quote("a" * 1_000_000, 5)
        "'aaaaa…' (1000000 characters)"
    """
    text = text if isinstance(text, str) else str(text)
    if len(text) <= limit:
        return repr(text)
    head = repr(text[:limit])
    return f"{head[:-1]}…{head[-1]} ({len(text)} characters)"


def cap_message(message: str, limit: int = LIMIT, total: int = 2000) -> str:
    """A message whose quoted parts (``'...'`` or ``"..."``) longer than ``limit`` are cut, and the whole kept
    under ``total`` characters: for messages built elsewhere (argparse's, a library's) that quote user text.

    Example:
        >>> cap_message("invalid choice: '" + "x" * 300 + "'", 3)
        "invalid choice: 'xxx…' (300 characters)"
    """
    quoted = re.compile(r"(['\"])([^'\"\n]{%d,})\1" % (limit + 1))
    message = quoted.sub(lambda m: f"{m[1]}{m[2][:limit]}…{m[1]} ({len(m[2])} characters)", message)
    if len(message) > total:
        message = f"{message[: total - 40]}… ({len(message) - total + 40} more characters)"
    return message


def split_outside(text: str, sep: str = ",") -> list[str]:
    """``text`` split at the ``sep`` outside brackets (``todo,downsample=(2,2,2),mode=avg`` has three parts); a
    ``+`` that is an exponent's (``1e+3``) does not split."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth = max(0, depth - 1)
        elif ch == sep and depth == 0 and not (sep == "+" and text[i - 1:i] in ("e", "E")
                                                and text[i - 2:i - 1].isdigit()):
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]
