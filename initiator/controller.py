"""HostController: one NVMe-oF controller seen from the host (admin queue + I/O queues).

The connect sequence follows the Linux host (drivers/nvme/host/tcp.c ``nvme_tcp_setup_ctrl``,
core.c ``nvme_enable_ctrl`` / ``nvme_init_ctrl_finish``, fabrics.c ``nvmf_connect_*``): ICReq,
Fabrics Connect on the admin queue, CAP / CC / CSTS.RDY, Identify Controller, Set Features Number
of Queues, one TCP connection and Connect per I/O queue, then keep-alive and AER.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from construct import Container

from initiator import commands as c
from initiator.auth import authenticate_queue, parse_key, parse_secret
from initiator.engine import BatchQueue, open_batch_queue
from initiator.nvm import Buffer, NamespaceGeometry
from initiator.queue import DEFAULT_TIMEOUT, HostQueue, TransportError, open_queue
from initiator.reservations import ReservationIo, ReservationNotification, parse_notification
from nvmeof import defaults
from nvmeof.auth import AuthFailure, DhchapSecret
from nvmeof.spec.fabrics import CONNECT_ADMIN_CNTLID, CONNECT_IATTR_DATA, Property, parse_connect_invalid_param
from nvmeof.spec.identify import (
    CMIC_ANA,
    CNTRLTYPE_DISCOVERY,
    IDENTIFY_DATA_SIZE,
    NSID_MAX,
    OAES_ANA,
    OAES_DISC_CHANGE,
    OAES_NS_ATTR,
    SGLS_KEYED,
    SGLS_OFFSET,
    IdentifyController,
    IdentifyNamespace,
    check_nsid,
    parse_active_ns_list,
    parse_ns_descriptor_list,
)
from nvmeof.spec.logs import ANA_LOG_RGO, AnaLog, AnaState, ana_log_size, parse_ana_log, parse_changed_ns_list
from nvmeof.spec.nvme import (
    AsyncEventNotice,
    AsyncEventType,
    Cns,
    Command,
    Completion,
    FeatureId,
    LogPageId,
)
from nvmeof.spec.reservations import AEN_INFO_RESERVATION_LOG, NOTIFICATION_LOG_SIZE
from nvmeof.status import NvmeError, Status
from nvmeof.tls.openssl import TlsError, TlsSession
from nvmeof.tls.psk import TlsKey

log = logging.getLogger(__name__)
_T = TypeVar("_T")


SHUTDOWN_TIMEOUT = 5.0       # Linux nvme_core shutdown_timeout
CHANGED_NS_LOG_SIZE = 4096
AEN_MASK = OAES_NS_ATTR | OAES_DISC_CHANGE | OAES_ANA   # the notices this host acts on
MAX_QUEUED_EVENTS = 1024
MAX_RESERVATION_PAGES = 256   # log 80h pages read for one event (NALP counts up to 255 more)


HOSTNQN_FILE = "/etc/nvme/hostnqn"
HOSTID_FILE = "/etc/nvme/hostid"
_UUID_NQN_PREFIX = "nqn.2014-08.org.nvmexpress:uuid:"


def default_hostnqn(hostid: uuid.UUID | None = None) -> str:
    """A host NQN in the form nvme-cli generates (``nvme gen-hostnqn``)."""
    return f"{_UUID_NQN_PREFIX}{hostid or uuid.uuid4()}"


@functools.cache
def default_host_identity() -> tuple[str, uuid.UUID]:
    """(hostnqn, hostid) for this process: /etc/nvme/hostnqn and hostid as nvme-cli reads them, else one
    generated pair kept for the process, so every controller it connects presents the same host."""
    nqn = _read_first_line(HOSTNQN_FILE)
    hostid = None
    text = _read_first_line(HOSTID_FILE)
    if text:
        with contextlib.suppress(ValueError):
            hostid = uuid.UUID(text)
    if hostid is None and nqn and nqn.startswith(_UUID_NQN_PREFIX):
        # libnvme derives the host ID from a UUID-based host NQN when no hostid file exists.
        with contextlib.suppress(ValueError):
            hostid = uuid.UUID(nqn[len(_UUID_NQN_PREFIX):])
    hostid = hostid or uuid.uuid4()
    return nqn or default_hostnqn(hostid), hostid


def _read_first_line(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip() or None
    except OSError:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class AsyncEvent:
    """One Asynchronous Event completion (AER CQE DW0), plus what the host read because of it."""

    type: int                      # AsyncEventType: bits 2:0
    info: int                      # bits 15:8
    lid: int                       # log page to read: bits 23:16
    dw0: int
    changed_nsids: tuple[int, ...] = ()   # for a namespace-attribute notice: log 04h's content
    ana_log: AnaLog | None = None         # for an ANA change notice: log 0Ch as re-read because of it
    # for Reservation Log Page Available (type 6h, info 0): the pages of log 80h read because of it
    reservations: tuple[ReservationNotification, ...] = ()

    @property
    def description(self) -> str:
        try:
            kind = AsyncEventType(self.type).name
        except ValueError:
            kind = f"type {self.type:#x}"
        if self.type == AsyncEventType.NOTICE:
            try:
                return f"{kind} {AsyncEventNotice(self.info).name}"
            except ValueError:
                pass
        return f"{kind} info {self.info:#x}"


# Connect Invalid Parameter offsets the host names (nvmf_log_connect_error): IPO is a byte offset
# into the Connect data (IATTR 1) or the SQE (IATTR 0).
_CONNECT_SQE_FIELDS = {40: "recfmt", 42: "qid", 44: "sqsize", 46: "cattr", 48: "kato"}
_CONNECT_DATA_FIELDS = {0: "hostid", 16: "cntlid", 256: "subsysnqn", 512: "hostnqn"}


def _parse_secrets(host: str | DhchapSecret | None,
                   ctrl: str | DhchapSecret | None) -> tuple[DhchapSecret | None, DhchapSecret | None]:
    host_secret = parse_secret("dhchap_secret (--dhchap-secret)", host)
    ctrl_secret = parse_secret("dhchap_ctrl_secret (--dhchap-ctrl-secret)", ctrl)
    if ctrl_secret is not None and host_secret is None:
        # nvme_auth_negotiate: the controller is only authenticated within a host authentication
        raise ValueError("dhchap_ctrl_secret (--dhchap-ctrl-secret) needs dhchap_secret (--dhchap-secret) too")
    return host_secret, ctrl_secret


class HostController(ReservationIo):
    """The public async API of one connected controller; see :func:`initiator.connect`."""

    def __init__(self, traddr: str, trsvcid: int | str = defaults.TCP_IO_PORT,
                 subnqn: str = defaults.DEFAULT_SUBSYSTEM_NQN, *, hostnqn: str | None = None,
                 hostid: str | uuid.UUID | bytes | None = None, transport: str = "tcp",
                 nr_io_queues: int = 1, queue_size: int = defaults.MAX_QUEUE_SIZE,
                 hdr_digest: bool = False, data_digest: bool = False, kato: int = defaults.DEFAULT_KATO_MS,
                 timeout: float = 30.0, target: Any = None, disable_sqflow: bool = False,
                 event_callback: Callable[[AsyncEvent], Any] | None = None,
                 event_queue: asyncio.Queue[AsyncEvent | None] | None = None,
                 dhchap_secret: str | DhchapSecret | None = None,
                 dhchap_ctrl_secret: str | DhchapSecret | None = None,
                 poll_us: int = defaults.POLL_US,
                 tls: bool = False, tls_key: str | TlsKey | None = None,
                 tls_identity_version: int = defaults.TLS_IDENTITY_VERSION, tls_compat: bool = False,
                 tls_sha256_binder: bool = False) -> None:
        if transport not in ("tcp", "loop", "rdma"):
            raise ValueError(f"transport {transport!r} is not supported by the Python host (tcp, rdma or loop)")
        if transport == "loop" and not callable(getattr(target, "connect_loop", None)):
            raise ValueError("transport 'loop' needs target=<target.core.Target> (an object with an async "
                             f"connect_loop(protocol_factory)), got {type(target).__name__}")
        if nr_io_queues < 0 or nr_io_queues > 0xFFFE:
            raise ValueError(f"nr_io_queues must be 0..65534, got {nr_io_queues}")
        if not 2 <= queue_size <= 65536:
            raise ValueError(f"queue_size must be 2..65536, got {queue_size}")
        if not 0 <= kato <= 0xFFFFFFFF:
            raise ValueError(f"kato must be 0..2**32-1 ms, got {kato}")
        if not isinstance(poll_us, int) or poll_us < 0:
            raise ValueError(f"poll_us must be an integer >= 0 (µs of busy polling after a batch, 0 = off), "
                             f"got {poll_us!r}")
        if poll_us and transport != "tcp":
            raise ValueError(f"poll_us={poll_us} needs the TCP batch engine (transport='tcp'); "
                             f"got transport={transport!r}")
        # NVMe/TCP over TLS 1.3 with a configured PSK (nvme connect --tls --tls-key); never logged or shown
        self._tls_key = parse_key("tls_key (--tls-key)", tls_key, TlsKey)
        self.tls = tls or self._tls_key is not None
        if self.tls:
            if transport != "tcp":
                raise ValueError(f"tls needs transport 'tcp', got {transport!r}")
            if self._tls_key is None:
                raise ValueError("tls needs tls_key (--tls-key NVMeTLSkey-1:...: the configured PSK, as "
                                 "`nvme gen-tls-key` prints it); this host reads no kernel keyring")
            if tls_identity_version not in (0, 1):
                raise ValueError(f"tls_identity_version must be 0 (NVMe0R) or 1 (NVMe1R), got {tls_identity_version}")
        self.tls_identity_version = tls_identity_version
        self.tls_compat = tls_compat   # derive as libnvme before 1.11 did (keys inserted by an older nvme-cli)
        if tls_sha256_binder and not self.tls:
            raise ValueError("tls_sha256_binder needs tls_key (it changes how a SHA-384 TLS PSK is offered)")
        # interop, default off (TP 8011): a SHA-384 PSK offered under a SHA-256 binder and suite, as a server on
        # GnuTLS before 3.8.11 (tlshd 1.0.0: Linux nvmet's TLS) takes it; see nvmeof/tls/openssl.py
        self.tls_sha256_binder = tls_sha256_binder
        # One NVMe/TCP engine: the batch engine (initiator/engine.py) owns a TCP socket, TLS queues' included (it
        # decrypts into its receive buffer and encrypts each batch). The loop transport has no socket, so it runs
        # HostQueue (initiator/queue.py), the batch engine's own slow path (every PDU through the sans-IO
        # TcpConnection); RDMA has its own queue. ``engine`` only says which one serves the queues ("batch" or
        # "stream"), it is not a choice; `_reference_queues` (tests only) runs TCP on HostQueue as the reference
        # model.
        self.engine = "batch" if transport == "tcp" and not self._reference_queues else "stream"
        self.poll_us = poll_us
        self.traddr = traddr
        self.trsvcid = int(trsvcid)
        self.subnqn = subnqn
        default_nqn, default_id = default_host_identity()
        self.hostid = _parse_hostid(hostid) if hostid is not None else default_id
        self.hostnqn = hostnqn or default_nqn
        c.check_nqn("subsystem NQN", subnqn)
        c.check_nqn("host NQN", self.hostnqn)
        # DH-HMAC-CHAP secrets (nvme-cli --dhchap-secret / --dhchap-ctrl-secret); never logged or shown
        self._host_secret, self._ctrl_secret = _parse_secrets(dhchap_secret, dhchap_ctrl_secret)
        self._auth_tid = 0           # nvme_ctrl.transaction: one transaction id per authentication
        self._authenticated = False
        self.transport = transport
        self.nr_io_queues = nr_io_queues
        self.queue_size = queue_size
        self.hdr_digest = hdr_digest
        self.data_digest = data_digest
        self.kato = kato
        self.timeout = timeout
        self.target = target
        self.disable_sqflow = disable_sqflow
        self.event_callback = event_callback
        self.cntlid = 0
        self.cap = 0
        self.vs = 0
        self.identity: Container | None = None
        self.mdts_bytes = 0          # 0: no MDTS limit
        self.io_incapsule_size = 0
        self.admin: HostQueue | None = None
        self.io_queues: list[HostQueue] = []
        self._rr = 0
        self._ns_cache: dict[int, NamespaceGeometry] = {}
        # Asymmetric Namespace Access (set from Identify when CMIC bit 3 is set; nvme_mpath_init_identify)
        self.ana_supported = False
        self.anatt = 0               # seconds a group may stay in ANA change state (Identify ANATT)
        self.ana_log: AnaLog | None = None   # the last ANA log read (at connect, on an ANA change AEN, ...)
        self._ana_nsids: dict[int, AnaState | int] = {}
        self._ana_lock = asyncio.Lock()   # one read at a time, so an older log never replaces a newer one
        self._owns_events = event_queue is None
        self._events: asyncio.Queue[AsyncEvent | None] = event_queue or asyncio.Queue()
        # Called once with the TransportError when any queue breaks while connected (reconnect hook).
        self.on_transport_error: Callable[[TransportError], Any] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # ---- connect and disconnect ----------------------------------------------------------------

    @property
    def is_discovery(self) -> bool:
        return self.subnqn == defaults.DISCOVERY_NQN

    def _queue_name(self, qid: int) -> str:
        return f"{self.transport}://{self.traddr}:{self.trsvcid} {self.subnqn} qid {qid}"

    def _tls_session(self) -> TlsSession | None:
        """A new client TLS session offering the configured PSK under its NVMe identity (one per queue)."""
        key = self._tls_key
        if key is None:
            return None
        compat = self.tls_compat
        identity = key.identity(self.hostnqn, self.subnqn, self.tls_identity_version, compat=compat)
        try:
            return TlsSession(server=False, identity=str(identity).encode(), psk=key.tls_psk(identity, compat=compat),
                              cipher=key.cipher, sha256_binder=self.tls_sha256_binder)
        except TlsError as exc:
            raise TransportError(self._queue_name(0), f"TLS unavailable: {exc}") from exc

    # Tests set this (monkeypatch) to serve plain TCP queues with HostQueue alone, the sans-IO reference model
    # the batch engine's fast path is compared against; not a user option.
    _reference_queues = False

    async def _open_queue(self, qid: int, size: int, incapsule: int) -> HostQueue:
        if self.transport == "rdma":
            return await self._open_rdma_queue(qid, size, incapsule)
        if self.engine == "batch":
            bq = BatchQueue(qid, queue_size=size, name=self._queue_name(qid), hdr_digest=self.hdr_digest,
                            data_digest=self.data_digest, incapsule_size=incapsule, timeout=self.timeout,
                            poll_us=self.poll_us, tls=self._tls_session())
            bq.on_broken = self._queue_broken
            return await open_batch_queue(bq, self.traddr, self.trsvcid, self.timeout)
        queue = HostQueue(qid, queue_size=size, name=self._queue_name(qid), hdr_digest=self.hdr_digest,
                          data_digest=self.data_digest, incapsule_size=incapsule, timeout=self.timeout,
                          tls=self._tls_session())
        if self.transport == "loop":
            # duck-typed (target.core.Target.connect_loop): the host library does not import the target
            def factory(pf: Any) -> Any:
                return self.target.connect_loop(pf)
        else:
            loop = asyncio.get_running_loop()

            def factory(pf: Any) -> Any:
                return loop.create_connection(pf, self.traddr, self.trsvcid)
        queue.on_broken = self._queue_broken
        return await open_queue(factory, queue, self.timeout)

    async def _open_rdma_queue(self, qid: int, size: int, incapsule: int) -> HostQueue:
        from initiator.rdma import RdmaQueue, open_rdma_queue

        # in-capsule data on NVMe/RDMA only where the controller advertises offset SGLs (SGLS.SAOS)
        if qid == 0 or self.identity is None or not self.identity.sgls & SGLS_OFFSET:
            incapsule = 0
        queue = RdmaQueue(qid, queue_size=size, name=self._queue_name(qid), incapsule_size=incapsule,
                          timeout=self.timeout, cntlid=self.cntlid if qid else 0)
        queue.on_broken = self._queue_broken
        return await open_rdma_queue(queue, self.traddr, self.trsvcid, self.timeout)  # type: ignore[return-value]

    def _queue_broken(self, err: TransportError) -> None:
        if self._closed:
            return
        log.warning("%s", err)
        callback, self.on_transport_error = self.on_transport_error, None
        if callback is not None:
            callback(err)

    async def _connect_queue(self, queue: HostQueue, sqsize: int, cntlid: int, kato: int) -> int:
        cmd = c.connect(queue.qid, sqsize, kato_ms=kato, disable_sqflow=self.disable_sqflow)
        data = c.connect_data(self.hostid.bytes, cntlid, self.subnqn, self.hostnqn)
        try:
            cqe = await queue.submit(cmd, data_out=data)
        except NvmeError as err:
            raise self._connect_error(err, queue.qid) from None
        cntlid = cqe.dw0 & 0xFFFF
        if cqe.dw0 & c.CONNECT_AUTHREQ_ASCR:
            # nvmf_connect_admin_queue: secure channel concatenation (TLS after DH-HMAC-CHAP) is not implemented
            raise NvmeError(Status.AUTH_REQUIRED, f"{queue.name}: the target requires secure channel "
                            "concatenation (AUTHREQ.ASCR), which this host does not implement")
        if cqe.dw0 & c.CONNECT_AUTHREQ_ATR:
            if self._host_secret is None:
                raise NvmeError(Status.AUTH_REQUIRED, f"{queue.name}: the target requires DH-HMAC-CHAP "
                                "authentication (AUTHREQ.ATR); give the host secret: dhchap_secret= "
                                "(--dhchap-secret DHHC-1:...)")
            await self._authenticate(queue)
        elif self._ctrl_secret is not None:
            # The kernel host skips authentication when the controller does not ask for it; a host given a
            # controller secret wants the controller to prove itself, so it authenticates anyway (the spec
            # lets the host start a transaction after Connect).
            await self._authenticate(queue)
        return cntlid

    async def _authenticate(self, queue: HostQueue) -> None:
        assert self._host_secret is not None
        t_id, self._auth_tid = self._auth_tid, (self._auth_tid + 1) & 0xFFFF
        await authenticate_queue(queue, hostnqn=self.hostnqn, subnqn=self.subnqn, host_secret=self._host_secret,
                                 ctrl_secret=self._ctrl_secret, t_id=t_id, name=queue.name)
        if queue.qid == 0:
            self._authenticated = True

    @property
    def authenticated(self) -> bool:
        """True once the admin queue passed DH-HMAC-CHAP (the target asked for it, or a controller secret was
        given); False for a controller that never required authentication."""
        return self._authenticated

    async def reauthenticate(self, *, dhchap_secret: str | DhchapSecret | None = None,
                             dhchap_ctrl_secret: str | DhchapSecret | None = None) -> None:
        """Run DH-HMAC-CHAP again on every queue, admin queue first (the kernel's nvme_ctrl_auth_work, as a
        write of sysfs dhchap_secret / dhchap_ctrl_secret triggers it). New secrets, if given, replace the
        old ones first. A failure closes the controller (the target tears it down) and raises AuthFailure
        or NvmeError naming the queue and the reason."""
        host = self._host_secret if dhchap_secret is None else dhchap_secret
        ctrl = self._ctrl_secret if dhchap_ctrl_secret is None else dhchap_ctrl_secret
        host_secret, ctrl_secret = _parse_secrets(host, ctrl)
        if host_secret is None:
            raise ValueError("reauthenticate needs a host secret (dhchap_secret=)")
        if self.admin is None or self._closed:
            raise RuntimeError(f"{self._queue_name(0)}: not connected")
        self._host_secret, self._ctrl_secret = host_secret, ctrl_secret
        try:
            await self._authenticate(self.admin)
            results = await asyncio.gather(*(self._authenticate(q) for q in self.io_queues), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        except (AuthFailure, NvmeError, TransportError, TimeoutError):
            await self.close()
            raise

    def _connect_error(self, err: NvmeError, qid: int) -> NvmeError:
        what = f"Connect (qid {qid}) to {self.traddr}:{self.trsvcid}"
        if err.status == Status.CONNECT_INVALID_PARAM:
            iattr, ipo = parse_connect_invalid_param(err.result)
            if iattr & CONNECT_IATTR_DATA:
                field = _CONNECT_DATA_FIELDS.get(ipo, f"byte {ipo}")
                if field == "subsysnqn":
                    detail = f"target rejected subsystem NQN {self.subnqn!r} (no such subsystem here)"
                elif field == "hostnqn":
                    detail = f"target rejected host NQN {self.hostnqn!r}"
                elif field == "cntlid":
                    detail = f"target rejected controller ID {self.cntlid:#x}"
                else:
                    detail = f"target rejected Connect data field {field}"
            else:
                field = _CONNECT_SQE_FIELDS.get(ipo, f"byte {ipo}")
                detail = f"target rejected Connect command field {field}"
        elif err.status == Status.CONNECT_INVALID_HOST:
            detail = f"host NQN {self.hostnqn!r} is not allowed to access subsystem {self.subnqn!r}"
        elif err.status == Status.CONNECT_CTRL_BUSY:
            detail = "the controller is busy (controller ID in use or no controller free)"
        elif err.status == Status.CONNECT_FORMAT:
            detail = "the target does not support this Connect format (RECFMT)"
        else:
            detail = "Connect failed"
        return NvmeError(err.status, f"{what}: {detail}", dnr=err.dnr, more=err.more, result=err.result)

    async def open(self) -> HostController:
        """Run the whole connect sequence; on any failure every queue opened so far is closed."""
        try:
            await self._open()
        except BaseException:
            self._abort_queues()
            raise
        return self

    async def _open(self) -> None:
        kato = 0 if self.is_discovery and self.kato == defaults.DEFAULT_KATO_MS else self.kato
        self.kato = kato
        self.admin = await self._open_queue(0, defaults.ADMIN_QUEUE_SIZE, defaults.ADMIN_INCAPSULE_SIZE)
        self.cntlid = await self._connect_queue(self.admin, defaults.ADMIN_QUEUE_SIZE - 1,
                                                CONNECT_ADMIN_CNTLID, kato)
        await self._enable()
        self.identity = ident = await self.identify_controller()
        self._check_identity(ident)
        self.vs = await self.get_property(Property.VS)
        if not self.is_discovery and self.nr_io_queues:
            await self._create_io_queues(ident)
        if kato:
            self._tasks.append(asyncio.create_task(self._keep_alive_loop(kato / 2000.0)))
        aen = ident.oaes & AEN_MASK
        if aen:
            try:
                await self.set_features(FeatureId.ASYNC_EVENT, aen)
            except NvmeError as err:
                # nvme_enable_aen only warns: the controller works, it just sends no events.
                log.warning("%s: Set Features Async Event Configuration failed: %s", self._queue_name(0), err)
            else:
                self._tasks.append(asyncio.create_task(self._aer_loop()))
        if not self.is_discovery and ident.cmic & CMIC_ANA:
            # nvme_mpath_init_identify: ANA capable, so read the log before any I/O is routed (after the
            # AER is armed, so a change from here on is reported and re-read)
            self.ana_supported = True
            self.anatt = ident.anatt
            await self.get_ana_log()

    async def _enable(self) -> None:
        """nvme_enable_ctrl: CAP, CC without EN, CC with EN, then CSTS.RDY within CAP.TO."""
        self.cap = cap = await self.get_property(Property.CAP, 8)
        if c.cap_mpsmin(cap) > 0:
            raise RuntimeError(f"{self._queue_name(0)}: controller minimum page size "
                               f"{1 << (12 + c.cap_mpsmin(cap))} exceeds the host's 4096")
        css = c.CC_CSS_CSI if cap & c.CAP_CSS_CSI else c.CC_CSS_NVM
        cc = css | c.CC_AMS_RR | c.CC_IOSQES | c.CC_IOCQES
        await self.set_property(Property.CC, cc)
        self.cap = await self.get_property(Property.CAP, 8)
        await self.set_property(Property.CC, cc | c.CC_EN)
        deadline = time.monotonic() + c.cap_timeout_s(cap)
        while True:
            csts = await self.get_property(Property.CSTS)
            if csts & c.CSTS_CFS:
                raise RuntimeError(f"{self._queue_name(0)}: controller fatal status (CSTS.CFS) "
                                   "while enabling")
            if csts & c.CSTS_RDY:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self._queue_name(0)}: CSTS.RDY not set within "
                                   f"{c.cap_timeout_s(cap)} s (CAP.TO) of CC.EN=1")
            await asyncio.sleep(0.01)

    def _check_identity(self, ident: Container) -> None:
        """The checks the Linux host applies to a fabrics controller's Identify data."""
        where = self._queue_name(0)
        if ident.cntlid != self.cntlid:
            raise RuntimeError(f"{where}: Identify CNTLID {ident.cntlid:#x} does not match the Connect "
                               f"CNTLID {self.cntlid:#x}")
        if ident.icdoff != 0:
            raise RuntimeError(f"{where}: ICDOFF {ident.icdoff} is not supported (must be 0)")
        if self.is_discovery:
            if ident.cntrltype not in (0, CNTRLTYPE_DISCOVERY):
                raise RuntimeError(f"{where}: not a discovery controller (CNTRLTYPE {ident.cntrltype})")
        else:
            if ident.kas == 0:
                raise RuntimeError(f"{where}: KAS is 0; keep-alive support is mandatory for fabrics")
            if ident.ioccsz < 4:
                raise RuntimeError(f"{where}: IOCCSZ {ident.ioccsz} is below the minimum of 4 (64 bytes)")
        if self.transport == "rdma" and not ident.sgls & SGLS_KEYED:
            raise RuntimeError(f"{where}: SGLS {ident.sgls:#x} lacks keyed SGL data blocks, which NVMe/RDMA needs")
        self.mdts_bytes = (1 << ident.mdts) * defaults.PAGE_SIZE if ident.mdts else 0
        self.io_incapsule_size = max(ident.ioccsz * 16 - 64, 0)

    async def _create_io_queues(self, ident: Container) -> None:
        n = self.nr_io_queues
        try:
            granted = await self.set_features(FeatureId.NUM_QUEUES, (n - 1) | ((n - 1) << 16))
        except NvmeError as err:
            # Like nvme_set_queue_count: an NVMe status leaves an admin-only controller.
            log.warning("%s: Set Features Number of Queues failed (%s); no I/O queues",
                        self._queue_name(0), err)
            return
        n = min(n, (granted & 0xFFFF) + 1, (granted >> 16) + 1)
        size = min(self.queue_size, c.cap_mqes(self.cap) + 1)
        if ident.maxcmd:
            size = min(size, ident.maxcmd)
        size = max(size, 2)
        queues = await asyncio.gather(
            *(self._open_queue(qid, size, self.io_incapsule_size) for qid in range(1, n + 1)),
            return_exceptions=True)
        errors = [q for q in queues if isinstance(q, BaseException)]
        self.io_queues = [q for q in queues if not isinstance(q, BaseException)]
        if errors:
            raise errors[0]
        results = await asyncio.gather(
            *(self._connect_queue(q, size - 1, self.cntlid, 0) for q in self.io_queues),
            return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def disconnect(self) -> None:
        """Shut the controller down (CC.SHN normal, wait for CSTS.SHST complete) and close every queue."""
        if self._closed:
            return
        self._closed = True
        await self._stop_tasks()
        if self.admin is not None and self.admin.broken is None:
            try:
                await self._shutdown()
            except (NvmeError, TransportError, TimeoutError) as err:
                log.warning("%s: shutdown incomplete: %s", self._queue_name(0), err)
        self._abort_queues()
        await self._wait_queues_closed()
        if self._owns_events:
            self._events.put_nowait(None)

    async def close(self) -> None:
        """Drop every connection without the CC.SHN shutdown (the target sees the host vanish)."""
        if self._closed:
            return
        self._closed = True
        await self._stop_tasks()
        self._abort_queues()
        await self._wait_queues_closed()
        if self._owns_events:
            self._events.put_nowait(None)

    async def _shutdown(self) -> None:
        cc = await self.get_property(Property.CC)
        await self.set_property(Property.CC, (cc & ~c.CC_SHN_MASK) | c.CC_SHN_NORMAL)
        rtd3e = (self.identity.rtd3e / 1e6) if self.identity is not None else 0.0
        limit = max(SHUTDOWN_TIMEOUT, min(rtd3e, 60.0))
        deadline = time.monotonic() + limit
        while True:
            csts = await self.get_property(Property.CSTS)
            if csts & c.CSTS_SHST_MASK == c.CSTS_SHST_CMPLT:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"CSTS.SHST did not report shutdown complete within {limit} s")
            await asyncio.sleep(0.01)

    async def _stop_tasks(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _abort_queues(self) -> None:
        for q in self.io_queues:
            q.close()
        if self.admin is not None:
            self.admin.close()

    async def _wait_queues_closed(self) -> None:
        queues = [*self.io_queues, *([self.admin] if self.admin else [])]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(q.wait_closed() for q in queues)), 5.0)

    async def __aenter__(self) -> HostController:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.disconnect()

    # ---- background work ---------------------------------------------------------------------

    async def _keep_alive_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.keep_alive()
            except NvmeError as err:
                log.warning("%s: Keep Alive failed: %s", self._queue_name(0), err)
            except TransportError as err:
                log.warning("%s: keep-alive stopped: %s", self._queue_name(0), err)
                return

    async def _event_logs(self, ev: AsyncEvent) -> AsyncEvent:
        """``ev`` with the log its event asks to read (ANA 0Ch, Changed Namespace List, Reservation
        Notification); a read the controller refuses or that does not parse is logged and the event goes out
        without it. TransportError passes: the AER loop ends with the connection."""
        if ev.type == AsyncEventType.NOTICE and ev.info == AsyncEventNotice.ANA_CHANGE:
            # nvme_handle_aen_notice -> nvme_ana_work: re-read log 0Ch; reading it without RAE also
            # tells the controller the event was seen, so it can report the next one
            ana_log = await self._read_event_log(self.get_ana_log, "the ANA log after an ANA change event")
            return ev if ana_log is None else dataclasses.replace(ev, ana_log=ana_log)
        if ev.type == AsyncEventType.NOTICE and ev.info == AsyncEventNotice.NS_ATTR_CHANGED:
            self._ns_cache.clear()

            async def changed() -> tuple[int, ...]:
                page = await self.get_log_page(LogPageId.CHANGED_NS, CHANGED_NS_LOG_SIZE)
                return tuple(parse_changed_ns_list(page))

            nsids = await self._read_event_log(changed, "the Changed Namespace List")
            return ev if nsids is None else dataclasses.replace(ev, changed_nsids=nsids)
        if ev.type == AsyncEventType.IO_CMD_SET and ev.info == AEN_INFO_RESERVATION_LOG:
            # reading log 80h without RAE is what lets the controller report again; NALP says whether
            # more pages wait behind the one read
            pages = await self._read_event_log(self._drain_reservation_log, "the Reservation Notification log")
            return ev if pages is None else dataclasses.replace(ev, reservations=pages)
        return ev

    async def _read_event_log(self, read: Callable[[], Awaitable[_T]], what: str) -> _T | None:
        try:
            return await read()
        except (NvmeError, ValueError) as err:
            log.warning("%s: reading %s failed: %s", self._queue_name(0), what, err)
            return None

    async def _aer_loop(self) -> None:
        """Keep one AER outstanding; deliver each event, reading the Changed NS log for NS notices."""
        assert self.admin is not None
        while True:
            try:
                cqe = await self.admin.submit(c.async_event_request(), timeout=None)
            except TransportError:
                return
            except NvmeError as err:
                log.warning("%s: Asynchronous Event Request failed: %s", self._queue_name(0), err)
                return
            dw0 = cqe.dw0
            ev = AsyncEvent(dw0 & 0x7, (dw0 >> 8) & 0xFF, (dw0 >> 16) & 0xFF, dw0)
            try:
                ev = await self._event_logs(ev)
            except TransportError:
                return
            if self._events.qsize() >= MAX_QUEUED_EVENTS:
                self._events.get_nowait()  # nobody is reading events(): keep the newest ones only
            self._events.put_nowait(ev)
            if self.event_callback is not None:
                try:
                    result = self.event_callback(ev)
                    if asyncio.iscoroutine(result):
                        await result
                except Exception:
                    log.exception("%s: event callback failed", self._queue_name(0))

    async def _drain_reservation_log(self) -> tuple[ReservationNotification, ...]:
        pages: list[ReservationNotification] = []
        while len(pages) < MAX_RESERVATION_PAGES:
            page = await self.get_reservation_log()
            if page.empty:
                break
            pages.append(page)
            if not page.nalp:
                break
        return tuple(pages)

    async def events(self) -> AsyncIterator[AsyncEvent]:
        """Asynchronous events as they arrive; the iteration ends when the controller is closed."""
        while True:
            ev = await self._events.get()
            if ev is None:
                self._events.put_nowait(None)  # let every other iterator end as well
                return
            yield ev

    # ---- admin commands ----------------------------------------------------------------------

    def _admin(self) -> HostQueue:
        if self.admin is None:
            raise RuntimeError("controller is not connected")
        return self.admin

    async def admin_command(self, cmd: Command, *, data_out: Buffer | None = None,
                            data_in: bytearray | memoryview | None = None,
                            timeout: Any = DEFAULT_TIMEOUT) -> Completion:
        """Send any admin command (passthrough); raises NvmeError on a non-success status."""
        return await self._admin().submit(cmd, data_out=data_out, data_in=data_in, timeout=timeout)

    async def get_property(self, offset: int, size: int | None = None) -> int:
        """Property Get; ``size`` 4 or 8 (default: 8 for CAP, 4 otherwise)."""
        size = size or (8 if offset == Property.CAP else 4)
        if size not in (4, 8):
            raise ValueError(f"property size must be 4 or 8, got {size}")
        cqe = await self._admin().submit(c.property_get(offset, size))
        return cqe.result if size == 8 else cqe.dw0

    async def set_property(self, offset: int, value: int, size: int = 4) -> None:
        if size not in (4, 8):
            raise ValueError(f"property size must be 4 or 8, got {size}")
        if not 0 <= value < 1 << (8 * size):
            raise ValueError(f"property value {value:#x} does not fit {size} bytes")
        await self._admin().submit(c.property_set(offset, value, size))

    async def identify(self, cns: int, *, nsid: int = 0, cntid: int = 0, csi: int = 0) -> bytearray:
        buf = bytearray(IDENTIFY_DATA_SIZE)
        await self._admin().submit(c.identify(cns, nsid=nsid, cntid=cntid, csi=csi), data_in=buf)
        return buf

    async def identify_controller(self) -> Container:
        return IdentifyController.parse(bytes(await self.identify(Cns.CONTROLLER)))

    async def identify_namespace(self, nsid: int) -> Container:
        check_nsid(nsid)
        return IdentifyNamespace.parse(bytes(await self.identify(Cns.NAMESPACE, nsid=nsid)))

    async def namespace_descriptors(self, nsid: int) -> dict[str, bytes | int]:
        check_nsid(nsid)
        return parse_ns_descriptor_list(await self.identify(Cns.NS_DESC_LIST, nsid=nsid))

    async def namespaces(self) -> list[int]:
        """Active NSIDs (Identify CNS 02h), following the list past 1024 entries."""
        out: list[int] = []
        start = 0
        while True:
            page = parse_active_ns_list(await self.identify(Cns.ACTIVE_NS_LIST, nsid=start))
            out.extend(page)
            if len(page) < IDENTIFY_DATA_SIZE // 4 or page[-1] >= NSID_MAX:
                return out
            start = page[-1]

    async def get_log_page(self, lid: int, length: int, *, offset: int = 0, nsid: int = c.NSID_ALL,
                           rae: bool = False, lsp: int = 0, lsi: int = 0) -> bytes:
        """Get Log Page, split into MDTS-sized pieces; RAE stays set on all but the last piece."""
        if length <= 0 or length % 4:
            raise ValueError(f"log page length must be a positive multiple of 4, got {length}")
        buf = bytearray(length)
        view = memoryview(buf)
        chunk = self.mdts_bytes or length
        pos = 0
        while pos < length:
            n = min(chunk, length - pos)
            last = pos + n == length
            cmd = c.get_log_page(lid, n, offset=offset + pos, nsid=nsid, rae=rae or not last, lsp=lsp,
                                 lsi=lsi)
            await self._admin().submit(cmd, data_in=view[pos:pos + n])
            pos += n
        return bytes(buf)

    @property
    def ana_log_size(self) -> int:
        """Bytes of the ANA log buffer, sized as nvme_mpath_init_identify does: the header, NANAGRPID group
        descriptors and MNAN NSIDs (NN when a controller reports MNAN 0, which the Linux host refuses)."""
        ident = self.identity
        if ident is None:
            raise RuntimeError("controller is not connected")
        return ana_log_size(ident.nanagrpid, ident.mnan or ident.nn)

    async def get_ana_log(self, rgo: bool = False) -> AnaLog:
        """Get Log Page 0Ch (Asymmetric Namespace Access); ``rgo`` asks for groups only, without NSIDs.

        A full read (``rgo`` False) also becomes :attr:`ana_log`, which :meth:`ana_state` answers from."""
        if not self.ana_supported:
            raise NvmeError(Status.INVALID_LOG_PAGE, f"{self.subnqn} does not report ANA (Identify CMIC "
                            "bit 3 is clear), so it has no ANA log page")
        assert self.identity is not None
        size = ana_log_size(self.identity.nanagrpid, 0) if rgo else self.ana_log_size
        async with self._ana_lock:   # nvme_read_ana_log holds ctrl->ana_lock the same way
            page = await self.get_log_page(LogPageId.ANA, (size + 3) & ~3, lsp=ANA_LOG_RGO if rgo else 0)
            ana = parse_ana_log(page)
            if not rgo:
                self.ana_log = ana
                self._ana_nsids = {nsid: g.state for g in ana.groups for nsid in g.nsids}
        return ana

    def ana_state(self, nsid: int) -> AnaState | int | None:
        """Namespace ``nsid``'s ANA state on this controller from the last log read: OPTIMIZED for a
        controller without ANA reporting (nvme_mpath_add_disk), None when the log does not list it."""
        if not self.ana_supported:
            return AnaState.OPTIMIZED
        return self._ana_nsids.get(nsid)

    async def ana_states(self) -> dict[int, AnaState | int]:
        """{nsid: ANA state} on this controller, from a fresh read of the ANA log."""
        if not self.ana_supported:
            return dict.fromkeys(await self.namespaces(), AnaState.OPTIMIZED)
        await self.get_ana_log()
        return dict(self._ana_nsids)

    async def get_reservation_log(self) -> ReservationNotification:
        """Get Log Page 80h (Reservation Notification): the oldest page waiting on this controller, which the
        read takes off its queue (``nalp``: how many more wait). The event loop reads it on each Reservation
        Log Page Available event (:attr:`AsyncEvent.reservations`), so this finds what that left."""
        return parse_notification(await self.get_log_page(LogPageId.RESERVATION, NOTIFICATION_LOG_SIZE))

    async def get_features(self, fid: int, *, sel: int = 0, cdw11: int = 0, nsid: int = 0,
                           data_len: int = 0) -> int | tuple[int, bytes]:
        """Get Features: DW0 of the completion, or (DW0, data) when ``data_len`` is given."""
        cmd = c.get_features(fid, sel=sel, cdw11=cdw11, nsid=nsid)
        if data_len:
            buf = bytearray(data_len)
            cqe = await self._admin().submit(cmd, data_in=buf)
            return cqe.dw0, bytes(buf)
        return (await self._admin().submit(cmd)).dw0

    async def set_features(self, fid: int, cdw11: int = 0, *, save: bool = False, nsid: int = 0,
                           cdw12: int = 0, data: Buffer | None = None) -> int:
        """Set Features; returns DW0 of the completion (e.g. the queues granted for FID 07h)."""
        cmd = c.set_features(fid, cdw11, save=save, nsid=nsid, cdw12=cdw12)
        return (await self._admin().submit(cmd, data_out=data)).dw0

    async def keep_alive(self) -> None:
        await self._admin().submit(c.keep_alive())

def _parse_hostid(hostid: str | uuid.UUID | bytes) -> uuid.UUID:
    if isinstance(hostid, uuid.UUID):
        return hostid
    if isinstance(hostid, bytes | bytearray):
        if len(hostid) != 16:
            raise ValueError(f"hostid must be 16 bytes, got {len(hostid)}")
        return uuid.UUID(bytes=bytes(hostid))
    try:
        return uuid.UUID(hostid)
    except ValueError:
        raise ValueError(f"hostid {hostid!r} is not a UUID") from None

