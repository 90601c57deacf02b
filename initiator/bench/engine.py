"""The job engine: one job on one connected controller.

The job keeps ``iodepth`` commands in flight, each slot owning one preallocated buffer: on the batch
engine's queues (initiator/engine.py) through completion callbacks without a Task or Future per I/O
(initiator/bench/batch.py), otherwise ``iodepth`` coroutines looping issue -> await -> record; either
way ``time.perf_counter_ns`` deltas go into the latency histograms.

Stop rules follow fio: ``size`` bytes (one pass over the region) or ``runtime`` seconds, whichever
comes first; with ``time_based`` the job loops over the region until ``runtime``. I/O issued during
``ramp_time`` is not counted, and the size limit counts only I/O after the ramp (fio resets its
counters when the ramp ends). Random offsets are uniform with replacement (fio's norandommap),
except the write phase of ``verify``, which writes every block of the region once in random order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from initiator.bench.batch import BatchDriver
from initiator.bench.cpu import rusage_seconds
from initiator.bench.jobspec import BenchError, ConnectSpec, JobSpec
from initiator.bench.results import JobResult
from initiator.bench.verify import VerifyError, VerifyResult, check_verify_block, fill_verify_block

PROGRESS_INTERVAL = 0.25   # seconds between progress counter publications

ProgressCallback = Callable[[float, "list[tuple[int, int, int, int]]", str], None]
"""(elapsed seconds since the first I/O, per-job (read_ios, read_bytes, write_ios, write_bytes), phase)"""


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
        self._cpu0 = rusage_seconds()
        loop = asyncio.get_running_loop()
        timer = loop.call_later(spec.ramp_time, self._measure_start) if spec.ramp_time else None
        if timer is None:
            self._measure_start()
        try:
            batch = BatchDriver.for_runner(self)
            if batch is not None:
                await batch.run()
            else:
                await self._gather(self._slot)
        finally:
            if timer is not None:
                timer.cancel()
        self._finish_window(self._last_done)

    def _measure_start(self) -> None:
        self._cpu0 = rusage_seconds()
        self.progress.measuring = True
        self.progress.phase = "run"
        if self._on_measure_start is not None:
            self._on_measure_start()

    def _finish_window(self, end_ns: int) -> None:
        usr, sys_ = rusage_seconds()
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
        self._cpu0 = rusage_seconds()
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
