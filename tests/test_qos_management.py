"""Managing QoS limits: TargetService (validation, persistence, restore, reload, live change), the config file,
the REST API, the CLI, /metrics, and a gateway group sharing them through a dir store."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from test_ana_management import run  # noqa: F401  (the CLI against a live API server)
from test_gateway_group import SUB as GW_SUB
from test_gateway_group import Member, until
from test_ui import HOSTA, running  # noqa: F401  (a live daemon with its API)
from test_ui import NQN as UI_NQN

import initiator
from api import metrics
from api.app import create_app
from target import config as configmod
from target.core import Target
from target.qos import QosLimits
from target.service import ServiceError, TargetService

SUB = "nqn.2026-01.com.example:qos-mgmt"
HOST = "nqn.2026-01.com.example:host-a"
TOKEN = "qos-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.asynccontextmanager
async def _served(path: Path) -> AsyncIterator[TargetService]:
    """A service with SUB (allowing HOST only) and two RAM namespaces, saving to ``path``."""
    svc = TargetService(Target(), config_path=path)
    try:
        await svc.add_subsystem(SUB, serial="S1", hosts=[HOST], allow_any_host=False)
        await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=1)
        await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=2)
        yield svc
    finally:
        await svc.target.close()


async def test_set_merge_persist_and_restore(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    async with _served(path) as svc:
        ns = await svc.set_namespace_qos(SUB, 1, {"rw_ios_per_second": 200})
        throttle = ns.qos
        assert throttle is not None and throttle.limits == QosLimits(rw_ios_per_second=200)
        # limits not named stay; the runtime object stays too (commands waiting keep their place)
        await svc.set_namespace_qos(SUB, 1, {"rw_mbytes_per_second": 10})
        assert ns.qos is throttle and ns.qos.limits == QosLimits(200, 10)
        await svc.set_namespace_qos(SUB, 1, {"w_mbytes_per_second": 3}, host=HOST)
        saved = json.loads(path.read_text())["subsystems"][0]["namespaces"]
        assert saved[0]["qos"] == {"rw_ios_per_second": 200, "rw_mbytes_per_second": 10,
                                   "hosts": {HOST: {"w_mbytes_per_second": 3}}}
        assert "qos" not in saved[1]
        assert svc.get_namespace(SUB, 2).qos is None
    again = TargetService(Target())
    try:
        assert await again.restore(configmod.load_config(path)) == []
        restored = again.get_namespace(SUB, 1).qos
        assert restored is not None and restored.limits == QosLimits(200, 10)
        assert restored.host_limits == {HOST: QosLimits(w_mbytes_per_second=3)}
        # all zero: the namespace is unlimited again and the I/O path sees None
        await again.set_namespace_qos(SUB, 1, {"rw_ios_per_second": 0, "rw_mbytes_per_second": 0})
        await again.set_namespace_qos(SUB, 1, {"w_mbytes_per_second": 0}, host=HOST)
        assert again.get_namespace(SUB, 1).qos is None
        assert "qos" not in again.snapshot()["subsystems"][0]["namespaces"][0]
    finally:
        await again.target.close()


async def test_refusals_name_what_was_wrong(tmp_path: Path) -> None:
    async with _served(tmp_path / "config.json") as svc:
        cases = [
            ((SUB, 1, {"rw_ios_per_second": -5}), {}, 400, "rw_ios_per_second"),
            ((SUB, 1, {"r_mbytes_per_second": 10**9}), {}, 400, "r_mbytes_per_second"),
            ((SUB, 1, {"iops": 5}), {}, 400, "iops"),
            ((SUB, 9, {"rw_ios_per_second": 5}), {}, 404, "9"),
            ((SUB, 1, {"rw_ios_per_second": 5}), {"host": "nqn.2026-01.com.example:stranger"}, 404, "stranger"),
            ((SUB, 1, {"rw_ios_per_second": 5}), {"host": "not an nqn"}, 400, "host"),
        ]
        for args, kwargs, status, word in cases:
            with pytest.raises(ServiceError) as err:
                await svc.set_namespace_qos(*args, **kwargs)
            assert err.value.status == status and word in err.value.message, (args, err.value.message)
        assert svc.get_namespace(SUB, 1).qos is None   # nothing half applied


async def test_reload_changes_limits_live(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    async with _served(path) as svc:
        ns = await svc.set_namespace_qos(SUB, 1, {"rw_ios_per_second": 100})
        throttle = ns.qos
        config = configmod.load_config(path)
        config["subsystems"][0]["namespaces"][0]["qos"] = {"rw_ios_per_second": 50, "hosts": {HOST: {
            "r_mbytes_per_second": 1}}}
        config["subsystems"][0]["namespaces"][1]["qos"] = {"w_mbytes_per_second": 7}
        assert await svc.reload(config) == []
        assert ns.qos is throttle and ns.qos.limits == QosLimits(rw_ios_per_second=50)
        assert ns.qos.host_limits == {HOST: QosLimits(r_mbytes_per_second=1)}
        assert svc.get_namespace(SUB, 2).qos.limits == QosLimits(w_mbytes_per_second=7)
        # a key dropped from the file is no limit
        for item in config["subsystems"][0]["namespaces"]:
            item.pop("qos")
        assert await svc.reload(config) == []
        assert ns.qos is None and svc.get_namespace(SUB, 2).qos is None
        # a bad value: the whole file is refused, naming it
        config["subsystems"][0]["namespaces"][0]["qos"] = {"rw_ios_per_second": -1}
        with pytest.raises(configmod.ConfigError, match=r"namespaces\[0\]\.qos\.rw_ios_per_second"):
            configmod.validate_config(config)


async def test_a_denied_host_loses_its_limits(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    other = "nqn.2026-01.com.example:host-b"
    async with _served(path) as svc:
        await svc.allow_host(SUB, other)
        await svc.set_namespace_qos(SUB, 1, {"rw_ios_per_second": 500})
        await svc.set_namespace_qos(SUB, 1, {"rw_ios_per_second": 10}, host=HOST)
        await svc.set_namespace_qos(SUB, 1, {"r_mbytes_per_second": 5}, host=other)
        await svc.set_namespace_qos(SUB, 2, {"rw_ios_per_second": 20}, host=HOST)
        await svc.deny_host(SUB, HOST)
        ns1, ns2 = svc.get_namespace(SUB, 1), svc.get_namespace(SUB, 2)
        assert ns1.qos is not None and ns1.qos.host_limits == {other: QosLimits(r_mbytes_per_second=5)}
        assert HOST not in ns1.qos.hosts and ns1.qos.limits == QosLimits(rw_ios_per_second=500)
        assert ns2.qos is None   # its only limit was the denied host's
        saved = json.loads(path.read_text())["subsystems"][0]["namespaces"]
        assert saved[0]["qos"] == {"rw_ios_per_second": 500, "hosts": {other: {"r_mbytes_per_second": 5}}}
        assert "qos" not in saved[1]
        # allowed again: it starts unlimited
        await svc.allow_host(SUB, HOST)
        assert HOST not in ns1.qos.host_limits
        # allow_any_host off keeps only the listed hosts' limits; with it on every host is admitted
        await svc.deny_host(SUB, HOST)
        await svc.deny_host(SUB, other)
        await svc.set_allow_any_host(SUB, True)
        await svc.set_namespace_qos(SUB, 1, {"rw_ios_per_second": 10}, host=HOST)
        await svc.set_allow_any_host(SUB, False)
        assert ns1.qos is not None and ns1.qos.host_limits == {}


async def test_a_failed_deny_puts_the_limits_back(tmp_path: Path) -> None:
    async with _served(tmp_path / "config.json") as svc:
        await svc.set_namespace_qos(SUB, 1, {"rw_ios_per_second": 10}, host=HOST)

        async def refused() -> None:
            raise ServiceError(503, "the store is out of reach")

        svc.set_change_hook(refused)
        with pytest.raises(ServiceError):
            await svc.deny_host(SUB, HOST)
        ns1 = svc.get_namespace(SUB, 1)
        assert ns1.qos is not None and ns1.qos.host_limits == {HOST: QosLimits(rw_ios_per_second=10)}


def test_nvmetcli_export_says_the_limits_are_left_out(tmp_path: Path) -> None:
    disk = tmp_path / "d.img"
    disk.write_bytes(bytes(1 << 16))
    config = {"version": 1, "subsystems": [{"nqn": SUB, "namespaces": [
        {"nsid": 1, "backend": "file", "path": str(disk), "qos": {"rw_ios_per_second": 100}}]}]}
    out = configmod.export_nvmetcli(configmod.validate_config(config))
    assert out["subsystems"][0]["namespaces"][0]["device"]["path"] == str(disk)
    assert any("no QoS limits" in w for w in out.warnings)


def test_config_file_problems_are_named() -> None:
    bad = {"version": 1, "subsystems": [{"nqn": SUB, "namespaces": [
        {"backend": "ram", "size": 4096, "qos": {"rw_ios_per_second": "fast"}},
        {"backend": "ram", "size": 4096, "qos": {"hosts": {HOST: {"w_mbytes_per_second": -2}}}}]}]}
    with pytest.raises(configmod.ConfigError) as err:
        configmod.validate_config(bad)
    text = str(err.value)
    assert "qos.rw_ios_per_second must be a whole number" in text
    assert f"qos.hosts['{HOST}'].w_mbytes_per_second must be 0 (unlimited)" in text


async def test_metrics_export_throttled_time(tmp_path: Path) -> None:
    async with _served(tmp_path / "config.json") as svc:
        ns = svc.get_namespace(SUB, 1)
        ns.stats.throttled, ns.stats.throttled_ns = 3, 1_500_000_000
        text = metrics.render(svc.list_subsystems(), [])
        assert f'nvmeof_namespace_throttled_total{{subnqn="{SUB}",nsid="1"}} 3' in text
        assert f'nvmeof_namespace_throttled_seconds_total{{subnqn="{SUB}",nsid="1"}} 1.5' in text
        assert f'nvmeof_namespace_throttled_total{{subnqn="{SUB}",nsid="2"}} 0' in text
        snap = metrics.snapshot(svc.list_subsystems(), 0.0)
        assert snap["namespaces"][0]["throttled_ns"] == 1_500_000_000
        # a worker's report carries them (NamespaceStats rows)
        from target.model import NamespaceStats
        total = NamespaceStats()
        total.add_row(ns.stats.to_row())
        assert (total.throttled, total.throttled_ns) == (3, 1_500_000_000)


@pytest.fixture
def client(tmp_path: Path):
    svc = TargetService(Target(), config_path=tmp_path / "config.json")
    with TestClient(create_app(svc, token=TOKEN), headers=AUTH) as c:
        yield c
        c.portal.call(svc.target.close)


def test_rest(client: TestClient) -> None:
    assert client.post("/api/v1/subsystems", json={"nqn": SUB, "hosts": [HOST]}).status_code == 201
    ns_url = f"/api/v1/subsystems/{SUB}/namespaces"
    assert client.post(ns_url, json={"backend": "ram", "size": 1 << 20}).status_code == 201
    assert client.get(f"{ns_url}/1").json()["qos"] is None
    r = client.put(f"{ns_url}/1/qos", json={"rw_ios_per_second": 200, "rw_mbytes_per_second": 20})
    assert r.status_code == 200, r.text
    assert r.json()["qos"] == {"rw_ios_per_second": 200, "rw_mbytes_per_second": 20, "r_mbytes_per_second": 0,
                               "w_mbytes_per_second": 0, "hosts": {}}
    r = client.put(f"{ns_url}/1/qos", json={"r_mbytes_per_second": 5, "host": HOST})
    assert r.status_code == 200 and r.json()["qos"]["hosts"][HOST]["r_mbytes_per_second"] == 5
    assert client.get(ns_url).json()[0]["qos"]["rw_ios_per_second"] == 200   # the listing shows it
    for body, field in (({"rw_ios_per_second": -1}, "rw_ios_per_second"),
                        ({"w_mbytes_per_second": 10**12}, "w_mbytes_per_second"),
                        ({"rw_ios_per_second": "200"}, "rw_ios_per_second"),
                        ({"rw_iops": 1}, "rw_iops")):
        bad = client.put(f"{ns_url}/1/qos", json=body)
        assert bad.status_code == 422 and field in json.dumps(bad.json()), (body, bad.text)
    missing = client.put(f"{ns_url}/7/qos", json={"rw_ios_per_second": 1})
    assert missing.status_code == 404 and "has no namespace 7" in missing.json()["detail"]
    stranger = client.put(f"{ns_url}/1/qos", json={"rw_ios_per_second": 1, "host": "nqn.2026-01.com.example:x"})
    assert stranger.status_code == 404 and "nqn.2026-01.com.example:x" in stranger.json()["detail"]
    assert client.get(f"{ns_url}/1/stats").json()["throttled_ns"] == 0


def test_cli(run) -> None:  # noqa: F811  (the fixture imported above)
    run("subsystem", "add", SUB)
    run("ns", "add", SUB, "--size", "1M")
    out = run("ns", "set-qos", SUB, "1", "--rw-ios-per-second", "200", "--rw-mbytes-per-second", "20").output
    assert "QoS 200 IOPS, 20 MiB/s" in out
    out = run("ns", "set-qos", SUB, "1", "--w-mbytes-per-second", "4", "--host", HOST).output
    assert f"host {HOST}: QoS 4 MiB/s write" in out
    table = run("ns", "list", SUB).output
    assert "QOS" in table and "200 IOPS, 20 MiB/s (+1 host)" in table
    shown = json.loads(run("ns", "show", SUB, "1", "-o", "json").output)
    assert shown["qos"]["rw_ios_per_second"] == 200 and "throttled_ns" in shown["stats"]
    run("ns", "set-qos", SUB, "1", "--rw-ios-per-second", "-1", code=2)
    run("ns", "set-qos", SUB, "1", code=2)
    assert "QoS unlimited" in run("ns", "set-qos", SUB, "1", "--rw-ios-per-second", "0",
                                  "--rw-mbytes-per-second", "0").output


def test_limits_set_on_one_gateway_hold_on_the_other(tmp_path: Path) -> None:
    async def go() -> None:
        a = await Member(tmp_path, "gw-a").start(first=True)
        b = await Member(tmp_path, "gw-b").start()
        try:
            await a.service.set_namespace_qos(GW_SUB, 1, {"rw_ios_per_second": 300, "w_mbytes_per_second": 8})
            await until(lambda: b.service.get_namespace(GW_SUB, 1).qos is not None, "the limit on gw-b")
            on_b = b.service.get_namespace(GW_SUB, 1).qos
            assert on_b.limits == QosLimits(rw_ios_per_second=300, w_mbytes_per_second=8)
            assert on_b.share == 1.0   # each gateway enforces the whole limit on the traffic it serves
            # and back: gw-b lifts it, gw-a follows
            await b.service.set_namespace_qos(GW_SUB, 1, {"rw_ios_per_second": 0, "w_mbytes_per_second": 0})
            await until(lambda: a.service.get_namespace(GW_SUB, 1).qos is None, "the limit gone on gw-a")
        finally:
            await b.stop()
            await a.stop()

    asyncio.run(go())


async def test_throttled_io_shows_in_metrics_and_dashboard(running) -> None:  # noqa: F811  (test_ui's fixture)
    """End to end: a host limit set over REST delays real reads, and the time they waited reaches /metrics (per
    namespace and per host) and the dashboard's data (/ui/stats rows), whose page draws both throttled charts."""
    parser = pytest.importorskip("prometheus_client.parser")
    daemon, io, http = running
    http.headers["Authorization"] = f"Bearer {daemon.api_token}"
    r = await http.put(f"/api/v1/subsystems/{UI_NQN}/namespaces/1/qos", json={"rw_ios_per_second": 50, "host": HOSTA})
    assert r.status_code == 200, r.text
    async with initiator.connect("127.0.0.1", io, UI_NQN, hostnqn=HOSTA, timeout=10) as ctrl:
        # 50 IOPS holds one I/O in its burst: of 8 reads sent together, at least 6 wait their turn
        await asyncio.gather(*(ctrl.read(1, i, 1) for i in range(8)))
    text = (await http.get("/metrics")).text
    snap = (await http.get("/ui/stats")).json()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in parser.text_string_to_metric_families(text) for s in family.samples}
    ns = (("nsid", "1"), ("subnqn", UI_NQN))
    host = (("hostnqn", HOSTA), ("subnqn", UI_NQN))
    for prefix, labels in (("nvmeof_namespace", ns), ("nvmeof_host", host)):
        assert samples[(f"{prefix}_throttled_total", labels)] >= 6, prefix
        assert samples[(f"{prefix}_throttled_seconds_total", labels)] > 0, prefix
    (row,) = snap["namespaces"]
    (hrow,) = snap["hosts"]
    assert row["throttled"] >= 6 and row["throttled_ns"] > 0
    assert hrow["hostnqn"] == HOSTA and hrow["throttled"] >= 6 and hrow["throttled_ns"] > 0
    page = (await http.get("/ui")).text
    assert 'id="chart-ns-throttle"' in page and 'id="chart-host-throttle"' in page
