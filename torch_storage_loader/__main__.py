"""Command line: ``python -m torch_storage_loader demo`` (also the ``torch-storage-loader`` script)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torch-storage-loader", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .demo import add_arguments

    add_arguments(sub.add_parser("demo", help="collectors save trajectories, a trainer loads them"))
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
