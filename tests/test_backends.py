"""Storage backends: RAM, null and file (regular file and, where loop devices work, a block device)."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import subprocess
import tempfile

import pytest

from target.backends import (
    BackendError,
    BackingError,
    BackingPolicy,
    FileBackend,
    NullBackend,
    RamBackend,
    open_backend,
)
from target.backends import file as filemod
from target.backends import null as nullmod

MiB = 1 << 20


# --- RAM ---------------------------------------------------------------------------------------


async def test_ram_write_read_roundtrip_and_live_view():
    ram = RamBackend(MiB)
    assert ram.size == MiB and not ram.read_only
    await ram.write(4096, b"abc" * 100)
    view = await ram.read(4096, 300)
    assert isinstance(view, memoryview) and bytes(view) == b"abc" * 100
    # no copy: the view shows later writes to the same bytes
    await ram.write(4096, b"XYZ")
    assert bytes(view[:3]) == b"XYZ"
    buf = memoryview(bytearray(6))
    await ram.read_into(4096, buf)
    assert bytes(buf) == b"XYZabc"


async def test_ram_rejects_out_of_range_and_negative():
    ram = RamBackend(8192)
    for call in (
        ram.read(8000, 193),
        ram.write(8190, b"abc"),
        ram.read_into(8192, memoryview(bytearray(1))),
        ram.write_zeroes(0, 8193),
        ram.discard(4096, 4097),
        ram.read(-1, 1),
    ):
        with pytest.raises(BackendError, match=r"past the end|negative"):
            await call
    await ram.read(8191, 1)  # the very last byte is fine


async def test_ram_write_zeroes_and_discard_zero_the_range():
    ram = RamBackend(64 * 1024)
    await ram.write(0, b"\xff" * (64 * 1024))
    await ram.write_zeroes(100, 10000)  # unaligned: partial pages plus whole pages
    data = bytes(await ram.read(0, 64 * 1024))
    assert data[:100] == b"\xff" * 100 and data[100:10100] == bytes(10000) and data[10100:] == b"\xff" * (
        64 * 1024 - 10100
    )
    await ram.discard(8192, 3 * 4096)
    data = bytes(await ram.read(0, 64 * 1024))
    assert data[8192 : 8192 + 3 * 4096] == bytes(3 * 4096)
    assert data[8192 + 3 * 4096 :] == b"\xff" * (64 * 1024 - 8192 - 3 * 4096)
    await ram.discard(5, 3)  # within one page
    assert bytes(await ram.read(0, 10)) == b"\xff" * 5 + bytes(3) + b"\xff" * 2


async def test_ram_resize_grows_and_shrinks_preserving_data():
    ram = RamBackend(2 * MiB)
    await ram.write(0, b"head")
    await ram.write(2 * MiB - 4, b"tail")
    held = await ram.read(0, 4)  # a view held across the resize stays valid
    await ram.resize(3 * MiB)
    assert ram.size == 3 * MiB
    assert bytes(await ram.read(0, 4)) == b"head"
    assert bytes(await ram.read(2 * MiB - 4, 4)) == b"tail"
    assert bytes(await ram.read(2 * MiB, MiB)) == bytes(MiB)
    assert bytes(held) == b"head"
    await ram.resize(MiB)
    assert ram.size == MiB and bytes(await ram.read(0, 4)) == b"head"
    with pytest.raises(BackendError, match="past the end"):
        await ram.read(MiB, 1)
    with pytest.raises(BackendError, match="positive"):
        await ram.resize(0)


async def test_ram_read_only_rejects_writes_and_close_stops_io():
    ram = RamBackend(4096, read_only=True)
    assert ram.read_only
    for call in (ram.write(0, b"x"), ram.write_zeroes(0, 1), ram.discard(0, 1)):
        with pytest.raises(BackendError, match="read-only"):
            await call
    assert bytes(await ram.read(0, 4)) == bytes(4)
    view = await ram.read(0, 4)
    ram.close()  # a held view must not make close fail
    ram.close()
    with pytest.raises(BackendError, match="closed"):
        await ram.read(0, 1)
    assert bytes(view) == bytes(4)
    assert ram.describe() == {"kind": "ram", "size": 4096, "read_only": True}


def test_ram_bad_size():
    with pytest.raises(BackendError, match="positive"):
        RamBackend(0)


# --- null ---------------------------------------------------------------------------------------


async def test_null_reads_zeros_from_a_shared_buffer_and_drops_writes():
    null = NullBackend(1 << 40)
    await null.write(0, b"data", fua=True)
    a = await null.read(0, 4096)
    b = await null.read(1 << 30, 128 * 1024)
    assert bytes(a) == bytes(4096) and bytes(b) == bytes(128 * 1024)
    assert isinstance(a, memoryview) and a.obj is nullmod._ZEROS and b.obj is nullmod._ZEROS
    big = await null.read(0, nullmod.ZERO_BUFFER_SIZE + 1)
    assert len(big) == nullmod.ZERO_BUFFER_SIZE + 1 and not any(big)
    buf = memoryview(bytearray(b"\x01" * (nullmod.ZERO_BUFFER_SIZE + 10)))
    await null.read_into(0, buf)
    assert not any(buf)
    await null.flush()
    await null.write_zeroes(0, 10)
    await null.discard(0, 10)
    with pytest.raises(BackendError, match="past the end"):
        await null.read((1 << 40) - 1, 2)
    with pytest.raises(BackendError, match="past the end"):
        await null.write((1 << 40), b"x")
    await null.resize(4096)
    assert null.size == 4096
    assert null.describe()["kind"] == "null"


async def test_null_read_only():
    null = NullBackend(4096, read_only=True)
    with pytest.raises(BackendError, match="read-only"):
        await null.write(0, b"x")


# --- file ---------------------------------------------------------------------------------------


async def test_file_create_write_read(tmp_path):
    path = tmp_path / "disk.img"
    f = FileBackend(path, size=8 * MiB, create=True)
    try:
        assert f.created and os.path.getsize(path) == 8 * MiB and f.size == 8 * MiB
        assert os.stat(path).st_blocks == 0  # sparse
        await f.write(MiB + 512, b"hello world")
        out = await f.read(MiB + 512, 11)
        assert bytes(out) == b"hello world"
        buf = memoryview(bytearray(5))
        await f.read_into(MiB + 518, buf)
        assert bytes(buf) == b"world"
        await f.flush()
        with pytest.raises(BackendError, match="past the end"):
            await f.read(8 * MiB - 1, 2)
        with pytest.raises(BackendError, match="past the end"):
            await f.write(8 * MiB, b"x")
        assert f.describe() == {
            "kind": "file", "path": str(path), "size": 8 * MiB, "read_only": False, "block_device": False,
        }
    finally:
        f.close()
    with pytest.raises(BackendError, match="closed"):
        await f.read(0, 1)


def test_file_open_errors_name_path_and_remedy(tmp_path):
    missing = tmp_path / "nope.img"
    with pytest.raises(BackendError, match=r"nope\.img does not exist.*create"):
        FileBackend(missing)
    with pytest.raises(BackendError, match="no size"):
        FileBackend(missing, create=True)
    with pytest.raises(BackendError, match="is a directory"):
        FileBackend(tmp_path)
    with pytest.raises(BackendError, match="neither a regular file nor a block device"):
        FileBackend("/dev/null")
    with pytest.raises(BackendError, match=r"folder .* does not exist"):
        FileBackend(tmp_path / "no" / "such.img", size=4096, create=True)
    empty = tmp_path / "empty.img"
    empty.touch()
    with pytest.raises(BackendError, match="empty"):
        FileBackend(empty)
    assert not missing.exists()


def _open_as_nobody(path: str) -> str:
    """Open ``path`` in a forked child that dropped root (root bypasses file permissions)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        message = "opened"
        try:
            os.setgid(65534)
            os.setuid(65534)
            FileBackend(path).close()
        except BackendError as exc:
            message = str(exc)
        except BaseException as exc:  # report anything else to the parent
            message = f"unexpected {exc!r}"
        os.write(wfd, message.encode())
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as fh:
        out = fh.read().decode()
    os.waitpid(pid, 0)
    return out


def test_file_unreadable_reports_permission():
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    folder = tempfile.mkdtemp()
    try:
        os.chmod(folder, 0o755)
        path = os.path.join(folder, "secret.img")
        with open(path, "wb") as fh:
            fh.write(bytes(4096))
        os.chmod(path, 0o000)
        message = _open_as_nobody(path)
        assert f"cannot open {path} for reading and writing: permission denied" in message
        os.chmod(folder, 0o700)
        message = _open_as_nobody(path)
        assert f"cannot look up {path}: permission denied" in message
    finally:
        shutil.rmtree(folder)


async def test_file_existing_is_never_grown_without_create(tmp_path):
    path = tmp_path / "d.img"
    path.write_bytes(b"\x07" * 8192)
    f = FileBackend(path)
    assert f.size == 8192 and not f.created
    f.close()
    # issue 10 item 2: a larger size used to grow the file (ftruncate) without being asked to
    for read_only in (False, True):
        with pytest.raises(BackendError, match=r"is 8192 bytes, less than the size 16384 .*create"):
            FileBackend(path, size=16384, read_only=read_only)
        assert os.path.getsize(path) == 8192
    prefix = FileBackend(path, size=4096)  # a smaller size exports the first bytes, the file untouched
    assert prefix.size == 4096 and os.path.getsize(path) == 8192
    prefix.close()
    g = FileBackend(path, size=16384, create=True)  # asked for: grown sparsely
    assert os.path.getsize(path) == 16384 and bytes(await g.read(8190, 4)) == b"\x07\x07\x00\x00"
    assert g.grown_from == 8192 and not g.created
    g.close_unused()  # what TargetService does when the namespace cannot be added after all
    assert path.read_bytes() == b"\x07" * 8192
    with pytest.raises(BackendError, match="cannot create a file read-only"):
        FileBackend(tmp_path / "x.img", size=4096, create=True, read_only=True)


async def test_file_read_only_rejects_writes(tmp_path):
    path = tmp_path / "ro.img"
    path.write_bytes(b"z" * 4096)
    f = FileBackend(path, read_only=True)
    try:
        for call in (f.write(0, b"x"), f.write_zeroes(0, 512), f.discard(0, 512), f.resize(8192)):
            with pytest.raises(BackendError, match="read-only"):
                await call
        assert bytes(await f.read(0, 2)) == b"zz"
    finally:
        f.close()


async def test_file_fua_uses_rwf_dsync_or_falls_back_to_fdatasync(tmp_path, monkeypatch):
    f = FileBackend(tmp_path / "fua.img", size=MiB, create=True)
    f._nowait_write, f._inline_write_max = False, 0  # every write on the thread pool (the inline path: below)
    calls = []
    real_pwritev, real_fdatasync = os.pwritev, os.fdatasync

    def spy_pwritev(fd, buffers, offset, flags=0):
        calls.append(("pwritev", flags))
        return real_pwritev(fd, buffers, offset, flags)

    def spy_fdatasync(fd):
        calls.append(("fdatasync",))
        return real_fdatasync(fd)

    monkeypatch.setattr(os, "pwritev", spy_pwritev)
    monkeypatch.setattr(os, "fdatasync", spy_fdatasync)
    try:
        await f.write(0, b"a" * 512)
        assert calls == [("pwritev", 0)]
        calls.clear()
        await f.write(512, b"b" * 512, fua=True)
        if hasattr(os, "RWF_DSYNC"):
            assert calls == [("pwritev", os.RWF_DSYNC)]
        else:
            assert calls == [("pwritev", 0), ("fdatasync",)]

        # a kernel or file system that refuses RWF_DSYNC: write, then fdatasync, and remember that
        def refusing_pwritev(fd, buffers, offset, flags=0):
            if flags:
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            return spy_pwritev(fd, buffers, offset, flags)

        monkeypatch.setattr(os, "pwritev", refusing_pwritev)
        f._rwf_dsync = True
        calls.clear()
        await f.write(1024, b"c" * 512, fua=True)
        assert calls == [("pwritev", 0), ("fdatasync",)] and f._rwf_dsync is False
        calls.clear()
        await f.flush()
        assert calls == [("fdatasync",)]
        assert bytes(await f.read(0, 1536)) == b"a" * 512 + b"b" * 512 + b"c" * 512
    finally:
        f.close()


async def test_file_discard_punches_a_hole(tmp_path):
    path = tmp_path / "hole.img"
    f = FileBackend(path, size=4 * MiB, create=True)
    try:
        await f.write(0, os.urandom(4 * MiB))
        await f.flush()
        before = os.stat(path).st_blocks
        await f.discard(MiB, 2 * MiB)
        after = os.stat(path).st_blocks
        assert after <= before - (2 * MiB) // 512, (before, after)
        assert os.path.getsize(path) == 4 * MiB  # KEEP_SIZE
        assert bytes(await f.read(MiB, 2 * MiB)) == bytes(2 * MiB)
        assert any(await f.read(0, MiB)) and any(await f.read(3 * MiB, MiB))
    finally:
        f.close()


async def test_file_write_zeroes_and_fallbacks(tmp_path, monkeypatch):
    path = tmp_path / "z.img"
    f = FileBackend(path, size=2 * MiB, create=True)
    try:
        await f.write(0, b"\x55" * (2 * MiB))
        await f.write_zeroes(4096, 8192)
        data = bytes(await f.read(0, 16384))
        assert data[:4096] == b"\x55" * 4096 and data[4096:12288] == bytes(8192) and data[12288:] == b"\x55" * 4096

        modes = []

        def unsupported(fd, mode, offset, length):
            modes.append(mode)
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")

        monkeypatch.setattr(filemod, "fallocate", unsupported)
        await f.write_zeroes(MiB, 100)
        await f.discard(MiB + 1000, MiB + 5000 - (MiB + 1000))
        assert modes == [
            filemod.FALLOC_FL_ZERO_RANGE | filemod.FALLOC_FL_KEEP_SIZE,
            filemod.FALLOC_FL_PUNCH_HOLE | filemod.FALLOC_FL_KEEP_SIZE,
            filemod.FALLOC_FL_PUNCH_HOLE | filemod.FALLOC_FL_KEEP_SIZE,
        ]
        data = bytes(await f.read(MiB - 1, 5002))
        assert data[0] == 0x55 and data[1:101] == bytes(100) and data[101:1001] == b"\x55" * 900
        assert data[1001:5001] == bytes(4000) and data[5001] == 0x55

        def failing(fd, mode, offset, length):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(filemod, "fallocate", failing)
        with pytest.raises(BackendError, match="deallocate failed: Input/output error"):
            await f.discard(0, 4096)
    finally:
        f.close()


async def test_file_resize_and_external_truncation(tmp_path):
    path = tmp_path / "r.img"
    f = FileBackend(path, size=MiB, create=True)
    try:
        await f.write(MiB - 3, b"end")
        await f.resize(2 * MiB)
        assert f.size == 2 * MiB and os.path.getsize(path) == 2 * MiB
        assert bytes(await f.read(MiB - 3, 6)) == b"end\x00\x00\x00"
        with pytest.raises(BackendError, match=r"shrinking from 2097152 to 4096 .*allow_shrink"):
            await f.resize(4096)
        assert f.size == 2 * MiB and os.path.getsize(path) == 2 * MiB
        await f.resize(4096, allow_shrink=True)  # the namespace covered the whole file: the file is cut
        assert os.path.getsize(path) == 4096
        with pytest.raises(BackendError, match="past the end"):
            await f.read(4096, 1)
        os.truncate(path, 1024)  # someone else shrinks the file underneath us
        with pytest.raises(BackendError, match="truncated by something else"):
            await f.read(0, 4096)
    finally:
        f.close()


async def test_file_close_waits_for_inflight_calls(tmp_path):
    f = FileBackend(tmp_path / "c.img", size=MiB, create=True)
    f._nowait_read = False  # a hole is "cached": without this the read completes inline
    fd = f._fd
    read = asyncio.ensure_future(f.read(0, MiB))
    await asyncio.sleep(0)  # the read is now in the thread pool; its completion needs the loop
    assert f._inflight == 1
    f.close()
    assert f._fd == fd  # closing is deferred: a thread still uses the descriptor
    with pytest.raises(BackendError, match="closed"):
        await f.write(0, b"x")
    assert bytes(await read) == bytes(MiB)
    assert f._fd == -1 and f._inflight == 0


async def test_file_block_device(tmp_path):
    if shutil.which("losetup") is None or os.geteuid() != 0:
        pytest.skip("needs root and losetup to attach a loop device")
    image = tmp_path / "loop.img"
    with open(image, "wb") as fh:
        fh.truncate(4 * MiB)
    proc = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot attach a loop device here: {proc.stderr.strip()}")
    dev = proc.stdout.strip()
    try:
        f = FileBackend(dev)
        try:
            assert f.block_device and f.size == 4 * MiB
            await f.write(4096, b"blockdata")
            await f.flush()
            assert bytes(await f.read(4096, 9)) == b"blockdata"
            await f.discard(0, MiB)
            assert bytes(await f.read(4096, 9)) == bytes(9)
            with pytest.raises(BackendError, match="allow_shrink"):
                await f.resize(2 * MiB)
            await f.resize(2 * MiB, allow_shrink=True)
            assert f.size == 2 * MiB
            with pytest.raises(BackendError, match="Grow the device first"):
                await f.resize(8 * MiB)
        finally:
            f.close()
        with pytest.raises(BackendError, match="holds 4194304 bytes"):
            FileBackend(dev, size=8 * MiB)
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


# --- factory ------------------------------------------------------------------------------------


async def test_open_backend_kinds_and_errors(tmp_path):
    ram = open_backend("ram", size=4096)
    null = open_backend("null", size=4096, read_only=True)
    f = open_backend("file", path=tmp_path / "f.img", size=4096, create=True)
    assert isinstance(ram, RamBackend) and isinstance(null, NullBackend) and null.read_only
    assert isinstance(f, FileBackend)
    f.close()
    for kwargs, message in (
        ({"kind": "disk", "size": 1}, "unknown backend kind 'disk'"),
        ({"kind": "file"}, "needs a path"),
        ({"kind": "ram"}, "needs a size"),
        ({"kind": "null", "path": "/tmp/x"}, "takes no path"),
        ({"kind": "ram", "size": 4096, "create": True}, "has no storage to create"),
    ):
        with pytest.raises(BackendError, match=message):
            open_backend(**kwargs)


async def test_file_resize_of_a_prefix_never_cuts_the_file(tmp_path):
    path = tmp_path / "p.img"
    path.write_bytes(b"\x01" * 16384)
    f = FileBackend(path, size=4096)
    try:
        assert await f.resize(8192) is None and f.size == 8192  # within the file: only what is presented
        assert await f.resize(4096, allow_shrink=True) is None  # the tail past 8192 was never the namespace's
        assert path.read_bytes() == b"\x01" * 16384
        old = await f.resize(32768)  # past the end: the resize is the explicit request to grow the file
        assert old == 16384 and os.path.getsize(path) == 32768
        await f.revert_resize(4096, old)
        assert f.size == 4096 and path.read_bytes() == b"\x01" * 16384
    finally:
        f.close()


async def test_file_size_the_file_system_refuses_is_a_clear_error(tmp_path):
    # issue 10 item 7: a 1 PiB create raised a bare OSError (EFBIG), a 500 at the API
    with pytest.raises(BackendError, match=r"cannot make .*big\.img 1125899906842624 bytes long: .*EFBIG"):
        _with_file_size_limit(lambda: FileBackend(tmp_path / "big.img", size=1 << 50, create=True))
    assert not (tmp_path / "big.img").exists()  # the file it created is removed again
    with pytest.raises(BackendError, match="beyond the largest file offset"):
        FileBackend(tmp_path / "huge.img", size=1 << 64, create=True)


def _with_file_size_limit(fn):
    """Run ``fn`` under RLIMIT_FSIZE 1 TiB, so any file system refuses 1 PiB (ext4 does anyway, tmpfs
    and XFS would not). Python ignores SIGXFSZ, so the call fails with EFBIG instead of a signal."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 40, hard))
    try:
        return fn()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# --- where files may live (issue 10 item 1) -----------------------------------------------------


@pytest.fixture
def disks(tmp_path):
    folder = tmp_path / "disks"
    folder.mkdir()
    (folder / "ok.img").write_bytes(bytes(4096))
    return folder


def test_policy_refuses_each_path_with_reason_and_option(disks, tmp_path):
    policy = BackingPolicy([disks])
    (disks / "shadow-link.img").symlink_to("/etc/passwd")
    (disks / "escape").symlink_to(tmp_path)
    os.mkfifo(disks / "fifo.img")
    cases = [
        ("/etc/shadow", rf"/etc/shadow is outside the backing directories \({disks}\); add --backing-dir DIR"),
        ("../../etc/passwd", r"'\.\./\.\./etc/passwd' is relative; give an absolute path"),
        ("/proc/self/mem", r"/proc/self/mem \(which resolves to /proc/\d+/mem\) is under /proc.*--allow-block-device"),
        (f"{disks}/shadow-link.img", r"resolves to /etc/passwd\) is outside the backing directories.*backing_dirs"),
        ("/dev/zero", r"/dev/zero is under /dev, a kernel interface.*--allow-block-device PATH"),
        (f"{disks}/a\0b.img", r"contains a NUL byte"),
        (f"{disks}/fifo.img", r"neither a regular file nor a block device"),
        (str(disks), r"is a directory"),
    ]
    for path, message in cases:
        with pytest.raises(BackendError, match=message):
            FileBackend(path, policy=policy).close()
    # a linked directory is followed: what counts is where the path really leads
    with pytest.raises(BackingError, match="outside the backing directories"):
        policy.check(f"{disks}/escape/other.img")
    assert policy.check(f"{disks}/escape/disks/ok.img") == f"{disks}/ok.img"
    with pytest.raises(BackingError, match="under /dev, where no namespace file may live"):
        BackingPolicy(["/dev/shm"])
    f = FileBackend(f"{disks}/./ok.img", policy=policy)
    assert f.path == f"{disks}/ok.img"  # stored resolved
    f.close()


def test_policy_refuses_device_nodes_inside_a_backing_dir(disks):
    if os.geteuid() != 0:
        pytest.skip("needs root to make device nodes")
    os.mknod(disks / "zero.img", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    os.mknod(disks / "loop.img", stat.S_IFBLK | 0o600, os.makedev(7, 0))
    policy = BackingPolicy([disks])
    with pytest.raises(BackendError, match="neither a regular file nor a block device"):
        FileBackend(disks / "zero.img", policy=policy)
    with pytest.raises(BackendError, match=r"is a block device, which is served only when named: .*--allow-block"):
        FileBackend(disks / "loop.img", policy=policy)


def test_policy_default_dir_is_in_the_state_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NVMEOF_STATE_DIR", str(tmp_path / "state"))
    policy = BackingPolicy()
    assert policy.backing_dirs == (str(tmp_path / "state" / "disks"),)
    wider = policy.widened(backing_dirs=[tmp_path / "more"], block_devices=["/dev/loop7"])
    assert wider.backing_dirs == (str(tmp_path / "state" / "disks"), str(tmp_path / "more"))
    assert wider.block_devices == ("/dev/loop7",) and wider.check("/dev/loop7") == "/dev/loop7"
    filemod.make_backing_dir(policy.backing_dirs[0])
    assert stat.S_IMODE(os.stat(policy.backing_dirs[0]).st_mode) == 0o700


def test_policy_catches_a_swap_between_check_and_open(disks, tmp_path, monkeypatch):
    """A file (or a folder on its path) replaced by a symbolic link after the check: the open does
    not follow a final link, and the opened descriptor is checked for where it really is."""
    policy = BackingPolicy([disks])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.img").write_bytes(b"s" * 4096)
    (disks / "sub").mkdir()
    (disks / "sub" / "secret.img").write_bytes(bytes(4096))
    (disks / "swapped.img").write_bytes(bytes(4096))
    checked = {p: policy.check(p) for p in (f"{disks}/sub/secret.img", f"{disks}/swapped.img")}
    # the attacker strikes after the check: the check saw the originals
    monkeypatch.setattr(BackingPolicy, "check", lambda self, path, what="path": checked[os.fspath(path)])
    (disks / "sub").rename(disks / "sub.old")
    (disks / "sub").symlink_to(outside)
    (disks / "swapped.img").unlink()
    (disks / "swapped.img").symlink_to(outside / "secret.img")
    with pytest.raises(BackingError, match=rf"turned out to be {outside}/secret\.img, outside"):
        FileBackend(f"{disks}/sub/secret.img", policy=policy)
    with pytest.raises(BackingError, match="became a symbolic link"):
        FileBackend(f"{disks}/swapped.img", policy=policy)
    # and an inode swapped between the lstat and the open
    fd = os.open(outside / "secret.img", os.O_RDONLY)
    try:
        with pytest.raises(BackingError, match="was replaced while it was being opened"):
            policy.check_opened(fd, f"{disks}/ok.img", os.stat(disks / "ok.img"))
    finally:
        os.close(fd)


# --- describing a backend to a worker process and attaching there (issue 11: the registry) -------------


def _worker_copy(backend):
    """What a worker receives: the description, and its own copies of the descriptors (SCM_RIGHTS dups them)."""
    from target.backends import attach_backend

    description, fds = backend.describe_for_worker()
    return attach_backend(description, [os.dup(fd) for fd in fds])


async def test_a_ram_disk_reaches_a_worker_through_its_memfd():
    ram = RamBackend(MiB)
    await ram.write(8192, b"shared!")
    shared = ram.for_workers()
    assert shared is not ram and shared.kind == "ram" and shared.for_workers() is shared
    ram.close()
    theirs = _worker_copy(shared)
    try:
        assert bytes(await theirs.read(8192, 7)) == b"shared!"
        await theirs.write(0, b"from the worker")
        assert bytes(await shared.read(0, 15)) == b"from the worker"
        await shared.resize(2 * MiB)
        theirs.follow_resize(2 * MiB)
        assert theirs.size == 2 * MiB and bytes(await theirs.read(2 * MiB - 4, 4)) == bytes(4)
        with pytest.raises(BackendError, match="only the main process resizes"):
            await theirs.resize(MiB)
    finally:
        theirs.close()
        shared.close()


async def test_null_and_file_backends_describe_themselves_to_a_worker(tmp_path):
    null = NullBackend(MiB, read_only=True)
    theirs = _worker_copy(null)
    assert isinstance(theirs, NullBackend) and theirs.size == MiB and theirs.read_only
    theirs.follow_resize(2 * MiB)
    assert theirs.size == 2 * MiB
    path = tmp_path / "w.img"
    path.write_bytes(b"F" * 8192)
    f = FileBackend(path, policy=BackingPolicy([tmp_path]))
    assert f.for_workers() is f
    theirs = _worker_copy(f)
    try:
        assert isinstance(theirs, FileBackend) and theirs.path == str(path) and theirs.size == 8192
        assert bytes(await theirs.read(0, 2)) == b"FF"
    finally:
        theirs.close()
        f.close()


def test_a_description_with_the_wrong_descriptors_is_refused_and_they_are_closed(tmp_path):
    from target.backends import attach_backend

    ram = RamBackend(MiB)
    with pytest.raises(BackendError, match="cannot be served by worker processes"):
        ram.describe_for_worker()   # a private mapping: for_workers() first
    ram.close()
    path = tmp_path / "x.img"
    path.write_bytes(bytes(4096))
    f = FileBackend(path)
    description, fds = f.describe_for_worker()
    a, b = os.dup(fds[0]), os.dup(fds[0])
    with pytest.raises(BackendError, match="arrived with 2 descriptors instead of one"):
        attach_backend(description, [a, b])
    for fd in (a, b):
        with pytest.raises(OSError):
            os.fstat(fd)
    with pytest.raises(BackendError, match="RAM namespace arrived with 0 descriptors"):
        attach_backend({"kind": "ram", "size": MiB, "read_only": False}, [])
    f.close()
