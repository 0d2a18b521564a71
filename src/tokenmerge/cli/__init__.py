"""The ``tokenmerge`` command line (also ``python -m tokenmerge``)."""

from __future__ import annotations

import sys

from . import bench, demo, quality
from .common import Parser

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="tokenmerge", description="Token merging for diffusion models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(sub)
    bench.add_parser(sub)
    quality.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.run(args, parser) or 0)


if __name__ == "__main__":
    sys.exit(main())
