"""The gateway group's member logic (target/gateway/group.py) with in-process targets sharing a dir store.

Each member is a real Target + TargetService with a real NVMe/TCP listener on loopback; a "crash" closes
the member's store files without any clean-up (what the kernel does to a process killed with -9) and
stops its target. Ticks are short (lease 0.6 s) so every wait below is bounded and fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from nvmeof.spec.logs import AnaState
from target.core import Target
from target.gateway.dirstore import DirStore
from target.gateway.group import GatewayGroup, candidate, cntlid_range, preferred_owner
from target.gateway.store import MemberRecord, StoreError, now
from target.service import ServiceError, TargetService
from tests.ports import free_port

SUB = "nqn.2026-12.io.nvmeof-toolkit:gw"
LEASE = 0.6
WAIT = 10.0  # generous bound for every state change below (they take a few ticks)
OPT, NONOPT, INACC, CHANGE = AnaState.OPTIMIZED, AnaState.NON_OPTIMIZED, AnaState.INACCESSIBLE, AnaState.CHANGE


class Member:
    def __init__(self, store_dir: Path, name: str, **kw) -> None:
        self.name = name
        self.target = Target()
        self.service = TargetService(self.target)
        self.store = DirStore(store_dir, "g1", LEASE, poll=0.05)
        self.group = GatewayGroup(self.service, self.store, name=name, tick=LEASE / 3, **kw)
        self.port = free_port()

    async def start(self, *, first: bool = False) -> Member:
        await self.group.join()
        if first:
            await self.service.add_subsystem(SUB, allow_any_host=True)
            await self.service.add_namespace(SUB, backend="null", size=1 << 20, nsid=1, anagrpid=1)
            await self.service.add_namespace(SUB, backend="null", size=1 << 20, nsid=2, anagrpid=2)
        assert await self.group.adopt() == []
        await self.service.add_listener("tcp", "127.0.0.1", self.port)
        await self.group.start()
        return self

    def states(self) -> dict[int, AnaState]:
        lst = next(x for x in self.target.listeners.values() if not x.discovery)
        return {g: lst.ana_state(g) for g in (1, 2)}

    async def crash(self) -> None:
        """kill -9: no standby, no release; the kernel drops the flocks (closing our fds does the same)."""
        for task in self.group._tasks:
            task.cancel()
        self.store._stop.set()
        self.store.leave()
        await self.target.close()

    async def stop(self) -> None:
        await self.group.stop()
        await self.target.close()


@contextlib.asynccontextmanager
async def member_pair(store_dir: Path) -> AsyncIterator[tuple[Member, Member]]:
    """Members gw-a (which makes the subsystem and NSIDs 1 and 2) and gw-b, started on one dir store; both
    stopped after, gw-b first."""
    a = await Member(store_dir, "gw-a").start(first=True)
    try:
        b = await Member(store_dir, "gw-b").start()
    except BaseException:
        await a.stop()
        raise
    try:
        yield a, b
    finally:
        await b.stop()
        await a.stop()


async def until(check: Callable[[], bool], what: str, timeout: float = WAIT) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def test_preferred_owner_and_candidate_are_stable_by_index() -> None:
    members = [MemberRecord("b", 1, True, {}), MemberRecord("a", 0, True, {}), MemberRecord("c", 2, False, {})]
    assert [preferred_owner(g, members).name for g in (1, 2, 3, 4)] == ["a", "b", "c", "a"]
    alive = lambda m: m.alive  # noqa: E731
    assert candidate(3, members, alive) == "a"  # c is dead: the next one after it in index order
    assert candidate(2, members, alive) == "b"
    assert candidate(1, [], alive) is None
    assert cntlid_range(0) == (1, 2040) and cntlid_range(1) == (2041, 4080)


def test_two_members_split_groups_and_disjoint_cntlids(tmp_path: Path) -> None:
    async def go() -> None:
        async with member_pair(tmp_path) as (a, b):
            await until(lambda: a.group.owned == {1} and b.group.owned == {2}, "a owns 1, b owns 2")
            await until(lambda: a.states() == {1: OPT, 2: NONOPT} and b.states() == {1: NONOPT, 2: OPT},
                        "states follow ownership")
            assert (a.target.cntlid_min, a.target.cntlid_max) == (1, 2040)
            assert (b.target.cntlid_min, b.target.cntlid_max) == (2041, 4080)
            # the shared configuration reached b: same namespaces, same identities
            ids = lambda m: [(n.nsid, n.uuid, n.nguid, n.anagrpid) for n in m.service.list_namespaces(SUB)]  # noqa: E731
            assert ids(a) == ids(b) and len(ids(b)) == 2
            report = await a.group.report()
            assert [(m["name"], m["index"], m["alive"]) for m in report["members"]] == [
                ("gw-a", 0, True), ("gw-b", 1, True)]
            assert [(g["anagrpid"], g["owner"], g["preferred"]) for g in report["ana_groups"]] == [
                (1, "gw-a", "gw-a"), (2, "gw-b", "gw-b")]
            # each discovery log lists the other's listener
            assert [p.trsvcid for p in a.target.peer_listeners] == [b.port]
            assert [p.trsvcid for p in b.target.peer_listeners] == [a.port]

    asyncio.run(go())


def test_crash_fails_over_and_restart_fails_back(tmp_path: Path) -> None:
    async def go() -> None:
        a = await Member(tmp_path, "gw-a").start(first=True)
        b = await Member(tmp_path, "gw-b").start()
        await until(lambda: a.group.owned == {1} and b.group.owned == {2}, "initial split")
        await a.crash()
        took = await until(lambda: b.group.owned == {1, 2} and b.states() == {1: OPT, 2: OPT}, "b takes group 1")
        assert took < 2.0, f"failover over a dir store took {took:.2f} s"
        a2 = await Member(tmp_path, "gw-a").start()
        assert a2.group.index == 0  # the same index (and CNTLID range) as before the crash
        seen_unusable = []

        def watch() -> bool:
            for g in (1, 2):  # never inaccessible on every member
                if a2.states()[g] not in (OPT, NONOPT) and b.states()[g] not in (OPT, NONOPT):
                    seen_unusable.append(g)
            return a2.group.owned == {1} and b.group.owned == {2} and a2.states()[1] == OPT and b.states()[1] == NONOPT

        await until(watch, "failback: group 1 back on gw-a")
        assert not seen_unusable
        await b.stop()
        await a2.stop()

    asyncio.run(go())


def test_failback_manual_keeps_the_survivor(tmp_path: Path) -> None:
    async def go() -> None:
        a = await Member(tmp_path, "gw-a", failback="manual").start(first=True)
        await until(lambda: a.group.owned == {1, 2}, "alone, gw-a owns both")
        b = await Member(tmp_path, "gw-b", failback="manual").start()
        await asyncio.sleep(LEASE * 2)
        assert a.group.owned == {1, 2} and b.group.owned == set()  # manual: group 2 stays where it is
        await a.crash()
        await until(lambda: b.group.owned == {1, 2}, "b takes group 1")
        a2 = await Member(tmp_path, "gw-a", failback="manual").start()
        await asyncio.sleep(LEASE * 3)
        assert b.group.owned == {1, 2} and a2.group.owned == set()
        assert a2.states() == {1: NONOPT, 2: NONOPT}
        await b.stop()  # a clean stop hands everything to the one left
        await until(lambda: a2.group.owned == {1, 2}, "a2 takes both after b stops")
        await a2.stop()

    asyncio.run(go())


def test_deleting_the_owners_listener_moves_its_groups(tmp_path: Path) -> None:
    async def go() -> None:
        a = await Member(tmp_path, "gw-a").start(first=True)
        b = await Member(tmp_path, "gw-b").start()
        await until(lambda: a.group.owned == {1} and b.group.owned == {2}, "initial split")
        lid = next(iter(a.target.listeners))
        await a.service.remove_listener(lid)
        await until(lambda: b.group.owned == {1, 2} and a.group.owned == set(), "group 1 moves to gw-b")
        await a.service.add_listener("tcp", "127.0.0.1", a.port)
        await until(lambda: a.group.owned == {1} and a.states() == {1: OPT, 2: NONOPT}, "back once it listens")
        await b.stop()
        await a.stop()

    asyncio.run(go())


def test_inaccessible_standby_uses_change_while_nobody_owns(tmp_path: Path) -> None:
    async def go() -> None:
        a = await Member(tmp_path, "gw-a", standby=INACC).start(first=True)
        b = await Member(tmp_path, "gw-b", standby=INACC).start()
        await until(lambda: a.states() == {1: OPT, 2: INACC} and b.states() == {1: INACC, 2: OPT}, "split")
        # unowned (nobody claims it): ANA change, never inaccessible
        assert a.group.unowned_state == CHANGE
        await a.crash()
        # the moment b sees a gone, group 1 is nobody's: change (hosts retry), not inaccessible, until b owns it
        await until(lambda: b.states()[1] in (CHANGE, OPT), "b leaves inaccessible for group 1")
        await until(lambda: b.states() == {1: OPT, 2: OPT}, "b owns both")
        await b.stop()

    asyncio.run(go())


def test_a_change_on_any_member_reaches_the_others(tmp_path: Path) -> None:
    async def go() -> None:
        async with member_pair(tmp_path) as (a, b):
            ns = await b.service.add_namespace(SUB, backend="null", size=1 << 20, nsid=3, anagrpid=2)
            await until(lambda: 3 in a.service.get_subsystem(SUB).namespaces, "nsid 3 on gw-a")
            assert a.service.get_namespace(SUB, 3).uuid == ns.uuid
            await a.service.remove_namespace(SUB, 3)
            await until(lambda: 3 not in b.service.get_subsystem(SUB).namespaces, "nsid 3 gone from gw-b")
            # a write based on a stale version is refused and undone (compare-and-swap)
            b.group.config_version -= 1
            with pytest.raises(ServiceError) as err:
                await b.service.add_namespace(SUB, backend="null", size=1 << 20, nsid=4)
            assert err.value.status == 409 and "another gateway" in err.value.message
            assert 4 not in b.service.get_subsystem(SUB).namespaces
            # listeners stay per gateway
            assert {lst.trsvcid for lst in a.target.listeners.values()} == {a.port}

    asyncio.run(go())


class CutStore(DirStore):
    """A dir store with a lease (like RADOS) whose calls hang once cut: a member cut off from the store."""

    cut = False

    def _slow(self) -> None:
        while self.cut:
            time.sleep(0.05)

    def try_acquire(self, anagrpid: int) -> bool:
        sent = now()  # the group's clock (lease_deadline is on it)
        ok = super().try_acquire(anagrpid)
        if ok:
            self._held_until(anagrpid, sent + self.lease - 0.2)
        return ok

    def renew(self, anagrpid: int) -> bool:
        sent = now()
        self._slow()
        ok = super().renew(anagrpid)
        if ok:
            self._held_until(anagrpid, sent + self.lease - 0.2)
        return ok

    def heartbeat(self) -> None:
        self._slow()
        if self.cut:
            raise StoreError("cut")


def test_a_member_cut_off_from_the_store_steps_down_before_its_lease_ends(tmp_path: Path) -> None:
    async def go() -> None:
        a = Member(tmp_path, "gw-a")
        a.store = CutStore(tmp_path, "g1", LEASE, poll=0.05)
        a.group = GatewayGroup(a.service, a.store, name="gw-a", tick=LEASE / 3)
        await a.start(first=True)
        await until(lambda: a.group.owned == {1, 2}, "alone: owns both")
        renewed = a.store.lease_deadline(1)
        assert renewed is not None
        a.store.cut = True
        await until(lambda: a.states() == {1: NONOPT, 2: NONOPT}, "steps down")
        assert now() < renewed + 0.2 + 0.15  # by its fencing deadline (plus a loop turn), inside the lease
        a.store.cut = False
        await until(lambda: a.group.owned == {1, 2}, "takes them again once the store answers")
        await a.stop()

    asyncio.run(go())


def test_a_second_process_with_the_same_name_is_refused(tmp_path: Path) -> None:
    async def go() -> None:
        a = await Member(tmp_path, "gw-a").start(first=True)
        twin = Member(tmp_path, "gw-a")
        with pytest.raises(StoreError, match="already running"):
            await twin.group.join()
        other = DirStore(tmp_path, "other-group", LEASE)
        with pytest.raises(StoreError, match="gateway group 'g1'"):
            other.join("gw-c", {})
        await a.stop()

    asyncio.run(go())


def test_rest_gateway_report(tmp_path: Path) -> None:
    import httpx

    from api.app import create_app

    async def get(service: TargetService) -> httpx.Response:
        app = create_app(service, token="t0k")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get("/api/v1/gateway", headers={"Authorization": "Bearer t0k"})

    async def go() -> None:
        alone = TargetService(Target())
        answer = await get(alone)
        assert answer.status_code == 404 and "--gateway-group" in answer.json()["detail"]
        async with member_pair(tmp_path) as (a, b):
            await until(lambda: a.group.owned == {1} and b.group.owned == {2}, "split")
            await asyncio.sleep(LEASE)  # b's published info catches up
            body = (await get(a.service)).json()
            assert body["group"] == "g1" and body["name"] == "gw-a" and body["store"].startswith("dir:")
            assert [(m["name"], m["cntlid_range"], m["owns"], [x["trsvcid"] for x in m["listeners"]])
                    for m in body["members"]] == [("gw-a", [1, 2040], [1], [a.port]),
                                                  ("gw-b", [2041, 4080], [2], [b.port])]
            assert body["ana_groups"] == [
                {"anagrpid": 1, "owner": "gw-a", "preferred": "gw-a",
                 "states": {"gw-a": "optimized", "gw-b": "non-optimized"}, "fenced": None},
                {"anagrpid": 2, "owner": "gw-b", "preferred": "gw-b",
                 "states": {"gw-a": "non-optimized", "gw-b": "optimized"}, "fenced": None}]

    asyncio.run(go())


def test_daemon_gateway_options_are_checked(tmp_path: Path) -> None:
    from nvmeof.cli.daemon import Daemon, DaemonError, DaemonOptions

    async def go() -> None:
        with pytest.raises(DaemonError, match="--group-store needs --gateway-group"):
            Daemon(DaemonOptions(group_store=f"dir:{tmp_path}"))
        with pytest.raises(DaemonError, match="--gateway-group needs --group-store"):
            Daemon(DaemonOptions(gateway_group="g1"))
        with pytest.raises(DaemonError, match="give dir:PATH"):
            Daemon(DaemonOptions(gateway_group="g1", group_store="nfs:/x"))
        with pytest.raises(DaemonError, match="gateway group name 'bad name'"):
            Daemon(DaemonOptions(gateway_group="bad name", group_store=f"dir:{tmp_path}"))
        daemon = Daemon(DaemonOptions(gateway_group="g1", gateway_name="gw-z", group_store=f"dir:{tmp_path}"))
        assert daemon.gateway is not None and daemon.gateway.name == "gw-z"

    asyncio.run(go())


def test_a_ram_disk_is_refused_in_a_group_and_nothing_reaches_the_store(tmp_path: Path) -> None:
    """Each gateway would serve its own RAM disk under one NGUID/UUID: a multipath host switching paths
    would silently read another disk. A file on shared storage, RBD and null serve the same data."""
    async def go() -> None:
        async with member_pair(tmp_path) as (a, b):
            with pytest.raises(ServiceError) as err:
                await a.service.add_namespace(SUB, backend="ram", size=1 << 20, nsid=7)
            assert err.value.status == 400
            assert "cannot be exported by gateway group g1" in err.value.message
            assert "--backend file" in err.value.message
            await asyncio.sleep(LEASE)
            assert 7 not in a.service.get_subsystem(SUB).namespaces
            assert 7 not in b.service.get_subsystem(SUB).namespaces

    asyncio.run(go())


def test_a_dead_member_is_removed_for_good_and_no_longer_counts(tmp_path: Path) -> None:
    """DELETE /gateway/members/NAME (nvmeof gateway remove): refused while alive (409) or unknown (404); once
    removed, n counts the remaining members (group 3 prefers (3-1) % 2 = index 0, not the dead gw-c), and a new
    member gets the freed index and CNTLID range, and with them group 3."""
    import httpx

    from api.app import create_app

    async def call(service: TargetService, method: str, path: str) -> httpx.Response:
        app = create_app(service, token="t0k")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.request(method, f"/api/v1/gateway{path}", headers={"Authorization": "Bearer t0k"})

    def preferred(report: dict, g: int) -> str:
        return next(x["preferred"] for x in report["ana_groups"] if x["anagrpid"] == g)

    async def go() -> None:
        a = await Member(tmp_path, "gw-a").start(first=True)
        await a.service.add_namespace(SUB, backend="null", size=1 << 20, nsid=3, anagrpid=3)
        b = await Member(tmp_path, "gw-b").start()
        c = await Member(tmp_path, "gw-c").start()
        d = None
        try:
            await until(lambda: (a.group.owned, b.group.owned, c.group.owned) == ({1}, {2}, {3}), "three-way split")
            assert preferred((await call(b.service, "GET", "")).json(), 3) == "gw-c"
            await c.crash()
            await until(lambda: a.group.owned == {1, 3}, "gw-a takes group 3 over")
            alive = await call(b.service, "DELETE", "/members/gw-a")
            assert alive.status_code == 409 and "gw-a is alive" in alive.json()["detail"]
            assert (await call(b.service, "DELETE", "/members/gw-b")).status_code == 409  # itself
            assert (await call(b.service, "DELETE", "/members/gw-x")).status_code == 404
            assert (await call(b.service, "DELETE", "/members/gw-c")).status_code == 204
            report = (await call(b.service, "GET", "")).json()
            assert [m["name"] for m in report["members"]] == ["gw-a", "gw-b"]
            assert preferred(report, 3) == "gw-a" and preferred(report, 2) == "gw-b"
            assert a.group.owned == {1, 3} and b.group.owned == {2}
            d = await Member(tmp_path, "gw-d").start()
            assert d.group.index == 2 and (d.target.cntlid_min, d.target.cntlid_max) == cntlid_range(2)
            await until(lambda: d.group.owned == {3} and a.group.owned == {1}, "group 3 fails back to gw-d")
        finally:
            for m in (d, b, a):
                if m is not None:
                    await m.stop()

    asyncio.run(go())
