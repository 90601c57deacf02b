"""RBD backend: a namespace stored in a Ceph RBD image, through librbd's Python binding.

I/O through librbd's aio calls completed on the event loop; every operation bounded by RBD_OP_TIMEOUT (+
RBD_WAIT_MARGIN), failing with BackendUnavailable; FileBackend's size rules, a resize made outside noticed by
polling; one librados connection per Ceph configuration, client id and keyring; a stopping process waits for
its clients (``wait_clients_down``) or leaves through ``exit_process``. Why each: ARCHITECTURE.md, "RBD backend".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import importlib.machinery
import importlib.util
import itertools
import json
import logging
import math
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Hashable, Iterable
from typing import Any, NoReturn

from nvmeof import defaults
from target.backends.base import Backend, BackendError, BackendSpec, BackendUnavailable, close_fds
from target.backends.file import BackingError, setting_path
from target.backends.rbd_options import NAME_MAX

log = logging.getLogger(__name__)

DIST_PACKAGES = "/usr/lib/python3/dist-packages"
INSTALL_HINT = ("RBD namespaces need librbd's Python bindings: install Debian's python3-rbd and python3-rados "
                "(apt-get install python3-rbd python3-rados); they are compiled for Python 3.11 and live in "
                f"{DIST_PACKAGES}")
# librados/librbd errors that mean "the cluster is out of reach for now", not "this request is wrong":
# ETIMEDOUT from rados_osd_op_timeout, ESHUTDOWN (also Ceph's EBLOCKLISTED) and ENOTCONN from a
# connection going away, EAGAIN from a throttled or restarting cluster.
UNAVAILABLE_ERRNOS = frozenset({errno.ETIMEDOUT, errno.ESHUTDOWN, errno.ENOTCONN, errno.EAGAIN})
SWEEP_INTERVAL = 0.5     # seconds between checks for commands librbd has not answered in time
FOLLOW_TRIES = 25        # size() calls (20 ms apart) a worker makes to see the main process's resize
CLOSE_WAIT = 1.0         # seconds close() waits for librbd to close the image before leaving it to a thread


def load_rbd() -> tuple[types.ModuleType, types.ModuleType]:
    """The ``rados`` and ``rbd`` modules, or BackendError with installation advice.

    Debian puts them in /usr/lib/python3/dist-packages, which a pyenv or venv Python does not
    search, so that folder is searched after sys.path (as for pyverbs). Only the compiled bindings
    count: a plain ``rbd.py`` that happens to be importable (a script folder on sys.path) is
    skipped, and sys.path itself is left as it is."""
    try:
        rados = _binding("rados", "Rados")
        rbd = _binding("rbd", "Image")   # its module init imports rados, loaded just above
    except ImportError as exc:
        raise BackendError(f"{INSTALL_HINT} (import failed: {exc})") from None
    return rados, rbd


_bindings: dict[str, types.ModuleType] = {}


def _binding(name: str, attribute: str) -> types.ModuleType:
    """The compiled extension module ``name`` (one defining ``attribute``), imported once."""
    module = _bindings.get(name) or sys.modules.get(name)
    if module is not None and hasattr(module, attribute):
        _bindings[name] = module
        return module
    for folder in [*sys.path, DIST_PACKAGES]:
        spec = importlib.machinery.PathFinder.find_spec(name, [folder or os.getcwd()])
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            break
    else:
        raise ImportError(f"no compiled {name} module on sys.path or in {DIST_PACKAGES}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, attribute):
        raise ImportError(f"{spec.origin} is not librbd's binding (it has no {attribute})")
    sys.modules.setdefault(name, module)
    _bindings[name] = module
    return module


def _errno_name(code: int) -> str:
    return f"{errno.errorcode.get(code, 'errno ' + str(code))}: {os.strerror(code)}"


def _check_name(value: Any, field: str, *, optional: bool = False) -> str | None:
    """A pool, image or RADOS namespace name as Ceph accepts it; BackendError naming ``field``."""
    if value is None and optional:
        return None
    hint = " (leave it out for the pool's default namespace)" if optional else ""
    if not isinstance(value, str) or not value:
        raise BackendError(f"rbd backend: {field} must be a non-empty name, got {value!r}{hint}")
    if "/" in value or "@" in value:
        raise BackendError(f"rbd backend: {field} {value!r} may not contain '/' or '@' (give pool, rbd_namespace "
                           "and image as separate settings; snapshots cannot be served)")
    if any(ord(c) < 0x20 or c == "\x7f" for c in value):
        raise BackendError(f"rbd backend: {field} {value!r} contains a control character")
    if len(value.encode()) > NAME_MAX:
        raise BackendError(f"rbd backend: {field} is {len(value.encode())} bytes long; at most {NAME_MAX} allowed")
    return value


def _check_id(value: Any) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() or ord(c) < 0x20 for c in value) \
            or len(value) > NAME_MAX:
        raise BackendError(f"rbd backend: ceph_id must be a Ceph client name such as 'admin' (client.admin), "
                           f"got {value!r}")
    return value.removeprefix("client.")


# --- one librados connection per (conf, id, keyring, timeouts) ------------------------------------


class _Connection:
    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key
        self.lock = threading.Lock()   # held while connecting, so two opens make one connection
        self.cluster: Any = None
        self.refs = 0


_connections: dict[tuple[Any, ...], _Connection] = {}
_connections_lock = threading.Lock()
# librados clients connected and not shut down yet (including one dropped from the registry after a
# blocklisting, which lives until its last image closes); _clients_changed is signalled at each shutdown.
_clients_up = 0
_clients_changed = threading.Condition(_connections_lock)


def _acquire(key: tuple[Any, ...], connect: Callable[[], Any]) -> _Connection:
    with _connections_lock:
        conn = _connections.get(key)
        if conn is None:
            conn = _connections[key] = _Connection(key)
        conn.refs += 1
    try:
        with conn.lock:
            if conn.cluster is None:
                conn.cluster = connect()
                _client_started()
                _connected(conn.cluster)
    except BaseException:
        _release(conn)
        raise
    return conn


def _release(conn: _Connection) -> None:
    with _connections_lock:
        conn.refs -= 1
        if conn.refs > 0:
            return
        if _connections.get(conn.key) is conn:
            del _connections[conn.key]
        cluster, conn.cluster = conn.cluster, None
    if cluster is not None:
        try:
            cluster.shutdown()
        finally:
            _client_stopped()


def _client_started() -> None:
    global _clients_up
    with _connections_lock:
        _clients_up += 1


def _client_stopped() -> None:
    global _clients_up
    with _connections_lock:
        _clients_up -= 1
        _clients_changed.notify_all()


def clients_up() -> int:
    """How many librados clients this process connected and has not shut down yet."""
    with _connections_lock:
        return _clients_up


def wait_clients_down(timeout: float) -> bool:
    """Wait (blocking) until every librados client is shut down; False if one is still up after ``timeout`` s."""
    with _clients_changed:
        return _clients_changed.wait_for(lambda: _clients_up == 0, timeout)


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``. With a librados client still up (an image librbd could not close in
    time), exit() would destroy libceph-common's static objects under its threads and crash the process, so
    it leaves through os._exit after flushing logs and stdio, as Ceph's own CLI does then (ceph.in, "use
    sys._exit when we don't shut down"). Otherwise the ordinary interpreter exit."""
    up = clients_up()
    if up:
        log.warning("%d librados client(s) still up at exit (an RBD image did not close in time); leaving without "
                    "running exit handlers", up)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)


def shared_connections() -> int:
    """How many librados connections are open (for tests: one per cluster and client, not per image)."""
    with _connections_lock:
        return sum(1 for c in _connections.values() if c.cluster is not None)


# --- who we are to the cluster (target/gateway/fencing.py publishes it, and fences a dead gateway's) ----------

_on_connect: list[Callable[[], None]] = []
_on_blocklisted: list[Callable[[str], None]] = []


def client_clusters() -> list[Any]:
    """The open librados handles (Rados objects) of every shared connection."""
    with _connections_lock:
        return [c.cluster for c in _connections.values() if c.cluster is not None]


def on_new_connection(callback: Callable[[], None]) -> None:
    """Call ``callback()`` (from the opening thread) after each new librados connection: its identity is new."""
    _on_connect.append(callback)


def on_blocklisted(callback: Callable[[str], None]) -> None:
    """Call ``callback(what_failed)`` when librbd answers ESHUTDOWN (Ceph's EBLOCKLISTED): another gateway
    fenced this one's client; the connection is dropped from the registry so the next open makes a new one."""
    _on_blocklisted.append(callback)


def _connected(cluster: Any) -> None:
    clients_changed()


def clients_changed() -> None:
    """Run the on_new_connection callbacks: this process's set of clients changed (also: a worker process of
    ours reported new clients, target/workers.py)."""
    for callback in list(_on_connect):
        try:
            callback()
        except Exception:  # a listener's bug must not fail the open
            log.exception("new-connection callback failed")


def _blocklisted(conn: _Connection | None, what: str) -> None:
    if conn is not None:
        with _connections_lock:
            if _connections.get(conn.key) is conn:
                del _connections[conn.key]   # later opens connect anew; this one ends with its last image
    report_blocklisted(what)


def report_blocklisted(what: str) -> None:
    """Run the on_blocklisted callbacks (also: a worker process of ours got ESHUTDOWN, target/workers.py)."""
    for callback in list(_on_blocklisted):
        try:
            callback(what)
        except Exception:
            log.exception("blocklisted callback failed")


# --- the operator's policy -----------------------------------------------------------------------


class CephPolicy:
    """Which Ceph client files an RBD namespace may name: librados reads them as the daemon's user, so a
    REST caller must not point it at any file it likes (``ceph_confs``, ``ceph_keyrings``, stored
    resolved; the first conf is the default), and how long an OSD/monitor call may take."""

    settings = ("ceph_confs", "ceph_keyrings", "rbd_op_timeout")   # as BackingPolicy.settings

    def __init__(
        self,
        ceph_confs: Iterable[str | os.PathLike[str]] = (),
        ceph_keyrings: Iterable[str | os.PathLike[str]] = (),
        rbd_op_timeout: float = defaults.RBD_OP_TIMEOUT,
    ) -> None:
        self.ceph_confs = tuple(dict.fromkeys(setting_path(d, "--ceph-conf") for d in ceph_confs))
        self.ceph_keyrings = tuple(dict.fromkeys(setting_path(d, "--ceph-keyring") for d in ceph_keyrings))
        self.rbd_op_timeout = rbd_op_timeout   # nvmeof serve --rbd-op-timeout

    def widened(
        self, ceph_confs: Iterable[str | os.PathLike[str]] = (), ceph_keyrings: Iterable[str | os.PathLike[str]] = ()
    ) -> CephPolicy:
        """A policy allowing these too (the configuration file's own keys, added to the flags)."""
        return CephPolicy([*self.ceph_confs, *ceph_confs], [*self.ceph_keyrings, *ceph_keyrings], self.rbd_op_timeout)

    def widens(self, ceph_confs: Iterable[str] = (), ceph_keyrings: Iterable[str] = ()) -> list[str]:
        """The entries that would allow more than this policy does."""
        return ([c for c in ceph_confs if os.path.realpath(c) not in self.ceph_confs]
                + [k for k in ceph_keyrings if os.path.realpath(k) not in self.ceph_keyrings])

    def ceph_conf(self, value: str | None) -> str:
        """The Ceph configuration file an RBD namespace uses: ``value`` if it is one the operator
        allowed (--ceph-conf, config key ``ceph_confs``), the first allowed one when ``value`` is
        None, and Ceph's own default /etc/ceph/ceph.conf when none is configured."""
        if value is None:
            return self.ceph_confs[0] if self.ceph_confs else defaults.CEPH_CONF
        return self._ceph_file(value, self.ceph_confs or (defaults.CEPH_CONF,), "Ceph configuration file",
                               "--ceph-conf PATH (config key ceph_confs)")

    def ceph_keyring(self, value: str | None) -> str | None:
        """The keyring an RBD namespace names, if the operator allowed it (--ceph-keyring, config key
        ``ceph_keyrings``); None leaves it to the Ceph configuration file."""
        if value is None:
            return None
        return self._ceph_file(
            value, self.ceph_keyrings, "Ceph keyring", "--ceph-keyring PATH (config key ceph_keyrings)"
        )

    @staticmethod
    def _ceph_file(value: Any, allowed: tuple[str, ...], what: str, option: str) -> str:
        if not isinstance(value, str) or not value or "\0" in value or not os.path.isabs(value):
            raise BackingError(f"{what} {value!r} must be an absolute path")
        real = os.path.realpath(value)
        if real not in allowed:
            listed = ", ".join(allowed) or "none"
            raise BackingError(f"{what} {value} is not one the daemon was started with (allowed: {listed}); "
                               f"allow it with {option}")
        return real


# --- the backend --------------------------------------------------------------------------------


class RbdBackend(Backend):
    kind = "rbd"
    policy_class = CephPolicy
    has_exclusive_lock = True
    holds_user_data = True
    can_deallocate = True

    def __init__(
        self,
        pool: str,
        image: str,
        *,
        rbd_namespace: str | None = None,
        size: int | None = None,
        create: bool = False,
        read_only: bool = False,
        ceph_conf: str = defaults.CEPH_CONF,
        ceph_id: str = defaults.CEPH_CLIENT_ID,
        ceph_keyring: str | None = None,
        op_timeout: float | None = None,
    ) -> None:
        """Open ``pool[/rbd_namespace]/image`` (blocks: call it in a thread). ``ceph_conf`` and
        ``ceph_keyring`` are used as given: ``open`` checks them against the daemon's policy first."""
        self.pool = _check_name(pool, "pool")
        self.image_name = _check_name(image, "image")
        self.rbd_namespace = _check_name(rbd_namespace, "rbd_namespace", optional=True)
        self.ceph_conf = ceph_conf
        self.ceph_id = _check_id(ceph_id)
        self.ceph_keyring = ceph_keyring
        self.op_timeout = float(defaults.RBD_OP_TIMEOUT if op_timeout is None else op_timeout)
        if not self.op_timeout > 0:
            raise BackendError(f"{self._name()}: op_timeout must be a positive number of seconds")
        self._wait_limit = self.op_timeout + defaults.RBD_WAIT_MARGIN
        self._read_only = read_only
        self.created = False
        self.grown_from: int | None = None   # the image's size before ``create`` grew it
        self._pending: dict[int, tuple[Any, ...]] = {}   # in flight: what must live until librbd calls back
        self._ids = itertools.count()
        self._closing = False
        self._closed = threading.Event()
        self._sync = threading.Lock()   # librbd's synchronous calls vs closing the image under them
        self._watch: asyncio.Task[None] | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._resizing = 0
        self._conn: _Connection | None = None
        self._ioctx: Any = None
        self._image: Any = None
        if size is not None:
            self._positive_size(size)
        if create and read_only:
            raise BackendError(f"{self._name()}: cannot create an image read-only; drop one of the two")
        self.rados, self.rbd = load_rbd()
        try:
            self._open_image(size, create)
            self._size = self._initial_size(size, create)
        except BaseException:
            self._discard_failed_open()
            raise

    @classmethod
    def validate_spec(cls, spec: BackendSpec, policy: CephPolicy | None = None) -> BackendSpec:
        if spec.path is not None:
            raise BackendError(f"an rbd namespace takes no path (got {os.fspath(spec.path)!r}); give pool and image")
        missing = [name for name in ("pool", "image") if spec.options.get(name) is None]
        if missing:
            raise BackendError(f"an rbd namespace needs {' and '.join(missing)} (the RBD pool and image to serve)")
        # the names as Ceph takes them (bytes, not the declaration's characters), before librados is loaded
        _check_name(spec.options["pool"], "pool")
        _check_name(spec.options["image"], "image")
        _check_name(spec.options.get("rbd_namespace"), "rbd_namespace", optional=True)
        if spec.options.get("ceph_id") is not None:
            _check_id(spec.options["ceph_id"])
        # Stored resolved, like file paths; an unlisted one is refused before librados reads it.
        policy = policy if policy is not None else CephPolicy()
        options = dict(spec.options)
        for key, check in (("ceph_conf", policy.ceph_conf), ("ceph_keyring", policy.ceph_keyring)):
            if key in options:
                options[key] = check(options[key])
        return dataclasses.replace(spec, options=options)

    @classmethod
    def storage_key(cls, spec: BackendSpec, policy: CephPolicy | None = None) -> Hashable | None:
        # one image of one cluster, whichever client or keyring reaches it
        opts = spec.options
        conf = opts.get("ceph_conf") or (policy if policy is not None else CephPolicy()).ceph_conf(None)
        return ("rbd", conf, opts.get("pool"), opts.get("rbd_namespace") or "", opts.get("image"))

    @classmethod
    def storage_name(cls, spec: BackendSpec) -> str:
        opts = spec.options
        return "RBD image " + "/".join(p for p in (opts.get("pool"), opts.get("rbd_namespace"), opts.get("image")) if p)

    @classmethod
    def open(cls, spec: BackendSpec, policy: CephPolicy | None = None) -> RbdBackend:
        spec = cls.validate_spec(spec, policy)
        policy = policy if policy is not None else CephPolicy()
        opts = spec.options
        return cls(opts["pool"], opts["image"], rbd_namespace=opts.get("rbd_namespace"), size=spec.size,
                   create=spec.create, read_only=spec.read_only,
                   ceph_conf=opts.get("ceph_conf") or policy.ceph_conf(None),
                   ceph_id=opts.get("ceph_id") or defaults.CEPH_CLIENT_ID, ceph_keyring=opts.get("ceph_keyring"),
                   op_timeout=policy.rbd_op_timeout)

    # opening ------------------------------------------------------------------------------------

    def _connect(self) -> Any:
        rados = self.rados
        if not os.path.isfile(self.ceph_conf):
            raise BackendError(f"{self._name()}: Ceph configuration file {self.ceph_conf} does not exist; "
                               "give another with ceph_conf (--ceph-conf)")
        extra = {"keyring": self.ceph_keyring} if self.ceph_keyring else None
        try:
            cluster = rados.Rados(conffile=self.ceph_conf, rados_id=self.ceph_id, conf=extra)
        except rados.Error as exc:
            raise BackendError(f"{self._name()}: cannot read Ceph configuration {self.ceph_conf}: {exc}") from None
        try:
            timeout = str(max(1, math.ceil(self.op_timeout)))   # Ceph takes whole seconds here
            cluster.conf_set("rados_osd_op_timeout", timeout)
            cluster.conf_set("rados_mon_op_timeout", timeout)
            # Deallocate must read back as zeros (DLFEAT): librbd skips discards smaller than its
            # granularity unless told not to, leaving the old data there.
            cluster.conf_set("rbd_skip_partial_discard", "false")
            # No librbd write-back cache: a write is on the OSDs when the host sees it complete, so
            # another gateway (or a restarted one) serving the image never reads older data, and an
            # FUA write cannot switch the cache to write-back behind the host (SPDK's bdev_rbd
            # likewise presents no volatile cache of its own).
            cluster.conf_set("rbd_cache", "false")
            cluster.connect(timeout=max(1, round(defaults.RBD_CONNECT_TIMEOUT)))
        except rados.Error as exc:
            cluster.shutdown()
            kind = BackendUnavailable if isinstance(exc, rados.TimedOut) else BackendError
            raise kind(f"{self._name()}: cannot connect to the Ceph cluster of {self.ceph_conf} as client."
                       f"{self.ceph_id}: {exc}; check the cluster is up and the conf, ceph_id and keyring") from None
        return cluster

    def _open_image(self, size: int | None, create: bool) -> None:
        rados, rbd = self.rados, self.rbd
        key = (self.ceph_conf, self.ceph_id, self.ceph_keyring, self.op_timeout)
        self._conn = _acquire(key, self._connect)
        try:
            self._ioctx = self._conn.cluster.open_ioctx(self.pool)
        except rados.ObjectNotFound:
            raise BackendError(f"{self._name()}: pool {self.pool} does not exist in the cluster of {self.ceph_conf}; "
                               f"create it (ceph osd pool create {self.pool}; rbd pool init {self.pool})") from None
        except rados.Error as exc:
            raise BackendError(f"{self._name()}: cannot open pool {self.pool}: {exc}") from None
        try:
            if self.rbd_namespace is not None:
                if not rbd.RBD().namespace_exists(self._ioctx, self.rbd_namespace):
                    raise BackendError(
                        f"{self._name()}: RADOS namespace {self.rbd_namespace} does not exist in pool {self.pool}; "
                        f"create it (rbd namespace create {self.pool}/{self.rbd_namespace})")
                self._ioctx.set_namespace(self.rbd_namespace)
            try:
                self._image = rbd.Image(self._ioctx, self.image_name, read_only=self._read_only)
                return
            except rbd.ImageNotFound:
                if not create:
                    raise BackendError(
                        f"{self._name()} does not exist; create it first (rbd create --size ... {self._where()}), "
                        "or ask for it to be created (create, --create) with a size") from None
                if size is None:
                    raise BackendError(f"{self._name()} does not exist and no size was given to create it with") \
                        from None
            try:
                rbd.RBD().create(self._ioctx, self.image_name, size)
                self.created = True
            except rbd.ImageExists:
                pass   # made meanwhile by someone else: served as it is, never removed by us
            self._image = rbd.Image(self._ioctx, self.image_name, read_only=self._read_only)
        except (rbd.Error, rados.Error) as exc:
            unavailable = getattr(exc, "errno", None) in UNAVAILABLE_ERRNOS
            kind = BackendUnavailable if unavailable else BackendError
            raise kind(f"{self._name()}: cannot open the image: {exc}") from None

    def _initial_size(self, size: int | None, create: bool) -> int:
        current = self._image.size()
        if size is None:
            size = current
        elif size > current:
            if not create:
                # nvmet and SPDK never change storage behind the user's back; neither do we.
                raise BackendError(
                    f"{self._name()} is {current} bytes, less than the size {size} asked for; adding an image "
                    f"never grows it unless asked: give a size up to {current} (or none) to export it as it is, "
                    f"or ask for create (--create, \"create\": true) to grow it to {size}")
            self._image_resize(size)
            if not self.created:
                self.grown_from = current
            current = size
        if size <= 0:
            raise BackendError(f"{self._name()} is empty (0 bytes); give a size and create to grow it")
        self._image_size = current
        return size

    def _image_resize(self, size: int) -> None:
        try:
            self._image.resize(size, allow_shrink=True)
        except (self.rbd.Error, self.rados.Error) as exc:
            unavailable = getattr(exc, "errno", None) in UNAVAILABLE_ERRNOS
            raise (BackendUnavailable if unavailable else BackendError)(
                f"{self._name()}: cannot resize the image to {size} bytes: {exc}") from None

    def _discard_failed_open(self) -> None:
        if self._image is not None:
            self._undo_open_changes()
        self._teardown()

    def _undo_open_changes(self) -> None:
        """Take back what opening did: remove an image this open created, shrink back one it grew."""
        try:
            if self.created:
                self._image.close()
                self._image = None
                self.rbd.RBD().remove(self._ioctx, self.image_name)
            elif self.grown_from is not None:
                self._image.resize(self.grown_from, allow_shrink=True)
        except (self.rbd.Error, self.rados.Error) as exc:
            log.warning("%s: could not take back what opening did (%s)", self._name(), exc)

    def close_unused(self) -> None:
        """Close a backend that was opened but never used, undoing what the open did to the image
        (TargetService calls it when the namespace it was opened for could not be added). Blocks."""
        self._stop_watch()
        if not self._closing and not self._pending:
            self._closing = True
            with self._sync:
                if self._image is not None:
                    self._undo_open_changes()
            self._teardown()
        else:
            self.close()

    # workers ------------------------------------------------------------------------------------

    def describe_for_worker(self) -> tuple[dict[str, Any], list[int]]:
        # Plain names: the worker opens its own connection and image (librados cannot cross a process).
        return {**self.describe(), "op_timeout": self.op_timeout}, []

    @classmethod
    def attach(cls, description: dict[str, Any], fds: list[int]) -> RbdBackend:
        close_fds(fds)
        return cls(description["pool"], description["image"], rbd_namespace=description.get("rbd_namespace"),
                   size=description["size"], read_only=bool(description["read_only"]),
                   ceph_conf=description["ceph_conf"], ceph_id=description["ceph_id"],
                   ceph_keyring=description.get("ceph_keyring"), op_timeout=description.get("op_timeout"))

    def follow_resize(self, size: int) -> None:
        """The main process resized the image. Its resize returned once every watcher of the header
        had been told, but librbd refreshes a handle's view only in a synchronous call (size()), not
        before checking an aio's range: re-read it here (one round trip, a few more if it lags)."""
        self._positive_size(size, "new size")
        current = 0
        for _ in range(FOLLOW_TRIES):
            with self._sync:
                if self._image is None:
                    raise BackendError(f"{self._name()} is closed (its namespace was removed)")
                current = self._image.size()
            if current >= size:
                break
            time.sleep(0.02)
        else:
            raise BackendError(f"{self._name()}: the image is {current} bytes, less than the {size} the main process "
                               "resized it to")
        self._size = size
        self._image_size = current

    # I/O ----------------------------------------------------------------------------------------

    def _name(self) -> str:
        return f"RBD image {self._where()}"

    def _where(self) -> str:
        parts = [getattr(self, "pool", None), getattr(self, "rbd_namespace", None), getattr(self, "image_name", None)]
        return "/".join(p for p in parts if p)

    async def _aio(self, what: str, call: str, *args: Any) -> tuple[int, Any]:
        """Start one librbd aio call (``Image.<call>(*args, oncomplete)``) and wait for its answer, at most
        op_timeout + RBD_WAIT_MARGIN seconds. Returns (return value, data)."""
        if self._closing:
            raise BackendError(f"{self._name()} is closed (its namespace was removed)")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, Any]] = loop.create_future()
        op = next(self._ids)

        def on_complete(completion: Any, *data: Any) -> None:   # a librbd thread
            ret = completion.get_return_value()
            try:
                loop.call_soon_threadsafe(self._completed, op, fut, ret, data[0] if data else None)
            except RuntimeError:
                pass   # the loop is closed: nobody waits any more

        try:
            completion = getattr(self._image, call)(*args, on_complete)
        except (self.rbd.Error, self.rados.Error) as exc:
            raise self._error(what, -(getattr(exc, "errno", None) or errno.EIO), str(exc)) from None
        # The arguments (a write's data) and the completion live until librbd has called back,
        # even when we stop waiting or our caller is cancelled.
        self._pending[op] = (fut, loop.time() + self._wait_limit, what, completion, args)
        if self._sweeper is None:
            self._sweeper = loop.call_later(SWEEP_INTERVAL, self._sweep)
        ret, data = await fut
        if ret < 0:
            raise self._error(what, ret)
        return ret, data

    def _completed(self, op: int, fut: asyncio.Future[tuple[int, Any]], ret: int, data: Any) -> None:
        self._pending.pop(op, None)
        if not fut.done():
            fut.set_result((ret, data))
        if self._closing and not self._pending:
            self._close_image()

    def _sweep(self) -> None:
        """Answer every command librbd has not called back for within op_timeout + RBD_WAIT_MARGIN
        with BackendUnavailable (one timer for all of them: a timer per command costs ~10 % of the
        I/O rate). Their entries stay until librbd calls back."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for fut, deadline, what, *_ in self._pending.values():
            if deadline <= now and not fut.done():
                fut.set_exception(BackendUnavailable(
                    f"{self._name()}: {what} got no answer from librbd within {self._wait_limit:.0f} s; the Ceph "
                    "cluster is unreachable or an OSD does not answer"))
        self._sweeper = loop.call_later(SWEEP_INTERVAL, self._sweep) if self._pending else None

    def _error(self, what: str, ret: int, detail: str = "") -> BackendError:
        code = -ret
        kind = BackendUnavailable if code in UNAVAILABLE_ERRNOS else BackendError
        extra = f" ({detail})" if detail else ""
        if code == errno.ESHUTDOWN:   # Ceph's EBLOCKLISTED: another gateway fenced this client
            _blocklisted(self._conn, f"{self._name()}: {what}")
        return kind(f"{self._name()}: {what} failed: {_errno_name(code)}{extra}")

    async def read_into(self, offset: int, buf: memoryview) -> None:
        data = await self.read(offset, len(buf))
        buf[:] = data

    async def read(self, offset: int, length: int) -> bytes:
        self._check_range(offset, length)
        if not length:
            return b""
        _, data = await self._aio("read", "aio_read", offset, length)
        if data is None or len(data) != length:
            got = 0 if data is None else len(data)
            raise BackendError(f"{self._name()}: read of {length} bytes at {offset} returned {got}")
        return data

    async def write(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> None:
        self._check_write_range(offset, len(data))
        if not len(data):
            return
        if isinstance(data, memoryview):
            # The binding takes bytes (or a bytearray); a view of a whole one is passed as it is.
            whole = data.obj if data.c_contiguous and isinstance(data.obj, bytes | bytearray) else None
            data = whole if whole is not None and len(whole) == data.nbytes else data.tobytes()
        await self._aio("write", "aio_write", data, offset)
        if fua:
            await self._aio("flush (FUA)", "aio_flush")

    async def flush(self) -> None:
        await self._aio("flush", "aio_flush")

    async def write_zeroes(self, offset: int, length: int) -> None:
        self._check_write_range(offset, length)
        if length:
            await self._aio("write zeroes", "aio_write_zeroes", offset, length)

    async def discard(self, offset: int, length: int) -> None:
        self._check_write_range(offset, length)
        if length:
            await self._aio("deallocate", "aio_discard", offset, length)

    # size ---------------------------------------------------------------------------------------

    def _current_size(self) -> int:
        return self._image.size()   # under self._sync, image open (_sync_call)

    async def _sync_call(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """A synchronous librbd call in a thread, never under a closing image."""
        def call() -> Any:
            with self._sync:
                if self._image is None:
                    raise BackendError(f"{self._name()} is closed (its namespace was removed)")
                try:
                    return fn(*args, **kw)
                except (self.rbd.Error, self.rados.Error) as exc:
                    raise self._error(what, -(getattr(exc, "errno", None) or errno.EIO), str(exc)) from None

        if self._closing:
            raise BackendError(f"{self._name()} is closed (its namespace was removed)")
        return await asyncio.to_thread(call)

    async def resize(self, new_size: int, *, allow_shrink: bool = False) -> int | None:
        """Present ``new_size`` bytes. Growing past the end of the image grows it (the resize is the
        explicit request); shrinking needs ``allow_shrink`` and shrinks the image too when the
        namespace covered all of it. A namespace on the first bytes of a larger image and a
        read-only one only change what is presented (as FileBackend.resize).

        Returns the image's size before, if it was changed (for ``revert_resize``), else None."""
        self._positive_size(new_size, "new size")
        if new_size < self._size and not allow_shrink:
            raise BackendError(
                f"{self._name()}: shrinking from {self._size} to {new_size} bytes cuts off the namespace's tail, "
                "whose data hosts then lose; ask for it explicitly with allow_shrink "
                "(--allow-shrink, \"allow_shrink\": true)")
        self._resizing += 1
        try:
            length = await self._sync_call("size lookup", self._current_size)
            target: int | None = None
            if new_size > length:
                if self._read_only:
                    raise BackendError(
                        f"{self._name()} is read-only and {length} bytes long; it cannot grow to {new_size}")
                target = new_size
            elif new_size < self._size and length == self._size and not self._read_only:
                target = new_size
            if target is not None:
                await self._sync_call("resize", self._image_resize, target)
                self._image_size = target
            else:
                self._image_size = length
            self._size = new_size
            return length if target is not None else None
        finally:
            self._resizing -= 1

    async def revert_resize(self, size: int, length: int | None) -> None:
        """Undo ``resize``: present ``size`` again, and give the image back its ``length``."""
        self._resizing += 1
        try:
            if length is not None:
                await self._sync_call("resize", self._image_resize, length)
                self._image_size = length
            self._size = size
        finally:
            self._resizing -= 1

    def watch_size(self, callback: Callable[[int], None]) -> None:
        """Poll the image's size every RBD_SIZE_POLL s (the 16.2 binding has no update_watch) and,
        when someone else resized it, present the new size and call ``callback(new_size)`` on the
        loop. A namespace covering the whole image follows it; one exporting a prefix keeps its
        size unless the image shrank below it (then it ends where the image now ends)."""
        self._stop_watch()
        if not self._closing:
            self._watch = asyncio.get_running_loop().create_task(self._poll_size(callback))

    async def _poll_size(self, callback: Callable[[int], None]) -> None:
        while not self._closing:
            await asyncio.sleep(defaults.RBD_SIZE_POLL)
            if self._resizing:
                continue
            try:
                current = await asyncio.wait_for(self._sync_call("size lookup", self._current_size),
                                                 self.op_timeout + defaults.RBD_WAIT_MARGIN)
            except (TimeoutError, BackendError, self.rbd.Error, self.rados.Error) as exc:
                log.debug("%s: size check failed: %s", self._name(), exc)
                continue
            if self._closing or self._resizing or current == self._image_size:
                continue
            old_image, self._image_size = self._image_size, current
            presented = current if self._size == old_image else min(self._size, current)
            if current <= 0 or presented == self._size:
                continue
            log.info("%s was resized outside this target from %d to %d bytes; presenting %d",
                     self._name(), old_image, current, presented)
            self._size = presented
            try:
                callback(presented)
            except Exception:
                log.exception("%s: resize callback failed", self._name())

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # exclusive lock (fencing a dead gateway, target/gateway/fencing.py) -------------------------

    def exclusive_lock_owners(self) -> list[dict[str, Any]]:
        """librbd's managed-lock owners of the image: [{"mode": int, "owner": client address}] (blocks)."""
        with self._sync:
            if self._image is None:
                raise BackendError(f"{self._name()} is closed (its namespace was removed)")
            return [dict(o) for o in self._image.lock_get_owners()]

    def break_exclusive_lock(self, mode: int, owner: str) -> None:
        """Break the lock ``owner`` holds (rbd_lock_break; blocks). The caller decides whose."""
        with self._sync:
            if self._image is None:
                raise BackendError(f"{self._name()} is closed (its namespace was removed)")
            self._image.lock_break(mode, owner)

    # identity -----------------------------------------------------------------------------------

    def stored_identity(self) -> dict[str, str] | None:
        key = defaults.RBD_IDENTITY_KEY
        with self._sync:
            if self._image is None:
                raise BackendError(f"{self._name()} is closed (its namespace was removed)")
            try:
                raw = self._image.metadata_get(key)
            except KeyError:
                return None
            except (self.rbd.Error, self.rados.Error) as exc:
                raise self._error(f"reading metadata key {key}", -(getattr(exc, "errno", None) or errno.EIO),
                                  str(exc)) from None
        try:
            ids = json.loads(raw)
        except ValueError:
            ids = None
        if not isinstance(ids, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ids.items()):
            raise BackendError(f"{self._name()}: metadata key {key} holds no namespace identity ({raw[:80]!r}); "
                               f"remove it (rbd image-meta remove {self._where()} {key}) to give the image a new one")
        return ids

    def store_identity(self, ids: dict[str, str]) -> None:
        key = defaults.RBD_IDENTITY_KEY
        value = json.dumps({k: str(v) for k, v in ids.items()}, sort_keys=True)
        if self._read_only:
            raise BackendError(
                f"{self._name()} is served read-only and has no namespace identity stored yet; serve it writable "
                f"once, or store one yourself (rbd image-meta set {self._where()} {key} '{value}')")
        with self._sync:
            if self._image is None:
                raise BackendError(f"{self._name()} is closed (its namespace was removed)")
            try:
                self._image.metadata_set(key, value)
            except (self.rbd.Error, self.rados.Error) as exc:
                raise self._error(f"writing metadata key {key}", -(getattr(exc, "errno", None) or errno.EIO),
                                  str(exc)) from None

    # closing ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving. The image is closed once librbd has answered every command in flight;
        close waits CLOSE_WAIT s for that at most (an unreachable cluster keeps librbd longer)."""
        if self._closing:
            return
        self._closing = True
        self._stop_watch()
        if not self._pending:
            self._close_image()

    def _close_image(self) -> None:
        worker = threading.Thread(target=self._teardown, name=f"rbd-close-{self.image_name}", daemon=True)
        worker.start()
        worker.join(CLOSE_WAIT)

    def _teardown(self) -> None:
        with self._sync:
            image, self._image = self._image, None
            ioctx, self._ioctx = self._ioctx, None
            conn, self._conn = self._conn, None
        try:
            if image is not None:
                image.close()
            if ioctx is not None:
                ioctx.close()
        except (self.rbd.Error, self.rados.Error) as exc:
            log.warning("%s: closing failed: %s", self._name(), exc)
        finally:
            if conn is not None:
                _release(conn)
            self._closed.set()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """True once the image and its connection share are released (tests, shutdown)."""
        return self._closed.wait(timeout)

    @property
    def client_blocklisted(self) -> bool:
        """Its librados client answered ESHUTDOWN (blocklisted) and left the registry: the image stays on that
        client until it is closed; it is not re-opened through a new one while it runs."""
        conn = self._conn
        if conn is None:
            return False
        with _connections_lock:
            return _connections.get(conn.key) is not conn

    def describe(self) -> dict[str, Any]:
        # Names only: a keyring's path is shown, never its content.
        return {**super().describe(), "pool": self.pool, "image": self.image_name,
                "rbd_namespace": self.rbd_namespace, "ceph_conf": self.ceph_conf, "ceph_id": self.ceph_id,
                "ceph_keyring": self.ceph_keyring}
