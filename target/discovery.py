"""Discovery controller command set: Identify Controller, the Discovery log page (70h), KATO/AEC features,
Keep Alive and AER, as Linux nvmet discovery.c allows (``nvmet_parse_discovery_cmd``).

The log lists, for the connected host, every NVM subsystem it may use on every I/O listener, the
discovery subsystem on the listener it came through (subtype "current"), and the referrals.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from nvmeof import defaults
from nvmeof.spec.fabrics import (
    CONNECT_ADMIN_CNTLID,
    DISCOVERY_LOG_ENTRY_SIZE,
    DISCOVERY_LOG_HEADER_SIZE,
    EFLAGS_EPCSD,
    TCP_SECTYPE_TLS13,
    TREQ_DISABLE_SQFLOW,
    TREQ_NOT_REQUIRED,
    TREQ_NOT_SPECIFIED,
    TREQ_REQUIRED,
    AdrFam,
    DiscoveryLogEntryCompiled,
    DiscoveryLogHeader,
    SubType,
    TrType,
)
from nvmeof.spec.identify import IDENTIFY_DATA_SIZE
from nvmeof.spec.nvme import AdminOpcode, Cns, Direction, LogPageId
from nvmeof.status import NvmeError, Status
from target import admin
from target.controller import AEN_BIT_DISC_CHANGE

if TYPE_CHECKING:
    from target.controller import Controller
    from target.model import Listener, Referral
    from target.request import Request

_TRTYPE = {"tcp": TrType.TCP, "rdma": TrType.RDMA}
_ADRFAM = {"ipv4": AdrFam.IPV4, "ipv6": AdrFam.IPV6}
_TSAS_NONE = bytes(256)   # TCP: SECTYPE none; RDMA fields filled below


def parse(req: Request) -> None:
    op = req.cmd.opcode
    if op == AdminOpcode.IDENTIFY:
        req.expect(Direction.C2H, IDENTIFY_DATA_SIZE, _identify)
    elif op == AdminOpcode.GET_LOG_PAGE:
        admin.parse_get_log_page(req, _get_log_page)
    elif op == AdminOpcode.SET_FEATURES:
        req.expect(Direction.NONE, 0, admin.set_features)
    elif op == AdminOpcode.GET_FEATURES:
        admin.parse_get_features(req)
    elif op == AdminOpcode.KEEP_ALIVE:
        req.expect(Direction.NONE, 0, admin.keep_alive)
    elif op == AdminOpcode.ASYNC_EVENT_REQUEST:
        req.expect(Direction.NONE, 0, admin.async_event_request)
    else:
        raise NvmeError(Status.INVALID_OPCODE, f"opcode {op:#04x} is not supported by a discovery controller")


async def _identify(req: Request) -> None:
    cns = req.cmd.cdw10 & 0xFF
    if cns != Cns.CONTROLLER:
        raise NvmeError(Status.INVALID_FIELD, f"a discovery controller answers Identify CNS 01h only, not {cns:#04x}")
    ctrl = req.queue.ctrl
    assert ctrl is not None
    req.reply = admin.identify_controller(ctrl, req.queue.ops)


async def _get_log_page(req: Request) -> None:
    ctrl = req.queue.ctrl
    assert ctrl is not None
    lid, rae, offset = admin.log_page_args(req)
    if lid != LogPageId.DISCOVERY:
        raise NvmeError(Status.INVALID_LOG_PAGE, f"a discovery controller has log page 70h only, not {lid:#04x}")
    page = discovery_log_page(ctrl, req.queue.listener, req.queue.local_addr)
    if not rae:
        ctrl.clear_aen_mask(AEN_BIT_DISC_CHANGE)
    admin.reply_log(req, page, lid, offset)


def _wildcard(traddr: str) -> bool:
    try:
        return ipaddress.ip_address(traddr).is_unspecified
    except ValueError:
        return False


def _treq_tsas(trtype: str, tls: str) -> tuple[int, bytes]:
    """TREQ's secure channel bits and the TCP TSAS SECTYPE, as nvmet sets them for a port's addr_tsas /
    addr_treq (nvmet_addr_tsas_store: TLS 1.3 makes TREQ "required" unless the port says "not required")."""
    if trtype != "tcp" or tls == "none":
        return TREQ_NOT_SPECIFIED, _TSAS_NONE
    treq = TREQ_REQUIRED if tls == "required" else TREQ_NOT_REQUIRED
    return treq, bytes([TCP_SECTYPE_TLS13]) + bytes(255)


def _entry(subtype: int, nqn: str, trtype: str, adrfam: str, traddr: str, trsvcid: int, portid: int,
           eflags: int = 0, tls: str = "none") -> bytes:
    treq, tsas = _treq_tsas(trtype, tls)
    if trtype == "rdma":
        # QPTYPE connected, PRTYPE not specified, CMS RDMA-CM (nvmet's defaults)
        tsas = bytes([1, 1, 1]) + bytes(253)
    return DiscoveryLogEntryCompiled.build({
        "trtype": _TRTYPE.get(trtype, 0),
        "adrfam": _ADRFAM.get(adrfam, 0),
        "subtype": subtype,
        "treq": treq | (TREQ_DISABLE_SQFLOW if trtype == "tcp" else 0),
        "portid": portid,
        "cntlid": CONNECT_ADMIN_CNTLID,
        "asqsz": defaults.ADMIN_QUEUE_SIZE,
        "eflags": eflags,
        "trsvcid": str(trsvcid),
        "subnqn": nqn,
        "traddr": traddr,
        "tsas": tsas,
    })


def discovery_log_page(ctrl: Controller, via: Listener | None, local_addr: str = "") -> bytes:
    """The whole log for this host: header (1024 B) and one 1024-byte entry per record."""
    target = ctrl.target
    entries: list[bytes] = []

    def addr(listener: Listener) -> str:
        return local_addr if local_addr and _wildcard(listener.traddr) else listener.traddr

    port = target.listening_port   # a listener configured with port 0 reports the port it was bound to
    io_listeners = [lst for lst in target.listeners.values() if not lst.discovery]
    # A gateway group member lists every live member's I/O listeners too (target/gateway/group.py sets
    # them), so a host discovering one gateway finds every path of the subsystem.
    io_listeners += target.peer_listeners
    for sub in target.subsystems.values():
        if sub.subtype != "nvm" or not sub.host_allowed(ctrl.hostnqn):
            continue
        for lst in io_listeners:
            entries.append(_entry(SubType.NVME, sub.nqn, lst.trtype, lst.adrfam, addr(lst), port(lst), lst.portid,
                                  tls=lst.tls))
    if via is not None:
        entries.append(_entry(SubType.CURRENT, defaults.DISCOVERY_NQN, via.trtype, via.adrfam, addr(via),
                              port(via), via.portid, EFLAGS_EPCSD, tls=via.tls))
    ref: Referral
    for ref in target.referrals:
        entries.append(_entry(SubType.REFERRAL, ref.subnqn, ref.trtype, ref.adrfam, ref.traddr, ref.trsvcid,
                              ref.portid))
    header = DiscoveryLogHeader.build({"genctr": target.genctr, "numrec": len(entries), "recfmt": 0})
    assert len(header) == DISCOVERY_LOG_HEADER_SIZE
    assert all(len(e) == DISCOVERY_LOG_ENTRY_SIZE for e in entries)
    return header + b"".join(entries)
