"""The performance fast paths give the same bytes on the wire as the general paths they shortcut.

Each test runs one scripted session twice, once with the fast path and once with it switched off,
and compares everything the peer received.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from target_host import SUBNQN, TinyHost, admin_session, io_session, make_target

from nvmeof.spec.nvme import AdminOpcode, Command, Completion, Direction, IoOpcode
from nvmeof.status import Status
from nvmeof.tcp import C2HDataReceived, ProtocolError
from target.backends.file import FileBackend
from target.model import Namespace
from target.transports.tcp import TargetConnection


class RecordingHost(TinyHost):
    """TinyHost that keeps every byte the target sent, and can queue several commands per write."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.received = bytearray()
        self.hold = False

    def data_received(self, data: bytes) -> None:
        self.received += data
        super().data_received(data)

    def flush(self) -> None:
        if not self.hold:
            super().flush()


async def _batch(host: RecordingHost, sends: list[tuple[Any, ...]]) -> list[tuple[int, bytes | None]]:
    """Queue all commands, write them in one go (one data_received on the target), await them all."""
    host.hold = True
    futs = [host.send(cmd, data, read_len=read_len) for cmd, data, read_len in sends]
    host.hold = False
    host.flush()
    results = await asyncio.wait_for(asyncio.gather(*futs), 10)
    return [(r.status, r.data) for r in results]


def _rd(slba: int, nlb: int, nsid: int = 1) -> tuple[Any, ...]:
    return Command(IoOpcode.READ, nsid=nsid, cdw10=slba, cdw12=nlb - 1), None, nlb * 512


def _wr(slba: int, data: bytes, nsid: int = 1) -> tuple[Any, ...]:
    return Command(IoOpcode.WRITE, nsid=nsid, cdw10=slba, cdw12=len(data) // 512 - 1), data, 0


async def _session(tmp_path: Any, eager: bool, monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[bytes, bytes, list[Any], int]:
    monkeypatch.setattr(TargetConnection, "eager", eager)
    tasks = 0
    task_done = TargetConnection._task_done

    def count(self: TargetConnection, task: asyncio.Task[None]) -> None:
        nonlocal tasks
        tasks += 1
        task_done(self, task)

    monkeypatch.setattr(TargetConnection, "_task_done", count)
    tgt = make_target()
    path = tmp_path / f"ns2-{eager}.img"
    tgt.subsystems[SUBNQN].namespaces[2] = Namespace(2, FileBackend(path, size=1 << 20, create=True))
    admin, cntlid = await admin_session(tgt, SUBNQN)
    io = await io_session(tgt, SUBNQN, cntlid)
    # io_session built a plain TinyHost; open a recording one on qid 2 for the batches
    rec = await _recording_io(tgt, cntlid)
    seen: list[Any] = []
    a = bytes(range(256)) * 16                     # 4 KiB, in-capsule
    big = random.Random(6).randbytes(64 * 1024)     # 64 KiB, R2T + H2CData
    seen += await _batch(rec, [_wr(0, a), _rd(0, 8), _rd(4, 2), _wr(100, a[:512]), _rd(100, 1)])
    seen += await _batch(rec, [_rd(2047, 2), _rd(0, 1, nsid=9), _wr(200, big), _rd(0, 8)])
    seen += await _batch(rec, [_rd(200, 128), (Command(IoOpcode.COMPARE, nsid=1, cdw10=0, cdw12=7), a, 0),
                               (Command(IoOpcode.COMPARE, nsid=1, cdw10=8, cdw12=7), a, 0),
                               (Command(IoOpcode.FLUSH, nsid=1), None, 0)])
    # the file backend suspends (thread pool): these run as Tasks in both modes, one at a time
    seen += await _batch(rec, [_wr(10, a, nsid=2)])
    seen += await _batch(rec, [_rd(10, 8, nsid=2)])
    seen += await _batch(rec, [_wr(300, big, nsid=2)])
    seen += await _batch(rec, [_rd(300, 128, nsid=2)])
    admin_rec = await _recording_admin(tgt)
    seen += await _batch(admin_rec[0], [(Command(AdminOpcode.IDENTIFY, nsid=1, cdw10=0), None, 4096),
                                        (Command(AdminOpcode.IDENTIFY, cdw10=1), None, 4096),
                                        (Command(0xEE), None, 0),
                                        (Command(AdminOpcode.GET_FEATURES, cdw10=0x07), None, 0)])
    for h in (admin, io, rec, admin_rec[0]):
        h.close()
    await asyncio.sleep(0.05)
    await tgt.close()
    return bytes(rec.received), bytes(admin_rec[0].received), seen, tasks


async def _recording_io(tgt: Any, cntlid: int) -> RecordingHost:
    from target.transports.loop import create_loop_connection

    _, host = await create_loop_connection(tgt, RecordingHost)
    assert isinstance(host, RecordingHost)
    await asyncio.wait_for(host.ready, 5)
    res = await host.connect(SUBNQN, qid=2, cntlid=cntlid, sqsize=127)
    assert res.status == 0
    return host


async def _recording_admin(tgt: Any) -> tuple[RecordingHost, int]:
    from target.transports.loop import create_loop_connection

    _, host = await create_loop_connection(tgt, RecordingHost)
    assert isinstance(host, RecordingHost)
    await asyncio.wait_for(host.ready, 5)
    res = await host.connect(SUBNQN, kato=0)
    assert res.status == 0
    await host.enable()
    return host, res.cqe.dw0 & 0xFFFF


async def test_eager_commands_equal_task_per_command(tmp_path, monkeypatch):
    fast_io, fast_admin, fast_results, fast_tasks = await _session(tmp_path, True, monkeypatch)
    slow_io, slow_admin, slow_results, slow_tasks = await _session(tmp_path, False, monkeypatch)
    # eager: only the commands that wait (R2T data, the file backend) became Tasks
    assert 0 < fast_tasks < slow_tasks / 4
    assert fast_results == slow_results
    assert fast_io == slow_io
    assert fast_admin == slow_admin
    statuses = [s for s, _ in fast_results]
    assert Status.LBA_RANGE in statuses and Status.INVALID_NS in statuses
    assert Status.COMPARE_FAILED in statuses and Status.INVALID_OPCODE in statuses
    assert fast_results[1][1] == bytes(range(256)) * 16


# --- direct data placement (nvmeof/tcp.py) ----------------------------------------------------------

def _ready_pair(hdgst: bool = False) -> tuple[Any, Any]:
    from nvmeof.tcp import Role, TcpConnection

    host, ctrl = TcpConnection(Role.HOST), TcpConnection(Role.CONTROLLER)
    host.send_icreq(hdgst=hdgst)
    ctrl.receive_data(b"".join(bytes(b) for b in host.data_to_send()))
    ctrl.send_icresp()
    host.receive_data(b"".join(bytes(b) for b in ctrl.data_to_send()))
    return host, ctrl


_C2H_SIZES = (4096, 16 * 1024, 16 * 1024 + 1, 128 * 1024, 40000, 300 * 1024, 512)


def _reads_sent(host: Any, sizes: dict[int, int] | None = None) -> Any:
    """The host sent the reads (cid: length) the controller's C2HData answers: it checks the data against them."""
    for cid, size in (sizes or dict(enumerate(_C2H_SIZES))).items():
        host.send_command(Command(IoOpcode.READ, cid=cid).to_bytes(), direction=Direction.C2H, data_len=size)
    host.data_to_send()
    return host


def _c2h_stream(ctrl: Any, rng: random.Random) -> tuple[bytes, dict[int, bytes]]:
    """C2HData for several commands (some split over PDUs, sizes around the placement threshold)."""
    payloads: dict[int, bytes] = {}
    for cid, size in enumerate(_C2H_SIZES):
        data = rng.randbytes(size)
        payloads[cid] = data
        split = 64 * 1024 if cid == 5 else size
        ctrl.send_c2h_data_split(cid, data, split, success=cid % 2 == 0)
        if cid % 2:
            ctrl.send_response(Completion(cid).to_bytes())
    return b"".join(bytes(b) for b in ctrl.data_to_send()), payloads


def _feed(host: Any, stream: bytes, cuts: list[int], direct: bool) -> list[tuple[Any, ...]]:
    seen: list[tuple[Any, ...]] = []

    def note(events: list[Any]) -> None:
        for ev in events:
            if isinstance(ev, C2HDataReceived):
                seen.append(("c2h", ev.cccid, ev.offset, bytes(ev.data), ev.last, ev.success, ev.digest_ok))
            else:
                seen.append((type(ev).__name__, bytes(getattr(ev, "cqe", b""))))

    pos = 0
    for cut in [*cuts, len(stream)]:
        while pos < cut:
            target = host.direct_buffer() if direct else None
            if target is not None:
                n = min(len(target), cut - pos)
                target[:n] = stream[pos:pos + n]
                note(host.direct_received(n))
            else:
                n = cut - pos
                note(host.receive_data(stream[pos:cut]))
            pos += n
    return seen


@pytest.mark.parametrize("seed", range(8))
def test_direct_placement_equals_general_path(seed: int) -> None:
    rng = random.Random(seed)
    host_a, ctrl = _ready_pair(hdgst=seed % 2 == 1)
    host_b, _ = _ready_pair(hdgst=seed % 2 == 1)
    _reads_sent(host_a)
    _reads_sent(host_b)
    stream, payloads = _c2h_stream(ctrl, rng)
    cuts = sorted(rng.sample(range(1, len(stream)), 40))
    dests = {cid: bytearray(len(p)) for cid, p in payloads.items()}
    placed: list[int] = []

    def place(cccid: int, ttag: int, datao: int, datal: int) -> memoryview:
        placed.append(cccid)
        return memoryview(dests[cccid])[datao:datao + datal]

    host_b.place = place
    general = _feed(host_a, stream, cuts, direct=False)
    direct = _feed(host_b, stream, cuts, direct=True)
    assert direct == general
    assert placed, "no payload went the direct way"
    assert bytes(dests[3]) == payloads[3]   # 128 KiB in one PDU: always placed (it spans many cuts)
    # a placement callback that declines keeps the general path
    host_c, _ = _ready_pair(hdgst=seed % 2 == 1)
    _reads_sent(host_c)
    host_c.place = lambda *a: None
    assert _feed(host_c, stream, cuts, direct=True) == general


def test_direct_placement_then_malformed_pdu_still_fails() -> None:
    host, ctrl = _ready_pair()
    _reads_sent(host, {1: 64 * 1024})
    dest = bytearray(64 * 1024)
    host.place = lambda cccid, ttag, datao, datal: memoryview(dest)[datao:datao + datal]
    ctrl.send_c2h_data(1, 0, bytes(range(256)) * 256, last=True, success=True)
    stream = b"".join(bytes(b) for b in ctrl.data_to_send())
    assert host.receive_data(stream[:1000]) == []
    assert host.direct_buffer() is not None
    events = host.receive_data(stream[1000:] + bytes(8))   # a zero header after the payload: unknown type 0
    assert isinstance(events[0], C2HDataReceived) and events[0].placed and bytes(dest) == bytes(range(256)) * 256
    assert isinstance(events[1], ProtocolError) and host.closed
