"""Worker processes for ``numjobs > 1``: each runs one job on its own connection ('spawn' start
method); the parent starts and stops them together with barriers, shows their progress counters
and merges their results."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from typing import Any

from initiator.bench.cpu import target_cpu_seconds
from initiator.bench.engine import PROGRESS_INTERVAL, JobRunner, Progress, ProgressCallback, run_job
from initiator.bench.jobspec import BenchError, ConnectSpec, JobSpec
from initiator.bench.results import BenchReport, JobResult

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
        await asyncio.sleep(PROGRESS_INTERVAL)


async def run_workers(cspec: ConnectSpec, spec: JobSpec, report: BenchReport,
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
            await asyncio.wait([end_wait], timeout=PROGRESS_INTERVAL * 2)
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
