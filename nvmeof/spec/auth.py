"""In-band authentication (DH-HMAC-CHAP) messages carried by Authentication Send / Receive.

Layouts and values: NVMe Base Specification 2.0 §8.13 ("In-band authentication"); Linux
include/linux/nvme.h ``struct nvmf_auth_dhchap_*_data`` and the ``NVME_AUTH_*`` enums. Every message
starts with the same 6 bytes (auth_type, auth_id, 2 reserved, t_id); the variable parts (challenge,
response, DH value) follow the fixed header and are sliced by the caller from ``hl`` / ``dhvlen``.
"""

from __future__ import annotations

import enum

from construct import Bytes, Int8ul, Int16ul, Int32ul, Padding, Struct

# Authentication Send/Receive SQE: SECP and SPSP0/SPSP1 the DH-HMAC-CHAP protocol uses
SECP_DHCHAP = 0xE9          # NVME_AUTH_DHCHAP_PROTOCOL_IDENTIFIER
SPSP0_DHCHAP = 0x01
SPSP1_DHCHAP = 0x01

# Connect response DW0 bits (NVMe-oF 1.1a / Base 2.0 Figure "Connect Response"): AUTHREQ
CONNECT_AUTHREQ_ATR = 1 << 17    # NVME_CONNECT_AUTHREQ_ATR: authentication transaction required
CONNECT_AUTHREQ_ASCR = 1 << 18   # NVME_CONNECT_AUTHREQ_ASCR: secure channel concatenation required

AUTH_ID_DHCHAP = 0x01            # NVME_AUTH_DHCHAP_AUTH_ID in the protocol descriptor
MAX_HASH_IDS = 30                # NVME_AUTH_DHCHAP_MAX_HASH_IDS: idlist[0..29] hashes
MAX_DH_IDS = 30                  # NVME_AUTH_DHCHAP_MAX_DH_IDS: idlist[30..59] DH groups
SC_C_NONE = 0                    # NVME_AUTH_SECP_NOSC: no secure channel concatenation


class AuthType(enum.IntEnum):
    COMMON = 0x00   # NVME_AUTH_COMMON_MESSAGES: Negotiate, Failure1, Failure2
    DHCHAP = 0x01   # NVME_AUTH_DHCHAP_MESSAGES: Challenge, Reply, Success1, Success2


class AuthId(enum.IntEnum):
    NEGOTIATE = 0x00
    CHALLENGE = 0x01
    REPLY = 0x02
    SUCCESS1 = 0x03
    SUCCESS2 = 0x04
    FAILURE2 = 0xF0
    FAILURE1 = 0xF1


class HashId(enum.IntEnum):
    SHA256 = 0x01
    SHA384 = 0x02
    SHA512 = 0x03


class DhGroupId(enum.IntEnum):
    NULL = 0x00
    FFDHE2048 = 0x01
    FFDHE3072 = 0x02
    FFDHE4096 = 0x03
    FFDHE6144 = 0x04
    FFDHE8192 = 0x05


FAILURE_REASON_FAILED = 0x01     # NVME_AUTH_DHCHAP_FAILURE_REASON_FAILED: the only Reason Code


class FailureReason(enum.IntEnum):
    """Reason Code Explanation of Failure1/Failure2 (NVME_AUTH_DHCHAP_FAILURE_*)."""

    FAILED = 0x01
    NOT_USABLE = 0x02
    CONCAT_MISMATCH = 0x03
    HASH_UNUSABLE = 0x04
    DHGROUP_UNUSABLE = 0x05
    INCORRECT_PAYLOAD = 0x06
    INCORRECT_MESSAGE = 0x07


# The 6 bytes every message begins with; enough to route a message before parsing the rest.
AuthHeader = Struct(
    "auth_type" / Int8ul,
    "auth_id" / Int8ul,
    "rsvd1" / Padding(2),
    "t_id" / Int16ul,
)
# Challenge, Reply and Success1 go on with the hash length HL and a reserved byte.
_HEADER_AND_HL = (*AuthHeader.subcons, "hl" / Int8ul, "rsvd2" / Padding(1))

ProtocolDescriptor = Struct(   # struct nvmf_auth_dhchap_protocol_descriptor (64 B)
    "authid" / Int8ul,
    "rsvd" / Padding(1),
    "halen" / Int8ul,
    "dhlen" / Int8ul,
    "idlist" / Bytes(60),      # hash ids in [0, halen), DH group ids in [30, 30 + dhlen)
)

Negotiate = Struct(            # struct nvmf_auth_dhchap_negotiate_data (8 B) + napd descriptors
    "auth_type" / Int8ul,
    "auth_id" / Int8ul,
    "rsvd" / Padding(2),
    "t_id" / Int16ul,
    "sc_c" / Int8ul,
    "napd" / Int8ul,
)

Challenge = Struct(            # struct nvmf_auth_dhchap_challenge_data (16 B) + C1[hl] + DH[dhvlen]
    *_HEADER_AND_HL,
    "hashid" / Int8ul,
    "dhgid" / Int8ul,
    "dhvlen" / Int16ul,
    "seqnum" / Int32ul,
)

Reply = Struct(                # struct nvmf_auth_dhchap_reply_data (16 B) + R1[hl] + C2[hl] + DH[dhvlen]
    *_HEADER_AND_HL,
    "cvalid" / Int8ul,
    "rsvd3" / Padding(1),
    "dhvlen" / Int16ul,
    "seqnum" / Int32ul,
)

Success1 = Struct(             # struct nvmf_auth_dhchap_success1_data (16 B) + R2[hl] if rvalid
    *_HEADER_AND_HL,
    "rvalid" / Int8ul,
    "rsvd3" / Padding(7),
)

Success2 = Struct(             # struct nvmf_auth_dhchap_success2_data (16 B)
    *AuthHeader.subcons,
    "rsvd2" / Padding(10),
)

Failure = Struct(              # struct nvmf_auth_dhchap_failure_data (8 B): Failure1 and Failure2
    *AuthHeader.subcons,
    "rescode" / Int8ul,
    "rescode_exp" / Int8ul,
)

AUTH_HEADER_SIZE = AuthHeader.sizeof()            # 6
NEGOTIATE_SIZE = Negotiate.sizeof()               # 8
PROTOCOL_DESCRIPTOR_SIZE = ProtocolDescriptor.sizeof()  # 64
CHALLENGE_SIZE = Challenge.sizeof()               # 16
REPLY_SIZE = Reply.sizeof()                       # 16
SUCCESS1_SIZE = Success1.sizeof()                 # 16
SUCCESS2_SIZE = Success2.sizeof()                 # 16
FAILURE_SIZE = Failure.sizeof()                   # 8
