"""Masking (per-host namespace visibility) through the management doors: TargetService checks and rules,
the config file (saved, restored, reloaded; nvmetcli export), REST and the command line.
target-level behaviour (Identify, I/O, AENs) is tests/test_masking_target.py."""

from __future__ import annotations

import json

import pytest

from target import config as configmod
from target.core import Target
from target.service import ServiceError, TargetService
from tests.test_ana_management import run  # noqa: F401  (fixture: the CLI against a live API server)
from tests.test_api import open_client

SUB = "nqn.2026-01.com.example:mask"
HOST_A = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-0000-0000-000000000001"
HOST_B = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-0000-0000-000000000002"
HOST_C = "nqn.2014-08.org.nvmexpress:uuid:cccccccc-0000-0000-0000-000000000003"


@pytest.fixture
async def svc(tmp_path):
    service = TargetService(Target(), config_path=tmp_path / "config.json")
    await service.add_subsystem(SUB, serial="M1", hosts=[HOST_A, HOST_B])
    yield service
    await service.target.close()


async def test_refusals_name_what_was_wrong(svc):
    with pytest.raises(ServiceError, match=f"host {HOST_C} is not allowed on subsystem {SUB}") as err:
        await svc.add_namespace(SUB, backend="ram", size=1 << 20, auto_visible=False, hosts=[HOST_C])
    assert err.value.status == 400
    assert svc.list_namespaces(SUB) == []   # nothing was added
    with pytest.raises(ServiceError, match="needs auto_visible false") as err:
        await svc.add_namespace(SUB, backend="ram", size=1 << 20, hosts=[HOST_A])
    assert err.value.status == 400
    with pytest.raises(ServiceError, match="host NQN"):
        await svc.add_namespace(SUB, backend="ram", size=1 << 20, auto_visible=False, hosts=["not an nqn"])
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=1)
    with pytest.raises(ServiceError, match="auto_visible") as err:   # SPDK: EPERM on an always-visible namespace
        await svc.add_namespace_host(SUB, 1, HOST_A)
    assert err.value.status == 409
    with pytest.raises(ServiceError, match=f"subsystem {SUB} has no namespace 7") as err:
        await svc.add_namespace_host(SUB, 7, HOST_A)
    assert err.value.status == 404
    await svc.set_namespace_auto_visible(SUB, 1, False)
    with pytest.raises(ServiceError, match=f"host {HOST_C} is not allowed") as err:
        await svc.add_namespace_host(SUB, 1, HOST_C)
    assert err.value.status == 400
    await svc.add_namespace_host(SUB, 1, HOST_A)
    with pytest.raises(ServiceError, match="already visible") as err:
        await svc.add_namespace_host(SUB, 1, HOST_A)
    assert err.value.status == 409
    with pytest.raises(ServiceError, match=f"does not list host {HOST_B}") as err:
        await svc.remove_namespace_host(SUB, 1, HOST_B)
    assert err.value.status == 404


async def test_denied_host_leaves_the_namespace_lists_and_any_host_subsystems_take_any_nqn(svc):
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=1, auto_visible=False, hosts=[HOST_A, HOST_B])
    await svc.deny_host(SUB, HOST_A)
    assert svc.get_namespace(SUB, 1).hosts == {HOST_B}
    # allowed again, it does not see the namespace again by itself
    await svc.allow_host(SUB, HOST_A)
    assert svc.get_namespace(SUB, 1).hosts == {HOST_B}
    any_host = "nqn.2026-01.com.example:open"
    await svc.add_subsystem(any_host, serial="M2")   # allows any host
    ns = await svc.add_namespace(any_host, backend="ram", size=1 << 20, auto_visible=False, hosts=[HOST_C])
    assert ns.hosts == {HOST_C}
    # allow_any_host off: HOST_C is no longer admitted, so it leaves the list too
    await svc.set_allow_any_host(any_host, False)
    assert svc.get_namespace(any_host, ns.nsid).hosts == set()


async def test_saved_restored_and_auto_visible_drops_the_list(svc, tmp_path):
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=1)
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=2, auto_visible=False, hosts=[HOST_B, HOST_A])
    saved = configmod.load_config(tmp_path / "config.json")
    entries = {n["nsid"]: n for n in saved["subsystems"][0]["namespaces"]}
    assert "auto_visible" not in entries[1] and "hosts" not in entries[1]   # unmasked: the entry is as before
    assert entries[2]["auto_visible"] is False and entries[2]["hosts"] == [HOST_A, HOST_B]
    other = TargetService(Target())
    assert await other.restore(saved) == []
    assert other.get_namespace(SUB, 2).visibility() == frozenset({HOST_A, HOST_B})
    assert other.get_namespace(SUB, 1).visibility() is None
    await svc.set_namespace_auto_visible(SUB, 2, True)
    assert svc.get_namespace(SUB, 2).hosts == set()
    assert "hosts" not in configmod.load_config(tmp_path / "config.json")["subsystems"][0]["namespaces"][1]


async def test_reload_changes_visibility_live_and_refuses_an_inconsistent_file(svc):
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=1)
    live = svc.live_config()
    ns = live["subsystems"][0]["namespaces"][0]
    ns.update({"auto_visible": False, "hosts": [HOST_A]})
    assert await svc.reload(live) == []
    served = svc.get_namespace(SUB, 1)
    assert served.visibility() == frozenset({HOST_A})
    # a file that drops HOST_A from the subsystem but keeps it on the namespace is refused whole
    bad = svc.live_config()
    bad["subsystems"][0]["hosts"] = [HOST_B]
    errors = await svc.reload(bad)
    assert errors and f"host {HOST_A}" in errors[0] and "namespace 1" in errors[0], errors
    assert svc.get_subsystem(SUB).hosts == {HOST_A, HOST_B}
    # a new host on the subsystem and a new masked namespace naming it, in one reload
    new = svc.live_config()
    new["subsystems"][0]["hosts"].append(HOST_C)
    new["subsystems"][0]["namespaces"].append({"nsid": 2, "backend": "ram", "size": 1 << 20,
                                              "auto_visible": False, "hosts": [HOST_C]})
    assert await svc.reload(new) == []
    assert svc.get_namespace(SUB, 2).hosts == {HOST_C}
    # keys left out of the file keep what runs, as for enabled
    kept = svc.live_config()
    for entry in kept["subsystems"][0]["namespaces"]:
        entry.pop("auto_visible", None)
        entry.pop("hosts", None)
    assert await svc.reload(kept) == []
    assert svc.get_namespace(SUB, 2).hosts == {HOST_C}


def test_nvmetcli_export_leaves_a_masked_namespace_out(tmp_path):
    image = tmp_path / "disk.img"
    image.write_bytes(bytes(1 << 20))
    config = configmod.validate_config({"version": 1, "subsystems": [{"nqn": SUB, "hosts": [HOST_A], "namespaces": [
        {"nsid": 1, "backend": "file", "path": str(image)},
        {"nsid": 2, "backend": "file", "path": str(image), "auto_visible": False, "hosts": [HOST_A]}]}]})
    converted = configmod.export_nvmetcli(config)
    assert [n["nsid"] for n in converted["subsystems"][0]["namespaces"]] == [1]
    assert any("namespace 2" in w and "per-host namespace visibility" in w for w in converted.warnings)


def test_config_file_checks_the_host_list_type():
    with pytest.raises(configmod.ConfigError, match="hosts: expected a list of host NQN strings"):
        configmod.validate_config({"version": 1, "subsystems": [{"nqn": SUB, "namespaces": [
            {"backend": "ram", "size": 4096, "auto_visible": False, "hosts": [1]}]}]})


@pytest.fixture
def client(tmp_path):
    service = TargetService(Target(), config_path=tmp_path / "config.json")
    client = open_client(service)
    yield client
    client.portal.call(service.target.close)
    client.__exit__(None, None, None)


def test_rest(client):
    subs = "/api/v1/subsystems"
    assert client.post(subs, json={"nqn": SUB, "hosts": [HOST_A, HOST_B]}).status_code == 201
    ns_url = f"{subs}/{SUB}/namespaces"
    made = client.post(ns_url, json={"backend": "ram", "size": 1 << 20, "auto_visible": False, "hosts": [HOST_A]})
    assert made.status_code == 201, made.text
    assert made.json()["auto_visible"] is False and made.json()["hosts"] == [HOST_A]
    bad = client.post(ns_url, json={"backend": "ram", "size": 1 << 20, "auto_visible": False, "hosts": [HOST_C]})
    assert bad.status_code == 400 and HOST_C in bad.text
    added = client.post(f"{ns_url}/1/hosts", json={"hostnqn": HOST_B})
    assert added.status_code == 201 and added.json()["hosts"] == [HOST_A, HOST_B]
    gone = client.delete(f"{ns_url}/1/hosts/{HOST_A}")
    assert gone.status_code == 200 and gone.json()["hosts"] == [HOST_B]
    missing = client.delete(f"{ns_url}/1/hosts/{HOST_A}")
    assert missing.status_code == 404 and HOST_A in missing.text
    assert client.post(f"{ns_url}/9/hosts", json={"hostnqn": HOST_B}).status_code == 404
    switched = client.put(f"{ns_url}/1/auto_visible", json={"auto_visible": True})
    assert switched.status_code == 200 and switched.json()["auto_visible"] is True and switched.json()["hosts"] == []
    assert client.get(f"{ns_url}/1").json()["auto_visible"] is True
    assert client.put(f"{ns_url}/1/auto_visible", json={"auto_visible": "yes"}).status_code == 422


def test_cli(run):  # noqa: F811
    run("subsystem", "add", SUB, "--no-allow-any-host")
    run("host", "allow", SUB, HOST_A)
    run("host", "allow", SUB, HOST_B)
    run("ns", "add", SUB, "--size", "1M", "--no-auto-visible", "--host", HOST_A)
    assert _hosts(run) == [HOST_A]
    assert "--no-auto-visible" in run("ns", "add", SUB, "--size", "1M", "--host", HOST_A, code=2).output
    out = run("ns", "host", "add", SUB, "1", HOST_B).stdout
    assert out.strip() == f"namespace 1 of {SUB} is visible to {HOST_A}, {HOST_B}"
    assert f"{HOST_A}, {HOST_B}" in run("ns", "list", SUB).stdout
    run("ns", "host", "remove", SUB, "1", HOST_A)
    assert _hosts(run) == [HOST_B]
    assert "does not list host" in run("ns", "host", "remove", SUB, "1", HOST_A, code=1).stderr
    assert "is not allowed" in run("ns", "host", "add", SUB, "1", HOST_C, code=1).stderr
    out = run("ns", "set-auto-visible", SUB, "1", "on").stdout
    assert out.strip() == f"namespace 1 of {SUB} is visible to all hosts"
    shown = json.loads(run("ns", "show", SUB, "1", "-o", "json").stdout)
    assert shown["auto_visible"] is True and shown["hosts"] == []


def _hosts(invoke) -> list[str]:  # type: ignore[no-untyped-def]
    return json.loads(invoke("ns", "show", SUB, "1", "-o", "json").stdout)["hosts"]
