"""Namespace storage backends and the one registry of their kinds.

``BACKENDS`` maps a namespace's ``backend`` setting to its class. The class opens itself from the
namespace's settings (``Backend.open``) and, for ``serve --workers``, describes itself to a worker
process and attaches there from that description (``describe_for_worker`` / ``attach``). The class
also owns its kind's rules: which settings are valid (``validate_spec``), which namespaces would share
storage (``storage_key``) and its part of the operator's policy (``policy_class``, composed here into
StoragePolicy), so ``open_backend``, the management service and the worker hand-off (target/workers.py,
target/worker.py) name no kind. A new backend is one module plus one line here (``register_backend``,
with the settings it takes as target.fields.Field declarations); one that needs an optional package is
registered as ``"module:Class"`` and imported the first time it is used.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from target.backends.base import Backend, BackendError, BackendSpec, close_fds
from target.backends.file import BackingError, BackingPolicy, FileBackend
from target.backends.null import NullBackend
from target.backends.ram import RamBackend
from target.backends.rbd_options import OPTIONS as RBD_OPTIONS
from target.fields import Field, SchemaError

BACKENDS: dict[str, type[Backend] | str] = {}
# Settings only one kind takes (BackendSpec.options), named as the configuration file, REST and the CLI
# name them, each declared as a target.fields.Field (JSON type, length bounds, description, secret): the
# configuration file's check, the REST body and ``validate_spec`` all use these declarations. Declared with
# the kind, so they are known before a lazily registered class is imported.
BACKEND_OPTIONS: dict[str, dict[str, Field]] = {}


def register_backend(kind: str, cls: type[Backend] | str, options: Mapping[str, Field] | None = None) -> None:
    """Add a backend kind: its class, or ``"module:Class"`` to import when first used, and the
    settings (BackendSpec.options) only it takes, by name. A name another kind declares too is one field of
    the file and the REST body, so it must be declared alike."""
    if kind in BACKENDS:
        raise ValueError(f"backend kind {kind!r} is already registered")
    fields = option_fields()
    for name, field in (options or {}).items():
        if name in fields and fields[name] != field:
            raise ValueError(f"backend kind {kind!r} declares setting {name!r} unlike another kind does")
    BACKENDS[kind] = cls
    if options:
        BACKEND_OPTIONS[kind] = dict(options)


def option_fields() -> dict[str, Field]:
    """Every registered kind's settings by name (a namespace entry's fields besides target/schema.py's)."""
    return {name: field for fields in BACKEND_OPTIONS.values() for name, field in fields.items()}


register_backend("file", FileBackend)
register_backend("ram", RamBackend)
register_backend("null", NullBackend)
register_backend("rbd", "target.backends.rbd:RbdBackend",   # librbd from Debian's python3-rbd, loaded when used
                 options=RBD_OPTIONS)
KINDS = tuple(BACKENDS)   # the kinds shipped here, for option lists; ``kinds()`` includes later registrations
OPTION_KEYS = tuple(option_fields())

__all__ = [
    "BACKENDS", "BACKEND_OPTIONS", "KINDS", "OPTION_KEYS", "Backend", "BackendError", "BackendSpec", "BackingError",
    "BackingPolicy", "FileBackend", "NullBackend", "RamBackend", "StoragePolicy", "attach_backend", "backend_class",
    "kinds", "open_backend", "option_fields", "register_backend", "spec_of", "storage_key", "validate_spec",
]


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


class StoragePolicy:
    """The operator's fences for every kind that has one (where file namespaces may live, which Ceph
    files an RBD namespace may name), composed from the backend classes' ``policy_class``: each kind's
    ``validate_spec`` and ``open`` get their own ``part``. A setting (``backing_dirs``, ``ceph_confs``,
    ...: a policy class's ``settings``) goes to the policy that takes it."""

    def __init__(self, parts: Mapping[str, Any]) -> None:
        self._parts = dict(parts)

    @classmethod
    def from_settings(cls, **settings: Any) -> StoragePolicy:
        """Each registered kind's policy from the settings it takes (the ones not given: its defaults);
        BackingError (a BackendError) if one is unusable, TypeError for a setting no kind takes."""
        classes = {}
        for kind in BACKENDS:
            try:
                policy_class = backend_class(kind).policy_class
            except BackendError:   # a kind whose package is missing fences nothing
                continue
            if policy_class is not None:
                classes[kind] = policy_class
        unknown = set(settings) - {name for policy_class in classes.values() for name in policy_class.settings}
        if unknown:
            raise TypeError(f"no backend takes the policy setting(s) {', '.join(sorted(unknown))}")
        return cls({kind: policy_class(**_mine(policy_class, settings)) for kind, policy_class in classes.items()})

    def part(self, kind: str) -> Any:
        """The policy of backend ``kind`` (None: it has none)."""
        return self._parts.get(kind)

    def widened(self, **entries: Iterable[str]) -> StoragePolicy:
        """A policy allowing these entries too (configuration keys added to the flags)."""
        return StoragePolicy({kind: part.widened(**mine) if (mine := _mine(part, entries)) else part
                              for kind, part in self._parts.items()})

    def widens(self, **entries: Iterable[str]) -> list[str]:
        """The entries that would allow more than this policy does."""
        return list(dict.fromkeys(entry for part in self._parts.values() if (mine := _mine(part, entries))
                                  for entry in part.widens(**mine)))


def _mine(policy: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in settings.items() if key in policy.settings}


def spec_of(entry: Mapping[str, Any]) -> BackendSpec:
    """The BackendSpec of a namespace's configuration entry (``path``, ``size``, the settings of any registered
    kind: ``validate_spec`` refuses those its own kind does not take)."""
    return BackendSpec(entry.get("path"), entry.get("size"), bool(entry.get("read_only", False)),
                       bool(entry.get("create", False)), {key: entry[key] for key in option_fields() if key in entry})


def validate_spec(kind: str, spec: BackendSpec, policy: StoragePolicy | None = None) -> BackendSpec:
    """``spec`` checked for ``kind`` before anything is opened: only the settings the kind takes, each as
    its declaration takes it (``Field.check``: type, length bounds), then the kind's own rules
    (``Backend.validate_spec``). BackendError names what is wrong."""
    cls = backend_class(kind)
    allowed = BACKEND_OPTIONS.get(kind, {})
    unknown = sorted(key for key in spec.options if key not in allowed)
    if unknown:
        takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
        raise BackendError(f"a {kind} namespace has no setting {', '.join(unknown)}; {takes}")
    for key, value in spec.options.items():
        try:
            allowed[key].check(key, value)
        except SchemaError as exc:
            raise BackendError(exc.message) from None
    return cls.validate_spec(dataclasses.replace(spec, options=dict(spec.options)),
                             policy.part(kind) if policy is not None else None)


def storage_key(kind: str, spec: BackendSpec, policy: StoragePolicy | None = None) -> Hashable | None:
    """What names the storage of a namespace entry of ``kind`` (``Backend.storage_key``); None for one that
    shares nothing, or whose kind or settings are unusable (an unrestored entry may be either)."""
    try:
        return backend_class(kind).storage_key(spec, policy.part(kind) if policy is not None else None)
    except (BackendError, TypeError, ValueError):
        return None


def open_backend(
    kind: str,
    *,
    path: str | os.PathLike[str] | None = None,
    size: int | None = None,
    read_only: bool = False,
    create: bool = False,
    policy: StoragePolicy | None = None,
    options: dict[str, Any] | None = None,
) -> Backend:
    """Open a backend; BackendError says which argument was wrong or missing. Its settings are checked
    against its part of ``policy`` when one is given (TargetService always gives its own)."""
    spec = validate_spec(kind, BackendSpec(path, size, read_only, create, dict(options or {})), policy)
    return backend_class(kind).open(spec, policy.part(kind) if policy is not None else None)


def attach_backend(description: dict[str, Any], fds: list[int]) -> Backend:
    """Worker side: the backend another process's ``describe_for_worker`` described (owning ``fds``)."""
    try:
        cls = backend_class(description.get("kind", ""))
    except BackendError:
        close_fds(fds)
        raise
    return cls.attach(description, fds)
