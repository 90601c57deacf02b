"""What every part of TargetService shares beyond target/schema.py's checks: ServiceError, and the checks
whose refusals come from elsewhere (NQNs, masking, host authentication) turned into ServiceErrors.

A leaf: it imports nothing of the service, so each resource module (subsystems, hosts, namespaces,
listeners, ANA, replay, reload) takes its errors and checks from here. The fields' own checks (ranges,
addresses, identifiers) are target/schema.py's, called directly: their SchemaError is a ServiceError(400).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from target import hostauth, masking, schema
from target.model import Namespace, Subsystem, endpoint_id
from target.nqn import NqnError, validate_nqn
from target.schema import SchemaError
from target.schema import ServiceError as ServiceError  # declared beside SchemaError, its 400


def _bad(message: str) -> ServiceError:
    return ServiceError(400, message)


def _nqn(value: Any, what: str) -> str:
    try:
        return validate_nqn(value, what=what)
    except NqnError as exc:
        raise _bad(str(exc)) from None


def _masking(check: Callable[[], Any]) -> Any:
    try:
        return check()
    except masking.MaskingError as exc:
        raise ServiceError(exc.status, exc.message) from None


def _visibility(sub: Subsystem, nsid: int, auto_visible: Any, hosts: Any) -> tuple[bool, set[str]]:
    return _masking(lambda: masking.check_visibility(sub, nsid, auto_visible, hosts))


def _restore_hosts(dropped: list[tuple[Namespace, str]]) -> None:
    """Undo masking.drop_unadmitted."""
    for ns, hostnqn in dropped:
        ns.hosts.add(hostnqn)


async def _nothing() -> None:
    return None


def _given(item: dict[str, Any], key: str, default: Any) -> Any:
    """The item's value for ``key``, or ``default`` when absent or null (a 0 or "" stays, to be refused)."""
    value = item.get(key)
    return default if value is None else value


def _endpoint_key(item: dict[str, Any]) -> str | None:
    """The listener/referral id an item would get, or None if its address does not parse."""
    try:
        trtype, _, traddr, port = schema.check_address(_given(item, "trtype", "tcp"), item.get("traddr"),
                                                       item.get("trsvcid"), item.get("adrfam"))
    except SchemaError:
        return None
    return endpoint_id(trtype, traddr, port)


def _show(value: Any) -> str:
    return value.hex() if isinstance(value, bytes) else str(value)


def _host_auth(hostnqn: str, settings: dict[str, Any], base: Any = None) -> Any:
    """hostauth.build with its refusal as a 400 (the message names the field, never the secret)."""
    if not isinstance(settings, dict):
        raise _bad(f"DH-HMAC-CHAP settings of host {hostnqn} must be an object, got {type(settings).__name__}")
    try:
        return hostauth.build(hostnqn, settings, base)
    except hostauth.AuthSettingError as exc:
        raise _bad(str(exc)) from None


def _split_hosts(hosts: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    """A config ``hosts`` list (NQN strings, or objects {"nqn", "dhchap_key", ...}) as the NQNs and
    the settings per NQN."""
    if not isinstance(hosts, list | tuple):
        return hosts, {}
    nqns: list[Any] = []
    settings: dict[str, dict[str, Any]] = {}
    for host in hosts:
        if isinstance(host, dict):
            nqns.append(host.get("nqn"))
            settings[host.get("nqn")] = {k: v for k, v in host.items() if k != "nqn"}
        else:
            nqns.append(host)
    return nqns, settings
