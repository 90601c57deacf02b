"""target/transaction.py: one undo log per management change, run backwards when the change fails,
dropped once it is saved; and TargetService's replays (import, retry) and single calls going through it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from target import config as configmod
from target.core import Target
from target.service import ServiceError, TargetService
from target.transaction import Transaction
from tests.ports import free_ports

MiB = 1 << 20
NQN = "nqn.2026-01.io.nvmeof-toolkit:txn1"
NQN2 = "nqn.2026-01.io.nvmeof-toolkit:txn2"


async def test_a_refused_save_undoes_every_step_newest_first_and_drops_the_notices() -> None:
    state: list[int] = []
    undone: list[int] = []
    told: list[str] = []
    txn = Transaction()
    for step in (1, 2, 3):
        state.append(step)
        txn.undo_sync(lambda step=step: undone.append(state.pop()) if state[-1] == step else None)
    txn.after_sync(lambda: told.append("saved"))

    async def refuse() -> None:
        raise ServiceError(409, "refused (injected)")

    with pytest.raises(ServiceError, match="injected"):
        await txn.commit(refuse)
    assert state == [] and undone == [3, 2, 1] and told == []
    await txn.announce()
    assert told == [], "a notice of a change undone is never sent"


async def test_a_saved_change_keeps_its_steps_and_announces_in_order() -> None:
    state: list[int] = []
    told: list[int] = []
    txn = Transaction()
    for step in (1, 2):
        state.append(step)
        txn.undo_sync(lambda step=step: state.remove(step))
        txn.after_sync(lambda step=step: told.append(step))
    saves = 0

    async def save() -> None:
        nonlocal saves
        saves += 1

    await txn.commit(save)
    await txn.roll_back()   # nothing left to undo once saved
    assert saves == 1 and state == [1, 2]
    await txn.announce()
    assert told == [1, 2]


async def test_an_undo_that_raises_does_not_keep_the_older_steps_applied() -> None:
    state = {"a": 1, "b": 2}
    txn = Transaction()
    txn.undo_sync(lambda: state.pop("a"))
    txn.undo_sync(lambda: state.pop("missing"))   # raises KeyError
    txn.undo_sync(lambda: state.pop("b"))
    with pytest.raises(KeyError):
        await txn.roll_back()
    assert state == {}


async def test_an_import_whose_save_fails_takes_back_its_listener_and_ana_states(tmp_path: Path,
                                                                                 monkeypatch: Any) -> None:
    svc = TargetService(Target(), config_path=tmp_path / "config.json")
    try:
        await svc.add_subsystem(NQN, serial="T1")
        before, saved = svc.snapshot(), (tmp_path / "config.json").read_text()
        port, = free_ports(1)

        def refuse(path: Any, config: Any) -> None:
            raise configmod.ConfigError(f"{path}: disk full (injected)")

        monkeypatch.setattr(configmod, "save_config", refuse)
        config = {"version": 1,
                  "subsystems": [{"nqn": NQN2, "namespaces": [{"backend": "ram", "size": MiB}]}],
                  "listeners": [{"traddr": "127.0.0.1", "trsvcid": port, "ana_states": {"2": "inaccessible"}}],
                  "referrals": [{"traddr": "192.0.2.7", "trsvcid": 8009}]}
        with pytest.raises(ServiceError) as err:
            await svc.restore(config, persist=True)
        assert err.value.status == 500 and "the import was undone" in err.value.message
        assert svc.snapshot() == before and svc._ana_saved == {}
        assert list(svc.target.subsystems) == [NQN] and not svc.target.listeners and not svc.target.referrals
        assert (tmp_path / "config.json").read_text() == saved
    finally:
        await svc.target.close()


async def test_a_retry_whose_save_fails_keeps_the_items_waiting(tmp_path: Path, monkeypatch: Any) -> None:
    svc = TargetService(Target(), config_path=tmp_path / "config.json", backing_dirs=[tmp_path])
    try:
        await svc.add_subsystem(NQN, serial="T1")
        late = tmp_path / "late.img"
        config = {"version": 1, "subsystems": [{"nqn": NQN2, "namespaces": [
            {"backend": "file", "path": str(late)}]}]}
        assert len(await svc.restore(config)) == 1
        waiting = svc.unrestored()
        late.write_bytes(bytes(MiB))

        def refuse(path: Any, config: Any) -> None:
            raise configmod.ConfigError(f"{path}: disk full (injected)")

        monkeypatch.setattr(configmod, "save_config", refuse)
        with pytest.raises(ServiceError, match="the retry was undone"):
            await svc.retry_unrestored()
        assert svc.unrestored() == waiting and not svc.get_subsystem(NQN2).namespaces
    finally:
        await svc.target.close()
