"""The storage interface every namespace backend implements.

Offsets and lengths are bytes. Callers (the I/O command set) check LBA ranges first and answer
LBA Out of Range; a backend still refuses anything past its end, so a caller bug cannot read or
write outside the namespace.
"""

from __future__ import annotations

import asyncio
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar


class BackendError(Exception):
    """A backend operation failed; the message names the object and what to do about it."""


class BackendUnavailable(BackendError):
    """The storage could not be reached in time (a Ceph cluster down or an OSD stopped): the same
    command may succeed later, so the host is told to retry (target/io.py answers without DNR)."""


@dataclass(frozen=True)
class BackendSpec:
    """A namespace's backend settings as the configuration gives them (``Backend.open`` reads them)."""

    path: str | os.PathLike[str] | None = None
    size: int | None = None
    read_only: bool = False
    create: bool = False
    # Settings only one kind reads (an RBD namespace's pool and image, ...), checked by that kind's
    # ``open``; the service stores them in the namespace's config entry as given.
    options: Mapping[str, Any] = field(default_factory=dict)


async def close_backends(backends: Iterable[Backend], timeout: float) -> list[Backend]:
    """Close every backend (a stopping daemon or worker) and wait, at most ``timeout`` s in all and with the
    event loop running (an RBD image closes after librbd's last callback), until each has released its
    storage. Returns those that had not."""
    backends = list(backends)
    for backend in backends:
        backend.close()
    deadline = time.monotonic() + timeout
    left = []
    for backend in backends:
        if not await asyncio.to_thread(backend.wait_closed, max(0.0, deadline - time.monotonic())):
            left.append(backend)
    return left


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def one_fd(fds: list[int], what: str) -> int:
    """The one descriptor a worker description arrives with; any other count is refused (closing them)."""
    if len(fds) == 1:
        return fds[0]
    close_fds(fds)
    raise BackendError(f"{what} arrived with {len(fds)} descriptors instead of one")


class Backend(ABC):
    """What every backend shares: its capacity, its read-only flag and the checks on both.

    A subclass sets ``_size`` (bytes, positive) and ``_read_only`` in its constructor; ``resize``
    updates ``_size``.
    """

    kind: str = "abstract"
    # The class of this kind's part of the operator's policy (StoragePolicy in target/backends/__init__.py),
    # or None: a kind with nothing to fence. It declares ``settings`` (its constructor's keyword names),
    # ``widened(**entries)`` and ``widens(**entries)``.
    policy_class: ClassVar[type | None] = None
    # Deallocate frees storage, so the namespace is thin provisioned (Identify Namespace NSFEAT
    # THIN, DLFEAT reads-as-zeros); a backend with nothing to free says False.
    can_deallocate: bool = True

    _size: int
    _read_only: bool

    @property
    def size(self) -> int:
        """Capacity in bytes."""
        return self._size

    @property
    def read_only(self) -> bool:
        return self._read_only

    @abstractmethod
    async def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with ``len(buf)`` bytes starting at ``offset``."""

    @abstractmethod
    async def read(self, offset: int, length: int) -> memoryview | bytes:
        """Return ``length`` bytes at ``offset``; the result stays valid after later writes only
        where the backend says so (RAM returns a live view of its memory)."""

    @abstractmethod
    async def write(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> None:
        """Write ``data`` at ``offset``; with ``fua`` it is durable when this returns."""

    # Synchronous fast paths for a transport that executes commands inline (the batch engine): a
    # backend that can answer without waiting (RAM, a file's page cache) does so here; anything
    # else says "not now" and the caller awaits ``read`` / ``write``, which always complete.

    def read_nowait(self, offset: int, length: int) -> memoryview | bytes | None:
        """``length`` bytes at ``offset`` if they are at hand without waiting, else None (then
        await ``read``). Same range checks and errors as ``read``, and the same lifetime rule: the
        result is the caller's until it drops every reference to it."""
        return None

    def write_nowait(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> bool:
        """Write ``data`` at once if that cannot wait for long, and say so; False: nothing durable
        was promised and the caller awaits ``write`` with the same arguments (which may write
        again what a partial attempt wrote, the same bytes)."""
        return False

    @abstractmethod
    async def flush(self) -> None:
        """Make every completed write durable."""

    @abstractmethod
    async def write_zeroes(self, offset: int, length: int) -> None: ...

    @abstractmethod
    async def discard(self, offset: int, length: int) -> None:
        """Deallocate the range; it reads back as zeros afterwards."""

    @abstractmethod
    async def resize(self, new_size: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def wait_closed(self, timeout: float | None = None) -> bool:
        """After ``close``: block until the storage is released, at most ``timeout`` s; False if it is not yet.
        Closing is immediate here; a backend whose close finishes in the background (RBD) overrides it."""
        return True

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "size": self._size, "read_only": self._read_only}

    # opening, and serving from worker processes (`serve --workers`) --------------------------------
    # A subclass registered in target/backends/__init__.py (BACKENDS) overrides what does not fit it.

    # A kind's own rules (what its settings must be, which storage it names) live here, so that the
    # service, the registry and the configuration code name no kind. ``policy`` is always this kind's
    # own part of the operator's policy (StoragePolicy.part, target/backends/__init__.py), or None.

    @classmethod
    def validate_spec(cls, spec: BackendSpec, policy: Any = None) -> BackendSpec:
        """``spec`` as this kind takes it, checked before anything is opened: BackendError naming what is
        wrong, else the spec to open and store (a file path resolved, ...). This default is for a backend
        made from a size alone (ram, null): no path, nothing to create."""
        if spec.path is not None:
            raise BackendError(f"a {cls.kind} namespace takes no path, only a size (got {os.fspath(spec.path)!r})")
        if spec.create:
            raise BackendError(f"a {cls.kind} namespace has no storage to create; 'create' is for a backend that "
                               "holds user data")
        if spec.size is None:
            raise BackendError(f"a {cls.kind} namespace needs a size in bytes")
        return spec

    @classmethod
    def storage_key(cls, spec: BackendSpec, policy: Any = None) -> Hashable | None:
        """What names the storage ``spec`` (a validated one) serves: two namespaces with equal keys would
        write over each other, so the service refuses the second. None: every namespace has its own."""
        return None

    @classmethod
    def storage_name(cls, spec: BackendSpec) -> str:
        """The storage ``spec`` serves, as messages name it."""
        return f"{cls.kind} storage"

    @classmethod
    def open(cls, spec: BackendSpec, policy: Any = None) -> Backend:
        """Open one from a namespace's settings (``open_backend``). This default is for a backend
        made from a size alone (ram, null)."""
        spec = cls.validate_spec(spec, policy)
        return cls(spec.size, read_only=spec.read_only)  # type: ignore[call-arg]

    def memory_view(self) -> memoryview | None:
        """The backend's whole storage as one writable view of this process's memory (a RAM disk), which a
        transport may send from without a copy; None where the data is not in memory (the default)."""
        return None

    def for_workers(self) -> Backend:
        """The backend to serve once worker processes serve it too: itself, or a copy they can
        share (a private RAM disk moves into a memfd); the caller closes the one it replaces."""
        return self

    def describe_for_worker(self) -> tuple[dict[str, Any], list[int]]:
        """What ``attach`` in a worker process needs: plain values (sent as JSON, ``kind`` among them)
        and descriptors (sent with SCM_RIGHTS; they stay ours, the worker gets copies)."""
        raise BackendError(f"a {self.kind} backend cannot be served by worker processes")

    @classmethod
    def attach(cls, description: dict[str, Any], fds: list[int]) -> Backend:
        """Worker side: serve the backend ``description`` and ``fds`` describe (owning ``fds``)."""
        close_fds(fds)
        raise BackendError(f"a {cls.kind} backend cannot be served by worker processes")

    # user data and identity (file and RBD namespaces) ---------------------------------------------

    # True for a backend whose storage is the user's own (a file, an RBD image): the service opens it
    # with ``create`` and resizes it with ``allow_shrink`` (resize/revert_resize/close_unused as
    # FileBackend has them) instead of treating its size as ours to change.
    holds_user_data: bool = False
    # Every process that opens the same spec serves the same data (a file on storage they all reach, an
    # RBD image, the null device), so the gateways of a group may export it under one NGUID/UUID. A RAM
    # disk is its process's own: two gateways would serve two disks as one and a host switching paths
    # would read the other one's data.
    same_data_in_every_process: bool = True

    def watch_size(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(new_size)`` on the event loop when the storage is resized by someone else
        (an RBD image resized with `rbd resize`); most backends cannot be, and never call it."""
        return None

    def stored_identity(self) -> dict[str, str] | None:
        """The namespace identity (``uuid``, ``nguid``, ``eui64`` as strings) kept with the storage
        itself, so every gateway serving it and every restart shows the same one; may block."""
        return None

    def store_identity(self, ids: dict[str, str]) -> None:
        """Keep ``ids`` with the storage (see ``stored_identity``); a no-op where it cannot; may block."""
        return None

    # Storage that other clients may hold an exclusive lock on (an RBD image): a gateway taking over a dead
    # member's ANA group breaks that member's lock (target/gateway/fencing.py). False: there is none.
    has_exclusive_lock: bool = False

    @property
    def client_blocklisted(self) -> bool:
        """The storage's client was blocklisted (fenced by another gateway) and the backend still sits on it."""
        return False

    def exclusive_lock_owners(self) -> list[dict[str, Any]]:
        """The holders of the storage's exclusive lock: [{"mode": int, "owner": client address}] (blocks)."""
        return []

    def break_exclusive_lock(self, mode: int, owner: str) -> None:
        """Break the lock ``owner`` holds (blocks); the caller decides whose."""
        raise BackendError(f"a {self.kind} backend holds no exclusive lock to break")

    def follow_resize(self, size: int) -> None:
        """Worker side: present ``size`` bytes after the main process resized the backend."""
        raise BackendError(f"a {self.kind} backend cannot follow a resize in a worker process")

    # shared checks -----------------------------------------------------------------------------

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0:
            raise BackendError(f"{self._name()}: negative offset {offset} or length {length}")
        if offset + length > self.size:
            raise BackendError(
                f"{self._name()}: range {offset}+{length} ends past the end ({self.size} bytes)"
            )

    def _check_writable(self) -> None:
        if self.read_only:
            raise BackendError(f"{self._name()} is read-only; writes are refused")

    def _check_write_range(self, offset: int, length: int) -> None:
        self._check_writable()
        self._check_range(offset, length)

    def _positive_size(self, value: Any, what: str = "size") -> int:
        """``value`` if it is a positive number of bytes; else BackendError naming ``what``."""
        if not isinstance(value, int) or value <= 0:
            raise BackendError(f"{self._name()}: {what} must be a positive number of bytes, got {value!r}")
        return value

    def _name(self) -> str:
        return f"{self.kind} backend"
