"""Model objects (target.model, target.controller) to response schemas."""

from __future__ import annotations

from typing import Any

from api import schemas
from nvmeof.spec.logs import ANA_STATE_NAMES
from nvmeof.spec.reservations import RTYPE_NAMES
from target import hostauth
from target.backends import OPTION_KEYS


def namespace(ns: Any) -> schemas.NamespaceOut:
    described = ns.backend.describe()
    path = ns.spec.get("path") or described.get("path")
    return schemas.NamespaceOut(
        nsid=ns.nsid,
        backend=ns.spec.get("backend") or described.get("kind") or ns.backend.kind,
        path=str(path) if path else None,
        size=ns.backend.size,
        block_size=ns.block_size,
        blocks=ns.nsze,
        uuid=str(ns.uuid),
        nguid=bytes(ns.nguid).hex(),
        eui64=bytes(ns.eui64).hex(),
        read_only=ns.read_only or ns.backend.read_only,
        enabled=ns.enabled,
        anagrpid=ns.anagrpid,
        reservation=RTYPE_NAMES.get(ns.pr.rtype, "none") if ns.pr.rtype else "none",
        registrants=len(ns.pr.registrants),
        auto_visible=ns.auto_visible,
        hosts=sorted(ns.hosts),
        qos=None if ns.qos is None else schemas.NamespaceQosOut(**ns.qos.limits.as_dict(), hosts={
            h: schemas.QosLimitsOut(**lim.as_dict()) for h, lim in sorted(ns.qos.host_limits.items())}),
        **{key: ns.spec[key] for key in OPTION_KEYS if key in ns.spec},
    )


def subsystem(sub: Any) -> schemas.SubsystemOut:
    return schemas.SubsystemOut(
        nqn=sub.nqn,
        serial=sub.serial,
        model=sub.model,
        allow_any_host=sub.allow_any_host,
        hosts=sorted(sub.hosts),
        max_namespaces=sub.max_namespaces,
        subtype=sub.subtype,
        namespaces=[namespace(ns) for _, ns in sorted(sub.namespaces.items())],
        dhchap_hash=hostauth.hash_names(sub.dhchap_hash),
        dhchap_dhgroup=hostauth.dhgroup_names(sub.dhchap_dhgroup),
    )


def host(hostnqn: str, entry: Any) -> schemas.HostOut:
    """One allowed host; its secrets only as whether they are set (the API never returns a secret)."""
    return schemas.HostOut(
        hostnqn=hostnqn,
        dhchap_key=entry is not None and entry.dhchap_key is not None,
        dhchap_ctrl_key=entry is not None and entry.dhchap_ctrl_key is not None,
        dhchap_hash=hostauth.hash_names(entry.dhchap_hash) if entry is not None else None,
        dhchap_dhgroup=hostauth.dhgroup_names(entry.dhchap_dhgroup) if entry is not None else None,
        tls_key=entry is not None and entry.tls_key is not None,
        tls_compat=entry is not None and entry.tls_compat,
    )


def hosts(sub: Any) -> schemas.HostsOut:
    return schemas.HostsOut(allow_any_host=sub.allow_any_host, hosts=sorted(sub.hosts),
                            entries=[host(h, sub.host_auth.get(h)) for h in sorted(sub.hosts)])


def stats(ns: Any) -> schemas.NamespaceStatsOut:
    return schemas.NamespaceStatsOut(**ns.stats.as_dict())


def listener(lst: Any) -> schemas.ListenerOut:
    return schemas.ListenerOut(
        id=lst.id, trtype=lst.trtype, adrfam=lst.adrfam, traddr=lst.traddr, trsvcid=int(lst.trsvcid),
        portid=lst.portid, discovery=lst.discovery, tls=lst.tls, inline_data_size=lst.inline_data_size,
        ana_states={str(g): ANA_STATE_NAMES[st] for g, st in sorted(lst.ana_states.items())},
    )


def referral(ref: Any) -> schemas.ReferralOut:
    return schemas.ReferralOut(
        id=ref.id, trtype=ref.trtype, adrfam=ref.adrfam, traddr=ref.traddr, trsvcid=int(ref.trsvcid),
        subnqn=ref.subnqn, portid=ref.portid,
    )


def controller(info: dict[str, Any]) -> schemas.ControllerOut:
    return schemas.ControllerOut.model_validate(info)
