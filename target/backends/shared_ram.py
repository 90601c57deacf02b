"""RAM disk in a memfd, mapped MAP_SHARED by the main process and every worker process.

`nvmeof serve --workers N` serves I/O queues from worker processes, which must see the same RAM
disk. The main process turns each RAM namespace into one of these (``from_ram``, which copies the
data once) and passes the memfd to each worker over its control socket (``attach``).

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

from target.backends.base import Backend, BackendError
from target.backends.file import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, fallocate

_PAGE = mmap.PAGESIZE
_COPY_CHUNK = 1 << 20


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


class SharedRamBackend(Backend):
    kind = "ram"   # to the namespace, the host and the configuration it is a RAM disk like any other
    can_deallocate = True

    def __init__(self, fd: int, size: int, *, read_only: bool = False, owner: bool = True) -> None:
        """Take ownership of ``fd`` (a memfd at least ``size`` bytes long) and map it."""
        if not isinstance(size, int) or size <= 0:
            os.close(fd)
            raise BackendError(f"shared ram backend: size must be a positive number of bytes, got {size!r}")
        try:
            self._map = _map(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._view = memoryview(self._map)
        self._fd = fd
        self._size = size
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
    def from_ram(cls, ram: Backend) -> SharedRamBackend:
        """A shared copy of a private RAM disk; only chunks holding data are copied (and allocated)."""
        shared = cls.create(ram.size, read_only=ram.read_only)
        src = memoryview(ram._map)  # type: ignore[attr-defined]
        try:
            zero = bytes(_COPY_CHUNK)
            for start in range(0, ram.size, _COPY_CHUNK):
                end = min(start + _COPY_CHUNK, ram.size)
                if src[start:end] != zero[: end - start]:
                    shared._view[start:end] = src[start:end]
        finally:
            src.release()
        return shared

    @classmethod
    def attach(cls, fd: int, size: int, *, read_only: bool = False) -> SharedRamBackend:
        """A worker's mapping of the owner's memfd (takes ownership of this copy of the descriptor)."""
        return cls(fd, size, read_only=read_only, owner=False)

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def size(self) -> int:
        return self._size

    @property
    def read_only(self) -> bool:
        return self._read_only

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("ram backend is closed (its namespace was removed)")

    async def read_into(self, offset: int, buf: memoryview) -> None:
        self._check_open()
        self._check_range(offset, len(buf))
        buf[:] = self._view[offset : offset + len(buf)]

    async def read(self, offset: int, length: int) -> memoryview:
        self._check_open()
        self._check_range(offset, length)
        return self._view[offset : offset + length]

    async def write(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> None:
        self._check_open()
        self._check_writable()
        self._check_range(offset, len(data))
        self._view[offset : offset + len(data)] = data

    async def flush(self) -> None:
        self._check_open()

    async def write_zeroes(self, offset: int, length: int) -> None:
        self._check_open()
        self._check_writable()
        self._check_range(offset, length)
        self._zero(offset, length)

    async def discard(self, offset: int, length: int) -> None:
        await self.write_zeroes(offset, length)

    def _zero(self, offset: int, length: int) -> None:
        end = offset + length
        first_page = -(-offset // _PAGE) * _PAGE
        last_page = end // _PAGE * _PAGE
        if last_page > first_page:
            self._fill_zero(offset, first_page)
            _punch(self._fd, first_page, last_page - first_page)
            self._fill_zero(last_page, end)
        else:
            self._fill_zero(offset, end)

    def _fill_zero(self, start: int, end: int) -> None:
        while start < end:
            chunk = min(end - start, _COPY_CHUNK)
            self._view[start : start + chunk] = bytes(chunk)
            start += chunk

    async def resize(self, new_size: int) -> None:
        self._check_open()
        if not isinstance(new_size, int) or new_size <= 0:
            raise BackendError(f"ram backend: new size must be a positive number of bytes, got {new_size!r}")
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
        self._remap(new_size)

    def remap(self, size: int) -> None:
        """Worker side: present ``size`` bytes after the owner resized the RAM disk."""
        self._check_open()
        if size != self._size:
            self._remap(size)

    def _remap(self, size: int) -> None:
        new_map = _map(self._fd, size)
        # Views handed out by earlier reads keep the old mapping alive until they are released.
        old_view = self._view
        self._map, self._view, self._size = new_map, memoryview(new_map), size
        old_view.release()

    def set_read_only(self, read_only: bool) -> None:
        self._read_only = read_only

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._view.release()
        try:
            self._map.close()
        except BufferError:
            pass   # a transport still holds a read view; the mapping goes when that view is dropped
        fd, self._fd = self._fd, -1
        os.close(fd)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "size": self._size, "read_only": self._read_only}
