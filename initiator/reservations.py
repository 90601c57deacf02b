"""Reservations for HostController: Register, Acquire, Release, Report, and the notification log record (80h).

The commands go on an I/O queue like any NVM command; a failing status raises NvmeError (another host's
reservation: Status.RESERVATION_CONFLICT). Keys travel in the command's data, never in a log line.
"""

from __future__ import annotations

import dataclasses

from initiator import commands as c
from initiator.nvm import NvmIo
from nvmeof.spec.identify import check_nsid
from nvmeof.spec.reservations import (
    ENTRY_SIZE,
    EXT_ENTRY_SIZE,
    EXT_HEADER_SIZE,
    HEADER_SIZE,
    NOTIFICATION_LOG_SIZE,
    AcquireAction,
    Cptpl,
    NotificationType,
    RegisterAction,
    ReleaseAction,
    ReservationNotificationLog,
    ReservationReport,
    parse_report,
)

MAX_REGISTRANTS = 0xFFFF     # REGCTL is a 16-bit count


@dataclasses.dataclass(frozen=True, slots=True)
class ReservationNotification:
    """One Reservation Notification log page (80h); ``count`` 0 means there was nothing to report."""

    count: int
    type: NotificationType | int
    nalp: int              # pages still waiting after this one (255: 255 or more)
    nsid: int

    @property
    def empty(self) -> bool:
        return self.count == 0 or self.type == NotificationType.EMPTY


def parse_notification(data: bytes) -> ReservationNotification:
    if len(data) < NOTIFICATION_LOG_SIZE:
        raise ValueError(f"reservation notification log of {len(data)} bytes is shorter than "
                         f"{NOTIFICATION_LOG_SIZE}")
    page = ReservationNotificationLog.parse(data[:NOTIFICATION_LOG_SIZE])
    try:
        kind: NotificationType | int = NotificationType(page.type)
    except ValueError:
        kind = page.type
    return ReservationNotification(page.count, kind, page.nalp, page.nsid)


def report_size(regctl: int, *, eds: bool) -> int:
    """Bytes of a Reservation Status data structure with ``regctl`` registrants (nvme-cli resv_report_size)."""
    if eds:
        return EXT_HEADER_SIZE + regctl * EXT_ENTRY_SIZE
    return HEADER_SIZE + regctl * ENTRY_SIZE


class ReservationIo(NvmIo):
    """The reservation commands of :class:`initiator.controller.HostController`, sent on its I/O queues
    with :meth:`NvmIo.io_command` (the notification log, an admin command, is the controller's own)."""

    async def resv_register(self, nsid: int, *, nrkey: int = 0, crkey: int = 0,
                            rrega: RegisterAction | int = RegisterAction.REGISTER, iekey: bool = False,
                            cptpl: Cptpl | int = Cptpl.NO_CHANGE) -> None:
        """Reservation Register: register NRKEY, unregister CRKEY, or replace CRKEY by NRKEY (``rrega``);
        ``iekey`` skips the CRKEY check, ``cptpl`` changes Persist Through Power Loss."""
        check_nsid(nsid)
        cmd, data = c.resv_register(nsid, rrega=rrega, crkey=crkey, nrkey=nrkey, iekey=iekey, cptpl=cptpl)
        await self.io_command(cmd, data_out=data)

    async def resv_acquire(self, nsid: int, *, crkey: int, rtype: int, prkey: int = 0,
                           racqa: AcquireAction | int = AcquireAction.ACQUIRE, iekey: bool = False) -> None:
        """Reservation Acquire of type ``rtype`` (:class:`ReservationType`) with our key CRKEY; to preempt
        (``racqa``), PRKEY names the registrant(s) to take it from. ``iekey`` is for controllers before
        NVMe 1.3: later ones (ours included) answer Invalid Field, in Release too."""
        check_nsid(nsid)
        cmd, data = c.resv_acquire(nsid, racqa=racqa, rtype=rtype, crkey=crkey, prkey=prkey, iekey=iekey)
        await self.io_command(cmd, data_out=data)

    async def resv_release(self, nsid: int, *, crkey: int, rtype: int = 0,
                           rrela: ReleaseAction | int = ReleaseAction.RELEASE, iekey: bool = False) -> None:
        """Reservation Release (``rtype`` must be the held type) or Clear (``rrela``: every registration
        and the reservation go)."""
        check_nsid(nsid)
        cmd, data = c.resv_release(nsid, rrela=rrela, rtype=rtype, crkey=crkey, iekey=iekey)
        await self.io_command(cmd, data_out=data)

    async def resv_report_raw(self, nsid: int, *, eds: bool = True, size: int | None = 4096) -> bytes:
        """The Reservation Status data structure, undecoded (nvme-cli resv-report --raw-binary).

        ``size`` bytes are asked for (NUMD); None reads the header first and then asks again with room for
        every registrant, as nvme-cli's resv-report does without --numd (capped at MDTS)."""
        check_nsid(nsid)
        if size is None:
            head = await self._report(nsid, report_size(0, eds=eds), eds)
            regctl = parse_report(head, eds=eds).regctl
            if not regctl:
                return head
            size = report_size(min(regctl, MAX_REGISTRANTS), eds=eds)
            if self.mdts_bytes:
                size = min(size, self.mdts_bytes)
        return await self._report(nsid, size, eds)

    async def _report(self, nsid: int, size: int, eds: bool) -> bytes:
        cmd = c.resv_report(nsid, size, eds=eds)
        buf = bytearray(size)
        await self.io_command(cmd, data_in=buf)
        return bytes(buf)

    async def resv_report(self, nsid: int, *, eds: bool = True, size: int | None = 4096) -> ReservationReport:
        """Reservation Report: generation, the type held (0: none), PTPL state and the registrants, with
        128-bit host IDs when ``eds``. ``size`` as for :meth:`resv_report_raw`; REGCTL counts every
        registrant even when ``registrants`` holds only those the buffer had room for."""
        return parse_report(await self.resv_report_raw(nsid, eds=eds, size=size), eds=eds)
