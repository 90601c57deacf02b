"""Admin command set of an I/O controller: Identify, Get Log Page, Set/Get Features, Keep Alive, AER, Abort.

Modelled on Linux nvmet admin-cmd.c. Identify fields advertise exactly what this target implements.
discovery.py reuses the Identify Controller builder, the log-page arguments and the features.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import time
from typing import TYPE_CHECKING

from nvmeof import defaults
from nvmeof.spec import identify as idf
from nvmeof.spec.identify import IDENTIFY_DATA_SIZE, IdentifyController, IdentifyNamespace
from nvmeof.spec.logs import (
    ANA_LOG_RGO,
    CHANGED_NS_LIST_OVERFLOW,
    CHANGED_NS_MAX,
    EFFECTS_CSUPP,
    EFFECTS_LBCC,
    AnaState,
    ErrorLogEntry,
    FirmwareSlotLog,
    SmartLog,
    ana_log_size,
    build_ana_log,
    build_changed_ns_list,
    build_effects_log,
    log_slice,
)
from nvmeof.spec.nvme import NSID_ALL, AdminOpcode, Cns, Direction, FeatureId, IoOpcode, LogPageId
from nvmeof.spec.reservations import (
    MASK_ALL,
    PTPL_FEATURE_BIT,
    RESCAP_ALL,
    RESCAP_PTPL,
    ReservationNotificationLog,
)
from nvmeof.status import NvmeError, Status
from target import pr
from target.controller import (
    AEC_SMART_MASK,
    AEN_BIT_ANA_CHANGE,
    AEN_BIT_NS_ATTR,
    ASYNC_EVENT_LIMIT,
    ERROR_LOG_ENTRIES,
    SMART_TEMPERATURE_K,
    Controller,
)
from target.reservations import Outcome

if TYPE_CHECKING:
    from target.model import Namespace
    from target.request import Execute, Request
    from target.transport_ops import TransportOps

WCTEMP_K = 343   # 70 C
CCTEMP_K = 358   # 85 C
HOST_ID_SIZE = 16
VWC_FLUSH_BROADCAST = 0x3 << 1
ANACAP = (idf.ANACAP_OPTIMIZED | idf.ANACAP_NON_OPTIMIZED | idf.ANACAP_INACCESSIBLE | idf.ANACAP_PERSISTENT_LOSS
          | idf.ANACAP_CHANGE)
# the most NSIDs an ANA log may list so that its worst case (every group, every NSID) fits MDTS
ANA_MNAN_MAX = (defaults.MAX_TRANSFER - ana_log_size(defaults.ANAGRPMAX, 0)) // 4
ADMIN_OPCODES = (AdminOpcode.GET_LOG_PAGE, AdminOpcode.IDENTIFY, AdminOpcode.ABORT, AdminOpcode.SET_FEATURES,
                 AdminOpcode.GET_FEATURES, AdminOpcode.ASYNC_EVENT_REQUEST, AdminOpcode.KEEP_ALIVE)
IO_EFFECTS = {IoOpcode.FLUSH: EFFECTS_CSUPP, IoOpcode.WRITE: EFFECTS_CSUPP | EFFECTS_LBCC,
              IoOpcode.READ: EFFECTS_CSUPP, IoOpcode.COMPARE: EFFECTS_CSUPP,
              IoOpcode.WRITE_ZEROES: EFFECTS_CSUPP | EFFECTS_LBCC,
              IoOpcode.DATASET_MANAGEMENT: EFFECTS_CSUPP | EFFECTS_LBCC,
              IoOpcode.RESV_REGISTER: EFFECTS_CSUPP, IoOpcode.RESV_REPORT: EFFECTS_CSUPP,
              IoOpcode.RESV_ACQUIRE: EFFECTS_CSUPP, IoOpcode.RESV_RELEASE: EFFECTS_CSUPP}
_EFFECTS_LOG = build_effects_log({op: EFFECTS_CSUPP for op in ADMIN_OPCODES}, IO_EFFECTS)


def _ctrl(req: Request) -> Controller:
    ctrl = req.queue.ctrl
    assert ctrl is not None
    return ctrl


def parse(req: Request) -> None:
    op = req.cmd.opcode
    if op == AdminOpcode.IDENTIFY:
        req.expect(Direction.C2H, IDENTIFY_DATA_SIZE, _identify)
    elif op == AdminOpcode.GET_LOG_PAGE:
        parse_get_log_page(req, _get_log_page)
    elif op == AdminOpcode.SET_FEATURES:
        req.expect(Direction.NONE, 0, set_features)
    elif op == AdminOpcode.GET_FEATURES:
        parse_get_features(req)
    elif op == AdminOpcode.KEEP_ALIVE:
        req.expect(Direction.NONE, 0, keep_alive)
    elif op == AdminOpcode.ASYNC_EVENT_REQUEST:
        req.expect(Direction.NONE, 0, async_event_request)
    elif op == AdminOpcode.ABORT:
        req.expect(Direction.NONE, 0, _abort)
    elif op in (AdminOpcode.CREATE_SQ, AdminOpcode.CREATE_CQ, AdminOpcode.DELETE_SQ, AdminOpcode.DELETE_CQ):
        raise NvmeError(Status.INVALID_OPCODE,
                        f"admin opcode {op:#04x} (queue create/delete) does not exist on fabrics; "
                        "I/O queues are made by Connect")
    else:
        raise NvmeError(Status.INVALID_OPCODE, f"admin opcode {op:#04x} is not supported")


# --- Identify ------------------------------------------------------------------------------------

async def _identify(req: Request) -> None:
    cns = req.cmd.cdw10 & 0xFF
    ctrl = _ctrl(req)
    if cns == Cns.CONTROLLER:
        req.reply = identify_controller(ctrl, req.queue.ops, req.queue.io_incapsule)
    elif cns == Cns.NAMESPACE:
        req.reply = _identify_namespace(req, ctrl)
    elif cns == Cns.ACTIVE_NS_LIST:
        nsid = req.cmd.nsid
        if nsid >= idf.NSID_MAX:  # no NSID follows the last one
            raise NvmeError(Status.INVALID_NS, f"active namespace list after NSID {nsid:#x}")
        req.reply = idf.build_active_ns_list(ctrl.subsystem.active_nsids(ctrl.hostnqn), nsid)
    elif cns == Cns.NS_DESC_LIST:
        ns = _find_ns(ctrl, req.cmd.nsid)
        req.reply = idf.build_ns_descriptor_list(ns.eui64, ns.nguid, ns.uuid.bytes)
    else:
        raise NvmeError(Status.INVALID_FIELD, f"Identify CNS {cns:#04x} is not supported")


def _find_ns(ctrl: Controller, nsid: int) -> Namespace:
    # A namespace masked from this host is an inactive NSID for it, answered like a missing one, so a
    # host cannot tell a namespace it may not see from a free NSID (SPDK nvmf_ctrlr_get_ns).
    ns = ctrl.subsystem.active_namespace(nsid, ctrl.hostnqn)
    if ns is None:
        raise NvmeError(Status.INVALID_NS, f"subsystem {ctrl.subsystem.nqn} has no active namespace {nsid}")
    return ns


def _identify_namespace(req: Request, ctrl: Controller) -> bytes:
    nsid = req.cmd.nsid
    if nsid == 0 or nsid > ctrl.subsystem.max_namespaces:
        raise NvmeError(Status.INVALID_NS,
                        f"Identify Namespace NSID {nsid:#x} outside 1..{ctrl.subsystem.max_namespaces}")
    ns = ctrl.subsystem.active_namespace(nsid, ctrl.hostnqn)
    if ns is None:
        # an inactive NSID (none, disabled, or masked from this host) reads as zeros: nvmet
        # nvmet_execute_identify_ns, SPDK for a namespace not visible to the controller
        return bytes(IDENTIFY_DATA_SIZE)
    return identify_namespace(ns, rescap=_rescap(ctrl))


def _rescap(ctrl: Controller) -> int:
    """RESCAP: every type and IEKEY as NVMe 1.3 defines it; PTPL only where the state can be kept."""
    target = ctrl.target
    if not target.reservations_supported:
        return 0
    return RESCAP_ALL if target.pr_store is not None else RESCAP_ALL & ~RESCAP_PTPL


def identify_namespace(ns: Namespace, *, rescap: int = 0) -> bytes:
    nsze = ns.nsze
    thin = ns.backend.can_deallocate
    return IdentifyNamespace.build({
        "nsze": nsze,
        "ncap": nsze,
        "nuse": nsze,
        "nsfeat": idf.NSFEAT_THIN if thin else 0,
        "nlbaf": 0,
        "flbas": 0,
        "nmic": idf.NMIC_SHARED,
        "rescap": rescap,
        # DLFEAT: deallocated blocks read as zeros (001b) and Write Zeroes may deallocate (bit 3)
        "dlfeat": 0x09 if thin else 0,
        "nsattr": 0 if ns.writable else 1,
        "anagrpid": ns.anagrpid,
        "nguid": bytes(ns.nguid),
        "eui64": bytes(ns.eui64),
        "lbaf": [{"ms": 0, "lbads": ns.lba_shift, "rp": 0}] + [{}] * 63,
    })


def identify_controller(ctrl: Controller, ops: TransportOps, io_incapsule: int | None = None) -> bytes:
    """Identify Controller; SGLS come from the queue's transport, IOCCSZ from ``io_incapsule``, the in-capsule
    size of the listener the admin queue came through (the transport's without one), as
    nvmet_execute_identify_ctrl reads req->port->inline_data_size."""
    if io_incapsule is None:
        io_incapsule = ops.io_incapsule
    sub = ctrl.subsystem
    discovery = ctrl.is_discovery
    fields = {
        "vid": 0,
        "ssvid": 0,
        "sn": sub.serial[:20],
        "mn": sub.model[:40],
        "fr": defaults.FIRMWARE_REVISION[:8],
        "rab": 6,
        "ieee": defaults.IEEE_OUI,
        # several ports and controllers, ANA reporting (nvmet_execute_identify_ctrl)
        "cmic": 0 if discovery else idf.CMIC_MULTI_PORT | idf.CMIC_MULTI_CTRL | idf.CMIC_ANA,
        "mdts": defaults.MDTS,
        "cntlid": ctrl.cntlid,
        "ver": ctrl.vs,
        "oaes": ctrl.oaes,
        "ctratt": 0 if discovery else idf.CTRATT_HOST_ID_128,
        "cntrltype": idf.CNTRLTYPE_DISCOVERY if discovery else idf.CNTRLTYPE_IO,
        "acl": 3,
        "aerl": ASYNC_EVENT_LIMIT - 1,
        "frmw": 0 if discovery else 0x3,   # one slot, slot 1 read-only
        "lpa": idf.LPA_EXT_DATA if discovery else idf.LPA_CMD_EFFECTS | idf.LPA_EXT_DATA,
        "elpe": 0 if discovery else ERROR_LOG_ENTRIES - 1,
        "wctemp": 0 if discovery else WCTEMP_K,
        "cctemp": 0 if discovery else CCTEMP_K,
        "kas": max(1, defaults.KAS_UNITS_MS // 100),
        "maxcmd": defaults.MAX_QUEUE_SIZE,
        "sgls": idf.SGLS_SUPPORTED | (idf.SGLS_KEYED if ops.keyed_sgls else 0) | idf.SGLS_OFFSET,
        "subnqn": sub.nqn,
        "icdoff": 0,
        "msdbd": 1,
        "psd": [{"mp": 0x9C4, "enlat": 0x10, "exlat": 0x4}] + [{}] * 31,
    }
    if not discovery:
        fields.update({
            "sqes": 0x66,
            "cqes": 0x44,
            "nn": sub.max_namespaces,
            # The Linux host sizes its ANA log buffer from MNAN (NANAGRPID descriptors + MNAN NSIDs) and
            # gives up ANA if that exceeds MDTS (nvme_mpath_init_identify); MNAN <= NN.
            "mnan": min(sub.max_namespaces, ANA_MNAN_MAX),
            "anatt": defaults.ANATT,
            "anacap": ANACAP,
            "anagrpmax": defaults.ANAGRPMAX,
            "nanagrpid": defaults.ANAGRPMAX,
            "oncs": idf.ONCS_COMPARE | idf.ONCS_DSM | idf.ONCS_WRITE_ZEROES
            | (idf.ONCS_RESERVATIONS if ctrl.target.reservations_supported else 0),
            # present, and Flush with NSID FFFFFFFFh flushes every namespace (bits 2:1 = 11b)
            "vwc": idf.VWC_PRESENT | VWC_FLUSH_BROADCAST,
            "ioccsz": (64 + io_incapsule) // 16,
            "iorcsz": 1,
        })
    return IdentifyController.build(fields)


# --- Get Log Page --------------------------------------------------------------------------------

def parse_get_log_page(req: Request, execute: Execute) -> None:
    cmd = req.cmd
    numd = ((cmd.cdw11 & 0xFFFF) << 16 | (cmd.cdw10 >> 16)) + 1
    length = numd * 4
    lpo = cmd.cdw12 | (cmd.cdw13 << 32)
    if lpo & 3:
        raise NvmeError(Status.INVALID_FIELD, f"Get Log Page offset {lpo} is not dword aligned")
    if length > defaults.MAX_TRANSFER:
        raise NvmeError(Status.INVALID_FIELD,
                        f"Get Log Page of {length} bytes exceeds MDTS ({defaults.MAX_TRANSFER} bytes)")
    req.expect(Direction.C2H, length, execute)


def log_page_args(req: Request) -> tuple[int, bool, int]:
    """(log identifier, retain asynchronous event, byte offset) of a Get Log Page."""
    cmd = req.cmd
    return cmd.cdw10 & 0xFF, bool(cmd.cdw10 & (1 << 15)), cmd.cdw12 | (cmd.cdw13 << 32)


def reply_log(req: Request, page: bytes, lid: int, offset: int) -> None:
    if offset > len(page):
        raise NvmeError(Status.INVALID_FIELD, f"log page {lid:#04x} offset {offset} is past its {len(page)} bytes")
    req.reply = log_slice(page, offset, req.data_len)


async def _get_log_page(req: Request) -> None:
    ctrl = _ctrl(req)
    lid, rae, offset = log_page_args(req)
    if lid == LogPageId.ERROR:
        page = _error_log(ctrl, req.queue.ops.nvme_trtype)
    elif lid == LogPageId.SMART:
        page = _smart_log(req, ctrl)
    elif lid == LogPageId.FW_SLOT:
        page = FirmwareSlotLog.build({"afi": 1, "frs": [defaults.FIRMWARE_REVISION[:8]] + [""] * 6})
    elif lid == LogPageId.CHANGED_NS:
        nsids, overflow = ctrl.take_changed_nsids(retain=rae)
        if overflow:
            page = struct.pack("<I", CHANGED_NS_LIST_OVERFLOW) + bytes(CHANGED_NS_MAX * 4 - 4)
        else:
            page = build_changed_ns_list(nsids)
    elif lid == LogPageId.CMD_EFFECTS:
        page = _EFFECTS_LOG
    elif lid == LogPageId.ANA:
        page = ana_log(ctrl, rgo=bool((req.cmd.cdw10 >> 8) & ANA_LOG_RGO))
        if not rae:
            ctrl.clear_aen_mask(AEN_BIT_ANA_CHANGE)   # nvmet_clear_aen_bit: the next change is told again
    elif lid == LogPageId.RESERVATION and ctrl.target.reservations_supported:
        # each read takes the oldest page (nvmet_execute_get_log_page_resv); a count that skips numbers
        # tells the host how many pages a full queue lost
        count, kind, nsid, waiting = ctrl.take_reservation_log()
        page = ReservationNotificationLog.build({"count": count, "type": kind, "nalp": waiting, "nsid": nsid})
    else:
        raise NvmeError(Status.INVALID_LOG_PAGE, f"log page {lid:#04x} is not supported")
    reply_log(req, page, lid, offset)


def ana_log(ctrl: Controller, *, rgo: bool = False) -> bytes:
    """Log 0Ch as this controller sees it (nvmet_execute_get_log_page_ana): each ANA group with an
    active namespace in its subsystem, by group id, in its state on the controller's listener, with
    its NSIDs ascending (nvme_update_ana_state walks them in step with its sorted namespace list)."""
    members: dict[int, list[int]] = {}
    for nsid in ctrl.subsystem.active_nsids(ctrl.hostnqn):   # a masked namespace is not listed, nor counted
        members.setdefault(ctrl.subsystem.namespaces[nsid].anagrpid, []).append(nsid)
    listener = ctrl.listener
    chgcnt = ctrl.target.ana_group_chgcnt
    groups = [(grp, chgcnt.get(grp, 0), listener.ana_state(grp) if listener is not None else AnaState.OPTIMIZED,
               members[grp]) for grp in sorted(members)]
    return build_ana_log(ctrl.target.ana_chgcnt, groups, rgo=rgo)


def _error_log(ctrl: Controller, trtype: int) -> bytes:
    entries = [
        ErrorLogEntry.build({
            "error_count": rec.error_count,
            "sqid": rec.sqid,
            "cmdid": rec.cmdid,
            "status_field": ctrl.error_status_field(rec),
            "param_error_location": 0xFFFF,
            "lba": rec.lba,
            "nsid": rec.nsid,
            "trtype": trtype,
            "opcode": rec.opcode,
        })
        for rec in ctrl.errors
    ]
    return b"".join(entries).ljust(ERROR_LOG_ENTRIES * 64, b"\x00")


def _smart_log(req: Request, ctrl: Controller) -> bytes:
    nsid = req.cmd.nsid
    if nsid in (0, NSID_ALL):
        namespaces = [ns for ns in ctrl.subsystem.namespaces.values() if ns.visible_to(ctrl.hostnqn)]
    else:
        namespaces = [_find_ns(ctrl, nsid)]
    read_bytes = sum(ns.stats.read_bytes for ns in namespaces)
    write_bytes = sum(ns.stats.write_bytes for ns in namespaces)
    hours = int((time.time() - ctrl.target.started) // 3600)
    return SmartLog.build({
        "temperature": SMART_TEMPERATURE_K,
        "avail_spare": 100,
        "spare_thresh": 10,
        # Data units: thousands of 512-byte units, rounded up (NVMe Base 2.0 Figure 207)
        "data_units_read": math.ceil(read_bytes / 512 / 1000),
        "data_units_written": math.ceil(write_bytes / 512 / 1000),
        "host_reads": sum(ns.stats.reads for ns in namespaces),
        "host_writes": sum(ns.stats.writes for ns in namespaces),
        "power_cycles": 1,
        "power_on_hours": hours,
        "num_err_log_entries": ctrl.error_count,
        "temp_sensor": [SMART_TEMPERATURE_K] + [0] * 7,
    })


# --- Features ------------------------------------------------------------------------------------

SEL_CURRENT, SEL_DEFAULT, SEL_SAVED, SEL_SUPPORTED = 0, 1, 2, 3
CAP_CHANGEABLE = 1 << 2
_DISCOVERY_FEATURES = frozenset({FeatureId.KATO, FeatureId.ASYNC_EVENT})
_IO_FEATURES = frozenset({FeatureId.ARBITRATION, FeatureId.POWER_MGMT, FeatureId.TEMP_THRESHOLD,
                          FeatureId.ERR_RECOVERY, FeatureId.VOLATILE_WC, FeatureId.NUM_QUEUES,
                          FeatureId.IRQ_COALESCE, FeatureId.ASYNC_EVENT, FeatureId.KATO, FeatureId.HOST_ID})
_RESV_FEATURES = frozenset({FeatureId.RESV_MASK, FeatureId.RESV_PERSIST})
CAP_NS_SPECIFIC = 1 << 1


def _supported(ctrl: Controller, fid: int) -> bool:
    if fid in _RESV_FEATURES:
        return not ctrl.is_discovery and ctrl.target.reservations_supported
    return fid in (_DISCOVERY_FEATURES if ctrl.is_discovery else _IO_FEATURES)


async def _set_resv_feature(req: Request, ctrl: Controller, fid: int, value: int) -> None:
    nsid = req.cmd.nsid
    if fid == FeatureId.RESV_MASK:
        # Reservation Notification Mask: per controller and namespace; NSID FFFFFFFFh sets every namespace
        if value & ~MASK_ALL:
            raise NvmeError(Status.INVALID_FIELD, f"Reservation Notification Mask {value:#x}: only bits 1-3 exist")
        nsids = ctrl.subsystem.active_nsids(ctrl.hostnqn) if nsid == NSID_ALL else [_find_ns(ctrl, nsid).nsid]
        for n in nsids:
            ctrl.resv_masks[n] = value
        req.dw0 = value
        return
    ns = _find_ns(ctrl, nsid)
    ptpl = bool(value & PTPL_FEATURE_BIT)
    if ptpl and ctrl.target.pr_store is None:
        raise NvmeError(Status.INVALID_FIELD, "Reservation Persistence: this target keeps no state across a restart "
                        "(RESCAP bit 0 clear)")
    await pr.change(ctrl.target, ctrl.subsystem, ns,
                    lambda s: Outcome(dataclasses.replace(s, ptpl=ptpl)))


def _get_resv_feature(ctrl: Controller, fid: int, nsid: int) -> int:
    ns = _find_ns(ctrl, nsid)
    if fid == FeatureId.RESV_MASK:
        return ctrl.resv_masks.get(ns.nsid, 0)
    return PTPL_FEATURE_BIT if ns.pr.ptpl else 0


def _num_queues_value(nsq: int, ncq: int) -> int:
    return (nsq - 1) | ((ncq - 1) << 16)


async def set_features(req: Request) -> None:
    ctrl = _ctrl(req)
    cmd = req.cmd
    fid = cmd.cdw10 & 0xFF
    value = cmd.cdw11
    if not _supported(ctrl, fid):
        raise NvmeError(Status.INVALID_FIELD, f"Set Features: feature {fid:#04x} is not supported")
    if cmd.cdw10 & (1 << 31):
        raise NvmeError(Status.FEATURE_NOT_SAVEABLE, f"Set Features {fid:#04x} with SV: nothing is saveable")
    if fid in _RESV_FEATURES:
        await _set_resv_feature(req, ctrl, fid, value)
    elif fid == FeatureId.NUM_QUEUES:
        nsqr, ncqr = value & 0xFFFF, value >> 16
        if nsqr == 0xFFFF or ncqr == 0xFFFF:
            raise NvmeError(Status.INVALID_FIELD, f"Number of Queues {value:#x}: 65536 queues cannot be requested")
        if len(ctrl.queues) > 1:
            raise NvmeError(Status.CMD_SEQ_ERROR, "Number of Queues changed after I/O queues were connected")
        nsq = min(nsqr + 1, defaults.MAX_IO_QUEUES)
        ncq = min(ncqr + 1, defaults.MAX_IO_QUEUES)
        ctrl.nr_io_queues = min(nsq, ncq)
        ctrl.nr_queues_set = True
        req.dw0 = _num_queues_value(nsq, ncq)
    elif fid == FeatureId.KATO:
        ctrl.kato_ms = value
        ctrl.keep_alive()
    elif fid == FeatureId.ASYNC_EVENT:
        allowed = ctrl.oaes | (0 if ctrl.is_discovery else AEC_SMART_MASK)
        if value & ~allowed:
            raise NvmeError(Status.INVALID_FIELD,
                            f"Asynchronous Event Configuration {value:#x} enables events this controller "
                            f"cannot send (supported {allowed:#x})")
        ctrl.aen_enabled = value
        req.dw0 = value
    elif fid == FeatureId.VOLATILE_WC:
        ctrl.volatile_write_cache = bool(value & 1)
    elif fid == FeatureId.ARBITRATION:
        ctrl.arbitration = value
    elif fid == FeatureId.POWER_MGMT:
        if value & 0x1F:
            raise NvmeError(Status.INVALID_FIELD, f"power state {value & 0x1F}: only power state 0 exists")
        ctrl.power_state = value
    elif fid == FeatureId.TEMP_THRESHOLD:
        tmpth, tmpsel, thsel = value & 0xFFFF, (value >> 16) & 0xF, (value >> 20) & 0x3
        if tmpsel not in (0, 0xF) or thsel > 1:
            raise NvmeError(Status.INVALID_FIELD,
                            f"Temperature Threshold: sensor {tmpsel} / threshold type {thsel} not supported "
                            "(composite temperature, over or under)")
        ctrl.temp_thresholds[(0, thsel)] = tmpth
    elif fid == FeatureId.ERR_RECOVERY:
        if value & (1 << 16):
            raise NvmeError(Status.INVALID_FIELD, "Error Recovery DULBE: deallocated blocks never report errors")
        ctrl.error_recovery = value & 0xFFFF
    elif fid == FeatureId.IRQ_COALESCE:
        ctrl.irq_coalesce = value & 0xFFFF
    elif fid == FeatureId.HOST_ID:
        raise NvmeError(Status.CMD_SEQ_ERROR, "the Host Identifier is fixed by Connect on fabrics")


def parse_get_features(req: Request) -> None:
    fid = req.cmd.cdw10 & 0xFF
    sel = (req.cmd.cdw10 >> 8) & 0x7
    if fid == FeatureId.HOST_ID and sel != SEL_SUPPORTED:
        req.expect(Direction.C2H, HOST_ID_SIZE, get_features)
    else:
        req.expect(Direction.NONE, 0, get_features)


def _feature_default(ctrl: Controller, fid: int, cdw11: int) -> int:
    if fid == FeatureId.NUM_QUEUES:
        return _num_queues_value(defaults.MAX_IO_QUEUES, defaults.MAX_IO_QUEUES)
    if fid == FeatureId.VOLATILE_WC:
        return 1
    if fid == FeatureId.ASYNC_EVENT:
        return ctrl.oaes
    if fid == FeatureId.KATO:
        return defaults.DEFAULT_KATO_MS
    if fid == FeatureId.TEMP_THRESHOLD:
        return _temp_threshold(cdw11, WCTEMP_K if (cdw11 >> 20) & 0x3 == 0 else 0)
    return 0


def _temp_threshold(cdw11: int, value: int) -> int:
    return (cdw11 & 0x3F0000) | value


def _feature_current(ctrl: Controller, fid: int, cdw11: int) -> int:
    if fid == FeatureId.NUM_QUEUES:
        return _num_queues_value(ctrl.nr_io_queues, ctrl.nr_io_queues)
    if fid == FeatureId.KATO:
        return ctrl.kato_ms
    if fid == FeatureId.ASYNC_EVENT:
        return ctrl.aen_enabled
    if fid == FeatureId.VOLATILE_WC:
        return int(ctrl.volatile_write_cache)
    if fid == FeatureId.ARBITRATION:
        return ctrl.arbitration
    if fid == FeatureId.POWER_MGMT:
        return ctrl.power_state
    if fid == FeatureId.TEMP_THRESHOLD:
        tmpsel, thsel = (cdw11 >> 16) & 0xF, (cdw11 >> 20) & 0x3
        if tmpsel != 0 or thsel > 1:
            raise NvmeError(Status.INVALID_FIELD,
                            f"Temperature Threshold: sensor {tmpsel} / threshold type {thsel} not supported")
        default = WCTEMP_K if thsel == 0 else 0
        return _temp_threshold(cdw11, ctrl.temp_thresholds.get((0, thsel), default))
    if fid == FeatureId.ERR_RECOVERY:
        return ctrl.error_recovery
    if fid == FeatureId.IRQ_COALESCE:
        return ctrl.irq_coalesce
    return 0


async def get_features(req: Request) -> None:
    ctrl = _ctrl(req)
    cmd = req.cmd
    fid = cmd.cdw10 & 0xFF
    sel = (cmd.cdw10 >> 8) & 0x7
    if not _supported(ctrl, fid):
        raise NvmeError(Status.INVALID_FIELD, f"Get Features: feature {fid:#04x} is not supported")
    if sel > SEL_SUPPORTED:
        raise NvmeError(Status.INVALID_FIELD, f"Get Features select {sel} is reserved")
    if sel == SEL_SUPPORTED:
        req.dw0 = 0 if fid == FeatureId.HOST_ID else CAP_CHANGEABLE
        if fid in _RESV_FEATURES:
            req.dw0 |= CAP_NS_SPECIFIC
        return
    if fid in _RESV_FEATURES:
        req.dw0 = _get_resv_feature(ctrl, fid, cmd.nsid)
        return
    if fid == FeatureId.HOST_ID:
        if not cmd.cdw11 & 1:
            raise NvmeError(Status.INVALID_FIELD, "Host Identifier is 128 bits here: set EXHID (CDW11 bit 0)")
        req.reply = ctrl.hostid
        return
    if sel == SEL_CURRENT:
        req.dw0 = _feature_current(ctrl, fid, cmd.cdw11)
    else:   # default, or saved: nothing is saveable, so the saved value is the default
        req.dw0 = _feature_default(ctrl, fid, cmd.cdw11)


# --- Keep Alive, AER, Abort ----------------------------------------------------------------------

async def keep_alive(req: Request) -> None:
    _ctrl(req).keep_alive()


async def async_event_request(req: Request) -> None:
    ctrl = _ctrl(req)
    fut = ctrl.add_aer()
    if fut is None:
        raise NvmeError(Status.ASYNC_LIMIT, f"more than {ASYNC_EVENT_LIMIT} Asynchronous Event Requests outstanding",
                        dnr=True)
    event = await fut
    req.dw0 = event.dw0


async def _abort(req: Request) -> None:
    req.dw0 = 1   # bit 0 set: the command was not aborted (commands here finish quickly; nvmet does the same)


__all__ = ["AEN_BIT_NS_ATTR", "identify_controller", "identify_namespace", "parse"]
