"""TargetService against a fake Target with exactly the hooks the service uses.

The fake binds real sockets in start_listener, so "port in use" is the kernel's answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import uuid
from typing import Any

import pytest

from nvmeof import defaults
from target.config import load_config
from target.model import Listener, Referral, Subsystem
from target.service import ServiceError, TargetService
from tests.ports import free_port

MiB = 1 << 20
HOST1 = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
HOST2 = "nqn.2026-01.com.example:host2"
SUB = "nqn.2026-01.com.example:sub1"


class FakeTarget:
    def __init__(self) -> None:
        self.subsystems: dict[str, Subsystem] = {}
        self.listeners: dict[str, Listener] = {}
        self.referrals: list[Referral] = []
        self.events: list[tuple[Any, ...]] = []
        self.servers: dict[str, asyncio.AbstractServer] = {}
        self.ctrls: dict[int, dict[str, Any]] = {}
        self.settles = 0
        self.controllers: dict[int, Any] = {}
        self.pr_store = None
        self.reservations_supported = True

    def namespace_changed(self, subnqn: str, nsid: int, concerns=None) -> None:  # type: ignore[no-untyped-def]
        self.events.append(("namespace_changed", subnqn, nsid))

    async def settle(self) -> None:
        self.settles += 1

    async def start_workers(self) -> None:
        return None

    def discovery_changed(self) -> None:
        self.events.append(("discovery_changed",))

    def ana_changed(self, *, subnqn=None, listeners=None, groups=(), concerns=None) -> int:  # type: ignore[no-untyped-def]
        return 0   # ANA events: tests/test_ana_target.py

    async def start_listener(self, listener: Listener) -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), listener.traddr, listener.trsvcid)
        self.servers[listener.id] = server
        self.events.append(("start_listener", listener.id))

    async def stop_listener(self, listener: Listener) -> None:
        server = self.servers.pop(listener.id)
        server.close()
        await server.wait_closed()
        self.events.append(("stop_listener", listener.id))

    def disconnect_subsystem(self, subnqn: str) -> int:
        self.events.append(("disconnect_subsystem", subnqn))
        return 0

    def disconnect_disallowed(self, subnqn: str) -> int:
        return 0

    def disconnect_listener(self, listener: Listener) -> int:
        return 0

    def controllers_info(self) -> list[dict[str, Any]]:
        return list(self.ctrls.values())

    def disconnect_controller(self, cntlid: int) -> bool:
        return self.ctrls.pop(cntlid, None) is not None

    # what a gateway group member asks (tests/test_gateway_group.py runs those against the real Target)
    def listening_port(self, listener: Listener) -> int:
        return listener.trsvcid

    def set_pr_store(self, store: Any) -> None:
        self.pr_store = store

    def set_cntlid_range(self, lo: int, hi: int) -> None:
        self.events.append(("set_cntlid_range", lo, hi))

    def set_ana_default(self, state: Any) -> None:
        self.events.append(("set_ana_default", state))

    def set_peer_listeners(self, peers: list[Listener]) -> None:
        self.events.append(("set_peer_listeners", [p.id for p in peers]))

    async def close(self) -> None:
        for server in self.servers.values():
            server.close()
            await server.wait_closed()
        self.servers.clear()


@pytest.fixture
async def target():
    t = FakeTarget()
    yield t
    await t.close()


@pytest.fixture
def cfg(tmp_path):
    return tmp_path / "etc" / "config.json"


@pytest.fixture
async def svc(target, cfg, tmp_path):
    cfg.parent.mkdir()
    return TargetService(target, config_path=cfg, backing_dirs=[tmp_path])


async def expect(status: int, fragment: str, coro) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        await coro
    assert info.value.status == status, info.value.message
    assert fragment in info.value.message, info.value.message
    return info.value


# --- subsystems ---------------------------------------------------------------------------------


async def test_add_subsystem_generates_nqn_and_serial_and_persists(svc, target, cfg):
    sub = await svc.add_subsystem()
    assert sub.nqn.startswith("nqn.2014-08.org.nvmexpress:uuid:")
    uuid.UUID(sub.nqn.rsplit(":", 1)[1])
    assert 0 < len(sub.serial) <= 20 and sub.serial.isascii()
    assert sub.model == defaults.MODEL and sub.allow_any_host and sub.max_namespaces == defaults.MAX_NAMESPACES
    assert target.subsystems[sub.nqn] is sub
    assert target.events == [("discovery_changed",)]
    assert load_config(cfg) == svc.snapshot()
    other = await svc.add_subsystem()
    assert other.nqn != sub.nqn and other.serial != sub.serial


async def test_add_subsystem_with_hosts_and_lookups(svc):
    sub = await svc.add_subsystem(SUB, serial="SN1", model="M", hosts=[HOST1], max_namespaces=4)
    assert not sub.allow_any_host and sub.hosts == {HOST1}
    assert sub.host_allowed(HOST1) and not sub.host_allowed(HOST2)
    assert svc.get_subsystem(SUB) is sub and svc.list_subsystems() == [sub]
    with pytest.raises(ServiceError, match="no subsystem") as info:
        svc.get_subsystem("nqn.2026-01.com.example:x")
    assert info.value.status == 404


@pytest.mark.parametrize(
    ("kwargs", "status", "fragment"),
    [
        ({"nqn": "nvmet-always"}, 400, "not of the form"),
        ({"nqn": "nqn.2026-13.com.example:x"}, 400, "month 13"),
        ({"nqn": "nqn.2026-01.com.example:" + "x" * 200}, 400, "the limit is 223"),
        ({"nqn": defaults.DISCOVERY_NQN}, 400, "reserved discovery NQN"),
        ({"nqn": "nqn.2014-08.org.nvmexpress:uuid:not-a-uuid"}, 400, "is not a UUID"),
        ({"nqn": "nqn.2026-01.com.example:has space"}, 400, "no spaces"),
        ({"nqn": "nqn.2026-01.com.example:a/b"}, 400, "'/'"),
        ({"serial": "x" * 21}, 400, "the limit is 20"),
        ({"serial": "séria"}, 400, "printable ASCII"),
        ({"model": "m" * 41}, 400, "the limit is 40"),
        ({"hosts": ["bad host"]}, 400, "host NQN"),
        ({"hosts": HOST1}, 400, "not a single string"),
        ({"hosts": [HOST1], "allow_any_host": True}, 400, "not both"),
        ({"max_namespaces": 0}, 400, "max_namespaces 0 is out of range"),
        ({"max_namespaces": True}, 400, "must be an integer"),
    ],
)
async def test_add_subsystem_validation(svc, target, cfg, kwargs, status, fragment):
    await expect(status, fragment, svc.add_subsystem(**kwargs))
    assert target.subsystems == {} and target.events == [] and not cfg.exists()


async def test_add_subsystem_duplicate(svc):
    await svc.add_subsystem(SUB)
    await expect(409, "already exists", svc.add_subsystem(SUB))


async def test_remove_subsystem(svc, target):
    await expect(404, "no subsystem", svc.remove_subsystem(SUB))
    await svc.add_subsystem(SUB)
    ns = await svc.add_namespace(SUB, backend="ram", size=MiB)
    err = await expect(409, "still has namespaces [1]", svc.remove_subsystem(SUB))
    assert "force" in err.message and SUB in target.subsystems
    target.events.clear()
    await svc.remove_subsystem(SUB, force=True)
    assert SUB not in target.subsystems
    assert target.events == [("disconnect_subsystem", SUB), ("discovery_changed",)]
    with pytest.raises(Exception, match="closed"):
        await ns.backend.read(0, 1)
    await svc.add_subsystem(SUB)
    await svc.remove_subsystem(SUB)  # empty: no force needed


async def test_hosts_allow_deny(svc, target, cfg):
    await svc.add_subsystem(SUB)
    await expect(409, "allows any host", svc.allow_host(SUB, HOST1))
    await expect(400, "host NQN", svc.allow_host(SUB, "nope"))
    await expect(404, "no subsystem", svc.allow_host("nqn.2026-01.com.example:zz", HOST1))
    await svc.set_allow_any_host(SUB, False)
    sub = await svc.allow_host(SUB, HOST1)
    assert sub.hosts == {HOST1} and sub.host_allowed(HOST1) and not sub.host_allowed(HOST2)
    await expect(409, "already allowed", svc.allow_host(SUB, HOST1))
    await expect(409, "deny them first", svc.set_allow_any_host(SUB, True))
    assert load_config(cfg)["subsystems"][0]["hosts"] == [HOST1]
    await expect(404, "not in the allowed hosts", svc.deny_host(SUB, HOST2))
    await svc.deny_host(SUB, HOST1)
    assert not sub.host_allowed(HOST1)
    await svc.set_allow_any_host(SUB, True)
    assert sub.host_allowed(HOST2)
    assert target.events.count(("discovery_changed",)) == 5


# --- namespaces ---------------------------------------------------------------------------------


async def test_add_namespace_defaults_and_lowest_free_nsid(svc, target, cfg):
    await svc.add_subsystem(SUB, max_namespaces=3)
    target.events.clear()
    a = await svc.add_namespace(SUB, backend="ram", size=MiB)
    b = await svc.add_namespace(SUB, backend="null", size=4 * MiB, block_size=4096, nsid=3)
    c = await svc.add_namespace(SUB, backend="ram", size=MiB)
    assert (a.nsid, b.nsid, c.nsid) == (1, 3, 2)
    assert a.nsze == MiB // 512 and b.nsze == 1024 and b.block_size == 4096
    assert target.events == [("namespace_changed", SUB, n) for n in (1, 3, 2)]
    assert svc.get_subsystem(SUB).active_nsids() == [1, 2, 3]
    assert len({a.uuid, b.uuid, c.uuid}) == 3 and len({a.nguid, b.nguid, c.nguid}) == 3
    assert len({a.eui64, b.eui64, c.eui64}) == 3 and all(len(x.eui64) == 8 and any(x.eui64) for x in (a, b, c))
    await expect(409, "maximum of 3", svc.add_namespace(SUB, backend="ram", size=MiB))
    assert svc.get_namespace(SUB, 3) is b and [n.nsid for n in svc.list_namespaces(SUB)] == [1, 2, 3]
    with pytest.raises(ServiceError, match=r"no namespace 4 \(it has: 1, 2, 3\)") as info:
        svc.get_namespace(SUB, 4)
    assert info.value.status == 404
    assert load_config(cfg) == svc.snapshot()


async def test_namespace_changes_wait_for_the_targets_settle_hook(svc, target):
    """Issue 11: ``settle`` is part of TargetHooks and called directly (it was probed with getattr,
    so a target whose settle was misspelt, or missing, was silently never waited for)."""
    await svc.add_subsystem(SUB)
    before = target.settles
    await svc.add_namespace(SUB, backend="ram", size=MiB)
    await svc.resize_namespace(SUB, 1, 2 * MiB)
    await svc.remove_namespace(SUB, 1)
    assert target.settles - before == 3


def test_every_target_implements_the_whole_target_hooks_protocol():
    """The service and the daemon call every hook directly (no getattr probes), so the plain Target
    has each one (a no-op where it has no workers) and PooledTarget overrides what it needs."""
    import inspect

    from target.core import Target
    from target.service import TargetHooks
    from target.workers import PooledTarget

    methods = [n for n, v in vars(TargetHooks).items() if not n.startswith("_") and callable(v)]
    assert {"settle", "start_workers", "namespace_changed"} <= set(methods)
    for cls in (Target, PooledTarget, FakeTarget):
        for name in methods:
            hook, impl = getattr(TargetHooks, name), getattr(cls, name, None)
            assert impl is not None, f"{cls.__name__} has no {name}"
            assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(hook), f"{cls.__name__}.{name}"


@pytest.mark.parametrize(
    ("kwargs", "status", "fragment"),
    [
        ({"backend": "tape", "size": MiB}, 400, "backend 'tape'"),
        ({"backend": "ram", "size": MiB, "block_size": 1024}, 400, "use 512 or 4096"),
        ({"backend": "ram", "size": 1000}, 400, "not a multiple of the block size 512"),
        ({"backend": "ram", "size": 0}, 400, "size 0 is out of range"),
        ({"backend": "ram", "size": "big"}, 400, "size must be an integer"),
        ({"backend": "ram"}, 400, "needs a size"),
        ({"backend": "ram", "size": MiB, "path": "/tmp/x"}, 400, "takes no path, only a size"),
        ({"backend": "ram", "size": MiB, "create": True}, 400, "has no storage to create"),
        ({"backend": "file"}, 400, "needs a path"),
        ({"backend": "file", "path": "/nonexistent/d.img"}, 400, "/nonexistent/d.img is outside the backing dir"),
        ({"backend": "file", "path": "/tmp", "size": MiB}, 400, "/tmp is outside the backing directories"),
        ({"backend": "file", "path": "d.img", "size": MiB}, 400, "'d.img' is relative; give an absolute path"),
        ({"backend": "ram", "size": MiB, "nsid": 0}, 400, "nsid 0 is out of range; use 1..8"),
        ({"backend": "ram", "size": MiB, "nsid": 9}, 400, "nsid 9 is out of range"),
        ({"backend": "ram", "size": MiB, "uuid": "xyz"}, 400, "not a UUID"),
        ({"backend": "ram", "size": MiB, "uuid": str(uuid.UUID(int=0))}, 400, "all zeros"),
        ({"backend": "ram", "size": MiB, "nguid": "00" * 16}, 400, "all zeros"),
        ({"backend": "ram", "size": MiB, "nguid": "zz" * 16}, 400, "not hexadecimal"),
        ({"backend": "ram", "size": MiB, "nguid": "11" * 15}, 400, "is 15 bytes"),
        ({"backend": "ram", "size": MiB, "eui64": "11" * 9}, 400, "it must be 8"),
        ({"backend": "ram", "size": MiB, "read_only": "yes"}, 400, "read_only must be true or false"),
    ],
)
async def test_add_namespace_validation(svc, target, cfg, kwargs, status, fragment):
    await svc.add_subsystem(SUB, max_namespaces=8)
    before = cfg.read_bytes()
    target.events.clear()
    await expect(status, fragment, svc.add_namespace(SUB, **kwargs))
    assert svc.get_subsystem(SUB).namespaces == {} and target.events == []
    assert cfg.read_bytes() == before


async def test_add_namespace_conflicts(svc, tmp_path):
    await svc.add_subsystem(SUB)
    other = "nqn.2026-01.com.example:sub2"
    await svc.add_subsystem(other)
    ns = await svc.add_namespace(
        SUB,
        backend="ram",
        size=MiB,
        nsid=5,
        uuid="6b3e4d52-7c1f-4d8e-9a3b-0c2d1e4f5a6b",
        nguid="00112233-4455-6677-8899-aabbccddeeff",
        eui64="0011223344556677",
    )
    assert ns.uuid == uuid.UUID("6b3e4d52-7c1f-4d8e-9a3b-0c2d1e4f5a6b")
    assert ns.nguid == bytes.fromhex("00112233445566778899aabbccddeeff") and ns.eui64.hex() == "0011223344556677"
    err = await expect(409, "NSID 5 is already in use", svc.add_namespace(SUB, backend="ram", size=MiB, nsid=5))
    assert "NSID 1 is free" in err.message
    # identifiers must be unique across all subsystems
    await expect(
        409,
        f"already used by namespace 5 of {SUB}",
        svc.add_namespace(other, backend="ram", size=MiB, uuid=str(ns.uuid)),
    )
    await expect(409, "NGUID", svc.add_namespace(other, backend="ram", size=MiB, nguid=ns.nguid.hex()))
    await expect(409, "EUI-64", svc.add_namespace(other, backend="ram", size=MiB, eui64="00:11:22:33:44:55:66:77"))
    path = tmp_path / "disk.img"
    await svc.add_namespace(SUB, backend="file", path=str(path), size=MiB, create=True)
    await expect(409, "already backs namespace 1", svc.add_namespace(other, backend="file", path=str(path)))
    assert svc.get_subsystem(other).namespaces == {}


async def test_add_file_namespace_sizes(svc, tmp_path):
    await svc.add_subsystem(SUB)
    odd = tmp_path / "odd.img"
    odd.write_bytes(bytes(1000))
    err = await expect(
        400, "1000 bytes, not a multiple of the block size 512", svc.add_namespace(SUB, backend="file", path=str(odd))
    )
    assert str(odd) in err.message
    small = tmp_path / "small.img"
    small.write_bytes(bytes(8192))
    ns = await svc.add_namespace(SUB, backend="file", path=str(small), block_size=4096)
    assert ns.nsze == 2 and "size" not in ns.spec
    created = tmp_path / "new.img"
    await expect(400, "needs a size", svc.add_namespace(SUB, backend="file", path=str(created), create=True))
    ns2 = await svc.add_namespace(SUB, backend="file", path=str(created), size=2 * MiB, create=True)
    assert created.stat().st_size == 2 * MiB and ns2.spec == {"backend": "file", "path": str(created), "size": 2 * MiB}
    ro = await svc.add_namespace(SUB, backend="ram", size=MiB, read_only=True)
    assert ro.read_only and not ro.writable


async def test_resize_namespace(svc, target, cfg):
    await svc.add_subsystem(SUB)
    ns = await svc.add_namespace(SUB, backend="ram", size=MiB)
    await ns.backend.write(0, b"keep")
    target.events.clear()
    await expect(400, "not a multiple of the block size", svc.resize_namespace(SUB, 1, MiB + 1))
    await expect(404, "no namespace 2", svc.resize_namespace(SUB, 2, MiB))
    await svc.resize_namespace(SUB, 1, 4 * MiB)
    assert ns.nsze == 4 * MiB // 512 and bytes(await ns.backend.read(0, 4)) == b"keep"
    assert target.events == [("namespace_changed", SUB, 1)]
    assert load_config(cfg)["subsystems"][0]["namespaces"][0]["size"] == 4 * MiB
    await svc.resize_namespace(SUB, 1, 4 * MiB)  # same size: nothing to tell anyone
    assert target.events == [("namespace_changed", SUB, 1)]


async def test_resize_file_namespace_records_size(svc, tmp_path, cfg):
    await svc.add_subsystem(SUB)
    path = tmp_path / "f.img"
    path.write_bytes(bytes(MiB))
    ns = await svc.add_namespace(SUB, backend="file", path=str(path))
    assert "size" not in load_config(cfg)["subsystems"][0]["namespaces"][0]
    await svc.resize_namespace(SUB, ns.nsid, 2 * MiB)
    assert path.stat().st_size == 2 * MiB
    assert load_config(cfg)["subsystems"][0]["namespaces"][0]["size"] == 2 * MiB
    ro_path = tmp_path / "ro.img"
    ro_path.write_bytes(bytes(MiB))
    ro = await svc.add_namespace(SUB, backend="file", path=str(ro_path), read_only=True)
    await expect(400, "read-only", svc.resize_namespace(SUB, ro.nsid, 2 * MiB))
    assert ro.nsze == MiB // 512


async def test_enable_disable_and_remove_namespace(svc, target, cfg):
    await svc.add_subsystem(SUB)
    ns = await svc.add_namespace(SUB, backend="ram", size=MiB, enabled=False)
    sub = svc.get_subsystem(SUB)
    assert sub.active_nsids() == []
    target.events.clear()
    await svc.set_namespace_enabled(SUB, 1, True)
    assert sub.active_nsids() == [1] and target.events == [("namespace_changed", SUB, 1)]
    await expect(400, "enabled must be true or false", svc.set_namespace_enabled(SUB, 1, 1))
    await svc.set_namespace_enabled(SUB, 1, False)
    assert load_config(cfg)["subsystems"][0]["namespaces"][0]["enabled"] is False
    await svc.remove_namespace(SUB, 1)
    assert sub.namespaces == {} and target.events[-1] == ("namespace_changed", SUB, 1)
    with pytest.raises(Exception, match="closed"):
        await ns.backend.read(0, 1)
    await expect(404, "no namespace 1", svc.remove_namespace(SUB, 1))
    assert load_config(cfg)["subsystems"][0]["namespaces"] == []


async def test_concurrent_adds_are_serialized(svc):
    await svc.add_subsystem(SUB)
    results = await asyncio.gather(*(svc.add_namespace(SUB, backend="ram", size=MiB) for _ in range(8)))
    assert sorted(ns.nsid for ns in results) == list(range(1, 9))


# --- listeners, referrals, controllers ----------------------------------------------------------


async def test_listeners(svc, target, cfg):
    port = free_port()
    lst = await svc.add_listener("tcp", "127.0.0.1", port)
    assert lst.id == f"tcp:127.0.0.1:{port}" and lst.adrfam == "ipv4" and lst.portid == 1 and not lst.discovery
    assert target.listeners[lst.id] is lst and ("start_listener", lst.id) in target.events
    disc = await svc.add_listener("tcp", "127.0.0.1", str(free_port()), discovery=True)
    assert disc.portid == 2 and disc.discovery
    with socket.create_connection(("127.0.0.1", port)):
        pass  # really listening
    assert [x["trsvcid"] for x in load_config(cfg)["listeners"]] == [port, disc.trsvcid]
    await expect(409, "already exists", svc.add_listener("tcp", "127.0.0.1", port))
    await expect(409, "port id 2 is already used", svc.add_listener("tcp", "127.0.0.1", free_port(), portid=2))
    target.events.clear()
    await svc.remove_listener(lst.id)
    assert lst.id not in target.listeners
    assert target.events == [("stop_listener", lst.id), ("discovery_changed",)]
    await expect(404, "no listener", svc.remove_listener(lst.id))
    again = await svc.add_listener("tcp", "127.0.0.1", free_port())
    assert again.portid == 1  # the lowest free port id again


async def test_listener_ipv6_id(svc):
    try:
        lst = await svc.add_listener("tcp", "::1", free_port())
    except ServiceError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc.message}")
    assert lst.adrfam == "ipv6" and lst.id == f"tcp:[::1]:{lst.trsvcid}"


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        (("fc", "127.0.0.1", 4420), {}, "transport type 'fc'"),
        (("tcp", "localhost", 4420), {}, "not an IPv4 or IPv6 address"),
        (("tcp", "127.0.0.1", 4420), {"adrfam": "ipv6"}, "is ipv4, but the address family given is ipv6"),
        (("tcp", "127.0.0.1", 4420), {"adrfam": "ib"}, "address family 'ib'"),
        (("tcp", "127.0.0.1", 0), {}, "out of range; use 1..65535"),
        (("tcp", "127.0.0.1", 70000), {}, "out of range"),
        (("tcp", "127.0.0.1", 4420), {"portid": 0}, "portid 0 is out of range"),
        (("tcp", "127.0.0.1", 4420), {"discovery": "no"}, "discovery must be true or false"),
    ],
)
async def test_listener_validation(svc, target, args, kwargs, fragment):
    await expect(400, fragment, svc.add_listener(*args, **kwargs))
    assert target.listeners == {} and target.events == []


async def test_listener_port_in_use(svc, target, cfg):
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = await expect(409, "already in use", svc.add_listener("tcp", "127.0.0.1", port))
    assert f"127.0.0.1:{port}" in err.message
    assert target.listeners == {} and not cfg.exists()


async def test_referrals(svc, target, cfg):
    ref = await svc.add_referral("10.0.0.2")
    assert ref.id == "tcp:10.0.0.2:8009" and ref.subnqn == defaults.DISCOVERY_NQN and ref.adrfam == "ipv4"
    await svc.add_referral("fd00::2", 4420, subnqn=SUB, portid=7)
    assert [r.id for r in target.referrals] == ["tcp:10.0.0.2:8009", "tcp:[fd00::2]:4420"]
    assert load_config(cfg)["referrals"][1] == {
        "trtype": "tcp",
        "adrfam": "ipv6",
        "traddr": "fd00::2",
        "trsvcid": 4420,
        "subnqn": SUB,
        "portid": 7,
    }
    await expect(409, "already exists", svc.add_referral("10.0.0.2", 8009))
    await expect(400, "referral subsystem NQN", svc.add_referral("10.0.0.3", subnqn="junk"))
    port = free_port()
    await svc.add_listener("tcp", "127.0.0.1", port)
    await expect(409, "own listeners", svc.add_referral("127.0.0.1", port))
    await svc.remove_referral("tcp:10.0.0.2:8009")
    assert [r.id for r in target.referrals] == ["tcp:[fd00::2]:4420"]
    await expect(404, "no referral", svc.remove_referral("tcp:10.0.0.2:8009"))
    assert target.events[-1] == ("discovery_changed",)


async def test_controllers_passthrough(svc, target):
    target.ctrls[3] = {"cntlid": 3, "hostnqn": HOST1}
    assert svc.controllers() == [{"cntlid": 3, "hostnqn": HOST1}]
    await svc.disconnect_controller(3)
    assert svc.controllers() == []
    await expect(404, "no connected controller with cntlid 3", svc.disconnect_controller(3))
    await expect(400, "cntlid must be an integer", svc.disconnect_controller("x"))


# --- persistence, atomicity, restore --------------------------------------------------------------


async def test_failed_save_undoes_the_change(target, tmp_path):
    folder = tmp_path / "gone"
    folder.mkdir()
    svc = TargetService(target, config_path=folder / "config.json", backing_dirs=[tmp_path])
    await svc.add_subsystem(SUB)
    snap = svc.snapshot()
    folder.rename(tmp_path / "moved")  # saving now fails: the folder is gone
    await expect(500, "the change was undone", svc.add_subsystem("nqn.2026-01.com.example:sub9"))
    created = tmp_path / "created.img"
    await expect(500, "cannot save", svc.add_namespace(SUB, backend="file", path=str(created), size=MiB, create=True))
    assert not created.exists()  # the file made for the refused namespace is gone again
    port = free_port()
    await expect(500, "cannot save", svc.add_listener("tcp", "127.0.0.1", port))
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the listener was stopped again
    await expect(500, "cannot save", svc.remove_subsystem(SUB))
    assert svc.snapshot() == snap and target.listeners == {}


async def test_snapshot_restore_roundtrip(svc, target, cfg, tmp_path):
    await svc.add_subsystem(SUB, serial="SERIAL1", model="Model X", hosts=[HOST1, HOST2], max_namespaces=16)
    await svc.add_namespace(SUB, backend="ram", size=2 * MiB, nsid=2)
    disk = tmp_path / "disk.img"
    ns = await svc.add_namespace(SUB, backend="file", path=str(disk), size=MiB, create=True, block_size=4096)
    await ns.backend.write(0, b"persistent")
    await svc.add_namespace(SUB, backend="null", size=8 * MiB, read_only=True, enabled=False)
    other = await svc.add_subsystem()
    await svc.add_namespace(other.nqn, backend="ram", size=MiB)
    await svc.add_listener("tcp", "127.0.0.1", free_port())
    await svc.add_listener("tcp", "127.0.0.1", free_port(), discovery=True, portid=9)
    await svc.add_referral("192.0.2.1", 8009, portid=4)
    saved = load_config(cfg)
    assert saved == svc.snapshot()
    assert json.loads(cfg.read_text())["version"] == 1
    await target.close()  # free the ports for the second target

    target2 = FakeTarget()
    svc2 = TargetService(target2, config_path=cfg, backing_dirs=[tmp_path])
    mtime = cfg.stat().st_mtime_ns
    try:
        errors = await svc2.restore(saved)
        assert errors == []
        assert svc2.snapshot() == saved
        assert cfg.stat().st_mtime_ns == mtime  # replaying does not rewrite the file
        ns2 = svc2.get_namespace(SUB, ns.nsid)
        assert bytes(await ns2.backend.read(0, 10)) == b"persistent"
        # the restored objects are live: a further change is persisted as usual
        await svc2.remove_namespace(SUB, 2)
        assert [n["nsid"] for n in load_config(cfg)["subsystems"][0]["namespaces"]] == [1, 3]
    finally:
        await target2.close()


async def test_restore_reports_broken_items_and_restores_the_rest(target, tmp_path):
    port, busy_port = free_port(), None
    good = tmp_path / "good.img"
    good.write_bytes(bytes(MiB))
    config = {
        "version": 1,
        "subsystems": [
            {"nqn": "bad nqn", "namespaces": [{"nsid": 1, "backend": "ram", "size": MiB}]},
            {
                "nqn": SUB,
                "serial": "S",
                "namespaces": [
                    {"nsid": 1, "backend": "file", "path": str(tmp_path / "missing.img")},
                    {"nsid": 2, "backend": "file", "path": str(good)},
                    {"nsid": 3, "backend": "ram", "size": 1000},
                    {"nsid": 4, "backend": "ram", "size": MiB, "colour": "blue"},
                    {"nsid": 5, "backend": "ram", "size": MiB},
                ],
            },
            {"nqn": SUB},
            "not an object",
        ],
        "listeners": [
            {"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": port},
            {"trtype": "tcp", "traddr": "999.1.1.1", "trsvcid": 4420},
            {"trtype": "tcp", "traddr": "127.0.0.1"},
        ],
        "referrals": [
            {"traddr": "192.0.2.9", "trsvcid": 8009},
            {"traddr": "192.0.2.9", "trsvcid": 8009},
        ],
    }
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        config["listeners"].append({"traddr": "127.0.0.1", "trsvcid": busy_port})
        svc = TargetService(target, backing_dirs=[tmp_path])
        errors = await svc.restore(config)
    text = "\n".join(errors)
    assert len(errors) == 10, text
    assert (
        "subsystems[0]" in errors[0] and "not of the form" in errors[0] and "skipped with its namespaces" in errors[0]
    )
    assert "already exists" in text and "expected an object" in text
    assert "namespaces[0]" in text and "missing.img does not exist" in text
    assert "namespaces[2]" in text and "not a multiple of the block size" in text
    assert "namespaces[3]: unknown key 'colour'" in text
    assert "listeners[1]" in text and "listeners[2]: missing required key 'trsvcid'" in text
    assert f"listeners[3]: cannot listen on tcp:127.0.0.1:{busy_port}: the address is already in use" in text
    assert "referrals[1]" in text and "already exists" in text
    assert sorted(svc.get_subsystem(SUB).namespaces) == [2, 5]
    assert list(target.listeners) == [f"tcp:127.0.0.1:{port}"]
    assert [r.id for r in target.referrals] == ["tcp:192.0.2.9:8009"]


async def test_restore_rejects_wrong_version_and_shape(svc):
    assert "version 2 is not supported" in (await svc.restore({"version": 2}))[0]
    assert "must be an object" in (await svc.restore([]))[0]  # type: ignore[arg-type]
    errors = await svc.restore({"version": 1, "subsystems": {"nqn": SUB}})
    assert errors == ["'subsystems' must be a list, got dict; none restored"]


async def test_service_without_config_path_keeps_no_file(target, tmp_path):
    svc = TargetService(target)
    await svc.add_subsystem(SUB)
    assert os.listdir(tmp_path) == []


# --- issue 10: where namespace files may live, and that adding/resizing never changes them unasked ---


async def test_file_paths_outside_the_backing_dirs_are_refused(svc, target, cfg, tmp_path):
    """Item 1: /etc/shadow, ../../etc/passwd, /proc/self/mem (and more) were exported as namespaces."""
    await svc.add_subsystem(SUB)
    (tmp_path / "link.img").symlink_to("/etc/shadow")
    before = cfg.read_bytes()
    target.events.clear()
    cases = [
        ("/etc/shadow", "/etc/shadow is outside the backing directories"),
        ("../../etc/passwd", "is relative; give an absolute path"),
        ("/proc/self/mem", "is under /proc, a kernel interface"),
        (str(tmp_path / "link.img"), "(which resolves to /etc/shadow) is outside the backing directories"),
        ("/dev/zero", "is under /dev, a kernel interface"),
        ("/dev/sda", "--allow-block-device PATH"),
        (f"{tmp_path}/x\0.img", "contains a NUL byte"),
    ]
    for path, fragment in cases:
        err = await expect(400, fragment, svc.add_namespace(SUB, backend="file", path=path))
        assert err.message.startswith("path "), err.message  # names the field
    err = await expect(400, "outside", svc.add_namespace(SUB, backend="file", path="/etc/shadow"))
    assert f"({tmp_path})" in err.message and "--backing-dir DIR" in err.message and "backing_dirs" in err.message
    assert svc.get_subsystem(SUB).namespaces == {} and target.events == [] and cfg.read_bytes() == before


async def test_default_backing_dir_is_the_state_dirs_disks(target, tmp_path, monkeypatch):
    monkeypatch.setenv("NVMEOF_STATE_DIR", str(tmp_path / "state"))
    svc = TargetService(target)
    disks = tmp_path / "state" / "disks"
    assert svc.backing.part("file").backing_dirs == (str(disks),)
    await svc.add_subsystem(SUB)
    await expect(400, f"outside the backing directories ({disks})",
                 svc.add_namespace(SUB, backend="file", path=str(tmp_path / "d.img"), size=MiB, create=True))
    disks.mkdir(parents=True)
    ns = await svc.add_namespace(SUB, backend="file", path=str(disks / "d.img"), size=MiB, create=True)
    assert ns.spec["path"] == str(disks / "d.img")


async def test_file_paths_are_stored_resolved(target, tmp_path, monkeypatch):
    """Item 5: a relative path was stored as given, so a restart elsewhere served another file."""
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (tmp_path / "via").symlink_to(real)
    (real / "a.img").write_bytes(b"A" * 4096)
    svc = TargetService(target, backing_dirs=[tmp_path / "via"])
    assert svc.backing.part("file").backing_dirs == (str(real),)
    await svc.add_subsystem(SUB)
    ns = await svc.add_namespace(SUB, backend="file", path=f"{tmp_path}/via/sub/../a.img")
    assert ns.spec["path"] == str(real / "a.img")
    assert svc.snapshot()["subsystems"][0]["namespaces"][0]["path"] == str(real / "a.img")
    await expect(409, "already backs namespace 1",
                 svc.add_namespace(SUB, backend="file", path=str(tmp_path / "via" / "a.img")))
    # a configuration written by an older version with a relative path is not guessed at
    saved = svc.snapshot()
    saved["subsystems"][0]["namespaces"][0]["path"] = "a.img"
    monkeypatch.chdir(real)
    svc2 = TargetService(FakeTarget(), backing_dirs=[real])
    errors = await svc2.restore(saved)
    assert len(errors) == 1 and "'a.img' is relative; give an absolute path" in errors[0]
    assert svc2.unrestored()[0]["item"]["path"] == "a.img"  # kept in the file, for the operator to fix


async def test_adding_an_existing_file_never_grows_or_cuts_it(svc, cfg, tmp_path):
    """Item 2: a 600-byte file added with size 1024 was grown; resizing it to 512 cut its tail."""
    await svc.add_subsystem(SUB)
    path = tmp_path / "six.img"
    content = os.urandom(600)
    path.write_bytes(content)
    err = await expect(400, "is 600 bytes, less than the size 1024 asked for",
                       svc.add_namespace(SUB, backend="file", path=str(path), size=1024))
    assert "create" in err.message
    assert path.read_bytes() == content
    ns = await svc.add_namespace(SUB, backend="file", path=str(path), size=1024, create=True)  # asked: grown
    assert path.stat().st_size == 1024 and path.read_bytes()[:600] == content
    err = await expect(400, "shrinking from 1024 to 512 bytes", svc.resize_namespace(SUB, ns.nsid, 512))
    assert "allow_shrink" in err.message and path.stat().st_size == 1024 and ns.backend.size == 1024
    await expect(400, "allow_shrink must be true or false",
                 svc.resize_namespace(SUB, ns.nsid, 512, allow_shrink="yes"))  # type: ignore[arg-type]
    await svc.resize_namespace(SUB, ns.nsid, 512, allow_shrink=True)
    assert path.read_bytes() == content[:512] and ns.backend.size == 512
    assert load_config(cfg)["subsystems"][0]["namespaces"][0]["size"] == 512


async def test_a_smaller_size_exports_a_prefix_and_keeps_the_file(svc, cfg, tmp_path):
    await svc.add_subsystem(SUB)
    path = tmp_path / "big.img"
    path.write_bytes(b"\x5a" * (4 * 4096))
    ns = await svc.add_namespace(SUB, backend="file", path=str(path), size=4096)
    assert ns.backend.size == 4096 and path.stat().st_size == 4 * 4096
    await svc.resize_namespace(SUB, ns.nsid, 2 * 4096)  # grows within the file: nothing written
    await svc.resize_namespace(SUB, ns.nsid, 4096, allow_shrink=True)  # the file's tail was never exported
    assert path.read_bytes() == b"\x5a" * (4 * 4096)
    # a restart exports the same prefix: the size is in the config
    assert load_config(cfg)["subsystems"][0]["namespaces"][0]["size"] == 4096
    # and a file shrunk since is reported, not grown back to the configured size
    saved = svc.snapshot()
    await svc.remove_namespace(SUB, ns.nsid)
    os.truncate(path, 512)
    svc2 = TargetService(FakeTarget(), backing_dirs=[tmp_path])
    errors = await svc2.restore(saved)
    assert len(errors) == 1 and "is 512 bytes, less than the size 4096" in errors[0] and path.stat().st_size == 512


async def test_undone_add_takes_back_a_grown_file(target, tmp_path):
    folder = tmp_path / "etc"
    folder.mkdir()
    svc = TargetService(target, config_path=folder / "config.json", backing_dirs=[tmp_path])
    await svc.add_subsystem(SUB)
    path = tmp_path / "g.img"
    path.write_bytes(b"g" * 4096)
    folder.rename(tmp_path / "gone")  # the save fails: the add is undone, and so is the growth
    await expect(500, "cannot save", svc.add_namespace(SUB, backend="file", path=str(path), size=MiB, create=True))
    assert path.read_bytes() == b"g" * 4096


async def test_a_size_the_file_system_refuses_is_a_400_naming_it(svc, tmp_path):
    """Item 7: a 1 PiB create gave a 500 (an OSError with EFBIG from ftruncate)."""
    import resource

    await svc.add_subsystem(SUB)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 40, hard))  # any file system refuses 1 PiB now
    try:
        err = await expect(400, "1125899906842624 bytes long: the file system (or RLIMIT_FSIZE) does not allow",
                           svc.add_namespace(SUB, backend="file", path=str(tmp_path / "p.img"), size=1 << 50,
                                             create=True))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "EFBIG" in err.message and not (tmp_path / "p.img").exists()
    await expect(400, f"size {1 << 63} is out of range; use 1..{(1 << 63) - 1}",
                 svc.add_namespace(SUB, backend="file", path=str(tmp_path / "q.img"), size=1 << 63, create=True))


async def test_block_devices_only_when_named(target, tmp_path):
    svc = TargetService(target, backing_dirs=[tmp_path], block_devices=["/dev/zero"])
    await svc.add_subsystem(SUB)
    # allowing a path that is no block device does not make a character device servable
    await expect(400, "neither a regular file nor a block device",
                 svc.add_namespace(SUB, backend="file", path="/dev/zero"))
    converted = {"subsystems": [{"nqn": SUB + "x", "namespaces": [{"nsid": 1, "device": {"path": "/dev/nvme9n1"}}]}]}
    from target.config import import_nvmetcli

    errors = await svc.restore(dict(import_nvmetcli(converted)), persist=True)
    assert len(errors) == 1 and "/dev/nvme9n1 is under /dev" in errors[0] and "--allow-block-device PATH" in errors[0]


async def test_config_backing_dirs_widen_at_start_up_but_not_through_an_import(target, tmp_path):
    flags, extra, third = tmp_path / "flags", tmp_path / "extra", tmp_path / "third"
    for folder in (flags, extra, third):
        folder.mkdir()
        (folder / "d.img").write_bytes(bytes(4096))
    config = {
        "version": 1, "backing_dirs": [str(extra)],
        "subsystems": [{"nqn": SUB, "namespaces": [{"nsid": 1, "backend": "file", "path": str(extra / "d.img")}]}],
    }
    cfg = tmp_path / "config.json"
    svc = TargetService(target, config_path=cfg, backing_dirs=[flags])
    assert await svc.restore(config) == []  # start-up: the operator's file adds to the flags
    assert svc.backing.part("file").backing_dirs == (str(flags), str(extra))
    await svc.add_namespace(SUB, backend="file", path=str(flags / "d.img"))
    saved = load_config(cfg)
    assert saved["backing_dirs"] == [str(extra)]  # written back as read, the flags are not
    # an import comes through the API: it cannot add a directory, and says so
    imported = {
        "version": 1, "backing_dirs": [str(extra), str(third)],
        "subsystems": [
            {"nqn": SUB + "2", "namespaces": [{"nsid": 1, "backend": "file", "path": str(third / "d.img")}]},
        ],
    }
    errors = await svc.restore(imported, persist=True)
    assert f"an import cannot widen where namespace files may live ({third} ignored)" in errors[0]
    assert "--backing-dir" in errors[0] and "outside the backing directories" in errors[1] and len(errors) == 2
    assert svc.backing.part("file").backing_dirs == (str(flags), str(extra))
    assert load_config(cfg)["backing_dirs"] == [str(extra)]
    assert await svc.restore({"version": 1, "backing_dirs": [str(flags / "sub")]}, persist=True) == []  # no wider
    # a backing directory under /dev in the file is refused, kept in the file, and the rest restored
    target2 = FakeTarget()
    svc2 = TargetService(target2, backing_dirs=[flags])
    errors = await svc2.restore({"version": 1, "backing_dirs": ["/dev/shm", str(extra)]})
    assert errors == ["backing_dirs: backing directory /dev/shm is under /dev, where no namespace file may live; "
                      "give a directory elsewhere (a block device there needs --allow-block-device PATH); ignored"]
    assert svc2.backing.part("file").backing_dirs == (str(flags), str(extra))
    assert svc2.snapshot()["backing_dirs"] == ["/dev/shm", str(extra)]
