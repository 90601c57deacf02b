"""``run_bench``: one job in this process, or ``numjobs`` jobs in worker processes."""

from __future__ import annotations

import asyncio
import time

from initiator.bench.cpu import process_cpu_seconds, target_cpu_seconds
from initiator.bench.engine import PROGRESS_INTERVAL, JobRunner, ProgressCallback, run_job
from initiator.bench.jobspec import BenchError, ConnectSpec, JobSpec
from initiator.bench.results import BenchReport
from initiator.bench.workers import run_workers


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
        await run_workers(cspec, spec, report, progress)
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
        await asyncio.sleep(PROGRESS_INTERVAL * 2)
