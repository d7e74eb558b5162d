"""Command line of torch_storage_loader (also the torch-storage-loader script).

demo                              collector processes save trajectories, a trainer loads them
clean DIR --older-than SECONDS    delete this library's files in DIR last modified more than
                                  SECONDS ago (left behind once no loader on DIR runs any more)
"""

from __future__ import annotations

import argparse
import os
import sys


def add_clean_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "directory",
        metavar="DIR",
        help="a directory FileStorageLoader saved into, or an object-store "
        "prefix (s3://bucket/prefix; credentials and endpoint from the "
        "environment: AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...)",
    )
    p.add_argument(
        "--older-than",
        type=float,
        required=True,
        metavar="SECONDS",
        help="delete files last modified more than SECONDS ago (temporaries of writes in "
        "progress only after at least 10 minutes)",
    )
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")


def clean(args: argparse.Namespace) -> int:
    from ._stores.clean import expired_files, remove
    from ._stores.objects import is_url

    if args.older_than < 0:
        print(f"torch-storage-loader clean: error: --older-than must be >= 0, got {args.older_than}", file=sys.stderr)
        return 2
    if not is_url(args.directory) and not os.path.isdir(args.directory):
        print(f"torch-storage-loader clean: error: {args.directory!r} is not a directory", file=sys.stderr)
        return 1
    from .errors import StorageError

    count = 0
    try:
        for path in expired_files(args.directory, args.older_than):
            if args.dry_run or remove(path):  # one that vanished meanwhile was someone else's to delete
                print(("would remove " if args.dry_run else "removed ") + path)
                count += 1
    except StorageError as exc:  # an object store that cannot be reached, or refuses the credentials
        print(f"torch-storage-loader clean: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"{'would remove' if args.dry_run else 'removed'} {count} file{'' if count == 1 else 's'} "
        f"older than {args.older_than:g} s from {args.directory}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="torch-storage-loader", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="collectors save trajectories, a trainer loads them")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] != ["clean"]:  # the demo imports torch: `clean` (from cron, say) starts without it
        from .demo import add_arguments

        add_arguments(demo)
    add_clean_arguments(
        sub.add_parser(
            "clean",
            help="delete this library's files in DIR older than --older-than seconds",
            description="Delete the files FileStorageLoader saved in DIR (names *.tsl it made, and "
            "temporaries of writes that died) last modified more than SECONDS ago. Other "
            "files, and files a DirectorySource consumer claimed, are never touched.",
        )
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(args)
    if args.command == "clean":
        return clean(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
