"""NVM I/O command set: Read, Write, Flush, Write Zeroes, Dataset Management, Compare.

Modelled on Linux nvmet io-cmd-file.c / io-cmd-bdev.c and core.c ``nvmet_parse_io_cmd``: parse finds
the namespace, checks access, the LBA range and the transfer size; execute calls the backend.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import TYPE_CHECKING

from nvmeof import defaults
from nvmeof.spec.nvme import DSM_AD, DSM_RANGE_SIZE, NSID_ALL, RW_FUA, WZ_DEAC, Direction, DsmRange, IoOpcode
from nvmeof.status import NvmeError, Status
from target import pr
from target.backends.base import BackendError, BackendUnavailable
from target.model import LATENCY_SHIFT
from target.reservations import allowed

if TYPE_CHECKING:
    from target.model import Namespace, NamespaceStats
    from target.request import Request

log = logging.getLogger(__name__)

_perf_ns = time.perf_counter_ns
_READ, _WRITE, _FLUSH = IoOpcode.READ.value, IoOpcode.WRITE.value, IoOpcode.FLUSH.value
_COMPARE, _WZ, _DSM = IoOpcode.COMPARE.value, IoOpcode.WRITE_ZEROES.value, IoOpcode.DATASET_MANAGEMENT.value
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})   # backend errnos answered Capacity Exceeded
DSM_DATA_MAX = 256 * DSM_RANGE_SIZE   # 256 ranges (NR is 8 bits); longer transfers are refused
_RESV_OPS = frozenset(int(op) for op in pr.RESV_OPCODES)


def parse(req: Request) -> None:
    ctrl = req.queue.ctrl
    assert ctrl is not None
    cmd = req.cmd
    op = cmd.opcode
    if op == _FLUSH and cmd.nsid == NSID_ALL:
        req.expect(Direction.NONE, 0, _flush_all)   # Identify VWC bits 2:1 = 11b advertise this
        return
    ns = ctrl.subsystem.namespaces.get(cmd.nsid)
    if ns is None or not ns.enabled or not (ns.auto_visible or ctrl.hostnqn in ns.hosts):   # masked: as missing
        raise NvmeError(Status.INVALID_NS, f"subsystem {ctrl.subsystem.nqn} has no active namespace {cmd.nsid}")
    req.ns = ns
    blocked = ctrl.ana_blocked.get(ns.anagrpid)
    if blocked is not None:
        raise _ana_refused(blocked, ns, ctrl.cntlid)
    if op in _RESV_OPS:
        pr.parse(req, ns, ctrl.target)
        return
    resv = ns.pr
    if resv.rtype and not allowed(resv, ctrl.hostid, op):
        raise pr.conflict(ns, ctrl.hostid, op)
    _parse_nvm(req, ns, op, cmd, ctrl.subsystem.nqn)
    if ns.qos is not None and (op == _READ or op == _WRITE or op == _COMPARE):
        req.execute = _throttled(req.execute, op != _WRITE)
    if resv.registrants:
        req.execute = pr.tracked(req.execute)


def _parse_nvm(req: Request, ns: Namespace, op: int, cmd, subnqn: str) -> None:
    if op == _READ or op == _WRITE or op == _COMPARE:
        _check_range(ns, cmd.slba, cmd.nlb)
        length = cmd.nlb << ns.lba_shift
        if length > defaults.MAX_TRANSFER:
            raise NvmeError(Status.INVALID_FIELD,
                            f"{cmd.nlb} blocks ({length} bytes) exceed MDTS ({defaults.MAX_TRANSFER} bytes)")
        if op == _READ:
            req.expect(Direction.C2H, length, _read)
        elif op == _WRITE:
            _check_writable(ns, subnqn)
            req.expect(Direction.H2C, length, _write)
        else:
            req.expect(Direction.H2C, length, _compare)
    elif op == _FLUSH:
        req.expect(Direction.NONE, 0, _flush)
    elif op == _WZ:
        _check_range(ns, cmd.slba, cmd.nlb)
        _check_writable(ns, subnqn)
        req.expect(Direction.NONE, 0, _write_zeroes)
    elif op == _DSM:
        nr = (cmd.cdw10 & 0xFF) + 1
        if cmd.cdw11 & DSM_AD:
            _check_writable(ns, subnqn)
        # The transfer may be longer than the NR ranges: mkfs.xfs discards with one range in a 4 KiB buffer, and
        # nvmet accepts any length from the ranges' up (nvmet_check_data_len_lte); only the ranges are read.
        needed = nr * DSM_RANGE_SIZE
        length = cmd.sgl().length
        if length < needed or length > DSM_DATA_MAX:
            raise NvmeError(Status.SGL_INVALID_DATA, f"Dataset Management of {nr} range(s) needs {needed} bytes "
                            f"(at most {DSM_DATA_MAX}); the SGL describes {length}")
        req.expect(Direction.H2C, length, _dsm)
    else:
        raise NvmeError(Status.INVALID_OPCODE, f"I/O opcode {op:#04x} is not supported")


def _throttled(execute, is_read: bool):
    # A QoS limit delays the command before it reaches the backend (SPDK queues it in the bdev's QoS
    # channel the same way); the host's data, if any, has arrived already. The limit is looked up again
    # here: one changed or removed while the data came in applies.
    async def run(req: Request) -> None:
        ns = req.ns
        qos = ns.qos
        if qos is not None and not req.qos_paid:
            ctrl = req.queue.ctrl
            waited = await qos.take(ctrl.hostnqn, is_read, req.data_len)
            if waited:
                # let go by a release with others (Throttle._pump): the transport sends their replies together
                req.coalesce = True
                for stats in (ns.stats, ctrl.host_stats):
                    stats.throttled += 1
                    stats.throttled_ns += waited
        await execute(req)

    return run


def _ana_refused(status: int, ns: Namespace, cntlid: int) -> NvmeError:
    # nvmet_check_ana_state: the group cannot be reached through this path (inaccessible, persistent
    # loss, in transition). DNR clear and SCT 3 (path related): the Linux host fails the I/O over to
    # another path (nvme_failover_req) instead of failing it. Not logged per command (a host switching
    # paths may send a burst); the state change itself was logged.
    return NvmeError(status, f"namespace {ns.nsid} (ANA group {ns.anagrpid}) is not accessible through controller "
                     f"{cntlid}'s port", dnr=False, logged=True)


def _check_range(ns: Namespace, slba: int, nlb: int) -> None:
    if slba + nlb > ns.nsze:
        raise NvmeError(Status.LBA_RANGE,
                        f"LBA {slba}+{nlb} ends past namespace {ns.nsid}'s {ns.nsze} blocks")


def _check_writable(ns: Namespace, subnqn: str) -> None:
    if not ns.writable:
        raise NvmeError(Status.NS_WRITE_PROTECTED, f"namespace {ns.nsid} of {subnqn} is read-only")


def _backend_failed(ns: Namespace, what: str, exc: Exception) -> NvmeError:
    if isinstance(exc, BackendUnavailable):
        # Not a fault of ours or the host's, and the host retries: Target.fail logs it as a warning
        # naming host and queue, and nothing is logged as an error.
        # Storage out of reach for now (Ceph unreachable, an OSD stopped): Namespace Not Ready with
        # DNR clear. Linux's nvme_decide_disposition retries any status without DNR (up to
        # nvme_max_retries) and fails over only on path errors (SCT 3), which this is not: every
        # gateway in front of the same cluster would fail alike. SPDK's bdev_rbd also answers
        # without DNR (an Internal Error).
        return NvmeError(Status.NS_NOT_READY, f"{what} failed, storage unreachable: {exc}", dnr=False)
    cause = exc if isinstance(exc, OSError) else exc.__cause__
    if isinstance(cause, OSError) and cause.errno in _NO_SPACE:
        # nvmet errno_to_nvme_status: -ENOSPC is Capacity Exceeded with DNR (the file system is full:
        # retrying the same write cannot succeed), everything else Internal Error. A full disk quota
        # (EDQUOT) is the same condition to the host, so it gets the same answer here.
        log.warning("namespace %d: %s failed, no space in the %s backend: %s", ns.nsid, what, ns.backend.kind, exc)
        return NvmeError(Status.CAP_EXCEEDED, f"{what} failed: {exc}", dnr=True, logged=True)
    log.error("namespace %d: %s failed in the %s backend: %s", ns.nsid, what, ns.backend.kind, exc)
    return NvmeError(Status.INTERNAL, f"{what} failed: {exc}")


def _count_read(stats: NamespaceStats, host: NamespaceStats, length: int, latency_ns: int) -> None:
    # The namespace's and the host's counters (/metrics, the dashboard): plain increments, and the
    # latency bucket from one shift and bit_length() (target/model.py LATENCY_SHIFT).
    bucket = (latency_ns >> LATENCY_SHIFT).bit_length()
    stats.reads += 1
    stats.read_bytes += length
    stats.read_latency_ns += latency_ns
    stats.read_hist[bucket] += 1
    host.reads += 1
    host.read_bytes += length
    host.read_latency_ns += latency_ns
    host.read_hist[bucket] += 1


def _count_write(stats: NamespaceStats, host: NamespaceStats, length: int, latency_ns: int) -> None:
    bucket = (latency_ns >> LATENCY_SHIFT).bit_length()
    stats.writes += 1
    stats.write_bytes += length
    stats.write_latency_ns += latency_ns
    stats.write_hist[bucket] += 1
    host.writes += 1
    host.write_bytes += length
    host.write_latency_ns += latency_ns
    host.write_hist[bucket] += 1


async def _read(req: Request) -> None:
    ns = req.ns
    assert ns is not None
    start = _perf_ns()
    length = req.data_len
    try:
        req.reply = await ns.backend.read(req.cmd.slba << ns.lba_shift, length)
    except (BackendError, OSError) as exc:
        raise _backend_failed(ns, "read", exc) from None
    _count_read(ns.stats, req.queue.ctrl.host_stats, length, _perf_ns() - start)


async def _write(req: Request) -> None:
    ns = req.ns
    assert ns is not None and req.data is not None
    start = _perf_ns()
    try:
        await ns.backend.write(req.cmd.slba << ns.lba_shift, req.data, fua=bool(req.cmd.cdw12 & RW_FUA))
    except (BackendError, OSError) as exc:
        raise _backend_failed(ns, "write", exc) from None
    _count_write(ns.stats, req.queue.ctrl.host_stats, req.data_len, _perf_ns() - start)


async def _compare(req: Request) -> None:
    ns = req.ns
    assert ns is not None and req.data is not None
    start = _perf_ns()
    try:
        stored = await ns.backend.read(req.cmd.slba << ns.lba_shift, req.data_len)
    except (BackendError, OSError) as exc:
        raise _backend_failed(ns, "compare read", exc) from None
    _count_read(ns.stats, req.queue.ctrl.host_stats, req.data_len, _perf_ns() - start)
    if stored != req.data:
        raise NvmeError(Status.COMPARE_FAILED, f"compare of LBA {req.cmd.slba}+{req.cmd.nlb} found different data",
                        dnr=True)


async def _flush(req: Request) -> None:
    ns = req.ns
    assert ns is not None
    try:
        await ns.backend.flush()
    except (BackendError, OSError) as exc:
        raise _backend_failed(ns, "flush", exc) from None


async def _flush_all(req: Request) -> None:
    ctrl = req.queue.ctrl
    assert ctrl is not None
    for ns in list(ctrl.subsystem.namespaces.values()):
        if not ns.enabled or not ns.visible_to(ctrl.hostnqn):
            continue
        try:
            await ns.backend.flush()
        except (BackendError, OSError) as exc:
            raise _backend_failed(ns, "flush", exc) from None


async def _write_zeroes(req: Request) -> None:
    ns = req.ns
    assert ns is not None
    cmd = req.cmd
    offset, length = cmd.slba << ns.lba_shift, cmd.nlb << ns.lba_shift
    start = _perf_ns()
    try:
        if cmd.cdw12 & WZ_DEAC:
            await ns.backend.discard(offset, length)
        else:
            await ns.backend.write_zeroes(offset, length)
    except (BackendError, OSError) as exc:
        raise _backend_failed(ns, "write zeroes", exc) from None
    _count_write(ns.stats, req.queue.ctrl.host_stats, 0, _perf_ns() - start)


async def _dsm(req: Request) -> None:
    ns = req.ns
    assert ns is not None and req.data is not None
    if not req.cmd.cdw11 & DSM_AD:
        return   # integral read/write hints only: nothing to do
    data = req.data
    ranges = []
    for i in range(0, ((req.cmd.cdw10 & 0xFF) + 1) * DSM_RANGE_SIZE, DSM_RANGE_SIZE):
        rng = DsmRange.parse(data[i:i + DSM_RANGE_SIZE])
        _check_range(ns, rng.slba, rng.nlb)
        ranges.append((rng.slba, rng.nlb))
    for slba, nlb in ranges:
        if not nlb:
            continue
        try:
            await ns.backend.discard(slba << ns.lba_shift, nlb << ns.lba_shift)
        except (BackendError, OSError) as exc:
            raise _backend_failed(ns, "deallocate", exc) from None
