"""RAM disk in a memfd, mapped MAP_SHARED by the main process and every worker process.

`nvmeof serve --workers N` serves I/O queues from worker processes, which must see the same RAM
disk. The main process turns each RAM namespace into one of these (``RamBackend.for_workers``, which
copies the data once) and passes the memfd to each worker over its control socket (``attach``).

Two differences from the private RamBackend follow from the pages belonging to a file:
* zeroing whole pages punches a hole in the memfd (MADV_DONTNEED on a shared mapping would only
  drop our mapping of the pages, not zero them);
* the memfd never shrinks: a worker still mapping the old, larger size would get SIGBUS past the
  end of the file, so a shrink punches out the tail (freeing it, and making a later grow read
  zeros there) and only the presented size changes.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

from target.backends.base import BackendError, one_fd
from target.backends.file import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, fallocate
from target.backends.ram import MappedRam, RamBackend


def _map(fd: int, size: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except (OSError, OverflowError, ValueError) as exc:
        raise BackendError(f"shared ram backend: cannot map {size} bytes of shared memory: {exc}") from exc


def _punch(fd: int, offset: int, length: int) -> None:
    try:
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
    except OSError as exc:
        raise BackendError(f"shared ram backend: cannot free memory: {exc.strerror or exc}") from exc


class SharedRamBackend(MappedRam):
    # kind "ram" (from MappedRam): to the namespace, the host and the configuration it is a RAM
    # disk like any other.

    def __init__(self, fd: int, size: int, *, read_only: bool = False, owner: bool = True) -> None:
        """Take ownership of ``fd`` (a memfd at least ``size`` bytes long) and map it."""
        if not isinstance(size, int) or size <= 0:
            os.close(fd)
            raise BackendError(f"shared ram backend: size must be a positive number of bytes, got {size!r}")
        try:
            self._set_map(_map(fd, size), size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._read_only = read_only
        self._owner = owner   # only the owner (the main process) changes the memfd's length
        self._closed = False

    @classmethod
    def create(cls, size: int, *, read_only: bool = False) -> SharedRamBackend:
        try:
            fd = os.memfd_create("nvmeof-ram", os.MFD_CLOEXEC)
        except OSError as exc:
            raise BackendError(f"shared ram backend: cannot create shared memory: {exc.strerror}") from exc
        try:
            os.ftruncate(fd, size)
        except (OSError, OverflowError, ValueError) as exc:
            os.close(fd)
            raise BackendError(f"shared ram backend: cannot size shared memory to {size} bytes: {exc}") from exc
        return cls(fd, size, read_only=read_only)

    @classmethod
    def from_ram(cls, ram: RamBackend) -> SharedRamBackend:
        """A shared copy of a private RAM disk; only chunks holding data are copied (and allocated)."""
        shared = cls.create(ram.size, read_only=ram.read_only)
        ram._copy_data_to(shared._view, ram.size)
        return shared

    def describe_for_worker(self) -> tuple[dict[str, Any], list[int]]:
        return self.describe(), [self._fd]   # kind "ram": RamBackend.attach hands it back to us

    @classmethod
    def attach(cls, description: dict[str, Any], fds: list[int]) -> SharedRamBackend:
        """A worker's mapping of the owner's memfd (takes ownership of this copy of the descriptor)."""
        fd = one_fd(fds, "a RAM namespace")
        return cls(fd, description["size"], read_only=bool(description["read_only"]), owner=False)

    @property
    def fd(self) -> int:
        return self._fd

    def _free_pages(self, offset: int, length: int) -> None:
        _punch(self._fd, offset, length)

    async def resize(self, new_size: int) -> None:
        self._check_open()
        self._positive_size(new_size, "new size")
        if new_size == self._size:
            return
        if not self._owner:
            raise BackendError("shared ram backend: only the main process resizes the RAM disk; workers remap")
        length = os.fstat(self._fd).st_size
        try:
            if new_size > length:
                os.ftruncate(self._fd, new_size)
        except OSError as exc:
            raise BackendError(f"ram backend: cannot grow the shared memory: {exc.strerror or exc}") from exc
        if new_size < self._size:
            _punch(self._fd, new_size, length - new_size)
        self._set_map(_map(self._fd, new_size), new_size)

    def follow_resize(self, size: int) -> None:
        """Worker side: present ``size`` bytes after the owner resized the RAM disk."""
        self._check_open()
        if size != self._size:
            self._set_map(_map(self._fd, size), size)

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        fd, self._fd = self._fd, -1
        os.close(fd)
