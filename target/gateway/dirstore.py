"""DirStore: a gateway group's store in a local directory (gateways on one machine).

Layout of PATH (created 0700):
  group                the group's name, written at the first join (another group's directory is refused)
  store.lock           flock held while the index registry or the configuration is updated
  members/NAME.json    {"name", "index", "info"}: written by the member (atomic rename); kept after it dies,
                       so its index is the same at its next start
  members/NAME.lock    flock LOCK_EX held by the running member: alive = nobody else can take it
  config.json          {"version": N, "config": {...}} replaced atomically under store.lock (mode 0600: it holds
                       the hosts' DH-HMAC-CHAP keys like the daemon's own config file)
  ana/G.lock           flock LOCK_EX held by the owner of ANA group G; its content names the holder
  resv/KEY.json        {"version": N, "record": {...}}: a namespace's reservation state, replaced atomically
                       under store.lock (compare-and-swap on the version)
  resv-acks/NAME.json  {KEY: version}: the reservation versions member NAME applied

flock locks belong to the open file and the kernel drops them when the process dies (kill -9
included), so failover does not wait for any lease. Changes are noticed by a poll thread
(defaults.GATEWAY_DIR_POLL) that also probes the members' liveness with LOCK_SH|LOCK_NB.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from nvmeof import defaults
from target.gateway.store import (
    ConfigConflict,
    GroupStore,
    MemberAlive,
    MemberRecord,
    MemberRemoved,
    MemberUnknown,
    StoreError,
    check_name,
    free_index,
)

log = logging.getLogger(__name__)

JOIN_WAIT = 2.0  # seconds a join waits for a previous instance's member lock (it may be exiting)


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise StoreError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path``: a store directory removed and made again leaves our flock
    on a deleted file while another member locks the new one."""
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _try_flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


class DirStore(GroupStore):
    kind = "dir"

    def __init__(self, path: str | os.PathLike[str], group: str, lease: float = defaults.GATEWAY_LEASE,
                 *, poll: float = defaults.GATEWAY_DIR_POLL) -> None:
        super().__init__(group, lease)
        self.path = Path(os.path.abspath(path))
        self.poll = poll
        try:
            for sub in ("", "members", "ana", "resv", "resv-acks"):
                (self.path / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"--group-store dir:{self.path}: cannot create it: {exc.strerror}") from exc
        self._member_fd: int | None = None
        self._ana_fds: dict[int, int] = {}
        self._fd_lock = threading.Lock()  # forget() closes fds from the event loop while threads renew
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    @property
    def where(self) -> str:
        return f"dir:{self.path}"

    @contextlib.contextmanager
    def _store_lock(self):
        fd = os.open(self.path / "store.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # membership ------------------------------------------------------------------------------------
    def join(self, name: str, info: dict[str, Any]) -> int:
        check_name(name, "gateway name", "--gateway-name")
        with self._store_lock():
            self._check_group()
            fd = os.open(self.path / "members" / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                deadline = time.monotonic() + JOIN_WAIT
                while not _try_flock(fd, fcntl.LOCK_EX):
                    if time.monotonic() > deadline:
                        raise StoreError(f"gateway {name} is already running in group {self.group} ({self.where}); "
                                         "give this one another --gateway-name")
                    time.sleep(0.05)
            except BaseException:
                os.close(fd)
                raise
            self._member_fd = fd
            records = self._records()
            mine = records.get(name)
            index = mine["index"] if mine else free_index({r["index"] for r in records.values()}, name)
            _write_atomic(self._member_file(name), {"name": name, "index": index, "info": info})
        self.name, self.index = name, index
        baseline = self._signature()  # taken now: a change made right after join() must be reported
        self._poller = threading.Thread(target=self._poll, args=(baseline,), name=f"gateway-store-{name}",
                                        daemon=True)
        self._poller.start()
        return index

    def _check_group(self) -> None:
        marker = self.path / "group"
        try:
            recorded = marker.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            marker.write_text(self.group + "\n", encoding="utf-8")
            return
        if recorded != self.group:
            raise StoreError(f"{self.where} is the store of gateway group {recorded!r}, not {self.group!r}; "
                             "give the matching --gateway-group or another directory")

    def _member_file(self, name: str) -> Path:
        return self.path / "members" / f"{name}.json"

    def _records(self) -> dict[str, dict[str, Any]]:
        out = {}
        for path in sorted((self.path / "members").glob("*.json")):
            data = _read_json(path)
            if data and isinstance(data.get("index"), int) and data.get("name") == path.stem:
                out[path.stem] = data
        return out

    def publish(self, info: dict[str, Any]) -> None:
        assert self.name is not None and self.index is not None, "join() first"
        with self._store_lock():
            if not self._member_file(self.name).exists():
                raise MemberRemoved(f"gateway {self.name} is no longer recorded in {self.where}")
            _write_atomic(self._member_file(self.name), {"name": self.name, "index": self.index, "info": info})

    def remove_member(self, name: str) -> None:
        check_name(name, "gateway name", "NAME")
        with self._store_lock():  # join() takes it too: nobody can start as ``name`` meanwhile
            if name not in self._records():
                raise MemberUnknown(f"no gateway {name} is recorded in group {self.group} ({self.where})")
            lock = self.path / "members" / f"{name}.lock"
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                if not _try_flock(fd, fcntl.LOCK_EX):
                    raise MemberAlive(f"gateway {name} is alive (its process holds the flock on {lock}); stop it "
                                      "before removing it from the group")
                for path in (self._member_file(name), lock, self.path / "resv-acks" / f"{name}.json"):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            finally:
                os.close(fd)
        self._fire()

    def _alive(self, name: str) -> bool:
        if name == self.name:
            return self._member_fd is not None
        try:
            fd = os.open(self.path / "members" / f"{name}.lock", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            if _try_flock(fd, fcntl.LOCK_SH):
                return False  # nobody holds it exclusively: that member's process is gone
            return True
        finally:
            os.close(fd)

    def members(self) -> list[MemberRecord]:
        records = self._records()
        out = [MemberRecord(name, r["index"], self._alive(name), r.get("info") or {}) for name, r in records.items()]
        return sorted(out, key=lambda m: m.index)

    def heartbeat(self) -> None:
        if not self.path.is_dir():
            raise StoreError(f"{self.where} is gone")
        fd = self._member_fd
        if fd is not None and self.name is not None and not _same_file(fd, self.path / "members" / f"{self.name}.lock"):
            raise StoreError(f"{self.where}: this gateway's member lock file was removed or replaced (the store "
                             "directory was made again?); restart this gateway to join it again")

    def leave(self) -> None:
        for anagrpid in list(self._ana_fds):
            self.release(anagrpid)
        if self._member_fd is not None:
            os.close(self._member_fd)
            self._member_fd = None

    def close(self) -> None:
        self._stop.set()
        self.leave()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(2)

    # shared configuration ------------------------------------------------------------------------
    def get_config(self) -> tuple[int, dict[str, Any] | None]:
        data = _read_json(self.path / "config.json")
        if not data:
            return 0, None
        return int(data.get("version", 0)), data.get("config")

    def put_config(self, config: dict[str, Any], expected: int) -> int:
        with self._store_lock():
            current, _ = self.get_config()
            if current != expected:
                raise ConfigConflict(current)
            _write_atomic(self.path / "config.json", {"version": current + 1, "config": config})
        self._fire()
        return current + 1

    def _signature(self) -> tuple[Any, ...]:
        # contents, not stat(): an atomic rename may reuse an inode number within one mtime tick
        try:
            config = (self.path / "config.json").read_bytes()
        except FileNotFoundError:
            config = b""
        records = self._records()
        alive = tuple(sorted(name for name in records if self._alive(name)))
        return config, json.dumps(records, sort_keys=True), alive, tuple(sorted(self.reservation_versions().items()))

    # reservations ----------------------------------------------------------------------------------
    def _resv_path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise StoreError(f"reservation key {key!r} is not a namespace UUID")
        return self.path / "resv" / f"{key}.json"

    def get_reservation(self, key: str) -> tuple[int, dict[str, Any] | None]:
        data = _read_json(self._resv_path(key))
        if not data:
            return 0, None
        return int(data.get("version", 0)), data.get("record")

    def put_reservation(self, key: str, record: dict[str, Any], expected: int) -> int:
        with self._store_lock():
            current, _ = self.get_reservation(key)
            if current != expected:
                raise ConfigConflict(current)
            _write_atomic(self._resv_path(key), {"version": current + 1, "record": record})
        self._fire()
        return current + 1

    def delete_reservation(self, key: str) -> None:
        with self._store_lock(), contextlib.suppress(FileNotFoundError):
            self._resv_path(key).unlink()

    def reservation_versions(self) -> dict[str, int]:
        out = {}
        for path in (self.path / "resv").glob("*.json"):
            data = _read_json(path)
            if data:
                out[path.stem] = int(data.get("version", 0))
        return out

    def ack_reservations(self, applied: dict[str, int]) -> None:
        if self.name is None:
            raise StoreError("ack_reservations before join")
        _write_atomic(self.path / "resv-acks" / f"{self.name}.json", dict(applied))

    def reservation_acks(self) -> dict[str, dict[str, int]]:
        out = {}
        for path in (self.path / "resv-acks").glob("*.json"):
            data = _read_json(path)
            if data is not None:
                out[path.stem] = {str(k): int(v) for k, v in data.items()}
        return out

    def _poll(self, last: tuple[Any, ...]) -> None:
        while not self._stop.wait(self.poll):
            try:
                sig = self._signature()
            except (OSError, StoreError):
                continue
            if sig != last:
                last = sig
                try:
                    self._fire()
                except Exception:  # a closing event loop, a bug in a callback: keep polling
                    log.exception("group store %s: change callback failed", self.where)

    # ANA group ownership -------------------------------------------------------------------------
    def _ana_path(self, anagrpid: int) -> Path:
        return self.path / "ana" / f"{anagrpid}.lock"

    def try_acquire(self, anagrpid: int) -> bool:
        with self._fd_lock:
            if anagrpid in self._ana_fds:
                return self._renew(anagrpid)
            path = self._ana_path(anagrpid)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise StoreError(f"{self.where}: cannot open {path}: {exc.strerror}") from exc
            try:
                if not _try_flock(fd, fcntl.LOCK_EX):
                    os.close(fd)
                    return False
                os.ftruncate(fd, 0)
                os.pwrite(fd, (self.name or "?").encode() + b"\n", 0)
            except OSError as exc:  # never keep (or leak) a locked fd that is not recorded
                os.close(fd)
                raise StoreError(f"{self.where}: cannot take {path}: {exc.strerror}") from exc
            self._ana_fds[anagrpid] = fd
            self._held_until(anagrpid, None)
            return True

    def renew(self, anagrpid: int) -> bool:
        with self._fd_lock:
            return self._renew(anagrpid)

    def _renew(self, anagrpid: int) -> bool:
        """A flock does not expire, but the file it is on may have been removed or replaced (then someone
        else can lock the new one): held only while our fd is the file at the path."""
        fd = self._ana_fds.get(anagrpid)
        if fd is None:
            return False
        if _same_file(fd, self._ana_path(anagrpid)):
            return True
        self._close_ana(anagrpid, truncate=False)
        return False

    def _close_ana(self, anagrpid: int, *, truncate: bool) -> None:
        fd = self._ana_fds.pop(anagrpid, None)
        self._forget(anagrpid)
        if fd is not None:
            if truncate:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
            os.close(fd)

    def release(self, anagrpid: int) -> None:
        with self._fd_lock:
            self._close_ana(anagrpid, truncate=True)

    def forget(self, anagrpid: int) -> None:
        """Closing the fd drops the flock: a member stepping down must let a survivor take the group."""
        with self._fd_lock:
            self._close_ana(anagrpid, truncate=False)

    def owner(self, anagrpid: int) -> str | None:
        if anagrpid in self._ana_fds:
            return self.name
        try:
            fd = os.open(self._ana_path(anagrpid), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            if _try_flock(fd, fcntl.LOCK_SH):
                return None
            return os.pread(fd, 256, 0).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)

