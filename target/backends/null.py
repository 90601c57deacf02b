"""Null backend: reads return zeros, writes are dropped. For benchmarking the protocol path."""

from __future__ import annotations

from typing import Any

from target.backends.base import Backend, close_fds

# One shared zero buffer serves every read up to this size without allocating.
ZERO_BUFFER_SIZE = 4 << 20
_ZEROS = bytes(ZERO_BUFFER_SIZE)
_ZEROS_VIEW = memoryview(_ZEROS)


class NullBackend(Backend):
    kind = "null"
    can_deallocate = False  # nothing is ever stored, so there is nothing to free

    def __init__(self, size: int, *, read_only: bool = False) -> None:
        self._size = self._positive_size(size)
        self._read_only = read_only

    async def read_into(self, offset: int, buf: memoryview) -> None:
        length = len(buf)
        self._check_range(offset, length)
        pos = 0
        while pos < length:
            chunk = min(length - pos, ZERO_BUFFER_SIZE)
            buf[pos : pos + chunk] = _ZEROS_VIEW[:chunk]
            pos += chunk

    async def read(self, offset: int, length: int) -> memoryview | bytes:
        self._check_range(offset, length)
        if length <= ZERO_BUFFER_SIZE:
            return _ZEROS_VIEW[:length]
        return bytes(length)

    async def write(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> None:
        self._check_write_range(offset, len(data))

    async def flush(self) -> None:
        return None

    async def write_zeroes(self, offset: int, length: int) -> None:
        self._check_write_range(offset, length)

    async def discard(self, offset: int, length: int) -> None:
        self._check_write_range(offset, length)

    async def resize(self, new_size: int) -> None:
        self._size = self._positive_size(new_size, "new size")

    def close(self) -> None:
        return None

    def describe_for_worker(self) -> tuple[dict[str, Any], list[int]]:
        return self.describe(), []   # a worker makes its own: there is nothing to share

    @classmethod
    def attach(cls, description: dict[str, Any], fds: list[int]) -> NullBackend:
        close_fds(fds)
        return cls(description["size"], read_only=bool(description["read_only"]))

    def follow_resize(self, size: int) -> None:
        self._size = self._positive_size(size, "new size")
