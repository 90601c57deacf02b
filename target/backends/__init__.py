"""Namespace storage backends and the factory that opens one by kind."""

from __future__ import annotations

import os

from target.backends.base import Backend, BackendError
from target.backends.file import BackingError, BackingPolicy, FileBackend
from target.backends.null import NullBackend
from target.backends.ram import RamBackend

KINDS = ("file", "ram", "null")

__all__ = [
    "KINDS", "Backend", "BackendError", "BackingError", "BackingPolicy", "FileBackend", "NullBackend", "RamBackend",
    "open_backend",
]


def open_backend(
    kind: str,
    *,
    path: str | os.PathLike[str] | None = None,
    size: int | None = None,
    read_only: bool = False,
    create: bool = False,
    policy: BackingPolicy | None = None,
) -> Backend:
    """Open a backend; BackendError says which argument was wrong or missing. A file backend's
    path is checked against ``policy`` when one is given (TargetService always gives its own)."""
    if kind == "file":
        if path is None or os.fspath(path) == "":
            raise BackendError("a file backend needs a path (a regular file or a block device)")
        return FileBackend(path, size=size, create=create, read_only=read_only, policy=policy)
    if kind in ("ram", "null"):
        if path is not None:
            raise BackendError(f"a {kind} backend takes no path (got {os.fspath(path)!r}); give a size")
        if create:
            raise BackendError(f"'create' applies to file backends only, not {kind}")
        if size is None:
            raise BackendError(f"a {kind} backend needs a size in bytes")
        cls = RamBackend if kind == "ram" else NullBackend
        return cls(size, read_only=read_only)
    raise BackendError(f"unknown backend kind {kind!r}; use one of {', '.join(KINDS)}")
