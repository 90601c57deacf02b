"""Request and response bodies of the management API (pydantic v2).

Requests carry only type and range checks; the bodies that add or change a configuration item (subsystem,
namespace, host, listener, referral) are built from that item's field declarations in target/schema.py
(``_body``), which the configuration file is checked against too. The meaning of a value (is this NQN well
formed, is the file there, is the port free) is checked by TargetService, so the REST API, the config
restore and the daemon start-up give the same answer. Responses are built from the model objects with the
``from_*`` helpers so every route renders an object the same way.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from nvmeof import defaults
from target import schema
from target.backends import option_fields

TrType = schema.TrType  # target/model.py, checked by target/schema.py
AdrFam = schema.AdrFam
AnaStateName = schema.AnaStateName  # nvmeof.spec.logs.ANA_STATE_NAMES
TlsMode = schema.TlsMode  # a TCP listener's TLS


def _example(example: dict[str, Any]) -> ConfigDict:
    """Request config with an example for /docs (schemathesis also starts from it)."""
    return ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [example]})


class _Request(BaseModel):
    # An unknown field is far more often a typo ("blocksize") than intent: refuse it by name.
    # Strict: "size": "1048576", "size": true or "allow_any_host": "yes" are refused (422 naming the
    # field) rather than guessed at; JSON has real numbers and booleans.
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        # A NUL byte cannot be part of a path, an NQN or a name (C strings end there): refuse it by field.
        items = value if isinstance(value, list) else [value]
        if any(isinstance(item, str) and "\x00" in item for item in items):
            raise ValueError("contains a NUL byte")
        return value



def _body(name: str, fields: dict[str, schema.Field], *, only: tuple[str, ...] = (), skip: tuple[str, ...] = (),
          notes: dict[str, str] | None = None, sets: dict[str, str] | None = None) -> type[_Request]:
    """The request body of a configuration item, built from its field declarations in target/schema.py
    (types, defaults, ranges, descriptions live there only): ``only``/``skip`` pick fields, ``notes`` add a
    body's own words to a description, ``sets`` names fields the body must give (a route that sets one
    setting) with the route's description. A body class subclasses it for its example and docstring."""
    specs: dict[str, Any] = {}
    for key, field in fields.items():
        if not field.in_body or key in skip or (only and key not in only):
            continue
        options: dict[str, Any] = field.range.bounds() if field.range is not None else {}
        if field.min_length is not None:
            options["min_length"] = field.min_length
        if field.max_length is not None:
            options["max_length"] = field.max_length
        if field.pattern is not None:
            options["pattern"] = field.pattern
        if field.strict is not None:
            options["strict"] = field.strict
        description = (field.description or "") + (notes or {}).get(key, "")
        if description:
            options["description"] = description
        body_type = field.body_type()
        if sets and key in sets:
            options["description"] = sets[key]
            body_type = field.kind if field.annotation is None else field.annotation
        elif isinstance(field.default, list):
            options["default_factory"] = list
        else:
            options["default"] = field.default
        specs[field.body_name or key] = (body_type, Field(**options))
    return create_model(name, __base__=_Request, __module__=__name__, **specs)


# -- subsystems -------------------------------------------------------------------------------------

class SubsystemCreate(_body("_SubsystemFields", schema.SUBSYSTEM)):  # type: ignore[misc]
    model_config = _example({"nqn": "nqn.2024-01.com.example:disk1", "allow_any_host": True})


class NamespaceStatsOut(BaseModel):
    reads: int
    writes: int
    read_bytes: int
    write_bytes: int
    errors: int
    read_latency_ns: int = Field(description="Sum over all reads")
    write_latency_ns: int = Field(description="Sum over all writes")
    throttled: int = Field(0, description="Commands a QoS limit delayed")
    throttled_ns: int = Field(0, description="Time those commands waited, summed")


class RegistrantOut(BaseModel):
    hostid: str = Field(description="The host's 128-bit Host Identifier (Connect HOSTID), hex")
    hostnqns: list[str] = Field(description="Host NQNs of the controllers of that host connected now")
    holds: bool = Field(description="Whether this registrant holds the reservation")
    rkey: str = Field(description="Always redacted: a registration key lets a host preempt another")


class ReservationOut(BaseModel):
    subnqn: str
    nsid: int
    supported: bool = Field(description="False where this target serves no reservations (serve --workers)")
    generation: int = Field(description="The Reservation Report's GEN: counts registrations, preempts, clears")
    rtype: int = Field(description="Reservation type 1..6, 0: none")
    type: str = Field(description="The type as a word (write-exclusive, ..., none)")
    ptpl: bool = Field(description="Persist Through Power Loss: kept across a restart of the target")
    holder: str | None = Field(description="HOSTID of the holder; null without a reservation or for the "
                               "all-registrants types, where every registrant holds it")
    all_registrants_hold: bool
    registrants: list[RegistrantOut]


class NamespaceOut(BaseModel):
    nsid: int
    backend: str
    path: str | None = None
    size: int = Field(description="Capacity in bytes")
    block_size: int
    blocks: int = Field(description="Capacity in logical blocks (NSZE)")
    uuid: str
    nguid: str = Field(description="32 hexadecimal digits")
    eui64: str = Field(description="16 hexadecimal digits")
    read_only: bool
    enabled: bool
    anagrpid: int = Field(defaults.DEFAULT_ANAGRPID, description="ANA group (1..ANAGRPMAX)")
    reservation: str = Field("none", description="Persistent reservation type (none, write-exclusive, ...); "
                             "GET .../reservations has the holder and registrants")
    registrants: int = Field(0, description="Hosts registered for reservations on this namespace")
    auto_visible: bool = Field(True, description="Visible to every allowed host; false: only to `hosts`")
    hosts: list[str] = Field(default_factory=list, description="Host NQNs that see it while auto_visible is false")
    qos: NamespaceQosOut | None = Field(None, description="QoS limits; null: unlimited")
    pool: str | None = Field(None, description="RBD pool (backend 'rbd')")
    image: str | None = Field(None, description="RBD image (backend 'rbd')")
    rbd_namespace: str | None = Field(None, description="RADOS namespace of the image, if any")
    ceph_conf: str | None = Field(None, description="Ceph configuration file, if not the daemon's default")
    ceph_id: str | None = Field(None, description="Ceph client id (cephx user without 'client.')")
    ceph_keyring: str | None = Field(None, description="Ceph keyring path (its contents are never shown)")


class SubsystemOut(BaseModel):
    nqn: str
    serial: str
    model: str
    allow_any_host: bool
    hosts: list[str]
    max_namespaces: int
    subtype: str
    namespaces: list[NamespaceOut]
    dhchap_hash: list[str] | None = Field(None, description="Allowed hashes for hosts that name none (null: all)")
    dhchap_dhgroup: list[str] | None = Field(None, description="Allowed DH groups for hosts that name none (null: all)")


# -- namespaces -------------------------------------------------------------------------------------


# a namespace's fields and, after them, the settings of the backend kinds as each kind declares them
# (target.backends.BACKEND_OPTIONS; tests/test_schema.py keeps them there)
class NamespaceCreate(_body("_NamespaceFields", {**schema.NAMESPACE, **option_fields()})):  # type: ignore[misc]
    model_config = _example({"backend": "ram", "size": 1 << 30, "block_size": 512})


class NamespaceAnaGroup(_body("_AnaGroupFields", schema.NAMESPACE, only=("anagrpid",),  # type: ignore[misc]
                               sets={"anagrpid": "The namespace's new ANA group"})):
    model_config = _example({"anagrpid": 2})


class NamespaceHostAdd(_body("_NamespaceHostFields", schema.HOST, only=("nqn",),  # type: ignore[misc]
                             sets={"nqn": "A host allowed on the subsystem; its controllers see the namespace "
                                          "from now on"})):
    model_config = _example({"hostnqn": "nqn.2014-08.org.nvmexpress:uuid:0f2d2f36-8a4e-4a3b-9a52-3b1f1f2f7c11"})


_AUTO_VISIBLE = ("true: every allowed host sees the namespace (the host list is dropped); "
                 "false: only the hosts added to it")


class NamespaceAutoVisible(_body("_AutoVisibleFields", schema.NAMESPACE, only=("auto_visible",),  # type: ignore[misc]
                                 sets={"auto_visible": _AUTO_VISIBLE})):
    model_config = _example({"auto_visible": False})


class QosLimitsOut(BaseModel):
    rw_ios_per_second: int = Field(0, description="Read and write commands per second; 0: unlimited")
    rw_mbytes_per_second: int = Field(0, description="Read and written MiB per second; 0: unlimited")
    r_mbytes_per_second: int = Field(0, description="Read MiB per second; 0: unlimited")
    w_mbytes_per_second: int = Field(0, description="Written MiB per second; 0: unlimited")


class NamespaceQosOut(QosLimitsOut):
    hosts: dict[str, QosLimitsOut] = Field(default_factory=dict, description="Limits of single hosts (host NQN)")


class NamespaceQosSet(_body("_QosFields", schema.QOS)):  # type: ignore[misc]
    model_config = _example({"rw_ios_per_second": 2000, "rw_mbytes_per_second": 100})

    host: str | None = Field(None, description="Set the limits of this host (NQN) on the namespace; without it, "
                             "the namespace's. Limits not given stay as they are")


class NamespaceResize(_body("_ResizeFields", schema.NAMESPACE, only=("size",),  # type: ignore[misc]
                             sets={"size": "New capacity in bytes, a multiple of the block size"})):
    model_config = _example({"size": 2 << 30})

    allow_shrink: bool = Field(False, description="Allow a smaller size: hosts lose the namespace's tail, and a "
                                                  "file namespace that covered its whole file cuts the file")


# -- hosts ------------------------------------------------------------------------------------------


class HostAdd(_body("_HostFields", schema.HOST, notes={"dhchap_hash": "; default: the subsystem's",
                                                      "dhchap_dhgroup": "; default: the subsystem's"})):  # type: ignore[misc]
    model_config = _example(
        {"hostnqn": "nqn.2014-08.org.nvmexpress:uuid:0f2d2f36-8a4e-4a3b-9a52-3b1f1f2f7c11"}
    )


_AUTH_NOTES = {"dhchap_hash": "; null: the subsystem's", "dhchap_dhgroup": "; null: the subsystem's",
               "tls_key": "; null removes it", "tls_compat": "; null: false"}


class HostAuthSet(_body("_HostAuthFields", schema.HOST, skip=("nqn",), notes=_AUTH_NOTES)):  # type: ignore[misc]
    """Set, rotate or remove a host's DH-HMAC-CHAP settings: a field given replaces the current value,
    null removes it, an absent field stays as it is."""

    model_config = _example({"dhchap_key": "DHHC-1:00:<base64 of key and CRC-32>:"})


class SubsystemDhchapSet(_body("_SubsystemDhchapFields", schema.SUBSYSTEM,  # type: ignore[misc]
                               only=("dhchap_hash", "dhchap_dhgroup"))):
    model_config = _example({"dhchap_hash": ["sha512", "sha384"], "dhchap_dhgroup": ["ffdhe4096", "ffdhe3072"]})


class HostOut(BaseModel):
    hostnqn: str
    dhchap_key: bool = Field(description="A host secret is set: the host must authenticate (the secret is never shown)")
    dhchap_ctrl_key: bool = Field(description="A controller secret is set: bidirectional authentication is possible")
    dhchap_hash: list[str] | None = Field(None, description="The host's allowed hashes (null: the subsystem's)")
    dhchap_dhgroup: list[str] | None = Field(None, description="The host's allowed DH groups (null: the subsystem's)")
    tls_key: bool = Field(False, description="A TLS PSK is set for this host (the key is never shown)")
    tls_compat: bool = Field(False, description="Its NVMe0R TLS PSK is derived the libnvme compat way")


class HostsOut(BaseModel):
    allow_any_host: bool = Field(description="When true the host list is not enforced")
    hosts: list[str]
    entries: list[HostOut] = Field(default_factory=list, description="Each allowed host with its DH-HMAC-CHAP "
                                   "settings (secrets as presence flags)")


# -- listeners and referrals ------------------------------------------------------------------------


class ListenerCreate(_body("_ListenerFields", schema.LISTENER)):  # type: ignore[misc]
    model_config = _example({"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": 4420})


class ListenerOut(BaseModel):
    id: str
    trtype: str
    adrfam: str
    traddr: str
    trsvcid: int
    portid: int
    discovery: bool
    tls: TlsMode = "none"
    inline_data_size: int = Field(defaults.IO_INCAPSULE_SIZE,
                                  description=schema.LISTENER["inline_data_size"].description)
    ana_states: dict[str, AnaStateName] = Field(
        default_factory=dict, description="ANA state per group id on this listener; groups not listed are optimized")


class AnaStateSet(_body("_AnaStateFields", schema.ANA_STATE)):  # type: ignore[misc]
    model_config = _example({"state": "inaccessible"})


class AnaListenerOut(BaseModel):
    listener_id: str
    trtype: str
    traddr: str
    trsvcid: int
    portid: int
    discovery: bool
    states: dict[str, AnaStateName] = Field(description="Served state of every group in use or set, by group id")
    saved: dict[str, AnaStateName] = Field(description="The states the configuration keeps (the served ones may "
                                                       "differ while a gateway group manages them)")


class AnaGroupOut(BaseModel):
    anagrpid: int
    namespaces: list[dict[str, Any]] = Field(description="[{subnqn, nsid}] of the group's namespaces")


class AnaOut(BaseModel):
    groups: list[AnaGroupOut]
    listeners: list[AnaListenerOut]


class ReferralCreate(_body("_ReferralFields", schema.REFERRAL)):  # type: ignore[misc]
    model_config = _example({"trtype": "tcp", "traddr": "192.0.2.10", "trsvcid": 8009})


class ReferralOut(BaseModel):
    id: str
    trtype: str
    adrfam: str
    traddr: str
    trsvcid: int
    subnqn: str
    portid: int


# -- controllers ------------------------------------------------------------------------------------


class QueueOut(BaseModel):
    qid: int
    sqsize: int
    hdgst: bool = Field(False, description="NVMe/TCP header digest (CRC32C) enabled on this queue")
    ddgst: bool = Field(False, description="NVMe/TCP data digest (CRC32C) enabled on this queue")
    worker_pid: int | None = Field(None, description="With `nvmeof serve --workers N`: the process ID of the "
                                   "worker serving this I/O queue; null when the main process serves it")


class ControllerOut(BaseModel):
    cntlid: int
    subnqn: str
    hostnqn: str
    hostid: str = Field(description="Host identifier, 32 hexadecimal digits")
    peer: str = Field(description="Host transport address of the admin queue")
    transport: str
    queues: list[QueueOut] = Field(description="Connected queues, admin queue (qid 0) included")
    kato_ms: int
    connected_since: float = Field(description="Unix time of the admin queue Connect")
    enabled: bool = Field(description="CC.EN is set")


# -- config, health, version ------------------------------------------------------------------------


class ImportResult(BaseModel):
    errors: list[str] = Field(description="Items that could not be applied; everything else was")
    warnings: list[str] = Field(default_factory=list, description="What the conversion could not carry over")


class UnrestoredOut(BaseModel):
    kind: Literal["subsystem", "namespace", "listener", "referral"]
    where: str = Field(description="Its place in the configuration it came from")
    subsystem: str | None = Field(None, description="The subsystem of a namespace")
    error: str = Field(description="Why it could not be restored")
    item: dict[str, Any] = Field(description="The configuration entry, kept as it is in the file")


class NvmetcliExport(BaseModel):
    nvmetcli: dict[str, Any] = Field(description="A dump `nvmetcli restore` reads")
    warnings: list[str] = Field(description="What the kernel target cannot express, left out or changed")


class Liveness(BaseModel):
    status: Literal["ok"]


class Health(BaseModel):
    status: Literal["ok"]
    subsystems: int
    controllers: int


class Version(BaseModel):
    version: str
    api: str = "v1"
    nvme_version: str


class ErrorOut(BaseModel):
    detail: str


class DisconnectedOut(BaseModel):
    disconnected: int = Field(description="How many controllers were disconnected by this change (their hosts "
                                          "lose access at once)")
