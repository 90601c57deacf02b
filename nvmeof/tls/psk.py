"""NVMe/TCP TLS pre-shared keys (TP 8011 / TP 8018): the interchange format, the retained and TLS PSKs, identities.

Rules mirror libnvme's src/nvme/linux.c (nvme_import_tls_key / nvme_export_tls_key, derive_retained_key,
derive_psk_digest, gen_tls_identity, derive_tls_key, nvme_generate_tls_key_identity) and nvme-cli's
``nvme gen-tls-key`` / ``nvme check-tls-key``; the identity strings are those the kernel's
drivers/nvme/common/keyring.c (nvme_tls_psk_lookup) searches the ``.nvme`` keyring for:

- configured PSK: ``NVMeTLSkey-1:HH:<base64(key || crc32_le(key))>:``, HH the hash the key is transformed with
  (00 none, 01 SHA-256, 02 SHA-384); the key is 32 bytes (00/01) or 48 bytes (00/02);
- retained PSK = HKDF-Expand-Label(HKDF-Extract(0, configured), "HostNQN", hostnqn, len(configured))
  (HH = 00: the configured key itself);
- the cipher hash of the PSK: HH, or for HH = 00 by length (32: SHA-256, 48: SHA-384); it picks the TLS 1.3
  suite (SHA-256: TLS_AES_128_GCM_SHA256, SHA-384: TLS_AES_256_GCM_SHA384);
- identity version 0: ``NVMe0R0C <hostnqn> <subnqn>``; version 1 adds `` <digest>`` where digest =
  base64(HMAC-C(retained, hostnqn " " subnqn " " "NVMe-over-Fabrics"));
- TLS PSK = HKDF-Expand-Label(HKDF-Extract(0, retained), "nvme-tls-psk", context, len(retained)), the context
  being the identity (version 0) or ``0C <digest>`` (version 1).

HKDF-Expand-Label is RFC 8446's: info = uint16 length || uint8 len || "tls13 " label || uint8 len || context.
libnvme before 1.11 wrote info without the length bytes of label and context and the length little-endian
(its *_compat functions, for keys inserted by older nvme-cli): ``compat=True`` gives those values.

A TlsKey never shows its key: repr/str name the hash and the length only; errors never echo key text.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac as _hmac
import os
import re
import zlib
from dataclasses import dataclass, field

KEY_PREFIX = "NVMeTLSkey-1:"
HMAC_NONE = 0
HMAC_SHA256 = 1
HMAC_SHA384 = 2
HASHES = {HMAC_SHA256: hashlib.sha256, HMAC_SHA384: hashlib.sha384}
HASH_LENGTHS = {HMAC_SHA256: 32, HMAC_SHA384: 48}
# the TLS 1.3 cipher suite whose hash is the PSK's (TP 8011: the PSK is bound to that hash)
CIPHER_SUITES = {HMAC_SHA256: "TLS_AES_128_GCM_SHA256", HMAC_SHA384: "TLS_AES_256_GCM_SHA384"}
IDENTITY_VERSIONS = (0, 1)
DIGEST_SEED = b"NVMe-over-Fabrics"
_HMAC_FIELD = re.compile(r"[0-9a-fA-F]{2}")
_IDENTITY = re.compile(r"NVMe([01])([RG])(0[12]) (\S+) (\S+)(?: (\S+))?")


def hkdf_extract(hmac_id: int, ikm: bytes, salt: bytes = b"") -> bytes:
    """RFC 5869 HKDF-Extract; an empty salt is HashLen zero bytes."""
    h = HASHES[hmac_id]
    return _hmac.new(salt or bytes(HASH_LENGTHS[hmac_id]), ikm, h).digest()


def hkdf_expand(hmac_id: int, prk: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 HKDF-Expand."""
    h = HASHES[hmac_id]
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = _hmac.new(prk, block + info + bytes([counter]), h).digest()
        out += block
        counter += 1
    return out[:length]


def hkdf_label(label: str, context: bytes, length: int, *, compat: bool = False) -> bytes:
    """The HkdfLabel of RFC 8446 7.1 ("tls13 " + label), or libnvme's pre-1.11 form with compat=True."""
    full = b"tls13 " + label.encode()
    if compat:
        return length.to_bytes(2, "little") + full + context
    if len(full) > 255 or len(context) > 255:
        raise ValueError("HKDF label or context longer than 255 bytes")
    return length.to_bytes(2, "big") + bytes([len(full)]) + full + bytes([len(context)]) + context


def hkdf_expand_label(hmac_id: int, secret: bytes, label: str, context: bytes, length: int, *,
                      compat: bool = False) -> bytes:
    """HKDF-Expand-Label(HKDF-Extract(0, secret), label, context, length), as TP 8018 applies it."""
    prk = hkdf_extract(hmac_id, secret)
    return hkdf_expand(hmac_id, prk, hkdf_label(label, context, length, compat=compat), length)


@dataclass(frozen=True)
class PskIdentity:
    """A parsed ``NVMe<v><R|G><hh> <hostnqn> <subnqn>[ <digest>]`` identity (keyring.c nvme_tls_psk_lookup)."""

    version: int
    generated: bool
    cipher: int
    hostnqn: str
    subnqn: str
    digest: str | None = None

    @classmethod
    def parse(cls, text: str | bytes) -> PskIdentity:
        if isinstance(text, bytes):
            try:
                text = text.decode("ascii")
            except UnicodeDecodeError:
                raise ValueError("PSK identity is not ASCII") from None
        m = _IDENTITY.fullmatch(text)
        if m is None:
            raise ValueError(f"PSK identity {text[:64]!r} is not 'NVMe<0|1>R<01|02> <hostnqn> <subnqn>[ <digest>]'")
        version, kind, cipher, hostnqn, subnqn, digest = m.groups()
        if (version == "1") != (digest is not None):
            raise ValueError(f"PSK identity version {version} {'needs' if version == '1' else 'takes no'} digest")
        return cls(int(version), kind == "G", int(cipher), hostnqn, subnqn, digest)

    def __str__(self) -> str:
        text = f"NVMe{self.version}{'G' if self.generated else 'R'}{self.cipher:02d} {self.hostnqn} {self.subnqn}"
        return f"{text} {self.digest}" if self.digest is not None else text


@dataclass(frozen=True, eq=False, repr=False)
class TlsKey:
    """One configured PSK: the raw key and the transform hash id from its ``NVMeTLSkey-1:HH:`` prefix."""

    key: bytes = field()
    hmac_id: int = HMAC_NONE

    def __post_init__(self) -> None:
        if self.hmac_id not in (HMAC_NONE, HMAC_SHA256, HMAC_SHA384):
            raise ValueError(f"TLS PSK hash id {self.hmac_id} is not 0 (none), 1 (SHA-256) or 2 (SHA-384)")
        want = (32, 48) if self.hmac_id == HMAC_NONE else (HASH_LENGTHS[self.hmac_id],)
        if len(self.key) not in want:
            raise ValueError(f"TLS PSK is {len(self.key)} bytes; hash id {self.hmac_id:02d} needs "
                             f"{' or '.join(map(str, want))}")

    @classmethod
    def parse(cls, text: str) -> TlsKey:
        """Parse ``NVMeTLSkey-1:HH:base64:`` (nvme_import_tls_key). Errors never echo the text."""
        if not isinstance(text, str):
            raise ValueError(f"TLS PSK must be a string, not {type(text).__name__}")
        text = text.strip()
        if not text.startswith(KEY_PREFIX):
            raise ValueError("TLS PSK must start with 'NVMeTLSkey-1:' (the PSK interchange format, as "
                             "`nvme gen-tls-key` writes it)")
        rest = text[len(KEY_PREFIX):]
        if len(rest) < 3 or rest[2] != ":" or not _HMAC_FIELD.fullmatch(rest[:2]):
            raise ValueError("TLS PSK needs a two-digit hash id after 'NVMeTLSkey-1:' (00, 01 or 02) followed by ':'")
        hmac_id = int(rest[:2], 16)
        if hmac_id not in (HMAC_NONE, HMAC_SHA256, HMAC_SHA384):
            raise ValueError(f"TLS PSK hash id {rest[:2]} is not 00 (none), 01 (SHA-256) or 02 (SHA-384)")
        body = rest[3:]
        if not body.endswith(":"):
            raise ValueError("TLS PSK must end with ':'")
        body = body[:-1]
        if ":" in body:
            raise ValueError("TLS PSK has more than one ':' after the hash id")
        try:
            raw = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("TLS PSK key part is not valid base64") from None
        if len(raw) - 4 not in (32, 48):
            raise ValueError(f"TLS PSK decodes to {len(raw)} bytes; it must be a 32 or 48 byte key plus its "
                             "4-byte CRC-32 (36 or 52 bytes)")
        key, crc = raw[:-4], int.from_bytes(raw[-4:], "little")
        if zlib.crc32(key) != crc:
            raise ValueError("TLS PSK CRC-32 does not match its key (a mistyped or truncated key)")
        return cls(key=key, hmac_id=hmac_id)

    def format(self) -> str:
        """The interchange form (nvme_export_tls_key)."""
        return format_key(self.key, self.hmac_id)

    @property
    def cipher(self) -> int:
        """The hash of the TLS PSK and of the cipher suite: the transform hash, or by key length for 00."""
        if self.hmac_id != HMAC_NONE:
            return self.hmac_id
        return HMAC_SHA256 if len(self.key) == 32 else HMAC_SHA384

    @property
    def cipher_suite(self) -> str:
        return CIPHER_SUITES[self.cipher]

    def retained(self, hostnqn: str, *, compat: bool = False) -> bytes:
        """derive_retained_key: the configured key bound to the host NQN."""
        if self.hmac_id == HMAC_NONE:
            return bytes(self.key)
        return hkdf_expand_label(self.hmac_id, self.key, "HostNQN", hostnqn.encode(), len(self.key), compat=compat)

    def identity(self, hostnqn: str, subnqn: str, version: int = 1, *, compat: bool = False) -> PskIdentity:
        """gen_tls_identity: the identity a host offers for this key (version 1 carries the PSK digest)."""
        if version not in IDENTITY_VERSIONS:
            raise ValueError(f"PSK identity version {version} is not 0 or 1")
        digest = None
        if version == 1:
            digest = psk_digest(self.cipher, self.retained(hostnqn, compat=compat), hostnqn, subnqn)
        return PskIdentity(version, False, self.cipher, hostnqn, subnqn, digest)

    def tls_psk(self, identity: PskIdentity, *, compat: bool | None = False) -> bytes:
        """derive_tls_key: the PSK TLS uses for `identity` (which names the host and subsystem NQNs).

        ``compat=None`` (a target answering any host): a version-1 identity's digest tells which derivation
        made it, libnvme's current one or its pre-1.11 one (the digest is an HMAC under the retained PSK, which
        differs between the two); a version-0 identity gets the current one.
        Raises ValueError when the identity cannot be this key's (another hash, a digest that does not match).
        """
        if identity.generated:
            raise ValueError("generated PSKs (secure channel concatenation) are not supported")
        if identity.cipher != self.cipher:
            raise ValueError(f"PSK identity hash {identity.cipher:02d} is not the key's ({self.cipher:02d})")
        if identity.version == 0:
            retained = self.retained(identity.hostnqn, compat=bool(compat))
            context = str(identity).encode()
        else:
            for mode in ((False, True) if compat is None else (compat,)):
                retained = self.retained(identity.hostnqn, compat=mode)
                want = psk_digest(self.cipher, retained, identity.hostnqn, identity.subnqn)
                if _hmac.compare_digest(want.encode(), (identity.digest or "").encode()):
                    compat = mode
                    break
            else:
                raise ValueError("PSK identity digest does not match the configured key")
            context = f"{self.cipher:02d} {identity.digest}".encode()
        return hkdf_expand_label(self.cipher, retained, "nvme-tls-psk", context, len(retained), compat=bool(compat))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TlsKey):
            return NotImplemented
        return self.hmac_id == other.hmac_id and _hmac.compare_digest(self.key, other.key)

    def __hash__(self) -> int:
        return hash((TlsKey, self.hmac_id, len(self.key)))

    def __repr__(self) -> str:
        return f"TlsKey(hmac={self.hmac_id}, {len(self.key)} bytes)"

    __str__ = __repr__


def psk_digest(cipher: int, retained: bytes, hostnqn: str, subnqn: str) -> str:
    """derive_psk_digest: base64(HMAC(retained, hostnqn " " subnqn " " "NVMe-over-Fabrics"))."""
    mac = _hmac.new(retained, f"{hostnqn} {subnqn} ".encode() + DIGEST_SEED, HASHES[cipher]).digest()
    return base64.b64encode(mac).decode("ascii")


def format_key(key: bytes, hmac_id: int) -> str:
    crc = zlib.crc32(key).to_bytes(4, "little")
    return f"{KEY_PREFIX}{hmac_id:02x}:{base64.b64encode(bytes(key) + crc).decode('ascii')}:"


def generate_key(*, hmac_id: int = HMAC_SHA256, secret: bytes | None = None) -> str:
    """A new configured PSK, as ``nvme gen-tls-key [--hmac 1|2] [--secret HEX]`` prints it.

    The key length follows the hash (1: 32 bytes, 2: 48 bytes); --secret must be exactly that long.
    """
    if hmac_id not in HASH_LENGTHS:
        raise ValueError(f"invalid HMAC identifier {hmac_id} (--hmac: 1 SHA-256, 2 SHA-384)")
    key_len = HASH_LENGTHS[hmac_id]
    raw = os.urandom(key_len) if secret is None else bytes(secret)
    if len(raw) != key_len:
        raise ValueError(f"--secret is {len(raw)} bytes; --hmac {hmac_id} needs {key_len}")
    return format_key(raw, hmac_id)
