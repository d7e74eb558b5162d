"""Where handles from the network may point: the ``trusted_roots`` a consumer configures.

A handle read from a network queue was written by whoever can write to that queue. A consumer
loads it only if it names a file under one of its trusted directories, or an object under one of
its trusted ``proto://bucket/prefix`` roots; with no roots configured, every such handle is
refused, with an error that names the setting (a Redis consumer then raises it and leaves the entry
in the stream: a misconfiguration loses nothing). Handles the consumer's own code makes (lists,
``StorageQueue``, ``loader.load(handle)``) and those a directory or prefix source makes from its
own listing are not network handles: they are confined by construction.

Paths are checked as the kernel will resolve them: the directory part through ``realpath``
(symbolic links and ``..`` included, relative paths from this process's working directory), the
file name as it is (files are opened without following a link, see ``_format.open_storage``).
Object keys may not hold empty, ``.`` or ``..`` segments, a query or a fragment.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any, NamedTuple

from ..errors import UntrustedStorageError

__all__ = ["Roots", "check_file", "check_object", "object_roots", "roots"]

SETTING = "trusted_roots"
MAX_PATH_CHARS = 4096


class Roots(NamedTuple):
    """Validated roots: absolute directories, and ``(protocol, bucket, key prefix)`` triples."""

    dirs: tuple[str, ...] = ()
    prefixes: tuple[tuple[str, str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.dirs or self.prefixes)

    def __or__(self, other: Roots) -> Roots:
        return Roots(tuple(dict.fromkeys(self.dirs + other.dirs)), tuple(dict.fromkeys(self.prefixes + other.prefixes)))

    def urls(self) -> list[str]:
        """The object-store roots as ``proto://bucket/prefix`` URLs."""
        return [f"{p}://{b}/{k}".rstrip("/") for p, b, k in self.prefixes]

    def describe(self) -> str:
        shown = list(self.dirs) + self.urls()
        return ", ".join(repr(r) for r in shown) if shown else "none"


def roots(value: Any, *, setting: str = SETTING) -> Roots:
    """Validate a ``trusted_roots=`` argument: None, or an iterable of absolute directories (str or
    ``os.PathLike``) and ``proto://bucket[/prefix]`` URLs. Raises ``ValueError`` naming ``setting``."""
    if value is None:
        return Roots()
    if isinstance(value, Roots):
        return value
    if isinstance(value, (str, bytes, os.PathLike)):
        raise ValueError(
            f"{setting}= takes a list of directories and s3://bucket/prefix URLs, got one "
            f"{type(value).__name__}: write {setting}=[{os.fspath(value)!r}]"
        )
    dirs, prefixes = [], []
    for item in value:
        if not isinstance(item, (str, os.PathLike)):
            raise ValueError(f"{setting}= holds a {type(item).__name__}; give directories and URLs as strings")
        item = os.fspath(item)
        if "://" in item and not item.startswith("file://"):
            proto, rest = item.split("://", 1)
            bucket, _, key = rest.partition("/")
            key = key.strip("/")
            if not proto or not bucket or not _clean_key(key, allow_empty=True):
                raise ValueError(
                    f"{setting}= holds {item!r}: object-store roots are proto://bucket or "
                    "proto://bucket/prefix (no '.', '..' or empty segments)"
                )
            prefixes.append((proto, bucket, key))
            continue
        path = item[len("file://") :] if item.startswith("file://") else item
        if not os.path.isabs(path):
            raise ValueError(f"{setting}= holds {item!r}, a relative path: give absolute directories")
        dirs.append(os.path.normpath(path))
    return Roots(tuple(dict.fromkeys(dirs)), tuple(dict.fromkeys(prefixes)))


@functools.lru_cache(maxsize=256)
def _real(directory: str) -> str:
    return os.path.realpath(directory)


def _refuse(what: str, path: str, roots_: Roots, why: str) -> UntrustedStorageError:
    shown = path if len(path) <= 300 else path[:300] + "..."
    return UntrustedStorageError(
        f"a network handle names {what} {shown!r}, which {why}; this consumer trusts {roots_.describe()}. "
        f"Pass {SETTING}=[...] (directories and s3://bucket/prefix URLs the producers write under) to the "
        "RedisStorageQueue or StorageDataset if its producers are yours",
        path=shown,
    )


def check_file(path: str, roots_: Roots) -> None:
    """Raise ``UntrustedStorageError`` unless ``path`` resolves to a file under a trusted directory."""
    if not roots_.dirs:
        raise _refuse("the file", path, roots_, "no trusted directory holds")
    if not path or len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise _refuse("the file", path, roots_, "is not a path")
    name = os.path.basename(path)
    if name in ("", ".", ".."):
        raise _refuse("the file", path, roots_, "does not end with a file name")
    try:
        real = os.path.join(os.path.realpath(os.path.dirname(path) or "."), name)
    except (OSError, ValueError):
        raise _refuse("the file", path, roots_, "cannot be resolved") from None
    for root in roots_.dirs:
        top = _real(root)
        if real.startswith(top.rstrip("/") + "/"):
            return
    raise _refuse("the file", path, roots_, f"resolves to {real!r}, outside every trusted directory")


def check_object(url: str, roots_: Roots) -> None:
    """Raise ``UntrustedStorageError`` unless ``url`` is an object under a trusted ``proto://bucket/prefix``."""
    if not roots_.prefixes:
        raise _refuse("the object", url, roots_, "no trusted bucket holds")
    if len(url) > MAX_PATH_CHARS or "://" not in url or any(c in url for c in "?#\x00"):
        raise _refuse("the object", url, roots_, "is not a plain object URL")
    proto, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    if not _clean_key(key):
        raise _refuse("the object", url, roots_, "has an empty, '.' or '..' segment in its key")
    for p, b, prefix in roots_.prefixes:
        if p == proto and b == bucket and (not prefix or key.startswith(prefix + "/")):
            return
    raise _refuse("the object", url, roots_, "lies outside every trusted prefix")


def _clean_key(key: str, allow_empty: bool = False) -> bool:
    if not key:
        return allow_empty
    return all(seg not in ("", ".", "..") for seg in key.split("/")) and not any(c in key for c in "?#\x00\\")


def object_roots(values: Iterable[Roots]) -> list[str]:
    """The bucket URLs (``proto://bucket``) of the object-store roots among ``values``."""
    out = []
    for r in values:
        out += [f"{p}://{b}" for p, b, _ in r.prefixes]
    return list(dict.fromkeys(out))
