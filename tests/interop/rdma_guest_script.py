"""Runs INSIDE the Debian guest (tests/interop/rootfs.py): a pyverbs proof of the NVMe/RDMA data path.

Two threads on rxe0 at 10.0.2.15: a passive "controller" and an active "host", each with its own
RDMA CM event channel and an external QP driven through CMID.init_qp_attr. The host connects with
NVMe/RDMA private data built by nvmeof.spec.rdma; the controller validates it with nvmeof.rdma and
accepts with crqsize. Then, driven by nvmeof.rdma's sans-IO queues:
  1. a Write-like command: the controller RDMA READs the host's buffer (keyed SGL 0x40);
  2. a Read-like command: RDMA WRITE into the host's buffer, then SEND of the CQE;
SEND_WITH_INV is not exercised: rxe cannot invalidate an ibv_reg_mr rkey, and binding a type-2
memory window through pyverbs 44 gave IBV_WC_REM_ACCESS_ERR (see docs/RDMA-NOTES.md).
Completions are waited for on each completion channel's file descriptor (select), as an event loop
would. Each process records one "STEP <name> OK ..." line per proven step in a file of its own
(guest_steps.StepLog: $NVMEOF_STEP_DIR/host.steps and controller.steps, on a 9p share the test reads
after the guest exits), never on the shared console, where two writers could tear each other's lines.
Exits non-zero on the first failure.
"""

from __future__ import annotations

import faulthandler
import os
import select
import sys
import threading
import time
import traceback

import pyverbs.cm_enums as ce
import pyverbs.enums as e
from guest_steps import STEP_DIR_ENV, StepLog  # shipped beside this script
from pyverbs.cmid import CMID, AddrInfo, CMEvent, CMEventChannel, ConnParam
from pyverbs.cq import CQ, CompChannel
from pyverbs.device import get_device_list
from pyverbs.mr import MR
from pyverbs.qp import QP, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

from nvmeof import rdma
from nvmeof.spec import rdma as spec
from nvmeof.spec.nvme import Command, Direction, IoOpcode, pack_cqe

ADDR = "10.0.2.15"
PORT = "4420"
SIZE = 4096
TIMEOUT = 20.0
RESULTS: dict[str, str] = {}
READY_FD: list[int] = []
PATTERN = os.urandom(SIZE)  # made before fork: both sides know what the host buffer holds
STEP_LOG: list[StepLog] = []  # this process's log, opened after fork


def step(name: str, detail: str = "") -> None:
    STEP_LOG[0].step(name, detail)


def say(text: str) -> None:
    """A console line for people, in one write() call so the other process cannot split it."""
    os.write(1, f"[{os.getpid()}] {text}\n".encode(errors="replace"))


FD_LOCK = threading.Lock()
CHANNEL_FDS: dict[int, int] = {}  # id(channel object) -> its file descriptor


def fd_targets() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the descriptor listdir itself used
            pass
    return out


def with_new_fd(make, marker: str):
    """Create a channel and find its fd: pyverbs 44 exposes neither ibv_comp_channel.fd nor
    rdma_event_channel.fd, so look for the descriptor that appeared in /proc/self/fd."""
    with FD_LOCK:
        before = fd_targets()
        obj = make()
        new = {f: t for f, t in fd_targets().items() if before.get(f) != t}
    fds = [f for f, t in new.items() if marker in t]
    if len(fds) != 1:
        raise RuntimeError(f"expected one new {marker} fd, found {new}")
    CHANNEL_FDS[id(obj)] = fds[0]
    RESULTS[f"fd-{marker}"] = new[fds[0]]
    return obj


def wait_fd(obj, what: str) -> None:
    readable, _, _ = select.select([CHANNEL_FDS[id(obj)]], [], [], TIMEOUT)
    if not readable:
        raise RuntimeError(f"nothing on the {what} fd within {TIMEOUT} s")


def cm_event(channel: CMEventChannel, expected: int) -> CMEvent:
    # CMEvent() blocks in rdma_get_cm_event: wait on the channel's fd first so a lost peer
    # cannot hang the test (the adapters will do the same from the event loop)
    wait_fd(channel, "CM event channel")
    ev = CMEvent(channel)
    if ev.event_type != expected:
        name = ev.event_str() if hasattr(ev, "event_str") else ev.event_type
        raise RuntimeError(f"CM event {name} ({ev.event_type}), expected {expected}")
    return ev


class Verbs:
    """PD/CQ/completion channel/QP for one side, on the CMID's device context."""

    def __init__(self, cmid: CMID) -> None:
        self.ctx = cmid.context
        self.pd = cmid.pd
        self.channel = with_new_fd(lambda: CompChannel(self.ctx), "infinibandevent")
        self.cq = CQ(self.ctx, 64, None, self.channel, 0)
        self.cq.req_notify()
        cap = QPCap(max_send_wr=32, max_recv_wr=32, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1))

    def to_state(self, cmid: CMID, state: int) -> None:
        attr, mask = cmid.init_qp_attr(state)
        if state == e.IBV_QPS_INIT:
            # the CM grants REMOTE_READ only once it knows the responder resources: the active side
            # moves its QP to INIT before connect(), so the peer's RDMA READs would fail with
            # IBV_WC_REM_INV_REQ_ERR (status 9). Grant it explicitly, as the kernel ULPs' QPs get.
            attr.qp_access_flags = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
                                    | e.IBV_ACCESS_REMOTE_WRITE)
            mask |= e.IBV_QP_ACCESS_FLAGS
        self.qp.modify(attr, mask)

    def wait_wc(self, want: int = 1) -> list:
        got = []
        deadline = time.monotonic() + TIMEOUT
        while len(got) < want:
            n, wcs = self.cq.poll(want - len(got))
            got.extend(wcs[:n] if n > 0 else [])
            if len(got) >= want:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {want} completions (got {len(got)})")
            wait_fd(self.channel, "completion channel")
            self.channel.get_cq_event(self.cq)  # blocks until the CQ is notified
            self.cq.ack_events(1)
            self.cq.req_notify()
        for wc in got:
            if wc.status != e.IBV_WC_SUCCESS:
                raise RuntimeError(f"work completion status {wc.status} opcode {wc.opcode} vendor_err {wc.vendor_err}")
        return got

    def post_recv(self, mr: MR, wr_id: int, length: int | None = None) -> None:
        self.qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(mr.buf, length or mr.length, mr.lkey)]))

    def post(self, opcode: int, mr: MR, length: int, wr_id: int, offset: int = 0, remote=None,
             invalidate: int | None = None) -> None:
        kw = {}
        if invalidate is not None:
            kw["imm_data"] = invalidate  # ibv_send_wr: imm_data and invalidate_rkey share a union
        wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[SGE(mr.buf + offset, length, mr.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED, **kw)
        if remote is not None:
            wr.set_wr_rdma(remote[1], remote[0])
        self.qp.post_send(wr)


def controller() -> None:
    ch = with_new_fd(CMEventChannel, "rdma_cm")
    listen = CMID(creator=ch, port_space=ce.RDMA_PS_TCP)
    listen.bind_addr(AddrInfo(src=ADDR, src_service=PORT, port_space=ce.RDMA_PS_TCP, flags=ce.RAI_PASSIVE))
    listen.listen()
    os.write(READY_FD[0], b"R")
    ev = cm_event(ch, ce.RDMA_CM_EVENT_CONNECT_REQUEST)
    private = ev.private_data
    decision = rdma.accept_connect_request(private, cntlid_valid=lambda c: c == 1)
    if not isinstance(decision, rdma.CmAccept):
        raise RuntimeError(f"controller rejected: {decision}")
    conn = CMID(creator=ev, listen_id=listen)
    ev.ack_cm_event()
    v = Verbs(conn)
    queue = rdma.RdmaControllerQueue(decision.params, incapsule_size=0, max_transfer=1 << 20)
    recv = MR(v.pd, queue.recv_buffer_size, e.IBV_ACCESS_LOCAL_WRITE)
    data = MR(v.pd, SIZE, e.IBV_ACCESS_LOCAL_WRITE)
    resp = MR(v.pd, 16, e.IBV_ACCESS_LOCAL_WRITE)
    v.to_state(conn, e.IBV_QPS_INIT)
    v.post_recv(recv, 1)
    v.to_state(conn, e.IBV_QPS_RTR)
    v.to_state(conn, e.IBV_QPS_RTS)
    conn.accept(conn_param(v.qp.qp_num, decision.private_data))
    cm_event(ch, ce.RDMA_CM_EVENT_ESTABLISHED).ack_cm_event()
    if bytes(private[:32]) != spec.pack_cm_request(1, 32, 31, 1):
        raise RuntimeError(f"controller saw private data {bytes(private).hex()}")
    step("cm-accept", f"request {len(private)} bytes qid={decision.params.qid} "
         f"hsqsize={decision.params.hsqsize} cntlid={decision.params.cntlid}")

    for _ in range(2):
        (wc,) = v.wait_wc(1)
        if wc.opcode != e.IBV_WC_RECV:
            raise RuntimeError(f"controller expected a RECV completion, got opcode {wc.opcode}")
        capsule = recv.read(wc.byte_len, 0)
        cmd = queue.receive_capsule(capsule)
        v.post_recv(recv, 1)
        direction = Direction.H2C if cmd.opcode == IoOpcode.WRITE else Direction.C2H
        plan = queue.plan(cmd.cid, direction, SIZE)
        for a in plan.reads:
            v.post(e.IBV_WR_RDMA_READ, data, a.length, 10, a.local_offset, (a.addr, a.rkey))
        if plan.reads:
            v.wait_wc(len(plan.reads))
            if data.read(SIZE, 0) != PATTERN:
                raise RuntimeError("RDMA READ brought different bytes than the host buffer holds")
            step("rdma-read", f"{SIZE} bytes via keyed SGL {cmd.sgl_id:#04x}, equal to the host's buffer")
            reply = 0
        else:
            data.write(bytes([cmd.cid & 0xFF, 0xA5]) * (SIZE // 2), SIZE, 0)
            reply = SIZE
        actions = queue.complete(cmd.cid, pack_cqe(cmd.cid, 0, sqid=decision.params.qid), reply)
        for a in actions:
            if isinstance(a, rdma.RdmaWrite):
                v.post(e.IBV_WR_RDMA_WRITE, data, a.length, 20, a.local_offset, (a.addr, a.rkey))
            else:
                resp.write(a.cqe, 16, 0)
                op = e.IBV_WR_SEND if a.invalidate_rkey is None else e.IBV_WR_SEND_WITH_INV
                v.post(op, resp, 16, 30, invalidate=a.invalidate_rkey)
        v.wait_wc(len(actions))
    cm_event(ch, ce.RDMA_CM_EVENT_DISCONNECTED).ack_cm_event()
    conn.close()
    listen.close()


def conn_param(qp_num: int, private_data: bytes) -> ConnParam:
    # pyverbs 44: no private_data keyword; set_private_data copies into a buffer of data_len
    # bytes fixed at construction (data_len=0 silently sends nothing)
    p = ConnParam(resources=4, depth=4, qp_num=qp_num, data_len=len(private_data))
    p.set_private_data(private_data)
    return p


def host() -> None:
    ch = with_new_fd(CMEventChannel, "rdma_cm")
    cmid = CMID(creator=ch, port_space=ce.RDMA_PS_TCP)
    cmid.resolve_addr(AddrInfo(src=ADDR, dst=ADDR, dst_service=PORT, port_space=ce.RDMA_PS_TCP), 3000)
    cm_event(ch, ce.RDMA_CM_EVENT_ADDR_RESOLVED).ack_cm_event()
    cmid.resolve_route(3000)
    cm_event(ch, ce.RDMA_CM_EVENT_ROUTE_RESOLVED).ack_cm_event()
    v = Verbs(cmid)
    queue = rdma.RdmaHostQueue(1, 32)
    access = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
              | e.IBV_ACCESS_MW_BIND)
    buf = MR(v.pd, 3 * SIZE, access)
    sqe = MR(v.pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
    rsp = MR(v.pd, 16, e.IBV_ACCESS_LOCAL_WRITE)
    buf.write(PATTERN, SIZE, 0)
    v.to_state(cmid, e.IBV_QPS_INIT)
    v.post_recv(rsp, 2)
    private = queue.connect_private_data(cntlid=1)
    cmid.connect(conn_param(v.qp.qp_num, private))
    ev = cm_event(ch, ce.RDMA_CM_EVENT_CONNECT_RESPONSE)
    crqsize = rdma.parse_accept(ev.private_data)
    ev.ack_cm_event()
    v.to_state(cmid, e.IBV_QPS_RTR)
    v.to_state(cmid, e.IBV_QPS_RTS)
    cmid.establish()
    step("cm-connect", f"crqsize={crqsize} private data sent {private.hex()}")

    def run(cmd: Command, buffer: rdma.RemoteBuffer) -> rdma.HostResponse:
        sqe.write(queue.submit(cmd, buffer=buffer), 64, 0)
        v.post(e.IBV_WR_SEND, sqe, 64, 3)
        got = v.wait_wc(2)  # our SEND and the response RECV, in either order
        (wc,) = [w for w in got if w.opcode == e.IBV_WC_RECV]
        inv = wc.imm_data if wc.wc_flags & e.IBV_WC_WITH_INV else None
        response = queue.receive_response(rsp.read(16, 0), inv)
        v.post_recv(rsp, 2)
        return response

    r = run(Command(IoOpcode.WRITE, nsid=1), rdma.RemoteBuffer(buf.buf, SIZE, buf.rkey))
    if r.completion.status_code != 0:
        raise RuntimeError(f"write completion {r.completion}")

    r = run(Command(IoOpcode.READ, nsid=1), rdma.RemoteBuffer(buf.buf + SIZE, SIZE, buf.rkey))
    got = buf.read(SIZE, SIZE)
    want = bytes([r.completion.cid & 0xFF, 0xA5]) * (SIZE // 2)
    if got != want:
        raise RuntimeError("RDMA WRITE data mismatch in the host buffer")
    step("rdma-write-send", f"{SIZE} bytes then CQE cid={r.completion.cid}")

    cmid.disconnect()
    cmid.close()


def guarded(fn) -> int:
    try:
        fn()
    except Exception:
        say(f"ERROR {fn.__name__}: {traceback.format_exc()}")
        return 1
    return 0


def main() -> int:
    # two processes, not threads: pyverbs holds the GIL inside blocking verbs calls
    faulthandler.dump_traceback_later(TIMEOUT * 3, exit=True)
    say(f"devices {[d.name for d in get_device_list()]}")
    # both files opened before fork: each process then writes only its own
    step_dir = os.environ.get(STEP_DIR_ENV)
    host_log, controller_log = StepLog(step_dir, "host"), StepLog(step_dir, "controller")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        READY_FD.append(ready_w)
        host_log.close()
        STEP_LOG.append(controller_log)
        os._exit(guarded(controller))
    os.close(ready_w)
    controller_log.close()
    STEP_LOG.append(host_log)
    if not select.select([ready_r], [], [], TIMEOUT)[0] or os.read(ready_r, 1) != b"R":
        say("ERROR controller never listened")
        os.kill(pid, 9)
        return 1
    rc = guarded(host)
    deadline = time.monotonic() + TIMEOUT
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            say("ERROR controller did not finish")
            return 1
        time.sleep(0.1)
    child = os.waitstatus_to_exitcode(status)
    say(f"fds {RESULTS.get('fd-rdma_cm')} {RESULTS.get('fd-infinibandevent')} controller exit {child}")
    return rc or child


if __name__ == "__main__":
    sys.exit(main())
