"""Field types shared by the NVMe data structures: 128-bit counters and fixed-size strings.

Each is a `construct` Adapter over a fixed-size `Bytes`, so it has a static `sizeof()` and works
inside compiled structs (the compiler links adapters it cannot inline).
"""

from __future__ import annotations

from typing import Any

from construct import Adapter, Bytes, Construct, IntegerError, StringError, Struct

INT128_MAX = (1 << 128) - 1


class _Int128ulAdapter(Adapter):
    """Unsigned 128-bit little-endian integer (SMART counters, capacities such as TNVMCAP)."""

    def _decode(self, obj: bytes, context: Any, path: str) -> int:
        return int.from_bytes(obj, "little")

    def _encode(self, obj: Any, context: Any, path: str) -> bytes:
        if not isinstance(obj, int) or isinstance(obj, bool):
            raise IntegerError(f"128-bit field needs an int, got {type(obj).__name__} {obj!r}", path=path)
        if not 0 <= obj <= INT128_MAX:
            raise IntegerError(f"value {obj} does not fit an unsigned 128-bit field", path=path)
        return obj.to_bytes(16, "little")


Int128ul = _Int128ulAdapter(Bytes(16))


class SpacePaddedString(Adapter):
    """ASCII text right-padded with spaces (Identify `sn`, `mn`, `fr`; firmware slot revisions).

    The spec restricts these to printable ASCII (20h..7Eh), which is enforced on build. Parsing
    strips trailing spaces and NULs, since some devices pad with NUL. With `zero_if_empty`, an
    empty string builds as all-zero bytes: the firmware slot log marks an empty slot that way.
    """

    def __init__(self, length: int, *, zero_if_empty: bool = False) -> None:
        super().__init__(Bytes(length))
        self.length = length
        self.zero_if_empty = zero_if_empty

    def _decode(self, obj: bytes, context: Any, path: str) -> str:
        # Lenient on parse: a peer's odd serial number must not make its whole Identify page unreadable.
        return obj.rstrip(b" \x00").decode("ascii", "backslashreplace")

    def _encode(self, obj: Any, context: Any, path: str) -> bytes:
        if not isinstance(obj, str):
            raise StringError(f"ASCII field needs a str, got {type(obj).__name__} {obj!r}", path=path)
        bad = next((c for c in obj if not " " <= c <= "~"), None)
        if bad is not None:
            raise StringError(f"{obj!r} contains {bad!r}; only printable ASCII is allowed", path=path)
        if len(obj) > self.length:
            raise StringError(f"{obj!r} is {len(obj)} characters; the field holds {self.length}", path=path)
        if not obj and self.zero_if_empty:
            return bytes(self.length)
        return obj.encode("ascii").ljust(self.length, b" ")


class NqnString(Adapter):
    """UTF-8 text, NUL-terminated and NUL-padded (NQNs such as Identify `subnqn`).

    Parsing stops at the first NUL, so bytes a sloppy peer left after the terminator are ignored.
    Building requires room for the terminator.
    """

    def __init__(self, length: int) -> None:
        super().__init__(Bytes(length))
        self.length = length

    def _decode(self, obj: bytes, context: Any, path: str) -> str:
        return obj.split(b"\x00", 1)[0].decode("utf-8", "backslashreplace")

    def _encode(self, obj: Any, context: Any, path: str) -> bytes:
        if not isinstance(obj, str):
            raise StringError(f"NQN field needs a str, got {type(obj).__name__} {obj!r}", path=path)
        if "\x00" in obj:
            raise StringError(f"{obj!r} contains a NUL character", path=path)
        raw = obj.encode("utf-8")
        if len(raw) > self.length - 1:
            raise StringError(
                f"{obj!r} is {len(raw)} bytes; the field holds {self.length - 1} plus a NUL terminator",
                path=path,
            )
        return raw.ljust(self.length, b"\x00")


def field_offset(struct: Struct, name: str) -> int:
    """Byte offset of the named top-level field of a fixed-size Struct."""
    offset = 0
    sc: Construct
    for sc in struct.subcons:
        if sc.name == name:
            return offset
        offset += sc.sizeof()
    raise KeyError(f"{name!r} is not a field of this struct")
