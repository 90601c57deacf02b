"""CRC32C (Castagnoli) for NVMe/TCP header and data digests.

The C-accelerated ``crc32c`` package does the work (SSE4.2 / ARMv8 CRC instructions when present);
a Python loop would cost more than the rest of the PDU path together.

Wire form: the Linux host and target store the digest as ``cpu_to_le32(~crc32c(~0, buf, len))``
(drivers/nvme/host/tcp.c ``nvme_tcp_hdgst``), i.e. the standard CRC32C value (initial value and
final XOR of all ones, as this package computes it) written little-endian.
"""

from __future__ import annotations

import struct

from crc32c import crc32c as _crc32c

DIGEST_LENGTH = 4  # NVME_TCP_DIGEST_LENGTH

_pack_le32 = struct.Struct("<I").pack


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """Return the CRC32C of ``data``; pass a previous result as ``value`` to continue it."""
    return _crc32c(data, value)


def digest_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """Return the 4-byte digest of ``data`` exactly as NVMe/TCP puts it on the wire."""
    return _pack_le32(_crc32c(data))
