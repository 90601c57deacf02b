"""NVMe/RDMA transport pieces testable without an RDMA device (the data path runs in the VM:
tests/interop/test_rdma_transport.py): missing pyverbs, the registry, SGL rules per transport,
the registered buffer pool, and the in-capsule limit of the admin queue."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest
from target_host import make_target

import initiator
from nvmeof import verbs as rv
from nvmeof.spec import identify as idf
from nvmeof.spec.identify import IdentifyController
from nvmeof.spec.nvme import (
    SGL_ID_INCAPSULE,
    SGL_ID_KEYED,
    SGL_ID_KEYED_INVALIDATE,
    SGL_ID_TRANSPORT,
    SQE_FLAGS_PSDT_SGL,
    Command,
    Direction,
    IoOpcode,
)
from nvmeof.status import NvmeError, Status
from target import admin
from target.core import Target, check_sgl
from target.request import Request, TargetQueue
from target.service import ServiceError, TargetService
from target.transports import get_transport
from target.transports.rdma import RDMA_OPS, RdmaListener
from target.transports.tcp import TCP_OPS

PYVERBS_MODULES = ("pyverbs", "pyverbs.cm_enums", "pyverbs.enums", "pyverbs.cmid", "pyverbs.cq", "pyverbs.mr",
                   "pyverbs.pyverbs_error", "pyverbs.qp", "pyverbs.wr")


@pytest.fixture
def no_pyverbs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import pyverbs` fail even where Debian's package is on the path."""
    for name in PYVERBS_MODULES:
        monkeypatch.setitem(sys.modules, name, None)


def test_load_pyverbs_says_how_to_install(no_pyverbs: None) -> None:
    with pytest.raises(rv.RdmaUnavailable, match="python3-pyverbs") as info:
        rv.load_pyverbs()
    assert "/usr/lib/python3/dist-packages" in str(info.value)


def test_registry_has_rdma() -> None:
    assert get_transport("rdma") is RdmaListener
    with pytest.raises(ValueError, match="available: rdma, tcp"):
        get_transport("fc")


async def test_rdma_listener_without_pyverbs_fails_and_tcp_still_works(no_pyverbs: None, tmp_path) -> None:
    target = Target()
    svc = TargetService(target, config_path=str(tmp_path / "config.json"))
    try:
        with pytest.raises(ServiceError) as info:
            await svc.add_listener("rdma", "127.0.0.1", 4420)
        assert info.value.status == 400
        assert "python3-pyverbs" in info.value.message and "dist-packages" in info.value.message
        assert target.listeners == {}
        assert not (tmp_path / "config.json").exists() or "rdma" not in (tmp_path / "config.json").read_text()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        await svc.add_listener("tcp", "127.0.0.1", port)
        async with initiator.connect("127.0.0.1", port, "nqn.2014-08.org.nvmexpress.discovery", kato=0,
                                     nr_io_queues=0, timeout=5) as ctrl:
            assert ctrl.cntlid
    finally:
        await target.close()


async def test_initiator_rdma_without_pyverbs_is_transport_error(no_pyverbs: None) -> None:
    with pytest.raises(initiator.TransportError, match="python3-pyverbs"):
        await initiator.connect("10.0.2.15", 4420, "nqn.2026-11.io.nvmeof-toolkit:x", transport="rdma", timeout=2)


async def test_rdma_listener_refuses_wildcard_address() -> None:
    pytest.importorskip("pyverbs.cmid")
    from target.model import Listener

    lst = Listener(trtype="rdma", adrfam="ipv4", traddr="0.0.0.0", trsvcid=4420, portid=1)
    with pytest.raises(ValueError, match="wildcard"):
        await RdmaListener(Target(), lst).start()


def _request(transport: str, sgl_id: int, length: int, key: int = 0, direction: Direction = Direction.H2C) -> Request:
    queue = TargetQueue(ops={"rdma": RDMA_OPS, "tcp": TCP_OPS}[transport])
    cmd = Command(IoOpcode.WRITE, nsid=1, flags=SQE_FLAGS_PSDT_SGL)
    cmd.dptr = Command.make_sgl(sgl_id, 0x1000 if sgl_id != SGL_ID_INCAPSULE else 0, length, key)
    req = Request(queue, cmd)
    req.direction, req.data_len = direction, length
    return req


@pytest.mark.parametrize("sgl_id", [SGL_ID_KEYED, SGL_ID_KEYED_INVALIDATE])
def test_check_sgl_takes_keyed_on_rdma_only(sgl_id: int) -> None:
    check_sgl(_request("rdma", sgl_id, 4096, key=0x1234))
    with pytest.raises(NvmeError) as info:
        check_sgl(_request("tcp", sgl_id, 4096, key=0x1234))
    assert info.value.status == Status.SGL_INVALID_TYPE


def test_check_sgl_refuses_transport_sgl_on_rdma() -> None:
    with pytest.raises(NvmeError, match="NVMe/RDMA takes") as info:
        check_sgl(_request("rdma", SGL_ID_TRANSPORT, 4096))
    assert info.value.status == Status.SGL_INVALID_TYPE
    check_sgl(_request("rdma", SGL_ID_INCAPSULE, 512))


def test_identify_advertises_keyed_sgls_on_rdma_only() -> None:
    target = make_target()
    sub = next(iter(target.subsystems.values()))
    ctrl = target.create_controller(sub, "nqn.2014-08.org.nvmexpress:uuid:1", bytes(16), 0)
    rdma = IdentifyController.parse(admin.identify_controller(ctrl, RDMA_OPS))
    tcp = IdentifyController.parse(admin.identify_controller(ctrl, TCP_OPS))
    assert rdma.sgls & idf.SGLS_KEYED and rdma.sgls & idf.SGLS_OFFSET
    assert not tcp.sgls & idf.SGLS_KEYED


class _FakeRegion:
    def __init__(self, size: int) -> None:
        self.size = size
        self.view = memoryview(bytearray(size))


async def test_buffer_pool_first_fit_coalesces_and_waits() -> None:
    pool = rv.BufferPool(_FakeRegion(16384))  # type: ignore[arg-type]
    a = await pool.acquire(4096)
    b = await pool.acquire(5000)      # rounded to 8192
    c = await pool.acquire(1)
    assert (a, b, c) == (0, 4096, 12288)
    assert pool.try_acquire(1) is None
    waiter = asyncio.ensure_future(pool.acquire(8192))
    await asyncio.sleep(0)
    assert not waiter.done()
    pool.release(a, 4096)
    await asyncio.sleep(0)
    assert not waiter.done()          # 4 KiB free is not enough
    pool.release(b, 5000)             # coalesces with the first range
    assert await asyncio.wait_for(waiter, 1) == 0
    with pytest.raises(ValueError, match="exceed"):
        await pool.acquire(16385)
    blocked = asyncio.ensure_future(pool.acquire(16384))
    await asyncio.sleep(0)
    pool.close()
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(blocked, 1)
