"""Regressions of the gateway group's safety rules (review of issue 15): a member never serves optimized a
group whose lock it does not hold, steps down at its fencing deadline whatever else is running, keeps its
background tasks alive, loses no configuration change, and its dir store follows the files it locks.

Same in-process members as tests/test_gateway_group.py (real Target + TargetService + loopback TCP listener,
a dir store shared through tmp_path, short ticks).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

from target.gateway.dirstore import DirStore
from target.gateway.group import GatewayGroup
from target.gateway.store import StoreError, now
from target.service import ServiceError
from tests.ports import free_port
from tests.test_gateway_group import INACC, LEASE, NONOPT, OPT, SUB, CutStore, Member, member_pair, until


def _io_listeners(m: Member):
    return [lst for lst in m.target.listeners.values() if not lst.discovery]


def _optimized_without_lock(*members: Member, group: int) -> list[str]:
    """Members that serve ``group`` optimized on some listener without holding its lock."""
    out = []
    for m in members:
        held = group in m.store.held()
        if not held and any(lst.ana_state(group) == OPT for lst in _io_listeners(m)):
            out.append(m.name)
    return out


def test_a_new_group_or_listener_is_never_optimized_without_the_lock(tmp_path: Path) -> None:
    """Finding 1: a namespace in a new ANA group, a listener added by REST, or one brought up from the file
    before the member starts its loop, all start in the standby state, not optimized on every member."""
    async def go() -> None:
        async with member_pair(tmp_path) as (a, b):
            await until(lambda: a.group.owned == {1} and b.group.owned == {2}, "initial split")
            await a.service.add_namespace(SUB, backend="null", size=1 << 20, nsid=3, anagrpid=3)
            # at once (no ownership step ran yet), and at every moment until one member owns it
            assert _optimized_without_lock(a, b, group=3) == []

            def settled() -> bool:
                assert _optimized_without_lock(a, b, group=3) == []
                return (3 in b.service.get_subsystem(SUB).namespaces
                        and len([m for m in (a, b) if 3 in m.group.owned]) == 1)

            await until(settled, "one member owns group 3")
            owner = a if 3 in a.group.owned else b
            await until(lambda: all(lst.ana_state(3) == OPT for lst in _io_listeners(owner)), "owner optimized")
            # a listener added by REST on the member that does not own group 1
            extra = await b.service.add_listener("tcp", "127.0.0.1", free_port())
            assert extra.ana_state(1) == NONOPT and extra.ana_state(7) == NONOPT
            assert _optimized_without_lock(a, b, group=1) == []

    asyncio.run(go())


def test_a_restarting_member_serves_standby_before_its_loop_runs(tmp_path: Path) -> None:
    """Finding 1, restart: the daemon brings the file's listeners up after join() but before adopt()/start()."""
    async def go() -> None:
        a = await Member(tmp_path, "gw-a").start(first=True)
        await until(lambda: a.group.owned == {1, 2}, "alone: owns both")
        c = Member(tmp_path, "gw-c", standby=INACC)
        await c.group.join()
        lst = await c.service.add_listener("tcp", "127.0.0.1", c.port)
        try:
            assert lst.ana_state(1) != OPT and lst.ana_state(2) != OPT
            # inaccessible standby: an unowned group is "change", and I/O to it is refused on this path
            assert set(lst.ana_blocked) >= {1, 2, 3}
        finally:
            await c.group.stop()
            await c.target.close()
            await a.stop()

    asyncio.run(go())


def _cut_member(tmp_path: Path) -> Member:
    a = Member(tmp_path, "gw-a")
    a.store = CutStore(tmp_path, "g1", LEASE, poll=0.05)
    a.group = GatewayGroup(a.service, a.store, name="gw-a", tick=LEASE / 3)
    return a


def test_the_fence_steps_down_while_the_service_lock_is_held(tmp_path: Path) -> None:
    """Finding 2: a mutation holding the TargetService lock (an RBD open, a store write) must not delay the
    step-down at the fencing deadline."""
    async def go() -> None:
        a = _cut_member(tmp_path)
        await a.start(first=True)
        await until(lambda: a.group.owned == {1, 2}, "alone: owns both")
        await a.service._lock.acquire()  # what a slow mutation does
        try:
            deadline = a.store.lease_deadline(1)
            assert deadline is not None
            a.store.cut = True
            await until(lambda: a.states() == {1: NONOPT, 2: NONOPT}, "steps down with the lock held",
                        timeout=LEASE * 4)
            assert now() < deadline + 0.2 + 0.15  # inside the lease, as without the lock
        finally:
            a.service._lock.release()
            a.store.cut = False
        await until(lambda: a.group.owned == {1, 2}, "takes them again")
        await a.stop()

    asyncio.run(go())


def test_renewals_go_on_while_a_configuration_apply_waits(tmp_path: Path) -> None:
    """Finding 2, the other half: the ownership step waiting (for the service lock) to apply a new shared
    configuration must not hold up the renewals; the owner stays optimized with a reachable store."""
    async def go() -> None:
        a = _cut_member(tmp_path)
        await a.start(first=True)
        await until(lambda: a.group.owned == {1, 2}, "alone: owns both")
        b = await Member(tmp_path, "gw-b", failback="manual").start()
        await a.service._lock.acquire()  # a slow mutation on gw-a
        try:
            await b.service.add_namespace(SUB, backend="null", size=1 << 20, nsid=3, anagrpid=1)
            await until(lambda: a.service._lock._waiters, "gw-a's step waits to apply version 2")
            end = time.monotonic() + 3 * LEASE
            while time.monotonic() < end:
                assert a.states()[1] == OPT and 1 in a.group.owned, "gw-a stepped down with its store reachable"
                await asyncio.sleep(0.02)
        finally:
            a.service._lock.release()
        await until(lambda: 3 in a.service.get_subsystem(SUB).namespaces, "gw-a applies version 2")
        await b.stop()
        await a.stop()

    asyncio.run(go())


def test_the_fence_task_survives_an_error(tmp_path: Path) -> None:
    """Finding 3: an exception while stepping down (PooledTarget.ana_changed -> pool.sync) must not end
    the task that fences; the next cut is fenced again."""
    async def go() -> None:
        a = _cut_member(tmp_path)
        await a.start(first=True)
        fence = next(t for t in a.group._tasks if t.get_name() == "gateway-fence")
        renew = next(t for t in a.group._tasks if t.get_name() == "gateway-renew")
        await until(lambda: a.group.owned == {1, 2}, "alone: owns both")
        real = a.target.ana_changed
        failures: list[str] = []

        def broken(**kw):  # PooledTarget.ana_changed -> pool.sync failing, in the fencing task only
            if "ana_changed" not in failures and asyncio.current_task() is fence:
                failures.append("ana_changed")
                raise RuntimeError("worker pool is gone")
            return real(**kw)

        real_deadline = a.store.lease_deadline

        def deadline_once(g: int):
            if "deadline" not in failures and asyncio.current_task() is fence:
                failures.append("deadline")
                raise RuntimeError("a bug")
            return real_deadline(g)

        a.store.lease_deadline = deadline_once
        await until(lambda: "deadline" in failures, "the fencing task met an error")
        await asyncio.sleep(LEASE)
        assert not fence.done()
        a.target.ana_changed = broken
        try:
            a.store.cut = True
            await until(lambda: a.states() == {1: NONOPT, 2: NONOPT}, "steps down despite the error")
            await asyncio.sleep(LEASE)
            assert not fence.done() and not renew.done()
            a.store.cut = False
            await until(lambda: a.group.owned == {1, 2}, "takes them again")
            a.store.cut = True
            await until(lambda: a.states() == {1: NONOPT, 2: NONOPT}, "fenced again")
            assert not fence.done()
        finally:
            a.store.cut = False  # a hung store thread would keep the interpreter from exiting
        await a.stop()

    asyncio.run(go())


def test_a_change_committed_while_the_store_config_is_applied_is_not_lost(tmp_path: Path) -> None:
    """Finding 4: a REST change on gw-b committing while gw-b applies a newer store version must either be
    refused (409, retry) or reach the store; never succeed locally and then vanish."""
    async def go() -> None:
        a = await Member(tmp_path, "gw-a").start(first=True)
        b = await Member(tmp_path, "gw-b").start()
        try:
            await until(lambda: a.group.owned == {1} and b.group.owned == {2}, "initial split")
            gate = asyncio.Event()
            orig = b.group._on_change
            calls = []

            async def paused() -> None:
                calls.append(asyncio.current_task())
                if len(calls) == 1:  # the REST change: wait inside its commit, holding b's service lock
                    await gate.wait()
                await orig()

            b.service.set_change_hook(paused)
            rest = asyncio.get_running_loop().create_task(
                b.service.add_namespace(SUB, backend="null", size=1 << 20, nsid=5))
            await until(lambda: len(calls) == 1, "the REST change is committing")
            await a.service.add_namespace(SUB, backend="null", size=1 << 20, nsid=6)
            # b's step reads version N+1 and waits for the service lock to apply it
            await until(lambda: b.service._lock._waiters, "gw-b's apply waits for the lock")
            gate.set()
            try:
                await rest
                ok = True
            except ServiceError as exc:
                assert exc.status == 409, exc.message
                ok = False
            await until(lambda: 6 in b.service.get_subsystem(SUB).namespaces, "gw-b applied nsid 6")
            if ok:  # it succeeded: it must be in the store, so on both members
                await until(lambda: 5 in a.service.get_subsystem(SUB).namespaces, "nsid 5 reached gw-a")
                assert 5 in b.service.get_subsystem(SUB).namespaces
            else:
                assert 5 not in b.service.get_subsystem(SUB).namespaces
        finally:
            b.service.set_change_hook(b.group._on_change)
            await b.stop()
            await a.stop()

    asyncio.run(go())


def test_manual_ana_states_are_refused_and_stray_states_corrected(tmp_path: Path) -> None:
    """Finding 6: the group decides ANA states; REST/CLI set-ana is refused, and a listener whose state
    differs from what the group wants is corrected (compared with the real state, not the last one applied)."""
    import httpx

    from api.app import create_app

    async def go() -> None:
        async with member_pair(tmp_path) as (a, b):
            await until(lambda: a.group.owned == {1} and b.group.owned == {2}, "initial split")
            lst = _io_listeners(a)[0]
            with pytest.raises(ServiceError) as err:
                await a.service.set_ana_state(lst.id, 2, "optimized")
            assert err.value.status == 409 and "gateway group g1" in err.value.message
            app = create_app(a.service, token="t0k")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                answer = await client.put(f"/api/v1/listeners/tcp/127.0.0.1/{a.port}/ana/2",
                                          json={"state": "optimized"}, headers={"Authorization": "Bearer t0k"})
            assert answer.status_code == 409 and "gateway group" in answer.json()["detail"]
            assert lst.ana_state(2) == NONOPT
            lst.set_ana_state(2, OPT)  # however it got there
            await until(lambda: lst.ana_state(2) == NONOPT, "the group puts group 2 back to standby")

    asyncio.run(go())


def test_a_store_directory_made_again_makes_the_owner_step_down(tmp_path: Path) -> None:
    """Finding 7: after the store directory is removed and made again, the old owner's flocks are on deleted
    files; it must step down rather than stay optimized next to whoever locks the new files."""
    async def go() -> None:
        store_dir = tmp_path / "store"
        a = await Member(store_dir, "gw-a").start(first=True)
        await until(lambda: a.group.owned == {1, 2} and a.states() == {1: OPT, 2: OPT}, "alone: owns both")
        shutil.rmtree(store_dir)
        for sub in ("members", "ana"):
            (store_dir / sub).mkdir(parents=True)
        await until(lambda: OPT not in a.states().values(), "steps down")
        other = DirStore(store_dir, "g1", LEASE)
        other.name = "gw-x"
        assert other.try_acquire(1)  # the new file is free, and nobody serves it optimized
        other.release(1)
        await a.stop()

    asyncio.run(go())


def test_dir_store_renew_follows_the_file(tmp_path: Path) -> None:
    """Finding 7, store level: renew is False once the lock file at the path is another file."""
    store = DirStore(tmp_path, "g1", LEASE)
    store.join("gw-a", {})
    try:
        assert store.try_acquire(1) and store.renew(1)
        path = tmp_path / "ana" / "1.lock"
        path.unlink()
        path.write_text("")
        assert not store.renew(1)
        assert 1 not in store.held()
    finally:
        store.close()


def test_dir_store_step_down_releases_the_flock(tmp_path: Path) -> None:
    """Finding 8: a member stepping down on store loss (forget) must let a survivor take the group."""
    mine = DirStore(tmp_path, "g1", LEASE)
    mine.join("gw-a", {})
    other = DirStore(tmp_path, "g1", LEASE)
    other.join("gw-b", {})
    try:
        assert mine.try_acquire(1)
        assert not other.try_acquire(1)
        mine.forget(1)
        assert other.try_acquire(1)
        assert mine.owner(1) == "gw-b"
        assert not mine.renew(1)  # and the one that forgot does not hold it silently
    finally:
        other.close()
        mine.close()


def test_dir_store_poll_thread_survives_a_callback_error(tmp_path: Path) -> None:
    """Finding 13: a change callback that raises must not end the poll thread."""
    store = DirStore(tmp_path, "g1", LEASE, poll=0.02)
    seen = []

    def bad() -> None:
        seen.append(1)
        raise RuntimeError("event loop is closed")

    store.watch(bad)
    store.join("gw-a", {})
    try:
        store.publish({"n": 1})
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        store.publish({"n": 2})
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(seen) >= 2 and store._poller is not None and store._poller.is_alive()
    finally:
        store.close()


def test_a_too_short_lease_is_refused(tmp_path: Path) -> None:
    """Finding 10: --gateway-lease below the minimum flaps (its fence deadline is about when renewals are sent)."""
    from nvmeof.cli.daemon import Daemon, DaemonError, DaemonOptions

    with pytest.raises(DaemonError, match="--gateway-lease 1: give at least 3"):
        Daemon(DaemonOptions(gateway_group="g1", gateway_name="gw-z", group_store=f"dir:{tmp_path}",
                             gateway_lease=1.0))


def test_a_change_undone_locally_is_applied_again_from_the_store(tmp_path: Path, monkeypatch) -> None:
    """Finding 5: the store took the change, then this member's own file could not be saved (undone here);
    the member must not stay behind the group's version for good."""
    import target.service as servicemod
    from target import config as configmod

    async def go() -> None:
        a = Member(tmp_path / "store", "gw-a")
        a.service.config_path = str(tmp_path / "gw-a.json")
        await a.start(first=True)
        real = configmod.save_config
        failed = []

        def save_once(path, data):
            if not failed:
                failed.append(path)
                raise configmod.ConfigError(f"{path}: disk full")
            return real(path, data)

        monkeypatch.setattr(servicemod.configmod, "save_config", save_once)
        try:
            with pytest.raises(ServiceError) as err:
                await a.service.add_namespace(SUB, backend="null", size=1 << 20, nsid=3)
            assert err.value.status == 500 and failed
            version, stored = a.store.get_config()
            assert [n["nsid"] for n in stored["subsystems"][0]["namespaces"]] == [1, 2, 3]
            await until(lambda: 3 in a.service.get_subsystem(SUB).namespaces and a.group.config_version == version,
                        "gw-a applies the store's version again")
        finally:
            await a.stop()

    asyncio.run(go())


def test_shared_keys_in_a_rados_store_are_warned_about_without_the_key(tmp_path: Path, caplog) -> None:
    """Finding 14: DH-HMAC-CHAP keys go into the shared configuration; with a RADOS store the start says so
    (naming the subsystem, never the key)."""
    import logging

    from nvmeof.auth import generate_secret

    key = generate_secret(key_len=32)

    async def go() -> None:
        a = Member(tmp_path, "gw-a")
        a.store.kind = "rados"  # what the warning depends on; the dir store stands in for RADOS here
        await a.group.join()
        await a.service.add_subsystem(SUB, allow_any_host=False)
        await a.service.allow_host(SUB, "nqn.2014-08.org.nvmexpress:uuid:0f0e0d0c-0b0a-0908-0706-050403020100",
                                   dhchap_key=key)
        assert await a.group.adopt() == []
        await a.service.add_listener("tcp", "127.0.0.1", a.port)
        with caplog.at_level(logging.WARNING, logger="nvmeof.gateway"):
            await a.group.start()
        await a.stop()

    asyncio.run(go())
    warned = [r.getMessage() for r in caplog.records if "plain text" in r.getMessage()]
    assert len(warned) == 1 and SUB in warned[0]
    assert key not in caplog.text and key.split(":")[2] not in caplog.text


@pytest.mark.ceph
def test_rados_heartbeat_refuses_a_name_another_process_took(ceph_cluster) -> None:
    """Finding 11: one's membership expired (cut off) and a second process started with the same name; the
    first must not carry on with the same index and CNTLID range."""
    import os

    from target.gateway.radosstore import RadosStore

    group = f"t{os.urandom(4).hex()}"
    one = RadosStore(ceph_cluster.pool, group, 3.0, ceph_conf=str(ceph_cluster.conf))
    two = RadosStore(ceph_cluster.pool, group, 3.0, ceph_conf=str(ceph_cluster.conf))
    try:
        one.join("gw-a", {})
        one.heartbeat()
        one.ioctx.unlock(one._member_obj("gw-a"), "alive", "gw-a")  # its membership lease ran out
        assert two.join("gw-a", {}) == one.index
        with pytest.raises(StoreError, match="another process runs as gateway gw-a"):
            one.heartbeat()
        two.heartbeat()
    finally:
        two.close()
        one.close()


def test_dir_store_failed_acquire_leaks_no_locked_fd(tmp_path: Path, monkeypatch) -> None:
    """Finding 12: a write failing after the flock was taken must not keep the group locked by nobody."""
    import target.gateway.dirstore as dirstore

    mine = DirStore(tmp_path, "g1", LEASE)
    mine.join("gw-a", {})
    other = DirStore(tmp_path, "g1", LEASE)
    other.join("gw-b", {})
    try:
        real = dirstore.os.ftruncate

        def full(fd: int, length: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(dirstore.os, "ftruncate", full)
        with pytest.raises(StoreError, match="No space left"):
            mine.try_acquire(1)
        monkeypatch.setattr(dirstore.os, "ftruncate", real)
        assert 1 not in mine.held()
        assert other.try_acquire(1)
    finally:
        other.close()
        mine.close()


def test_a_fenced_member_takes_no_part_until_its_addresses_are_off_the_blocklist(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """The rejoin logic over a dir store, with the monitor's `osd blocklist ls` answered by a stand-in: fenced,
    the member steps down and is not eligible while one of its published addresses is listed (or the list cannot
    be read), saying which; once none is, it takes part again (its groups come back by failback)."""
    import json

    from target.gateway import fencing

    addr = "127.0.0.1:0/4242"
    answer: dict[str, object] = {"ret": 0, "list": [{"addr": addr, "until": "2026-12-03T10:00:00.0+0000"}]}

    class Monitor:
        def mon_command(self, cmd: str, inbuf: bytes) -> tuple[int, bytes, str]:
            assert json.loads(cmd) == {"prefix": "osd blocklist ls", "format": "json"}
            return int(answer["ret"]), json.dumps(answer["list"]).encode(), "EACCES: access denied"

    monkeypatch.setattr(fencing, "any_cluster", lambda store=None: Monitor())

    async def go() -> None:
        async with member_pair(tmp_path) as (a, b):
            await until(lambda: a.group.owned == {1} and b.group.owned == {2}, "split")
            a.group._published = dict(a.group._published or {}, clients=[{"entity": "client.9", "addrs": [addr]}])
            await a.group.fence.fenced_here("RBD image rbd/x: write")
            await until(lambda: b.group.owned == {1, 2}, "gw-b takes group 1 over")
            await until(lambda: f"{addr} until 2026-12-03T10:00:00.0+0000 are on the OSD blocklist"
                        in (a.group.not_taking_part or ""), "the reason names the listed address")
            report = await b.group.report()
            assert "on the OSD blocklist" in next(m for m in report["members"] if m["name"] == "gw-a")[
                "not_taking_part"] and not a.group._eligible_me()
            answer["ret"] = -13
            await until(lambda: "cannot be read" in (a.group.not_taking_part or ""), "an unreadable blocklist")
            assert a.group.owned == set()
            answer["ret"], answer["list"] = 0, [{"addr": "127.0.0.1:0/1", "until": "x"}]  # someone else's
            await until(lambda: a.group.not_taking_part is None, "gw-a takes part again")
            await until(lambda: a.group.owned == {1} and b.group.owned == {2}, "failback of group 1 to gw-a")

    asyncio.run(go())


def test_blocklist_listing_is_read_across_several_json_values() -> None:
    from target.gateway.fencing import blocklisted_addrs

    class Monitor:
        def __init__(self, ret: int, out: bytes) -> None:
            self.ret, self.out = ret, out

        def mon_command(self, cmd: str, inbuf: bytes) -> tuple[int, bytes, str]:
            return self.ret, self.out, "EACCES"

    two = b'[{"addr":"127.0.0.1:0/7","until":"t1"}]\n[{"addr":"v2:10.0.0.1:0/9","until":"t2"}]'
    assert blocklisted_addrs(Monitor(0, two)) == {"127.0.0.1:0/7": "t1", "10.0.0.1:0/9": "t2"}
    assert blocklisted_addrs(Monitor(0, b"")) == {}
    with pytest.raises(StoreError, match="EACCES"):
        blocklisted_addrs(Monitor(-13, b""))
    with pytest.raises(StoreError, match="not JSON"):
        blocklisted_addrs(Monitor(0, b"[{"))
