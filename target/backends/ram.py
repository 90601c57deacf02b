"""RAM disk backend on one anonymous mapping.

Anonymous memory costs nothing until written, so a 1 GiB RAM disk that holds little data holds
little memory; discard and write zeroes hand whole pages back to the kernel with MADV_DONTNEED
(a private anonymous page reads as zeros afterwards).

``MappedRam`` holds the I/O of a RAM disk on any mapping; the shared (memfd) RAM disk of
``--workers`` derives from it too and differs only in how it maps, frees pages, resizes and closes.
"""

from __future__ import annotations

import mmap
from abc import abstractmethod
from typing import Any

from target.backends.base import Backend, BackendError

_PAGE = mmap.PAGESIZE
_COPY_CHUNK = 1 << 20


def _new_map(size: int) -> mmap.mmap:
    try:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError, ValueError) as exc:
        raise BackendError(f"ram backend: cannot allocate {size} bytes of memory: {exc}") from exc


class MappedRam(Backend):
    """A RAM disk whose bytes are one mapping; a subclass supplies the mapping and frees pages."""

    kind = "ram"
    same_data_in_every_process = False   # each gateway of a group would serve its own disk

    _map: mmap.mmap
    _view: memoryview
    _closed: bool

    def _set_map(self, new_map: mmap.mmap, size: int) -> None:
        """Present ``new_map`` as the disk's ``size`` bytes."""
        # Views handed out by earlier reads keep the old mapping alive until they are released.
        old_view = getattr(self, "_view", None)
        self._map, self._view, self._size = new_map, memoryview(new_map), size
        if old_view is not None:
            old_view.release()

    @abstractmethod
    def _free_pages(self, offset: int, length: int) -> None:
        """Hand back whole pages ``offset``..``offset+length`` (page aligned); they read as zeros."""

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
        # A live view, not a copy: the transport sends it straight from the RAM disk.
        return self._view[offset : offset + length]

    def memory_view(self) -> memoryview | None:
        """The whole disk as one view (None once closed), for a caller that checked the range itself
        against ``size`` and slices it (the batch engine's reads: one slice, no call per command).
        Valid until the next resize or close; the caller drops its slices when it has sent them."""
        return None if self._closed else self._view

    def read_nowait(self, offset: int, length: int) -> memoryview:
        # Memory never waits: the batch engine (target/transports/tcp_batch.py) runs reads inline and
        # sends this view of the disk itself.
        self._check_open()
        self._check_range(offset, length)
        return self._view[offset : offset + length]

    def write_nowait(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> bool:
        self._check_open()
        self._check_write_range(offset, len(data))
        self._view[offset : offset + len(data)] = data
        return True

    async def write(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> None:
        self._check_open()
        self._check_write_range(offset, len(data))
        self._view[offset : offset + len(data)] = data

    async def flush(self) -> None:
        self._check_open()

    async def write_zeroes(self, offset: int, length: int) -> None:
        self._check_open()
        self._check_write_range(offset, length)
        self._zero(offset, length)

    async def discard(self, offset: int, length: int) -> None:
        await self.write_zeroes(offset, length)

    def _zero(self, offset: int, length: int) -> None:
        end = offset + length
        first_page = -(-offset // _PAGE) * _PAGE
        last_page = end // _PAGE * _PAGE
        if last_page > first_page:
            self._fill_zero(offset, first_page)
            self._free_pages(first_page, last_page - first_page)
            self._fill_zero(last_page, end)
        else:
            self._fill_zero(offset, end)

    def _fill_zero(self, start: int, end: int) -> None:
        while start < end:
            chunk = min(end - start, _COPY_CHUNK)
            self._view[start : start + chunk] = bytes(chunk)
            start += chunk

    def _copy_data_to(self, dst: memoryview, length: int) -> None:
        """Copy the first ``length`` bytes into ``dst``, skipping all-zero chunks so the pages
        behind them stay unallocated in ``dst``."""
        zero = bytes(_COPY_CHUNK)
        for start in range(0, length, _COPY_CHUNK):
            end = min(start + _COPY_CHUNK, length)
            # Slicing the mmap compares with memcmp; a memoryview comparison walks item by item.
            if self._map[start:end] != zero[: end - start]:
                dst[start:end] = self._view[start:end]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._view.release()
        try:
            self._map.close()
        except BufferError:
            # A transport still holds a read view; the mapping goes when that view is dropped.
            pass


class RamBackend(MappedRam):
    def __init__(self, size: int, *, read_only: bool = False) -> None:
        self._read_only = read_only
        self._set_map(_new_map(self._positive_size(size)), size)
        self._closed = False

    def _free_pages(self, offset: int, length: int) -> None:
        self._map.madvise(mmap.MADV_DONTNEED, offset, length)

    def for_workers(self) -> Backend:
        """A shared copy in a memfd: a private mapping is invisible to worker processes."""
        from target.backends.shared_ram import SharedRamBackend  # it builds on this module

        return SharedRamBackend.from_ram(self)

    @classmethod
    def attach(cls, description: dict[str, Any], fds: list[int]) -> Backend:
        """A worker serves a RAM disk from the main process's memfd (what ``for_workers`` made)."""
        from target.backends.shared_ram import SharedRamBackend

        return SharedRamBackend.attach(description, fds)

    async def resize(self, new_size: int) -> None:
        self._check_open()
        self._positive_size(new_size, "new size")
        if new_size == self._size:
            return
        new_map = _new_map(new_size)
        new_view = memoryview(new_map)
        try:
            self._copy_data_to(new_view, min(self._size, new_size))
        finally:
            new_view.release()
        self._set_map(new_map, new_size)
