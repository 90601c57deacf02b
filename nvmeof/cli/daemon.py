"""The target process: restore or create the configuration, start listeners and the REST API, and
shut everything down cleanly on SIGINT/SIGTERM. It lives in the composition layer (nvmeof/cli/), the one
place that may assemble the target, the REST API and the transports together (tests/test_layers.py).

The REST API always requires a token. Unless one is given (--api-token, NVMEOF_API_TOKEN) a random
one is generated at every start. Either way it is written to ``<state dir>/api-token`` (mode 0600,
in a state directory no other user can write) with ``<state dir>/api-endpoint`` next to it (one
line: ``http://ADDR:PORT`` or ``unix:PATH``), so the `nvmeof` CLI run by the same user or root
finds both by itself; both files are removed at a clean exit if they are still ours. On a Unix
socket (``--api unix:PATH``, mode 0600, like SPDK's RPC socket) the token is required as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from nvmeof import defaults
from nvmeof.cli.notify import notify, reloading
from nvmeof.uri import TransportAddress

log = logging.getLogger("nvmeof.daemon")


class DaemonError(Exception):
    """The daemon cannot start; the message says why and what to do."""


@dataclass
class DaemonOptions:
    config_path: Path | None = None
    listen: list[TransportAddress] = field(default_factory=list)
    discovery: list[TransportAddress] = field(default_factory=list)
    tls: str = "none"   # serve --tls: the TLS mode of the -l/-d listeners (none, optional, required)
    inline_data_size: int = defaults.IO_INCAPSULE_SIZE   # serve --inline-data-size: the -l listeners' in-capsule size
    api: tuple[str, int] | Path | None = (defaults.LISTEN_ADDRESS, defaults.API_PORT)  # a Path: a Unix socket
    api_token: str | None = None
    subsystem_nqn: str = defaults.DEFAULT_SUBSYSTEM_NQN
    ramdisk_size: int = defaults.RAMDISK_DEFAULT_SIZE
    block_size: int = defaults.DEFAULT_BLOCK_SIZE
    workers: int = 0   # processes serving TCP I/O queues; 0 serves everything in this process
    ic_timeout: float = defaults.TCP_ICREQ_TIMEOUT  # seconds a new NVMe/TCP connection has to send ICReq
    connect_timeout: float = defaults.TCP_CONNECT_TIMEOUT  # seconds from ICResp to the queue's Fabrics Connect
    auth_timeout: float = defaults.AUTH_TIMEOUT  # seconds a DH-HMAC-CHAP transaction may stall (target/auth.py)
    max_connections: int = defaults.TCP_MAX_CONNECTIONS  # NVMe/TCP connections in all (kept below RLIMIT_NOFILE)
    max_connections_per_listener: int = defaults.TCP_MAX_CONNECTIONS_PER_LISTENER  # NVMe/TCP connections per listener
    h2c_budget: int = defaults.TCP_H2C_GLOBAL_BUDGET  # R2T'd write bytes of all connections (split across workers)
    backing_dirs: list[Path] = field(default_factory=list)  # where file namespaces may live; <state dir>/disks if empty
    block_devices: list[Path] = field(default_factory=list)  # block devices (under /dev) namespaces may use
    state_dir: Path | None = None  # api-token and api-endpoint live here; defaults.state_dir() when None
    api_host_names: list[str] = field(default_factory=list)  # Host names the API answers to besides its address
    api_max_body: int = defaults.API_MAX_BODY  # bytes of one REST request body; larger gets 413
    ceph_confs: list[Path] = field(default_factory=list)  # Ceph configuration files RBD namespaces may use
    ceph_keyrings: list[Path] = field(default_factory=list)  # Ceph keyrings RBD namespaces may name
    rbd_images: list[dict[str, str]] = field(default_factory=list)  # default subsystem's RBD namespaces
    rbd_op_timeout: float = defaults.RBD_OP_TIMEOUT  # seconds an OSD/monitor call of an RBD namespace may take
    poll_us: int = defaults.POLL_US  # batch engine: µs of busy receives after a batch before sleeping (0: off)
    gateway_group: str | None = None  # the gateway group this target is a member of (target/gateway/)
    gateway_name: str | None = None  # this member's name in it (default: the host name)
    group_store: str | None = None  # dir:PATH or rados:POOL: where the group keeps membership, config, locks
    gateway_lease: float = defaults.GATEWAY_LEASE  # seconds an ANA group's ownership lock outlives its holder
    failback: str = "auto"  # auto: a group goes back to its preferred owner when it returns; manual: stays
    ana_standby: str = "non-optimized"  # the state of the groups another gateway owns
    cntlid_range: tuple[int, int] | None = None  # controller IDs this target hands out (Target.set_cntlid_range)


def state_directory(path: Path | str | None = None) -> Path:
    """The daemon's state directory (``path``, else defaults.state_dir()), created 0700 if missing.

    Refused when another user could plant or swap files in it (group/world-writable, or owned by
    someone other than this user or root): the token file there decides who manages the target."""
    directory = Path(os.path.abspath(path if path is not None else defaults.state_dir()))
    fix = "choose another with --state-dir DIR (or NVMEOF_STATE_DIR)"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.stat()
    except OSError as e:
        raise DaemonError(f"cannot create the state directory {directory}: {e.strerror}; {fix}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise DaemonError(f"state directory {directory} is not a directory; {fix}")
    if st.st_mode & 0o022:
        raise DaemonError(f"state directory {directory} is writable by group or others (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}), so another user could replace the API token file: "
                          f"run chmod go-w {directory}, or {fix}")
    if st.st_uid not in (0, os.geteuid()):
        raise DaemonError(f"state directory {directory} belongs to uid {st.st_uid}, neither this user "
                          f"(uid {os.geteuid()}) nor root; {fix}")
    return directory


def write_private_file(path: Path, text: str) -> None:
    """Write ``path`` atomically with mode 0600 from its first byte: a temp file next to it created
    with O_EXCL (never an existing file or a planted symlink), then renamed over the old one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_if_ours(path: Path, text: str) -> None:
    """Remove ``path`` if it still holds what we wrote: another daemon may have taken it over since."""
    with contextlib.suppress(OSError):
        if path.read_text(encoding="utf-8") == text + "\n":
            path.unlink()


def _socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def bind_unix_socket(path: Path) -> socket.socket:
    """A listening Unix socket at ``path`` with mode 0600 from the moment it appears there: bound in
    a private 0700 directory next to it, chmod'ed, then renamed into place (no process-wide umask
    change). A stale socket is replaced; any other file, or a socket someone serves on, is refused."""
    where = f"--api unix:{path}"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise DaemonError(f"{where}: {e.strerror}") from e
    if st is not None and not stat.S_ISSOCK(st.st_mode):
        raise DaemonError(f"{where}: {path} exists and is not a socket; refusing to replace it (remove it or "
                          "choose another path)")
    if st is not None and _socket_answers(path):
        raise DaemonError(f"{where}: another process serves on that socket; stop it or choose another path")
    try:
        private = Path(tempfile.mkdtemp(prefix=".nvmeof-api-", dir=path.parent))
    except OSError as e:
        raise DaemonError(f"{where}: cannot create the socket in {path.parent}: {e.strerror}") from e
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staged = private / "s"
    try:
        sock.bind(str(staged))
        os.chmod(staged, 0o600)
        os.replace(staged, path)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise DaemonError(f"{where}: cannot serve the REST API there: {e.strerror or e}") from e
    finally:
        with contextlib.suppress(OSError):
            staged.unlink()
        with contextlib.suppress(OSError):
            private.rmdir()
    sock.setblocking(False)
    return sock


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


def configure_tcp_port(target, options: DaemonOptions) -> None:
    """Hand the NVMe/TCP limits to the target's port (and raise RLIMIT_NOFILE for the connection cap
    before worker processes inherit it)."""
    from target.transports.tcp import TcpLimits, TcpPort

    limits = TcpLimits(ic_timeout=options.ic_timeout, connect_timeout=options.connect_timeout,
                       max_connections=options.max_connections,
                       max_connections_per_listener=options.max_connections_per_listener,
                       h2c_global_budget=options.h2c_budget, poll_us=options.poll_us)
    try:
        TcpPort.of(target).configure(limits, raise_fd_limit=True)
    except ValueError as e:
        raise DaemonError(str(e)) from e


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
            self.target = Target()   # NVMe/TCP: the batch engine (the standard registry's "tcp" entry)
        configure_tcp_port(self.target, options)
        if self.target.reservations_supported:
            from target.pr import LocalPrStore

            # reservation states kept with PTPL (a gateway group replaces this with its own store at join)
            self.target.set_pr_store(LocalPrStore(Path(options.state_dir or defaults.state_dir())
                                                  / defaults.RESERVATIONS_DIR))
        self.target.auth_timeout = options.auth_timeout
        if options.cntlid_range is not None:
            try:
                self.target.set_cntlid_range(*options.cntlid_range)
            except ValueError as e:
                raise DaemonError(str(e)) from e
        from target.backends import BackendError

        backing = options.backing_dirs or [Path(options.state_dir or defaults.state_dir()) / defaults.BACKING_DIR]
        try:
            self.service = TargetService(self.target, config_path=options.config_path, backing_dirs=backing,
                                         block_devices=options.block_devices, ceph_confs=options.ceph_confs,
                                         ceph_keyrings=options.ceph_keyrings,
                                         rbd_op_timeout=options.rbd_op_timeout)
        except BackendError as e:  # a --backing-dir under /dev, say: the message names it
            raise DaemonError(str(e)) from e
        self.api_server: _EmbeddedServer | None = None
        self.api_token: str | None = None
        self.api_endpoint: str | None = None   # http://ADDR:PORT or unix:PATH, once the API listens
        self.state_dir: Path | None = None
        self._api_files: list[tuple[Path, str]] = []
        self._api_socket: tuple[Path, int, int] | None = None   # path, st_dev, st_ino of our Unix socket
        self.restore_errors: list[str] = []
        self._stop = asyncio.Event()
        self._reload_task: asyncio.Task | None = None
        self._reload_wanted = False
        self.gateway = self._make_gateway()

    def _make_gateway(self):
        """The gateway group member (--gateway-group), or None; nothing is contacted yet."""
        opts = self.options
        if opts.gateway_group is None:
            for given, option in ((opts.group_store, "--group-store"), (opts.gateway_name, "--gateway-name")):
                if given:
                    raise DaemonError(f"{option} needs --gateway-group NAME (the group this gateway joins)")
            return None
        from nvmeof.spec.logs import AnaState
        from target.gateway.group import STANDBY, GatewayGroup
        from target.gateway.store import StoreError, parse_store

        if not opts.group_store:
            raise DaemonError("--gateway-group needs --group-store dir:PATH (gateways on one machine) or "
                              "rados:POOL (a Ceph pool every gateway reaches)")
        if opts.gateway_lease < defaults.GATEWAY_LEASE_MIN:
            # the fence steps down lease - max(1 s, lease/5) after a renew is sent, renewals come every lease/3:
            # below this, one slow renew already makes the owner step down and flap
            raise DaemonError(f"--gateway-lease {opts.gateway_lease:g}: give at least {defaults.GATEWAY_LEASE_MIN:g} "
                              "seconds (an owner renews every lease/3 and steps down max(1 s, lease/5) before its "
                              "lease ends)")
        name = opts.gateway_name or socket.gethostname().split(".")[0]
        try:
            kind, where = parse_store(opts.group_store)
            if kind == "dir":
                from target.gateway.dirstore import DirStore

                store = DirStore(where, opts.gateway_group, opts.gateway_lease)
            else:
                from target.gateway.radosstore import RadosStore

                store = RadosStore(where, opts.gateway_group, opts.gateway_lease,
                                   ceph_conf=str(opts.ceph_confs[0]) if opts.ceph_confs else None,
                                   keyring=str(opts.ceph_keyrings[0]) if opts.ceph_keyrings else None)
        except StoreError as e:
            raise DaemonError(str(e)) from e
        return GatewayGroup(self.service, store, name=name, failback=opts.failback,
                            standby=STANDBY.get(opts.ana_standby, AnaState.NON_OPTIMIZED))

    async def start(self) -> None:
        opts = self.options
        # Before the configuration is replayed, so every namespace reaches the workers as it appears.
        await self.target.start_workers()
        if opts.api is not None:
            # Checked before the (possibly long) restore, so a bad state directory fails at once.
            self.state_dir = state_directory(opts.state_dir)
            self.api_token = opts.api_token or os.environ.get("NVMEOF_API_TOKEN") or secrets.token_urlsafe(32)
        if not opts.backing_dirs:
            from target.backends.file import make_backing_dir

            make_backing_dir(self.service.backing.part("file").backing_dirs[0])  # <state dir>/disks, mode 0700
        shared = None
        if self.gateway is not None:
            from target.gateway.store import StoreError

            try:
                await self.gateway.join()  # its CNTLID range before any host can connect
                shared = await self.gateway.stored_config()
            except StoreError as e:
                raise DaemonError(str(e)) from e
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
            await self._create_default(subsystem=shared is None)  # a group's own configuration replaces it
        if self.gateway is not None:
            try:
                errors = await self.gateway.adopt()
            except StoreError as e:
                raise DaemonError(str(e)) from e
            if errors:
                raise DaemonError(f"the configuration of gateway group {opts.gateway_group} cannot be applied "
                                  f"here: {'; '.join(errors)}")
        await self._add_listeners(opts.listen, discovery=False)
        await self._add_listeners(opts.discovery, discovery=True)
        if self.gateway is not None:
            await self.gateway.start()
        if opts.api is not None:
            self._start_api()

    async def _create_default(self, *, subsystem: bool = True) -> None:
        opts = self.options
        if subsystem:
            await self._create_default_subsystem()
        if not opts.listen:
            opts.listen = [TransportAddress("tcp", defaults.LISTEN_ADDRESS, defaults.TCP_IO_PORT)]
        if not opts.discovery:
            opts.discovery = [TransportAddress("tcp", defaults.LISTEN_ADDRESS, defaults.TCP_DISCOVERY_PORT)]

    async def _create_default_subsystem(self) -> None:
        opts = self.options
        await self.service.add_subsystem(opts.subsystem_nqn, allow_any_host=True)
        for image in opts.rbd_images:
            from target.service import ServiceError

            try:
                await self.service.add_namespace(opts.subsystem_nqn, backend="rbd", block_size=opts.block_size,
                                                 options=image)
            except ServiceError as e:
                raise DaemonError(f"--rbd-image {'/'.join(image.values())}: {e.message}") from e
        if not opts.rbd_images and self.gateway is None:
            await self.service.add_namespace(opts.subsystem_nqn, backend="ram", size=opts.ramdisk_size,
                                             block_size=opts.block_size)
        elif not opts.rbd_images:  # a RAM disk cannot be one namespace served by several gateways
            log.info("gateway group %s: the default subsystem %s starts without a namespace (a RAM disk would be "
                     "each gateway's own); add a file or rbd namespace", opts.gateway_group, opts.subsystem_nqn)

    async def _add_listeners(self, addresses: list[TransportAddress], *, discovery: bool) -> None:
        from target.service import ServiceError

        existing = {(lst.trtype, lst.traddr, int(lst.trsvcid)) for lst in self.target.listeners.values()}
        for addr in addresses:
            if (addr.trtype, addr.traddr, addr.trsvcid) in existing:
                continue
            try:
                await self.service.add_listener(addr.trtype, addr.traddr, addr.trsvcid, discovery=discovery,
                                                tls=self.options.tls if addr.trtype == "tcp" else None,
                                                inline_data_size=defaults.IO_INCAPSULE_SIZE if discovery
                                                else self.options.inline_data_size)
            except ServiceError as e:
                raise DaemonError(f"cannot listen on {addr}: {e}") from e

    def _start_api(self) -> None:
        from api.app import create_app
        from api.auth import HostPolicy

        opts = self.options
        assert self.state_dir is not None and self.api_token is not None
        hosts: HostPolicy | None = None
        if isinstance(opts.api, Path):
            path = Path(os.path.abspath(opts.api))
            sock = bind_unix_socket(path)
            st = os.lstat(path)
            self._api_socket = (path, st.st_dev, st.st_ino)
            endpoint = f"unix:{path}"
        else:
            host, port = opts.api
            sock = self._bind_tcp(host, port)
            hosts = HostPolicy.for_bind(host, port, opts.api_host_names)
            endpoint = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        token_file = self.state_dir / defaults.API_TOKEN_FILE
        app = create_app(self.service, token=self.api_token, hosts=hosts, max_body=opts.api_max_body,
                         token_hint=f"{token_file} on the target's machine")
        try:
            for name, text in ((defaults.API_TOKEN_FILE, self.api_token), (defaults.API_ENDPOINT_FILE, endpoint)):
                write_private_file(self.state_dir / name, text)
                self._api_files.append((self.state_dir / name, text))
        except OSError as e:
            sock.close()
            raise DaemonError(f"cannot write the API token file in {self.state_dir}: {e.strerror}; choose another "
                              "state directory with --state-dir DIR (or NVMEOF_STATE_DIR)") from e
        self.api_endpoint = endpoint
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        self.api_server = _EmbeddedServer(app, sock, "warning" if level == "info" else level)
        self.api_server.start()
        log.info("REST API on %s; its token is in %s", endpoint, token_file)

    @staticmethod
    def _bind_tcp(host: str, port: int) -> socket.socket:
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
        return sock

    def _remove_api_files(self) -> None:
        for path, text in self._api_files:
            remove_if_ours(path, text)
        self._api_files = []
        if self._api_socket is not None:
            path, dev, ino = self._api_socket
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) == (dev, ino):
                    path.unlink()
            self._api_socket = None

    def request_stop(self) -> None:
        self._stop.set()

    def request_reload(self) -> None:
        """SIGHUP: one reload at a time; a SIGHUP during one runs another after it (the file may have
        changed again)."""
        self._reload_wanted = True
        if self._reload_task is None or self._reload_task.done():
            self._reload_task = asyncio.get_running_loop().create_task(self._reloads())

    async def _reloads(self) -> None:
        while self._reload_wanted and not self._stop.is_set():
            self._reload_wanted = False
            await self.reload()

    async def reload(self) -> list[str]:
        """Re-read --config and apply what changed (TargetService.reload), keeping connected hosts.
        A file that does not load or whose changes are refused changes nothing; either way the
        reasons are logged and the daemon stays READY. Returns them ([] when applied)."""
        from target.config import load_config

        path = self.options.config_path
        if path is None:
            log.warning("SIGHUP: no --config file to re-read; nothing reloaded")
            return ["no --config file"]
        reloading()
        try:
            config = await asyncio.to_thread(load_config, path)
            errors = await self.service.reload(config)
            if not errors and self.gateway is not None:  # the group's members get what the file changed
                errors = await self.gateway.push_config()
        except Exception as e:  # the message names the file and the problem
            errors = [str(e)]
        if errors:
            log.error("configuration %s: reload refused, nothing changed: %s", path, "; ".join(errors))
        notify(READY=1, STATUS=self.status() if not errors else f"reload refused ({len(errors)} problem(s)); "
               f"{self.status()}")
        return errors

    def status(self) -> str:
        """One line for systemctl status (STATUS=)."""
        subs = [s for s in self.target.subsystems.values() if s.nqn != defaults.DISCOVERY_NQN]
        nss = sum(len(s.namespaces) for s in subs)
        listeners = ", ".join(f"{lst.traddr}:{lst.trsvcid}" for lst in self.target.listeners.values())
        api = f"; API {self.api_endpoint}" if self.api_endpoint else ""
        return f"{len(subs)} subsystem(s), {nss} namespace(s); listening on {listeners or 'nothing'}{api}"

    async def wait(self) -> None:
        await self._stop.wait()

    async def stop(self) -> None:
        if self._reload_task is not None:  # let a reload in progress finish (it holds the service lock)
            with contextlib.suppress(Exception):
                await self._reload_task
        if self.api_server is not None:
            await self.api_server.stop()
        self._remove_api_files()
        if self.gateway is not None:  # standby and release first, so a survivor takes over at once
            await self.gateway.stop()
        await self.target.close()
        # Only then the storage: nothing uses it any more, and librados must be shut down before exit.
        for where in await self.service.close_backends():
            log.warning("%s: its storage did not close within %.0f s", where, defaults.BACKEND_CLOSE_WAIT)

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
        if self.api_server is not None and self.api_endpoint is not None:
            token_file = self.state_dir / defaults.API_TOKEN_FILE if self.state_dir else defaults.API_TOKEN_FILE
            lines.append(f"  REST API            {self.api_endpoint}  (token in {token_file}; the nvmeof CLI "
                         "reads it: nvmeof subsystem list)")
            if self.api_endpoint.startswith("http"):
                # The token is shown here once, on stdout, never in a log line (as Jupyter does).
                # One link logs the browser in (a cookie) for both the dashboard and /docs.
                lines.append(f"  Dashboard (login)   {self.api_endpoint}/login?token={self.api_token}&next=/ui")
                lines.append(f"  API docs            {self.api_endpoint}/docs  (after the login link)")
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
        if self.gateway is not None and self.gateway.index is not None:
            from target.gateway.group import cntlid_range

            lo, hi = cntlid_range(self.gateway.index)
            lines.append(f"  gateway group       {self.gateway.store.group}: member {self.gateway.name} (index "
                         f"{self.gateway.index}, controller IDs {lo}-{hi}), store {self.gateway.store.where}; "
                         "see nvmeof gateway list")
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
    # SIGHUP (systemctl reload) re-reads the configuration file; installed before READY=1 so that a
    # reload systemd sends right after start-up is never the default action (terminate).
    loop.add_signal_handler(signal.SIGHUP, daemon.request_reload)
    try:
        try:
            await daemon.start()
        except DaemonError:
            await daemon.stop()
            raise
        if ready is not None:
            ready(daemon)
        notify(READY=1, STATUS=daemon.status())
        await daemon.wait()
        log.info("shutting down")
        notify(STOPPING=1, STATUS="shutting down")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    await daemon.stop()
    return 0
