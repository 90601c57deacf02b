"""HostController.read/write/compare on the batch engine's callback path (BatchQueue.start_awaitable).

Against our own target over TCP: many tasks at once with their data checked, and proof that the commands
took the awaitable slot path (no submit(), every start of one loop iteration in one sendmsg); NVMe status
errors raise what the submit() path (the stream engine) raises; against the scripted controller of
test_initiator_queue: a command timeout, a TermReq and a dropped connection fail every pending await, and
a cancelled await keeps its cid until the controller answers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tests.test_initiator_queue as tq
from initiator.controller import HostController
from initiator.engine import BatchQueue
from initiator.nvm import NamespaceGeometry
from initiator.queue import TransportError
from nvmeof.status import NvmeError, Status
from tests.test_engine import open_batch
from tests.test_initiator_controller import NQN, NS1_BLOCKS, Env, pattern
from tests.test_initiator_controller import tcp_env as tcp_env
from tests.test_initiator_queue import FakeServer
from tests.test_initiator_queue import server as server

TASKS = 32


def spy_submit(monkeypatch: pytest.MonkeyPatch, queues: list[Any]) -> list[int]:
    """Count the submit() calls on ``queues`` (the Future-per-command path the awaitable path avoids)."""
    calls = [0]
    for q in queues:
        real = q.submit

        async def counted(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            calls[0] += 1
            return await _real(*args, **kwargs)

        monkeypatch.setattr(q, "submit", counted)
    return calls


@pytest.mark.parametrize("digests", [False, True])
async def test_many_tasks_read_and_write_verified(tcp_env: Env, digests: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    async with tcp_env.connect(hdr_digest=digests, data_digest=digests) as ctrl:
        q = ctrl.io_queues[0]
        assert isinstance(q, BatchQueue)
        calls = spy_submit(monkeypatch, ctrl.io_queues)
        before = q.commands_submitted
        rounds = 4
        big = ctrl.io_incapsule_size + 4096     # above the in-capsule size: R2T/H2CData

        async def worker(i: int) -> None:
            buf = bytearray(4096)
            for r in range(rounds):
                slba = (i * rounds + r) * 8
                data = pattern(4096, i * 100 + r)
                await ctrl.write(1, slba, data)
                await ctrl.read(1, slba, 8, buf=buf)
                assert bytes(buf) == data, f"task {i} round {r}"
                assert await ctrl.read(1, slba, 8) == data
                await ctrl.compare(1, slba, data)
            large = pattern(big, i)
            slba = 100_000 + i * (big // 512)
            await ctrl.write(1, slba, memoryview(large))
            assert await ctrl.read(1, slba, big // 512) == large

        await asyncio.gather(*(worker(i) for i in range(TASKS)))
        assert calls[0] == 0, "an I/O of the library API went through submit()"
        assert q.commands_submitted - before == TASKS * (rounds * 4 + 2)
        assert q.inflight == 0


async def test_starts_of_one_iteration_leave_in_one_sendmsg(tcp_env: Env) -> None:
    async with tcp_env.connect() as ctrl:
        q = ctrl.io_queues[0]
        assert isinstance(q, BatchQueue)
        data = pattern(TASKS * 4096, 5)
        await ctrl.write(1, 0, data)
        sends = q._sends
        results = await asyncio.gather(*(ctrl.read(1, i * 8, 8) for i in range(TASKS)))
        assert b"".join(results) == data
        # the first read is alone in flight and leaves at once; the other 31 in the next iteration, together
        assert q._sends - sends == 2


async def test_more_tasks_than_cids_wait_their_turn(tcp_env: Env) -> None:
    async with tcp_env.connect(queue_size=8) as ctrl:
        blobs = [pattern(512, i) for i in range(100)]
        await asyncio.gather(*(ctrl.write(1, i, blobs[i]) for i in range(100)))
        assert await asyncio.gather(*(ctrl.read(1, i, 1) for i in range(100))) == blobs
        assert ctrl.io_queues[0].inflight == 0


async def test_status_errors_match_the_submit_path(tcp_env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same exception type, status, DNR and queue name as the reference model (HostQueue alone, submit()
    per command, every PDU through the sans-IO TcpConnection)."""
    got: dict[str, list[tuple[type, int, bool]]] = {}
    for engine in ("batch", "stream"):
        monkeypatch.setattr(HostController, "_reference_queues", engine == "stream")
        async with tcp_env.connect() as ctrl:
            assert isinstance(ctrl.io_queues[0], BatchQueue) == (engine == "batch")
            data = pattern(4096, 1)
            await ctrl.write(1, 0, data)
            wrong = bytearray(data)
            wrong[7] ^= 1
            errors = []
            for op in (ctrl.read(1, NS1_BLOCKS - 4, 8), ctrl.write(1, NS1_BLOCKS - 1, bytes(1024)),
                       ctrl.compare(1, 0, wrong)):
                with pytest.raises(NvmeError) as info:
                    await op
                assert NQN in str(info.value) and "qid 1" in str(info.value)
                errors.append((type(info.value), info.value.status, info.value.dnr))
            got[engine] = errors
            assert await ctrl.read(1, 0, 8) == data   # the queue goes on
    assert got["batch"] == got["stream"]
    assert [s for _t, s, _d in got["batch"]] == [Status.LBA_RANGE, Status.LBA_RANGE, Status.COMPARE_FAILED]


async def test_dropped_connection_fails_every_pending_read(tcp_env: Env) -> None:
    """The target goes away with reads in flight: none hangs, each either completed or failed with
    TransportError (the scripted controller's tests below make every one fail for sure)."""
    ctrl = await tcp_env.connect()
    try:
        q = ctrl.io_queues[0]
        await ctrl.read(1, 0, 8)   # the namespace geometry, read once and cached
        tasks = [asyncio.create_task(ctrl.read(1, i * 8, 8)) for i in range(TASKS)]
        await asyncio.sleep(0)
        assert q.inflight == TASKS
        await tcp_env.target.close()
        done, pending = await asyncio.wait(tasks, timeout=10)
        assert not pending
        for t in done:
            assert t.exception() is None or isinstance(t.exception(), TransportError), t.exception()
        with pytest.raises(TransportError):
            await ctrl.read(1, 0, 1)
        assert q.broken is not None and q.inflight == 0
    finally:
        await ctrl.close()


# ---- against the scripted controller (it can hang, drop and send a TermReq) ---------------------------


@pytest.fixture
async def fake_ctrls():
    made: list[HostController] = []
    yield made
    for ctrl in made:
        for q in ctrl.io_queues:
            q.close()
            await asyncio.wait_for(q.wait_closed(), 5)


async def fake_controller(srv: FakeServer, made: list[HostController], **kwargs: Any) -> HostController:
    """A HostController whose one I/O queue is a BatchQueue to the scripted controller (no admin queue:
    the namespace geometry is given)."""
    ctrl = HostController("127.0.0.1", srv.port)
    ctrl.io_queues = [await open_batch(srv, **kwargs)]
    ctrl._ns_cache[1] = NamespaceGeometry(1, 512, len(srv.ram) // 512)
    made.append(ctrl)
    return ctrl


def hang_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    real = tq.FakeController.on_command

    def on_command(self: tq.FakeController, cmd: Any, data: Any, ok: bool) -> None:
        if cmd.opcode == 0x02 and self.server.action == "hang":
            self.server.commands.append(cmd)
            return
        real(self, cmd, data, ok)

    monkeypatch.setattr(tq.FakeController, "on_command", on_command)


async def test_timeout_fails_every_pending_await(server: FakeServer, fake_ctrls: list[HostController],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    hang_reads(monkeypatch)
    ctrl = await fake_controller(server, fake_ctrls, timeout=0.2)
    data = pattern(4096, 3)
    await ctrl.write(1, 0, data)
    assert await ctrl.read(1, 0, 8) == data
    server.action = "hang"
    results = await asyncio.wait_for(asyncio.gather(*(ctrl.read(1, i, 1) for i in range(8)),
                                                    return_exceptions=True), 10)
    # as on the submit() path: all fail with the queue's TransportError, a CommandTimeout names the timeout
    # (the slot path gives every slot the CommandTimeout that broke the queue)
    assert all(isinstance(r, tq.TransportError) for r in results), results
    timeouts = [r for r in results if isinstance(r, tq.CommandTimeout)]
    assert timeouts and "got no completion in 0.2 s" in str(timeouts[0])
    with pytest.raises(tq.TransportError):
        await ctrl.read(1, 0, 1)


@pytest.mark.parametrize("action", ["termreq", "drop"])
async def test_termreq_and_drop_fail_every_pending_await(server: FakeServer, action: str,
                                                         fake_ctrls: list[HostController],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    hang_reads(monkeypatch)
    ctrl = await fake_controller(server, fake_ctrls)
    server.action = "hang"
    pending = [asyncio.ensure_future(ctrl.read(1, i, 1)) for i in range(8)]
    await asyncio.sleep(0.05)
    assert not any(p.done() for p in pending)
    server.action = action
    with pytest.raises(tq.TransportError):
        await asyncio.wait_for(ctrl.write(1, 0, bytes(512)), 5)
    for r in await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 5):
        assert isinstance(r, tq.TransportError), r


async def test_cancelled_await_keeps_its_cid_until_answered(server: FakeServer,
                                                           fake_ctrls: list[HostController],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    hang_reads(monkeypatch)
    ctrl = await fake_controller(server, fake_ctrls)
    q = ctrl.io_queues[0]
    server.ram[:512] = bytes(range(256)) * 2
    server.action = "hang"
    task = asyncio.ensure_future(ctrl.read(1, 0, 1))
    await asyncio.sleep(0.05)
    free = q.free_slots
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert q.free_slots == free, "a cid was freed while the controller may still answer it"
    # the controller answers the cancelled command now: its cid comes back, nothing breaks
    hung = server.commands[-1]
    server.action = ""
    conn = server.connections[-1]
    conn.on_command(hung, None, True)
    conn.flush()
    for _ in range(100):
        if q.free_slots == free + 1:
            break
        await asyncio.sleep(0.01)
    assert q.free_slots == free + 1 and q.broken is None
    assert await ctrl.read(1, 0, 1) == bytes(range(256)) * 2
