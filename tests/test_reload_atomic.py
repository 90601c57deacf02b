"""TargetService.reload is all or nothing over every step, not only the first ones: a failure in any of
them (removals, additions, host lists, resize, enabled, ANA group, ANA states, the gateway group's
store, the save) leaves the running configuration, the Target's live objects and the saved file as
they were; a reload that applies saves the file once."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from nvmeof.spec.logs import AnaState
from target import config as configmod
from target.core import Target
from target.service import ServiceError, TargetService
from tests.ports import free_ports

MiB = 1 << 20
KEEP = "nqn.2026-01.io.nvmeof-toolkit:atomic-keep"
GONE = "nqn.2026-01.io.nvmeof-toolkit:atomic-gone"
NEW = "nqn.2026-01.io.nvmeof-toolkit:atomic-new"
HOSTA = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-00000000000a"
HOSTB = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-00000000000b"


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
               {nsid: (id(ns), ns.backend.size, ns.enabled, ns.anagrpid) for nsid, ns in sub.namespaces.items()})
         for nqn, sub in t.subsystems.items()},
        {lid: (id(lst), dict(lst.ana_states)) for lid, lst in t.listeners.items()},
        [r.id for r in t.referrals],
        copy.deepcopy(svc._ana_saved),
    )


# (method, which call raises): the later calls of a step come after its earlier ones applied
STEPS = [("_reload_take_away", 1), ("_replay", 1), ("_reload_access", 1), ("_resize_step", 1),
         ("_resize_step", 2), ("_enabled_step", 1), ("_anagrpid_step", 1), ("_reload_ana", 1)]


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
    assert errors == [f"{method} refused (injected)"], errors
    assert calls == nth
    assert svc.snapshot() == snapshot and svc.live_config() == live
    assert live_objects(svc) == objects
    assert Path(svc.config_path).read_text() == saved


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

    svc.on_change = conflict
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

    svc.on_change = on_change
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
