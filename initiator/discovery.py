"""Discovery: read a discovery controller's log page (LID 70h) and connect to what it lists.

The read sequence is libnvme's (src/nvme/fabrics.c ``nvme_discovery_log``): the header, then the
entries at LPO 1024 in 4 KiB pieces with RAE kept set until the last, then the header again; if the
generation counter moved, start over, at most ``MAX_DISC_RETRIES`` (10) times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import struct
from typing import Any

from initiator.controller import HostController
from nvmeof import defaults
from nvmeof.spec.fabrics import (
    DISCOVERY_LOG_ENTRY_SIZE,
    DISCOVERY_LOG_HEADER_SIZE,
    TREQ_DISABLE_SQFLOW,
    DiscoveryLogEntryCompiled,
    SubType,
    TrType,
)
from nvmeof.spec.nvme import LogPageId

log = logging.getLogger(__name__)

MAX_DISC_RETRIES = 10      # libnvme
LOG_CHUNK = 4096           # NVME_LOG_PAGE_PDU_SIZE
HEADER_READ = 20           # DISCOVERY_HEADER_LEN: genctr, numrec, recfmt (dword-rounded)
_HEADER = struct.Struct("<QQH")


class DiscoveryLogChanging(RuntimeError):
    """The generation counter kept changing across MAX_DISC_RETRIES reads."""


@dataclasses.dataclass(frozen=True, slots=True)
class DiscoveryEntry:
    trtype: int
    adrfam: int
    subtype: int
    treq: int
    portid: int
    cntlid: int
    asqsz: int
    eflags: int
    trsvcid: str
    subnqn: str
    traddr: str
    tsas: bytes

    @property
    def transport(self) -> str:
        try:
            return TrType(self.trtype).name.lower()
        except ValueError:
            return f"trtype {self.trtype}"

    @property
    def kind(self) -> str:
        try:
            return SubType(self.subtype).name.lower()
        except ValueError:
            return f"subtype {self.subtype}"

    @classmethod
    def parse(cls, raw: bytes | memoryview) -> DiscoveryEntry:
        e = DiscoveryLogEntryCompiled.parse(bytes(raw))
        return cls(e.trtype, e.adrfam, e.subtype, e.treq, e.portid, e.cntlid, e.asqsz, e.eflags,
                   e.trsvcid.strip(" \x00"), e.subnqn, e.traddr.strip(" \x00"), bytes(e.tsas))


async def read_discovery_log(ctrl: HostController, *,
                             max_retries: int = MAX_DISC_RETRIES) -> tuple[int, list[DiscoveryEntry]]:
    """(genctr, entries) from a connected discovery controller."""
    for _ in range(max_retries):
        genctr, numrec = _HEADER.unpack_from(
            await ctrl.get_log_page(LogPageId.DISCOVERY, HEADER_READ, rae=True))[:2]
        total = numrec * DISCOVERY_LOG_ENTRY_SIZE
        data = bytearray()
        pos = 0
        while pos < total:
            n = min(LOG_CHUNK, total - pos)
            data += await ctrl.get_log_page(LogPageId.DISCOVERY, n, offset=DISCOVERY_LOG_HEADER_SIZE + pos,
                                            rae=True)
            pos += n
        # The final header read drops RAE, which clears a pending discovery-change event.
        again = _HEADER.unpack_from(await ctrl.get_log_page(LogPageId.DISCOVERY, HEADER_READ))[0]
        if again == genctr:
            entries = [DiscoveryEntry.parse(memoryview(data)[i:i + DISCOVERY_LOG_ENTRY_SIZE])
                       for i in range(0, total, DISCOVERY_LOG_ENTRY_SIZE)]
            return genctr, entries
        log.info("discovery log generation changed from %d to %d while reading; retrying", genctr, again)
    raise DiscoveryLogChanging(f"discovery log of {ctrl.traddr}:{ctrl.trsvcid} kept changing across "
                               f"{max_retries} reads")


async def discover(traddr: str, trsvcid: int | str = defaults.TCP_DISCOVERY_PORT, transport: str = "tcp",
                   hostnqn: str | None = None, hostid: Any = None, *, subnqn: str = defaults.DISCOVERY_NQN,
                   hdr_digest: bool = False, data_digest: bool = False, timeout: float = 30.0,
                   target: Any = None, dhchap_secret: Any = None,
                   dhchap_ctrl_secret: Any = None, tls_key: Any = None,
                   tls_identity_version: int = defaults.TLS_IDENTITY_VERSION,
                   tls_sha256_binder: bool = False) -> list[DiscoveryEntry]:
    """Connect to a discovery controller (kato 0, no I/O queues), read its log, disconnect.

    ``dhchap_secret`` / ``dhchap_ctrl_secret``: DH-HMAC-CHAP for a discovery controller that requires it.
    ``tls_key``: over TLS, with the PSK identity naming the discovery NQN (nvme discover --tls);
    ``tls_sha256_binder``: as connect()'s."""
    ctrl = HostController(traddr, trsvcid, subnqn, hostnqn=hostnqn, hostid=hostid, transport=transport,
                          nr_io_queues=0, kato=0, hdr_digest=hdr_digest, data_digest=data_digest,
                          timeout=timeout, target=target, dhchap_secret=dhchap_secret,
                          dhchap_ctrl_secret=dhchap_ctrl_secret, tls_key=tls_key,
                          tls_identity_version=tls_identity_version, tls_sha256_binder=tls_sha256_binder)
    await ctrl.open()
    try:
        _, entries = await read_discovery_log(ctrl)
    finally:
        await ctrl.disconnect()
    return entries


async def connect_all(traddr: str, trsvcid: int | str = defaults.TCP_DISCOVERY_PORT, transport: str = "tcp",
                      hostnqn: str | None = None, hostid: Any = None, *, target: Any = None,
                      timeout: float = 30.0, **connect_kwargs: Any) -> list[HostController]:
    """Connect to every NVM subsystem entry (subtype 2) reachable over ``transport``.

    Entries of another transport are skipped (logged). If any connect fails, the controllers already
    connected are disconnected and the error is raised.
    """
    # the host secret also answers a discovery controller that requires authentication (nvme connect-all)
    entries = await discover(traddr, trsvcid, transport, hostnqn, hostid, timeout=timeout, target=target,
                             dhchap_secret=connect_kwargs.get("dhchap_secret"), tls_key=connect_kwargs.get("tls_key"),
                             tls_identity_version=connect_kwargs.get("tls_identity_version",
                                                                     defaults.TLS_IDENTITY_VERSION),
                             tls_sha256_binder=connect_kwargs.get("tls_sha256_binder", False))
    wanted = TrType.TCP if transport == "tcp" else None
    ctrls: list[HostController] = []
    seen: set[tuple[str, str, str]] = set()
    try:
        for e in entries:
            if e.subtype != SubType.NVME:
                continue
            if wanted is not None and e.trtype != wanted:
                log.info("skipping %s at %s:%s: transport %s is not %s", e.subnqn, e.traddr, e.trsvcid,
                         e.transport, transport)
                continue
            key = (e.subnqn, e.traddr, e.trsvcid)
            if key in seen:
                continue
            seen.add(key)
            ctrl = HostController(e.traddr if transport == "tcp" else traddr, int(e.trsvcid or 0), e.subnqn,
                                  hostnqn=hostnqn, hostid=hostid, transport=transport, timeout=timeout,
                                  target=target, disable_sqflow=bool(e.treq & TREQ_DISABLE_SQFLOW),
                                  **connect_kwargs)
            ctrls.append(await ctrl.open())
    except BaseException:
        await asyncio.gather(*(c.disconnect() for c in ctrls), return_exceptions=True)
        raise
    return ctrls
