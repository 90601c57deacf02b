"""The management inputs' fields, declared once: their limits and the checks of their values.

The REST bodies (api/schemas.py, pydantic) are built from the items' ``Field`` declarations here, or take
their bounds from here (``IntField.bounds()``), and the service (target/service/checks.py) checks the same
fields with ``IntField.check`` and the value parsers below, so the API, a config replay and the daemon
start-up refuse the same values; the manage CLI's ranges and target/config.py's item fields come from here
too. Each check raises SchemaError (a ValueError) whose message names the field and what was wrong; the
service turns it into a 400. The limits themselves come from nvmeof/defaults.py and nvmeof/spec (one place
each).
"""

from __future__ import annotations

import ipaddress
import uuid as uuidlib
from typing import Any, Literal

from nvmeof import defaults
from nvmeof.spec.fabrics import PORTID_MAX
from nvmeof.spec.identify import NSID_MAX
from nvmeof.spec.logs import ANA_STATE_NAMES, AnaState, parse_ana_state
from target.backends import KINDS
from target.fields import (
    JSON_TYPES,
    REQUIRED_IN_BODY,
    Field,
    IntField,
    SchemaError,
    ServiceError,
    is_json,
)

__all__ = ["JSON_TYPES", "REQUIRED_IN_BODY", "Field", "IntField", "SchemaError", "ServiceError", "is_json"]

SERIAL_MAX = 20  # Identify Controller SN, bytes
MODEL_MAX = 40  # Identify Controller MN, bytes
# The values a listener, referral and namespace take; target/model.py's objects hold them
TRTYPES = ("tcp", "rdma")
ADRFAMS = ("ipv4", "ipv6")
BLOCK_SIZES = (512, 4096)

NSID = IntField("nsid", 1, NSID_MAX)
MAX_NAMESPACES = IntField("max_namespaces", 1, NSID_MAX)
ANAGRPID = IntField("anagrpid", 1, defaults.ANAGRPMAX)
TRSVCID = IntField("port (trsvcid)", 1, defaults.PORT_MAX)
LISTENER_PORTID = IntField("portid", 1, PORTID_MAX)  # 0 is left for referrals that name no port
REFERRAL_PORTID = IntField("portid", 0, PORTID_MAX)
CNTLID = IntField("cntlid", 0, 0xFFFF)
INLINE_DATA_SIZE = IntField("inline_data_size", 0, defaults.INLINE_DATA_SIZE_MAX)
SIZE = IntField("size", 1, defaults.MAX_FILE_SIZE)
QOS_IOS = IntField("rw_ios_per_second", 0, defaults.QOS_IOS_MAX)
QOS_MBYTES = IntField("mbytes_per_second", 0, defaults.QOS_MBYTES_MAX)
NGUID_LEN = 16  # bytes (Identify Namespace NGUID)
EUI64_LEN = 8  # bytes (Identify Namespace EUI64)


def check_bool(value: Any, name: str) -> bool:
    if not is_json(bool, value):
        raise SchemaError(f"{name} must be true or false, got {value!r}")
    return value


def check_ascii(value: Any, name: str, limit: int) -> str:
    """A fixed-size ASCII field of Identify (serial, model): printable, non-empty, at most ``limit``."""
    if not isinstance(value, str) or not value.strip():
        raise SchemaError(f"{name} must be a non-empty string, got {value!r}")
    if any(not (0x20 <= ord(ch) <= 0x7E) for ch in value):
        raise SchemaError(f"{name} {value!r} must be printable ASCII (it goes into a fixed ASCII field)")
    if len(value) > limit:
        raise SchemaError(f"{name} {value!r} is {len(value)} characters; the limit is {limit}")
    return value


def check_hex_id(value: Any, name: str, length: int) -> bytes:
    """An NGUID/EUI-64 given as bytes or hex text (with optional '-' or ':' separators)."""
    if isinstance(value, bytes | bytearray):
        raw = bytes(value)
    elif isinstance(value, str):
        digits = value.replace("-", "").replace(":", "").strip()
        try:
            raw = bytes.fromhex(digits)
        except ValueError:
            raise SchemaError(f"{name} {value!r} is not hexadecimal") from None
    else:
        raise SchemaError(f"{name} must be hex text, got {value!r}")
    if len(raw) != length:
        raise SchemaError(f"{name} {value!r} is {len(raw)} bytes; it must be {length} ({2 * length} hex digits)")
    if raw == bytes(length):
        raise SchemaError(f"{name} is all zeros, which tells the host there is none; leave it out to generate one")
    return raw


def check_uuid(value: Any) -> uuidlib.UUID:
    if isinstance(value, uuidlib.UUID):
        parsed = value
    else:
        try:
            parsed = uuidlib.UUID(str(value))
        except ValueError:
            raise SchemaError(f"uuid {value!r} is not a UUID (8-4-4-4-12 hex digits)") from None
    if parsed.int == 0:
        raise SchemaError("uuid is all zeros, which tells the host there is none; leave it out to generate one")
    return parsed


def check_address(trtype: Any, traddr: Any, trsvcid: Any, adrfam: Any) -> tuple[str, str, str, int]:
    """A listener's or referral's transport address as (trtype, adrfam, traddr, port): the family is
    derived from the address, a given one must agree."""
    if trtype not in TRTYPES:
        raise SchemaError(f"transport type {trtype!r} is not supported; use one of {', '.join(TRTYPES)}")
    try:
        ip = ipaddress.ip_address(str(traddr).strip("[]"))
    except ValueError:
        raise SchemaError(f"address {traddr!r} is not an IPv4 or IPv6 address") from None
    family = "ipv6" if ip.version == 6 else "ipv4"
    if adrfam is not None and adrfam != family:
        if adrfam not in ADRFAMS:
            raise SchemaError(f"address family {adrfam!r} is not supported; use one of {', '.join(ADRFAMS)}")
        raise SchemaError(f"address {traddr} is {family}, but the address family given is {adrfam}")
    return trtype, family, str(ip), TRSVCID.check(trsvcid)


def check_tls_mode(tls: Any, trtype: str) -> str:
    """A listener's ``tls`` (None: "none"); TLS exists for NVMe/TCP only (TP 8011)."""
    if tls is None:
        return "none"
    if tls not in defaults.TLS_MODES:
        raise SchemaError(f"tls {tls!r}: use one of {', '.join(defaults.TLS_MODES)}")
    if tls != "none" and trtype != "tcp":
        raise SchemaError(f"tls {tls}: TLS is an NVMe/TCP secure channel; a {trtype} listener takes tls none")
    return str(tls)


def check_inline_data_size(value: Any, trtype: str) -> int:
    """A listener's in-capsule data size in bytes (nvmet's port param_inline_data_size): what its I/O queues
    accept in a command capsule and Identify's IOCCSZ advertises. IOCCSZ counts 16-byte units, so the size
    is a multiple of 16 (nvmet would advertise a rounded-down size yet accept the rest); NVMe/RDMA
    preallocates it per receive, and nvmet_rdma_add_port bounds it by NVMET_RDMA_MAX_INLINE_DATA_SIZE,
    which is refused here rather than quietly reduced."""
    size = INLINE_DATA_SIZE.check(value)
    unit = defaults.INLINE_DATA_SIZE_UNIT
    if size % unit:
        raise SchemaError(f"inline_data_size {size} is not a multiple of {unit} (Identify's IOCCSZ counts "
                          f"{unit}-byte units); use {size // unit * unit} or {(size // unit + 1) * unit}")
    if trtype == "rdma" and size > defaults.RDMA_INLINE_DATA_SIZE_MAX:
        raise SchemaError(f"inline_data_size {size} is too large for an rdma listener: each receive holds it "
                          f"preallocated; use at most {defaults.RDMA_INLINE_DATA_SIZE_MAX} "
                          "(nvmet-rdma's NVMET_RDMA_MAX_INLINE_DATA_SIZE)")
    return size


def check_ana_state(value: Any) -> AnaState:
    """An ANA state: an AnaState, or its word (ANA_STATE_NAMES; parse_ana_state takes any case, "_" for "-")."""
    try:
        return parse_ana_state(value)
    except ValueError as exc:
        raise SchemaError(str(exc)) from None


def check_block_size(value: Any) -> int:
    if isinstance(value, bool) or value not in BLOCK_SIZES:
        raise SchemaError(f"block size {value!r} is not supported; use {' or '.join(map(str, BLOCK_SIZES))}")
    return int(value)


# The fields of each configuration item: the config file's items (target/config.py checks their structure
# against the JSON types, *_FIELDS), the REST bodies (api/schemas.py builds them from these) and the service's
# parameters (the same names) are the one set. Field and IntField live in target/fields.py, which the backend
# registry imports too: a backend kind declares its own settings with them (BACKEND_OPTIONS).
TrType = Literal[TRTYPES]  # type: ignore[valid-type]
AdrFam = Literal[ADRFAMS]  # type: ignore[valid-type]
TlsMode = Literal[defaults.TLS_MODES]  # type: ignore[valid-type]  # a TCP listener's TLS
AnaStateName = Literal[tuple(ANA_STATE_NAMES.values())]  # type: ignore[valid-type]  # nvmeof.spec.logs

LISTENER: dict[str, Field] = {
    "trtype": Field(str, "tcp", TrType),
    "traddr": Field(str, REQUIRED_IN_BODY, min_length=1, description="IPv4 or IPv6 address to listen on",
                    required_in_file=True),
    "trsvcid": Field(int, defaults.TCP_IO_PORT, range=TRSVCID, required_in_file=True),
    "adrfam": Field(str, None, AdrFam, description="Derived from traddr when omitted"),
    "discovery": Field(bool, False, description="Serve the discovery subsystem on this listener"),
    "portid": Field(int, None, range=LISTENER_PORTID, description="Discovery log port ID; a free one if omitted"),
    # NVMe/TCP secure channel: "none" (default), "optional" or "required" (TLS 1.3 with a PSK)
    "tls": Field(str, "none", TlsMode,
                 description="NVMe/TCP TLS 1.3 with PSKs: none, optional (TLS or clear) or required"),
    # nvmet's port param_inline_data_size: in-capsule data its I/O queues take (IOCCSZ); set when it is added
    "inline_data_size": Field(int, defaults.IO_INCAPSULE_SIZE, range=INLINE_DATA_SIZE,
                              description="In-capsule data bytes a command may carry on this listener's I/O queues "
                                          "(Identify IOCCSZ; nvmet's param_inline_data_size): a multiple of 16, at "
                                          f"most {defaults.INLINE_DATA_SIZE_MAX} (MDTS), "
                                          f"{defaults.RDMA_INLINE_DATA_SIZE_MAX} on rdma; larger writes go by R2T"),
    # {"<anagrpid>": state word}: groups not named are optimized on this listener (PUT .../ana/... sets them)
    "ana_states": Field(dict, in_body=False),
}
# PUT .../ana/<anagrpid>: one group's state on a listener (kept in the listener's "ana_states")
ANA_STATE: dict[str, Field] = {
    "state": Field(str, REQUIRED_IN_BODY, AnaStateName),
}
REFERRAL: dict[str, Field] = {
    "trtype": Field(str, "tcp", TrType),
    "traddr": Field(str, REQUIRED_IN_BODY, min_length=1, required_in_file=True),
    "trsvcid": Field(int, defaults.TCP_DISCOVERY_PORT, range=TRSVCID, required_in_file=True),
    "adrfam": Field(str, None, AdrFam),
    "subnqn": Field(str, defaults.DISCOVERY_NQN),
    "portid": Field(int, 0, range=REFERRAL_PORTID),
}


def kinds(fields: dict[str, Field]) -> dict[str, type]:
    """The fields' JSON types, as the configuration file has them."""
    return {name: field.kind for name, field in fields.items() if field.in_file}


DHCHAP_HASH = ("DH-HMAC-CHAP hashes allowed, in order of preference: sha256, sha384, sha512 (or hmac(sha256) ... "
               "as configfs spells them); null or absent: all")
DHCHAP_DHGROUP = ("DH-HMAC-CHAP DH groups allowed, in order of preference: null, ffdhe2048 ... ffdhe8192; "
                  "null or absent: all")
_DHCHAP_KEY = ("The host's DH-HMAC-CHAP secret (DHHC-1:NN:base64: as `nvme gen-dhchap-key` writes it); with it the "
               "host must authenticate every queue. Never shown again: answers say only whether it is set")
_TLS_KEY = ("The host's NVMe/TCP TLS PSK on this subsystem (NVMeTLSkey-1:NN:base64: as `nvme gen-tls-key` writes it), "
            "used on listeners with tls optional/required. Never shown again: answers say only whether it is set")
_TLS_COMPAT = ("Derive the host's TLS PSK for identities without a digest (NVMe0R..) as libnvme's compat functions do: "
               "for a host (e.g. Linux with nvme-cli 2.13 / libnvme 1.13) whose keyring key was inserted that way. "
               "Default false (RFC 8446 HKDF-Expand-Label)")
SUBSYSTEM: dict[str, Field] = {
    "nqn": Field(str, description="NQN; generated (UUID form) when omitted", required_in_file=True),
    "serial": Field(str, max_length=SERIAL_MAX, description="Serial number; generated when omitted"),
    "model": Field(str, defaults.MODEL, min_length=1, max_length=MODEL_MAX),
    "allow_any_host": Field(bool, description="Let every host connect; defaults to true when no hosts are listed"),
    # host NQNs, or in the file host objects (HOST) with their settings; the body adds them as NQNs
    "hosts": Field(list, [], list[str], description="Host NQNs allowed to connect"),
    "max_namespaces": Field(int, defaults.MAX_NAMESPACES, range=MAX_NAMESPACES),
    "namespaces": Field(list, in_body=False),  # NAMESPACE items; the body adds none (POST .../namespaces)
    "dhchap_hash": Field(list, None, list[str], description=DHCHAP_HASH, each="names"),
    "dhchap_dhgroup": Field(list, None, list[str], description=DHCHAP_DHGROUP, each="names"),
}
# A host object in a subsystem's "hosts" list (the kernel's configfs names, hosts/<nqn>/dhchap_*)
HOST: dict[str, Field] = {
    "nqn": Field(str, REQUIRED_IN_BODY, body_name="hostnqn", required_in_file=True),
    "dhchap_key": Field(str, description=_DHCHAP_KEY, secret=True),
    "dhchap_ctrl_key": Field(str, description="The controller's secret for bidirectional authentication (needs "
                                              "dhchap_key); never shown again", secret=True),
    "dhchap_hash": Field(list, None, list[str], description=DHCHAP_HASH, each="names"),
    "dhchap_dhgroup": Field(list, None, list[str], description=DHCHAP_DHGROUP, each="names"),
    # the host's NVMe/TCP TLS PSK on the subsystem (NVMeTLSkey-1:NN:...:)
    "tls_key": Field(str, description=_TLS_KEY, secret=True),
    # its NVMe0R TLS PSK derived as libnvme's *_compat functions do (nvme-cli 2.13)
    "tls_compat": Field(bool, description=_TLS_COMPAT),
}
HOST_SECRET_FIELDS = tuple(name for name, field in HOST.items() if field.secret)
HEX_NGUID = rf"^[0-9A-Fa-f]{{{2 * NGUID_LEN}}}$"
HEX_EUI64 = rf"^[0-9A-Fa-f]{{{2 * EUI64_LEN}}}$"
# A namespace in a subsystem's "namespaces" list; besides these, the settings of its backend kind
# (target.backends.BACKEND_OPTIONS, declared with the kind as these are)
NAMESPACE: dict[str, Field] = {
    "backend": Field(str, REQUIRED_IN_BODY, Literal[KINDS], required_in_file=True),  # type: ignore[valid-type]
    "path": Field(str, description="Absolute path of a file under a backing directory, or of an allowed block "
                                   "device (backend 'file'); stored resolved"),
    "size": Field(int, range=SIZE, description="Bytes; required for ram/null, or with create=true"),
    "block_size": Field(int, defaults.DEFAULT_BLOCK_SIZE, description=" or ".join(map(str, BLOCK_SIZES))),
    "nsid": Field(int, range=NSID, description="Lowest free NSID when omitted"),
    "uuid": Field(str, None, uuidlib.UUID, strict=False),  # JSON has no UUID type: parsed from its string
    "nguid": Field(str, pattern=HEX_NGUID),
    "eui64": Field(str, pattern=HEX_EUI64),
    "read_only": Field(bool, False),
    "enabled": Field(bool, True),
    # its ANA group, 1..ANAGRPMAX (default 1)
    "anagrpid": Field(int, defaults.DEFAULT_ANAGRPID, range=ANAGRPID,
                      description="ANA group: hosts with native multipath pick paths by its state on each listener"),
    "create": Field(bool, False, in_file=False,
                    description="Create the file (or RBD image) with the given size if it is missing, or grow a "
                                "shorter one to it; without it an existing one is never changed"),
    # false: only the "hosts" listed see it (masking; default true)
    "auto_visible": Field(bool, True, description="Visible to every allowed host (default); false: only to `hosts` "
                                                  "(masking: other hosts see an inactive NSID)"),
    "hosts": Field(list, [], list[str], max_length=1024, each="host NQN strings",
                   description="Host NQNs that see it (needs auto_visible false); each must be allowed on the "
                               "subsystem"),
    # QoS limits (target/qos.py): {"rw_ios_per_second": N, ..., "hosts": {"<hostnqn>": {...}}}; PUT .../qos
    "qos": Field(dict, in_body=False),
}
# A namespace's (or one host's on it) QoS limits, the "qos" object's keys (target/qos.py's LIMIT_KEYS)
_MIB = "MiB per second; 0 removes the limit"
QOS: dict[str, Field] = {
    "rw_ios_per_second": Field(int, range=QOS_IOS, description="Commands per second; 0 removes the limit"),
    "rw_mbytes_per_second": Field(int, range=QOS_MBYTES, description=_MIB),
    "r_mbytes_per_second": Field(int, range=QOS_MBYTES, description=_MIB),
    "w_mbytes_per_second": Field(int, range=QOS_MBYTES, description=_MIB),
}
SUBSYSTEM_FIELDS = kinds(SUBSYSTEM)
HOST_FIELDS = kinds(HOST)
NAMESPACE_FIELDS = kinds(NAMESPACE)
LISTENER_FIELDS = kinds(LISTENER)
REFERRAL_FIELDS = kinds(REFERRAL)
# The configuration file's items by the name its messages give them (target/config.py checks each against these)
ITEMS: dict[str, dict[str, Field]] = {
    "subsystem": SUBSYSTEM, "host": HOST, "namespace": NAMESPACE, "listener": LISTENER, "referral": REFERRAL,
}
