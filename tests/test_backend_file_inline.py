"""File backend data path (issue 12): page-cache hits served on the event loop, everything that may
wait on the thread pool, pooled read buffers that are never reused while referenced. Which path a
call took is counted (``io_counts``), never timed."""

from __future__ import annotations

import dataclasses
import errno
import os
import time

import pytest

from nvmeof import defaults
from target.backends import BackendError, FileBackend
from target.backends import file as filemod
from target.backends import inline as inlinemod
from target.backends.buffers import BufferPool
from target.backends.inline import InlinePolicy

MiB = 1 << 20
NOWAIT = getattr(os, "RWF_NOWAIT", None)
needs_nowait = pytest.mark.skipif(NOWAIT is None, reason="this Python has no os.RWF_NOWAIT")


@pytest.fixture(autouse=True)
def _never_slow(monkeypatch):
    """Backends made here keep writing inline however long a write takes on a loaded machine (which
    path a call takes must not depend on timing); the tests of InlinePolicy give it a fake clock."""
    monkeypatch.setattr(defaults, "FILE_INLINE_SLOW_US", 1 << 40)


@pytest.fixture
def disk(tmp_path):
    """A 4 MiB file with known contents, written through the page cache (so it is cached)."""
    path = tmp_path / "disk.img"
    data = os.urandom(4 * MiB)
    path.write_bytes(data)
    f = FileBackend(path)
    if not f._nowait_read:
        f.close()
        pytest.skip("this file system does not take RWF_NOWAIT reads (tmpfs)")
    yield f, data
    f.close()


def _nowait_spy(monkeypatch, *, read_errno=None, read_short=None, write_errno=None):
    """os.preadv/os.pwritev wrapped: every call is recorded; RWF_NOWAIT reads may be made to fail with
    ``read_errno`` or to return only ``read_short`` bytes, RWF_NOWAIT writes to fail with ``write_errno``."""
    calls: list[tuple[str, int]] = []
    real_preadv, real_pwritev = os.preadv, os.pwritev

    def preadv(fd, buffers, offset, flags=0):
        calls.append(("preadv", flags))
        if flags and read_short is not None:
            return real_preadv(fd, [memoryview(buffers[0])[:read_short]], offset)
        if flags and read_errno is not None:
            raise OSError(read_errno, os.strerror(read_errno))
        return real_preadv(fd, buffers, offset, flags)

    def pwritev(fd, buffers, offset, flags=0):
        calls.append(("pwritev", flags))
        if flags == NOWAIT and write_errno is not None:
            raise OSError(write_errno, os.strerror(write_errno))
        return real_pwritev(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pwritev", pwritev)
    return calls


# --- the buffer pool ---------------------------------------------------------------------------------


def test_pool_reuses_an_idle_buffer_and_never_one_still_referenced():
    pool = BufferPool(4096, 2)
    a = pool.take(100)
    b = pool.take(4096)
    assert len(a) == 100 and len(b) == 4096 and a.obj is not b.obj and len(pool) == 2
    held = a[10:20]            # a slice of a view keeps the buffer busy too
    del a
    c = pool.take(10)          # both pooled buffers are referenced: a one-off
    assert c.obj is not held.obj and c.obj is not b.obj and pool.misses == 1
    del b, c
    d = pool.take(50)
    assert d.obj is not held.obj and len(pool) == 2 and pool.misses == 1
    first = id(held.obj)
    del held
    e = pool.take(50)
    assert id(e.obj) == first  # back once the last view of it went
    big = pool.take(8192)      # longer than a pooled buffer: a one-off
    assert len(big) == 8192 and pool.misses == 2 and len(pool) == 2


async def test_a_read_result_is_not_overwritten_while_held(disk):
    f, data = disk
    first = await f.read(0, 4096)
    second = await f.read(8192, 4096)
    assert bytes(first) == data[:4096] and bytes(second) == data[8192:12288]
    assert first.obj is not second.obj
    del first, second
    for i in range(20):        # sequential reads that drop their result reuse the pool
        assert bytes(await f.read(i * 4096, 4096)) == data[i * 4096:(i + 1) * 4096]
    assert f.io_counts()["pool_buffers"] <= 3 and f.io_counts()["pool_misses"] == 0


# --- reads -------------------------------------------------------------------------------------------


@needs_nowait
async def test_a_page_cache_hit_is_served_inline(disk):
    f, data = disk
    assert bytes(await f.read(MiB, 4096)) == data[MiB:MiB + 4096]
    assert bytes(await f.read(2 * MiB, 128 * 1024)) == data[2 * MiB:2 * MiB + 128 * 1024]
    buf = memoryview(bytearray(4096))
    await f.read_into(3 * MiB, buf)
    assert bytes(buf) == data[3 * MiB:3 * MiB + 4096]
    got = f.read_nowait(512, 1024)
    assert got is not None and bytes(got) == data[512:1536]
    assert f.io_counts()["inline"] == 4 and f.io_counts()["thread"] == 0


@needs_nowait
async def test_eagain_goes_to_the_thread_pool(disk, monkeypatch):
    f, data = disk
    calls = _nowait_spy(monkeypatch, read_errno=errno.EAGAIN)
    assert bytes(await f.read(4096, 4096)) == data[4096:8192]
    assert calls == [("preadv", NOWAIT), ("preadv", 0)]
    assert f.io_counts()["inline"] == 0 and f.io_counts()["thread"] == 1
    assert f.read_nowait(4096, 4096) is None           # the engine then awaits read()
    assert f._nowait_read                              # EAGAIN is "not now", not "never"


@needs_nowait
async def test_a_short_nowait_read_finishes_on_the_thread_pool(disk, monkeypatch):
    f, data = disk
    calls = _nowait_spy(monkeypatch, read_short=1000)
    assert bytes(await f.read(10_000, 4096)) == data[10_000:14_096]
    assert calls == [("preadv", NOWAIT), ("preadv", 0)] and f.io_counts()["thread"] == 1


@needs_nowait
async def test_a_cold_read_takes_the_thread_path(tmp_path):
    path = tmp_path / "cold.img"
    data = os.urandom(8 * MiB)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # clean pages leave the page cache
        try:
            os.preadv(fd, [bytearray(4096)], 6 * MiB, NOWAIT)
            pytest.skip("the page cache kept the file after POSIX_FADV_DONTNEED")
        except BlockingIOError:
            pass
    finally:
        os.close(fd)
    f = FileBackend(path)
    try:
        assert bytes(await f.read(2 * MiB, 4096)) == data[2 * MiB:2 * MiB + 4096]
        assert f.io_counts()["thread"] == 1 and f.io_counts()["inline"] == 0
        assert bytes(await f.read(2 * MiB, 4096)) == data[2 * MiB:2 * MiB + 4096]   # cached now
        assert f.io_counts()["thread"] == 1 and f.io_counts()["inline"] == 1
    finally:
        f.close()


async def test_without_rwf_nowait_every_read_takes_the_thread_path(tmp_path, monkeypatch):
    monkeypatch.setattr(filemod, "_RWF_NOWAIT", None)
    monkeypatch.setattr(defaults, "FILE_INLINE_WRITE_MAX", 64 * 1024)   # the opt-in inline buffered writes
    path = tmp_path / "old.img"
    data = os.urandom(MiB)
    path.write_bytes(data)
    f = FileBackend(path)
    try:
        calls = _nowait_spy(monkeypatch)
        assert bytes(await f.read(4096, 8192)) == data[4096:12288]
        assert f.read_nowait(0, 4096) is None
        buf = memoryview(bytearray(100))
        await f.read_into(7, buf)
        assert bytes(buf) == data[7:107]
        assert all(flags == 0 for _, flags in calls)
        assert f.io_counts()["thread"] == 2 and f.io_counts()["inline"] == 0
        # writes: small page-aligned ones still inline (buffered copy), the rest on the thread pool
        await f.write(8192, b"\x11" * 4096)
        await f.write(100, b"\x22" * 512)
        await f.write(0, b"\x33" * (128 * 1024), fua=False)
        assert f.io_counts()["inline"] == 1 and f.io_counts()["thread"] == 4
        assert bytes(await f.read(0, 128 * 1024)) == b"\x33" * (128 * 1024)
    finally:
        f.close()


async def test_an_unsupported_nowait_read_is_remembered(disk, monkeypatch):
    f, data = disk
    calls = _nowait_spy(monkeypatch, read_errno=errno.EOPNOTSUPP)
    assert bytes(await f.read(0, 4096)) == data[:4096]
    assert bytes(await f.read(4096, 4096)) == data[4096:8192]
    assert [c for c in calls if c[1]] == [("preadv", NOWAIT)] and not f._nowait_read
    assert f.io_counts()["thread"] == 2


# --- writes ------------------------------------------------------------------------------------------


async def test_buffered_writes_run_inline_by_default_while_fast(tmp_path):
    """ext4/tmpfs refuse RWF_NOWAIT for buffered writes; a plain page-aligned pwrite then runs on the
    event loop while it stays fast (InlinePolicy), unaligned ones (a partial page may need a read
    first) on the thread pool."""
    path = tmp_path / "d.img"
    f = FileBackend(path, size=MiB, create=True)
    try:
        f._nowait_write = False   # as on ext4
        assert f.write_nowait(4096, b"\x44" * 4096)
        await f.write(8192, b"\x55" * 4096)
        await f.write(100, b"\x66" * 512)
        assert f.io_counts()["inline"] == 2 and f.io_counts()["thread"] == 1
        assert f.io_counts()["write_timed"] == 2 and f.io_counts()["write_nowait"] == 0   # which road: reported
        assert path.read_bytes()[:12288] == bytes(100) + b"\x66" * 512 + bytes(3484) + b"\x44" * 4096 + b"\x55" * 4096
    finally:
        f.close()


async def test_writes_inline_and_on_the_thread_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "FILE_INLINE_WRITE_MAX", 64 * 1024)   # the opt-in inline buffered writes
    path = tmp_path / "w.img"
    f = FileBackend(path, size=4 * MiB, create=True)
    try:
        calls = _nowait_spy(monkeypatch)
        assert f.write_nowait(4096, b"\x44" * 4096)
        await f.write(8192, b"\x55" * 4096)
        assert f.io_counts() == {**f.io_counts(), "inline": 2, "thread": 0}
        assert not f.write_nowait(0, b"x" * 4096, fua=True)      # FUA waits for the device: never inline
        await f.write(0, b"\x66" * 4096, fua=True)
        await f.flush()
        assert f.io_counts()["inline"] == 2 and f.io_counts()["thread"] >= 2
        assert path.read_bytes()[:12288] == b"\x66" * 4096 + b"\x44" * 4096 + b"\x55" * 4096
        assert ("preadv", 0) not in calls
    finally:
        f.close()


@needs_nowait
async def test_a_write_rwf_nowait_takes_runs_inline_untimed(tmp_path, monkeypatch):
    """Where the file system takes RWF_NOWAIT buffered writes (XFS, btrfs) the kernel bounds them: no
    timing, and io_counts says which road the writes took."""
    path = tmp_path / "xfs.img"
    f = FileBackend(path, size=MiB, create=True)
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, offset, flags=0: real(fd, bufs, offset))  # flag taken
    try:
        f._nowait_write = True
        assert f.write_nowait(0, b"\x79" * 4096)
        await f.write(4096, b"\x7a" * 4096)
        assert f.io_counts()["write_nowait"] == 2 and f.io_counts()["write_timed"] == 0
        assert f.io_counts()["inline"] == 2 and f._write_policy.worst_ns == 0
        assert path.read_bytes()[:8192] == b"\x79" * 4096 + b"\x7a" * 4096
    finally:
        f.close()


async def test_nowait_calls_check_ranges_read_only_and_closed(tmp_path):
    path = tmp_path / "ro.img"
    path.write_bytes(bytes(8192))
    f = FileBackend(path, read_only=True)
    with pytest.raises(BackendError, match="past the end"):
        f.read_nowait(8192, 1)
    with pytest.raises(BackendError, match="read-only"):
        f.write_nowait(0, b"x")
    f.close()
    with pytest.raises(BackendError, match="closed"):
        f.read_nowait(0, 1)


# --- the adaptive inline write policy ----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now


US, MS = 1000, 1_000_000


@dataclasses.dataclass(frozen=True)
class _Snap:
    ru_nvcsw: int
    ru_nivcsw: int


class Switches:
    """A thread's context switch counts, as getrusage(RUSAGE_THREAD) gives them."""

    def __init__(self) -> None:
        self.ru_nvcsw = self.ru_nivcsw = 0

    def __call__(self) -> _Snap:
        return _Snap(self.ru_nvcsw, self.ru_nivcsw)


def _policy(clock, pressure=None, switches=None):
    """A policy on fake clocks: ``clock`` for the calls' wall time, a FakeClock of its own (``p.cpu``) for the
    thread's CPU time."""
    return InlinePolicy(slow_ns=300 * US, backoff_ns=100 * MS, backoff_max_ns=400 * MS, clock=clock, pressure=pressure,
                        switches=switches or Switches(), cpu=FakeClock())


def _call(p: InlinePolicy, clock: FakeClock, took: int, *, voluntary: int = 0, involuntary: int = 0,
          ran: int = 0) -> None:
    """An inline call that took ``took`` ns (sleeping ``voluntary`` times, preempted ``involuntary``
    times, on the CPU for ``ran`` ns meanwhile), told to the policy as it ends."""
    before, cpu = p.switches(), p.cpu() if p.cpu_timed else -1
    clock.now += took
    p.cpu.now += ran
    p.switches.ru_nvcsw += voluntary
    p.switches.ru_nivcsw += involuntary
    p.record(clock.now - took, clock.now, before, cpu)


def test_a_slow_call_backs_off_and_a_slow_retry_doubles_the_back_off():
    clock = FakeClock()
    p = _policy(clock)
    assert p.inline_now()
    _call(p, clock, 20 * US)                            # fast: stays inline
    assert p.inline_now() and p.backoffs == 0
    _call(p, clock, 2 * MS, voluntary=1)                # 2 ms asleep: the file goes to the pool for 100 ms
    assert not p.inline_now() and p.slow == 1 and p.backoffs == 1
    clock.now += 100 * MS - 1
    assert not p.inline_now()
    clock.now += 1
    assert p.inline_now() and p.probes == 1             # back-off over: one call tried inline
    _call(p, clock, MS, voluntary=1)                    # slow again: twice as long
    clock.now += 200 * MS - 1
    assert not p.inline_now()
    clock.now += 1
    assert p.inline_now()
    _call(p, clock, MS, voluntary=1)                    # 400 ms (the cap) ...
    clock.now += 400 * MS - 1
    assert not p.inline_now()
    clock.now += 1
    assert p.inline_now()
    _call(p, clock, MS, voluntary=1)                    # ... and no longer
    clock.now += 400 * MS
    assert p.inline_now()
    _call(p, clock, 10 * US)                            # a fast retry: inline again, back-off reset
    assert p.inline_now() and p.counts()["on_pool"] == 0
    _call(p, clock, MS, voluntary=1)
    clock.now += 100 * MS
    assert p.inline_now() and p.probes == 5 and p.worst_ns == 2 * MS and p.slow == 5


def test_a_call_slow_only_because_the_thread_was_preempted_stays_inline():
    clock = FakeClock()
    p = _policy(clock)
    _call(p, clock, 5 * MS, involuntary=1)              # waited for a CPU: a pool thread would too
    assert p.inline_now() and p.slow == 1 and p.preempted == 1 and p.backoffs == 0
    _call(p, clock, 5 * MS, voluntary=1, involuntary=1)  # it slept in the kernel too: back off
    assert not p.inline_now() and p.backoffs == 1


def test_a_slow_call_without_any_context_switch_stays_inline():
    """No context switch at all: the time went to interrupts or to a hypervisor holding the vCPU (seen on
    the shared benchmark VM, where such calls sent the file to the pool, whose GIL hand-offs then stalled
    the loop far longer); a pool thread would lose that time too. Only a call that slept backs off."""
    clock = FakeClock()
    p = _policy(clock)
    _call(p, clock, 5 * MS)
    assert p.inline_now() and p.slow == 1 and p.unswitched == 1 and p.preempted == 0 and p.backoffs == 0
    _call(p, clock, 5 * MS, voluntary=1)
    assert not p.inline_now() and p.backoffs == 1
    assert p.counts()["unswitched"] == 1 and p.counts()["slow"] == 2


@pytest.mark.parametrize("involuntary", [0, 1])
def test_a_slow_call_that_ran_on_the_cpu_backs_off_without_sleeping(involuntary):
    """A call that never slept but ran on the CPU for longer than the bound (reclaim or compaction that does not
    sleep, a long copy), preempted or not at its end: the next one would stall the loop as long, so the file
    backs off (before, only a call that slept did). The thread's CPU time tells it from a call that waited
    for a CPU or for the hypervisor (CPU time under the bound: no back-off). That clock is read only for a
    for a number of calls after a slow one that did not sleep, so the first such call is not caught, the next
    one is."""
    clock = FakeClock()
    p = InlinePolicy(slow_ns=300 * US, backoff_ns=100 * MS, backoff_max_ns=400 * MS, cpu_timed_calls=4,
                     clock=clock, pressure=None, switches=Switches(), cpu=FakeClock())
    _call(p, clock, 10 * US, ran=10 * US)
    assert not p.cpu_timed                                           # fast calls: no CPU clock read
    _call(p, clock, 5 * MS, involuntary=involuntary, ran=5 * MS)     # not timed yet: taken as a wait ...
    assert p.inline_now() and p.backoffs == 0 and p.cpu_timed        # ... and the next calls are timed
    _call(p, clock, 5 * MS, involuntary=involuntary, ran=300 * US)   # the bound itself: not over it
    assert p.inline_now() and p.ran == 0 and p.backoffs == 0
    _call(p, clock, 5 * MS, involuntary=involuntary, ran=4 * MS)
    assert not p.inline_now() and p.ran == 1 and p.backoffs == 1 and p.preempted + p.unswitched == 2
    clock.now += 100 * MS
    assert p.inline_now() and p.cpu_timed                           # the probe is timed too ...
    _call(p, clock, 2 * MS, ran=2 * MS)                              # ... and ran long: twice as long
    clock.now += 200 * MS - 1
    assert not p.inline_now() and p.counts()["ran"] == 2
    clock.now += 1
    assert p.inline_now()
    for _ in range(3):
        _call(p, clock, 10 * US, ran=10 * US)                        # fast again: timed 4 calls from the probe ...
    assert p.cpu_timed
    _call(p, clock, 10 * US, ran=10 * US)
    assert p.inline_now() and not p.cpu_timed                        # ... then no more


def test_dirty_page_pressure_sends_writes_to_the_pool():
    clock = FakeClock()
    pressure = [False]
    p = _policy(clock, lambda now: pressure[0])
    clock.now += 200 * MS
    _call(p, clock, 10 * US)
    assert p.inline_now()
    pressure[0] = True
    _call(p, clock, 10 * US)                            # checked at most every 100 ms: not yet
    assert p.inline_now()
    clock.now += 100 * MS
    _call(p, clock, 10 * US)
    assert not p.inline_now() and p.backoffs == 1 and p.slow == 0
    clock.now += 100 * MS                                # still under pressure when the back-off ends:
    assert not p.inline_now() and p.backoffs == 2 and p.probes == 0   # another one, no write tried
    clock.now += 100 * MS
    pressure[0] = False
    assert p.inline_now() and p.probes == 1


def test_dirty_pressure_reads_the_kernel_thresholds(monkeypatch):
    files = {"/proc/meminfo": b"MemTotal: 2000000 kB\nMemFree: 900000 kB\nActive(file): 50000 kB\n"
                              b"Inactive(file): 50000 kB\nDirty: 99000 kB\nWriteback: 0 kB\n",
             "/proc/sys/vm/dirty_ratio": b"20\n", "/proc/sys/vm/dirty_background_ratio": b"10\n",
             "/proc/sys/vm/dirty_bytes": b"0\n", "/proc/sys/vm/dirty_background_bytes": b"0\n"}
    monkeypatch.setattr(inlinemod, "_read_file", lambda path: files[path])
    assert not inlinemod.dirty_pressure()               # 99 MB dirty, background threshold 100 MB
    files["/proc/meminfo"] = files["/proc/meminfo"].replace(b"Writeback: 0", b"Writeback: 1000")
    assert inlinemod.dirty_pressure()
    files["/proc/sys/vm/dirty_background_bytes"] = b"200000000\n"
    assert not inlinemod.dirty_pressure()
    files["/proc/sys/vm/dirty_bytes"] = b"150000000\n"  # background above the hard limit: half of it
    assert inlinemod.dirty_pressure()


def _slow_pwritev(monkeypatch, clock, *, slow_ns=0, errno_=None, switches=None):
    """os.pwritev that advances the fake clock by ``slow_ns`` (a write asleep in the kernel: one
    voluntary context switch on ``switches``) or fails with ``errno_``; both can be changed later
    through the returned dict."""
    real = os.pwritev
    state = {"slow_ns": slow_ns, "errno": errno_, "calls": []}

    def pwritev(fd, buffers, offset, flags=0):
        state["calls"].append(flags)
        clock.now += state["slow_ns"]
        if state["slow_ns"] and switches is not None:
            switches.ru_nvcsw += 1
        if state["errno"] is not None:
            raise OSError(state["errno"], os.strerror(state["errno"]))
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "pwritev", pwritev)
    return state


@pytest.fixture
def timed_file(tmp_path):
    """A 1 MiB file served as on ext4 (no RWF_NOWAIT writes), its write policy on a fake clock."""
    path = tmp_path / "t.img"
    f = FileBackend(path, size=MiB, create=True)
    f._nowait_write = False
    clock = FakeClock()
    f._write_policy = _policy(clock)
    yield f, path, clock
    f.close()


async def test_a_slow_inline_write_moves_the_file_to_the_pool_and_back(timed_file, monkeypatch):
    f, path, clock = timed_file
    stuck = _slow_pwritev(monkeypatch, clock, slow_ns=5 * MS, switches=f._write_policy.switches)
    assert f.write_nowait(0, b"\x01" * 4096)            # inline, but it took 5 ms
    assert not f.write_nowait(4096, b"\x02" * 4096)     # the batch engine's call says "not now" ...
    await f.write(4096, b"\x02" * 4096)                 # ... and write() runs it on the pool
    await f.write(8192, b"\x03" * 8192)
    assert f.io_counts()["inline"] == 1 and f.io_counts()["thread"] == 2
    assert f.io_counts()["write_backoffs"] == 1 and f.io_counts()["write_on_pool"] == 1
    stuck["slow_ns"] = 0                                 # writes are fast again
    clock.now += 100 * MS                                # the back-off is over
    assert f.write_nowait(16384, b"\x04" * 4096)
    await f.write(20480, b"\x05" * 4096)
    assert f.io_counts()["inline"] == 3 and f.io_counts()["thread"] == 2
    want = b"\x01" * 4096 + b"\x02" * 4096 + b"\x03" * 8192 + b"\x04" * 4096 + b"\x05" * 4096
    assert bytes(await f.read(0, len(want))) == want
    assert path.read_bytes()[:len(want)] == want


async def test_a_write_that_computes_for_long_without_sleeping_moves_the_file_to_the_pool(tmp_path, monkeypatch):
    """The real clocks and getrusage: writes that spin on the CPU for 3 ms in the kernel's stead (no sleep, no
    voluntary context switch; a stub of pwritev, then the real one) stall the loop for 3 ms each; the second
    one, timed on the CPU clock since the first, sends the file to the pool (before, such writes never backed
    off: only one that slept did)."""
    f = FileBackend(tmp_path / "c.img", size=MiB, create=True)
    try:
        f._nowait_write = False   # as on ext4: every write under the write policy
        f._write_policy = InlinePolicy(slow_ns=MS, pressure=None)
        real = os.pwritev

        def pwritev(fd, buffers, offset, flags=0):
            start = time.thread_time_ns()
            while time.thread_time_ns() - start < 3 * MS:
                pass
            return real(fd, buffers, offset, flags)

        monkeypatch.setattr(os, "pwritev", pwritev)
        assert f.write_nowait(0, b"\x01" * 4096)           # inline, and it ran for 3 ms: the next ones are timed
        assert f.write_nowait(0, b"\x01" * 4096)           # inline, and it ran for 3 ms again
        assert not f.write_nowait(4096, b"\x02" * 4096), f.io_counts()   # the next one: not on the loop
        counts = f.io_counts()
        assert counts["write_ran"] == 1 and counts["write_backoffs"] == 1, counts
        monkeypatch.setattr(os, "pwritev", real)
        await f.write(4096, b"\x02" * 4096)
        assert f.io_counts()["thread"] == 1
        assert bytes(await f.read(0, 8192)) == b"\x01" * 4096 + b"\x02" * 4096
    finally:
        f.close()


@needs_nowait
async def test_a_nowait_write_that_would_block_runs_under_the_write_policy(timed_file, monkeypatch):
    """EAGAIN from an RWF_NOWAIT write (on XFS nearly always the timestamp update, once per clock tick):
    the write is done without the flag, inline and timed while the write policy says inline, and on the
    thread pool while the file is backed off; RWF_NOWAIT is still tried first (it never waits)."""
    f, path, clock = timed_file
    f._nowait_write = True   # as on XFS/btrfs, which take RWF_NOWAIT buffered writes
    calls = _nowait_spy(monkeypatch, write_errno=errno.EAGAIN)
    await f.write(0, b"\x77" * 4096)
    assert calls == [("pwritev", NOWAIT), ("pwritev", 0)] and f._nowait_write
    counts = f.io_counts()
    assert (counts["inline"], counts["thread"], counts["write_eagain"], counts["write_timed"]) == (1, 0, 1, 1)
    _call(f._write_policy, clock, 10 * MS, voluntary=1)   # a write that slept: the file backs off
    calls.clear()
    assert not f.write_nowait(4096, b"\x78" * 4096)       # EAGAIN, and not inline now: the caller ...
    await f.write(4096, b"\x78" * 4096)                   # ... goes through write(), to the pool
    assert calls == [("pwritev", NOWAIT), ("pwritev", NOWAIT), ("pwritev", 0)]
    counts = f.io_counts()
    assert (counts["inline"], counts["thread"], counts["write_eagain"], counts["write_timed"]) == (1, 1, 3, 1)
    assert path.read_bytes()[:8192] == b"\x77" * 4096 + b"\x78" * 4096


async def test_fua_and_flush_never_run_inline(timed_file, monkeypatch):
    f, _, clock = timed_file
    calls = _slow_pwritev(monkeypatch, clock)["calls"]
    assert not f.write_nowait(0, b"x" * 4096, fua=True)
    await f.write(0, b"y" * 4096, fua=True)
    await f.flush()
    assert f.io_counts()["inline"] == 0 and f.io_counts()["thread"] >= 2
    assert all(flags != 0 for flags in calls) or not hasattr(os, "RWF_DSYNC")


async def test_a_sync_descriptor_never_writes_inline(tmp_path):
    path = tmp_path / "s.img"
    path.write_bytes(bytes(MiB))
    fd = os.open(path, os.O_RDWR | os.O_DSYNC)
    f = FileBackend.from_fd(fd, str(path), MiB)
    try:
        f._nowait_write = False
        assert not f.write_nowait(0, b"\x09" * 4096)
        await f.write(0, b"\x09" * 4096)
        assert f.io_counts()["inline"] == 0 and f.io_counts()["thread"] == 1
        assert path.read_bytes()[:4096] == b"\x09" * 4096
    finally:
        f.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("inline", [True, False])
async def test_write_errors_carry_their_errno_inline_and_on_the_pool(timed_file, monkeypatch, code, inline):
    f, _, clock = timed_file
    if not inline:
        _call(f._write_policy, clock, 10 * MS, voluntary=1)  # as after a write that slept: on the pool
    _slow_pwritev(monkeypatch, clock, errno_=code)
    with pytest.raises(BackendError) as caught:
        await f.write(0, b"z" * 4096)
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == code
    assert f.io_counts()["thread"] == (0 if inline else 1)
