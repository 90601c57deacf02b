"""The bench's batch path: ``iodepth`` I/O slots driven by completion callbacks on the batch engine.

No Task, coroutine or Future per I/O: each slot's completion callback (run by the queue inside the
wake-up that parsed the completion) records the latency and starts the slot's next I/O with
``BatchQueue.start``, so every completion of one wake-up and every command it causes leave in that
wake-up's single ``sendmsg``. One Future for the whole job says when the last slot is done.

The I/O pattern, the stop rules and the counters are those of ``JobRunner._slot`` (fio's), so both
paths report the same things; CPU per I/O stays process CPU time over completed I/Os.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nvmeof.spec.nvme import IoOpcode

MAX_NLB = 65536   # CDW12 NLB is 16 bits, 0's based
_READ = int(IoOpcode.READ)
_WRITE = int(IoOpcode.WRITE)
PUBLISH_EVERY = 256   # counted completions between updates of the job's counters (progress display)


class BatchDriver:
    """Runs the plain (non-verify) phase of one ``JobRunner`` on the batch engine's queues."""

    @classmethod
    def for_runner(cls, runner: Any) -> BatchDriver | None:
        """The driver, or None where the job needs the coroutine path: a controller without batch
        queues (stream engine, loop or RDMA transport), an I/O larger than one command carries, or
        more slots than a queue has free cids."""
        queues = list(getattr(runner.ctrl, "io_queues", None) or ())
        if not queues or not all(callable(getattr(q, "start", None)) for q in queues):
            return None
        spec = runner.spec
        mdts = getattr(runner.ctrl, "mdts_bytes", 0)
        if runner.nlb > MAX_NLB or (mdts and spec.bs > mdts):
            return None
        per_queue = -(-spec.iodepth // len(queues))
        if any(q.free_slots < per_queue for q in queues):
            return None
        return cls(runner, queues)

    def __init__(self, runner: Any, queues: list[Any]) -> None:
        self.runner = runner
        spec = runner.spec
        depth = spec.iodepth
        self.queues = [queues[i % len(queues)] for i in range(depth)]
        self.starts = [q.start for q in self.queues]
        self.buffers = runner.buffers
        self.t0 = [0] * depth
        self.counted = [False] * depth
        self.is_read = [False] * depth
        self.active = 0
        self.stopped = False
        self.done: asyncio.Future[None] | None = None
        # The job's constants, looked up once (spec.random and read_fraction are properties).
        self.nsid, self.nlb, self.base, self.bs = spec.nsid, runner.nlb, runner.base_lba, spec.bs
        self.units = runner.units
        self.is_random = spec.random
        self.fraction = spec.read_fraction
        self.rand = runner._rng.random
        self.deadline = runner._deadline
        self.mstart = runner._mstart
        self.limit = runner._limit
        self.issued = 0
        self.cursor = 0
        # Counted completions: latencies go to the histograms in batches (LatencyHistogram.record_many)
        # and the I/O counters are published every PUBLISH_EVERY completions and at the end.
        self.read_lat: list[int] = []
        self.write_lat: list[int] = []
        self.last_done = runner._last_done
        self.complete = self._make_complete()

    async def run(self) -> None:
        r = self.runner
        self.done = asyncio.get_running_loop().create_future()
        depth = r.spec.iodepth
        self.active = depth
        try:
            for slot in range(depth):
                if not self._issue(slot):
                    self.active -= 1
            if self.active == 0:
                return
            for q in set(self.queues):
                q.kick()
            await self.done
        finally:
            self.stopped = True
            r._issued += self.issued
            self._publish()

    def _publish(self) -> None:
        """Move the counted completions into the job's results and progress counters."""
        r = self.runner
        bs = self.bs
        for lat, stats, is_read in ((self.read_lat, r.result.read, True), (self.write_lat, r.result.write, False)):
            if not lat:
                continue
            stats.ios += len(lat)
            stats.bytes += len(lat) * bs
            stats.clat.record_many(lat)
            if is_read:
                r.progress.read_ios += len(lat)
                r.progress.read_bytes += len(lat) * bs
            else:
                r.progress.write_ios += len(lat)
                r.progress.write_bytes += len(lat) * bs
            lat.clear()
        if self.last_done > r._last_done:
            r._last_done = self.last_done

    def _issue(self, slot: int) -> bool:
        """Start the slot's next I/O; False when the job's stop rules say this slot is done."""
        t0 = time.perf_counter_ns()
        if self.deadline is not None and t0 >= self.deadline:
            return False
        counted = t0 >= self.mstart
        if counted and self.limit is not None:
            if self.issued >= self.limit:
                return False
            self.issued += 1
        if self.is_random:
            unit = int(self.rand() * self.units)
        else:
            unit = self.cursor
            self.cursor = unit + 1 if unit + 1 < self.units else 0
        fraction = self.fraction
        is_read = fraction == 1.0 or (fraction > 0.0 and self.rand() < fraction)
        self.t0[slot] = t0
        self.counted[slot] = counted
        self.is_read[slot] = is_read
        nlb = self.nlb
        self.starts[slot](_READ if is_read else _WRITE, self.nsid, self.base + unit * nlb, nlb,
                          self.buffers[slot], not is_read, self.complete, slot)
        return True

    def _make_complete(self) -> Any:
        """The slots' completion callback: count the I/O, then start the slot's next one (``_issue`` without
        a second clock read: the completion time is the next I/O's start). A closure over the job's
        constants and lists, since this runs once per I/O."""
        driver = self
        t0s, counted_at, is_read_at = self.t0, self.counted, self.is_read
        read_lat, write_lat = self.read_lat, self.write_lat
        starts, buffers = self.starts, self.buffers
        deadline, mstart, limit = self.deadline, self.mstart, self.limit
        is_random, rand, units, fraction = self.is_random, self.rand, self.units, self.fraction
        nsid, nlb, base = self.nsid, self.nlb, self.base
        clock = time.perf_counter_ns
        publish, fail, finished = self._publish, self._fail, self._slot_finished
        read_op, write_op, every = _READ, _WRITE, PUBLISH_EVERY

        def complete(slot: int, err: BaseException | None) -> None:
            t1 = clock()
            if err is not None:
                fail(err)
                return
            if counted_at[slot]:
                lat = read_lat if is_read_at[slot] else write_lat
                lat.append(t1 - t0s[slot])
                driver.last_done = t1
                if len(lat) >= every:
                    publish()
            if driver.stopped or (deadline is not None and t1 >= deadline):
                finished()
                return
            counted = t1 >= mstart
            if counted and limit is not None:
                if driver.issued >= limit:
                    finished()
                    return
                driver.issued += 1
            if is_random:
                unit = int(rand() * units)
            else:
                unit = driver.cursor
                driver.cursor = unit + 1 if unit + 1 < units else 0
            is_read = fraction == 1.0 or (fraction > 0.0 and rand() < fraction)
            t0s[slot] = t1
            counted_at[slot] = counted
            is_read_at[slot] = is_read
            try:
                starts[slot](read_op if is_read else write_op, nsid, base + unit * nlb, nlb, buffers[slot],
                             not is_read, complete, slot)
            except Exception as exc:  # the queue broke between completions: the job fails with its reason
                fail(exc)

        return complete

    def _slot_finished(self) -> None:
        self.active -= 1
        if self.active == 0 and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _fail(self, err: BaseException) -> None:
        self.stopped = True
        if self.done is not None and not self.done.done():
            self.done.set_exception(err)
