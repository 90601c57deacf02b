"""One declaration, three doors: a field's range or vocabulary in target/schema.py is what the configuration
file, the REST API and a direct TargetService call each accept and refuse (issue 27).

Each case takes its values from the declaration only, so a door that keeps a rule of its own (a narrower
range, an off-by-one, a forgotten check, a name list of its own) fails here: the value just outside must be
refused by all three with a message naming the field, the bounds (or every declared name) accepted by all
three.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import pytest

from nvmeof.spec.identify import NSID_MAX
from target import config as configmod
from target import schema
from target.backends import BACKEND_OPTIONS, BackendError, backend_class
from target.model import endpoint_id
from target.service import ServiceError
from tests.ports import free_port

SUBS = "/api/v1/subsystems"
_ids = itertools.count(1)


@dataclass(frozen=True)
class Case:
    """``field`` of a ``kind`` item: the values every door must refuse and accept; ``words``: how the
    service's message names the field where it does not spell the key."""

    kind: str
    field: str
    refused: tuple[Any, ...]
    accepted: tuple[Any, ...]
    words: str | None = None
    opens: bool = False  # a backend kind's setting: a value taken is seen reaching the backend's open

    @property
    def id(self) -> str:
        return f"{self.kind}.{self.field}"


def _ranged(kind: str, field: str, *, accept: tuple[int, ...] | None = None, words: str | None = None,
            typed: bool = True) -> Case:
    """A field with a declared IntField: one outside each end refused, and a value of another JSON type (a
    boolean, a float); the bounds accepted (``accept``: the in-range values to try instead, where a bound cannot
    stand on its own for another reason; ``typed`` False: the value is text where it goes, a URL's path or a
    JSON object's key, so JSON's types do not apply)."""
    fields = {"qos": schema.QOS, "ana": {"anagrpid": schema.NAMESPACE["anagrpid"]}}.get(kind) or schema.ITEMS[kind]
    limit = fields[field].range
    assert limit is not None
    accepted = (limit.low, limit.high) if accept is None else accept
    other_types = (True, float(limit.high)) if typed else ()
    return Case(kind, field, (limit.low - 1, limit.high + 1, *other_types), accepted, words)


def _option(kind: str, field: str, *, accept: bool = True) -> Case:
    """A setting backend ``kind`` declares (target.backends.BACKEND_OPTIONS): one past each length bound and a
    value of another JSON type refused, each bound taken (``accept`` False: the value must also be one the
    operator allowed, a Ceph file, so only the refusals are tried)."""
    declared = BACKEND_OPTIONS[kind][field]
    assert declared.min_length is not None and declared.max_length is not None
    refused = ("x" * (declared.max_length + 1), "x" * (declared.min_length - 1), 5)
    accepted = ("x" * declared.min_length, "x" * declared.max_length) if accept else ()
    return Case(kind, field, refused, accepted, opens=True)


CASES = [
    _ranged("subsystem", "max_namespaces"),
    _ranged("namespace", "nsid"),
    _ranged("namespace", "anagrpid"),
    # a size is a multiple of the block size too: the bounds themselves are refused for that
    _ranged("namespace", "size", accept=(512,)),
    # a listener binds its trsvcid: its range is tried on the referral (the same TRSVCID), its refusals here
    _ranged("listener", "trsvcid", accept=()),
    _ranged("listener", "portid"),
    # in 16-byte units (IOCCSZ) up to MDTS: a size off the unit is refused inside the range too
    Case("listener", "inline_data_size", (-16, 0x100010, 8200, True, 16384.0, "x"), (0, 16, 131072, 0x100000)),
    _ranged("referral", "trsvcid"),
    _ranged("referral", "portid"),
    _ranged("qos", "rw_ios_per_second"),
    _ranged("qos", "w_mbytes_per_second"),
    # the vocabularies: every declared name taken, one more refused
    Case("namespace", "block_size", (1024, 0), schema.BLOCK_SIZES, words="block size"),
    Case("referral", "trtype", ("fc", "TCP"), schema.TRTYPES, words="transport type"),
    Case("listener", "tls", ("maybe",), ("none", "optional", "required")),
    Case("namespace", "read_only", ("yes", 1), (True, False)),  # a boolean is JSON's, nothing else
    # a group's ANA state on a listener: the file's ana_states, PUT .../ana/<anagrpid>, set_ana_state
    Case("ana", "state", ("bogus", 3), tuple(get_args(schema.AnaStateName)), words="ANA state"),
    _ranged("ana", "anagrpid", words="ANA group", typed=False),  # the file's key, the URL's path
    # a backend kind's own settings, refused before the backend opens (no Ceph needed)
    _option("rbd", "pool"),
    _option("rbd", "image"),
    _option("rbd", "rbd_namespace"),
    _option("rbd", "ceph_id"),
    _option("rbd", "ceph_conf", accept=False),
]
# What the rbd backend's open raises in these tests: a value seen here passed every check of its door
OPENED = "reached the rbd backend's open"


def _nqn() -> str:
    return f"nqn.2024-01.com.example:doors{next(_ids)}"


def _item(case: Case, value: Any) -> dict[str, Any]:
    """The configuration item (and REST body) that sets ``case.field`` to ``value``, unique in the target."""
    if case.kind == "subsystem":
        return {"nqn": _nqn(), case.field: value}
    if case.kind in ("namespace", "qos"):
        return {"backend": "null", "size": 1 << 20, case.field: value}
    if case.kind == "rbd":  # storage of its own each time: one refused at open stays pending in a replay
        n = next(_ids)
        return {"backend": "rbd", "pool": f"pool{n}", "image": f"image{n}", case.field: value}
    if case.kind == "listener":
        return {"traddr": "127.0.0.1", "trsvcid": free_port(), case.field: value}
    # referrals listen on nothing: an address of their own keeps them apart
    return {"traddr": f"192.0.2.{next(_ids) % 250 + 1}", "trsvcid": 8009 + next(_ids), case.field: value}


def _subsystem(client: Any) -> str:
    """A subsystem that takes any NSID, for the namespace and QoS cases."""
    nqn = _nqn()
    client.portal.call(lambda: client.app.state.service.add_subsystem(nqn, max_namespaces=NSID_MAX))
    return nqn


def _ana(case: Case, value: Any) -> tuple[Any, Any]:
    """The ANA group and state an "ana" case sets."""
    return (value, "inaccessible") if case.field == "anagrpid" else (2, value)


def _listener(client: Any) -> int:
    """A listener on a free port of 127.0.0.1, for the ANA cases: its port."""
    port = free_port()
    client.portal.call(lambda: client.app.state.service.add_listener("tcp", "127.0.0.1", port))
    return port


def _via_rest(client: Any, case: Case, value: Any) -> tuple[bool, str]:
    item = _item(case, value)
    if case.kind == "ana":
        grp, state = _ana(case, value)
        response = client.put(f"/api/v1/listeners/tcp/127.0.0.1/{_listener(client)}/ana/{grp}", json={"state": state})
    elif case.kind == "subsystem":
        response = client.post(SUBS, json=item)
    elif case.kind in ("namespace", "rbd"):
        response = client.post(f"{SUBS}/{_subsystem(client)}/namespaces", json=item)
    elif case.kind == "qos":
        nqn = _subsystem(client)
        assert client.post(f"{SUBS}/{nqn}/namespaces", json={"backend": "null", "size": 1 << 20}).status_code == 201
        response = client.put(f"{SUBS}/{nqn}/namespaces/1/qos", json={case.field: value})
    else:
        response = client.post(f"/api/v1/{case.kind}s", json=item)
    if response.status_code < 300:
        return True, ""
    assert response.status_code in (400, 422), response.text
    return False, json.dumps(response.json()["detail"])


def _via_service(client: Any, case: Case, value: Any) -> tuple[bool, str]:
    service = client.app.state.service
    item = _item(case, value)
    call: Callable[[], Any]
    if case.kind == "ana":
        grp, state = _ana(case, value)
        lid = endpoint_id("tcp", "127.0.0.1", _listener(client))
        call = lambda: service.set_ana_state(lid, grp, state)  # noqa: E731
    elif case.kind == "subsystem":
        call = lambda: service.add_subsystem(item.pop("nqn"), **item)  # noqa: E731
    elif case.kind == "namespace":
        nqn = _subsystem(client)
        call = lambda: service.add_namespace(nqn, **item)  # noqa: E731
    elif case.kind == "rbd":
        nqn = _subsystem(client)
        call = lambda: service.add_namespace(nqn, backend=item.pop("backend"), options=item)  # noqa: E731
    elif case.kind == "qos":
        nqn = _subsystem(client)
        client.portal.call(lambda: service.add_namespace(nqn, backend="null", size=1 << 20))
        call = lambda: service.set_namespace_qos(nqn, 1, {case.field: value})  # noqa: E731
    elif case.kind == "listener":
        call = lambda: service.add_listener("tcp", item.pop("traddr"), item.pop("trsvcid"), **item)  # noqa: E731
    else:
        call = lambda: service.add_referral(item.pop("traddr"), item.pop("trsvcid"), **item)  # noqa: E731
    try:
        client.portal.call(call)
    except ServiceError as exc:
        assert exc.status == 400, exc.message
        return False, exc.message
    return True, ""


def _via_config_file(client: Any, case: Case, value: Any, path: Any) -> tuple[bool, str]:
    """The daemon's start-up: the file is loaded (its structure checked) and replayed through the service."""
    item = _item(case, value)
    config: dict[str, Any] = {"version": 1}
    if case.kind == "ana":
        grp, state = _ana(case, value)
        config["listeners"] = [{"traddr": "127.0.0.1", "trsvcid": free_port(), "ana_states": {str(grp): state}}]
    elif case.kind == "subsystem":
        config["subsystems"] = [item]
    elif case.kind in ("namespace", "qos", "rbd"):
        if case.kind == "qos":
            item = {"backend": "null", "size": 1 << 20, "qos": {case.field: value}}
        config["subsystems"] = [{"nqn": _nqn(), "max_namespaces": NSID_MAX, "namespaces": [item]}]
    else:
        config[f"{case.kind}s"] = [{"trtype": "tcp", **item}]
    path.write_text(json.dumps(config))
    try:
        loaded = configmod.load_config(path)
    except configmod.ConfigError as exc:
        return False, str(exc)
    errors = client.portal.call(lambda: client.app.state.service.restore(loaded))
    return not errors, "\n".join(errors)


DOORS = {"config file": _via_config_file, "REST": _via_rest, "service": _via_service}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_door_keeps_the_declared_rule(client: Any, tmp_path: Any, monkeypatch: Any, case: Case) -> None:
    if case.opens:  # the storage itself is out of reach here: a value that gets as far as opening it was taken
        def no_storage(cls: Any, spec: Any, policy: Any = None) -> Any:
            raise BackendError(OPENED)
        monkeypatch.setattr(backend_class(case.kind), "open", classmethod(no_storage))

    def through(door: str, value: Any) -> tuple[bool, str]:
        if door == "config file":
            ok, message = _via_config_file(client, case, value, tmp_path / f"restore{next(_ids)}.json")
        else:
            ok, message = DOORS[door](client, case, value)
        return ok or (case.opens and OPENED in message), message

    for value in case.refused:
        for door in DOORS:
            ok, message = through(door, value)
            assert not ok, f"{door} took {case.kind} {case.field}={value!r}, which {case.accepted} does not hold"
            named = case.field in message or (case.words is not None and case.words in message)
            assert named, f"{door}'s refusal of {case.field}={value!r} does not name it: {message}"
    service = client.app.state.service
    for value in case.accepted:
        for door in DOORS:
            ok, message = through(door, value)
            assert ok, f"{door} refused {case.kind} {case.field}={value}, which the declaration takes: {message}"
            for lid in list(service.target.listeners):  # its portid is free again for the next door
                client.portal.call(service.remove_listener, lid)
