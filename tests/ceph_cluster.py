"""A throwaway one-node Ceph cluster in a directory: one monitor, one memstore OSD, pool ``rbd`` of size 1.

Everything lives under the directory given (configuration, monitor store, OSD data, logs, sockets,
pid files); nothing touches /etc/ceph or /var/lib/ceph. The monitor listens on loopback ports chosen
free at start, so two clusters can run at once. The daemons run in the foreground of their own
sessions (``-f``), so a cluster started by ``scripts/ceph-cluster start`` outlives that command and
``stop`` finds them again by the pids written to ``cluster.json``.

Facts this mirrors are in /work/shared/CEPH.md: the start order, that RBD needs no manager, and that
a memstore OSD must never be restarted (it comes back empty), so an outage is SIGSTOP/SIGCONT.

Also a command line: ``python3 -m tests.ceph_cluster start|stop|status DIR`` (scripts/ceph-cluster).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType

from tests.ports import free_ports

BINARIES = ("ceph-mon", "ceph-osd", "ceph", "rbd", "monmaptool")
DIST_PACKAGES = "/usr/lib/python3/dist-packages"
PACKAGES = "ceph-mon ceph-osd ceph-mgr ceph-common python3-rbd python3-rados"
STATE = "cluster.json"
# What start() creates inside the directory; stop() removes exactly these (and the directory if
# start created it and nothing else is left in it).
CREATED = ("ceph.conf", "monmap", "keyring", "run", "log", "crash", "mon", "osd", STATE)
CLI_TIMEOUT = 60.0        # seconds one ceph/rbd command may take before it is called hung
STOP_GRACE = 15.0         # seconds a daemon gets after SIGTERM before SIGKILL
SUSPEND_WAIT = 10.0       # seconds suspend_osd waits for every thread of the OSD to stop


class CephClusterError(RuntimeError):
    """The cluster could not be started, or a command against it failed (the message says which)."""


class CephClusterExists(CephClusterError):
    """start() found a cluster's files in the directory and changed nothing."""


def unusable_reason() -> str | None:
    """Why a cluster cannot be started here (missing daemons/CLIs or Python bindings), or None."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"Ceph binaries missing ({', '.join(missing)}); apt-get install {PACKAGES}"
    for module in ("rados", "rbd"):
        if not _compiled_module(module):
            return f"Python binding {module} missing; apt-get install python3-rbd python3-rados"
    return None


def install_if_missing() -> str | None:
    """As root with apt-get, install the Debian packages when something is missing
    (tests/install_ceph_deps.sh); then why a cluster still cannot start here, or None."""
    reason = unusable_reason()
    if reason is None or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return reason
    script = Path(__file__).with_name("install_ceph_deps.sh")
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-10:])
        return f"{reason}; {script.name} failed (exit {res.returncode}):\n{tail}"
    return unusable_reason()


def _compiled_module(name: str) -> bool:
    """A compiled ``name`` is importable from sys.path or Debian's dist-packages (what
    target/backends/rbd.py's load_rbd searches; a plain rbd.py elsewhere does not count)."""
    for folder in [*sys.path, DIST_PACKAGES]:
        spec = importlib.machinery.PathFinder.find_spec(name, [folder or os.getcwd()])
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            return True
    return False


def _conf_text(d: Path, fsid: str, mon_host: str, memstore_bytes: int) -> str:
    return f"""[global]
fsid = {fsid}
mon host = {mon_host}
public network = 127.0.0.0/8
ms bind ipv4 = true
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
run dir = {d}/run
admin socket = {d}/run/$name.asok
pid file = {d}/run/$name.pid
log file = {d}/log/$name.log
crash dir = {d}/crash
keyring = {d}/keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim allowed = false
mon data avail warn = 2
# No manager runs (RBD, locks, watch/notify and omap need none): without this the monitor turns
# HEALTH_WARN "no active mgr" (MGR_DOWN) once mon_mgr_mkfs_grace (120 s) after creation has passed
# (MgrMonitor::get_health).
mon mgr mkfs grace = 31536000
mon cluster log file = {d}/log/ceph.$channel.log
osd crush chooseleaf type = 0
[client]
admin socket =
log to file = false
[mon]
mon data = {d}/mon/$name
[osd]
osd data = {d}/osd/$name
osd objectstore = memstore
memstore device bytes = {memstore_bytes}
"""


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG = 1, include/uapi/linux/prctl.h


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def thread_states(pid: int) -> list[str]:
    """The state letter (R, S, D, T...) of every thread of ``pid`` (/proc/PID/task/*/stat)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue   # the thread ended meanwhile
    return states


def _is_ours(pid: int, conf: Path) -> bool:
    """The pid still belongs to a daemon of this cluster (its command line names our conf), so a
    recycled pid is never signalled."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return str(conf).encode() in f.read().split(b"\0")
    except OSError:
        return False


class CephCluster:
    """One monitor ``a`` and one memstore OSD ``0`` under ``directory``; pool ``rbd`` (size 1)."""

    pool = "rbd"

    def __init__(self, directory: Path | str, *, memstore_bytes: int = 2 << 30, die_with_us: bool = True) -> None:
        """``die_with_us``: the daemons get SIGKILL when the process that started them dies (a test
        run killed by a CI timeout leaves no cluster behind); scripts/ceph-cluster turns it off."""
        self.directory = Path(directory).absolute()
        self.die_with_us = die_with_us
        self.conf = self.directory / "ceph.conf"
        self.memstore_bytes = memstore_bytes
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._pids: dict[str, int] = {}
        self._created_dir = False
        self._load_state()

    # lifecycle ------------------------------------------------------------------------------------

    def start(self, timeout: float = 90) -> None:
        """Create and start the cluster; CephClusterError (with the daemons' log tails) on failure.
        The daemons started so far keep running then: call stop()."""
        reason = unusable_reason()
        if reason:
            raise CephClusterError(reason)
        if not self.directory.exists():
            self.directory.mkdir(parents=True)
            self._created_dir = True
        taken = [name for name in CREATED if (self.directory / name).exists()]
        if taken:
            raise CephClusterExists(f"{self.directory} already holds {', '.join(taken)}: a cluster (running or "
                                   "not) is there; stop it first or pick an empty directory")
        deadline = time.monotonic() + timeout
        d = self.directory
        for sub in ("run", "log", "crash", "mon", "osd/osd.0"):
            (d / sub).mkdir(parents=True)
        v2, v1 = free_ports(2)
        mon_addr = f"[v2:127.0.0.1:{v2},v1:127.0.0.1:{v1}]"
        fsid = str(uuid.uuid4())
        self.conf.write_text(_conf_text(d, fsid, f"v2:127.0.0.1:{v2},v1:127.0.0.1:{v1}", self.memstore_bytes))
        self._save_state()
        try:
            self._run(["monmaptool", "--create", "--fsid", fsid, "--addv", "a", mon_addr, str(d / "monmap")],
                      deadline)
            self._run(["ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a", "--monmap", str(d / "monmap")],
                      deadline)
            self._spawn("mon.a", ["ceph-mon", "-f", "-c", str(self.conf), "-i", "a"])
            osd_uuid = str(uuid.uuid4())
            osd_id = self._ceph_until(deadline, "osd", "new", osd_uuid).strip()
            if osd_id != "0":
                raise CephClusterError(f"'ceph osd new' gave id {osd_id!r}, expected 0")
            self._run(["ceph-osd", "-c", str(self.conf), "-i", "0", "--mkfs", "--osd-uuid", osd_uuid], deadline)
            self._spawn("osd.0", ["ceph-osd", "-f", "-c", str(self.conf), "-i", "0"])
            self._wait_osd_up(deadline)
            self._ceph_until(deadline, "osd", "pool", "create", self.pool, "8")
            self._cli(["rbd", "-c", str(self.conf), "pool", "init", self.pool], deadline)
        except (CephClusterError, OSError, subprocess.SubprocessError) as exc:
            raise CephClusterError(f"Ceph cluster in {d} did not start: {exc}\n{self.log_tail()}") from None

    def stop(self, *, remove: bool = True) -> None:
        """SIGTERM the daemons (a suspended OSD is continued first), SIGKILL whatever is still running
        after STOP_GRACE s; with ``remove`` delete what start() created, and nothing else."""
        for name in ("osd.0", "mon.a"):
            pid = self._pids.get(name)
            if pid is None or not self._owned(name, pid):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGTERM)
            if not self._wait_gone(name, pid, STOP_GRACE):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._wait_gone(name, pid, 10)
        self._procs.clear()
        self._pids.clear()
        if remove:
            for entry in CREATED:
                path = self.directory / entry
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                elif path.exists() or path.is_symlink():
                    path.unlink()
            if self._created_dir:
                with contextlib.suppress(OSError):
                    self.directory.rmdir()   # only if empty: someone else's files stay
        elif self.directory.exists() and (self.directory / STATE).exists():
            self._save_state()

    def __enter__(self) -> CephCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # state ------------------------------------------------------------------------------------------

    def running(self) -> dict[str, bool]:
        """Each daemon's name and whether it runs."""
        return {name: self._owned(name, pid) for name, pid in self._pids.items()}

    def osd_pid(self) -> int:
        pid = self._pids.get("osd.0")
        if pid is None or not self._owned("osd.0", pid):
            raise CephClusterError(f"the OSD of the cluster in {self.directory} is not running")
        return pid

    def suspend_osd(self) -> None:
        """Make the cluster unreachable for data I/O (SIGSTOP; never restart a memstore OSD), and return only
        once every thread of the OSD has stopped. kill() returns when the signal is queued: the group stop
        starts when one OSD thread next runs and dequeues it (kernel do_signal_stop), and until each thread
        has stopped the OSD can still answer requests; a caller issuing I/O "to a stopped OSD" right after
        kill() then sometimes saw it answered (test_32_reads_in_flight_at_once: 32 reads answered 4096 with
        the right data, none seen in flight)."""
        pid = self.osd_pid()
        os.kill(pid, signal.SIGSTOP)
        end = time.monotonic() + SUSPEND_WAIT
        while any(state not in "tT" for state in thread_states(pid)):
            if time.monotonic() >= end:
                raise CephClusterError(f"the OSD (pid {pid}) did not stop within {SUSPEND_WAIT:.0f} s of SIGSTOP "
                                       f"(thread states {sorted(thread_states(pid))})")
            time.sleep(0.001)

    def resume_osd(self) -> None:
        os.kill(self.osd_pid(), signal.SIGCONT)

    # commands -------------------------------------------------------------------------------------

    def ceph(self, *args: str, timeout: float = CLI_TIMEOUT) -> str:
        """Run ``ceph -c CONF ARGS`` and return its stdout; CephClusterError with stderr on failure."""
        return self._cli(["ceph", "-c", str(self.conf), "--connect-timeout", str(int(timeout)), *args],
                         time.monotonic() + timeout)

    def rbd(self, *args: str, timeout: float = CLI_TIMEOUT) -> str:
        """Run ``rbd -c CONF ARGS`` and return its stdout; CephClusterError with stderr on failure."""
        return self._cli(["rbd", "-c", str(self.conf), *args], time.monotonic() + timeout)

    def rbd_bytes(self, *args: str, timeout: float = CLI_TIMEOUT) -> bytes:
        """Like rbd() for binary output (``rbd export IMAGE -``)."""
        return self._cli(["rbd", "-c", str(self.conf), *args], time.monotonic() + timeout, text=False)

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of every daemon log (and its captured stdout/stderr), for error messages."""
        out = []
        for log in sorted((self.directory / "log").glob("*")):
            try:
                tail = log.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if tail:
                out.append(f"--- {log} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(out) or f"(no logs in {self.directory / 'log'})"

    # internals ------------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CEPH_")}   # no outside conf/args
        return env

    def _cli(self, argv: list[str], deadline: float, *, text: bool = True) -> str:
        remaining = max(1.0, deadline - time.monotonic())
        try:
            res = subprocess.run(argv, capture_output=True, timeout=remaining, env=self._env(), check=False,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise CephClusterError(f"`{' '.join(argv)}` did not finish within {remaining:.0f} s") from None
        if res.returncode != 0:
            err = res.stderr.decode(errors="replace").strip()
            raise CephClusterError(f"`{' '.join(argv)}` failed (exit {res.returncode}): {err}")
        return res.stdout.decode(errors="replace") if text else res.stdout  # type: ignore[return-value]

    def _run(self, argv: list[str], deadline: float) -> str:
        return self._cli(argv, deadline)

    def _ceph_until(self, deadline: float, *args: str) -> str:
        """A ceph command retried until the deadline (the monitor may still be electing itself)."""
        while True:
            try:
                return self._cli(["ceph", "-c", str(self.conf), "--connect-timeout", "5", *args],
                                 min(deadline, time.monotonic() + 15))
            except CephClusterError:
                if time.monotonic() + 1 >= deadline:
                    raise
                self._check_daemons()
                time.sleep(0.5)

    def _spawn(self, name: str, argv: list[str]) -> None:
        # PR_SET_PDEATHSIG follows the thread that forks: only the main thread lives as long as we do.
        tie = self.die_with_us and threading.current_thread() is threading.main_thread()
        log = open(self.directory / "log" / f"{name}.stdout", "ab")   # the child gets its own copy
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=self._env(), start_new_session=True,
                                    preexec_fn=_die_with_parent if tie else None)
        finally:
            log.close()
        self._procs[name] = proc
        self._pids[name] = proc.pid
        self._save_state()

    def _check_daemons(self) -> None:
        for name, pid in self._pids.items():
            if not self._owned(name, pid):
                raise CephClusterError(f"{name} (pid {pid}) exited")

    def _wait_osd_up(self, deadline: float) -> None:
        while True:
            stat = json.loads(self._ceph_until(deadline, "osd", "stat", "-f", "json"))
            if stat.get("num_up_osds") == 1:
                return
            self._check_daemons()
            if time.monotonic() >= deadline:
                raise CephClusterError(f"the OSD did not come up (osd stat: {stat})")
            time.sleep(0.3)

    def _owned(self, name: str, pid: int) -> bool:
        proc = self._procs.get(name)
        if proc is not None:
            return proc.poll() is None
        return _alive(pid) and _is_ours(pid, self.conf)

    def _wait_gone(self, name: str, pid: int, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if not self._owned(name, pid):
                return True
            time.sleep(0.05)
        return not self._owned(name, pid)

    def _save_state(self) -> None:
        state = {"pids": self._pids, "created_dir": self._created_dir}
        (self.directory / STATE).write_text(json.dumps(state))

    def _load_state(self) -> None:
        try:
            state = json.loads((self.directory / STATE).read_text())
        except (OSError, ValueError):
            return
        self._pids = {str(k): int(v) for k, v in state.get("pids", {}).items()}
        self._created_dir = bool(state.get("created_dir"))


def _main(argv: list[str]) -> int:
    usage = "usage: ceph-cluster start|stop|status DIR"
    if len(argv) != 2 or argv[0] not in ("start", "stop", "status"):
        print(usage, file=sys.stderr)
        return 2
    command, directory = argv
    cluster = CephCluster(Path(directory), die_with_us=False)
    if command == "start":
        try:
            cluster.start()
        except CephClusterExists as exc:
            print(f"ceph-cluster: {exc}", file=sys.stderr)
            return 1
        except CephClusterError as exc:
            print(f"ceph-cluster: {exc}", file=sys.stderr)
            cluster.stop(remove=False)
            print(f"ceph-cluster: daemons stopped; files left in {cluster.directory} for inspection "
                  f"(remove them with: ceph-cluster stop {cluster.directory})", file=sys.stderr)
            return 1
        print(f"Ceph cluster running in {cluster.directory} (pool {cluster.pool}); conf: {cluster.conf}")
        print(f"export CEPH_CONF={cluster.conf}")
        return 0
    if not (cluster.directory / STATE).exists():
        print(f"ceph-cluster: no cluster in {cluster.directory} (no {STATE})", file=sys.stderr)
        return 1
    if command == "stop":
        cluster.stop()
        print(f"Ceph cluster in {cluster.directory} stopped and removed")
        return 0
    running = cluster.running()
    for name, up in running.items():
        print(f"{name}: {'running' if up else 'not running'} (pid {cluster._pids[name]})")
    print(f"conf: {cluster.conf}")
    print(f"export CEPH_CONF={cluster.conf}")
    if running and all(running.values()):
        try:
            print(cluster.ceph("health", timeout=10).strip())
        except CephClusterError as exc:
            print(f"health: {exc}")
            return 1
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
