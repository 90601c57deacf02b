"""The ``--verify crc32c`` block pattern and what a verify pass found.

Every ``bs`` block written carries a 32-byte header (magic, crc32c, its LBA, the verify seed, the
block length) followed by a payload derived from the seed and the LBA; the crc32c covers
everything after the crc field. The read phase checks all of it and reports the lowest-offset bad
block with what was expected and what was found.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

from nvmeof.crc32c import crc32c

VERIFY_MODES = ("crc32c",)
VERIFY_MAGIC = 0x5642564E  # "NVBV" little-endian
VERIFY_HEADER = struct.Struct("<IIQQII")  # magic, crc32c, slba, seed, length, reserved
VERIFY_HEADER_SIZE = VERIFY_HEADER.size   # 32
DEFAULT_VERIFY_SEED = 0x6E766D656F66       # "nvmeof"


def verify_payload(seed: int, slba: int, length: int) -> bytes:
    """The bytes after the header of the block at ``slba``: a function of the seed and the LBA only,
    so a later read-only verify run with the same seed can check it."""
    return random.Random((seed << 64) | slba).randbytes(length)


def fill_verify_block(buf: memoryview, seed: int, slba: int) -> None:
    length = len(buf)
    buf[VERIFY_HEADER_SIZE:] = verify_payload(seed, slba, length - VERIFY_HEADER_SIZE)
    VERIFY_HEADER.pack_into(buf, 0, VERIFY_MAGIC, 0, slba, seed, length, 0)
    crc = crc32c(buf[8:])
    struct.pack_into("<I", buf, 4, crc)


def check_verify_block(buf: memoryview, seed: int, slba: int) -> tuple[str, str, str] | None:
    """None when the block is what fill_verify_block wrote for ``slba``, else (field, expected, actual)."""
    length = len(buf)
    magic, crc, h_slba, h_seed, h_len, _ = VERIFY_HEADER.unpack_from(buf, 0)
    if magic != VERIFY_MAGIC:
        return "magic", f"{VERIFY_MAGIC:#010x}", f"{magic:#010x}"
    if h_slba != slba:
        return "slba", str(slba), str(h_slba)
    if h_seed != seed:
        return "seed", f"{seed:#x}", f"{h_seed:#x}"
    if h_len != length:
        return "length", str(length), str(h_len)
    actual_crc = crc32c(buf[8:])
    if actual_crc != crc:
        return "crc32c", f"{crc:#010x}", f"{actual_crc:#010x}"
    expected = verify_payload(seed, slba, length - VERIFY_HEADER_SIZE)
    got = bytes(buf[VERIFY_HEADER_SIZE:])
    if got != expected:  # right crc but wrong payload: data written with another pattern
        at = next(i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b)
        return (f"payload byte {VERIFY_HEADER_SIZE + at}", expected[at:at + 8].hex(), got[at:at + 8].hex())
    return None


@dataclass
class VerifyError:
    block: int           # index of the bs-sized block within the region
    offset: int          # byte offset on the namespace
    slba: int
    field: str           # magic, slba, seed, length, crc32c, payload, or io
    expected: str
    actual: str

    def describe(self) -> str:
        return (f"verify: bad block {self.block} (offset {self.offset:#x}, LBA {self.slba}): "
                f"{self.field} expected {self.expected}, got {self.actual}")


@dataclass
class VerifyResult:
    blocks: int = 0
    errors: int = 0
    first: VerifyError | None = None

    def add(self, err: VerifyError) -> None:
        self.errors += 1
        if self.first is None or err.offset < self.first.offset:
            self.first = err

    def merge(self, other: VerifyResult) -> None:
        self.blocks += other.blocks
        self.errors += other.errors
        if other.first is not None and (self.first is None or other.first.offset < self.first.offset):
            self.first = other.first
