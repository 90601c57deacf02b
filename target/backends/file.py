"""File backend: a regular file or a block device, driven with preadv/pwritev.

Data in the page cache is served on the event loop itself: a read first tries preadv2 with
RWF_NOWAIT (mm/filemap.c filemap_read gives up with EAGAIN, or a short count, instead of waiting
for the device), into a buffer from the backend's pool (target/backends/buffers.py), and only what
is not cached goes to a small dedicated thread pool; a write tries pwritev2 with RWF_NOWAIT the
same way, and where the file system does not support that for buffered writes (ext4 answers
EOPNOTSUPP) or answers EAGAIN, page-aligned writes up to FILE_INLINE_WRITE_MAX still run inline
while they stay fast (InlinePolicy, target/backends/inline.py: a slow one sends the file's writes
to the pool for a back-off period, as does dirty-page pressure) and the others on the pool. FUA writes,
Flush, Write Zeroes and Deallocate wait for the device or the journal: always the thread pool,
so the event loop keeps serving other queues. Write Zeroes and Deallocate use fallocate(2) (zero
range, punch hole) so they cost no data transfer where the file system or device supports them,
and fall back to writing zeros.

BackingPolicy says where the daemon's files may live (backing directories, named block devices);
opening never changes an existing file unless asked (``create`` grows, ``resize`` grows or, with
``allow_shrink``, cuts), as the kernel target and SPDK never truncate user data.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
import errno
import fcntl
import logging
import os
import stat
import struct
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from nvmeof import defaults
from target.backends.base import Backend, BackendError, BackendSpec, one_fd
from target.backends.buffers import BufferPool
from target.backends.inline import InlinePolicy, sync_flags

T = TypeVar("T")
log = logging.getLogger(__name__)

BLKGETSIZE64 = 0x80081272  # _IOR(0x12, 114, size_t), include/uapi/linux/fs.h
FALLOC_FL_KEEP_SIZE = 0x01  # include/uapi/linux/falloc.h
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
_ZERO_CHUNK = 1 << 20
_ZEROS = bytes(_ZERO_CHUNK)
# fallocate modes a file system or device may not support; we fall back rather than fail
_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.ENOTTY})
# preadv2/pwritev2 flag "fail with EAGAIN rather than wait" (Linux 4.14); None where Python lacks it
_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
_PAGE = os.sysconf("SC_PAGE_SIZE")

_executor: ThreadPoolExecutor | None = None
_fallocate_fn: Callable[..., int] | None = None


def _get_executor() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=defaults.FILE_IO_THREADS, thread_name_prefix="nvmeof-file")
    return _executor


def _libc_fallocate() -> Callable[..., int] | None:
    """libc fallocate(2) through ctypes: os.posix_fallocate has no mode argument."""
    global _fallocate_fn
    if _fallocate_fn is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            fn = getattr(libc, "fallocate64", None) or libc.fallocate
        except (OSError, AttributeError):
            return None
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        fn.restype = ctypes.c_int
        _fallocate_fn = fn
    return _fallocate_fn


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """Call fallocate(2); OSError carries its errno (ENOSYS when libc lacks it)."""
    fn = _libc_fallocate()
    if fn is None:
        raise OSError(errno.ENOSYS, "fallocate is not available in this C library")
    if fn(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _blockdev_size(fd: int) -> int:
    try:
        raw = fcntl.ioctl(fd, BLKGETSIZE64, bytes(8))
        return struct.unpack("Q", raw)[0]
    except OSError:
        return os.lseek(fd, 0, os.SEEK_END)


def _pread_all(fd: int, buf: memoryview, offset: int) -> None:
    done, total = 0, len(buf)
    while done < total:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise BackendError(
                f"read hit the end of the file at byte {offset + done}: "
                "the file was truncated by something else while in use"
            )
        done += n


def _pwrite_all(fd: int, data: memoryview, offset: int, flags: int = 0) -> None:
    done, total = 0, len(data)
    while done < total:
        done += os.pwritev(fd, [data[done:]], offset + done, flags)


def _write_zero_chunks(fd: int, offset: int, length: int) -> None:
    zeros = memoryview(_ZEROS)
    end = offset + length
    while offset < end:
        chunk = min(end - offset, _ZERO_CHUNK)
        _pwrite_all(fd, zeros[:chunk], offset)
        offset += chunk


def _zero_range(fd: int, offset: int, length: int) -> None:
    for mode in (FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE):
        try:
            fallocate(fd, mode, offset, length)
            return
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
    _write_zero_chunks(fd, offset, length)


def _punch_hole(fd: int, offset: int, length: int) -> None:
    try:
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
        _write_zero_chunks(fd, offset, length)


# Kernel interfaces, not storage: a namespace there could read process memory (/proc/PID/mem),
# kernel tunables or raw devices. Only a block device the operator names is served from them.
KERNEL_TREES = ("/proc", "/sys", "/dev")
_BACKING_HINT = "add --backing-dir DIR to nvmeof serve, or backing_dirs to its configuration file"
_DEVICE_HINT = "allow it with --allow-block-device PATH (or allow_block_devices in the configuration file)"


class BackingError(BackendError):
    """A path the backing policy refuses; the message says why and which option allows it."""


def _under(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def setting_path(value: str | os.PathLike[str], what: str) -> str:
    """An operator's --backing-dir/--allow-block-device value, resolved (relative to the directory
    `nvmeof serve` was started in, which is the operator's)."""
    text = os.fspath(value)
    if not isinstance(text, str) or not text or "\0" in text:
        raise BackingError(f"{what} {text!r} is not a usable path")
    return os.path.realpath(text)


def make_backing_dir(path: str | os.PathLike[str]) -> None:
    """Create the default backing directory (and the state directory above it) with mode 0700 if
    missing; a failure is only logged: a target serving RAM disks needs no directory."""
    path = os.fspath(path)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.warning("cannot create the backing directory %s: %s; file namespaces cannot be added there "
                    "until it exists (or give --backing-dir DIR)", path, exc.strerror or exc)


class BackingPolicy:
    """Where file namespaces may live: a regular file under one of ``backing_dirs``, or exactly one
    of ``block_devices``. Nothing under /proc, /sys or /dev except those block devices.

    Both sets are stored resolved (os.path.realpath), and so is every path checked, so a symbolic
    link inside a backing directory cannot point the daemon outside it. SPDK and the kernel target
    leave this to root; the daemon may serve a REST API to less trusted admins, hence the fence.
    """

    # its constructor's settings (the `nvmeof serve` options and configuration keys that fill them);
    # StoragePolicy (target/backends/__init__.py) hands each to the kind whose policy takes it
    settings = ("backing_dirs", "block_devices")

    def __init__(
        self,
        backing_dirs: Iterable[str | os.PathLike[str]] | None = None,
        block_devices: Iterable[str | os.PathLike[str]] = (),
    ) -> None:
        dirs = [self.default_dir()] if backing_dirs is None else list(backing_dirs)
        self.backing_dirs = tuple(dict.fromkeys(self._backing_dir(d) for d in dirs))
        self.block_devices = tuple(
            dict.fromkeys(setting_path(d, "--allow-block-device") for d in block_devices)
        )

    @staticmethod
    def default_dir() -> str:
        return os.path.join(defaults.state_dir(), defaults.BACKING_DIR)

    @staticmethod
    def _backing_dir(value: str | os.PathLike[str]) -> str:
        real = setting_path(value, "backing directory")
        tree = next((t for t in KERNEL_TREES if _under(real, t)), None)
        if tree is not None:
            raise BackingError(
                f"backing directory {real} is under {tree}, where no namespace file may live; "
                "give a directory elsewhere (a block device there needs --allow-block-device PATH)"
            )
        return real

    def widened(
        self,
        backing_dirs: Iterable[str | os.PathLike[str]] = (),
        block_devices: Iterable[str | os.PathLike[str]] = (),
    ) -> BackingPolicy:
        """A policy allowing these too (the configuration file's own keys, added to the flags)."""
        return BackingPolicy([*self.backing_dirs, *backing_dirs], [*self.block_devices, *block_devices])

    def describe(self) -> str:
        return ", ".join(self.backing_dirs) or "none"

    def widens(self, backing_dirs: Iterable[str] = (), block_devices: Iterable[str] = ()) -> list[str]:
        """The entries that would allow more than this policy does (a folder inside a backing
        directory does not)."""
        dirs = [d for d in backing_dirs if not any(_under(os.path.realpath(d), b) for b in self.backing_dirs)]
        return dirs + [d for d in block_devices if os.path.realpath(d) not in self.block_devices]

    def allows(self, real: str) -> bool:
        """Whether a resolved path may back a namespace."""
        if real in self.block_devices:
            return True
        if any(_under(real, t) for t in KERNEL_TREES):
            return False
        return any(_under(real, d) for d in self.backing_dirs)

    def check(self, path: Any, what: str = "path") -> str:
        """The resolved form of ``path`` if it may back a namespace; BackingError saying why not."""
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise BackingError(f"{what} must be a non-empty string (an absolute file path), got {path!r}")
        if "\0" in path:
            raise BackingError(f"{what} {path!r} contains a NUL byte, which no file path can hold")
        if not os.path.isabs(path):
            raise BackingError(
                f"{what} {path!r} is relative; give an absolute path (the daemon's working directory "
                "is not yours, so a relative path would name another file)"
            )
        real = os.path.realpath(path)
        shown = path if real == path else f"{path} (which resolves to {real})"
        if real in self.block_devices:
            return real
        tree = next((t for t in KERNEL_TREES if _under(real, t)), None)
        if tree is not None:
            raise BackingError(
                f"{what} {shown} is under {tree}, a kernel interface, not storage; only a block device "
                f"named by the operator is served from there: {_DEVICE_HINT}"
            )
        if not any(_under(real, d) for d in self.backing_dirs):
            raise BackingError(
                f"{what} {shown} is outside the backing directories ({self.describe()}); {_BACKING_HINT} "
                "to allow another directory"
            )
        return real

    def check_opened(self, fd: int, real: str, expected: os.stat_result | None) -> os.stat_result:
        """Check the object actually opened: of an allowed type, the one that was checked (not
        swapped in between, compared by device and inode), and still inside the policy wherever
        the kernel says the descriptor points now (/proc/self/fd)."""
        st = os.fstat(fd)
        if stat.S_ISBLK(st.st_mode):
            if real not in self.block_devices:
                raise BackingError(f"{real} is a block device, which is served only when named: {_DEVICE_HINT}")
        elif not stat.S_ISREG(st.st_mode):
            raise BackingError(f"{real} is not a regular file; give a regular file (or a block device)")
        if expected is not None and (st.st_dev, st.st_ino) != (expected.st_dev, expected.st_ino):
            raise BackingError(f"{real} was replaced while it was being opened; try again")
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            where = real  # no /proc: the O_NOFOLLOW open and the inode comparison above stand
        if where != real and not self.allows(where):
            raise BackingError(f"{real} turned out to be {where}, outside the backing directories; refused")
        return st


class FileBackend(Backend):
    kind = "file"
    policy_class = BackingPolicy
    holds_user_data = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        size: int | None = None,
        create: bool = False,
        read_only: bool = False,
        policy: BackingPolicy | None = None,
    ) -> None:
        """Open ``path``. An existing file is never changed by opening it: a smaller ``size``
        exports its first ``size`` bytes, a larger one is refused unless ``create`` asks for the
        file to be made that long (a missing file is created, a shorter one grown sparsely).

        With a ``policy`` (the daemon always gives one) the path is resolved and checked against it,
        the final component is opened with O_NOFOLLOW and the opened object is checked again, so
        a file swapped for a symbolic link between the check and the open is refused.
        """
        self.path = policy.check(path) if policy is not None else os.fspath(path)
        self._read_only = read_only
        self._rwf_dsync = hasattr(os, "RWF_DSYNC")
        self._inflight = 0
        self._closing = False
        self._fd = -1
        self._init_io()
        self.created = False
        self.grown_from: int | None = None  # the length before ``create`` grew an existing file
        if size is not None:
            self._positive_size(size)
        if create and read_only:
            raise BackendError(
                f"file backend {self.path}: cannot create a file read-only; drop one of the two"
            )
        st = self._stat(create, size, policy)
        self.created = st is None
        self.block_device = st is not None and stat.S_ISBLK(st.st_mode)
        flags = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC
        if self.created:
            flags |= os.O_CREAT | os.O_EXCL
        if policy is not None:
            # O_NONBLOCK: a FIFO swapped in after the check must not hang the open; cleared below.
            flags |= os.O_NOFOLLOW | os.O_NONBLOCK
        self._fd = self._open(flags)
        try:
            if policy is not None:
                policy.check_opened(self._fd, self.path, st)
                os.set_blocking(self._fd, True)
            self._size = self._initial_size(size, create)
            self._follow_open_flags()
        except BaseException:
            self._discard_failed_open()
            raise

    @classmethod
    def validate_spec(cls, spec: BackendSpec, policy: BackingPolicy | None = None) -> BackendSpec:
        if spec.path is None or os.fspath(spec.path) == "":
            raise BackendError("a file namespace needs a path (a regular file or a block device)")
        # Stored resolved: the config file and the API show the file actually served, and a restart
        # from another working directory serves the same one.
        path = policy.check(spec.path) if policy is not None else os.fspath(spec.path)
        return dataclasses.replace(spec, path=path)

    @classmethod
    def storage_key(cls, spec: BackendSpec, policy: BackingPolicy | None = None) -> Hashable | None:
        # the file itself, wherever a path names it from (a symbolic link, a second spelling)
        return ("path", os.path.realpath(spec.path)) if spec.path else None

    @classmethod
    def storage_name(cls, spec: BackendSpec) -> str:
        return os.fspath(spec.path or "")

    @classmethod
    def open(cls, spec: BackendSpec, policy: BackingPolicy | None = None) -> FileBackend:
        spec = cls.validate_spec(spec, policy)
        return cls(spec.path or "", size=spec.size, create=spec.create, read_only=spec.read_only, policy=policy)

    def describe_for_worker(self) -> tuple[dict[str, Any], list[int]]:
        # The checked descriptor, not the path: a file swapped since must not be reopened.
        return self.describe(), [self._fd]

    @classmethod
    def attach(cls, description: dict[str, Any], fds: list[int]) -> FileBackend:
        fd = one_fd(fds, f"file namespace {description.get('path')}")
        try:
            return cls.from_fd(fd, description["path"], description["size"], read_only=bool(description["read_only"]))
        except BaseException:
            os.close(fd)
            raise

    def follow_resize(self, size: int) -> None:
        # The main process already changed the file; here only the presented size follows.
        self._size = self._positive_size(size, "new size")

    @classmethod
    def from_fd(cls, fd: int, path: str, size: int, read_only: bool = False) -> FileBackend:
        """Serve a descriptor the main process opened and checked (a worker process gets it over
        its channel): opening the path again could reach another file swapped in meanwhile."""
        self = cls.__new__(cls)
        self.path, self._read_only, self._rwf_dsync = path, read_only, hasattr(os, "RWF_DSYNC")
        self._inflight, self._closing, self._fd = 0, False, fd
        self._init_io()
        self.created, self.grown_from = False, None
        self.block_device = stat.S_ISBLK(os.fstat(fd).st_mode)
        self._size = self._positive_size(size)
        self._follow_open_flags()
        return self

    def fileno(self) -> int:
        return self._fd

    def _init_io(self) -> None:
        """The data path's state: the read buffer pool, which RWF_NOWAIT probes still apply, and
        counters of calls served inline and on the thread pool (``io_counts``)."""
        self._pool = BufferPool(defaults.FILE_BUFFER_SIZE, defaults.FILE_BUFFERS)
        self._nowait_read = self._nowait_write = _RWF_NOWAIT is not None
        self._inline_write_max = defaults.FILE_INLINE_WRITE_MAX
        self._write_policy = InlinePolicy()   # when plain buffered writes run inline (target/backends/inline.py)
        self.inline_ops = 0   # reads/writes completed on the event loop
        self.thread_ops = 0   # calls handed to the thread pool (cold reads, FUA, flush, fallocate, ...)
        # which road the inline writes took: RWF_NOWAIT (the kernel bounds them), or timed by the write
        # policy where the file system refuses RWF_NOWAIT for buffered writes (ext4, tmpfs) or a write
        # answered EAGAIN (counted too)
        self.nowait_writes = self.timed_writes = self.nowait_eagain = 0

    def _follow_open_flags(self) -> None:
        # A descriptor opened O_DIRECT / O_SYNC / O_DSYNC (one handed over by whoever opened it) waits
        # for the device on every write: never inline.
        if sync_flags(self._fd):
            self._inline_write_max = 0

    def io_counts(self) -> dict[str, int]:
        return {"inline": self.inline_ops, "thread": self.thread_ops, "pool_buffers": len(self._pool),
                "pool_misses": self._pool.misses, "write_nowait": self.nowait_writes,
                "write_eagain": self.nowait_eagain, "write_timed": self.timed_writes,
                **{f"write_{k}": v for k, v in self._write_policy.counts().items()}}

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags, 0o600)
        except PermissionError:
            mode = "reading" if self._read_only else "reading and writing"
            hint = "" if self._read_only else ", or add it read-only"
            raise BackendError(
                f"cannot open {self.path} for {mode}: permission denied; fix its permissions or owner{hint}"
            ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise BackingError(f"{self.path} became a symbolic link while it was being opened; refused") from None
            raise BackendError(f"cannot open {self.path}: {exc.strerror}") from None

    def _stat(self, create: bool, size: int | None, policy: BackingPolicy | None) -> os.stat_result | None:
        try:
            # The policy resolved the path: a link found now was swapped in since, never followed.
            st = os.lstat(self.path) if policy is not None else os.stat(self.path)
        except FileNotFoundError:
            if not create:
                raise BackendError(
                    f"{self.path} does not exist; create it first, or ask for it to be created "
                    "(create, --create) with a size"
                ) from None
            if size is None:
                raise BackendError(
                    f"{self.path} does not exist and no size was given to create it with"
                ) from None
            parent = os.path.dirname(os.path.abspath(self.path))
            if not os.path.isdir(parent):
                raise BackendError(f"cannot create {self.path}: folder {parent} does not exist") from None
            return None
        except PermissionError:
            raise BackendError(
                f"cannot look up {self.path}: permission denied on a folder in its path"
            ) from None
        except (OSError, ValueError) as exc:
            raise BackendError(f"cannot look up {self.path}: {getattr(exc, 'strerror', None) or exc}") from None
        if stat.S_ISLNK(st.st_mode):
            raise BackingError(f"{self.path} became a symbolic link while it was being checked; refused")
        if stat.S_ISDIR(st.st_mode):
            raise BackendError(f"{self.path} is a directory; give a regular file or a block device")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise BackendError(
                f"{self.path} is neither a regular file nor a block device (a FIFO, socket or character "
                "device cannot hold a namespace); give one of those"
            )
        if policy is not None and stat.S_ISBLK(st.st_mode) and self.path not in policy.block_devices:
            raise BackingError(f"{self.path} is a block device, which is served only when named: {_DEVICE_HINT}")
        return st

    def _initial_size(self, size: int | None, create: bool) -> int:
        if self.block_device:
            capacity = _blockdev_size(self._fd)
            if size is None:
                size = capacity
            elif size > capacity:
                raise BackendError(
                    f"block device {self.path} holds {capacity} bytes, less than the {size} asked for; "
                    "give a smaller size or leave it out to use the whole device"
                )
        else:
            current = os.fstat(self._fd).st_size
            if size is None:
                size = current
            elif size > current:
                if not create:
                    # nvmet and SPDK never change a file behind the user's back; neither do we.
                    raise BackendError(
                        f"{self.path} is {current} bytes, less than the size {size} asked for; adding a file "
                        f"never grows it unless asked: give a size up to {current} (or none) to export it as "
                        f"it is, or ask for create (--create, \"create\": true) to grow it sparsely to {size}"
                    )
                self._set_length(size)
                if not self.created:
                    self.grown_from = current
        if size <= 0:
            raise BackendError(f"{self.path} is empty (0 bytes); give a size and create to grow it")
        return size

    def _set_length(self, length: int) -> None:
        """ftruncate(2) with the reasons a file system refuses a length spelled out."""
        try:
            os.ftruncate(self._fd, length)
        except OverflowError:
            raise BackendError(f"{self.path}: size {length} is beyond the largest file offset") from None
        except OSError as exc:
            reason = {
                errno.EFBIG: "the file system (or RLIMIT_FSIZE) does not allow a file that large (EFBIG)",
                errno.ENOSPC: "no space is left on its file system (ENOSPC)",
                errno.EDQUOT: "the disk quota is exceeded (EDQUOT)",
                errno.EINVAL: "the file system refuses that length (EINVAL)",
            }.get(exc.errno or 0, exc.strerror or str(exc))
            raise BackendError(f"cannot make {self.path} {length} bytes long: {reason}; give a smaller size") from None

    def _discard_failed_open(self) -> None:
        self._undo_open_changes()
        os.close(self._fd)
        self._fd = -1

    def _undo_open_changes(self) -> None:
        """Take back what opening did to the file: remove it if it was created (only if the name
        still leads to the very file we created), or cut it back to its old length if grown."""
        try:
            if self.created:
                opened, named = os.fstat(self._fd), os.lstat(self.path)
                if (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino):
                    os.unlink(self.path)
            elif self.grown_from is not None:
                os.ftruncate(self._fd, self.grown_from)
        except OSError:
            pass

    def close_unused(self) -> None:
        """Close a backend that was opened but never used, undoing what the open did to the file
        (TargetService calls it when the namespace it was opened for could not be added)."""
        if self._fd >= 0 and self._inflight == 0:
            self._undo_open_changes()
        self.close()

    def _name(self) -> str:
        return f"file backend {self.path}"

    async def _run(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        if self._closing:
            raise BackendError(f"{self._name()} is closed (its namespace was removed)")
        fut = asyncio.get_running_loop().run_in_executor(_get_executor(), fn, self._fd, *args)
        # The fd must outlive the thread using it even if our caller is cancelled: count the call
        # until the thread finishes, and let close() defer to the last one.
        self._inflight += 1
        self.thread_ops += 1
        fut.add_done_callback(self._op_done)
        try:
            return await asyncio.shield(fut)
        except OSError as exc:
            raise BackendError(f"{self._name()}: {what} failed: {exc.strerror or exc}") from exc

    def _op_done(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled():
            fut.exception()  # marks it retrieved when the awaiting task went away
        self._inflight -= 1
        if self._closing and self._inflight == 0:
            self._close_fd()

    # the data path ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise BackendError(f"{self._name()} is closed (its namespace was removed)")

    def _read_cached(self, buf: memoryview, offset: int) -> int:
        """Bytes at the start of ``buf`` filled from the page cache without waiting: preadv2 with
        RWF_NOWAIT (IOCB_NOWAIT; filemap_read stops at the first page not cached, so the count may
        be short). 0 when nothing is cached or the file does not support it (tmpfs: EOPNOTSUPP,
        remembered so later reads skip the probe)."""
        if not self._nowait_read:
            return 0
        try:
            return os.preadv(self._fd, [buf], offset, _RWF_NOWAIT)  # type: ignore[arg-type]
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise BackendError(f"{self._name()}: read failed: {exc.strerror or exc}") from exc
            self._nowait_read = False
            return 0

    def _write_cached(self, view: memoryview, offset: int) -> int:
        """Bytes at the start of ``view`` written on the event loop: pwritev2 with RWF_NOWAIT where
        the file system allows it for buffered writes (XFS, btrfs); where it does not (ext4, tmpfs),
        or when it answers EAGAIN, for a page-aligned write up to FILE_INLINE_WRITE_MAX a plain pwritev
        (it copies into the page cache and needs no read of a partial page first) while the write
        policy says inline, timed for it; 0 means the caller goes to the thread pool.

        EAGAIN goes to the write policy rather than straight to the pool: on XFS nearly every one is
        the file's timestamp update, which IOCB_NOWAIT refuses whenever the clock has ticked since the
        last one (file_modified_flags), about 250 a second here, and a pool hand-off for each stalled
        the loop more (GIL hand-offs) than the update does; one that sleeps backs the file off."""
        fd, length = self._fd, len(view)
        if self._nowait_write:
            try:
                done = os.pwritev(fd, [view], offset, _RWF_NOWAIT)  # type: ignore[arg-type]
                self.nowait_writes += done == length
                return done
            except BlockingIOError:
                self.nowait_eagain += 1
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise BackendError(f"{self._name()}: write failed: {exc.strerror or exc}") from exc
                self._nowait_write = False  # ext4, tmpfs: buffered writes never take RWF_NOWAIT
        policy = self._write_policy
        if length > self._inline_write_max or (offset | length) & (_PAGE - 1) or not policy.inline_now():
            return 0
        clock = policy.clock
        switches = policy.switches()
        cpu = policy.cpu() if policy.cpu_timed else -1
        start = clock()
        try:
            _pwrite_all(fd, view, offset)
        except OSError as exc:
            policy.record(start, clock(), switches, cpu)
            raise BackendError(f"{self._name()}: write failed: {exc.strerror or exc}") from exc
        policy.record(start, clock(), switches, cpu)
        self.timed_writes += 1
        return length

    def read_nowait(self, offset: int, length: int) -> memoryview | None:
        # The batch engine's hot path: the checks of _check_range/_check_open and the probe of
        # _read_cached inlined (a method call each costs about as much as the page-cache copy of 4 KiB).
        if offset < 0 or length < 0 or offset + length > self._size or self._closing or not self._nowait_read:
            self._check_range(offset, length)
            self._check_open()
            return None   # no RWF_NOWAIT here: read() takes the thread pool
        buf = self._pool.take(length)
        try:
            done = os.preadv(self._fd, [buf], offset, _RWF_NOWAIT)  # type: ignore[arg-type]
        except BlockingIOError:
            return None   # not cached: read() takes the thread pool
        except OSError:
            done = self._read_cached(buf, offset)   # again, for its EOPNOTSUPP/error handling
        if done == length:
            self.inline_ops += 1
            return buf
        return None

    def write_nowait(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> bool:
        self._check_write_range(offset, len(data))
        self._check_open()
        if fua:
            return False   # RWF_DSYNC waits for the device
        view = memoryview(data)
        if self._write_cached(view, offset) == len(view):
            self.inline_ops += 1
            return True
        return False   # what a short NOWAIT write did is written again by write(): same bytes

    async def read_into(self, offset: int, buf: memoryview) -> None:
        self._check_range(offset, len(buf))
        self._check_open()
        done = self._read_cached(buf, offset)
        if done == len(buf):
            self.inline_ops += 1
            return
        await self._run("read", _pread_all, buf[done:], offset + done)

    async def read(self, offset: int, length: int) -> memoryview:
        """A view of a pooled buffer; it stays valid (and is not reused) for as long as any
        reference to it lives (target/backends/buffers.py)."""
        self._check_range(offset, length)
        self._check_open()
        buf = self._pool.take(length)
        done = self._read_cached(buf, offset)
        if done == length:
            self.inline_ops += 1
            return buf
        await self._run("read", _pread_all, buf[done:], offset + done)
        return buf

    async def write(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> None:
        self._check_write_range(offset, len(data))
        self._check_open()
        view = memoryview(data)
        if not fua:
            done = self._write_cached(view, offset)
            if done == len(view):
                self.inline_ops += 1
                return
            await self._run("write", _pwrite_all, view[done:], offset + done)
            return
        if self._rwf_dsync:
            try:
                await self._run("write (FUA)", _pwrite_all, view, offset, os.RWF_DSYNC)
                return
            except BackendError as exc:
                cause = exc.__cause__
                if not (isinstance(cause, OSError) and cause.errno in _UNSUPPORTED):
                    raise
                self._rwf_dsync = False  # kernel or file system refuses per-write sync: sync separately
        await self._run("write", _pwrite_all, view, offset)
        await self._run("fdatasync", os.fdatasync)

    async def flush(self) -> None:
        await self._run("fdatasync", os.fdatasync)

    async def write_zeroes(self, offset: int, length: int) -> None:
        self._check_write_range(offset, length)
        if length:
            await self._run("write zeroes", _zero_range, offset, length)

    async def discard(self, offset: int, length: int) -> None:
        self._check_write_range(offset, length)
        if length:
            await self._run("deallocate", _punch_hole, offset, length)

    async def resize(self, new_size: int, *, allow_shrink: bool = False) -> int | None:
        """Present ``new_size`` bytes. Growing past the end of the file extends it sparsely (the
        resize is the explicit request); shrinking needs ``allow_shrink`` and cuts the file too when
        the namespace ended where the file ends. A namespace on the first bytes of a longer file,
        a block device and a read-only file are never changed: only what is presented.

        Returns the file's length before, if it was changed (for ``revert_resize``), else None.
        """
        self._positive_size(new_size, "new size")
        if new_size < self._size and not allow_shrink:
            raise BackendError(
                f"{self._name()}: shrinking from {self._size} to {new_size} bytes cuts off the namespace's tail, "
                "whose data hosts then lose; ask for it explicitly with allow_shrink "
                "(--allow-shrink, \"allow_shrink\": true)"
            )
        if self.block_device:
            capacity = await self._run("size lookup", _blockdev_size)
            if new_size > capacity:
                raise BackendError(
                    f"block device {self.path} holds {capacity} bytes; cannot present {new_size}. "
                    "Grow the device first"
                )
            self._size = new_size
            return None
        length = (await self._run("size lookup", os.fstat)).st_size
        target: int | None = None
        if new_size > length:
            if self._read_only:
                raise BackendError(
                    f"{self._name()} is read-only and {length} bytes long; it cannot grow to {new_size}"
                )
            target = new_size
        elif new_size < self._size and length == self._size and not self._read_only:
            target = new_size
        if target is not None:
            await self._run("resize", self._length_setter, target)
        self._size = new_size
        return length if target is not None else None

    async def revert_resize(self, size: int, length: int | None) -> None:
        """Undo ``resize``: present ``size`` again, and give the file back its ``length``."""
        if length is not None:
            await self._run("resize", self._length_setter, length)
        self._size = size

    def _length_setter(self, fd: int, length: int) -> None:
        # runs on the executor with the fd _run hands every call
        self._set_length(length)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._inflight == 0:
            self._close_fd()

    def _close_fd(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": self.path, "block_device": self.block_device}
