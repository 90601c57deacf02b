"""RAM disk backend on one anonymous mapping.

Anonymous memory costs nothing until written, so a 1 GiB RAM disk that holds little data holds
little memory; discard and write zeroes hand whole pages back to the kernel with MADV_DONTNEED
(a private anonymous page reads as zeros afterwards).
"""

from __future__ import annotations

import mmap

from target.backends.base import Backend, BackendError

_PAGE = mmap.PAGESIZE
_COPY_CHUNK = 1 << 20


def _new_map(size: int) -> mmap.mmap:
    try:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError, ValueError) as exc:
        raise BackendError(f"ram backend: cannot allocate {size} bytes of memory: {exc}") from exc


class RamBackend(Backend):
    kind = "ram"

    def __init__(self, size: int, *, read_only: bool = False) -> None:
        self._size = self._positive_size(size)
        self._read_only = read_only
        self._map = _new_map(size)
        self._view = memoryview(self._map)
        self._closed = False

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
        self._check_open()
        self._check_write_range(offset, length)
        self._zero(offset, length)

    def _zero(self, offset: int, length: int) -> None:
        end = offset + length
        first_page = -(-offset // _PAGE) * _PAGE
        last_page = end // _PAGE * _PAGE
        if last_page > first_page:
            self._fill_zero(offset, first_page)
            self._map.madvise(mmap.MADV_DONTNEED, first_page, last_page - first_page)
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
        self._positive_size(new_size, "new size")
        if new_size == self._size:
            return
        old_map, old_view = self._map, self._view
        new_map = _new_map(new_size)
        new_view = memoryview(new_map)
        keep = min(self._size, new_size)
        # Copy only chunks holding data, so untouched pages stay unallocated in the new map.
        zero = bytes(_COPY_CHUNK)
        for start in range(0, keep, _COPY_CHUNK):
            end = min(start + _COPY_CHUNK, keep)
            # Slicing the mmap compares with memcmp; a memoryview comparison walks item by item.
            if old_map[start:end] != zero[: end - start]:
                new_view[start:end] = old_view[start:end]
        # Views handed out by earlier reads keep the old map alive until they are released.
        self._map, self._view, self._size = new_map, new_view, new_size
        old_view.release()
        del old_map

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
