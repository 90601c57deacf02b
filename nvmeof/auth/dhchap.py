"""DH-HMAC-CHAP computations: the hashes, the responses and the FFDHE exchange (NVMe Base 2.0 §8.13.5).

Byte order of every HMAC input mirrors the Linux kernel line by line:
- host response (drivers/nvme/host/auth.c nvme_auth_dhchap_setup_host_response, target/auth.c
  nvmet_auth_host_hash): HMAC(Kh', C1' || le32(S1) || le16(T_ID) || SC_C || "HostHost" || NQNh || 0x00 || NQNc)
- controller response (nvme_auth_dhchap_setup_ctrl_response, nvmet_auth_ctrl_hash):
  HMAC(Kc', C2' || le32(S2) || le16(T_ID) || 0x00 || "Controller" || NQNc || 0x00 || NQNh)
  where Kh' / Kc' are the transformed host / controller keys (nvme_auth_transform_key with NQNh / NQNc)
- with a DH group the challenge is augmented (nvme_auth_augmented_challenge): C' = HMAC(H(Ks), C), Ks the
  shared secret g^xy mod p written big-endian on the full width of the prime (the kernel's kpp output).
Crypto: hashlib/hmac for SHA-2 and HMAC, `cryptography` for the FFDHE groups; no hand-written math.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from functools import cache

from cryptography.hazmat.primitives.asymmetric import dh

from nvmeof.auth.ffdhe import FFDHE_GENERATOR, FFDHE_PRIMES

HASH_NAMES: dict[int, str] = {1: "sha256", 2: "sha384", 3: "sha512"}
HASH_LENGTHS: dict[int, int] = {1: 32, 2: 48, 3: 64}
DHGROUP_NAMES: dict[int, str] = {0: "null", 1: "ffdhe2048", 2: "ffdhe3072", 3: "ffdhe4096", 4: "ffdhe6144",
                                 5: "ffdhe8192"}
DHGROUP_BITS: dict[int, int] = {1: 2048, 2: 3072, 3: 4096, 4: 6144, 5: 8192}


def hmac_digest(hash_id: int, key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=HASH_NAMES[hash_id])
    for part in parts:
        mac.update(part)
    return mac.digest()


def augmented_challenge(hash_id: int, session_key: bytes, challenge: bytes) -> bytes:
    """nvme_auth_augmented_challenge: HMAC(H(Ks), C)."""
    hashed = hashlib.new(HASH_NAMES[hash_id], session_key).digest()
    return hmac_digest(hash_id, hashed, challenge)


def _challenge_for(hash_id: int, challenge: bytes, session_key: bytes | None) -> bytes:
    return augmented_challenge(hash_id, session_key, challenge) if session_key else challenge


def host_response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, t_id: int, hostnqn: str,
                  subnqn: str, *, session_key: bytes | None = None, sc_c: int = 0) -> bytes:
    """R1 for C1: the value the host sends in DH-HMAC-CHAP_Reply and the controller recomputes."""
    return hmac_digest(hash_id, key, _challenge_for(hash_id, challenge, session_key),
                       struct.pack("<IHB", seqnum, t_id, sc_c), b"HostHost", hostnqn.encode(), b"\0",
                       subnqn.encode())


def controller_response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, t_id: int, subnqn: str,
                        hostnqn: str, *, session_key: bytes | None = None) -> bytes:
    """R2 for C2: the value the controller sends in DH-HMAC-CHAP_Success1 (bidirectional)."""
    return hmac_digest(hash_id, key, _challenge_for(hash_id, challenge, session_key),
                       struct.pack("<IHB", seqnum, t_id, 0), b"Controller", subnqn.encode(), b"\0",
                       hostnqn.encode())


def random_challenge(hash_id: int) -> bytes:
    return os.urandom(HASH_LENGTHS[hash_id])


def dh_value_len(dhgroup_id: int) -> int:
    """Bytes of a DH value (public key) for the group: the width of its prime (0 for the null group)."""
    return DHGROUP_BITS[dhgroup_id] // 8 if dhgroup_id else 0


@cache
def _parameters(dhgroup_id: int) -> dh.DHParameters:
    p = FFDHE_PRIMES[DHGROUP_BITS[dhgroup_id]]
    return dh.DHParameterNumbers(p, FFDHE_GENERATOR, q=(p - 1) // 2).parameters()


class DhExchange:
    """One ephemeral FFDHE key pair: ``public`` (our DH value) and ``shared(peer)`` (Ks).

    Raises ValueError when the peer's value has the wrong length or is not a valid group element
    (cryptography/OpenSSL check 1 < y < p-1, as the kernel's dh_is_pubkey_valid does).
    """

    def __init__(self, dhgroup_id: int) -> None:
        if dhgroup_id not in DHGROUP_BITS:
            raise ValueError(f"DH group id {dhgroup_id} is not an FFDHE group (1..5)")
        self.dhgroup_id = dhgroup_id
        self.size = dh_value_len(dhgroup_id)
        self._private = _parameters(dhgroup_id).generate_private_key()
        self.public = self._private.public_key().public_numbers().y.to_bytes(self.size, "big")

    def shared(self, peer: bytes) -> bytes:
        if len(peer) != self.size:
            raise ValueError(f"DH value is {len(peer)} bytes; {DHGROUP_NAMES[self.dhgroup_id]} needs {self.size}")
        y = int.from_bytes(peer, "big")
        p = FFDHE_PRIMES[DHGROUP_BITS[self.dhgroup_id]]
        if not 1 < y < p - 1:
            raise ValueError(f"DH value is not an element of {DHGROUP_NAMES[self.dhgroup_id]} (1 < y < p-1)")
        try:
            peer_key = dh.DHPublicNumbers(y, _parameters(self.dhgroup_id).parameter_numbers()).public_key()
            secret = self._private.exchange(peer_key)
        except ValueError as exc:
            raise ValueError(f"DH value rejected by the {DHGROUP_NAMES[self.dhgroup_id]} exchange: {exc}") from None
        return secret.rjust(self.size, b"\0")
