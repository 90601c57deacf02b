"""Fabrics command set: Connect, Property Get/Set, Disconnect.

Modelled on Linux nvmet fabrics-cmd.c (``nvmet_execute_admin_connect``, ``nvmet_execute_io_connect``,
``nvmet_install_queue``, ``nvmet_execute_prop_get/set``) and core.c ``nvmet_alloc_ctrl`` /
``nvmet_ctrl_find_get``. Every refused Connect is logged with what the user has to change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from construct import ConstructError

from nvmeof import defaults
from nvmeof.spec.fabrics import (
    CATTR_DISABLE_SQFLOW,
    CONNECT_ADMIN_CNTLID,
    CONNECT_DATA_SIZE,
    CONNECT_IATTR_DATA,
    CONNECT_IATTR_SQE,
    PROPERTY_SIZE_8,
    ConnectCommand,
    ConnectData,
    ConnectDataCompiled,
    Property,
    connect_invalid_param_result,
)
from nvmeof.spec.fields import field_offset
from nvmeof.spec.nvme import Direction, FabricsType
from nvmeof.status import NvmeError, Status
from target import auth
from target.controller import host_label
from target.tls import check_connect as check_tls_connect

if TYPE_CHECKING:
    from target.controller import Controller
    from target.model import Subsystem
    from target.ports import ControllerRegistry
    from target.request import Execute, Request, TargetQueue

log = logging.getLogger(__name__)

# IPO values: byte offsets of the offending field in the SQE (IATTR 0) or the Connect data (IATTR 1)
IPO_SQE_QID = field_offset(ConnectCommand, "qid")            # 42
IPO_SQE_SQSIZE = field_offset(ConnectCommand, "sqsize")      # 44
IPO_DATA_HOSTID = field_offset(ConnectData, "hostid")        # 0
IPO_DATA_CNTLID = field_offset(ConnectData, "cntlid")        # 16
IPO_DATA_SUBSYSNQN = field_offset(ConnectData, "subsysnqn")  # 256
IPO_DATA_HOSTNQN = field_offset(ConnectData, "hostnqn")      # 512


def _invalid_param(iattr: int, ipo: int, detail: str) -> NvmeError:
    return NvmeError(Status.CONNECT_INVALID_PARAM, detail, result=connect_invalid_param_result(iattr, ipo))


def _rejected(err: NvmeError, req: Request) -> NvmeError:
    fields = {"event": "refused", "peer": req.queue.peer, "qid": req.cmd.cdw10 >> 16, "reason": err.detail,
              "status": err.name, **_connect_names(req)}
    log.warning("Connect from %s refused with %s: %s", req.queue.peer or "a local peer", err.name, err.detail,
                extra=fields)
    return err.mark_logged()  # core.Target.fail need not log it again


def _connect_names(req: Request) -> dict[str, str]:
    """The host and subsystem NQNs of a refused Connect, for the log line's fields (when readable)."""
    try:
        data = ConnectDataCompiled.parse(bytes(req.data or b""))
        return {"host": _nqn(data.hostnqn), "subnqn": _nqn(data.subsysnqn)}
    except (ConstructError, UnicodeDecodeError, ValueError):
        return {}


# --- Connect -------------------------------------------------------------------------------------

def parse_connect(target: ControllerRegistry, req: Request) -> None:
    async def execute(r: Request) -> None:
        try:
            _execute_connect(target, r)
        except NvmeError as err:
            raise _rejected(err, r) from None
    req.expect(Direction.H2C, CONNECT_DATA_SIZE, execute)


def _nqn(raw: str) -> str:
    # PaddedString strips trailing NULs only; anything after the first NUL is not part of the NQN
    return raw.split("\x00", 1)[0]


def _execute_connect(target: ControllerRegistry, req: Request) -> None:
    cmd = req.cmd
    recfmt = cmd.cdw10 & 0xFFFF
    qid = cmd.cdw10 >> 16
    sqsize = cmd.cdw11 & 0xFFFF
    cattr = (cmd.cdw11 >> 16) & 0xFF
    kato = cmd.cdw12
    if recfmt != 0:
        raise NvmeError(Status.CONNECT_FORMAT, f"Connect record format {recfmt}; only format 0 exists")
    if req.data is None or len(req.data) != CONNECT_DATA_SIZE:
        raise NvmeError(Status.SGL_INVALID_DATA, f"Connect needs {CONNECT_DATA_SIZE} bytes of data")
    raw = bytes(req.data)
    try:
        data = ConnectDataCompiled.parse(raw)
        subnqn = _nqn(data.subsysnqn)
    except (ConstructError, UnicodeDecodeError):
        raise _invalid_param(CONNECT_IATTR_DATA, IPO_DATA_SUBSYSNQN, "SUBNQN is not valid UTF-8") from None
    try:
        hostnqn = _nqn(data.hostnqn)
    except (ConstructError, UnicodeDecodeError):
        raise _invalid_param(CONNECT_IATTR_DATA, IPO_DATA_HOSTNQN, "HOSTNQN is not valid UTF-8") from None
    # An all-zero HOSTNQN is not refused here: Linux nvmet admits it wherever any host may connect
    # (nvmet_host_allowed), and the allow-list check below refuses it everywhere else.
    host = host_label(hostnqn)
    queue = req.queue
    if queue.ctrl is not None:
        raise NvmeError(Status.CONNECT_CTRL_BUSY, f"qid {queue.qid} is already connected")
    if sqsize == 0:
        raise _invalid_param(CONNECT_IATTR_SQE, IPO_SQE_SQSIZE,
                             f"host {host}: SQSIZE 0 (a queue needs at least 2 entries)")
    if sqsize > defaults.MAX_QUEUE_SIZE - 1:
        raise _invalid_param(CONNECT_IATTR_SQE, IPO_SQE_SQSIZE,
                             f"host {host}: SQSIZE {sqsize} exceeds CAP.MQES {defaults.MAX_QUEUE_SIZE - 1}; "
                             f"use a queue size of at most {defaults.MAX_QUEUE_SIZE}")
    refused = check_tls_connect(queue.tls, hostnqn, subnqn)
    if refused is not None:
        raise NvmeError(Status.CONNECT_INVALID_HOST, f"host {host}: {refused}",
                        result=connect_invalid_param_result(CONNECT_IATTR_DATA, IPO_DATA_HOSTNQN))
    subsystem = target.find_subsystem(subnqn)
    if qid == 0:
        cntlid = data.cntlid
        if cntlid != CONNECT_ADMIN_CNTLID:
            raise _invalid_param(CONNECT_IATTR_DATA, IPO_DATA_CNTLID,
                                 f"host {host}: admin Connect asks for controller ID {cntlid:#x}; this target "
                                 f"only creates controllers dynamically (CNTLID {CONNECT_ADMIN_CNTLID:#x})")
        if subsystem is None:
            raise _invalid_param(CONNECT_IATTR_DATA, IPO_DATA_SUBSYSNQN,
                                 f"host {host} asked for subsystem {subnqn!r}, which does not exist here; "
                                 "check the NQN with 'nvme discover'")
        if not subsystem.host_allowed(hostnqn):
            raise NvmeError(Status.CONNECT_INVALID_HOST, _not_allowed(hostnqn, subnqn),
                            result=connect_invalid_param_result(CONNECT_IATTR_DATA, IPO_DATA_HOSTNQN))
        ctrl = target.create_controller(subsystem, hostnqn, data.hostid, kato)
        ctrl.attach_listener(queue.listener)
        log.info("controller %d created for subsystem %s, host %s (%s, KATO %d ms)", ctrl.cntlid,
                 subsystem.nqn, host, queue.peer, ctrl.kato_ms,
                 extra={"event": "connect", "host": hostnqn, "subnqn": subsystem.nqn, "qid": 0,
                        "cntlid": ctrl.cntlid, "peer": queue.peer, "kato": ctrl.kato_ms})
    else:
        if subsystem is None:
            raise _invalid_param(CONNECT_IATTR_DATA, IPO_DATA_SUBSYSNQN,
                                 f"host {host}: I/O queue Connect for unknown subsystem {subnqn!r}")
        ctrl = _io_queue_controller(target, subsystem, data.cntlid, hostnqn, bytes(data.hostid), qid)
        if not ctrl.enabled:
            raise NvmeError(Status.CMD_SEQ_ERROR,
                            f"host {host}: I/O queue {qid} Connect before controller {ctrl.cntlid} was enabled")
        if ctrl.is_discovery:
            raise _invalid_param(CONNECT_IATTR_SQE, IPO_SQE_QID,
                                 f"host {host}: discovery controllers have no I/O queues (qid {qid})")
        if qid > ctrl.nr_io_queues:
            raise _invalid_param(CONNECT_IATTR_SQE, IPO_SQE_QID,
                                 f"host {host}: qid {qid} exceeds the {ctrl.nr_io_queues} I/O queues granted to "
                                 f"controller {ctrl.cntlid}")
        if qid in ctrl.queues:
            raise _invalid_param(CONNECT_IATTR_SQE, IPO_SQE_QID,
                                 f"host {host}: qid {qid} of controller {ctrl.cntlid} is already connected")
    queue.qid = qid
    queue.sqsize = sqsize
    queue.sqhd = 0
    queue.sqflow_disabled = bool(cattr & CATTR_DISABLE_SQFLOW)
    queue.connected_at = time.time()
    queue.ctrl = ctrl
    ctrl.queues[qid] = queue
    # nvmet_connect_result: CNTLID, plus AUTHREQ.ATR when this host must authenticate the queue
    req.dw0 = ctrl.cntlid | auth.start(target, queue, ctrl.subsystem, hostnqn)


def _not_allowed(hostnqn: str, subnqn: str) -> str:
    if not hostnqn:
        return (f"the Connect data carries an empty HOSTNQN and subsystem {subnqn} admits only the hosts in its "
                "list; configure a host NQN on the host (nvme-cli: --hostnqn or /etc/nvme/hostnqn) and add it to "
                "the subsystem's hosts, or allow any host")
    return f"host {hostnqn} is not allowed to use subsystem {subnqn}; add it to the subsystem's hosts or allow any host"


def _io_queue_controller(target: ControllerRegistry, subsystem: Subsystem, cntlid: int, hostnqn: str, hostid: bytes,
                         qid: int) -> Controller:
    """The controller an I/O queue Connect joins: it must be live, on this subsystem, and created by
    the same host, which the spec identifies by both HOSTNQN and HOSTID. Linux nvmet_ctrl_find_get
    compares the host NQN and answers a mismatch as an unknown CNTLID; FreeBSD nvmft_handoff_io_queue
    also compares the 16-byte Host Identifier and answers INVALID_PARAM with IPO at the HOSTID field."""
    host = host_label(hostnqn)
    ctrl = target.controllers.get(cntlid)
    if ctrl is None or ctrl.closed or ctrl.subsystem is not subsystem:
        raise _invalid_param(CONNECT_IATTR_DATA, IPO_DATA_CNTLID,
                             f"host {host}: I/O queue {qid} Connect names controller {cntlid}, which is not a "
                             f"live controller of subsystem {subsystem.nqn}")
    if ctrl.hostnqn != hostnqn:
        raise _invalid_param(CONNECT_IATTR_DATA, IPO_DATA_CNTLID,
                             f"host {host}: I/O queue {qid} Connect names controller {cntlid}, which host "
                             f"{host_label(ctrl.hostnqn)} created (the HOSTNQN differs from its admin queue's "
                             "Connect)")
    if ctrl.hostid != hostid:
        raise _invalid_param(CONNECT_IATTR_DATA, IPO_DATA_HOSTID,
                             f"host {host}: I/O queue {qid} Connect for controller {cntlid} carries HOSTID "
                             f"{hostid.hex()}, but its admin queue connected with HOSTID {ctrl.hostid.hex()}")
    return ctrl


# --- Property Get / Set, Disconnect --------------------------------------------------------------

def parse(target: ControllerRegistry, req: Request) -> None:
    cmd = req.cmd
    fctype = cmd.fctype
    qid = req.queue.qid
    if fctype == FabricsType.PROPERTY_GET and qid == 0:
        req.expect(Direction.NONE, 0, _property_get)
    elif fctype == FabricsType.PROPERTY_SET and qid == 0:
        req.expect(Direction.NONE, 0, _property_set)
    elif fctype == FabricsType.DISCONNECT:
        req.expect(Direction.NONE, 0, _make_disconnect(target))
    elif fctype == FabricsType.AUTH_SEND:
        auth.parse_send(target, req)
    elif fctype == FabricsType.AUTH_RECEIVE:
        auth.parse_receive(target, req)
    elif fctype == FabricsType.CONNECT:
        raise NvmeError(Status.CONNECT_CTRL_BUSY, f"qid {qid} is already connected; Connect comes once per queue")
    else:
        raise NvmeError(Status.INVALID_OPCODE, f"fabrics command type {fctype:#04x} is not supported on qid {qid}")


async def _property_get(req: Request) -> None:
    ctrl = req.queue.ctrl
    assert ctrl is not None
    attrib = req.cmd.cdw10 & 0xFF
    offset = req.cmd.cdw11
    if attrib & PROPERTY_SIZE_8:
        if offset != Property.CAP:
            raise NvmeError(Status.INVALID_FIELD, f"8-byte Property Get of offset {offset:#x}; only CAP is 8 bytes")
        value = ctrl.cap
    elif offset == Property.VS:
        value = ctrl.vs
    elif offset == Property.CC:
        value = ctrl.cc
    elif offset == Property.CSTS:
        value = ctrl.csts
    else:
        raise NvmeError(Status.INVALID_FIELD, f"4-byte Property Get of unsupported offset {offset:#x}")
    req.dw0 = value & 0xFFFFFFFF
    req.dw1 = value >> 32


async def _property_set(req: Request) -> None:
    ctrl = req.queue.ctrl
    assert ctrl is not None
    attrib = req.cmd.cdw10 & 0xFF
    offset = req.cmd.cdw11
    value = req.cmd.cdw12 | (req.cmd.cdw13 << 32)
    if attrib & PROPERTY_SIZE_8 or offset != Property.CC:
        raise NvmeError(Status.INVALID_FIELD,
                        f"Property Set of offset {offset:#x} ({8 if attrib & 1 else 4} bytes); only CC is writable")
    ctrl.set_cc(value)


def _make_disconnect(target: ControllerRegistry) -> Execute:
    async def execute(req: Request) -> None:
        queue = req.queue
        ctrl = queue.ctrl
        assert ctrl is not None
        # Close only after the transport has sent this command's completion.
        loop = asyncio.get_running_loop()
        if queue.qid == 0:  # the controller's teardown line is this disconnect's one log line
            loop.call_soon(target.remove_controller, ctrl, "host disconnects qid 0 (Disconnect on the admin queue)")
        else:
            log.info("host %s disconnects qid %d of controller %d", host_label(ctrl.hostnqn), queue.qid,
                     ctrl.cntlid, extra={"event": "disconnect", "host": ctrl.hostnqn, "subnqn": ctrl.subsystem.nqn,
                                         "qid": queue.qid, "cntlid": ctrl.cntlid, "peer": queue.peer,
                                         "reason": "Disconnect command"})
            loop.call_soon(_close_queue, target, queue)
    return execute


def _close_queue(target: ControllerRegistry, queue: TargetQueue) -> None:
    target.queue_closed(queue)
    queue.close()
