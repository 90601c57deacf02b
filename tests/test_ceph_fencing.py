"""Fencing on takeover (target/gateway/fencing.py) against the real one-node Ceph cluster.

End to end: two `nvmeof serve` gateways on one RBD image over a rados store; the owner writes (so its librbd
holds the image's exclusive lock), is killed with -9, and the survivor's first write must not wait for the
OSD to time the dead client's watch out (~30 s, osd_client_watch_timeout): the survivor blocklists the dead
gateway's clients and breaks its lock before it reports OPTIMIZED. Measured before fencing: 22-25 s after
OPTIMIZED; with it: well under a second.

Unit level: fence_member() with two real librados clients never breaks the lock a live client holds, nor
blocklists an address a live member publishes; it does break the dead one's.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from initiator.connecting import connect
from target.gateway import fencing
from target.gateway.store import MemberRecord
from tests.test_gateway_e2e import OPT, SETTLE, SUBNQN, Gateway, rbd_group_args, wait_states

pytestmark = [pytest.mark.ceph, pytest.mark.slow, pytest.mark.timeout(300)]

LEASE = 3.0
FAILOVER_BOUND = LEASE + 12.0
WRITE_BOUND = 15.0  # seconds from OPTIMIZED on the survivor to its first write done (unfenced: ~25 s)


async def timed_write(gw: Gateway, data: bytes, deadline: float) -> tuple[float, int]:
    """Write through ``gw`` as a host would: a command that fails (the target answers a retryable status
    when librbd does not answer in time) is sent again. Returns (seconds until one succeeded, failures)."""
    start = time.monotonic()
    failures = 0
    async with connect("127.0.0.1", gw.io_port, SUBNQN, timeout=60) as ctrl:
        while True:
            try:
                await ctrl.write(1, 16, data)
                await ctrl.flush(1)
                return time.monotonic() - start, failures
            except Exception:  # any failure is retried, as the kernel's multipath does
                failures += 1
                assert time.monotonic() < deadline, f"no write through {gw.name} succeeded:\n{gw.log()[-3000:]}"
                await asyncio.sleep(0.2)


@pytest.mark.parametrize("workers", [0, 1])
def test_survivor_writes_at_once_after_kill9_of_the_owner(tmp_path: Path, ceph_cluster: Any, rbd_image: str,
                                                          workers: int) -> None:
    """With --workers the owner's I/O runs in a worker process with librados clients of its own: those are
    published (with the worker's index) and fenced like the main process's."""
    common = rbd_group_args(ceph_cluster, rbd_image, "fence", LEASE)
    a = Gateway(tmp_path, "fence-a", [*common, *(["--workers", str(workers)] if workers else [])])
    b = Gateway(tmp_path, "fence-b", common)
    try:
        a.start()
        b.start()
        wait_states(a, {1: OPT}, SETTLE)
        data = os.urandom(32 * 1024)
        asyncio.run(timed_write(a, data, time.monotonic() + 30))  # a's librbd takes the exclusive lock
        deadline = time.monotonic() + SETTLE
        while True:  # a publishes its clients (store connection + the image's) in its member record
            dead = next(m for m in b.gateway_list()["members"] if m["name"] == "fence-a")
            if len(dead.get("clients") or []) >= 2 + workers:
                break
            assert time.monotonic() < deadline, f"fence-a never published its Ceph clients: {dead}"
            time.sleep(0.2)
        a_addrs = {addr for client in dead["clients"] for addr in client["addrs"]}
        worker_addrs = {addr for client in dead["clients"] if client.get("worker") is not None
                        for addr in client["addrs"]}
        assert bool(worker_addrs) == bool(workers), dead["clients"]
        a.kill9()
        killed = time.monotonic()
        took_over, _ = wait_states(b, {1: OPT}, FAILOVER_BOUND)
        stall, failures = asyncio.run(timed_write(b, data, time.monotonic() + 90))
        print(f"kill -9 -> optimized on fence-b after {took_over:.2f} s; its first write then took {stall:.2f} s "
              f"({failures} failed attempt(s)); {time.monotonic() - killed:.2f} s after the kill")
        assert stall < WRITE_BOUND, f"the survivor's write stalled {stall:.1f} s:\n{b.log()[-3000:]}"

        # the dead gateway's clients are on the OSD blocklist, and the takeover says it fenced
        listed = ceph_cluster.ceph("osd", "blocklist", "ls")
        assert a_addrs and all(addr in listed for addr in a_addrs), (a_addrs, listed)
        groups = b.gateway_list()["ana_groups"]
        assert [(g["anagrpid"], g["owner"], g.get("fenced")) for g in groups] == [(1, "fence-b", True)]
        text = b.gateway_list(text=True)
        assert any(line.split()[:4] == ["1", "fence-b", "fence-a", "yes"] for line in text.splitlines()), text
        assert "fenced gateway fence-a" in b.log()
        assert b.stop() == 0
    finally:
        a.stop()
        b.stop()
    assert "Traceback" not in b.log(), b.log()[-4000:]


@pytest.mark.parametrize("which", ["rbd", "all", "store"])
def test_a_fenced_gateway_steps_down_and_rejoins_once_unblocklisted(tmp_path: Path, ceph_cluster: Any,
                                                                    rbd_image: str, which: str) -> None:
    """Blocklist a lone owner's clients from outside (what a survivor's takeover does): "rbd" only the image's
    client (its next write gets ESHUTDOWN, EBLOCKLISTED, from librbd), "all" the store's too, "store" only the
    store's (its heartbeat gets it); either way it steps down at once, saying why, and takes no part while
    listed, though it is alone. Taken off the blocklist: with only the store's client fenced it reconnects the
    store with a new client and owns the group again; with the image's client fenced it says to restart."""
    from nvmeof.spec.logs import AnaState

    a = Gateway(tmp_path, "fenced-a", rbd_group_args(ceph_cluster, rbd_image, "fenced", LEASE, size="8M"))

    def report_says(what: str) -> dict[str, Any]:
        deadline = time.monotonic() + SETTLE
        while True:
            report = a.gateway_list()
            if what in (report.get("not_taking_part") or ""):
                return report
            assert time.monotonic() < deadline, (report.get("not_taking_part"), a.log()[-3000:])
            time.sleep(0.2)

    try:
        a.start()
        wait_states(a, {1: OPT}, SETTLE)
        data = os.urandom(4096)
        asyncio.run(timed_write(a, data, time.monotonic() + 30))
        me = next(m for m in a.gateway_list()["members"] if m["name"] == "fenced-a")
        assert len(me["clients"]) == 2
        clients = {"all": me["clients"], "rbd": me["clients"][1:], "store": me["clients"][:1]}[which]
        fenced = [addr for client in clients for addr in client["addrs"]]
        for addr in fenced:
            ceph_cluster.ceph("osd", "blocklist", "add", addr, "600")

        async def one_write() -> None:
            async with connect("127.0.0.1", a.io_port, SUBNQN, timeout=30) as ctrl:
                try:
                    await ctrl.write(1, 16, data)
                except Exception:  # refused: the point is what the gateway does next
                    pass

        if which != "store":
            asyncio.run(one_write())
        wait_states(a, {1: AnaState.NON_OPTIMIZED}, SETTLE)
        cause = {"rbd": f"RBD image {ceph_cluster.pool}/{rbd_image}: write"}.get(which, "the group store")
        deadline = time.monotonic() + SETTLE
        while "ANA group 1: fenced-a steps down (its Ceph client was blocklisted" not in a.log():
            assert time.monotonic() < deadline, a.log()[-3000:]
            time.sleep(0.1)
        assert f"ERROR nvmeof.gateway: gateway fenced-a: its Ceph client is blocklisted ({cause}" in a.log(), \
            a.log()[-3000:]
        report = report_says("on the OSD blocklist")
        assert all(addr in report["not_taking_part"] for addr in fenced), report
        assert "this gateway takes no part: its Ceph client address(es)" in a.gateway_list(text=True)
        mine = next(m for m in report["members"] if m["name"] == "fenced-a")
        assert mine["owns"] == [] and not mine["ready"], report  # alone, but fenced: it does not take the group

        for addr in fenced:
            ceph_cluster.ceph("osd", "blocklist", "rm", addr)
        if which == "store":
            wait_states(a, {1: OPT}, SETTLE)
            report = a.gateway_list()
            assert report["not_taking_part"] is None, report
            now = next(m for m in report["members"] if m["name"] == "fenced-a")["clients"]
            assert now[0]["entity"] != me["clients"][0]["entity"], (me, now)  # a new store client
            assert "takes part in the group again through a new group store client" in a.log()
            asyncio.run(timed_write(a, data, time.monotonic() + 30))
        else:
            report = report_says("restart this gateway")
            assert f"{ceph_cluster.pool}/{rbd_image}" in report["not_taking_part"], report
            mine = next(m for m in report["members"] if m["name"] == "fenced-a")
            assert mine["owns"] == [] and not mine["ready"], report
    finally:
        a.stop()


# --- unit level: two real clients -----------------------------------------------------------------------------

HOLDER = """
import sys, time
sys.path.append("/usr/lib/python3/dist-packages")
import rados, rbd
cluster = rados.Rados(conffile=sys.argv[1]); cluster.connect()
image = rbd.Image(cluster.open_ioctx(sys.argv[2]), sys.argv[3])
image.write(b"x" * 512, 0)  # takes the image's exclusive lock
print(cluster.get_instance_id(), cluster.get_addrs(), flush=True)
time.sleep(120)
"""


def _holder(ceph_cluster: Any, image: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(ceph_cluster.conf), ceph_cluster.pool, image],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    instance, addrs = proc.stdout.readline().split()
    return proc, {"entity": f"client.{instance}", "addrs": fencing.split_addrs(addrs)}


def test_a_live_members_lock_is_never_broken(ceph_cluster: Any, rbd_image: str) -> None:
    from target.backends.rbd import RbdBackend

    ceph_cluster.rbd("create", "--size", "8M", f"{ceph_cluster.pool}/{rbd_image}")
    live_proc, live = _holder(ceph_cluster, rbd_image)
    backend = RbdBackend(ceph_cluster.pool, rbd_image, ceph_conf=str(ceph_cluster.conf))
    try:
        assert [o["owner"] for o in backend.exclusive_lock_owners()] == live["addrs"]
        cluster = fencing.any_cluster()
        assert cluster is not None
        gone = {"entity": "client.999999", "addrs": ["127.0.0.1:0/999999"]}
        dead = MemberRecord("dead", 1, False, {"clients": [gone]})
        alive = MemberRecord("alive", 0, True, {"clients": [live]})
        result = fencing.fence_member(dead, [alive], [backend], cluster=cluster, expire=60)
        assert result.broken == [] and result.blocklisted == gone["addrs"], result
        assert [o["owner"] for o in backend.exclusive_lock_owners()] == live["addrs"]

        # a record naming the live client as a dead member's (a stale or forged record) changes nothing either
        forged = MemberRecord("stale", 2, False, {"clients": [live]})
        result = fencing.fence_member(forged, [alive], [backend], cluster=cluster, expire=60)
        assert result.broken == [] and result.blocklisted == [] and result.fenced, result
        assert [o["owner"] for o in backend.exclusive_lock_owners()] == live["addrs"]
        assert live["addrs"][0] not in ceph_cluster.ceph("osd", "blocklist", "ls")

        # the same client once its member is dead: blocklisted and its lock broken
        live_proc.kill()
        live_proc.wait()
        dead = MemberRecord("alive", 0, False, {"clients": [live]})
        result = fencing.fence_member(dead, [], [backend], cluster=cluster, expire=60)
        assert result.fenced and result.blocklisted == live["addrs"] and result.broken == live["addrs"], result
        assert backend.exclusive_lock_owners() == []
        assert live["addrs"][0] in ceph_cluster.ceph("osd", "blocklist", "ls")
    finally:
        live_proc.kill()
        live_proc.wait()
        backend.close()
        assert backend.wait_closed(10)


def test_split_addrs() -> None:
    assert fencing.split_addrs("127.0.0.1:0/123") == ["127.0.0.1:0/123"]
    assert fencing.split_addrs("[v2:10.0.0.1:0/7,v1:10.0.0.1:0/7]") == ["10.0.0.1:0/7"]
    assert fencing.split_addrs("") == []
