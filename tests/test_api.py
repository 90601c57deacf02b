"""The REST management API through FastAPI's TestClient, against a real Target and TargetService."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import types
import uuid

import httpx
import pytest
from fastapi.testclient import TestClient

import api.deps
from api.app import create_app
from api.auth import HostPolicy
from nvmeof import __version__, defaults
from target import config as configmod
from target.core import Target
from target.service import TargetService
from tests.api_client import AUTH, TOKEN, open_client
from tests.ports import free_port

NQN = "nqn.2024-01.com.example:disk1"
NQN2 = "nqn.2024-01.com.example:disk2"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:0f2d2f36-8a4e-4a3b-9a52-3b1f1f2f7c11"
SUBS = "/api/v1/subsystems"
ENC = NQN.replace(":", "%3A")


def ns_url(nqn: str = NQN, nsid: int | None = None, action: str = "") -> str:
    url = f"{SUBS}/{nqn}/namespaces"
    if nsid is not None:
        url += f"/{nsid}"
    return url + (f"/{action}" if action else "")


@pytest.fixture
def populated(client):
    """One subsystem with one 1 MiB RAM namespace, so the config file exists."""
    assert client.post(SUBS, json={"nqn": NQN}).status_code == 201
    assert client.post(ns_url(), json={"backend": "ram", "size": 1 << 20}).status_code == 201
    return client


def detail(response) -> str:
    return json.dumps(response.json()["detail"])


# -- subsystems -------------------------------------------------------------------------------------


def test_subsystem_create_list_show_delete(client, config_path):
    r = client.post(SUBS, json={"nqn": NQN, "serial": "SN1", "model": "M1", "max_namespaces": 8})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body == {"nqn": NQN, "serial": "SN1", "model": "M1", "allow_any_host": True, "hosts": [],
                    "max_namespaces": 8, "subtype": "nvm", "namespaces": [], "dhchap_hash": None,
                    "dhchap_dhgroup": None}
    assert [s["nqn"] for s in client.get(SUBS).json()] == [NQN]
    # The NQN's colon works both raw and percent-encoded in the path.
    assert client.get(f"{SUBS}/{NQN}").json()["serial"] == "SN1"
    assert client.get(f"{SUBS}/{ENC}").json()["serial"] == "SN1"
    assert json.loads(config_path.read_text())["subsystems"][0]["nqn"] == NQN
    r = client.delete(f"{SUBS}/{ENC}")
    assert r.status_code == 200 and r.json() == {"disconnected": 0}
    assert client.get(SUBS).json() == []
    assert json.loads(config_path.read_text())["subsystems"] == []


def test_subsystem_generated_nqn_and_serial(client):
    body = client.post(SUBS, json={}).json()
    assert body["nqn"].startswith("nqn.2014-08.org.nvmexpress:uuid:")
    uuid.UUID(body["nqn"].rsplit(":", 1)[1])
    assert len(body["serial"]) == 20


def test_subsystem_with_hosts_defaults_to_host_list(client):
    body = client.post(SUBS, json={"nqn": NQN, "hosts": [HOSTNQN]}).json()
    assert body["allow_any_host"] is False and body["hosts"] == [HOSTNQN]


@pytest.mark.parametrize(("payload", "status", "words"), [
    ({"nqn": "iqn.2024-01.com.example:x"}, 400, "not of the form"),
    ({"nqn": "nqn.2024-13.com.example:x"}, 400, "month 13"),
    ({"nqn": "nqn.2024-01.com.example:a/b"}, 400, "'/'"),
    ({"nqn": defaults.DISCOVERY_NQN}, 400, "reserved discovery NQN"),
    ({"nqn": NQN, "serial": "x" * 21}, 422, "serial"),
    ({"nqn": NQN, "serial": "caf\u00e9"}, 400, "printable ASCII"),
    ({"nqn": NQN, "allow_any_host": True, "hosts": [HOSTNQN]}, 400, "either allow_any_host or a list"),
    ({"nqn": NQN, "hosts": ["not-an-nqn"]}, 400, "host NQN 'not-an-nqn'"),
    ({"nqn": 5}, 422, "nqn"),
    ({"nqn": NQN, "max_namespaces": 0}, 422, "max_namespaces"),
    ({"nqn": NQN, "maxnamespaces": 3}, 422, "maxnamespaces"),
])
def test_subsystem_create_refused(client, payload, status, words):
    r = client.post(SUBS, json=payload)
    assert r.status_code == status, r.text
    assert words in detail(r)
    assert client.get(SUBS).json() == []


def test_subsystem_duplicate_and_missing(client):
    client.post(SUBS, json={"nqn": NQN})
    r = client.post(SUBS, json={"nqn": NQN})
    assert r.status_code == 409 and "already exists" in r.json()["detail"]
    r = client.get(f"{SUBS}/{NQN2}")
    assert r.status_code == 404 and NQN2 in r.json()["detail"]
    assert client.delete(f"{SUBS}/{NQN2}").status_code == 404


def test_subsystem_delete_with_namespaces_needs_force(populated, service, config_path):
    before = config_path.read_bytes()
    r = populated.delete(f"{SUBS}/{NQN}")
    assert r.status_code == 409 and "force" in r.json()["detail"]
    assert config_path.read_bytes() == before
    assert service.get_subsystem(NQN).namespaces
    assert populated.delete(f"{SUBS}/{NQN}", params={"force": "true"}).json() == {"disconnected": 0}
    assert populated.get(SUBS).json() == []


# -- namespaces -------------------------------------------------------------------------------------


def test_namespace_lifecycle(populated, service):
    ns = populated.get(ns_url(nsid=1)).json()
    assert ns["backend"] == "ram" and ns["size"] == 1 << 20 and ns["blocks"] == 2048 and ns["enabled"]
    r = populated.post(ns_url(), json={"backend": "null", "size": 1 << 30, "block_size": 4096})
    assert r.status_code == 201 and r.json()["nsid"] == 2 and r.json()["blocks"] == 1 << 18
    assert [n["nsid"] for n in populated.get(ns_url()).json()] == [1, 2]
    assert [n["nsid"] for n in populated.get(ns_url(ENC)).json()] == [1, 2]

    r = populated.post(ns_url(nsid=1, action="resize"), json={"size": 2 << 20})
    assert r.status_code == 200 and r.json()["size"] == 2 << 20 and r.json()["blocks"] == 4096
    assert service.get_namespace(NQN, 1).backend.size == 2 << 20

    assert populated.post(ns_url(nsid=2, action="disable")).json()["enabled"] is False
    assert service.get_namespace(NQN, 2).enabled is False
    assert populated.post(ns_url(nsid=2, action="enable")).json()["enabled"] is True

    assert populated.delete(ns_url(nsid=2)).status_code == 204
    assert populated.get(ns_url(nsid=2)).status_code == 404
    # The lowest free NSID is reused.
    assert populated.post(ns_url(), json={"backend": "ram", "size": 4096}).json()["nsid"] == 2


def test_namespace_given_identifiers(populated):
    wanted = {"uuid": str(uuid.uuid4()), "nguid": "11" * 16, "eui64": "22" * 8, "nsid": 7}
    r = populated.post(ns_url(), json={"backend": "ram", "size": 4096, **wanted})
    assert r.status_code == 201, r.text
    assert {k: r.json()[k] for k in wanted} == wanted
    r = populated.post(ns_url(), json={"backend": "ram", "size": 4096, "uuid": wanted["uuid"]})
    assert r.status_code == 409 and "already used by namespace 7" in r.json()["detail"]


def test_namespace_file_backend(populated, tmp_path):
    path = tmp_path / "disk.img"
    path.write_bytes(bytes(1 << 20))
    r = populated.post(ns_url(), json={"backend": "file", "path": str(path)})
    assert r.status_code == 201, r.text
    assert r.json()["path"] == str(path) and r.json()["size"] == 1 << 20
    created = tmp_path / "new.img"
    r = populated.post(ns_url(), json={"backend": "file", "path": str(created), "size": 8192, "create": True})
    assert r.status_code == 201 and created.stat().st_size == 8192
    r = populated.post(ns_url(), json={"backend": "file", "path": str(path)})
    assert r.status_code == 409 and "already backs namespace" in r.json()["detail"]


@pytest.mark.parametrize(("payload", "status", "words"), [
    ({"backend": "file", "path": "/nonexistent/disk.img"}, 400, "/nonexistent/disk.img"),
    ({"backend": "file"}, 400, "needs a path"),
    ({"backend": "ram", "size": 1000}, 400, "not a multiple of the block size 512"),
    ({"backend": "ram", "size": 4096, "block_size": 1024}, 400, "block size"),
    ({"backend": "ram"}, 400, "needs a size"),
    ({"backend": "ram", "size": 4096, "nsid": 1}, 409, "NSID 1 is already in use"),
    ({"backend": "ram", "size": 4096, "nguid": "00" * 16}, 400, "all zeros"),
    ({"backend": "ram", "size": 4096, "nguid": "xyz"}, 422, "nguid"),
    ({"backend": "ram", "size": 4096, "uuid": "nope"}, 422, "uuid"),
    ({"backend": "ram", "size": 4096, "nsid": 0}, 422, "nsid"),
    ({"backend": "tape", "size": 4096}, 422, "backend"),
    ({"backend": "ram", "size": -1}, 422, "size"),
])
def test_namespace_add_refused(populated, payload, status, words):
    r = populated.post(ns_url(), json=payload)
    assert r.status_code == status, r.text
    assert words in detail(r)
    assert [n["nsid"] for n in populated.get(ns_url()).json()] == [1]


def test_namespace_routes_on_missing_objects(populated):
    assert populated.post(ns_url(NQN2), json={"backend": "ram", "size": 4096}).status_code == 404
    assert populated.get(ns_url(NQN2)).status_code == 404
    for method, action in (("get", ""), ("delete", ""), ("post", "enable"), ("post", "disable"),
                           ("get", "stats")):
        r = populated.request(method.upper(), ns_url(nsid=9, action=action))
        assert r.status_code == 404, (method, action)
        assert "no namespace 9" in r.json()["detail"]
    assert populated.post(ns_url(nsid=9, action="resize"), json={"size": 4096}).status_code == 404
    r = populated.get(ns_url(nsid=0))
    assert r.status_code == 422 and "nsid" in detail(r)


def test_namespace_resize_refused(populated, service):
    r = populated.post(ns_url(nsid=1, action="resize"), json={"size": 1000})
    assert r.status_code == 400 and "not a multiple of the block size 512" in r.json()["detail"]
    r = populated.post(ns_url(nsid=1, action="resize"), json={"size": 0})
    assert r.status_code == 422 and "size" in detail(r)
    r = populated.post(ns_url(nsid=1, action="resize"), json={})
    assert r.status_code == 422 and "size" in detail(r)
    assert service.get_namespace(NQN, 1).backend.size == 1 << 20


def test_namespace_stats(populated, service):
    assert populated.get(ns_url(nsid=1, action="stats")).json() == {
        "reads": 0, "writes": 0, "read_bytes": 0, "write_bytes": 0, "errors": 0,
        "read_latency_ns": 0, "write_latency_ns": 0, "throttled": 0, "throttled_ns": 0,
    }
    stats = service.get_namespace(NQN, 1).stats
    stats.reads, stats.read_bytes, stats.read_latency_ns, stats.errors = 3, 12288, 4500, 1
    body = populated.get(ns_url(nsid=1, action="stats")).json()
    assert (body["reads"], body["read_bytes"], body["read_latency_ns"], body["errors"]) == (3, 12288, 4500, 1)


# -- hosts ------------------------------------------------------------------------------------------


def test_hosts_allow_list_deny(client, service):
    client.post(SUBS, json={"nqn": NQN, "allow_any_host": False})
    hosts = f"{SUBS}/{NQN}/hosts"
    r = client.post(hosts, json={"hostnqn": HOSTNQN})
    assert r.status_code == 201 and r.json() == {
        "allow_any_host": False, "hosts": [HOSTNQN],
        "entries": [{"hostnqn": HOSTNQN, "dhchap_key": False, "dhchap_ctrl_key": False, "dhchap_hash": None,
                     "dhchap_dhgroup": None, "tls_key": False, "tls_compat": False}]}
    assert client.get(hosts).json()["hosts"] == [HOSTNQN]
    assert service.get_subsystem(NQN).host_allowed(HOSTNQN)
    r = client.post(hosts, json={"hostnqn": HOSTNQN})
    assert r.status_code == 409 and "already allowed" in r.json()["detail"]
    r = client.post(hosts, json={"hostnqn": "host1"})
    assert r.status_code == 400 and "host NQN 'host1'" in r.json()["detail"]
    r = client.post(hosts, json={})
    assert r.status_code == 422 and "hostnqn" in detail(r)
    assert client.delete(f"{hosts}/{HOSTNQN.replace(':', '%3A')}").json() == {"disconnected": 0}
    assert not service.get_subsystem(NQN).host_allowed(HOSTNQN)
    r = client.delete(f"{hosts}/{HOSTNQN}")
    assert r.status_code == 404 and "not in the allowed hosts" in r.json()["detail"]


def test_host_allow_refused_when_any_host_allowed(client):
    client.post(SUBS, json={"nqn": NQN})
    r = client.post(f"{SUBS}/{NQN}/hosts", json={"hostnqn": HOSTNQN})
    assert r.status_code == 409 and "allow_any_host" in r.json()["detail"]
    assert client.post(f"{SUBS}/{NQN2}/hosts", json={"hostnqn": HOSTNQN}).status_code == 404


# -- listeners and referrals ------------------------------------------------------------------------


def test_listener_add_list_delete(client, service):
    port = free_port()
    r = client.post("/api/v1/listeners", json={"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": port})
    assert r.status_code == 201, r.text
    assert r.json() == {"id": f"tcp:127.0.0.1:{port}", "trtype": "tcp", "adrfam": "ipv4",
                        "traddr": "127.0.0.1", "trsvcid": port, "portid": 1, "discovery": False, "tls": "none",
                        "inline_data_size": 8192, "ana_states": {}}
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # it really listens
    assert [lst["trsvcid"] for lst in client.get("/api/v1/listeners").json()] == [port]
    r = client.post("/api/v1/listeners", json={"traddr": "127.0.0.1", "trsvcid": port})
    assert r.status_code == 409 and "already exists" in r.json()["detail"]
    assert client.delete(f"/api/v1/listeners/tcp/127.0.0.1/{port}").json() == {"disconnected": 0}
    assert client.get("/api/v1/listeners").json() == []
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    r = client.delete(f"/api/v1/listeners/tcp/127.0.0.1/{port}")
    assert r.status_code == 404 and f"tcp:127.0.0.1:{port}" in r.json()["detail"]


def test_listener_port_in_use(client, service):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = client.post("/api/v1/listeners", json={"traddr": "127.0.0.1", "trsvcid": port})
    assert r.status_code == 409, r.text
    assert "already in use" in r.json()["detail"]
    assert service.list_listeners() == []


@pytest.mark.parametrize(("payload", "status", "words"), [
    ({"trtype": "fc", "traddr": "127.0.0.1", "trsvcid": 4420}, 422, "trtype"),
    ({"traddr": "storage.example", "trsvcid": 4420}, 400, "not an IPv4 or IPv6 address"),
    ({"traddr": "127.0.0.1", "trsvcid": 70000}, 422, "trsvcid"),
    ({"traddr": "127.0.0.1", "trsvcid": 4420, "adrfam": "ipv6"}, 400, "is ipv4"),
])
def test_listener_refused(client, payload, status, words):
    r = client.post("/api/v1/listeners", json=payload)
    assert r.status_code == status, r.text
    assert words in detail(r)


def test_ipv6_listener_path(client):
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    r = client.post("/api/v1/listeners", json={"traddr": "::1", "trsvcid": port})
    assert r.status_code == 201 and r.json()["id"] == f"tcp:[::1]:{port}"
    # '0:0::1' names the same address as '::1'.
    assert client.delete(f"/api/v1/listeners/tcp/0:0::1/{port}").json() == {"disconnected": 0}


def test_referrals(client):
    r = client.post("/api/v1/referrals", json={"traddr": "10.0.0.2"})
    assert r.status_code == 201, r.text
    assert r.json() == {"id": "tcp:10.0.0.2:8009", "trtype": "tcp", "adrfam": "ipv4", "traddr": "10.0.0.2",
                        "trsvcid": 8009, "subnqn": defaults.DISCOVERY_NQN, "portid": 0}
    assert client.post("/api/v1/referrals", json={"traddr": "10.0.0.2"}).status_code == 409
    r = client.post("/api/v1/referrals", json={"traddr": "10.0.0.3", "subnqn": "bad"})
    assert r.status_code == 400 and "referral subsystem NQN" in r.json()["detail"]
    assert len(client.get("/api/v1/referrals").json()) == 1
    assert client.delete("/api/v1/referrals/tcp/10.0.0.2/8009").status_code == 204
    assert client.delete("/api/v1/referrals/tcp/10.0.0.2/8009").status_code == 404
    assert client.get("/api/v1/referrals").json() == []


# -- controllers ------------------------------------------------------------------------------------


def test_controllers_list_and_disconnect(populated, service):
    assert populated.get("/api/v1/controllers").json() == []
    target = service.target
    hostid = uuid.uuid4().bytes
    ctrl = target.create_controller(service.get_subsystem(NQN), HOSTNQN, hostid, 15000)
    [info] = populated.get("/api/v1/controllers").json()
    assert info["cntlid"] == ctrl.cntlid and info["subnqn"] == NQN and info["hostnqn"] == HOSTNQN
    assert info["hostid"] == hostid.hex() and info["kato_ms"] == 15000
    assert info["connected_since"] == pytest.approx(ctrl.created)
    r = populated.delete(f"/api/v1/controllers/{ctrl.cntlid}")
    assert r.status_code == 204
    assert ctrl.cntlid not in target.controllers and ctrl.closed
    r = populated.delete(f"/api/v1/controllers/{ctrl.cntlid}")
    assert r.status_code == 404 and f"cntlid {ctrl.cntlid}" in r.json()["detail"]
    assert populated.delete("/api/v1/controllers/70000").status_code == 422


# -- configuration ----------------------------------------------------------------------------------


def test_config_export_import_round_trip(populated, service, tmp_path):
    exported = populated.get("/api/v1/config").json()
    assert exported == service.snapshot()
    other = TargetService(Target(), config_path=tmp_path / "other.json")
    client2 = open_client(other)
    try:
        r = client2.post("/api/v1/config", json=exported)
        assert r.status_code == 200 and r.json() == {"errors": [], "warnings": []}
        assert client2.get("/api/v1/config").json() == exported
        # An import is a live change, so it is saved.
        assert json.loads((tmp_path / "other.json").read_text()) == exported
        # Importing again: every item now conflicts, each is reported, nothing else changes.
        r = client2.post("/api/v1/config", json=exported)
        assert r.status_code == 200 and any("already exists" in e for e in r.json()["errors"])
        assert client2.get("/api/v1/config").json() == exported
    finally:
        client2.portal.call(other.target.close)
        client2.__exit__(None, None, None)


def test_config_import_partial(client, service):
    config = {"version": 1, "subsystems": [
        {"nqn": NQN, "namespaces": [{"backend": "ram", "size": 4096}, {"backend": "ram", "size": 1000}]},
        {"nqn": "bad-nqn"},
    ]}
    r = client.post("/api/v1/config", json=config)
    assert r.status_code == 200
    errors = r.json()["errors"]
    assert len(errors) == 2
    # Subsystems are restored before namespaces, so the bad NQN is reported first.
    assert "bad-nqn" in errors[0] and "not a multiple of the block size" in errors[1]
    assert [ns.nsid for ns in service.list_namespaces(NQN)] == [1]


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"subsystems": []}, 400, "missing \\\"version\\\""),
    ({"version": 2}, 400, "version 2 is not supported"),
    ({"version": 1, "subsystems": [{"nqn": NQN, "colour": "red"}]}, 400, "unknown key 'colour'"),
    ({"version": 1, "ports": []}, 400, "import-nvmetcli"),
    ([1, 2], 422, "body"),
])
def test_config_import_refused_whole(populated, service, config_path, body, status, words):
    before_file, before = config_path.read_bytes(), service.snapshot()
    r = populated.post("/api/v1/config", json=body)
    assert r.status_code == status, r.text
    assert words in detail(r)
    assert service.snapshot() == before and config_path.read_bytes() == before_file


def test_nvmetcli_export_and_import(populated, service, tmp_path):
    path = tmp_path / "disk.img"
    path.write_bytes(bytes(1 << 20))
    populated.post(ns_url(), json={"backend": "file", "path": str(path), "nsid": 5})
    r = populated.get("/api/v1/config/nvmetcli")
    assert r.status_code == 200
    dump, warnings = r.json()["nvmetcli"], r.json()["warnings"]
    [sub] = dump["subsystems"]
    assert sub["nqn"] == NQN and [n["nsid"] for n in sub["namespaces"]] == [5]
    assert sub["namespaces"][0]["device"]["path"] == str(path)
    assert any("ram backend" in w for w in warnings)

    other = TargetService(Target(), backing_dirs=[tmp_path])
    client2 = open_client(other)
    try:
        r = client2.post("/api/v1/config/nvmetcli", json=dump)
        assert r.status_code == 200 and r.json()["errors"] == [], r.text
        [ns] = other.list_namespaces(NQN)
        assert (ns.nsid, ns.spec["path"]) == (5, str(path))
        assert str(ns.uuid) == str(service.get_namespace(NQN, 5).uuid)
        r = client2.post("/api/v1/config/nvmetcli", json={"subsystems": [{"nqn": NQN2, "allowed_hosts": 5}]})
        assert r.status_code == 400 and "malformed nvmetcli configuration" in r.json()["detail"], r.text
        assert [s.nqn for s in other.list_subsystems()] == [NQN]
    finally:
        client2.portal.call(other.target.close)
        client2.__exit__(None, None, None)


# -- health, version, metrics, docs -----------------------------------------------------------------


def test_health_version(populated):
    assert populated.get("/health").json() == {"status": "ok"}
    assert populated.get("/api/v1/health").json() == {"status": "ok", "subsystems": 1, "controllers": 0}
    version = populated.get("/version").json()
    assert version["version"] == __version__ and version["api"] == "v1"
    assert populated.get("/api/v1/version").json() == version


def test_metrics(populated, service):
    parser = pytest.importorskip("prometheus_client.parser")
    stats = service.get_namespace(NQN, 1).stats
    stats.reads, stats.read_bytes, stats.read_latency_ns = 4, 16384, 2_000_000
    stats.writes, stats.write_bytes, stats.write_latency_ns, stats.errors = 2, 1024, 500_000, 1
    service.target.create_controller(service.get_subsystem(NQN), HOSTNQN, bytes(16), 5000)
    r = populated.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in parser.text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, s.labels.get("nsid"))] = s.value
    assert samples[("nvmeof_namespace_reads_total", "1")] == 4
    assert samples[("nvmeof_namespace_read_bytes_total", "1")] == 16384
    assert samples[("nvmeof_namespace_written_bytes_total", "1")] == 1024
    assert samples[("nvmeof_namespace_errors_total", "1")] == 1
    assert samples[("nvmeof_namespace_read_latency_seconds_sum", "1")] == pytest.approx(0.002)
    assert samples[("nvmeof_namespace_read_latency_seconds_count", "1")] == 4
    assert samples[("nvmeof_namespace_write_latency_seconds_sum", "1")] == pytest.approx(0.0005)
    assert samples[("nvmeof_namespace_size_bytes", "1")] == 1 << 20
    assert samples[("nvmeof_controllers", None)] == 1
    assert samples[("nvmeof_subsystems", None)] == 1


def test_docs_and_schema(client):
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/api/v1/subsystems/{nqn}/namespaces/{nsid}/resize", "/api/v1/listeners/{trtype}/{traddr}/{trsvcid}",
                 "/api/v1/config/nvmetcli", "/api/v1/controllers/{cntlid}", "/metrics", "/health"):
        assert path in paths


# -- authentication ---------------------------------------------------------------------------------


@pytest.fixture
def secured(service):
    """A client that sends no token unless a test adds one."""
    client = open_client(service, authorized=False)
    yield client
    client.portal.call(service.target.close)
    client.__exit__(None, None, None)


def test_create_app_always_needs_a_token(service):
    with pytest.raises(TypeError):
        create_app(service)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="no unauthenticated mode"):
        create_app(service, token="")


@pytest.mark.parametrize("path", [SUBS, "/docs", "/openapi.json", "/metrics", "/version", "/api/v1/version",
                                  "/api/v1/health", "/api/v1/nothing"])
def test_auth_required(secured, path, caplog):
    with caplog.at_level(logging.WARNING, logger="nvmeof.api"):
        r = secured.get(path)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert "Authorization" in r.json()["detail"]
    # The refusal is logged with the client's address (TestClient's is 'testclient').
    assert any("testclient" in rec.getMessage() and path in rec.getMessage() for rec in caplog.records)


def test_only_health_is_open_and_it_tells_nothing(secured):
    r = secured.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_auth_wrong_and_right_token(secured):
    assert secured.get(SUBS, headers={"Authorization": "Bearer nope"}).json()["detail"] == "unauthorized: wrong token"
    r = secured.get(SUBS, headers={"Authorization": "Basic czNjcmV0"})
    assert r.status_code == 401 and "not Bearer" in r.json()["detail"]
    assert secured.get(SUBS, headers=AUTH).status_code == 200
    r = secured.post(SUBS, json={"nqn": NQN}, headers={"Authorization": f"bearer {TOKEN}"})
    assert r.status_code == 201
    schema = secured.get("/openapi.json", headers=AUTH).json()
    # /docs: the Authorize button offers the bearer scheme, and every route but /health asks for it.
    assert schema["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert "security" not in schema["paths"]["/health"]["get"]
    assert schema["paths"]["/api/v1/subsystems"]["get"]["security"] == [{"bearer": []}]
    assert "Authorize" in schema["info"]["description"]


def test_401_names_the_token_file(service):
    client = open_client(service, authorized=False, token_hint="/state/api-token on the target's machine")
    try:
        assert "/state/api-token" in client.get(SUBS).json()["detail"]
    finally:
        client.__exit__(None, None, None)


def test_login_link_sets_a_strict_session_cookie(secured, caplog):
    with caplog.at_level(logging.DEBUG):
        r = secured.get("/login", params={"token": "wrong"}, follow_redirects=False)
        assert r.status_code == 401 and "set-cookie" not in r.headers
        r = secured.get("/login", params={"token": TOKEN}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/docs"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
        assert TOKEN not in cookie
        # The browser now reaches /docs and, from it, the API (same-origin requests carry the cookie).
        assert secured.get("/docs").status_code == 200
        assert secured.post(SUBS, json={"nqn": NQN}, headers={"Origin": "http://testserver"}).status_code == 201
        secured.cookies.clear()
        secured.cookies.set("nvmeof_session", "forged")
        assert secured.get(SUBS).status_code == 401
    # Neither the login link (its query string) nor any refusal put the token into a log line of the
    # server (httpx, the test's client, logs the URL it requested itself).
    server = [rec for rec in caplog.records if not rec.name.startswith("httpx")]
    assert server and not any(TOKEN in rec.getMessage() for rec in server)


# -- request checks: Host, Origin, Content-Type, body size ------------------------------------------


@pytest.fixture
def bound(service):
    """The app as the daemon runs it on 127.0.0.1:8080, with one extra --api-host-name."""
    client = TestClient(create_app(service, token=TOKEN, hosts=HostPolicy.for_bind("127.0.0.1", 8080,
                                                                                   ["target.example"])),
                        base_url="http://127.0.0.1:8080", headers=AUTH)
    client.__enter__()
    yield client
    client.portal.call(service.target.close)
    client.__exit__(None, None, None)


@pytest.mark.parametrize(("host", "ok"), [
    ("127.0.0.1:8080", True), ("localhost:8080", True), ("LOCALHOST:8080", True), ("target.example:8080", True),
    ("evil.example:8080", False), ("127.0.0.1:9999", False), ("127.0.0.1", False), ("", False),
    ("localhost.evil.example:8080", False), ("[::1]:8080", False),
])
def test_host_header_must_name_the_api(bound, host, ok):
    r = bound.get(SUBS, headers={"Host": host})
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 403 and "Host header" in r.json()["detail"] and "--api-host-name" in r.json()["detail"]


def test_host_policy_of_other_binds():
    wildcard = HostPolicy.for_bind("0.0.0.0", 8080)
    assert wildcard.allows("192.0.2.7:8080") and wildcard.allows("[fe80::1]:8080")
    assert not wildcard.allows("evil.example:8080") and not wildcard.allows("192.0.2.7:8081")
    v6 = HostPolicy.for_bind("::1", 80, ["Mgmt.Example."])
    assert v6.allows("[::1]") and v6.allows("[::1]:80") and v6.allows("localhost") and v6.allows("mgmt.example")
    assert not v6.allows("::1") and not v6.allows("[::2]")


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:8081", "https://127.0.0.1:8080"])
def test_cross_origin_requests_are_refused(bound, service, origin):
    # The cross-site form POST of the issue: form-encoded, foreign Origin, disabled namespace 1.
    assert bound.post(SUBS, json={"nqn": NQN}).status_code == 201
    assert bound.post(ns_url(), json={"backend": "ram", "size": 1 << 20}).status_code == 201
    r = bound.post(ns_url(nsid=1, action="disable"), headers={"Origin": origin,
                   "Content-Type": "application/x-www-form-urlencoded"}, content=b"x=1")
    assert r.status_code == 403 and "Origin" in r.json()["detail"]
    assert service.get_namespace(NQN, 1).enabled
    r = bound.options(SUBS, headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403
    assert not [k for k in r.headers if k.lower().startswith("access-control-")]


def test_own_origin_is_accepted_and_no_cors_headers_are_sent(bound):
    r = bound.post(SUBS, json={"nqn": NQN}, headers={"Origin": "http://127.0.0.1:8080"})
    assert r.status_code == 201
    assert not [k for k in r.headers if k.lower().startswith("access-control-")]


@pytest.mark.parametrize(("headers", "content"), [
    ({"Content-Type": "application/x-www-form-urlencoded"}, b"nqn=x"),
    ({"Content-Type": "text/plain"}, b'{"nqn": "nqn.2024-01.com.example:disk1"}'),
    ({"Content-Type": "multipart/form-data; boundary=x"}, b"--x--"),
    ({}, b'{"nqn": "nqn.2024-01.com.example:disk1"}'),
    ({"Content-Type": "text/plain"}, b""),
])
def test_state_changing_requests_must_be_json(populated, service, headers, content):
    r = populated.post(SUBS, headers=headers, content=content)
    assert r.status_code == 415 and "application/json" in r.json()["detail"]
    r = populated.request("DELETE", f"{SUBS}/{NQN}", params={"force": "true"}, headers=headers, content=content)
    assert r.status_code == 415
    assert [s.nqn for s in service.list_subsystems()] == [NQN]


def test_bodyless_requests_need_no_content_type(populated, service):
    assert populated.post(ns_url(nsid=1, action="disable")).status_code == 200
    assert not service.get_namespace(NQN, 1).enabled
    r = populated.post(SUBS, content=json.dumps({"nqn": NQN2}), headers={"Content-Type": "application/json; "
                                                                                         "charset=utf-8"})
    assert r.status_code == 201


def test_body_over_the_cap_is_refused(service):
    client = open_client(service, max_body=1024)
    try:
        big = {"nqn": NQN, "model": "m", "hosts": ["x" * 2000]}
        r = client.post(SUBS, json=big)          # Content-Length over the cap: refused before reading
        assert r.status_code == 413 and "--api-max-body" in r.json()["detail"]
        chunks = iter([b'{"nqn": "', b"x" * 800, b"y" * 800, b'"}'])
        r = client.post(SUBS, content=chunks, headers={"Content-Type": "application/json"})  # chunked
        assert r.status_code == 413
        assert client.post(SUBS, json={"nqn": NQN}).status_code == 201
        assert [s.nqn for s in service.list_subsystems()] == [NQN]
        # Even an unauthenticated client learns the limit before the token is checked: no body is read.
        r = client.post(SUBS, json=big, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 413
    finally:
        client.__exit__(None, None, None)


def test_default_body_cap(client):
    r = client.post("/api/v1/config", content=b" " * (defaults.API_MAX_BODY + 1),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and str(defaults.API_MAX_BODY) in r.json()["detail"]


# -- strict types -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "payload", "field"), [
    (ns_url(), {"backend": "ram", "size": "1048576"}, "size"),
    (ns_url(), {"backend": "ram", "size": True}, "size"),
    (ns_url(), {"backend": "ram", "size": 1048576.0}, "size"),
    (ns_url(), {"backend": "ram", "size": 1 << 20, "read_only": "true"}, "read_only"),
    (ns_url(), {"backend": "ram", "size": 1 << 20, "nsid": True}, "nsid"),
    (ns_url(), {"backend": "file", "path": "/tmp/a\u0000b", "size": 4096, "create": True}, "path"),
    (SUBS, {"nqn": NQN2, "allow_any_host": "yes"}, "allow_any_host"),
    (SUBS, {"nqn": NQN2, "allow_any_host": 1}, "allow_any_host"),
    (SUBS, {"nqn": NQN2, "max_namespaces": "8"}, "max_namespaces"),
    (SUBS, {"nqn": "nqn.2024-01.com.example:a\u0000"}, "nqn"),
    (SUBS, {"nqn": NQN2, "hosts": [HOSTNQN + "\u0000"]}, "hosts"),
    (ns_url(nsid=1, action="resize"), {"size": "2097152"}, "size"),
    ("/api/v1/listeners", {"traddr": "127.0.0.1", "trsvcid": "4420"}, "trsvcid"),
    ("/api/v1/listeners", {"traddr": "127.0.0.1", "discovery": "false"}, "discovery"),
    ("/api/v1/referrals", {"traddr": "192.0.2.1", "portid": False}, "portid"),
])
def test_strict_types_name_the_field(populated, service, url, payload, field):
    before = service.snapshot()
    r = populated.post(url, json=payload)
    assert r.status_code == 422, r.text
    assert [e["loc"][-1] for e in r.json()["detail"]] == [field]
    assert service.snapshot() == before


def test_uuid_is_still_given_as_a_string(populated):
    given = "0f2d2f36-8a4e-4a3b-9a52-3b1f1f2f7c11"
    r = populated.post(ns_url(), json={"backend": "ram", "size": 1 << 20, "uuid": given})
    assert r.status_code == 201 and r.json()["uuid"] == given


# -- a large import does not hold the event loop ----------------------------------------------------


IMPORT_ITEMS = 500


def _big_nvmetcli(count: int) -> dict:
    return {"hosts": [], "ports": [], "subsystems": [{
        "nqn": f"nqn.2024-01.com.example:bulk{i}",
        "allowed_hosts": [f"nqn.2014-08.org.nvmexpress:uuid:{uuid.UUID(int=i * 2 + k)}" for k in range(2)],
        "attr": {"allow_any_host": "0", "serial": f"SN{i}", "model": "bulk"},
        # Files that do not exist: each is refused and reported, which is work for the loop all the same.
        "namespaces": [{"nsid": 1, "enable": 1, "device": {"path": f"/nonexistent/bulk{i}.img"}}],
    } for i in range(count)]}


def _big_config(count: int) -> dict:
    return {"version": 1, "listeners": [], "referrals": [], "subsystems": [{
        "nqn": f"nqn.2024-01.com.example:bulk{i}", "allow_any_host": True,
        "namespaces": [{"nsid": 1, "backend": "null", "size": 1 << 20, "block_size": 512}],
    } for i in range(count)]}


@pytest.mark.parametrize(("path", "build"), [("/api/v1/config/nvmetcli", _big_nvmetcli),
                                             ("/api/v1/config", _big_config)])
async def test_large_import_yields_between_items_and_parses_off_the_loop(service, path, build, monkeypatch,
                                                                         record_property):
    """The loop that serves NVMe I/O must get turns all through an import of hundreds of items.

    Structural, not timed: a ticker task that only yields records how many subsystems exist each
    time it runs; it must see the import progress item by item. And the pure-CPU steps (JSON
    parsing, the nvmetcli conversion, the checks) must run in another thread than the loop's."""
    body = json.dumps(build(IMPORT_ITEMS)).encode()
    assert len(body) <= defaults.API_MAX_BODY
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    seen: set[int] = set()
    longest = 0.0
    cpu_threads: dict[str, int] = {}

    def recorded(name: str, func):
        def call(*args, **kwargs):
            cpu_threads[name] = threading.get_ident()
            return func(*args, **kwargs)
        return call

    monkeypatch.setattr(api.deps, "json", types.SimpleNamespace(loads=recorded("json.loads", json.loads)))
    monkeypatch.setattr(configmod, "import_nvmetcli", recorded("import_nvmetcli", configmod.import_nvmetcli))
    monkeypatch.setattr(configmod, "validate_config", recorded("validate_config", configmod.validate_config))

    async def ticker() -> None:
        nonlocal longest
        last = loop.time()
        while True:
            await asyncio.sleep(0)
            seen.add(len(service.target.subsystems))
            now = loop.time()
            longest, last = max(longest, now - last), now

    app = create_app(service, token=TOKEN)
    task = asyncio.create_task(ticker())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api",
                                     headers=AUTH, timeout=60) as http:
            r = await http.post(path, content=body, headers={"Content-Type": "application/json"})
    finally:
        task.cancel()
    assert r.status_code == 200, r.text
    assert len(service.target.subsystems) >= IMPORT_ITEMS
    record_property("longest_loop_stall_ms", round(longest * 1000, 2))
    assert len(seen) >= IMPORT_ITEMS // 2, f"the loop ran at only {len(seen)} distinct stages of the import"
    assert cpu_threads and loop_thread not in cpu_threads.values(), cpu_threads
    await service.target.close()


# -- nothing half-applied ---------------------------------------------------------------------------


FAILING = [
    ("POST", SUBS, {"nqn": NQN}),                                               # duplicate
    ("POST", SUBS, {"nqn": NQN2, "hosts": ["h"]}),                               # bad host NQN
    ("DELETE", f"{SUBS}/{NQN}", None),                                         # has namespaces
    ("POST", ns_url(), {"backend": "ram", "size": 4096, "nsid": 1}),             # duplicate NSID
    ("POST", ns_url(), {"backend": "file", "path": "/nonexistent/x.img"}),       # missing file
    ("POST", ns_url(), {"backend": "ram", "size": 4097}),                        # not a block multiple
    ("POST", ns_url(nsid=1, action="resize"), {"size": 513}),                    # not a block multiple
    ("POST", f"{SUBS}/{NQN}/hosts", {"hostnqn": HOSTNQN}),                       # any host allowed
    ("POST", "/api/v1/referrals", {"traddr": "not-an-ip"}),
    ("POST", "/api/v1/config", {"version": 1, "subsystems": [{"nqn": NQN2, "bogus": 1}]}),
]


@pytest.mark.parametrize(("method", "url", "body"), FAILING)
def test_failed_request_changes_nothing(populated, service, config_path, method, url, body):
    before_file, before = config_path.read_bytes(), service.snapshot()
    sizes = {ns.nsid: ns.backend.size for ns in service.list_namespaces(NQN)}
    r = populated.request(method, url, json=body)
    assert 400 <= r.status_code < 500, r.text
    assert isinstance(r.json()["detail"], str) and r.json()["detail"]
    assert service.snapshot() == before
    assert config_path.read_bytes() == before_file
    assert {ns.nsid: ns.backend.size for ns in service.list_namespaces(NQN)} == sizes


def test_failed_listener_changes_nothing(populated, service, config_path):
    before_file, before = config_path.read_bytes(), service.snapshot()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = populated.post("/api/v1/listeners", json={"traddr": "127.0.0.1", "trsvcid": busy.getsockname()[1]})
    assert r.status_code == 409
    assert service.snapshot() == before and config_path.read_bytes() == before_file
