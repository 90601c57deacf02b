"""Access revocation (issue 10, item 8): a host that loses access loses its live controller at once.

Denying a host, turning allow_any_host off, removing a subsystem and removing a listener disconnect the
controllers that lost access (as SPDK spdk_nvmf_subsystem_remove_host and nvmf_stop_listen do), in
worker processes too, and the service and the REST API say how many. The hosts are the Python
initiator over real TCP; its next read fails (its connections were closed) and a reconnect is refused,
while a host that kept its access goes on working.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator

import pytest
from fastapi.testclient import TestClient
from raw_pdu import SUBNQN, Served, serve, wait_until
from target_host import open_tcp

import initiator
from api.app import create_app
from initiator.queue import TransportError
from nvmeof import defaults
from nvmeof.cli.daemon import Daemon, DaemonOptions
from nvmeof.status import NvmeError, Status
from nvmeof.uri import TransportAddress
from target.core import Target
from target.service import TargetService
from tests.ports import free_port, free_ports

HOSTA = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-1111-4000-8000-00000000000a"
HOSTB = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-1111-4000-8000-00000000000b"
MiB = 1 << 20
BLOCK = bytes(range(256)) * 2


def connect(port: int, hostnqn: str, subnqn: str = SUBNQN, **kw) -> initiator.HostController:  # type: ignore[no-untyped-def]
    kw.setdefault("nr_io_queues", 1)
    return initiator.connect("127.0.0.1", port, subnqn, hostnqn=hostnqn, timeout=10, kato=0, **kw)


async def works(ctrl: initiator.HostController, slba: int = 0) -> None:
    await ctrl.write(1, slba, BLOCK)
    assert await ctrl.read(1, slba, 1) == BLOCK


async def revoked(ctrl: initiator.HostController) -> None:
    """Its next read fails: the target closed its connections."""
    with pytest.raises(TransportError):
        await ctrl.read(1, 0, 1)


async def refused(port: int, hostnqn: str, subnqn: str = SUBNQN) -> None:
    with pytest.raises(NvmeError) as err:
        await connect(port, hostnqn, subnqn)
    assert err.value.status == Status.CONNECT_INVALID_HOST


def hosts_connected(target: Target) -> list[str]:
    return sorted(c.hostnqn for c in target.controllers.values())


@pytest.fixture
async def listed() -> AsyncIterator[Served]:
    """Subsystem SUBNQN admitting HOSTA and HOSTB only, on a TCP listener."""
    served = await serve(allow_any_host=False, hosts=(HOSTA, HOSTB))
    yield served
    await served.target.close()  # type: ignore[attr-defined]


@pytest.fixture
async def open_to_all() -> AsyncIterator[Served]:
    served = await serve()
    yield served
    await served.target.close()  # type: ignore[attr-defined]


async def test_denied_host_is_disconnected_and_cannot_come_back(listed: Served) -> None:
    a = await connect(listed.port, HOSTA)
    b = await connect(listed.port, HOSTB)
    try:
        await works(a)
        await works(b, 8)
        disconnected = await listed.service.deny_host(SUBNQN, HOSTA)  # type: ignore[attr-defined]
        await revoked(a)
        assert hosts_connected(listed.target) == [HOSTB]  # type: ignore[arg-type]
        assert disconnected == 1
        await refused(listed.port, HOSTA)
        await works(b, 16)  # the host that is still allowed goes on
    finally:
        await a.close()
        await b.disconnect()


async def test_allow_any_host_off_disconnects_hosts_not_listed(open_to_all: Served) -> None:
    svc = open_to_all.service
    a = await connect(open_to_all.port, HOSTA)
    try:
        await works(a)
        disconnected = await svc.set_allow_any_host(SUBNQN, False)  # type: ignore[attr-defined]
        await revoked(a)
        assert disconnected == 1
        await refused(open_to_all.port, HOSTA)
        await svc.allow_host(SUBNQN, HOSTA)  # type: ignore[attr-defined]
        async with connect(open_to_all.port, HOSTA) as again:
            await works(again)
        # nothing left to revoke: turning it off again disconnects nobody
        assert await svc.set_allow_any_host(SUBNQN, False) == 0  # type: ignore[attr-defined]
    finally:
        await a.close()


async def test_removed_subsystem_takes_its_controllers(listed: Served) -> None:
    a = await connect(listed.port, HOSTA)
    b = await connect(listed.port, HOSTB)
    try:
        assert await listed.service.remove_subsystem(SUBNQN, force=True) == 2  # type: ignore[attr-defined]
        assert not listed.target.controllers  # type: ignore[attr-defined]
        await revoked(a)
        await revoked(b)
        with pytest.raises(NvmeError) as err:
            await connect(listed.port, HOSTA)
        assert err.value.status == Status.CONNECT_INVALID_PARAM  # no such subsystem any more
    finally:
        await a.close()
        await b.close()


async def test_removed_listener_disconnects_controllers_with_a_queue_there(listed: Served) -> None:
    svc, target = listed.service, listed.target
    port2 = free_port()
    second = await svc.add_listener("tcp", "127.0.0.1", port2)  # type: ignore[attr-defined]
    a = await connect(listed.port, HOSTA)      # only through the first listener: keeps working
    b = await connect(port2, HOSTB)            # admin and I/O queue through the second
    # a controller whose admin queue came through the first listener and an I/O queue through the second
    admin = await open_tcp(listed.port)
    res = await admin.connect(SUBNQN, hostnqn=HOSTA)
    assert res.status == 0
    await admin.enable()
    cntlid = res.cqe.dw0 & 0xFFFF
    io = await open_tcp(port2)
    assert (await io.connect(SUBNQN, qid=1, cntlid=cntlid, hostnqn=HOSTA, sqsize=127)).status == 0
    try:
        disconnected = await svc.remove_listener(second.id)  # type: ignore[attr-defined]
        assert cntlid not in target.controllers  # type: ignore[attr-defined]
        await asyncio.wait_for(admin.lost, 5)
        assert disconnected == 2
        await revoked(b)
        await works(a)
    finally:
        admin.close()
        io.close()
        await a.disconnect()
        await b.close()


# --- the REST API answers the count --------------------------------------------------------------

TOKEN = "revocation-test-token"


def test_rest_delete_answers_how_many_controllers_went() -> None:
    target = Target()
    service = TargetService(target)
    client = TestClient(create_app(service, token=TOKEN), headers={"Authorization": f"Bearer {TOKEN}"})
    with client:
        subs = "/api/v1/subsystems"
        r = client.post(subs, json={"nqn": SUBNQN, "allow_any_host": False, "hosts": [HOSTA, HOSTB]})
        assert r.status_code == 201, r.text
        sub = service.get_subsystem(SUBNQN)
        ctrl_a = target.create_controller(sub, HOSTA, bytes(16), 0)
        target.create_controller(sub, HOSTB, bytes(16), 0)
        target.create_controller(sub, HOSTB, bytes(16), 0)
        r = client.delete(f"{subs}/{SUBNQN}/hosts/{HOSTA}")
        assert r.status_code == 200 and r.json() == {"disconnected": 1}, r.text
        assert ctrl_a.closed and sorted(c["hostnqn"] for c in client.get("/api/v1/controllers").json()) == \
            [HOSTB, HOSTB]
        r = client.delete(f"{subs}/{SUBNQN}", params={"force": "true"})
        assert r.status_code == 200 and r.json() == {"disconnected": 2}, r.text
        assert client.get("/api/v1/controllers").json() == []
        # an empty HOSTNQN (item 9) is listed like any other host
        client.post(subs, json={"nqn": SUBNQN})
        target.create_controller(service.get_subsystem(SUBNQN), "", bytes(16), 0)
        [info] = client.get("/api/v1/controllers").json()
        assert info["hostnqn"] == ""
        client.portal.call(target.close)


def test_cli_note_names_the_count() -> None:
    from nvmeof.cli.commands.manage import _disconnected, _disconnected_note

    assert _disconnected_note(_disconnected({"disconnected": 1})) == " (1 controller disconnected)"
    assert _disconnected_note(_disconnected({"disconnected": 3})) == " (3 controllers disconnected)"
    assert _disconnected_note(_disconnected(None)) == ""  # a daemon that answers 204


# --- with worker processes (`serve --workers`) -----------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "memfd_create") or sys.platform != "linux",
                    reason="worker processes need Linux memfd and SCM_RIGHTS")
async def test_revocation_reaches_io_queues_in_worker_processes() -> None:
    io, disc = free_ports(2)
    nqn = defaults.DEFAULT_SUBSYSTEM_NQN
    daemon = Daemon(DaemonOptions(listen=[TransportAddress("tcp", "127.0.0.1", io)],
                                  discovery=[TransportAddress("tcp", "127.0.0.1", disc)],
                                  api=None, ramdisk_size=4 * MiB, workers=2))
    await daemon.start()
    try:
        svc = daemon.service
        await svc.set_allow_any_host(nqn, False)
        await svc.allow_host(nqn, HOSTA)
        await svc.allow_host(nqn, HOSTB)
        a = await connect(io, HOSTA, nqn, nr_io_queues=2)
        b = await connect(io, HOSTB, nqn, nr_io_queues=2)
        try:
            pool = daemon.target.pool  # type: ignore[attr-defined]
            await wait_until(lambda: len(pool.placement()) == 4, what="all four I/O queues in workers")
            assert set(pool.placement().values()) <= set(pool.pids())
            await works(a)
            await works(b, 8)
            disconnected = await svc.deny_host(nqn, HOSTA)
            await revoked(a)
            assert {cntlid for cntlid, _ in pool.placement()} == {b.cntlid}
            assert disconnected == 1
            await refused(io, HOSTA, nqn)
            await works(b, 16)
        finally:
            await a.close()
            await b.disconnect()
    finally:
        await daemon.stop()
