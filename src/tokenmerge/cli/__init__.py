"""The ``tokenmerge`` command line (also ``python -m tokenmerge``)."""

from __future__ import annotations

import sys

from . import bench, demo, quality, tune
from .common import Parser

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="tokenmerge", description="Faster diffusion, faithfully: caches across steps, token "
                                                   "merging, tuned on your model.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(sub)
    bench.add_parser(sub)
    quality.add_parser(sub)
    tune.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.run(args, parser) or 0)


if __name__ == "__main__":
    sys.exit(main())
