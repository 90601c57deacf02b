"""fio-style benchmark engine over the Python initiator (`nvmeof bench`).

One job keeps ``iodepth`` commands in flight on its own controller connection: ``iodepth``
coroutines, each owning one preallocated buffer, loop issue -> await -> record. Latencies are
``time.perf_counter_ns`` deltas recorded into a log-linear histogram with fio's bucket layout
(``stat.h``: FIO_IO_U_PLAT_BITS = 6, 29 groups), so memory stays constant however long the run and
percentiles carry at most 1/64 relative error. ``numjobs > 1`` spawns worker processes ('spawn'
start method), each with its own connection; the parent merges their results.

Stop rules follow fio: ``size`` bytes (one pass over the region) or ``runtime`` seconds, whichever
comes first; with ``time_based`` the job loops over the region until ``runtime``. I/O issued during
``ramp_time`` is not counted, and the size limit counts only I/O after the ramp (fio resets its
counters when the ramp ends). Random offsets are uniform with replacement (fio's norandommap),
except the write phase of ``verify``, which writes every block of the region once in random order.

Verify (``--verify crc32c``): every ``bs`` block written carries a 32-byte header (magic, crc32c,
its LBA, the verify seed, the block length) followed by a payload derived from the seed and the
LBA; the crc32c covers everything after the crc field. The read phase checks all of it and
reports the lowest-offset bad block with what was expected and what was found.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import random
import resource
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nvmeof import defaults
from nvmeof.crc32c import crc32c

RW_MODES = ("read", "write", "randread", "randwrite", "randrw", "readwrite", "rw")
VERIFY_MODES = ("crc32c",)

# fio's latency histogram layout (stat.h)
PLAT_BITS = 6
PLAT_VAL = 1 << PLAT_BITS
PLAT_GROUP_NR = 29
PLAT_NR = PLAT_GROUP_NR * PLAT_VAL

# fio's default clat percentile list (options.c: def_percentile_list)
FIO_PERCENTILES = (1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5,
                   99.9, 99.95, 99.99)

VERIFY_MAGIC = 0x5642564E  # "NVBV" little-endian
VERIFY_HEADER = struct.Struct("<IIQQII")  # magic, crc32c, slba, seed, length, reserved
VERIFY_HEADER_SIZE = VERIFY_HEADER.size   # 32
DEFAULT_VERIFY_SEED = 0x6E766D656F66       # "nvmeof"
DEFAULT_RANDSEED = 0x3C5A7E19
EILSEQ = 84  # fio reports verify failures with this errno

_PROGRESS_INTERVAL = 0.25   # seconds between progress counter publications


class BenchError(Exception):
    """The job cannot run as specified; the message names the option and the problem."""


# --- latency histogram -----------------------------------------------------------------------------

def bucket_index(ns: int) -> int:
    """fio's plat_val_to_idx: values below 128 ns get their own bucket, then 64 buckets per power of 2."""
    msb = ns.bit_length() - 1
    if msb <= PLAT_BITS:
        return ns if ns > 0 else 0
    error_bits = msb - PLAT_BITS
    idx = ((error_bits + 1) << PLAT_BITS) + ((ns >> error_bits) & (PLAT_VAL - 1))
    return idx if idx < PLAT_NR - 1 else PLAT_NR - 1


def bucket_value(idx: int) -> float:
    """fio's plat_idx_to_val: the middle of the bucket's range."""
    if idx < (PLAT_VAL << 1):
        return float(idx)
    error_bits = (idx >> PLAT_BITS) - 1
    base = 1 << (error_bits + PLAT_BITS)
    return base + (idx % PLAT_VAL + 0.5) * (1 << error_bits)


class LatencyHistogram:
    """Latency samples in nanoseconds: fio's buckets plus exact count, sum, sum of squares, min, max."""

    __slots__ = ("buckets", "count", "max", "min", "total", "total_sq")

    def __init__(self) -> None:
        self.buckets = [0] * PLAT_NR
        self.count = 0
        self.total = 0
        self.total_sq = 0
        self.min = 0
        self.max = 0

    def record(self, ns: int) -> None:
        self.buckets[bucket_index(ns)] += 1
        if self.count == 0 or ns < self.min:
            self.min = ns
        if ns > self.max:
            self.max = ns
        self.count += 1
        self.total += ns
        self.total_sq += ns * ns

    def merge(self, other: LatencyHistogram) -> None:
        if other.count == 0:
            return
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]
        self.min = other.min if self.count == 0 else min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.count += other.count
        self.total += other.total
        self.total_sq += other.total_sq

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    @property
    def stdev(self) -> float:
        """Sample standard deviation (n - 1), as fio reports it."""
        if self.count < 2:
            return 0.0
        var = (self.total_sq - self.total * self.total / self.count) / (self.count - 1)
        return math.sqrt(var) if var > 0 else 0.0

    def percentiles(self, points: tuple[float, ...] | list[float] = FIO_PERCENTILES) -> dict[float, int]:
        """fio's calc_clat_percentiles: the first bucket where the running count reaches p% of all
        samples gives the bucket's middle value, kept within the observed min and max."""
        out: dict[float, int] = {}
        if self.count == 0:
            return {p: 0 for p in points}
        order = sorted(points)
        j = 0
        running = 0
        for idx, n in enumerate(self.buckets):
            if not n:
                continue
            running += n
            while j < len(order) and running >= order[j] / 100.0 * self.count:
                value = round(bucket_value(idx))
                out[order[j]] = min(max(value, self.min), self.max)
                j += 1
            if j == len(order):
                break
        for p in order[j:]:  # only reachable through float rounding at 100%
            out[p] = self.max
        return {p: out[p] for p in points}

    def percentile(self, p: float) -> int:
        return self.percentiles((p,))[p]

    def __getstate__(self) -> dict[str, Any]:
        # Sparse: a worker result crosses a pipe; most of the 1856 buckets are empty.
        return {"buckets": {i: n for i, n in enumerate(self.buckets) if n}, "count": self.count,
                "total": self.total, "total_sq": self.total_sq, "min": self.min, "max": self.max}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.buckets = [0] * PLAT_NR
        for i, n in state["buckets"].items():
            self.buckets[i] = n
        self.count, self.total, self.total_sq = state["count"], state["total"], state["total_sq"]
        self.min, self.max = state["min"], state["max"]


# --- job description -------------------------------------------------------------------------------

@dataclass
class ConnectSpec:
    """Where the jobs connect (the nvme-cli connect options)."""

    transport: str = "tcp"
    traddr: str = defaults.LISTEN_ADDRESS
    trsvcid: int = defaults.TCP_IO_PORT
    subnqn: str = defaults.DEFAULT_SUBSYSTEM_NQN
    hostnqn: str | None = None
    hdr_digest: bool = False
    data_digest: bool = False
    nr_io_queues: int = 1
    queue_size: int = defaults.MAX_QUEUE_SIZE
    target: Any = None  # an in-process target.core.Target for transport="loop" (tests)

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "trsvcid": self.trsvcid, "subnqn": self.subnqn, "hostnqn": self.hostnqn,
            "transport": self.transport, "nr_io_queues": self.nr_io_queues, "queue_size": self.queue_size,
            "hdr_digest": self.hdr_digest, "data_digest": self.data_digest,
        }
        if self.target is not None:
            kw["target"] = self.target
        return kw


@dataclass
class JobSpec:
    """One fio job, in fio's option names and units (bytes, seconds)."""

    name: str = "nvmeof"
    rw: str = "read"
    bs: int = 4096
    iodepth: int = 1
    numjobs: int = 1
    rwmixread: int = 50
    runtime: float | None = None
    time_based: bool = False
    ramp_time: float = 0.0
    size: int | None = None       # region length; None: from offset to the end of the namespace
    offset: int = 0
    nsid: int = 1
    verify: str | None = None
    verify_seed: int = DEFAULT_VERIFY_SEED
    randseed: int = DEFAULT_RANDSEED
    group_reporting: bool = False

    def __post_init__(self) -> None:
        if self.rw == "readwrite" or self.rw == "rw":
            self.rw = "readwrite"

    def validate(self) -> None:
        if self.rw not in RW_MODES:
            raise BenchError(f"--rw {self.rw!r} is not supported: use one of {', '.join(RW_MODES)}")
        if not 0 <= self.rwmixread <= 100:
            raise BenchError(f"--rwmixread {self.rwmixread} is out of range: give a percentage 0-100")
        if self.bs <= 0 or self.bs % 512:
            raise BenchError(f"--bs {self.bs} must be a positive multiple of 512 bytes")
        if self.iodepth < 1:
            raise BenchError(f"--iodepth {self.iodepth} must be at least 1")
        if self.numjobs < 1:
            raise BenchError(f"--numjobs {self.numjobs} must be at least 1")
        if self.runtime is not None and self.runtime <= 0:
            raise BenchError(f"--runtime {self.runtime} must be positive")
        if self.time_based and self.runtime is None:
            raise BenchError("--time_based needs --runtime (how long to keep looping over the region)")
        if self.ramp_time < 0:
            raise BenchError(f"--ramp_time {self.ramp_time} must not be negative")
        if self.size is not None and self.size <= 0:
            raise BenchError(f"--size {self.size} must be positive")
        if self.offset < 0:
            raise BenchError(f"--offset {self.offset} must not be negative")
        if not 1 <= self.nsid <= 0xFFFFFFFE:
            raise BenchError(f"--nsid {self.nsid} is not a valid namespace ID (1 to 0xFFFFFFFE)")
        if self.verify is not None:
            if self.verify not in VERIFY_MODES:
                raise BenchError(f"--verify {self.verify!r} is not supported: use {', '.join(VERIFY_MODES)}")
            if self.rw in ("randrw", "readwrite"):
                raise BenchError(f"--verify works with read, write, randread or randwrite, not {self.rw}")
            if self.ramp_time:
                raise BenchError("--ramp_time cannot be combined with --verify (every block is checked)")
            if self.bs <= VERIFY_HEADER_SIZE:
                raise BenchError(f"--bs {self.bs} is too small for --verify (header is {VERIFY_HEADER_SIZE} B)")

    @property
    def random(self) -> bool:
        return self.rw.startswith("rand")

    @property
    def read_fraction(self) -> float:
        if self.rw in ("read", "randread"):
            return 1.0
        if self.rw in ("write", "randwrite"):
            return 0.0
        return self.rwmixread / 100.0


# --- results ---------------------------------------------------------------------------------------

@dataclass
class DirStats:
    """One data direction of one job (or of a group of jobs)."""

    ios: int = 0
    bytes: int = 0
    runtime_ns: int = 0
    clat: LatencyHistogram = field(default_factory=LatencyHistogram)

    @property
    def runtime_ms(self) -> int:
        # fio keeps runtimes in whole milliseconds and derives IOPS and bandwidth from them
        return max(1, round(self.runtime_ns / 1e6)) if self.ios else 0

    @property
    def iops(self) -> float:
        return self.ios * 1000.0 / self.runtime_ms if self.ios else 0.0

    @property
    def bw_bytes(self) -> float:
        return self.bytes * 1000.0 / self.runtime_ms if self.ios else 0.0

    def merge(self, other: DirStats) -> None:
        self.ios += other.ios
        self.bytes += other.bytes
        self.runtime_ns = max(self.runtime_ns, other.runtime_ns)
        self.clat.merge(other.clat)


@dataclass
class VerifyError:
    block: int           # index of the bs-sized block within the region
    offset: int          # byte offset on the namespace
    slba: int
    field: str           # magic, slba, seed, length, crc32c, payload, or io
    expected: str
    actual: str

    def describe(self) -> str:
        return (f"verify: bad block {self.block} (offset {self.offset:#x}, LBA {self.slba}): "
                f"{self.field} expected {self.expected}, got {self.actual}")


@dataclass
class VerifyResult:
    blocks: int = 0
    errors: int = 0
    first: VerifyError | None = None

    def add(self, err: VerifyError) -> None:
        self.errors += 1
        if self.first is None or err.offset < self.first.offset:
            self.first = err

    def merge(self, other: VerifyResult) -> None:
        self.blocks += other.blocks
        self.errors += other.errors
        if other.first is not None and (self.first is None or other.first.offset < self.first.offset):
            self.first = other.first


@dataclass
class JobResult:
    name: str
    jobs: int = 1                   # how many jobs this result covers (group_reporting merges)
    pid: int = 0
    read: DirStats = field(default_factory=DirStats)
    write: DirStats = field(default_factory=DirStats)
    runtime_ns: int = 0             # measured window (after the ramp), all phases
    usr_s: float = 0.0              # initiator CPU in the measured window
    sys_s: float = 0.0
    verify: VerifyResult | None = None
    error: str | None = None

    @property
    def total_ios(self) -> int:
        return self.read.ios + self.write.ios

    def merge(self, other: JobResult) -> None:
        self.jobs += other.jobs
        self.read.merge(other.read)
        self.write.merge(other.write)
        self.runtime_ns = max(self.runtime_ns, other.runtime_ns)
        self.usr_s += other.usr_s
        self.sys_s += other.sys_s
        if other.verify is not None:
            if self.verify is None:
                self.verify = VerifyResult()
            self.verify.merge(other.verify)
        if other.error and not self.error:
            self.error = other.error


@dataclass
class BenchReport:
    job: JobSpec
    connect: ConnectSpec
    results: list[JobResult]
    started: float                      # wall clock (time.time) at the start
    target_cpu_s: float | None = None   # target processes' CPU in the measured window
    target_pids: tuple[int, ...] = ()

    def group(self) -> JobResult:
        total = JobResult(name=self.job.name, jobs=0, pid=os.getpid())
        for r in self.results:
            total.merge(r)
        return total

    @property
    def total_ios(self) -> int:
        return sum(r.total_ios for r in self.results)

    def cpu_us_per_io(self) -> dict[str, float | None]:
        ios = self.total_ios
        ini = sum(r.usr_s + r.sys_s for r in self.results)
        return {
            "initiator": ini * 1e6 / ios if ios else None,
            "target": self.target_cpu_s * 1e6 / ios if ios and self.target_cpu_s is not None else None,
        }

    @property
    def failed(self) -> bool:
        return any(r.error for r in self.results) or any(
            r.verify is not None and r.verify.errors for r in self.results)


# --- CPU accounting --------------------------------------------------------------------------------

def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return 100


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads) from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError as e:
        raise BenchError(f"--target-pid {pid}: cannot read /proc/{pid}/stat ({e.strerror})") from None
    # the command name may contain spaces and parentheses: fields start after the last ')'
    fields = raw[raw.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _clock_ticks()


def target_cpu_seconds(pids: tuple[int, ...]) -> float:
    """CPU time of the target processes and their live descendants (worker processes)."""
    seen: set[int] = set()
    todo = list(pids)
    total = 0.0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            total += process_cpu_seconds(pid)
        except BenchError:
            if pid in pids:
                raise
            continue  # a descendant that exited meanwhile
        todo += _children(pid)
    return total


def _rusage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


# --- verify pattern --------------------------------------------------------------------------------

def verify_payload(seed: int, slba: int, length: int) -> bytes:
    """The bytes after the header of the block at ``slba``: a function of the seed and the LBA only,
    so a later read-only verify run with the same seed can check it."""
    return random.Random((seed << 64) | slba).randbytes(length)


def fill_verify_block(buf: memoryview, seed: int, slba: int) -> None:
    length = len(buf)
    buf[VERIFY_HEADER_SIZE:] = verify_payload(seed, slba, length - VERIFY_HEADER_SIZE)
    VERIFY_HEADER.pack_into(buf, 0, VERIFY_MAGIC, 0, slba, seed, length, 0)
    crc = crc32c(buf[8:])
    struct.pack_into("<I", buf, 4, crc)


def check_verify_block(buf: memoryview, seed: int, slba: int) -> tuple[str, str, str] | None:
    """None when the block is what fill_verify_block wrote for ``slba``, else (field, expected, actual)."""
    length = len(buf)
    magic, crc, h_slba, h_seed, h_len, _ = VERIFY_HEADER.unpack_from(buf, 0)
    if magic != VERIFY_MAGIC:
        return "magic", f"{VERIFY_MAGIC:#010x}", f"{magic:#010x}"
    if h_slba != slba:
        return "slba", str(slba), str(h_slba)
    if h_seed != seed:
        return "seed", f"{seed:#x}", f"{h_seed:#x}"
    if h_len != length:
        return "length", str(length), str(h_len)
    actual_crc = crc32c(buf[8:])
    if actual_crc != crc:
        return "crc32c", f"{crc:#010x}", f"{actual_crc:#010x}"
    expected = verify_payload(seed, slba, length - VERIFY_HEADER_SIZE)
    got = bytes(buf[VERIFY_HEADER_SIZE:])
    if got != expected:  # right crc but wrong payload: data written with another pattern
        at = next(i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b)
        return (f"payload byte {VERIFY_HEADER_SIZE + at}", expected[at:at + 8].hex(), got[at:at + 8].hex())
    return None


# --- geometry --------------------------------------------------------------------------------------

def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj[name]
    return getattr(obj, name)


def namespace_geometry(idns: Any) -> tuple[int, int]:
    """(LBA size in bytes, NSZE in LBAs) from an Identify Namespace result."""
    nsze = int(_field(idns, "nsze"))
    for attr in ("block_size", "lba_size"):
        value = idns.get(attr) if isinstance(idns, Mapping) else getattr(idns, attr, None)
        if value:
            return int(value), nsze
    flbas = int(_field(idns, "flbas"))
    index = (flbas & 0x0F) | ((flbas & 0x60) >> 1)
    lbads = int(_field(_field(idns, "lbaf")[index], "lbads"))
    if nsze == 0 or lbads < 9:
        raise BenchError(f"namespace is not usable: NSZE {nsze}, LBA data size 2^{lbads}")
    return 1 << lbads, nsze


# --- one job ---------------------------------------------------------------------------------------

class Progress:
    """Counters a progress display reads while the job runs (post-ramp I/O only)."""

    __slots__ = ("measuring", "phase", "read_bytes", "read_ios", "write_bytes", "write_ios")

    def __init__(self) -> None:
        self.read_ios = self.read_bytes = self.write_ios = self.write_bytes = 0
        self.phase = "setup"
        self.measuring = False


class JobRunner:
    """Runs one job on one connected controller."""

    def __init__(self, ctrl: Any, spec: JobSpec, index: int = 0, *,
                 on_measure_start: Callable[[], None] | None = None) -> None:
        self.ctrl = ctrl
        self.spec = spec
        self.index = index
        self.progress = Progress()
        self._on_measure_start = on_measure_start
        self.result = JobResult(name=spec.name, pid=os.getpid())

    async def setup(self) -> None:
        spec = self.spec
        geometry = getattr(self.ctrl, "namespace_geometry", None)
        if geometry is not None:
            geo = await geometry(spec.nsid)
            self.lba_size, nsze = geo.block_size, geo.nsze
        else:
            self.lba_size, nsze = namespace_geometry(await self.ctrl.identify_namespace(spec.nsid))
        ns_bytes = self.lba_size * nsze
        if spec.bs % self.lba_size:
            raise BenchError(f"--bs {spec.bs} is not a multiple of namespace {spec.nsid}'s "
                             f"{self.lba_size}-byte LBA size")
        if spec.offset % self.lba_size:
            raise BenchError(f"--offset {spec.offset} is not a multiple of the {self.lba_size}-byte LBA size")
        if spec.offset >= ns_bytes:
            raise BenchError(f"--offset {spec.offset} is past the end of namespace {spec.nsid} "
                             f"({ns_bytes} bytes)")
        region = spec.size if spec.size is not None else ns_bytes - spec.offset
        if spec.offset + region > ns_bytes:
            raise BenchError(f"--offset {spec.offset} + --size {region} ends past the end of namespace "
                             f"{spec.nsid} ({ns_bytes} bytes)")
        self.units = region // spec.bs
        if self.units == 0:
            raise BenchError(f"--size {region}: the region is smaller than one --bs {spec.bs} block")
        self.nlb = spec.bs // self.lba_size
        self.base_lba = spec.offset // self.lba_size
        # One buffer per slot, allocated once: the hot loop allocates nothing.
        self.buffers = [memoryview(bytearray(spec.bs)) for _ in range(spec.iodepth)]
        if spec.read_fraction < 1.0 and spec.verify is None:
            noise = random.Random(spec.randseed).randbytes(spec.bs)
            for buf in self.buffers:
                buf[:] = noise

    async def run(self) -> JobResult:
        spec = self.spec
        res = self.result
        if spec.verify is not None:
            await self._verify_job()
        else:
            await self._main_phase()
        res.read.runtime_ns = res.runtime_ns if res.read.ios else 0
        res.write.runtime_ns = res.runtime_ns if res.write.ios else 0
        return res

    # -- plain job ------------------------------------------------------------------------------

    async def _main_phase(self) -> None:
        spec = self.spec
        self.progress.phase = "ramp" if spec.ramp_time else "run"
        start = time.perf_counter_ns()
        self._mstart = start + int(spec.ramp_time * 1e9)
        self._deadline = (self._mstart + int(spec.runtime * 1e9)) if spec.runtime is not None else None
        self._limit = None if spec.time_based else self.units
        self._issued = 0
        self._cursor = 0
        self._last_done = self._mstart
        self._rng = random.Random(spec.randseed + self.index)
        self._cpu0 = _rusage()
        loop = asyncio.get_running_loop()
        timer = loop.call_later(spec.ramp_time, self._measure_start) if spec.ramp_time else None
        if timer is None:
            self._measure_start()
        try:
            await self._gather(self._slot)
        finally:
            if timer is not None:
                timer.cancel()
        self._finish_window(self._last_done)

    def _measure_start(self) -> None:
        self._cpu0 = _rusage()
        self.progress.measuring = True
        self.progress.phase = "run"
        if self._on_measure_start is not None:
            self._on_measure_start()

    def _finish_window(self, end_ns: int) -> None:
        usr, sys_ = _rusage()
        self.result.usr_s += usr - self._cpu0[0]
        self.result.sys_s += sys_ - self._cpu0[1]
        self.result.runtime_ns += max(0, end_ns - self._mstart)

    async def _gather(self, slot_fn: Callable[[int], Any]) -> None:
        tasks = [asyncio.ensure_future(slot_fn(i)) for i in range(self.spec.iodepth)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _slot(self, slot: int) -> None:
        spec = self.spec
        ctrl, nsid, nlb, base, bs = self.ctrl, spec.nsid, self.nlb, self.base_lba, spec.bs
        buf = self.buffers[slot]
        units = self.units
        rand = self._rng.random
        is_random = spec.random
        read_fraction = spec.read_fraction
        mixed = 0.0 < read_fraction < 1.0
        always_read = read_fraction == 1.0
        rd, wr, prog = self.result.read, self.result.write, self.progress
        rd_hist, wr_hist = rd.clat, wr.clat
        clock = time.perf_counter_ns
        mstart, deadline, limit = self._mstart, self._deadline, self._limit
        while True:
            t0 = clock()
            if deadline is not None and t0 >= deadline:
                return
            counted = t0 >= mstart
            if counted and limit is not None:
                if self._issued >= limit:
                    return
                self._issued += 1
            if is_random:
                unit = int(rand() * units)
            else:
                unit = self._cursor
                self._cursor = unit + 1 if unit + 1 < units else 0
            is_read = (rand() < read_fraction) if mixed else always_read
            slba = base + unit * nlb
            t0 = clock()
            if is_read:
                await ctrl.read(nsid, slba, nlb, buf=buf)
            else:
                await ctrl.write(nsid, slba, buf)
            t1 = clock()
            if counted:
                if is_read:
                    rd.ios += 1
                    rd.bytes += bs
                    rd_hist.record(t1 - t0)
                    prog.read_ios += 1
                    prog.read_bytes += bs
                else:
                    wr.ios += 1
                    wr.bytes += bs
                    wr_hist.record(t1 - t0)
                    prog.write_ios += 1
                    prog.write_bytes += bs
                if t1 > self._last_done:
                    self._last_done = t1

    # -- verify job -----------------------------------------------------------------------------

    async def _verify_job(self) -> None:
        spec = self.spec
        self.result.verify = VerifyResult()
        self._mstart = time.perf_counter_ns()
        self._cpu0 = _rusage()
        self._measure_start()
        order = list(range(self.units))
        if spec.random:
            random.Random(spec.randseed + self.index).shuffle(order)
        deadline = (self._mstart + int(spec.runtime * 1e9)) if spec.runtime is not None else None
        if spec.read_fraction == 0.0:
            self.progress.phase = "write"
            written: list[int] = []
            it = iter(order)

            async def writer(slot: int) -> None:
                await self._verify_writes(slot, it, deadline, written)

            await self._gather(writer)
            order = written  # verify what was written, in the order it was written
        self.progress.phase = "verify"
        it = iter(order)

        async def reader(slot: int) -> None:
            await self._verify_reads(slot, it)

        await self._gather(reader)
        self._finish_window(time.perf_counter_ns())

    async def _verify_writes(self, slot: int, it: Any, deadline: int | None, written: list[int]) -> None:
        spec, buf, wr, prog = self.spec, self.buffers[slot], self.result.write, self.progress
        clock = time.perf_counter_ns
        for unit in it:
            if deadline is not None and clock() >= deadline:
                return
            slba = self.base_lba + unit * self.nlb
            fill_verify_block(buf, spec.verify_seed, slba)
            t0 = clock()
            await self.ctrl.write(spec.nsid, slba, buf)
            wr.clat.record(clock() - t0)
            wr.ios += 1
            wr.bytes += spec.bs
            prog.write_ios += 1
            prog.write_bytes += spec.bs
            written.append(unit)

    async def _verify_reads(self, slot: int, it: Any) -> None:
        spec, buf, rd, prog = self.spec, self.buffers[slot], self.result.read, self.progress
        ver = self.result.verify
        assert ver is not None
        clock = time.perf_counter_ns
        for unit in it:
            slba = self.base_lba + unit * self.nlb
            t0 = clock()
            await self.ctrl.read(spec.nsid, slba, self.nlb, buf=buf)
            rd.clat.record(clock() - t0)
            rd.ios += 1
            rd.bytes += spec.bs
            prog.read_ios += 1
            prog.read_bytes += spec.bs
            ver.blocks += 1
            bad = check_verify_block(buf, spec.verify_seed, slba)
            if bad is not None:
                ver.add(VerifyError(unit, slba * self.lba_size, slba, *bad))


# --- running jobs ----------------------------------------------------------------------------------

async def connect(cspec: ConnectSpec) -> Any:
    import initiator

    return await initiator.connect(cspec.traddr, **cspec.kwargs())


async def run_job(cspec: ConnectSpec, spec: JobSpec, index: int = 0, *,
                  on_ready: Callable[[JobRunner], Any] | None = None,
                  on_measure_start: Callable[[], None] | None = None,
                  on_done: Callable[[JobRunner], Any] | None = None) -> JobResult:
    """Connect, run one job, disconnect. The hooks let a caller synchronise several jobs
    (``on_ready`` before the first I/O, ``on_done`` before disconnecting; either may be async)."""
    ctrl = await connect(cspec)
    try:
        runner = JobRunner(ctrl, spec, index, on_measure_start=on_measure_start)
        await runner.setup()
        if on_ready is not None:
            await _maybe_await(on_ready(runner))
        result = await runner.run()
        if on_done is not None:
            await _maybe_await(on_done(runner))
        return result
    finally:
        with contextlib.suppress(Exception):
            await ctrl.disconnect()


async def _maybe_await(value: Any) -> None:
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        await value


ProgressCallback = Callable[[float, "list[tuple[int, int, int, int]]", str], None]
"""(elapsed seconds since the first I/O, per-job (read_ios, read_bytes, write_ios, write_bytes), phase)"""


async def run_bench(cspec: ConnectSpec, spec: JobSpec, *, target_pids: tuple[int, ...] = (),
                    progress: ProgressCallback | None = None) -> BenchReport:
    """Run ``spec.numjobs`` jobs (in this process for one job, in spawned workers otherwise)."""
    spec.validate()
    if spec.numjobs > 1 and cspec.transport == "loop":
        raise BenchError("--numjobs > 1 runs worker processes, which cannot reach an in-process loop target")
    for pid in target_pids:
        process_cpu_seconds(pid)  # fail early on a wrong PID
    report = BenchReport(job=spec, connect=cspec, results=[], started=time.time(), target_pids=target_pids)
    if spec.numjobs == 1:
        await _run_inline(cspec, spec, report, progress)
    else:
        await _run_workers(cspec, spec, report, progress)
    return report


async def _run_inline(cspec: ConnectSpec, spec: JobSpec, report: BenchReport,
                      progress: ProgressCallback | None) -> None:
    target0: list[float] = []
    pids = report.target_pids

    def measure_start() -> None:
        if pids:
            target0.append(target_cpu_seconds(pids))

    runner_box: list[JobRunner] = []
    ticker: asyncio.Task[None] | None = None

    def ready(runner: JobRunner) -> None:
        nonlocal ticker
        runner_box.append(runner)
        if progress is not None:
            ticker = asyncio.ensure_future(_tick_inline(runner, progress))

    def done(runner: JobRunner) -> None:
        if pids and target0:
            report.target_cpu_s = target_cpu_seconds(pids) - target0[0]
        if ticker is not None:
            ticker.cancel()

    try:
        result = await run_job(cspec, spec, 0, on_ready=ready, on_measure_start=measure_start, on_done=done)
    finally:
        if ticker is not None:
            ticker.cancel()
    report.results.append(result)


async def _tick_inline(runner: JobRunner, progress: ProgressCallback) -> None:
    t0 = time.monotonic()
    p = runner.progress
    while True:
        progress(time.monotonic() - t0, [(p.read_ios, p.read_bytes, p.write_ios, p.write_bytes)], p.phase)
        await asyncio.sleep(_PROGRESS_INTERVAL * 2)


# --- worker processes ------------------------------------------------------------------------------

_COUNTERS = 4  # read_ios, read_bytes, write_ios, write_bytes per job


def _worker_main(cspec: ConnectSpec, spec: JobSpec, index: int, counters: Any, start: Any, end: Any,
                 results: Any, barrier_timeout: float) -> None:
    """Entry point of one worker process."""
    try:
        result = asyncio.run(_worker_async(cspec, spec, index, counters, start, end, barrier_timeout))
    except BaseException as e:  # the parent reports it; never leave the others waiting
        results.put((index, None, f"job {index}: {type(e).__name__}: {e}"))
        time.sleep(0.2)  # let the queue's feeder thread deliver the message before the barriers break
        start.abort()
        end.abort()
        return
    results.put((index, result, None))


async def _worker_async(cspec: ConnectSpec, spec: JobSpec, index: int, counters: Any, start: Any, end: Any,
                        barrier_timeout: float) -> JobResult:
    publisher: asyncio.Task[None] | None = None

    async def ready(runner: JobRunner) -> None:
        nonlocal publisher
        await asyncio.to_thread(start.wait, barrier_timeout)
        publisher = asyncio.ensure_future(_publish(runner.progress, counters, index))

    async def done(runner: JobRunner) -> None:
        if publisher is not None:
            publisher.cancel()
        _store(runner.progress, counters, index)
        await asyncio.to_thread(end.wait)

    return await run_job(cspec, spec, index, on_ready=ready, on_done=done)


def _store(p: Progress, counters: Any, index: int) -> None:
    base = index * _COUNTERS
    counters[base:base + _COUNTERS] = [p.read_ios, p.read_bytes, p.write_ios, p.write_bytes]


async def _publish(p: Progress, counters: Any, index: int) -> None:
    while True:
        _store(p, counters, index)
        await asyncio.sleep(_PROGRESS_INTERVAL)


async def _run_workers(cspec: ConnectSpec, spec: JobSpec, report: BenchReport,
                       progress: ProgressCallback | None) -> None:
    ctx = multiprocessing.get_context("spawn")
    n = spec.numjobs
    counters = ctx.Array("q", n * _COUNTERS, lock=False)
    start = ctx.Barrier(n + 1)
    end = ctx.Barrier(n + 1)
    results = ctx.Queue()
    barrier_timeout = 60.0
    procs = [ctx.Process(target=_worker_main, name=f"nvmeof-bench-{i}", daemon=True,
                         args=(cspec, spec, i, counters, start, end, results, barrier_timeout))
             for i in range(n)]
    for p in procs:
        p.start()
    errors: list[str] = []
    collected: dict[int, JobResult] = {}

    def drain(block: bool) -> None:
        while len(collected) + len(errors) < n:
            try:
                index, result, err = results.get(timeout=1.0) if block else results.get_nowait()
            except Exception:  # queue.Empty
                if not block or not any(p.is_alive() for p in procs):
                    return
                continue
            if err is not None:
                errors.append(err)
            else:
                collected[index] = result

    try:
        try:
            await asyncio.to_thread(start.wait, barrier_timeout)
        except Exception:
            await asyncio.to_thread(drain, True)
            raise BenchError("workers failed to start: " + ("; ".join(errors) or "barrier broken")) from None
        t0 = time.monotonic()
        # no timeout: a size-limited run takes as long as it takes; a dead worker breaks the barrier
        end_wait = asyncio.ensure_future(asyncio.to_thread(end.wait))
        target0 = None
        if report.target_pids and not spec.ramp_time:
            target0 = target_cpu_seconds(report.target_pids)
        while not end_wait.done():
            if any(p.exitcode not in (None, 0) for p in procs):
                end.abort()  # a worker died without reaching the barrier (killed, crashed)
            if target0 is None and report.target_pids and time.monotonic() - t0 >= spec.ramp_time:
                target0 = target_cpu_seconds(report.target_pids)
            if progress is not None:
                snap = list(counters)
                progress(time.monotonic() - t0,
                         [tuple(snap[i * _COUNTERS:(i + 1) * _COUNTERS]) for i in range(n)], "run")
            await asyncio.wait([end_wait], timeout=_PROGRESS_INTERVAL * 2)
        try:
            end_wait.result()
        except Exception:
            drain(True)
            raise BenchError("a worker failed: " + ("; ".join(errors) or "barrier broken")) from None
        if report.target_pids and target0 is not None:
            report.target_cpu_s = target_cpu_seconds(report.target_pids) - target0
        await asyncio.to_thread(drain, True)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    if errors:
        raise BenchError("; ".join(errors))
    if len(collected) != n:
        raise BenchError(f"only {len(collected)} of {n} workers reported a result")
    report.results.extend(collected[i] for i in range(n))


# --- fio JSON ----------------------------------------------------------------------------------------

def _clat_json(h: LatencyHistogram) -> dict[str, Any]:
    out: dict[str, Any] = {"min": h.min, "max": h.max, "mean": h.mean, "stddev": h.stdev, "N": h.count}
    if h.count:
        out["percentile"] = {f"{p:f}": v for p, v in h.percentiles().items()}
    return out


def _dir_json(d: DirStats) -> dict[str, Any]:
    clat = _clat_json(d.clat)
    return {
        "io_bytes": d.bytes,
        "io_kbytes": d.bytes >> 10,
        "bw_bytes": round(d.bw_bytes),
        "bw": round(d.bw_bytes / 1024),
        "iops": d.iops,
        "runtime": d.runtime_ms,
        "total_ios": d.ios,
        "short_ios": 0,
        "drop_ios": 0,
        "clat_ns": clat,
        # issue to completion is all one measurement here: lat = clat, no separate submission latency
        "lat_ns": {k: v for k, v in clat.items() if k != "percentile"},
    }


def fio_json(report: BenchReport, version: str) -> dict[str, Any]:
    """The report in fio's JSON layout (fio 3.x field names), plus cpu_us_per_io and verify."""
    spec = report.job
    results = [report.group()] if spec.group_reporting else report.results
    cpu = report.cpu_us_per_io()
    options = {
        "name": spec.name, "rw": spec.rw, "bs": str(spec.bs), "iodepth": str(spec.iodepth),
        "numjobs": str(spec.numjobs), "nsid": str(spec.nsid), "offset": str(spec.offset),
    }
    if spec.rw in ("randrw", "readwrite"):
        options["rwmixread"] = str(spec.rwmixread)
    if spec.size is not None:
        options["size"] = str(spec.size)
    if spec.runtime is not None:
        options["runtime"] = str(spec.runtime)
    if spec.time_based:
        options["time_based"] = "1"
    if spec.ramp_time:
        options["ramp_time"] = str(spec.ramp_time)
    if spec.verify:
        options["verify"] = spec.verify
    jobs = []
    for r in results:
        ios = r.total_ios
        runtime_ms = max(1, round(r.runtime_ns / 1e6))
        job: dict[str, Any] = {
            "jobname": r.name,
            "groupid": 0,
            "error": EILSEQ if (r.verify is not None and r.verify.errors) else (5 if r.error else 0),
            "eta": 0,
            "elapsed": max(1, round(r.runtime_ns / 1e9)),
            "job options": options,
            "read": _dir_json(r.read),
            "write": _dir_json(r.write),
            "job_runtime": runtime_ms,
            "usr_cpu": 100.0 * r.usr_s * 1000 / runtime_ms,
            "sys_cpu": 100.0 * r.sys_s * 1000 / runtime_ms,
            "cpu_us_per_io": {
                "initiator": (r.usr_s + r.sys_s) * 1e6 / ios if ios else None,
                # the target's CPU cannot be split per job; a single (or grouped) job gets it all
                "target": cpu["target"] if len(results) == 1 else None,
            },
        }
        if r.verify is not None:
            job["verify"] = _verify_json(r.verify)
        if r.error:
            job["error_message"] = r.error
        jobs.append(job)
    return {
        "fio version": f"nvmeof-bench-{version}",
        "timestamp": int(report.started),
        "timestamp_ms": int(report.started * 1000),
        "time": time.ctime(report.started),
        "global options": {"transport": report.connect.transport, "traddr": report.connect.traddr,
                           "trsvcid": str(report.connect.trsvcid), "subnqn": report.connect.subnqn},
        "jobs": jobs,
        "cpu_us_per_io": cpu,
        "target_pids": list(report.target_pids),
    }


def _verify_json(v: VerifyResult) -> dict[str, Any]:
    out: dict[str, Any] = {"blocks": v.blocks, "errors": v.errors}
    if v.first is not None:
        f = v.first
        out["first_error"] = {"block": f.block, "offset": f.offset, "slba": f.slba, "field": f.field,
                              "expected": f.expected, "actual": f.actual}
    return out
