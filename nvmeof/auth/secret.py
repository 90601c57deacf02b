"""DH-HMAC-CHAP secrets in the interchange form ``DHHC-1:NN:<base64(key || crc32_le(key))>:``.

Rules mirror the Linux kernel's drivers/nvme/common/auth.c (nvme_auth_parse_key, nvme_auth_extract_key,
nvme_auth_transform_key) and nvme-cli's ``nvme gen-dhchap-key`` (nvme.c gen_dhchap_key with libnvme's
nvme_gen_dhchap_key):
- NN is the hash the key is transformed with before use: 00 none, 01 SHA-256, 02 SHA-384, 03 SHA-512;
- the key is 32, 48 or 64 bytes, followed by its CRC-32 (IEEE, as zlib computes it) little-endian;
- transformed key = HMAC-H(key, NQN || "NVMe-over-Fabrics") (the host NQN for the host key, the subsystem
  NQN for the controller key); NN = 00 uses the key as it is;
- gen-dhchap-key with NN != 00 writes the transformed random secret, which the user of the string
  transforms once more: ``generate_secret`` does the same so its strings are byte-for-byte nvme-cli's.

A DhchapSecret never shows its key: repr/str name the hash and length only.
"""

from __future__ import annotations

import base64
import binascii
import hmac as _hmac
import os
import re
import zlib
from dataclasses import dataclass, field

from nvmeof.auth.dhchap import HASH_LENGTHS, hmac_digest

SECRET_PREFIX = "DHHC-1:"
KEY_LENGTHS = (32, 48, 64)
TRANSFORM_SUFFIX = b"NVMe-over-Fabrics"
_HMAC_FIELD = re.compile(r"[0-9a-fA-F]{2}")


def transform_key(key: bytes, hmac_id: int, nqn: str) -> bytes:
    """nvme_auth_transform_key: the key itself for hmac_id 0, else HMAC(key, nqn || "NVMe-over-Fabrics")."""
    if hmac_id == 0:
        return bytes(key)
    if hmac_id not in HASH_LENGTHS:
        raise ValueError(f"unknown DH-HMAC-CHAP key transform hash id {hmac_id} (valid: 0 none, 1, 2, 3)")
    return hmac_digest(hmac_id, key, nqn.encode(), TRANSFORM_SUFFIX)


@dataclass(frozen=True, eq=False, repr=False)
class DhchapSecret:
    """One host or controller secret: the raw key and the transform hash id from its ``DHHC-1:NN:`` prefix."""

    key: bytes = field()
    hmac_id: int = 0

    def __post_init__(self) -> None:
        if self.hmac_id not in (0, *HASH_LENGTHS):
            raise ValueError(f"DH-HMAC-CHAP secret hash id {self.hmac_id} is not 0 (none), 1, 2 or 3")
        if len(self.key) not in KEY_LENGTHS:
            raise ValueError(f"DH-HMAC-CHAP key is {len(self.key)} bytes; it must be 32, 48 or 64")

    @classmethod
    def parse(cls, text: str) -> DhchapSecret:
        """Parse ``DHHC-1:NN:base64:`` (trailing ':' optional, surrounding whitespace ignored).

        Errors name what is wrong but never echo the text (it is a secret).
        """
        if not isinstance(text, str):
            raise ValueError(f"DH-HMAC-CHAP secret must be a string, not {type(text).__name__}")
        text = text.strip()
        if not text.startswith(SECRET_PREFIX):
            raise ValueError("DH-HMAC-CHAP secret must start with 'DHHC-1:' (the interchange format version 1, "
                             "as `nvme gen-dhchap-key` writes it)")
        rest = text[len(SECRET_PREFIX):]
        if len(rest) < 3 or rest[2] != ":" or not _HMAC_FIELD.fullmatch(rest[:2]):
            raise ValueError("DH-HMAC-CHAP secret needs a two-digit hash id after 'DHHC-1:' (00, 01, 02 or 03) "
                             "followed by ':'")
        hmac_id = int(rest[:2], 16)
        if hmac_id not in (0, *HASH_LENGTHS):
            raise ValueError(f"DH-HMAC-CHAP secret hash id {rest[:2]} is not 00 (none), 01 (SHA-256), "
                             "02 (SHA-384) or 03 (SHA-512)")
        body = rest[3:]
        if body.endswith(":"):
            body = body[:-1]
        if ":" in body:
            raise ValueError("DH-HMAC-CHAP secret has more than one ':' after the hash id")
        try:
            raw = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("DH-HMAC-CHAP secret key part is not valid base64") from None
        if len(raw) - 4 not in KEY_LENGTHS:
            raise ValueError(f"DH-HMAC-CHAP secret decodes to {len(raw)} bytes; it must be a 32, 48 or 64 byte "
                             "key plus its 4-byte CRC-32 (36, 52 or 68 bytes)")
        key, crc = raw[:-4], int.from_bytes(raw[-4:], "little")
        if zlib.crc32(key) != crc:
            raise ValueError("DH-HMAC-CHAP secret CRC-32 does not match its key (a mistyped or truncated secret)")
        return cls(key=key, hmac_id=hmac_id)

    def format(self) -> str:
        """The interchange form, as nvme-cli prints it (``DHHC-1:%02x:...:``)."""
        return format_secret(self.key, self.hmac_id)

    def transformed(self, nqn: str) -> bytes:
        """The key the HMAC of the response uses: nvme_auth_transform_key(key, nqn)."""
        return transform_key(self.key, self.hmac_id, nqn)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DhchapSecret):
            return NotImplemented
        return self.hmac_id == other.hmac_id and _hmac.compare_digest(self.key, other.key)

    def __hash__(self) -> int:
        return hash((DhchapSecret, self.hmac_id, len(self.key)))

    def __repr__(self) -> str:
        return f"DhchapSecret(hmac={self.hmac_id}, {len(self.key)} bytes)"

    __str__ = __repr__


def format_secret(key: bytes, hmac_id: int) -> str:
    crc = zlib.crc32(key).to_bytes(4, "little")
    return f"{SECRET_PREFIX}{hmac_id:02x}:{base64.b64encode(bytes(key) + crc).decode('ascii')}:"


def generate_secret(*, key_len: int | None = None, hmac_id: int = 0, nqn: str | None = None,
                    secret: bytes | None = None) -> str:
    """A new secret string, as ``nvme gen-dhchap-key [--key-length L] [--hmac N] [--nqn NQN] [--secret HEX]``.

    nvme-cli's rules: hmac 1/2/3 fix the key length to 32/48/64 (another --key-length is refused); without
    --hmac the length defaults to 32; --secret must be exactly that long; the key written for hmac != 0 is
    HMAC(secret, nqn || "NVMe-over-Fabrics") of the (random or given) secret.
    """
    if hmac_id not in (0, *HASH_LENGTHS):
        raise ValueError(f"invalid HMAC identifier {hmac_id} (--hmac: 0 none, 1 SHA-256, 2 SHA-384, 3 SHA-512)")
    if hmac_id:
        want = HASH_LENGTHS[hmac_id]
        if key_len is None:
            key_len = want
        elif key_len != want:
            raise ValueError(f"invalid key length {key_len} for --hmac {hmac_id} (it needs --key-length {want})")
    elif key_len is None:
        key_len = 32
    if key_len not in KEY_LENGTHS:
        raise ValueError(f"invalid key length {key_len} (--key-length: 32, 48 or 64)")
    if secret is None:
        raw = os.urandom(key_len)
    else:
        raw = bytes(secret)
        if len(raw) != key_len:
            raise ValueError(f"--secret is {len(raw)} bytes; the key length is {key_len} (--key-length)")
    if hmac_id:
        if not nqn:
            raise ValueError(f"--hmac {hmac_id} transforms the key with the host NQN: give it (--nqn)")
        raw = transform_key(raw, hmac_id, nqn)
    return format_secret(raw, hmac_id)
