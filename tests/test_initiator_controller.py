"""The Python host against our own target, over the in-memory loop transport and over TCP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

import pytest

import initiator
from initiator.controller import HostController
from nvmeof.spec.fabrics import Property
from nvmeof.spec.nvme import Command, FeatureId, IoOpcode, LogPageId
from nvmeof.status import NvmeError, Status
from target.core import Target
from target.service import TargetService
from tests.ports import free_port

NQN = "nqn.2026-11.io.nvmeof-toolkit:initiator-test"
NS1_BLOCKS = 64 * 1024 * 1024 // 512     # 64 MiB of 512-byte blocks
NS2_SIZE = 8 * 1024 * 1024               # 8 MiB of 4096-byte blocks


@dataclasses.dataclass
class Env:
    target: Target
    service: TargetService
    transport: str
    port: int = 0

    def kwargs(self, **extra: Any) -> dict[str, Any]:
        if self.transport == "tcp":
            base: dict[str, Any] = {"traddr": "127.0.0.1", "trsvcid": self.port, "transport": "tcp"}
        else:
            base = {"traddr": "loop", "trsvcid": 0, "transport": "loop", "target": self.target}
        base.setdefault("subnqn", NQN)
        base.update(extra)
        return base

    def connect(self, **extra: Any) -> Any:
        return initiator.connect(**self.kwargs(**extra))


async def make_target() -> tuple[Target, TargetService]:
    target = Target(keep_alive_interval=0.1)
    service = TargetService(target)
    await service.add_subsystem(NQN)
    await service.add_namespace(NQN, backend="ram", size=NS1_BLOCKS * 512, block_size=512, nsid=1)
    await service.add_namespace(NQN, backend="ram", size=NS2_SIZE, block_size=4096, nsid=2)
    return target, service


@pytest.fixture(params=["loop", "tcp"])
async def env(request: pytest.FixtureRequest):
    target, service = await make_target()
    e = Env(target, service, request.param)
    if request.param == "tcp":
        e.port = free_port()
        await service.add_listener("tcp", "127.0.0.1", e.port)
    yield e
    await target.close()


@pytest.fixture
async def tcp_env():
    target, service = await make_target()
    e = Env(target, service, "tcp", free_port())
    await service.add_listener("tcp", "127.0.0.1", e.port)
    yield e
    await target.close()


def pattern(n: int, seed: int) -> bytes:
    return (os.urandom(16) + seed.to_bytes(4, "little")) * (n // 20) + bytes(n % 20)


# ---- connect, identify, properties -----------------------------------------------------------------


async def test_connect_identify_and_properties(env: Env) -> None:
    async with env.connect(nr_io_queues=2) as ctrl:
        ident = await ctrl.identify_controller()
        assert ident.cntlid == ctrl.cntlid and ident.subnqn == NQN
        assert ctrl.identity.mdts == ident.mdts
        assert len(ctrl.io_queues) == 2
        assert await ctrl.namespaces() == [1, 2]
        ns = await ctrl.identify_namespace(1)
        assert ns.nsze == NS1_BLOCKS
        geo = await ctrl.namespace_geometry(2)
        assert (geo.block_size, geo.nsze) == (4096, NS2_SIZE // 4096)
        assert await ctrl.get_property(Property.VS) == ctrl.vs
        csts = await ctrl.get_property(Property.CSTS)
        assert csts & 1  # RDY
        cap = await ctrl.get_property(Property.CAP)
        assert cap == ctrl.cap and cap & 0xFFFF >= 1
        descs = await ctrl.namespace_descriptors(1)
        assert descs  # the target reports at least one identifier
        assert ctrl.hostnqn.startswith("nqn.2014-08.org.nvmexpress:uuid:")
        cntlid = ctrl.cntlid
        assert cntlid in env.target.controllers
    await asyncio.sleep(0.05)
    assert cntlid not in env.target.controllers  # shut down and gone


async def test_await_form_and_explicit_host_identity(env: Env) -> None:
    hostnqn = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
    ctrl = await env.connect(hostnqn=hostnqn, hostid="11111111-2222-3333-4444-555555555555", nr_io_queues=1)
    try:
        info = {c["cntlid"]: c for c in env.target.controllers_info()}
        assert ctrl.cntlid in info
        assert hostnqn in str(info[ctrl.cntlid])
    finally:
        await ctrl.disconnect()


# ---- I/O --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("digest", [False, True])
async def test_write_read_round_trip(env: Env, digest: bool) -> None:
    async with env.connect(hdr_digest=digest, data_digest=digest) as ctrl:
        assert all(q.negotiated_digests == (digest, digest) for q in [ctrl.admin, *ctrl.io_queues])
        data = pattern(4096, 1)
        await ctrl.write(1, 100, data)
        assert await ctrl.read(1, 100, 8) == data
        buf = bytearray(8192)
        await ctrl.read(1, 96, 16, buf=buf)
        assert bytes(buf[2048:6144]) == data
        # a 4 KiB-block namespace, data from a memoryview
        big = pattern(3 * 4096, 2)
        await ctrl.write(2, 5, memoryview(big), fua=True)
        assert await ctrl.read(2, 5, 3) == big


async def test_many_commands_over_several_queues(env: Env) -> None:
    async with env.connect(nr_io_queues=4, queue_size=16) as ctrl:
        assert len(ctrl.io_queues) == 4
        before = [q.commands_submitted for q in ctrl.io_queues]
        blobs = [pattern(4096, i) for i in range(200)]
        await asyncio.gather(*(ctrl.write(1, i * 8, blobs[i]) for i in range(200)))
        reads = await asyncio.gather(*(ctrl.read(1, i * 8, 8) for i in range(200)))
        assert reads == blobs
        used = [q.commands_submitted - b for q, b in zip(ctrl.io_queues, before, strict=True)]
        assert sum(used) == 400 and all(u > 0 for u in used)


async def test_transfers_larger_than_mdts_and_incapsule(env: Env) -> None:
    async with env.connect(nr_io_queues=2) as ctrl:
        assert ctrl.mdts_bytes > 0 and ctrl.io_incapsule_size > 0
        size = 2 * ctrl.mdts_bytes + 3 * 512           # three commands, the last one small
        data = pattern(size, 7)
        before = sum(q.commands_submitted for q in ctrl.io_queues)
        await ctrl.write(1, 1000, data)
        assert sum(q.commands_submitted for q in ctrl.io_queues) - before == 3
        assert await ctrl.read(1, 1000, size // 512) == data
        await ctrl.compare(1, 1000, data)
        # just above the in-capsule size: R2T/H2CData instead of in-capsule
        mid = pattern(ctrl.io_incapsule_size + 512, 8)
        await ctrl.write(1, 5000, mid)
        assert await ctrl.read(1, 5000, len(mid) // 512) == mid


async def test_flush_write_zeroes_deallocate_compare(env: Env) -> None:
    async with env.connect() as ctrl:
        data = pattern(8192, 3)
        await ctrl.write(1, 0, data)
        await ctrl.flush(1)
        await ctrl.compare(1, 0, data)
        wrong = bytearray(data)
        wrong[100] ^= 1
        with pytest.raises(NvmeError) as info:
            await ctrl.compare(1, 0, wrong)
        assert info.value.status == Status.COMPARE_FAILED
        await ctrl.write_zeroes(1, 0, 8)
        assert await ctrl.read(1, 0, 16) == bytes(4096) + data[4096:]
        await ctrl.deallocate(1, [(8, 8), (200, 4)])
        assert await ctrl.read(1, 8, 8) == bytes(4096)   # the RAM backend reads deallocated blocks as 0


async def test_io_errors(env: Env) -> None:
    async with env.connect() as ctrl:
        with pytest.raises(NvmeError) as info:
            await ctrl.read(1, NS1_BLOCKS - 4, 8)
        assert info.value.status == Status.LBA_RANGE and "LBA_RANGE" in str(info.value)
        # unknown NSID: straight from the target's I/O path
        with pytest.raises(NvmeError) as info:
            await ctrl.io_command(Command(IoOpcode.READ, nsid=99, cdw12=0), data_in=bytearray(512))
        assert info.value.status == Status.INVALID_NS
        with pytest.raises(NvmeError) as info:
            await ctrl.read(99, 0, 1)
        assert info.value.status == Status.INVALID_NS
        with pytest.raises(ValueError, match="multiple of namespace 2's block size 4096"):
            await ctrl.write(2, 0, bytes(512))
        # the controller is still fine
        await ctrl.write(1, 0, bytes(512))


# ---- admin --------------------------------------------------------------------------------------------


async def test_log_pages_features_keep_alive(env: Env) -> None:
    async with env.connect(nr_io_queues=3, kato=3000) as ctrl:
        smart = await ctrl.get_log_page(LogPageId.SMART, 512)
        assert len(smart) == 512
        effects = await ctrl.get_log_page(LogPageId.CMD_EFFECTS, 4096)
        # split into MDTS-sized pieces: force a 1 KiB MDTS and compare
        admin = ctrl.admin
        before = admin.commands_submitted
        ctrl.mdts_bytes = 1024
        assert await ctrl.get_log_page(LogPageId.CMD_EFFECTS, 4096) == effects
        assert admin.commands_submitted - before == 4
        assert await ctrl.get_log_page(LogPageId.CMD_EFFECTS, 1024, offset=2048) == effects[2048:3072]
        assert await ctrl.get_features(FeatureId.NUM_QUEUES) & 0xFFFF == 2
        assert await ctrl.get_features(FeatureId.KATO) == 3000
        await ctrl.set_features(FeatureId.TEMP_THRESHOLD, 350)
        assert await ctrl.get_features(FeatureId.TEMP_THRESHOLD) & 0xFFFF == 350
        with pytest.raises(NvmeError) as info:
            await ctrl.set_features(0x55)
        assert info.value.status == Status.INVALID_FIELD
        await ctrl.keep_alive()
        with pytest.raises(ValueError, match="multiple of 4"):
            await ctrl.get_log_page(LogPageId.SMART, 10)


async def test_keep_alive_keeps_idle_controller(env: Env) -> None:
    async with env.connect(kato=1000) as ctrl, env.connect(kato=1000) as silent:
        # The second controller stops its keep-alive task: the target must drop it after KATO,
        # which shows the first one survives only thanks to its keep-alives.
        for task in silent._tasks:
            task.cancel()
        await asyncio.sleep(3.0)
        assert ctrl.cntlid in env.target.controllers
        assert await ctrl.read(1, 0, 1) is not None
        assert silent.cntlid not in env.target.controllers
        with pytest.raises(initiator.TransportError):
            await silent.read(1, 0, 1)


async def test_namespace_change_event(env: Env) -> None:
    seen: list[initiator.AsyncEvent] = []
    async with env.connect(event_callback=seen.append) as ctrl:
        # namespace notices only: the target may also report the ANA log's change (membership) now
        events = (e async for e in ctrl.events() if e.info == 0)
        await env.service.add_namespace(NQN, backend="ram", size=1 << 20, block_size=512, nsid=7)
        ev = await asyncio.wait_for(anext(events), 5)
        assert ev.type == 2 and ev.info == 0 and 7 in ev.changed_nsids
        assert [e for e in seen if e.info == 0] == [ev]
        assert await ctrl.namespaces() == [1, 2, 7]
        # the AER was re-armed: a second change is delivered too
        await env.service.remove_namespace(NQN, 7)
        ev2 = await asyncio.wait_for(anext(events), 5)
        assert 7 in ev2.changed_nsids


# ---- connect errors ---------------------------------------------------------------------------------


async def test_wrong_subsystem_nqn_is_named(env: Env) -> None:
    bad = "nqn.2026-11.io.nvmeof-toolkit:no-such-thing"
    with pytest.raises(NvmeError) as info:
        await env.connect(subnqn=bad)
    assert info.value.status == Status.CONNECT_INVALID_PARAM
    assert f"target rejected subsystem NQN '{bad}'" in str(info.value)
    assert not env.target.controllers


async def test_host_not_allowed_is_named(env: Env) -> None:
    other = "nqn.2026-11.io.nvmeof-toolkit:locked"
    allowed = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-0000-0000-000000000000"
    await env.service.add_subsystem(other, hosts=[allowed])
    hostnqn = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-0000-0000-000000000000"
    with pytest.raises(NvmeError) as info:
        await env.connect(subnqn=other, hostnqn=hostnqn)
    assert info.value.status == Status.CONNECT_INVALID_HOST
    assert hostnqn in str(info.value) and other in str(info.value)


async def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="transport 'fc' is not supported"):
        HostController("127.0.0.1", 4420, NQN, transport="fc")
    with pytest.raises(ValueError, match="needs target="):
        HostController("x", 0, NQN, transport="loop")
    with pytest.raises(ValueError, match=r"connect_loop\(protocol_factory\)\), got object"):
        HostController("x", 0, NQN, transport="loop", target=object())
    with pytest.raises(ValueError, match="subsystem NQN"):
        HostController("127.0.0.1", 4420, "n" * 300)


async def test_nothing_listening_is_transport_error() -> None:
    with pytest.raises(initiator.TransportError, match="cannot connect"):
        await initiator.connect("127.0.0.1", free_port(), NQN, timeout=2)


# ---- failures while running ------------------------------------------------------------------------


async def test_target_killed_mid_transfer(env: Env) -> None:
    ctrl = await env.connect(nr_io_queues=2)
    try:
        size = 1 << 20
        tasks = [asyncio.create_task(ctrl.read(1, i * 2048, 2048)) for i in range(24)]
        tasks += [asyncio.create_task(ctrl.write(1, i * 2048, bytes(size))) for i in range(24, 40)]
        await asyncio.sleep(0.01)
        start = asyncio.get_running_loop().time()
        await env.target.close()
        done, pending = await asyncio.wait(tasks, timeout=3)
        assert not pending
        assert asyncio.get_running_loop().time() - start < 3
        failures = [t.exception() for t in done if t.exception() is not None]
        assert failures, "every command finished before the target went away"
        for exc in failures:
            assert isinstance(exc, initiator.TransportError), exc
            assert NQN in str(exc)
        with pytest.raises(initiator.TransportError):
            await ctrl.read(1, 0, 1)
    finally:
        await ctrl.close()


async def test_reconnect_after_controller_teardown(env: Env) -> None:
    rc = await env.connect(reconnect=True, max_reconnect_delay=0.5)
    try:
        await rc.write(1, 0, pattern(512, 9))
        first = rc.cntlid
        assert env.target.disconnect_controller(first)
        data = await rc.read(1, 0, 1)          # fails on the dead queue, reconnects, retries
        assert len(data) == 512
        assert rc.reconnects == 1 and rc.cntlid != first
    finally:
        await rc.disconnect()
