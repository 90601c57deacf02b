"""Our initiator's ANA support and multipath (issue 15): the ANA log (0Ch), ANA change AENs,
connect_multipath's routing, failover on ANA states and on lost paths, reconnection, refusals.

Against our target in-process: one Target with two TCP listeners on loopback (two ports of one subsystem,
so two controllers with distinct CNTLIDs), whose per-listener ANA states TargetService.set_ana_state sets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import pytest
from ports import free_ports

import initiator
from initiator import sync
from initiator.controller import HostController
from initiator.multipath import MultipathController, MultipathError, NoPathError
from nvmeof.spec.logs import AnaState
from nvmeof.status import NvmeError, Status
from target.core import Target
from target.service import TargetService

SUBNQN = "nqn.2026-01.com.example:multipath"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:0e9c3a1d-5b55-4c3e-9a4b-3c2f1a0b9d71"
BS = 512
DEADLINE = 20.0     # generous bound for things that happen in milliseconds


class Rig:
    def __init__(self, tgt: Target, svc: TargetService, ports: list[int], listener_ids: list[str]) -> None:
        self.tgt = tgt
        self.svc = svc
        self.ports = ports
        self.listener_ids = listener_ids

    @property
    def paths(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.ports]

    async def state(self, index: int, state: str, anagrpid: int = 1) -> None:
        await self.svc.set_ana_state(self.listener_ids[index], anagrpid, state)


@contextlib.asynccontextmanager
async def rig(nlisteners: int = 2, *, namespaces: dict[int, int] | None = None) -> AsyncIterator[Rig]:
    """A target with ``nlisteners`` TCP listeners and namespaces {nsid: anagrpid} (default {1: 1})."""
    tgt = Target()
    svc = TargetService(tgt)
    try:
        await svc.add_subsystem(SUBNQN, serial="MPATH1", allow_any_host=True)
        for nsid, grp in (namespaces or {1: 1}).items():
            await svc.add_namespace(SUBNQN, backend="ram", size=1 << 20, nsid=nsid, anagrpid=grp)
        ports = free_ports(nlisteners)
        listeners = [await svc.add_listener("tcp", "127.0.0.1", p) for p in ports]
        yield Rig(tgt, svc, ports, [lst.id for lst in listeners])
    finally:
        await tgt.close()


def connect(r: Rig, **kwargs) -> initiator.connecting._Connecting:
    kwargs.setdefault("max_reconnect_delay", 0.2)
    kwargs.setdefault("no_path_timeout", DEADLINE)
    return initiator.connect_multipath(r.paths, SUBNQN, hostnqn=HOSTNQN, **kwargs)


async def until(check: Callable[[], bool], what: str, deadline: float = DEADLINE) -> None:
    async with asyncio.timeout(deadline):
        while not check():
            await asyncio.sleep(0.01)


def ios(mp: MultipathController) -> list[int]:
    return [p.ios for p in mp.paths()]


def path_state(mp: MultipathController, index: int, nsid: int = 1) -> str | None:
    return mp.paths()[index].ana_states.get(nsid)


# ---- one controller: the ANA log and its events ------------------------------------------------

async def test_ana_log_sized_from_identify_and_parsed():
    async with rig(1, namespaces={1: 1, 2: 2, 3: 2}) as r:
        await r.state(0, "non-optimized", anagrpid=2)
        async with initiator.connect("127.0.0.1", r.ports[0], SUBNQN, hostnqn=HOSTNQN) as ctrl:
            ident = ctrl.identity
            assert ctrl.ana_supported and ctrl.anatt == ident.anatt > 0
            # nvme_mpath_init_identify: header + NANAGRPID descriptors + MNAN NSIDs
            assert ident.mnan > 0
            assert ctrl.ana_log_size == 16 + 32 * ident.nanagrpid + 4 * ident.mnan
            ana = await ctrl.get_ana_log()
            assert [(g.anagrpid, g.state, g.nsids) for g in ana.groups] == [
                (1, AnaState.OPTIMIZED, [1]), (2, AnaState.NON_OPTIMIZED, [2, 3])]
            assert ctrl.ana_log == ana
            groups_only = await ctrl.get_ana_log(rgo=True)
            assert [(g.anagrpid, g.state, g.nsids) for g in groups_only.groups] == [
                (1, AnaState.OPTIMIZED, []), (2, AnaState.NON_OPTIMIZED, [])]
            assert ctrl.ana_log == ana   # an RGO read does not replace the NSID map
            assert await ctrl.ana_states() == {1: AnaState.OPTIMIZED, 2: AnaState.NON_OPTIMIZED,
                                               3: AnaState.NON_OPTIMIZED}
            assert ctrl.ana_state(3) == AnaState.NON_OPTIMIZED and ctrl.ana_state(9) is None


async def test_ana_change_aen_rereads_the_log_and_rearms():
    async with rig(1) as r:
        events = []
        async with initiator.connect("127.0.0.1", r.ports[0], SUBNQN, hostnqn=HOSTNQN,
                                     event_callback=events.append) as ctrl:
            assert ctrl.ana_state(1) == AnaState.OPTIMIZED
            for n, state in enumerate(("inaccessible", "change", "non-optimized"), 1):
                await r.state(0, state)
                await until(lambda n=n: len(events) >= n, f"ANA change event {n}")
                ev = events[-1]
                assert ev.description == "NOTICE ANA_CHANGE" and ev.lid == 0x0C
                assert ev.ana_log is not None and ev.ana_log.groups[0].state.name == state.upper().replace("-", "_")
                # the controller's own view followed (the AER was re-armed for the next change)
                assert ctrl.ana_log == ev.ana_log
            assert ctrl.ana_state(1) == AnaState.NON_OPTIMIZED
            # an I/O where the group is inaccessible: the path-related status, DNR clear
            await r.state(0, "inaccessible")
            with pytest.raises(NvmeError) as err:
                await ctrl.write(1, 0, bytes(BS))
            assert err.value.status == Status.ANA_INACCESSIBLE and not err.value.dnr


# ---- routing ---------------------------------------------------------------------------------

async def test_io_goes_to_the_optimized_path():
    async with rig() as r:
        await r.state(0, "non-optimized")
        async with connect(r) as mp:
            assert mp.paths()[0].cntlid != mp.paths()[1].cntlid
            for i in range(4):
                await mp.write(1, i, bytes([i]) * BS)
            assert ios(mp) == [0, 4]
            # the optimized path goes away: the non-optimized one is the fallback (__nvme_find_path)
            await r.state(1, "inaccessible")
            await until(lambda: path_state(mp, 1) == "inaccessible", "path 1 inaccessible")
            await mp.write(1, 0, bytes(BS))
            assert ios(mp) == [1, 4]
            # and when path 0 becomes optimized again it is preferred
            await r.state(1, "non-optimized")
            await r.state(0, "optimized")
            await until(lambda: path_state(mp, 0) == "optimized" and path_state(mp, 1) == "non-optimized", "back")
            await mp.write(1, 0, bytes(BS))
            assert ios(mp) == [2, 4]


async def test_round_robin_spreads_over_optimized_paths():
    async with rig() as r, connect(r, iopolicy="round-robin") as mp:
        for _ in range(6):
            assert await mp.read(1, 0, 1) == bytes(BS)
        assert ios(mp) == [3, 3]
        await r.state(1, "non-optimized")
        await until(lambda: path_state(mp, 1) == "non-optimized", "path 1 non-optimized")
        for _ in range(4):
            await mp.read(1, 0, 1)
        assert ios(mp) == [7, 3]   # round-robin prefers optimized paths too


async def test_inaccessible_moves_io_to_the_other_path_without_error():
    async with rig() as r:
        await r.state(1, "non-optimized")
        async with connect(r) as mp:
            await mp.write(1, 0, b"\x11" * BS)
            assert ios(mp) == [1, 0]
            await r.state(0, "inaccessible")
            await mp.write(1, 1, b"\x22" * BS)   # no error to the caller, whichever way it learnt
            assert ios(mp) == [1, 1]
            assert await mp.read(1, 0, 2) == b"\x11" * BS + b"\x22" * BS


async def test_ana_status_on_io_fails_over_and_rereads(caplog):
    """A host that missed the AEN learns from the I/O's ANA status (nvme_failover_req)."""
    caplog.set_level(logging.INFO, "initiator.multipath")
    async with rig() as r:
        await r.state(1, "non-optimized")
        async with connect(r) as mp:
            await r.state(0, "inaccessible")
            await until(lambda: path_state(mp, 0) == "inaccessible", "path 0 inaccessible")
            # make path 0's controller believe it is still optimized, as if the event had not come yet
            ctrl0 = mp.controllers[0]
            ctrl0._ana_nsids[1] = AnaState.OPTIMIZED
            mp._current.clear()
            await mp.write(1, 5, b"\x33" * BS)
            assert ios(mp) == [0, 1]
            assert "ANA_INACCESSIBLE" in caplog.text or "Asymmetric Access Inaccessible" in caplog.text
            await until(lambda: ctrl0.ana_state(1) == AnaState.INACCESSIBLE, "path 0 log re-read")
            assert await mp.read(1, 5, 1) == b"\x33" * BS


async def test_transition_waits_for_a_usable_path():
    async with rig() as r:
        await r.state(0, "change")
        await r.state(1, "change")
        async with connect(r) as mp:
            io = asyncio.create_task(mp.write(1, 0, b"\x44" * BS))
            await asyncio.sleep(0.3)
            assert not io.done()            # queued, like the kernel's requeue list
            await r.state(1, "optimized")
            async with asyncio.timeout(DEADLINE):
                await io
            assert ios(mp) == [0, 1]


async def test_no_usable_path_fails_after_no_path_timeout():
    async with rig() as r:
        await r.state(0, "inaccessible")
        await r.state(1, "persistent-loss")
        async with connect(r, no_path_timeout=0.3) as mp:
            with pytest.raises(NoPathError, match=r"no usable path within 0.3 s.*inaccessible.*persistent-loss"):
                await mp.write(1, 0, bytes(BS))
            assert ios(mp) == [0, 0]


async def test_namespace_unknown_to_every_path_gets_the_targets_answer():
    async with rig() as r, connect(r, no_path_timeout=DEADLINE) as mp:
        with pytest.raises(NvmeError) as err:
            async with asyncio.timeout(DEADLINE / 2):   # no waiting for a path: the target says why
                await mp.read(7, 0, 1)
        assert err.value.status in (Status.INVALID_NS, Status.INVALID_FIELD)


# ---- lost paths ------------------------------------------------------------------------------

async def test_killed_connection_fails_over_and_the_path_comes_back():
    async with rig() as r, connect(r) as mp:
        await mp.write(1, 0, b"\x55" * BS)
        assert ios(mp) == [1, 0]
        cntlid0 = mp.paths()[0].cntlid
        await r.svc.disconnect_controller(cntlid0)
        for i in range(1, 5):
            await mp.write(1, i, bytes([0x55 + i]) * BS)   # no error to the caller
        assert ios(mp)[1] >= 3
        await until(lambda: mp.paths()[0].live and mp.paths()[0].reconnects == 1, "path 0 reconnected")
        assert mp.paths()[0].cntlid != cntlid0
        assert await mp.read(1, 0, 5) == b"".join(bytes([0x55 + i]) * BS for i in range(5))


async def test_removed_listener_fails_over_and_the_path_returns_with_it():
    async with rig() as r, connect(r) as mp:
        await mp.write(1, 0, b"\x66" * BS)
        removed = await r.svc.remove_listener(r.listener_ids[0])
        assert removed == 1
        await mp.write(1, 1, b"\x67" * BS)
        assert ios(mp)[1] >= 1
        await until(lambda: not mp.paths()[0].live, "path 0 down")
        await asyncio.sleep(0.5)     # several refused reconnect attempts
        assert not mp.paths()[0].live and mp.paths()[0].error
        await r.svc.add_listener("tcp", "127.0.0.1", r.ports[0])
        await mp.wait_paths(timeout=DEADLINE)
        info = mp.paths()[0]
        assert info.live and info.reconnects == 1 and info.ana_states == {1: "optimized"}
        # numa keeps its current path while it stays optimized (nvme_numa_path); the returned path
        # takes the I/O once the other one stops being optimized
        await r.state(1, "inaccessible")
        await until(lambda: path_state(mp, 1) == "inaccessible", "path 1 inaccessible")
        before = ios(mp)
        await mp.write(1, 2, b"\x68" * BS)
        assert ios(mp) == [before[0] + 1, before[1]]
        assert await mp.read(1, 0, 3) == b"\x66" * BS + b"\x67" * BS + b"\x68" * BS


async def test_io_in_flight_while_paths_die_and_states_move():
    """A stream of writes and reads while the owner path is killed, flipped and restored: every request
    completes and every block reads back."""
    async with rig() as r:
        await r.state(1, "non-optimized")
        async with connect(r) as mp:
            async def stream() -> None:
                for i in range(120):
                    await mp.write(1, i, bytes([i]) * BS)
                    await asyncio.sleep(0)

            task = asyncio.create_task(stream())
            await asyncio.sleep(0.02)
            await r.svc.disconnect_controller(mp.paths()[0].cntlid)
            await r.state(0, "inaccessible")
            await r.state(1, "optimized")
            await asyncio.sleep(0.05)
            await r.state(0, "optimized")
            await r.state(1, "non-optimized")
            async with asyncio.timeout(DEADLINE):
                await task
            assert await mp.read(1, 0, 120) == b"".join(bytes([i]) * BS for i in range(120))


async def test_data_written_through_one_path_reads_back_through_the_other():
    async with rig() as r:
        await r.state(1, "inaccessible")
        async with connect(r) as mp:
            data = bytes(range(256)) * (8 * BS // 256)
            await mp.write(1, 16, data)
            await mp.flush(1)
            await mp.flush()
            assert ios(mp) == [2, 0]
            await r.state(1, "optimized")
            await r.state(0, "inaccessible")
            await until(lambda: path_state(mp, 0) == "inaccessible", "path 0 inaccessible")
            assert await mp.read(1, 16, 8) == data
            assert ios(mp) == [2, 1]


# ---- refusals --------------------------------------------------------------------------------

async def test_duplicate_cntlid_is_refused():
    """Two separate targets with the same subsystem NQN both start at CNTLID 1 (the kernel: "Duplicate cntlid")."""
    async with rig(1) as a, rig(1) as b:
        with pytest.raises(MultipathError, match=r"duplicate cntlid 1 .*--cntlid-range"):
            await initiator.connect_multipath([*a.paths, *b.paths], SUBNQN, hostnqn=HOSTNQN)
        assert not a.tgt.controllers and not b.tgt.controllers   # both paths were let go
        b.tgt.set_cntlid_range(100, 200)
        async with initiator.connect_multipath([*a.paths, *b.paths], SUBNQN, hostnqn=HOSTNQN) as mp:
            first, second = (p.cntlid for p in mp.paths())
            assert first < 100 <= second <= 200


async def test_every_path_presents_the_same_host():
    async with rig() as r, connect(r) as mp:
        ctrls = mp.controllers
        assert len(ctrls) == 2
        assert {c.hostnqn for c in ctrls} == {HOSTNQN} and len({c.hostid for c in ctrls}) == 1
        seen = {(c.hostnqn, bytes(c.hostid)) for c in r.tgt.controllers.values()}
        assert len(seen) == 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"iopolicy": "fastest"}, "iopolicy 'fastest' is not one of: numa, round-robin"),
    ({"no_path_timeout": -1}, "no_path_timeout must be >= 0"),
    ({"reconnect": True}, "does not take reconnect="),
])
async def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        await initiator.connect_multipath([("127.0.0.1", 1), ("127.0.0.1", 2)], SUBNQN, **kwargs)


async def test_refusals_name_what_was_wrong():
    with pytest.raises(ValueError, match="needs at least one"):
        MultipathController([], SUBNQN)
    with pytest.raises(ValueError, match="given twice"):
        MultipathController([("127.0.0.1", 4420), ("127.0.0.1", "4420")], SUBNQN)
    (port,) = free_ports(1)
    with pytest.raises(NoPathError, match=r"no path to .* could connect"):
        await initiator.connect_multipath([("127.0.0.1", port)], SUBNQN, timeout=2.0)


async def test_unreachable_path_at_connect_joins_later():
    async with rig(1) as r:
        (late,) = free_ports(1)
        async with initiator.connect_multipath([*r.paths, ("127.0.0.1", late)], SUBNQN, hostnqn=HOSTNQN,
                                               max_reconnect_delay=0.2) as mp:
            assert [p.live for p in mp.paths()] == [True, False]
            await mp.write(1, 0, bytes(BS))
            await r.svc.add_listener("tcp", "127.0.0.1", late)
            await mp.wait_paths(timeout=DEADLINE)
            assert mp.paths()[1].live and mp.paths()[1].cntlid != mp.paths()[0].cntlid


def test_sync_wrapper():
    async def make() -> tuple[Target, list[int]]:
        tgt = Target()
        svc = TargetService(tgt)
        await svc.add_subsystem(SUBNQN, serial="MPATH2", allow_any_host=True)
        await svc.add_namespace(SUBNQN, backend="ram", size=1 << 20, nsid=1)
        ports = free_ports(2)
        for p in ports:
            await svc.add_listener("tcp", "127.0.0.1", p)
        return tgt, ports

    tgt, ports = sync.run(make())
    try:
        with sync.connect_multipath([("127.0.0.1", p) for p in ports], SUBNQN, hostnqn=HOSTNQN) as mp:
            mp.write(1, 3, b"\x77" * BS)
            assert mp.read(1, 3, 1) == b"\x77" * BS
            assert [p.live for p in mp.paths()] == [True, True]
    finally:
        sync.run(tgt.close())


async def test_controller_without_ana_counts_as_optimized(monkeypatch):
    """A target that does not report ANA (CMIC bit 3 clear): its namespaces are optimized everywhere."""
    async with rig() as r:
        async with initiator.connect("127.0.0.1", r.ports[0], SUBNQN, hostnqn=HOSTNQN) as ctrl:
            ctrl.ana_supported = False
            assert ctrl.ana_state(1) == AnaState.OPTIMIZED
            assert await ctrl.ana_states() == {1: AnaState.OPTIMIZED}
            with pytest.raises(NvmeError, match="does not report ANA"):
                await ctrl.get_ana_log()
        assert isinstance(ctrl, HostController)
