"""File backend: a regular file or a block device, driven with preadv/pwritev on a thread pool.

Blocking system calls run on a small dedicated executor so the event loop keeps serving other
queues. Write Zeroes and Deallocate use fallocate(2) (zero range, punch hole) so they cost no data
transfer where the file system or device supports them, and fall back to writing zeros.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from nvmeof import defaults
from target.backends.base import Backend, BackendError

T = TypeVar("T")

BLKGETSIZE64 = 0x80081272  # _IOR(0x12, 114, size_t), include/uapi/linux/fs.h
FALLOC_FL_KEEP_SIZE = 0x01  # include/uapi/linux/falloc.h
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
_ZERO_CHUNK = 1 << 20
_ZEROS = bytes(_ZERO_CHUNK)
# fallocate modes a file system or device may not support; we fall back rather than fail
_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.ENOTTY})

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


class FileBackend(Backend):
    kind = "file"

    def __init__(
        self,
        path: str | os.PathLike[str],
        size: int | None = None,
        create: bool = False,
        read_only: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        self._read_only = read_only
        self._rwf_dsync = hasattr(os, "RWF_DSYNC")
        self._inflight = 0
        self._closing = False
        self._fd = -1
        if size is not None:
            self._positive_size(size)
        if create and read_only:
            raise BackendError(
                f"file backend {self.path}: cannot create a file read-only; drop one of the two"
            )
        st = self._stat(create, size)
        self.created = st is None
        self.block_device = st is not None and stat.S_ISBLK(st.st_mode)
        flags = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC
        if self.created:
            flags |= os.O_CREAT | os.O_EXCL
        try:
            self._fd = os.open(self.path, flags, 0o600)
        except PermissionError:
            mode = "reading" if read_only else "reading and writing"
            hint = "" if read_only else ", or add it read-only"
            raise BackendError(
                f"cannot open {self.path} for {mode}: permission denied; fix its permissions or owner{hint}"
            ) from None
        except OSError as exc:
            raise BackendError(f"cannot open {self.path}: {exc.strerror}") from None
        try:
            self._size = self._initial_size(size)
        except BaseException:
            self._discard_failed_open()
            raise

    def _stat(self, create: bool, size: int | None) -> os.stat_result | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if not create:
                raise BackendError(
                    f"{self.path} does not exist; create it first, or ask for it to be created "
                    "(create=True) with a size"
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
        except OSError as exc:
            raise BackendError(f"cannot look up {self.path}: {exc.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise BackendError(f"{self.path} is a directory; give a regular file or a block device")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise BackendError(f"{self.path} is neither a regular file nor a block device; give one of those")
        return st

    def _initial_size(self, size: int | None) -> int:
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
                if self._read_only:
                    raise BackendError(
                        f"{self.path} is {current} bytes, less than the {size} asked for, and it is "
                        "read-only so it cannot grow; give a size up to its length or leave the size out"
                    )
                # Grows sparsely: only the length changes, no blocks are written.
                os.ftruncate(self._fd, size)
        if size <= 0:
            raise BackendError(f"{self.path} is empty (0 bytes); give a size to grow it to")
        return size

    def _discard_failed_open(self) -> None:
        os.close(self._fd)
        self._fd = -1
        if self.created:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _name(self) -> str:
        return f"file backend {self.path}"

    async def _run(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        if self._closing:
            raise BackendError(f"{self._name()} is closed (its namespace was removed)")
        fut = asyncio.get_running_loop().run_in_executor(_get_executor(), fn, self._fd, *args)
        # The fd must outlive the thread using it even if our caller is cancelled: count the call
        # until the thread finishes, and let close() defer to the last one.
        self._inflight += 1
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

    async def read_into(self, offset: int, buf: memoryview) -> None:
        self._check_range(offset, len(buf))
        await self._run("read", _pread_all, buf, offset)

    async def read(self, offset: int, length: int) -> memoryview:
        self._check_range(offset, length)
        buf = memoryview(bytearray(length))
        await self._run("read", _pread_all, buf, offset)
        return buf

    async def write(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> None:
        self._check_write_range(offset, len(data))
        view = memoryview(data)
        if not fua:
            await self._run("write", _pwrite_all, view, offset)
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

    async def resize(self, new_size: int) -> None:
        self._positive_size(new_size, "new size")
        if self.block_device:
            capacity = await self._run("size lookup", _blockdev_size)
            if new_size > capacity:
                raise BackendError(
                    f"block device {self.path} holds {capacity} bytes; cannot present {new_size}. "
                    "Grow the device first"
                )
        else:
            if self._read_only:
                raise BackendError(f"{self._name()} is read-only; it cannot be resized")
            await self._run("resize", os.ftruncate, new_size)
        self._size = new_size

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
