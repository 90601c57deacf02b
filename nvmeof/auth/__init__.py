"""In-band authentication (DH-HMAC-CHAP), sans-IO: secrets, computations and the two transactions.

secret.py      DhchapSecret (DHHC-1 interchange form, CRC, transform), generate_secret (nvme gen-dhchap-key)
dhchap.py      hashes, host/controller responses, augmented challenge, FFDHE exchange (ffdhe.py: the primes)
messages.py    build/parse of Negotiate, Challenge, Reply, Success1/2, Failure1/2 (layouts: nvmeof/spec/auth.py)
controller.py  ControllerTransaction (the target's side of one queue)
host.py        HostTransaction (the initiator's side of one queue)
names.py       hash / DH group names as configfs spells them, next_seqnum
"""

from nvmeof.auth.controller import ControllerTransaction
from nvmeof.auth.errors import AuthFailure, reason_text
from nvmeof.auth.host import HostTransaction
from nvmeof.auth.messages import is_negotiate
from nvmeof.auth.names import DHGROUP_IDS, HASH_IDS, dhgroup_name, hash_name, next_seqnum, parse_dhgroup, parse_hash
from nvmeof.auth.secret import DhchapSecret, generate_secret

__all__ = [
    "DHGROUP_IDS", "HASH_IDS", "AuthFailure", "ControllerTransaction", "DhchapSecret", "HostTransaction",
    "dhgroup_name", "generate_secret", "hash_name", "is_negotiate", "next_seqnum", "parse_dhgroup", "parse_hash",
    "reason_text",
]
