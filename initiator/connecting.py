"""``initiator.connect``: the composition of HostController and ReconnectingController.

It lives apart from both so neither imports the other's module in a cycle: reconnect.py builds on
controller.py, and this module on both (tests/test_layers.py checks the initiator has no import cycle).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from initiator.auth import parse_secret
from initiator.controller import AsyncEvent, HostController
from initiator.multipath import MultipathController
from initiator.reconnect import ReconnectingController
from nvmeof import defaults
from nvmeof.auth import DhchapSecret
from nvmeof.tls.psk import TlsKey


class _Connecting:
    """What :func:`connect` returns: await it for the controller, or use it with ``async with``."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._ctrl: Any = None

    def __await__(self) -> Any:
        return self._make().__await__()

    async def __aenter__(self) -> Any:
        self._ctrl = await self._make()
        return self._ctrl

    async def __aexit__(self, *exc: object) -> None:
        await self._ctrl.disconnect()


def connect(traddr: str, trsvcid: int | str = defaults.TCP_IO_PORT,
            subnqn: str = defaults.DEFAULT_SUBSYSTEM_NQN, hostnqn: str | None = None,
            hostid: str | uuid.UUID | bytes | None = None, transport: str = "tcp",
            nr_io_queues: int = 1, queue_size: int = defaults.MAX_QUEUE_SIZE, hdr_digest: bool = False,
            data_digest: bool = False, kato: int = defaults.DEFAULT_KATO_MS, timeout: float = 30.0, *,
            target: Any = None, disable_sqflow: bool = False,
            event_callback: Callable[[AsyncEvent], Any] | None = None, reconnect: bool = False,
            max_reconnect_delay: float = 30.0, reconnect_attempts: int | None = None,
            dhchap_secret: str | DhchapSecret | None = None,
            dhchap_ctrl_secret: str | DhchapSecret | None = None,
            poll_us: int = defaults.POLL_US, tls: bool = False, tls_key: str | TlsKey | None = None,
            tls_identity_version: int = defaults.TLS_IDENTITY_VERSION, tls_compat: bool = False,
            tls_sha256_binder: bool = False) -> _Connecting:
    """Connect to an NVMe-oF controller: ``ctrl = await connect(...)`` or ``async with connect(...) as ctrl``.

    With ``reconnect=True`` the result is a :class:`initiator.reconnect.ReconnectingController`.
    ``dhchap_secret`` (and for bidirectional authentication ``dhchap_ctrl_secret``) are DHHC-1 strings as
    ``nvme gen-dhchap-key`` writes them; every queue authenticates when the target asks for it.
    NVMe/TCP queues run on the batch engine (initiator/engine.py: one socket per queue, cid-indexed command
    slots, one sendmsg per wake-up; every PDU it does not fast-path goes through the sans-IO TcpConnection).
    ``poll_us`` > 0 (batch engine) busy-polls the socket up to that many µs after a batch before sleeping.
    ``tls_key`` (an ``NVMeTLSkey-1:...:`` configured PSK; implies ``tls=True``) runs every queue over TLS 1.3
    with the PSK identity of version ``tls_identity_version`` (1: NVMe1R with digest, 0: NVMe0R); its bytes
    go through the TLS session (initiator/queue.py HostQueue). ``tls_sha256_binder=True`` (interop, default off)
    offers a SHA-384 PSK with a SHA-256 binder and suite, which a Linux nvmet TLS port needs while its tlshd
    runs on GnuTLS before 3.8.11 (Debian trixie's 3.8.9); TP 8011 binds it to SHA-384.
    """
    # parsed once: a bad secret is refused here, and a kept DhchapSecret never shows its key
    dhchap_secret = parse_secret("dhchap_secret (--dhchap-secret)", dhchap_secret)
    dhchap_ctrl_secret = parse_secret("dhchap_ctrl_secret (--dhchap-ctrl-secret)", dhchap_ctrl_secret)
    kwargs: dict[str, Any] = dict(
        hostnqn=hostnqn, hostid=hostid, transport=transport, nr_io_queues=nr_io_queues, queue_size=queue_size,
        hdr_digest=hdr_digest, data_digest=data_digest, kato=kato, timeout=timeout, target=target,
        disable_sqflow=disable_sqflow, event_callback=event_callback, dhchap_secret=dhchap_secret,
        dhchap_ctrl_secret=dhchap_ctrl_secret, poll_us=poll_us, tls=tls,
        tls_key=tls_key, tls_identity_version=tls_identity_version, tls_compat=tls_compat,
        tls_sha256_binder=tls_sha256_binder)
    if reconnect:
        async def make_reconnecting() -> Any:
            rc = ReconnectingController(traddr, trsvcid, subnqn, max_delay=max_reconnect_delay,
                                        attempts=reconnect_attempts, **kwargs)
            return await rc.open()
        return _Connecting(make_reconnecting)

    async def make() -> HostController:
        return await HostController(traddr, trsvcid, subnqn, **kwargs).open()
    return _Connecting(make)


def connect_multipath(paths: list[tuple[str, int | str]] | tuple[tuple[str, int | str], ...], subnqn: str, *,
                      iopolicy: str = "numa", no_path_timeout: float | None = None,
                      max_reconnect_delay: float = 5.0, hostnqn: str | None = None,
                      hostid: str | uuid.UUID | bytes | None = None, transport: str = "tcp",
                      dhchap_secret: str | DhchapSecret | None = None,
                      dhchap_ctrl_secret: str | DhchapSecret | None = None, **kwargs: Any) -> _Connecting:
    """Connect one controller per ``(traddr, trsvcid)`` path of subsystem ``subnqn`` and route I/O by ANA:
    ``mp = await connect_multipath(...)`` or ``async with connect_multipath(...) as mp``.

    The result is an :class:`initiator.multipath.MultipathController` with HostController's namespace I/O
    methods. ``kwargs`` are :func:`connect`'s controller options (nr_io_queues, kato, timeout, target, ...),
    the same for every path; ``iopolicy`` is "numa" (stay on the first optimized path) or "round-robin".
    """
    dhchap_secret = parse_secret("dhchap_secret (--dhchap-secret)", dhchap_secret)
    dhchap_ctrl_secret = parse_secret("dhchap_ctrl_secret (--dhchap-ctrl-secret)", dhchap_ctrl_secret)
    for bad in ("reconnect", "reconnect_attempts", "event_queue"):
        if bad in kwargs:
            raise ValueError(f"connect_multipath does not take {bad}=: every path reconnects by itself "
                             "(max_reconnect_delay sets the backoff's ceiling)")

    async def make() -> MultipathController:
        mp = MultipathController(list(paths), subnqn, iopolicy=iopolicy, no_path_timeout=no_path_timeout,
                                 max_reconnect_delay=max_reconnect_delay, hostnqn=hostnqn, hostid=hostid,
                                 transport=transport, dhchap_secret=dhchap_secret,
                                 dhchap_ctrl_secret=dhchap_ctrl_secret, **kwargs)
        return await mp.open()
    return _Connecting(make)
