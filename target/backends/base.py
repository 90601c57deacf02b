"""The storage interface every namespace backend implements.

Offsets and lengths are bytes. Callers (the I/O command set) check LBA ranges first and answer
LBA Out of Range; a backend still refuses anything past its end, so a caller bug cannot read or
write outside the namespace.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class BackendError(Exception):
    """A backend operation failed; the message names the object and what to do about it."""


class Backend(ABC):
    """What every backend shares: its capacity, its read-only flag and the checks on both.

    A subclass sets ``_size`` (bytes, positive) and ``_read_only`` in its constructor; ``resize``
    updates ``_size``.
    """

    kind: str = "abstract"
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

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "size": self._size, "read_only": self._read_only}

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
