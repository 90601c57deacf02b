"""Names of hashes and DH groups as configfs / nvmetcli / nvme-cli spell them, and the sequence numbers."""

from __future__ import annotations

import secrets
import threading

HASH_IDS: dict[str, int] = {"sha256": 1, "sha384": 2, "sha512": 3}
DHGROUP_IDS: dict[str, int] = {"null": 0, "ffdhe2048": 1, "ffdhe3072": 2, "ffdhe4096": 3, "ffdhe6144": 4,
                               "ffdhe8192": 5}
HASH_BY_ID: dict[int, str] = {v: k for k, v in HASH_IDS.items()}
DHGROUP_BY_ID: dict[int, str] = {v: k for k, v in DHGROUP_IDS.items()}


def parse_hash(name: str) -> int:
    """'sha256' or configfs' dhchap_hash form 'hmac(sha256)' (case-insensitive) -> hash id 1..3."""
    text = name.strip().lower()
    if text.startswith("hmac(") and text.endswith(")"):
        text = text[5:-1]
    if text not in HASH_IDS:
        raise ValueError(f"unknown DH-HMAC-CHAP hash {name!r}: use one of sha256, sha384, sha512 "
                         "(or hmac(sha256), ... as configfs dhchap_hash spells them)")
    return HASH_IDS[text]


def parse_dhgroup(name: str) -> int:
    """'null', 'ffdhe2048' ... 'ffdhe8192' (configfs dhchap_dhgroup; case-insensitive) -> DH group id 0..5."""
    text = name.strip().lower()
    if text not in DHGROUP_IDS:
        raise ValueError(f"unknown DH-HMAC-CHAP DH group {name!r}: use one of {', '.join(DHGROUP_IDS)}")
    return DHGROUP_IDS[text]


def hash_name(hash_id: int) -> str:
    return HASH_BY_ID.get(hash_id, f"hash#{hash_id}")


def dhgroup_name(dhgroup_id: int) -> str:
    return DHGROUP_BY_ID.get(dhgroup_id, f"dhgroup#{dhgroup_id}")


_seq_lock = threading.Lock()
_seqnum = 0


def next_seqnum() -> int:
    """nvme_auth_get_seqnum: random start, then +1 per transaction, never 0 (0 means "no bidirectional")."""
    global _seqnum
    with _seq_lock:
        _seqnum = secrets.randbits(32) if _seqnum == 0 else (_seqnum + 1) & 0xFFFFFFFF
        if _seqnum == 0:
            _seqnum = 1
        return _seqnum
