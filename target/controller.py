"""One NVMe controller on the target: properties, features, keep-alive, asynchronous events and logs.

Modelled on Linux nvmet (drivers/nvme/target/core.c ``nvmet_update_cc``, ``nvmet_start_ctrl``,
``nvmet_keep_alive_timer``, ``nvmet_add_async_event``; admin-cmd.c for the features). A controller
lives from its admin Connect until Disconnect, admin-queue loss, keep-alive expiry or removal.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nvmeof import defaults
from nvmeof.spec.identify import OAES_ANA, OAES_DISC_CHANGE, OAES_NS_ATTR
from nvmeof.spec.logs import CHANGED_NS_MAX
from nvmeof.spec.nvme import LBA_OPCODES, AsyncEventNotice, AsyncEventType, LogPageId
from nvmeof.spec.registers import (
    CAP_CQR,
    CAP_CSS_NVM,
    CC_AMS_MASK,
    CC_AMS_SHIFT,
    CC_CSS_MASK,
    CC_CSS_SHIFT,
    CC_EN,
    CC_IOCQES_SHIFT,
    CC_IOSQES_SHIFT,
    CC_MPS_MASK,
    CC_MPS_SHIFT,
    CC_QES_MASK,
    CC_SHN_MASK,
    CC_SHN_SHIFT,
    CSTS_CFS,
    CSTS_RDY,
    CSTS_SHST_CMPLT,
    NVM_IOCQES,
    NVM_IOSQES,
)
from nvmeof.spec.reservations import AEN_INFO_RESERVATION_LOG
from nvmeof.status import encode_status
from target.model import NamespaceStats

if TYPE_CHECKING:
    from target.model import Listener, Subsystem
    from target.ports import ControllerHost
    from target.request import Request, TargetQueue

log = logging.getLogger(__name__)


ERROR_LOG_ENTRIES = 64            # Identify ELPE 63 (0's based)
ASYNC_EVENT_LIMIT = 4             # Identify AERL 3 (0's based)
DISCOVERY_DEFAULT_KATO_MS = 120_000  # NVMET_DISC_KATO_MS: reap discovery controllers of vanished hosts
SMART_TEMPERATURE_K = 300

AEN_BIT_NS_ATTR = 8
AEN_BIT_ANA_CHANGE = 11
AEN_BIT_DISC_CHANGE = 31
RESV_LOG_PAGES = 64               # reservation notification pages kept per controller (nvmet keeps 64 too)
# Asynchronous Event Configuration bits a host may set: SMART critical warnings (7:0) plus what OAES lists
AEC_SMART_MASK = 0xFF
_NOT_BLOCKED: dict[int, int] = {}   # the ana_blocked of a controller without a listener: never written


def host_label(hostnqn: str) -> str:
    """How logs and messages name a host: Linux nvmet admits an empty HOSTNQN where any host may
    connect (nvmet_host_allowed), so "" must read as something."""
    return hostnqn or "<empty HOSTNQN>"


def version_value(version: tuple[int, int, int] = defaults.NVME_VERSION) -> int:
    major, minor, tertiary = version
    return (major << 16) | (minor << 8) | tertiary


def capability_value() -> int:
    # MQES 15:0 (0's based), CQR 16, TO 31:24, CSS 44:37 (NVM only: no CSI duties), MPSMIN/MPSMAX 0.
    return (defaults.MAX_QUEUE_SIZE - 1) | CAP_CQR | (defaults.CAP_TO_500MS << 24) | CAP_CSS_NVM


@dataclass(slots=True)
class ErrorRecord:
    error_count: int
    sqid: int
    cmdid: int
    status: int        # (SCT << 8) | SC
    dnr: bool
    lba: int
    nsid: int
    opcode: int


@dataclass(slots=True)
class AsyncEvent:
    event_type: int
    info: int
    log_page: int

    @property
    def dw0(self) -> int:
        return self.event_type | (self.info << 8) | (self.log_page << 16)


class Controller:
    """Controller state. The transport owns queues' bytes; this owns what the commands change."""

    def __init__(self, target: ControllerHost, subsystem: Subsystem, cntlid: int, hostnqn: str, hostid: bytes,
                 kato_ms: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.subsystem = subsystem
        self.cntlid = cntlid
        self.hostnqn = hostnqn
        self.hostid = bytes(hostid)
        self.is_discovery = subsystem.subtype == "discovery"
        # This host's I/O counters on the subsystem (target/io.py adds to them); discovery does no I/O.
        self.host_stats = NamespaceStats() if self.is_discovery else subsystem.stats_for_host(hostnqn)
        self.clock = clock
        if kato_ms == 0 and self.is_discovery:
            kato_ms = DISCOVERY_DEFAULT_KATO_MS
        self.kato_ms = kato_ms
        self.last_keep_alive = clock()
        self.created = time.time()
        self.created_monotonic = clock()
        self.cap = capability_value()
        self.vs = version_value()
        self.cc = 0
        self.csts = 0
        self.queues: dict[int, TargetQueue] = {}
        self.closed = False
        # The listener the admin queue came through: its ANA states are this controller's (log 0Ch,
        # I/O). None (loop transport, tests): every group optimized.
        self.listener: Listener | None = None
        self.ana_blocked: dict[int, int] = _NOT_BLOCKED
        # features
        self.nr_io_queues = defaults.MAX_IO_QUEUES   # until Set Features Number of Queues grants fewer
        self.nr_queues_set = False
        self.oaes = OAES_DISC_CHANGE if self.is_discovery else OAES_NS_ATTR | OAES_ANA
        self.aen_enabled = self.oaes              # Asynchronous Event Configuration (feature 0Bh)
        self.aen_masked: set[int] = set()         # nvmet aen_masked: one notice until its log is read
        self.volatile_write_cache = True
        self.arbitration = 0
        self.power_state = 0
        self.temp_thresholds: dict[tuple[int, int], int] = {}
        self.error_recovery = 0
        self.irq_coalesce = 0
        # asynchronous events
        self.aer_waiters: collections.deque[asyncio.Future[AsyncEvent]] = collections.deque()
        self.pending_events: collections.deque[AsyncEvent] = collections.deque()
        self.changed_nsids: set[int] = set()
        self.changed_ns_overflow = False
        # Reservation notifications (log 80h): pages waiting, oldest first, the per-controller page counter,
        # pages lost to a full queue, and the Reservation Notification Mask (feature 82h) per NSID
        self.resv_log: collections.deque[tuple[int, int, int]] = collections.deque()
        self.resv_log_count = 0
        self.resv_log_lost = 0
        self.resv_masks: dict[int, int] = {}
        self.resv_aen_pending = False
        # error log
        self.error_count = 0
        self.errors: collections.deque[ErrorRecord] = collections.deque(maxlen=ERROR_LOG_ENTRIES)

    def __repr__(self) -> str:
        return f"Controller(cntlid={self.cntlid}, subsystem={self.subsystem.nqn!r}, host={self.hostnqn!r})"

    # --- properties ---------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return bool(self.cc & CC_EN) and bool(self.csts & CSTS_RDY)

    def set_cc(self, new: int) -> None:
        """nvmet_update_cc: EN 0->1 readies (or fails), EN 1->0 resets, SHN sets SHST complete."""
        old = self.cc
        self.cc = new & 0xFFFFFFFF
        if new & CC_EN and not old & CC_EN:
            self._start()
        if not new & CC_EN and old & CC_EN:
            self._reset()
        shn_new = (new >> CC_SHN_SHIFT) & CC_SHN_MASK
        shn_old = (old >> CC_SHN_SHIFT) & CC_SHN_MASK
        if shn_new and not shn_old:
            self._reset()
            self.csts |= CSTS_SHST_CMPLT
        if not shn_new and shn_old:
            self.csts &= ~CSTS_SHST_CMPLT

    def _start(self) -> None:
        cc = self.cc
        problems = []
        if (cc >> CC_IOSQES_SHIFT) & CC_QES_MASK != NVM_IOSQES:
            problems.append(f"IOSQES {(cc >> CC_IOSQES_SHIFT) & CC_QES_MASK} (need {NVM_IOSQES})")
        if (cc >> CC_IOCQES_SHIFT) & CC_QES_MASK != NVM_IOCQES:
            problems.append(f"IOCQES {(cc >> CC_IOCQES_SHIFT) & CC_QES_MASK} (need {NVM_IOCQES})")
        if (cc >> CC_MPS_SHIFT) & CC_MPS_MASK:
            problems.append(f"MPS {(cc >> CC_MPS_SHIFT) & CC_MPS_MASK} (only 4 KiB pages, MPS 0)")
        if (cc >> CC_AMS_SHIFT) & CC_AMS_MASK:
            problems.append(f"AMS {(cc >> CC_AMS_SHIFT) & CC_AMS_MASK} (only round robin)")
        if (cc >> CC_CSS_SHIFT) & CC_CSS_MASK:
            problems.append(f"CSS {(cc >> CC_CSS_SHIFT) & CC_CSS_MASK} (only the NVM command set, 0)")
        if problems:
            log.warning("controller %d (host %s): CC.EN=1 refused, CSTS.CFS set: unsupported %s",
                        self.cntlid, host_label(self.hostnqn), ", ".join(problems))
            self.csts = CSTS_CFS
            return
        self.csts = CSTS_RDY
        self.last_keep_alive = self.clock()

    def _reset(self) -> None:
        self.csts &= ~CSTS_RDY
        self.cc = 0

    # --- keep-alive -----------------------------------------------------------------------------

    def keep_alive(self) -> None:
        self.last_keep_alive = self.clock()

    def keep_alive_expired(self, now: float) -> bool:
        if not self.kato_ms or self.closed:
            return False
        return now - self.last_keep_alive > self.kato_ms / 1000 + defaults.KATO_GRACE

    # --- asynchronous events --------------------------------------------------------------------

    def add_aer(self) -> asyncio.Future[AsyncEvent] | None:
        """Register one AER; returns a future for its event, or None when the limit is reached."""
        if len(self.aer_waiters) >= ASYNC_EVENT_LIMIT:
            return None
        fut: asyncio.Future[AsyncEvent] = asyncio.get_running_loop().create_future()
        if self.pending_events:
            fut.set_result(self.pending_events.popleft())
        else:
            self.aer_waiters.append(fut)
        return fut

    def _post_event(self, event: AsyncEvent) -> None:
        while self.aer_waiters:
            fut = self.aer_waiters.popleft()
            if not fut.done():
                fut.set_result(event)
                return
        self.pending_events.append(event)

    def _aen_allowed(self, bit: int) -> bool:
        """nvmet_aen_bit_disabled inverted: enabled by AEC and not already posted and unread."""
        if not self.aen_enabled & (1 << bit) or bit in self.aen_masked:
            return False
        self.aen_masked.add(bit)
        return True

    def namespace_changed(self, nsid: int) -> None:
        if self.changed_ns_overflow or (len(self.changed_nsids) >= CHANGED_NS_MAX and nsid not in self.changed_nsids):
            self.changed_ns_overflow = True
            self.changed_nsids.clear()
        else:
            self.changed_nsids.add(nsid)
        if self._aen_allowed(AEN_BIT_NS_ATTR):
            self._post_event(AsyncEvent(AsyncEventType.NOTICE, AsyncEventNotice.NS_ATTR_CHANGED,
                                        LogPageId.CHANGED_NS))

    def reservation_notice(self, kind: int, nsid: int) -> None:
        """Queue one Reservation Notification log page and post its AEN (type 6h, info 00h), unless the
        host masked that kind for ``nsid`` (feature 82h) (nvmet_pr_add_resv_log)."""
        if self.resv_masks.get(nsid, 0) & (1 << kind):
            return
        self.resv_log_count = (self.resv_log_count + 1) & 0xFFFFFFFFFFFFFFFF or 1   # 0 is never a count
        if len(self.resv_log) >= RESV_LOG_PAGES:
            self.resv_log_lost += 1
            self.resv_log.popleft()
        self.resv_log.append((self.resv_log_count, kind, nsid))
        if not self.resv_aen_pending:
            self.resv_aen_pending = True
            self._post_event(AsyncEvent(AsyncEventType.IO_CMD_SET, AEN_INFO_RESERVATION_LOG, LogPageId.RESERVATION))

    def take_reservation_log(self) -> tuple[int, int, int, int]:
        """(count, type, nsid, pages still waiting) of the oldest page, removed; zeros when none waits.
        One notice is outstanding until the host has read every page."""
        if not self.resv_log:
            self.resv_aen_pending = False
            return 0, 0, 0, 0
        count, kind, nsid = self.resv_log.popleft()
        if not self.resv_log:
            self.resv_aen_pending = False
        return count, kind, nsid, min(len(self.resv_log), 255)

    def attach_listener(self, listener: Listener | None) -> None:
        """At admin Connect: the port this controller reports ANA states for."""
        self.listener = listener
        self.ana_blocked = listener.ana_blocked if listener is not None else _NOT_BLOCKED

    def ana_changed(self) -> None:
        """ANA change notice (nvmet_send_ana_event); the host re-reads log 0Ch, which re-arms it."""
        if self._aen_allowed(AEN_BIT_ANA_CHANGE):
            self._post_event(AsyncEvent(AsyncEventType.NOTICE, AsyncEventNotice.ANA_CHANGE, LogPageId.ANA))

    def discovery_changed(self) -> None:
        if self._aen_allowed(AEN_BIT_DISC_CHANGE):
            self._post_event(AsyncEvent(AsyncEventType.NOTICE, AsyncEventNotice.DISC_LOG_CHANGE,
                                        LogPageId.DISCOVERY))

    def clear_aen_mask(self, bit: int) -> None:
        self.aen_masked.discard(bit)

    def take_changed_nsids(self, retain: bool) -> tuple[list[int], bool]:
        nsids, overflow = sorted(self.changed_nsids), self.changed_ns_overflow
        if not retain:
            self.changed_nsids.clear()
            self.changed_ns_overflow = False
            self.clear_aen_mask(AEN_BIT_NS_ATTR)
        return nsids, overflow

    # --- error log ------------------------------------------------------------------------------

    def record_error(self, req: Request, status: int, dnr: bool) -> None:
        self.error_count += 1
        cmd = req.cmd
        lba = cmd.slba if req.queue.qid and cmd.opcode in LBA_OPCODES else 0
        self.errors.appendleft(ErrorRecord(self.error_count, req.queue.qid, cmd.cid, status, dnr, lba,
                                           cmd.nsid if cmd.opcode != 0x7F else 0, cmd.opcode))

    def error_status_field(self, record: ErrorRecord) -> int:
        # Error log "status field": the CQE's bits 15:1 with the phase tag (0 here) in bit 0
        return encode_status(record.status, dnr=record.dnr) << 1

    # --- teardown -------------------------------------------------------------------------------

    def shutdown(self, reason: str) -> None:
        """Tear down: detach and close every queue, drop AERs. The target frees the cntlid."""
        if self.closed:
            return
        self.closed = True
        admin = self.queues.get(0)
        log.info("controller %d (subsystem %s, host %s) torn down: %s", self.cntlid, self.subsystem.nqn,
                 host_label(self.hostnqn), reason,
                 extra={"event": "disconnect", "host": self.hostnqn, "subnqn": self.subsystem.nqn, "qid": 0,
                        "cntlid": self.cntlid, "peer": admin.peer if admin is not None else "", "reason": reason})
        for fut in self.aer_waiters:
            if not fut.done():
                fut.cancel()
        self.aer_waiters.clear()
        queues = list(self.queues.values())
        self.queues.clear()
        for queue in queues:
            queue.ctrl = None
            if queue.auth is not None and queue.auth.timer is not None:
                queue.auth.timer.cancel()   # target.auth's stall timer: nothing left to time out
            queue.close()

    def info(self) -> dict[str, object]:
        peer = self.queues[0].peer if 0 in self.queues else ""
        transport = self.queues[0].trtype if 0 in self.queues else ""
        return {
            "cntlid": self.cntlid,
            "subnqn": self.subsystem.nqn,
            "hostnqn": self.hostnqn,
            "hostid": self.hostid.hex(),
            "peer": peer,
            "transport": transport,
            "queues": [{"qid": q.qid, "sqsize": q.sqsize, "hdgst": q.hdgst, "ddgst": q.ddgst}
                       for _, q in sorted(self.queues.items())],
            "kato_ms": self.kato_ms,
            "connected_since": self.created,
            "enabled": self.enabled,
        }
