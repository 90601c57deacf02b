"""In-band authentication (DH-HMAC-CHAP) on the target: the per-queue state, the gate, and the
Authentication Send / Receive commands that drive a ``nvmeof.auth.ControllerTransaction``.

Modelled on Linux nvmet (fabrics-cmd-auth.c ``nvmet_execute_auth_send`` / ``_receive``, auth.c
``nvmet_setup_auth``, ``nvmet_check_auth_status``, fabrics-cmd.c ``nvmet_connect_result``):
- a queue whose host has a DH-HMAC-CHAP key (``Subsystem.auth_for``) gets a ``QueueAuth`` at Connect,
  and the Connect response carries AUTHREQ.ATR; every queue, admin and I/O, runs its own transaction;
- until that transaction succeeds the queue takes only Authentication Send/Receive and Disconnect;
  anything else completes with AUTH_REQUIRED (nvmet's NVME_SC_AUTH_REQUIRED | DNR). nvmet also lets
  Property Get/Set through on the admin queue; we do not: nothing before authentication;
- a new AUTH_Negotiate restarts the transaction with the host's settings as they are now, so a
  rotated key applies to the next (re-)authentication while authenticated queues keep running;
- a failed transaction (after its Failure1 went out, a Failure2 from the host, a message out of
  order) or one that stalls past ``Target.auth_timeout`` tears the controller down, as
  nvmet_ctrl_fatal_error does. Each refusal is one warning naming host, subsystem, qid, cntlid, reason.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from nvmeof import defaults
from nvmeof.auth import ControllerTransaction, is_negotiate
from nvmeof.spec.auth import CONNECT_AUTHREQ_ATR, SECP_DHCHAP, SPSP0_DHCHAP, SPSP1_DHCHAP
from nvmeof.spec.fabrics import FABRICS_OPCODE
from nvmeof.spec.nvme import Direction, FabricsType
from nvmeof.status import NvmeError, Status
from target import hostauth
from target.controller import host_label

if TYPE_CHECKING:
    from target.controller import Controller
    from target.model import HostAuth, Subsystem
    from target.ports import ControllerHost
    from target.request import Request, TargetQueue

log = logging.getLogger(__name__)

__all__ = ["CONNECT_AUTHREQ_ATR", "QueueAuth", "cancel", "gate", "parse_receive", "parse_send", "start"]

# What an unauthenticated queue still accepts (nvmet_parse_fabrics_io_cmd / _admin_cmd let the auth
# commands through before nvmet_check_auth_status; Disconnect ends the queue, which is always allowed).
_ALLOWED_FCTYPES = frozenset({FabricsType.AUTH_SEND, FabricsType.AUTH_RECEIVE, FabricsType.DISCONNECT})


class QueueAuth:
    """One queue's authentication: its transaction, whether the queue has passed, the stall timer."""

    __slots__ = ("authenticated", "timer", "txn")

    def __init__(self, txn: ControllerTransaction) -> None:
        self.txn = txn
        self.authenticated = False   # stays True through a re-authentication until one fails
        self.timer: asyncio.TimerHandle | None = None


def _transaction(sub: Subsystem, hostnqn: str, entry: HostAuth, qid: int) -> ControllerTransaction:
    hashes, dhgroups = hostauth.effective(sub, entry)
    return ControllerTransaction(subnqn=sub.nqn, hostnqn=hostnqn, qid=qid, host_secret=entry.dhchap_key,
                                 ctrl_secret=entry.dhchap_ctrl_key, hashes=hashes, dhgroups=dhgroups, seqnum=0)


def start(target: ControllerHost, queue: TargetQueue, sub: Subsystem, hostnqn: str) -> int:
    """After a successful Connect: the AUTHREQ bits for DW0 of its response (0 when the host has no key);
    with a key the queue is gated from now on and its transaction timer runs."""
    entry = sub.auth_for(hostnqn)
    if entry is None:
        queue.auth = None
        return 0
    state = QueueAuth(_transaction(sub, hostnqn, entry, queue.qid))
    queue.auth = state
    _arm(target, queue, state)
    return CONNECT_AUTHREQ_ATR


def gate(queue: TargetQueue, opcode: int, fctype: int) -> None:
    """nvmet_check_auth_status: refuse a command on a queue that has not authenticated yet."""
    if opcode == FABRICS_OPCODE and fctype in _ALLOWED_FCTYPES:
        return
    ctrl = queue.ctrl
    assert ctrl is not None
    what = f"fabrics command type {fctype:#04x}" if opcode == FABRICS_OPCODE else f"opcode {opcode:#04x}"
    raise NvmeError(Status.AUTH_REQUIRED,
                    f"{what} on qid {queue.qid} of controller {ctrl.cntlid} before the queue authenticated; "
                    "the host must complete DH-HMAC-CHAP (Authentication Send/Receive) first")


def cancel(queue: TargetQueue) -> None:
    """The queue is going away: stop its timer."""
    state = queue.auth
    if state is not None and state.timer is not None:
        state.timer.cancel()
        state.timer = None


# --- the commands ---------------------------------------------------------------------------------

def _check_sqe(req: Request, length_name: str) -> int:
    """nvmet_execute_auth_send/receive: SECP, SPSP0, SPSP1 must select DH-HMAC-CHAP, the length must not
    be 0 (INVALID_FIELD | DNR otherwise). Returns TL (Send) or AL (Receive)."""
    cdw10 = req.cmd.cdw10
    spsp0, spsp1, secp = (cdw10 >> 8) & 0xFF, (cdw10 >> 16) & 0xFF, (cdw10 >> 24) & 0xFF
    if secp != SECP_DHCHAP:
        raise NvmeError(Status.INVALID_FIELD, f"SECP {secp:#04x}; DH-HMAC-CHAP is {SECP_DHCHAP:#04x}")
    if spsp0 != SPSP0_DHCHAP or spsp1 != SPSP1_DHCHAP:
        raise NvmeError(Status.INVALID_FIELD,
                        f"SPSP0/SPSP1 {spsp0:#04x}/{spsp1:#04x}; DH-HMAC-CHAP uses "
                        f"{SPSP0_DHCHAP:#04x}/{SPSP1_DHCHAP:#04x}")
    length = req.cmd.cdw11
    if length == 0:
        raise NvmeError(Status.INVALID_FIELD, f"{length_name} 0; an authentication message is never empty")
    if length > defaults.AUTH_MAX_TRANSFER:
        raise NvmeError(Status.INVALID_FIELD, f"{length_name} {length}; DH-HMAC-CHAP messages are at most "
                        f"{defaults.AUTH_MAX_TRANSFER} bytes here")
    return length


def _state_for(target: ControllerHost, queue: TargetQueue) -> QueueAuth:
    """The queue's QueueAuth; a queue that connected without a key gets one now if its host has a key
    since (it is authenticated already: it was admitted without one)."""
    state = queue.auth
    if state is not None:
        return state
    ctrl = queue.ctrl
    assert ctrl is not None
    entry = ctrl.subsystem.auth_for(ctrl.hostnqn)
    if entry is None:
        raise NvmeError(Status.CMD_SEQ_ERROR,
                        f"Authentication on qid {queue.qid} of controller {ctrl.cntlid}: host "
                        f"{host_label(ctrl.hostnqn)} has no DH-HMAC-CHAP key on subsystem {ctrl.subsystem.nqn}; "
                        "set one (nvmeof host set-key) to authenticate it")
    state = QueueAuth(_transaction(ctrl.subsystem, ctrl.hostnqn, entry, queue.qid))
    state.authenticated = True
    queue.auth = state
    return state


def parse_send(target: ControllerHost, req: Request) -> None:
    tl = _check_sqe(req, "TL")
    state = _state_for(target, req.queue)

    async def execute(r: Request) -> None:
        queue = r.queue
        ctrl = queue.ctrl
        assert ctrl is not None and r.data is not None
        data = bytes(r.data)
        txn = state.txn
        if is_negotiate(data) and not txn.teardown:
            # A (re-)authentication starts: with the host's settings as they are now (a rotated key applies)
            entry = ctrl.subsystem.auth_for(ctrl.hostnqn)
            if entry is not None:
                txn = state.txn = _transaction(ctrl.subsystem, ctrl.hostnqn, entry, queue.qid)
        txn.send(data)
        _after(target, queue, ctrl, state)

    req.expect(Direction.H2C, tl, execute)


def parse_receive(target: ControllerHost, req: Request) -> None:
    al = _check_sqe(req, "AL")
    state = _state_for(target, req.queue)

    async def execute(r: Request) -> None:
        queue = r.queue
        ctrl = queue.ctrl
        assert ctrl is not None
        r.reply = state.txn.receive(al)
        _after(target, queue, ctrl, state)

    req.expect(Direction.C2H, al, execute)


def _after(target: ControllerHost, queue: TargetQueue, ctrl: Controller, state: QueueAuth) -> None:
    """After a step: a finished transaction opens the queue; a failed one tears the controller down once
    this command's response has gone out; anything else re-arms the stall timer."""
    txn = state.txn
    if txn.teardown:
        cancel(queue)
        reason = txn.failure.message if txn.failure is not None else "the transaction failed"
        _refuse(queue, ctrl, reason)
        asyncio.get_running_loop().call_soon(_tear_down, target, ctrl, queue, reason)
        return
    if txn.state == "done" and txn.authenticated:
        cancel(queue)
        if not state.authenticated:
            log.info("host %s authenticated qid %d of controller %d (subsystem %s; %s, %s%s)", host_label(ctrl.hostnqn),
                     queue.qid, ctrl.cntlid, ctrl.subsystem.nqn, _hash(txn.hash_id), _group(txn.dhgroup_id),
                     ", bidirectional" if getattr(txn, "bidirectional", False) else "")
        state.authenticated = True
        return
    _arm(target, queue, state)


def _hash(hash_id: int | None) -> str:
    return hostauth.HASH_NAMES.get(hash_id or 0, "no hash")


def _group(dhgroup_id: int | None) -> str:
    return hostauth.DHGROUP_NAMES.get(dhgroup_id if dhgroup_id is not None else -1, "no DH group")


def _refuse(queue: TargetQueue, ctrl: Controller, reason: str) -> None:
    log.warning("authentication refused: host %s, subsystem %s, qid %d, cntlid %d: %s; tearing the controller down",
                host_label(ctrl.hostnqn), ctrl.subsystem.nqn, queue.qid, ctrl.cntlid, reason,
                extra={"event": "refused", "host": ctrl.hostnqn, "subnqn": ctrl.subsystem.nqn, "qid": queue.qid,
                       "cntlid": ctrl.cntlid, "peer": queue.peer, "reason": reason})


def _tear_down(target: ControllerHost, ctrl: Controller, queue: TargetQueue, reason: str) -> None:
    # nvmet_ctrl_fatal_error: the whole controller goes, every queue with it (the host reconnects)
    if not ctrl.closed:
        target.remove_controller(ctrl, f"authentication failed on qid {queue.qid}: {reason}")


def _arm(target: ControllerHost, queue: TargetQueue, state: QueueAuth) -> None:
    if state.timer is not None:
        state.timer.cancel()
    timeout = target.auth_timeout
    if timeout <= 0:
        state.timer = None
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    state.timer = loop.call_later(timeout, _expired, target, queue, state, timeout)


def _expired(target: ControllerHost, queue: TargetQueue, state: QueueAuth, timeout: float) -> None:
    """The host stopped half-way: nvmet_auth_expired_work resets the step; we end the controller, so a
    host that never finishes does not keep a queue (and a controller ID) forever."""
    state.timer = None
    ctrl = queue.ctrl
    if ctrl is None or ctrl.closed or queue.auth is not state:
        return
    txn = state.txn
    if txn.state == "done" and txn.authenticated:
        return
    waiting = txn.expected_next
    txn.expire()
    reason = f"the transaction stalled: no progress for {timeout:g} s while waiting for {waiting}"
    _refuse(queue, ctrl, reason)
    _tear_down(target, ctrl, queue, reason)
