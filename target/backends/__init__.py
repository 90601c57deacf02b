"""Namespace storage backends and the one registry of their kinds.

``BACKENDS`` maps a namespace's ``backend`` setting to its class. The class opens itself from the
namespace's settings (``Backend.open``) and, for ``serve --workers``, describes itself to a worker
process and attaches there from that description (``describe_for_worker`` / ``attach``), so
``open_backend`` and the worker hand-off (target/workers.py, target/worker.py) name no kind. A new
backend is one module plus one line here; one that needs an optional package is registered as
``"module:Class"`` and imported the first time a namespace uses it.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from target.backends.base import Backend, BackendError, BackendSpec, close_fds
from target.backends.file import BackingError, BackingPolicy, FileBackend
from target.backends.null import NullBackend
from target.backends.ram import RamBackend

BACKENDS: dict[str, type[Backend] | str] = {
    "file": FileBackend,
    "ram": RamBackend,
    "null": NullBackend,
    "rbd": "target.backends.rbd:RbdBackend",   # needs Debian's python3-rbd/python3-rados
}
KINDS = tuple(BACKENDS)   # the kinds shipped here, for option lists; ``kinds()`` includes later registrations
# Settings only one kind takes (BackendSpec.options), named as the configuration file, REST and the CLI
# name them; known without importing the kind, so a config file is checked where Ceph is not installed.
BACKEND_OPTIONS: dict[str, tuple[str, ...]] = {
    "rbd": ("pool", "image", "rbd_namespace", "ceph_conf", "ceph_id", "ceph_keyring"),
}
OPTION_KEYS = tuple(dict.fromkeys(key for keys in BACKEND_OPTIONS.values() for key in keys))

__all__ = [
    "BACKENDS", "BACKEND_OPTIONS", "KINDS", "OPTION_KEYS", "Backend", "BackendError", "BackendSpec", "BackingError",
    "BackingPolicy", "FileBackend", "NullBackend", "RamBackend", "attach_backend", "backend_class", "kinds",
    "open_backend", "register_backend",
]


def register_backend(kind: str, cls: type[Backend] | str) -> None:
    """Add a backend kind: its class, or ``"module:Class"`` to import when first used."""
    if kind in BACKENDS:
        raise ValueError(f"backend kind {kind!r} is already registered")
    BACKENDS[kind] = cls


def kinds() -> tuple[str, ...]:
    return tuple(BACKENDS)


def backend_class(kind: str) -> type[Backend]:
    entry = BACKENDS.get(kind)
    if entry is None:
        raise BackendError(f"unknown backend kind {kind!r}; use one of {', '.join(BACKENDS)}")
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        try:
            entry = BACKENDS[kind] = getattr(importlib.import_module(module), name)
        except ImportError as exc:
            raise BackendError(f"the {kind} backend cannot be loaded ({exc}); install what it needs") from exc
    return entry


def open_backend(
    kind: str,
    *,
    path: str | os.PathLike[str] | None = None,
    size: int | None = None,
    read_only: bool = False,
    create: bool = False,
    policy: BackingPolicy | None = None,
    options: dict[str, Any] | None = None,
) -> Backend:
    """Open a backend; BackendError says which argument was wrong or missing. A file backend's
    path is checked against ``policy`` when one is given (TargetService always gives its own)."""
    return backend_class(kind).open(BackendSpec(path, size, read_only, create, dict(options or {})), policy)


def attach_backend(description: dict[str, Any], fds: list[int]) -> Backend:
    """Worker side: the backend another process's ``describe_for_worker`` described (owning ``fds``)."""
    try:
        cls = backend_class(description.get("kind", ""))
    except BackendError:
        close_fds(fds)
        raise
    return cls.attach(description, fds)
