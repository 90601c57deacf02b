"""Reservations across a gateway group (target/gateway/prstore.py): two in-process members sharing a dir
store, hosts on real NVMe/TCP connections to each; a reservation taken through one member is enforced on
the other before the command that took it completes, racing changes lose nothing, preempt and abort
reaches the other member's hosts, and the reservation outlives its member's crash."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from target_host import open_tcp
from test_target_reservations import HOST_A, HOST_B, HOST_C, Host

from nvmeof.spec.reservations import NotificationType
from nvmeof.spec.reservations import ReservationType as T
from nvmeof.status import Status
from target.gateway import prstore
from tests.test_gateway_group import SUB, Member, until


async def tcp_host(port: int, hostid: bytes, name: str) -> Host:
    hostnqn = f"nqn.2014-08.org.nvmexpress:uuid:{name}"
    admin = await open_tcp(port)
    res = await admin.connect(SUB, hostnqn=hostnqn, hostid=hostid)
    assert res.status == 0, res
    await admin.enable()
    io = await open_tcp(port)
    res = await io.connect(SUB, qid=1, cntlid=res.cqe.dw0 & 0xFFFF, sqsize=127, hostnqn=hostnqn, hostid=hostid)
    assert res.status == 0, res
    return Host(admin, io, hostid)


async def settled_pair(tmp_path: Path) -> tuple[Member, Member]:
    """Members gw-a (owner of ANA group 1, NSID 1) and gw-b (group 2, NSID 2) on one dir store, once ownership
    has settled; both stopped if it does not."""
    a = await Member(tmp_path, "gw-a").start(first=True)
    b = await Member(tmp_path, "gw-b").start()
    try:
        await until(lambda: a.group.owned == {1} and b.group.owned == {2}, "a owns 1, b owns 2")
    except BaseException:
        await b.stop()
        await a.stop()
        raise
    return a, b


def test_reservation_taken_on_one_member_is_enforced_on_the_other_at_once(tmp_path: Path) -> None:
    async def go() -> None:
        a, b = await settled_pair(tmp_path)
        try:
            ha = await tcp_host(a.port, HOST_A, "aaaa")
            hb = await tcp_host(b.port, HOST_B, "bbbb")
            hc = await tcp_host(b.port, HOST_C, "cccc")
            assert (await ha.register(0xA1)).status == 0
            assert (await ha.acquire(0xA1, T.EXCLUSIVE_ACCESS)).status == 0
            # no wait: the acquire completed only once gw-b had applied it
            assert (await hc.read()).status == Status.RESERVATION_CONFLICT
            assert (await hb.write()).status == Status.RESERVATION_CONFLICT
            assert (await ha.write()).status == 0
            # B registers through gw-b: one state, both members agree
            assert (await hb.register(0xB2)).status == 0
            _, rep_a = await ha.report()
            _, rep_b = await hb.report()
            assert rep_a == rep_b and rep_a.regctl == 2 and rep_a.rtype == T.EXCLUSIVE_ACCESS
            # racing registrations on both members: neither is lost (compare-and-swap, then retry)
            results = await asyncio.gather(hc.register(0xC3), ha.register(0xAA, crkey=0xA1, rrega=2))
            assert [r.status for r in results] == [0, 0]
            _, rep = await hb.report()
            assert {r.hostid: r.rkey for r in rep.registrants} == {HOST_A: 0xAA, HOST_B: 0xB2, HOST_C: 0xC3}
            assert rep.gen == 4
            # preempt and abort through gw-b: A (on gw-a) loses its registration there at once, and is told
            assert (await hb.acquire(0xB2, T.WRITE_EXCLUSIVE, racqa=2, prkey=0xAA)).status == 0
            assert (await ha.write()).status == Status.RESERVATION_CONFLICT
            assert (await ha.read()).status == 0      # write exclusive: reads stay open
            page = await ha.resv_log()
            assert page.type == NotificationType.REGISTRATION_PREEMPTED and page.nsid == 1
            assert (await hb.write()).status == 0
        finally:
            await b.stop()
            await a.stop()

    asyncio.run(go())


def test_reservation_survives_the_crash_of_the_member_it_was_taken_on(tmp_path: Path) -> None:
    async def go() -> None:
        a, b = await settled_pair(tmp_path)
        try:
            ha = await tcp_host(a.port, HOST_A, "aaaa")
            hc = await tcp_host(b.port, HOST_C, "cccc")
            assert (await ha.register(0xA1)).status == 0
            assert (await ha.acquire(0xA1, T.WRITE_EXCLUSIVE)).status == 0
            await a.crash()
            await until(lambda: b.group.owned == {1, 2}, "gw-b takes group 1")
            assert (await hc.write()).status == Status.RESERVATION_CONFLICT
            ha2 = await tcp_host(b.port, HOST_A, "aaaa")    # A's host reconnects through the survivor
            assert (await ha2.write()).status == 0
            _, rep = await ha2.report()
            assert rep.rtype == T.WRITE_EXCLUSIVE and [r.holds for r in rep.registrants] == [True]
            # a member that joins later reads the state from the store before it serves the namespace
            a2 = await Member(tmp_path, "gw-a").start()
            try:
                ns = a2.target.subsystems[SUB].namespaces[1]
                assert ns.pr.rtype == T.WRITE_EXCLUSIVE and ns.pr.holder == HOST_A
            finally:
                await a2.stop()
        finally:
            await b.stop()

    asyncio.run(go())


def test_a_restart_of_the_whole_group_clears_states_without_ptpl(tmp_path: Path) -> None:
    async def go() -> None:
        a = await Member(tmp_path, "gw-a").start(first=True)
        ha = await tcp_host(a.port, HOST_A, "aaaa")
        assert (await ha.register(0xA1)).status == 0                 # no PTPL
        assert (await ha.acquire(0xA1, T.WRITE_EXCLUSIVE)).status == 0
        await a.crash()
        a2 = await Member(tmp_path, "gw-a").start()                   # nobody else alive: a power loss
        try:
            assert not a2.target.subsystems[SUB].namespaces[1].pr.registrants
            ha = await tcp_host(a2.port, HOST_A, "aaaa")
            assert (await ha.register(0xA1, cptpl=3)).status == 0     # now with PTPL
            assert (await ha.acquire(0xA1, T.WRITE_EXCLUSIVE)).status == 0
        finally:
            await a2.crash()
        a3 = await Member(tmp_path, "gw-a").start()
        try:
            ns = a3.target.subsystems[SUB].namespaces[1]
            assert ns.pr.rtype == T.WRITE_EXCLUSIVE and ns.pr.ptpl
        finally:
            await a3.stop()

    asyncio.run(go())


def test_preempt_and_abort_on_one_member_waits_for_the_preempted_hosts_commands_on_the_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # gw-b would stop waiting for gw-a's acknowledgement after RESERVATION_ACK_TIMEOUT; far longer here, so
    # only the drain decides when the command completes
    monkeypatch.setattr(prstore, "RESERVATION_ACK_TIMEOUT", 120.0)

    async def go() -> None:
        a, b = await settled_pair(tmp_path)
        try:
            ha = await tcp_host(a.port, HOST_A, "aaaa")
            hb = await tcp_host(b.port, HOST_B, "bbbb")
            assert (await ha.register(0xA1)).status == 0
            assert (await hb.register(0xB2)).status == 0
            assert (await ha.acquire(0xA1, T.WRITE_EXCLUSIVE)).status == 0
            ns_a = a.target.subsystems[SUB].namespaces[1]
            # A command of host A still running on gw-a: the count target/pr.py `tracked` keeps while it runs
            # (a real one would have to be held inside a backend; the count is what the drain waits on).
            ns_a.pr_inflight[HOST_A] = 1
            preempt = asyncio.create_task(hb.acquire(0xB2, T.WRITE_EXCLUSIVE, racqa=2, prkey=0xA1))
            await until(lambda: ns_a.pr.holder == HOST_B, "gw-a enforces B's reservation")
            # gw-a enforces the new state at once (A's new writes conflict there) but has not acknowledged it
            # while A's command runs, so the preempt and abort on gw-b has not completed (nvmet_pr_do_abort)
            assert (await ha.write()).status == Status.RESERVATION_CONFLICT
            # without the drain gw-a acknowledges within a few store polls (tens of ms) and the command completes
            await asyncio.wait({preempt}, timeout=1.0)
            assert not preempt.done(), "preempt and abort completed while the preempted host's command still ran"
            del ns_a.pr_inflight[HOST_A]      # A's command finishes
            assert (await preempt).status == 0
            page = await ha.resv_log()
            assert page.type == NotificationType.REGISTRATION_PREEMPTED
        finally:
            await b.stop()
            await a.stop()

    asyncio.run(go())
