"""Model objects (target.model, target.controller) to response schemas."""

from __future__ import annotations

from typing import Any

from api import schemas


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
    )


def stats(ns: Any) -> schemas.NamespaceStatsOut:
    return schemas.NamespaceStatsOut(**ns.stats.as_dict())


def listener(lst: Any) -> schemas.ListenerOut:
    return schemas.ListenerOut(
        id=lst.id, trtype=lst.trtype, adrfam=lst.adrfam, traddr=lst.traddr, trsvcid=int(lst.trsvcid),
        portid=lst.portid, discovery=lst.discovery,
    )


def referral(ref: Any) -> schemas.ReferralOut:
    return schemas.ReferralOut(
        id=ref.id, trtype=ref.trtype, adrfam=ref.adrfam, traddr=ref.traddr, trsvcid=int(ref.trsvcid),
        subnqn=ref.subnqn, portid=ref.portid,
    )


def controller(info: dict[str, Any]) -> schemas.ControllerOut:
    return schemas.ControllerOut.model_validate(info)
