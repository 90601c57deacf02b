"""The target process: restore or create the configuration, start listeners and the REST API, and
shut everything down cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

from nvmeof import defaults
from nvmeof.uri import TransportAddress

log = logging.getLogger("nvmeof.daemon")


class DaemonError(Exception):
    """The daemon cannot start; the message says why and what to do."""


@dataclass
class DaemonOptions:
    config_path: Path | None = None
    listen: list[TransportAddress] = field(default_factory=list)
    discovery: list[TransportAddress] = field(default_factory=list)
    api: tuple[str, int] | None = (defaults.LISTEN_ADDRESS, defaults.API_PORT)
    api_token: str | None = None
    subsystem_nqn: str = defaults.DEFAULT_SUBSYSTEM_NQN
    ramdisk_size: int = defaults.RAMDISK_DEFAULT_SIZE
    block_size: int = defaults.DEFAULT_BLOCK_SIZE
    workers: int = 0   # processes serving TCP I/O queues; 0 serves everything in this process


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _EmbeddedServer:
    """uvicorn inside our event loop, on a socket we bind ourselves so a busy port is our error to report."""

    def __init__(self, app, sock: socket.socket, log_level: str) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            # The daemon owns SIGINT/SIGTERM; uvicorn must not replace our handlers.
            def install_signal_handlers(self) -> None:
                pass

            @contextlib.contextmanager
            def capture_signals(self):
                yield

        config = uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False)
        self.server = Server(config)
        self.sock = sock
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self.task, 5)
        self.sock.close()


class Daemon:
    def __init__(self, options: DaemonOptions) -> None:
        from target.core import Target
        from target.service import TargetService

        self.options = options
        if options.workers < 0:
            raise DaemonError(f"--workers {options.workers}: give 0 (one process) or a positive number of workers")
        if options.workers:
            from target.workers import PooledTarget

            self.target: Target = PooledTarget(options.workers)
        else:
            self.target = Target()
        self.service = TargetService(self.target, config_path=options.config_path)
        self.api_server: _EmbeddedServer | None = None
        self.restore_errors: list[str] = []
        self._stop = asyncio.Event()

    async def start(self) -> None:
        opts = self.options
        start_workers = getattr(self.target, "start_workers", None)
        if start_workers is not None:
            # Before the configuration is replayed, so every namespace reaches the workers as it appears.
            await start_workers()
        if opts.api is not None:
            host, port = opts.api
            token = opts.api_token or os.environ.get("NVMEOF_API_TOKEN") or None
            if not is_loopback(host) and not token:
                raise DaemonError(f"the REST API would listen on {host}:{port}, beyond loopback, without a token: "
                                  "pass --api-token TOKEN (or set NVMEOF_API_TOKEN), or --api 127.0.0.1:PORT")
            opts.api_token = token
        config = None
        if opts.config_path is not None and opts.config_path.exists():
            from target.config import load_config

            try:
                config = load_config(opts.config_path)
            except Exception as e:  # the message names the file and the problem
                raise DaemonError(f"cannot load configuration {opts.config_path}: {e}") from e
        if config is not None:
            self.restore_errors = await self.service.restore(config)
            for err in self.restore_errors:
                log.error("configuration %s: not restored: %s", opts.config_path, err)
            kept = self.service.unrestored()
            if kept:
                log.warning("configuration %s: %d item(s) not restored are kept in the file and retried at the "
                            "next start: %s; see GET /api/v1/config/unrestored (retry or discard them there)",
                            opts.config_path, len(kept), ", ".join(entry["where"] for entry in kept))
        else:
            await self._create_default()
        await self._add_listeners(opts.listen, discovery=False)
        await self._add_listeners(opts.discovery, discovery=True)
        if opts.api is not None:
            self._start_api(*opts.api)

    async def _create_default(self) -> None:
        opts = self.options
        await self.service.add_subsystem(opts.subsystem_nqn, allow_any_host=True)
        await self.service.add_namespace(opts.subsystem_nqn, backend="ram", size=opts.ramdisk_size,
                                         block_size=opts.block_size)
        if not opts.listen:
            opts.listen = [TransportAddress("tcp", defaults.LISTEN_ADDRESS, defaults.TCP_IO_PORT)]
        if not opts.discovery:
            opts.discovery = [TransportAddress("tcp", defaults.LISTEN_ADDRESS, defaults.TCP_DISCOVERY_PORT)]

    async def _add_listeners(self, addresses: list[TransportAddress], *, discovery: bool) -> None:
        from target.service import ServiceError

        existing = {(lst.trtype, lst.traddr, int(lst.trsvcid)) for lst in self.target.listeners.values()}
        for addr in addresses:
            if (addr.trtype, addr.traddr, addr.trsvcid) in existing:
                continue
            try:
                await self.service.add_listener(addr.trtype, addr.traddr, addr.trsvcid, discovery=discovery)
            except ServiceError as e:
                raise DaemonError(f"cannot listen on {addr}: {e}") from e

    def _start_api(self, host: str, port: int) -> None:
        from api.app import create_app

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise DaemonError(f"cannot start the REST API on {host}:{port}: {e.strerror}; "
                              "pick another with --api HOST:PORT or disable it with --api none") from e
        sock.listen(128)
        sock.setblocking(False)
        app = create_app(self.service, token=self.options.api_token)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        self.api_server = _EmbeddedServer(app, sock, "warning" if level == "info" else level)
        self.api_server.start()

    def request_stop(self) -> None:
        self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    async def stop(self) -> None:
        if self.api_server is not None:
            await self.api_server.stop()
        await self.target.close()

    def banner(self) -> str:
        lines = ["nvmeof target is running."]
        ios = [lst for lst in self.target.listeners.values() if not lst.discovery]
        discs = [lst for lst in self.target.listeners.values() if lst.discovery]
        for sub in self.target.subsystems.values():
            if sub.nqn == defaults.DISCOVERY_NQN:
                continue
            nss = ", ".join(f"nsid {ns.nsid}: {ns.spec.get('backend', '?')} {ns.backend.size / 2**20:.0f} MiB"
                            for ns in sub.namespaces.values())
            lines.append(f"  subsystem {sub.nqn}  ({nss or 'no namespaces'})")
        for lst in ios:
            lines.append(f"  I/O listener        {lst.trtype}://{lst.traddr}:{lst.trsvcid}")
        for lst in discs:
            lines.append(f"  discovery listener  {lst.trtype}://{lst.traddr}:{lst.trsvcid}")
        if self.api_server is not None and self.options.api is not None:
            host, port = self.options.api
            lines.append(f"  REST API            http://{host}:{port}/docs")
        if ios:
            io = ios[0]
            disc = discs[0] if discs else io
            sub = next((s for s in self.target.subsystems.values() if s.nqn != defaults.DISCOVERY_NQN), None)
            nqn = sub.nqn if sub else "<subsystem NQN>"
            lines += [
                "Connect with nvme-cli (Linux kernel host, needs the nvme-tcp module):",
                f"  nvme discover -t {disc.trtype} -a {disc.traddr} -s {disc.trsvcid}",
                f"  nvme connect -t {io.trtype} -a {io.traddr} -s {io.trsvcid} -n {nqn}",
                "Connect with the Python initiator:",
                f"  nvmeof discover -a {disc.traddr} -s {disc.trsvcid}",
                f"  nvmeof identify -a {io.traddr} -s {io.trsvcid} -n {nqn}",
                f"  python3 -c \"import initiator.sync as h; c = h.connect('{io.traddr}', {io.trsvcid}, "
                f"subnqn='{nqn}'); print(c.namespaces()); c.close()\"",
            ]
        kept = self.service.unrestored()
        if kept:
            lines.append(f"NOT RESTORED from {self.options.config_path} (kept in it, retried at the next start):")
            lines += [f"  {entry['where']}: {entry['error']}" for entry in kept]
        lines.append("Stop with Ctrl-C (SIGINT) or SIGTERM.")
        return "\n".join(lines)


async def serve(options: DaemonOptions, *, ready=None) -> int:
    daemon = Daemon(options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, daemon.request_stop)
    try:
        try:
            await daemon.start()
        except DaemonError:
            await daemon.stop()
            raise
        if ready is not None:
            ready(daemon)
        await daemon.wait()
        log.info("shutting down")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    await daemon.stop()
    return 0
