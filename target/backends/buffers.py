"""Data buffers allocated once and reused, for backends that must copy data (file, block device).

SPDK keeps the data buffers of its requests in a pool (``spdk_mempool``) so no I/O allocates; the
difference here is how a buffer comes back. A read hands its buffer onward as a memoryview (into a
PDU list, a transport's send queue, a ``bytes`` join...) and nobody on that way tells the backend
when the last copy went out. So a buffer is idle again exactly when nothing refers to it any more:
every memoryview of a bytearray keeps one reference to it (through its managed buffer) for as long
as any view exists, and a thread still filling it holds its view too. ``take`` reuses a buffer
whose reference count is back to the pool's own, and allocates a one-off buffer when every pooled
one is still in use; correctness never depends on callers giving anything back.
"""

from __future__ import annotations

import sys


def _idle_refs() -> int:
    """References to a pooled bytearray nobody else holds, counted as ``take`` counts them."""
    bufs = [bytearray(1)]
    buf = bufs[0]
    return sys.getrefcount(buf)


_IDLE_REFS = _idle_refs()
_refs = sys.getrefcount


class BufferPool:
    """Up to ``count`` buffers of ``size`` bytes, made on first use and then reused.

    ``take(length)`` returns a writable memoryview of exactly ``length`` bytes; its contents are
    whatever the buffer last held (the caller fills it). Longer requests, and requests while every
    pooled buffer is in use, get a one-off buffer (counted in ``misses``).
    """

    def __init__(self, size: int, count: int) -> None:
        if size <= 0 or count < 0:
            raise ValueError(f"buffer pool needs a positive size and a count >= 0, got {size} x {count}")
        self.size = size
        self.count = count
        self.misses = 0
        self._bufs: list[bytearray] = []
        self._next = 0

    def take(self, length: int) -> memoryview:
        bufs = self._bufs
        if length <= self.size:
            n = len(bufs)
            # Round robin from the one after the last buffer taken: the oldest one out, most likely idle.
            i = self._next
            for _ in range(n):
                if i >= n:
                    i = 0
                buf = bufs[i]
                i += 1
                if _refs(buf) == _IDLE_REFS:
                    self._next = i
                    return memoryview(buf)[:length]
            if n < self.count:
                buf = bytearray(self.size)
                bufs.append(buf)
                self._next = n + 1
                return memoryview(buf)[:length]
        self.misses += 1
        return memoryview(bytearray(length))

    def __len__(self) -> int:
        """Buffers made so far (idle or not)."""
        return len(self._bufs)
