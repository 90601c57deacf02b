"""Reload (SIGHUP): the daemon re-reads --config and applies only the differences
(target/reload.py plans them, TargetService.reload applies them all or nothing), so the hosts of
whatever stays keep their controllers.

All or nothing over every step, not only the first ones: a failure in any of them (removals,
additions, host lists, resize, enabled, ANA group, visibility, QoS, ANA states, the gateway group's
store, the save) leaves the running configuration, the Target's live objects and the saved file as
they were; a reload that applies saves the file once. One transaction (target/transaction.py) logs
every step's undo."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import initiator
from nvmeof.cli.daemon import Daemon, DaemonOptions
from nvmeof.spec.logs import AnaState
from nvmeof.uri import TransportAddress
from target import config as configmod
from target.core import Target
from target.reload import plan_reload
from target.service import ServiceError, TargetService, _endpoint_key
from tests.ports import free_ports

MiB = 1 << 20
NQN = "nqn.2026-01.io.nvmeof-toolkit:reload1"
NQN2 = "nqn.2026-01.io.nvmeof-toolkit:reload2"
HOSTA = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-00000000000a"
HOSTB = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-00000000000b"


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    io, disc = free_ports(2)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "version": 1,
        "subsystems": [{"nqn": NQN, "allow_any_host": False, "hosts": [HOSTA, HOSTB],
                        "namespaces": [{"nsid": 1, "backend": "ram", "size": MiB},
                                       {"nsid": 2, "backend": "ram", "size": MiB}]}],
        "listeners": [{"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": io}],
    }))
    d = Daemon(DaemonOptions(config_path=config, backing_dirs=[tmp_path], api=None,
                             discovery=[TransportAddress("tcp", "127.0.0.1", disc)]))
    await d.start()
    d.io_port = io  # type: ignore[attr-defined]
    try:
        yield d
    finally:
        await d.stop()


def edit(d: Daemon, change: Any) -> str:
    """Apply ``change`` to the config file as an operator would; returns the text before."""
    path = d.options.config_path
    assert path is not None
    before = path.read_text()
    data = json.loads(before)
    change(data)
    path.write_text(json.dumps(data))
    return before


async def connect(d: Daemon, hostnqn: str) -> Any:
    return await initiator.connect("127.0.0.1", d.io_port, NQN, hostnqn=hostnqn, timeout=10)  # type: ignore


async def test_an_unchanged_file_plans_nothing(daemon: Daemon) -> None:
    plan = plan_reload(daemon.service.live_config(), json.loads(daemon.options.config_path.read_text()),
                       _endpoint_key)
    assert plan.empty() and not plan.problems, plan
    assert await daemon.reload() == []


async def test_reload_keeps_allowed_hosts_and_drops_the_denied_one(daemon: Daemon) -> None:
    a, b = await connect(daemon, HOSTA), await connect(daemon, HOSTB)
    try:
        cntlid_a = a.cntlid
        port2 = free_ports(1)[0]

        def change(data: dict[str, Any]) -> None:
            sub = data["subsystems"][0]
            sub["hosts"] = [HOSTA]
            sub["namespaces"] = [ns for ns in sub["namespaces"] if ns["nsid"] != 2]
            sub["namespaces"][0]["size"] = 2 * MiB
            sub["namespaces"].append({"backend": "ram", "size": MiB, "nsid": 7})
            data["subsystems"].append({"nqn": NQN2, "namespaces": [{"backend": "null", "size": MiB}]})
            data["listeners"].append({"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": port2})

        edit(daemon, change)
        assert await daemon.reload() == []
        assert await a.namespaces() == [1, 7]
        assert a.cntlid == cntlid_a and cntlid_a in daemon.target.controllers
        assert not any(c.hostnqn == HOSTB for c in daemon.target.controllers.values()), "denied host still on"
        assert (await a.identify_namespace(1)).nsze * 512 == 2 * MiB
        assert NQN2 in daemon.target.subsystems
        assert any(lst.trsvcid == port2 for lst in daemon.target.listeners.values())
        saved = json.loads(daemon.options.config_path.read_text())
        assert saved["subsystems"][0]["hosts"] == [HOSTA] and saved["subsystems"][1]["namespaces"][0]["nsid"] == 1
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d["subsystems"][0].update(serial="CHANGED"), "serial cannot change"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(block_size=4096), "block_size cannot change"),
    # the host change and the removal of nsid 2 alone would apply; the namespace that cannot open takes them back
    (lambda d: (d["subsystems"][0].update(hosts=[HOSTA]), d["subsystems"][0]["namespaces"].pop(),
                d["subsystems"][0]["namespaces"].append({"backend": "file", "path": "/nonexistent/x.img"})),
     "x.img"),
    (lambda d: d["subsystems"][0].update(allow_any_host=True), "not both"),
    (lambda d: d["listeners"][0].update(inline_data_size=16384), "inline_data_size cannot change"),
])
async def test_a_refused_reload_changes_nothing(daemon: Daemon, change: Any, fragment: str) -> None:
    b = await connect(daemon, HOSTB)
    try:
        live = daemon.service.live_config()
        edit(daemon, change)
        edited = daemon.options.config_path.read_text()
        errors = await daemon.reload()
        assert errors and any(fragment in e for e in errors), errors
        assert daemon.service.live_config() == live
        assert daemon.options.config_path.read_text() == edited, "the refused file was overwritten"
        assert await b.namespaces() == [1, 2]
    finally:
        await b.close()


async def test_a_file_that_does_not_load_is_refused(daemon: Daemon, caplog: pytest.LogCaptureFixture) -> None:
    live = daemon.service.live_config()
    daemon.options.config_path.write_text('{"version": 1, "subsystems": [{"nqn": 5}]}')
    errors = await daemon.reload()
    assert errors and "nqn" in errors[0]
    assert daemon.service.live_config() == live
    assert "reload refused, nothing changed" in caplog.text


# --- every step of a reload, failing one at a time --------------------------------------------------

KEEP = "nqn.2026-01.io.nvmeof-toolkit:atomic-keep"
GONE = "nqn.2026-01.io.nvmeof-toolkit:atomic-gone"
NEW = "nqn.2026-01.io.nvmeof-toolkit:atomic-new"


@pytest.fixture
async def svc(tmp_path: Path) -> AsyncIterator[TargetService]:
    service = TargetService(Target(), config_path=tmp_path / "config.json")
    await service.add_subsystem(KEEP, serial="K1", allow_any_host=False, hosts=[HOSTA, HOSTB])
    for nsid in (1, 2, 3):
        await service.add_namespace(KEEP, backend="ram", size=MiB, nsid=nsid)
    await service.add_subsystem(GONE, serial="G1")
    await service.add_namespace(GONE, backend="null", size=MiB, nsid=1)
    keep_port, gone_port, new_port = free_ports(3)
    await service.add_listener("tcp", "127.0.0.1", keep_port)
    await service.add_listener("tcp", "127.0.0.1", gone_port)
    await service.add_referral("192.0.2.1", 8009)
    service.new_port = new_port  # type: ignore[attr-defined]
    try:
        yield service
    finally:
        await service.target.close()


def every_step(svc: TargetService) -> dict[str, Any]:
    """A file that changes something at every step of a reload."""
    config = configmod.load_config(svc.config_path)
    keep = next(s for s in config["subsystems"] if s["nqn"] == KEEP)
    keep["hosts"] = [HOSTA]
    nss = {ns["nsid"]: ns for ns in keep["namespaces"]}
    nss[1]["size"] = 2 * MiB
    nss[2]["size"] = 3 * MiB
    nss[2]["enabled"] = False
    nss[3]["anagrpid"] = 4
    nss[3]["auto_visible"], nss[3]["hosts"] = False, [HOSTA]
    nss[1]["qos"] = {"rw_ios_per_second": 50, "hosts": {HOSTA: {"r_mbytes_per_second": 1}}}
    keep["namespaces"] = [nss[1], nss[2], nss[3], {"backend": "ram", "size": MiB, "nsid": 9}]
    config["subsystems"] = [keep, {"nqn": NEW, "namespaces": [{"backend": "null", "size": MiB}]}]
    keep_listener = config["listeners"][0]
    keep_listener["ana_states"] = {"4": "inaccessible"}
    config["listeners"] = [keep_listener, {"trtype": "tcp", "traddr": "127.0.0.1",
                                           "trsvcid": svc.new_port}]  # type: ignore[attr-defined]
    config["referrals"] = [{"trtype": "tcp", "traddr": "192.0.2.2", "trsvcid": 8009}]
    return config


def live_objects(svc: TargetService) -> Any:
    """What the Target serves, object by object (identity and the fields a reload changes)."""
    t = svc.target
    return (
        {nqn: (id(sub), set(sub.hosts), sub.allow_any_host,
               {nsid: (id(ns), ns.backend.size, ns.enabled, ns.anagrpid, ns.auto_visible, set(ns.hosts),
                       None if ns.qos is None else ns.qos.config())
                for nsid, ns in sub.namespaces.items()})
         for nqn, sub in t.subsystems.items()},
        {lid: (id(lst), dict(lst.ana_states)) for lid, lst in t.listeners.items()},
        [r.id for r in t.referrals],
        copy.deepcopy(svc._ana_saved),
    )


# (method, which call raises): the later calls of a step come after its earlier ones applied; the
# _add_* ones are the replay's items (new subsystem, its namespace after the other new one, listener, referral)
STEPS = [("_reload_take_away", 1), ("_reload_access", 1), ("_replay", 1), ("_add_subsystem", 1),
         ("_add_namespace", 1), ("_add_namespace", 2), ("_add_listener", 1), ("_add_referral", 1),
         ("_resize_step", 1), ("_resize_step", 2), ("_enabled_step", 1), ("_anagrpid_step", 1),
         ("_visibility_step", 1), ("_qos_step", 1), ("_reload_ana", 1)]


@pytest.mark.parametrize("method, nth", STEPS)
async def test_a_failing_step_undoes_every_step(svc: TargetService, monkeypatch: pytest.MonkeyPatch,
                                                method: str, nth: int) -> None:
    real = getattr(svc, method)
    calls = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == nth:
            raise ServiceError(400, f"{method} refused (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(svc, method, failing)
    snapshot, live, objects = svc.snapshot(), svc.live_config(), live_objects(svc)
    saved = Path(svc.config_path).read_text()
    errors = await svc.reload(every_step(svc))
    assert len(errors) == 1 and f"{method} refused (injected)" in errors[0], errors
    assert calls == nth or (method.startswith("_add_") and calls > nth)   # a replay tries every item
    assert svc.snapshot() == snapshot and svc.live_config() == live
    assert live_objects(svc) == objects
    assert Path(svc.config_path).read_text() == saved


@pytest.mark.parametrize("method", ["_replay", "_anagrpid_step", "_reload_ana"])
async def test_a_bug_in_a_step_undoes_every_step_and_propagates(svc: TargetService, monkeypatch: pytest.MonkeyPatch,
                                                                 method: str) -> None:
    """Not a refusal (ServiceError) but a bug or a cancellation: raised to the caller, nothing half applied."""
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{method} is broken (injected)")

    monkeypatch.setattr(svc, method, broken)
    snapshot, objects = svc.snapshot(), live_objects(svc)
    saved = Path(svc.config_path).read_text()
    with pytest.raises(RuntimeError, match="injected"):
        await svc.reload(every_step(svc))
    assert svc.snapshot() == snapshot and live_objects(svc) == objects
    assert Path(svc.config_path).read_text() == saved
    assert not svc._lock.locked()


async def test_a_failing_save_undoes_every_step(svc: TargetService, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(path: Any, config: Any) -> None:
        raise configmod.ConfigError(f"{path}: disk full (injected)")

    monkeypatch.setattr(configmod, "save_config", refuse)
    snapshot, objects = svc.snapshot(), live_objects(svc)
    saved = Path(svc.config_path).read_text()
    errors = await svc.reload(every_step(svc))
    assert len(errors) == 1 and "disk full (injected)" in errors[0] and "undone" in errors[0], errors
    assert svc.snapshot() == snapshot and live_objects(svc) == objects
    assert Path(svc.config_path).read_text() == saved


async def test_a_refusing_group_store_undoes_every_step(svc: TargetService) -> None:
    """on_change (a gateway group's store, compare-and-swap) is asked once, before the file is saved."""
    asked = []

    async def conflict() -> None:
        asked.append(svc.live_config())
        raise ServiceError(409, "another gateway changed the shared configuration (injected)")

    svc.set_change_hook(conflict)
    snapshot, objects = svc.snapshot(), live_objects(svc)
    saved = Path(svc.config_path).read_text()
    config = every_step(svc)
    errors = await svc.reload(config)
    assert errors == ["another gateway changed the shared configuration (injected)"]
    assert len(asked) == 1 and asked[0]["subsystems"][0]["namespaces"][0]["size"] == 2 * MiB, "asked before applying"
    assert svc.snapshot() == snapshot and live_objects(svc) == objects
    assert Path(svc.config_path).read_text() == saved


async def test_an_applied_reload_saves_once_with_every_step(svc: TargetService,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    real = configmod.save_config
    saves: list[dict[str, Any]] = []

    def counting(path: Any, config: dict[str, Any]) -> None:
        saves.append(copy.deepcopy(config))
        real(path, config)

    monkeypatch.setattr(configmod, "save_config", counting)
    changes = 0

    async def on_change() -> None:
        nonlocal changes
        changes += 1

    svc.set_change_hook(on_change)
    assert await svc.reload(every_step(svc)) == []
    assert len(saves) == 1 and changes == 1, (len(saves), changes)
    assert saves[0] == svc.snapshot() == configmod.load_config(svc.config_path)
    keep = svc.get_subsystem(KEEP)
    assert GONE not in svc.target.subsystems and NEW in svc.target.subsystems
    assert sorted(keep.namespaces) == [1, 2, 3, 9] and keep.hosts == {HOSTA}
    assert keep.namespaces[1].backend.size == 2 * MiB and keep.namespaces[2].backend.size == 3 * MiB
    assert not keep.namespaces[2].enabled and keep.namespaces[3].anagrpid == 4
    first = next(iter(svc.target.listeners.values()))
    assert first.ana_state(4) == AnaState.INACCESSIBLE and len(svc.target.listeners) == 2
    assert [r.traddr for r in svc.target.referrals] == ["192.0.2.2"]
