"""discover() and connect_all() against our own target's discovery controller over TCP."""

from __future__ import annotations

import pytest
from test_initiator_controller import NQN, free_port, make_target

import initiator
from initiator.controller import HostController
from initiator.discovery import DiscoveryLogChanging
from nvmeof import defaults
from nvmeof.spec.fabrics import SubType, TrType
from nvmeof.spec.nvme import LogPageId
from target.core import Target
from target.service import TargetService

SECOND = "nqn.2026-11.io.nvmeof-toolkit:initiator-second"


@pytest.fixture
async def disc():
    target, service = await make_target()
    await service.add_subsystem(SECOND)
    await service.add_namespace(SECOND, backend="ram", size=1 << 20, block_size=512, nsid=1)
    io_port, disc_port = free_port(), free_port()
    await service.add_listener("tcp", "127.0.0.1", io_port)
    await service.add_listener("tcp", "127.0.0.1", disc_port, discovery=True)
    yield target, service, io_port, disc_port
    await target.close()


async def test_discover_lists_subsystems(disc: tuple[Target, TargetService, int, int]) -> None:
    target, _, io_port, disc_port = disc
    entries = await initiator.discover("127.0.0.1", disc_port)
    nvm = sorted((e.subnqn, e.traddr, e.trsvcid) for e in entries if e.subtype == SubType.NVME)
    assert nvm == sorted([(NQN, "127.0.0.1", str(io_port)), (SECOND, "127.0.0.1", str(io_port))])
    current = [e for e in entries if e.subtype == SubType.CURRENT]
    assert [(e.subnqn, e.trsvcid) for e in current] == [(defaults.DISCOVERY_NQN, str(disc_port))]
    assert all(e.trtype == TrType.TCP and e.transport == "tcp" for e in entries)
    assert not target.controllers   # the discovery controller was disconnected


async def test_discover_retries_while_genctr_changes(disc: tuple[Target, TargetService, int, int],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    target, _, _, disc_port = disc
    real = HostController.get_log_page
    calls: list[int] = []
    bumps = {"left": 1}

    async def spy(self: HostController, lid: int, length: int, **kw: int) -> bytes:
        offset = kw.get("offset", 0)
        calls.append(offset)
        if lid == LogPageId.DISCOVERY and offset >= 1024 and bumps["left"]:
            bumps["left"] -= 1
            target.discovery_changed()     # a change between the header and the entries
        return await real(self, lid, length, **kw)

    monkeypatch.setattr(HostController, "get_log_page", spy)
    entries = await initiator.discover("127.0.0.1", disc_port)
    assert len([e for e in entries if e.subtype == SubType.NVME]) == 2
    headers = [o for o in calls if o == 0]
    assert len(headers) == 4          # header, entries, header (changed) -> header, entries, header

    bumps["left"] = 100
    with pytest.raises(DiscoveryLogChanging, match="kept changing across 10 reads"):
        await initiator.discover("127.0.0.1", disc_port)


async def test_discover_loop_transport(disc: tuple[Target, TargetService, int, int]) -> None:
    target = disc[0]
    entries = await initiator.discover("loop", 0, transport="loop", target=target)
    assert {e.subnqn for e in entries if e.subtype == SubType.NVME} == {NQN, SECOND}


async def test_connect_all(disc: tuple[Target, TargetService, int, int]) -> None:
    disc_port = disc[3]
    ctrls = await initiator.connect_all("127.0.0.1", disc_port, nr_io_queues=1)
    try:
        assert sorted(c.subnqn for c in ctrls) == sorted([NQN, SECOND])
        for c in ctrls:
            assert c.disable_sqflow   # TREQ asked for it
            await c.write(1, 0, b"\x5a" * 512)
            assert await c.read(1, 0, 1) == b"\x5a" * 512
        assert len({c.hostnqn for c in ctrls}) == 1
    finally:
        for c in ctrls:
            await c.disconnect()
