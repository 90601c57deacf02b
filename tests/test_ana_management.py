"""Managing ANA (issue 15): TargetService persistence and restore of namespace groups and listener
states, reload, nvmetcli import/export of ana_grpid / ana_groups, the REST API and the CLI."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from test_cli_manage import TOKEN as CLI_TOKEN
from test_cli_manage import LiveServer, root

from api import schemas
from api.app import create_app
from nvmeof.cli.commands.serve import _cntlid_range
from nvmeof.spec.logs import ANA_STATE_NAMES, AnaState
from target import config as configmod
from target.core import Target
from target.service import TargetService
from tests.ports import free_port

SUB = "nqn.2026-01.com.example:ana-mgmt"
TOKEN = "ana-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _populated(path) -> tuple[TargetService, str, str]:
    svc = TargetService(Target(), config_path=path)
    await svc.add_subsystem(SUB, serial="S1")
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=1)
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=2, anagrpid=5)
    a = (await svc.add_listener("tcp", "127.0.0.1", free_port())).id
    b = (await svc.add_listener("tcp", "127.0.0.1", free_port())).id
    return svc, a, b


async def test_persisted_and_restored(tmp_path):
    path = tmp_path / "config.json"
    svc, a, b = await _populated(path)
    try:
        await svc.set_ana_state(b, 5, AnaState.INACCESSIBLE)
        await svc.set_ana_state(a, 1, "non-optimized")
        # runtime states (a gateway's) are served but never written
        await svc.set_ana_states({1: AnaState.CHANGE}, listener_ids=[b])
        saved = json.loads(path.read_text())
        nss = {n["nsid"]: n for n in saved["subsystems"][0]["namespaces"]}
        assert nss[1]["anagrpid"] == 1 and nss[2]["anagrpid"] == 5
        lst = {f"tcp:127.0.0.1:{item['trsvcid']}": item for item in saved["listeners"]}
        assert lst[b]["ana_states"] == {"5": "inaccessible"}
        assert lst[a]["ana_states"] == {"1": "non-optimized"}
        await svc.set_namespace_anagrpid(SUB, 1, 7)
        assert json.loads(path.read_text())["subsystems"][0]["namespaces"][0]["anagrpid"] == 7
        # back to optimized: the key disappears
        await svc.set_ana_state(a, 1, AnaState.OPTIMIZED)
        assert "ana_states" not in {f"tcp:127.0.0.1:{i['trsvcid']}": i for i in
                                    json.loads(path.read_text())["listeners"]}[a]
    finally:
        await svc.target.close()
    config = configmod.load_config(path)
    again = TargetService(Target())
    try:
        assert await again.restore(config) == []
        assert again.get_namespace(SUB, 1).anagrpid == 7 and again.get_namespace(SUB, 2).anagrpid == 5
        assert again.get_listener(b).ana_states == {5: AnaState.INACCESSIBLE}
        assert again.get_listener(b).ana_blocked == {5: 0x302}
        assert again.get_listener(a).ana_states == {}
        assert again.snapshot()["listeners"] == config["listeners"]
    finally:
        await again.target.close()


async def test_reload_changes_groups_and_states_live(tmp_path):
    path = tmp_path / "config.json"
    svc, _a, b = await _populated(path)
    try:
        config = configmod.load_config(path)
        config["subsystems"][0]["namespaces"][1]["anagrpid"] = 6
        for item in config["listeners"]:
            if f"tcp:127.0.0.1:{item['trsvcid']}" == b:
                item["ana_states"] = {"6": "persistent-loss"}
        assert await svc.reload(config) == []
        assert svc.get_namespace(SUB, 2).anagrpid == 6
        assert svc.get_listener(b).ana_state(6) == AnaState.PERSISTENT_LOSS
        for item in config["listeners"]:
            item.pop("ana_states", None)
        assert await svc.reload(config) == []
        assert svc.get_listener(b).ana_states == {}
        assert "ana_states" not in json.dumps(json.loads(path.read_text())["listeners"])
    finally:
        await svc.target.close()


def test_config_file_problems_are_named():
    bad = {"version": 1, "listeners": [{"traddr": "127.0.0.1", "trsvcid": 4420,
                                        "ana_states": {"0": "optimized", "2": "standby"}}]}
    with pytest.raises(configmod.ConfigError) as err:
        configmod.validate_config(bad)
    text = str(err.value)
    assert "ana_states: key '0' is not an ANA group id 1..128" in text
    assert "ana_states['2']: ANA state 'standby' is not one of" in text


def test_nvmetcli_import_and_export_carry_ana(tmp_path):
    disk = tmp_path / "d.img"
    disk.write_bytes(bytes(1 << 16))
    dump = {
        "hosts": [],
        "ports": [{"addr": {"adrfam": "ipv4", "traddr": "10.0.0.1", "treq": "not specified", "trsvcid": "4420",
                            "trtype": "tcp"},
                   "portid": 1, "referrals": [], "subsystems": [SUB],
                   "ana_groups": [{"ana": {"state": "optimized"}, "grpid": 1},
                                  {"ana": {"state": "inaccessible"}, "grpid": 2},
                                  {"ana": {"state": "bogus"}, "grpid": 3}]}],
        "subsystems": [{"nqn": SUB, "allowed_hosts": [], "attr": {"allow_any_host": "1"},
                        "namespaces": [{"nsid": 1, "enable": 1, "ana_grpid": 2, "device": {"path": str(disk)}},
                                       {"nsid": 2, "enable": 1, "ana_grpid": 1, "device": {"path": str(disk)}}]}],
    }
    out = configmod.import_nvmetcli(dump)
    configmod.validate_config(out)
    nss = out["subsystems"][0]["namespaces"]
    assert nss[0]["anagrpid"] == 2 and "anagrpid" not in nss[1]   # group 1 is the default
    assert out["listeners"][0]["ana_states"] == {"2": "inaccessible"}
    assert any("ana_groups[2]: ANA state 'bogus' is not one of" in w for w in out.warnings)
    assert not any("ANA" in w and "not supported" in w for w in out.warnings)
    back = configmod.export_nvmetcli(out)
    assert [ns["ana_grpid"] for ns in back["subsystems"][0]["namespaces"]] == [2, 1]
    assert back["ports"][0]["ana_groups"] == [{"ana": {"state": "optimized"}, "grpid": 1},
                                              {"ana": {"state": "inaccessible"}, "grpid": 2}]
    assert configmod.import_nvmetcli(json.loads(json.dumps(back)))["listeners"] == out["listeners"]


def test_api_state_names_are_the_spec_names():
    assert list(schemas.AnaStateName.__args__) == list(ANA_STATE_NAMES.values())


@pytest.fixture
def client(tmp_path):
    svc = TargetService(Target(), config_path=tmp_path / "config.json")
    with TestClient(create_app(svc, token=TOKEN), headers=AUTH) as c:
        yield c
        c.portal.call(svc.target.close)


def test_rest(client):
    assert client.post("/api/v1/subsystems", json={"nqn": SUB}).status_code == 201
    ns_url = f"/api/v1/subsystems/{SUB}/namespaces"
    r = client.post(ns_url, json={"backend": "ram", "size": 1 << 20, "anagrpid": 3})
    assert r.status_code == 201 and r.json()["anagrpid"] == 3
    assert client.post(ns_url, json={"backend": "ram", "size": 1 << 20, "anagrpid": 129}).status_code == 422
    r = client.put(f"{ns_url}/1/anagrpid", json={"anagrpid": 4})
    assert r.status_code == 200 and r.json()["anagrpid"] == 4
    assert client.get(f"{ns_url}/1").json()["anagrpid"] == 4
    port = free_port()
    assert client.post("/api/v1/listeners", json={"traddr": "127.0.0.1", "trsvcid": port}).status_code == 201
    r = client.put(f"/api/v1/listeners/tcp/127.0.0.1/{port}/ana/4", json={"state": "inaccessible"})
    assert r.status_code == 200, r.text
    assert r.json()["ana_states"] == {"4": "inaccessible"}
    bad = client.put(f"/api/v1/listeners/tcp/127.0.0.1/{port}/ana/4", json={"state": "standby"})
    assert bad.status_code == 422
    assert client.put(f"/api/v1/listeners/tcp/127.0.0.1/{port}/ana/0", json={"state": "optimized"}).status_code == 422
    assert client.put("/api/v1/listeners/tcp/127.0.0.1/1/ana/4", json={"state": "optimized"}).status_code == 404
    ana = client.get("/api/v1/ana").json()
    assert ana["groups"] == [{"anagrpid": 4, "namespaces": [{"subnqn": SUB, "nsid": 1}]}]
    [lst] = ana["listeners"]
    assert lst["listener_id"] == f"tcp:127.0.0.1:{port}"
    assert lst["states"] == {"4": "inaccessible"} and lst["saved"] == {"4": "inaccessible"}


@pytest.fixture
def run(tmp_path, monkeypatch):
    server = LiveServer(TargetService(Target(), config_path=tmp_path / "config.json"))
    monkeypatch.setenv("NVMEOF_API_TOKEN", CLI_TOKEN)
    monkeypatch.setenv("NVMEOF_API", server.url)
    runner = CliRunner()

    def invoke(*args: str, code: int = 0):
        result = runner.invoke(root, list(args), catch_exceptions=False)
        assert result.exit_code == code, (args, result.output)
        return result

    yield invoke
    server.close()


def test_cli(run):
    run("subsystem", "add", SUB)
    out = json.loads(run("ns", "add", SUB, "--size", "1M", "--anagrpid", "2", "-o", "json").output)
    assert out["anagrpid"] == 2
    assert "is in ANA group 3" in run("ns", "set-anagrpid", SUB, "1", "3").output
    assert json.loads(run("ns", "show", SUB, "1", "-o", "json").output)["anagrpid"] == 3
    port = free_port()
    run("listener", "add", f"127.0.0.1:{port}")
    assert f"ANA group 3 is inaccessible on tcp:127.0.0.1:{port}" in run(
        "listener", "set-ana", f"tcp:127.0.0.1:{port}", "3", "inaccessible").output
    out = json.loads(run("listener", "set-ana", f"127.0.0.1:{port}", "3", "non-optimized", "-o", "json").output)
    assert out["ana_states"] == {"3": "non-optimized"}
    run("listener", "set-ana", f"127.0.0.1:{port}", "3", "standby", code=2)
    text = run("ana", "show").output
    assert f"{SUB}/1" in text and f"tcp:127.0.0.1:{port}" in text and "non-optimized" in text
    report = json.loads(run("ana", "show", "-o", "json").output)
    assert report["listeners"][0]["states"] == {"3": "non-optimized"}


def test_serve_cntlid_range_option():
    assert _cntlid_range(None) is None
    assert _cntlid_range("2041-4080") == (2041, 4080)
    for bad in ("0-10", "10-5", "1-65520", "abc", "5"):
        with pytest.raises(Exception, match="LO-HI"):
            _cntlid_range(bad)
