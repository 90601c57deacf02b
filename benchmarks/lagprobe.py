#!/usr/bin/env python3
"""Run the `nvmeof` command line (of whichever tree is on PYTHONPATH) with a loop-lag probe in its event loop.

    python3 benchmarks/lagprobe.py OUT.jsonl serve --api none ...     # as `python3 -m nvmeof.cli serve ...`

How late the event loop gets to work that is ready is what a call that blocks on the loop (a buffered
``pwrite`` stuck in dirty-page throttling, say) costs every other queue it serves. The probe measures
it from outside the code under test, so both trees of an A/B are measured the same way:

* ``asyncio.run`` and ``uvloop.run`` are wrapped before the command line is imported, so the probe
  starts inside whichever loop `nvmeof serve` runs (no change to the target's code);
* a separate process, the pacer, wakes every ``--interval`` (1 ms), notes time.monotonic_ns and writes
  it into a pipe the loop reads (``add_reader``); how late the loop reads it is how long the loop took
  to get to ready work (the rest of the loop iteration it arrived in, plus the wake-up). A stall of
  2 ms or more is seen by at least one tick while it lasts, which measures at least its remaining part.
  The pacer is a process and not a thread of the target because a thread needs the target's GIL to
  hand the loop anything: measured with perf sched_switch, such a probe thread was often preempted
  while holding the GIL, and the loop then slept on the GIL for 4-25 ms (BENCHMARKS.md, "Loop stalls
  of file writes: what they wait on"), a stall the probe made and then reported. It is started as a
  grandchild (its launcher exits), so `nvmeof bench --target-pid` does not count it as the target's;
* on a shared machine most lateness is the loop's thread waiting for a CPU (preempted by the bench
  client, say), which no code of the target causes or avoids. The pacer reads the loop thread's
  run-queue wait (/proc/PID/task/TID/schedstat, second field, the kernel's sched_info run_delay) when
  it sends a tick and the loop reads it again when the tick lands; lateness minus that wait is the part
  the loop spent running or sleeping in a call (a stall of its own: a blocking pwrite, a long batch,
  a wait for the GIL), reported as ``own``. A pacer delayed between its clock reading and its write
  would make both figures larger (never smaller), so it runs as a real-time task (SCHED_FIFO) where
  allowed: on a loaded machine a normal one was, and reported "own" stalls of an idle loop;
* every 100 ms the loop sends the pacer one JSON line, which it appends to OUT: ``t``
  (time.monotonic_ns, CLOCK_MONOTONIC, comparable across processes), ``max_ns`` and ``max_own_ns``
  (the worst lateness that landed in those 100 ms, and the worst own part), ``n`` (probes),
  ``over_1ms`` and ``over_2ms`` (how many were later than that), ``own_over_1ms`` and
  ``own_over_2ms``, ``gc_max_ns`` (the longest garbage collection pause in those 100 ms: one cause
  of lateness that is no call's fault).

Each line also carries ``files``: the summed ``io_counts()`` of the process's file backends (calls
served inline and on the thread pool, the write policy's back-offs where the tree has one), found
by wrapping ``FileBackend._init_io`` where the tree has it.

The probe's own cost: about a thousand pipe reads a second on the loop (fewer when it is busy: one read
takes every tick that arrived), the same for every tree.
benchmarks/run.py starts its targets through this script and reports each row's worst lag
(``loop_lag_window``).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import runpy
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Coroutine
from typing import Any

INTERVAL_S = 0.001
REPORT_NS = 100_000_000
FILES: weakref.WeakSet[Any] = weakref.WeakSet()
TICK = struct.Struct("=qq")   # a tick: when the pacer sent it (monotonic ns), the loop thread's run-queue wait then


def file_counts() -> dict[str, int]:
    total: dict[str, int] = {}
    for backend in list(FILES):
        try:
            counts = backend.io_counts()
        except Exception:   # a backend closing meanwhile
            continue
        for key, value in counts.items():
            total[key] = total.get(key, 0) + value
    return total


def _register_file_backends() -> None:
    try:
        from target.backends.file import FileBackend
    except ImportError:
        return
    init_io = getattr(FileBackend, "_init_io", None)
    if init_io is None:
        return

    def registering(self: Any) -> None:
        init_io(self)
        FILES.add(self)

    FileBackend._init_io = registering  # type: ignore[method-assign]


class Probe:
    """The loop side: reads the pacer's ticks when the loop gets to them, and sends the pacer its reports."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out: str, interval: float) -> None:
        self.loop = loop
        self.lags: list[tuple[int, int]] = []
        self.gc_started = 0
        self.gc_worst = 0     # the longest garbage collection pause since the last report (any thread)
        self.next_report = time.monotonic_ns() + REPORT_NS
        tid = threading.get_native_id()   # the loop's own thread: the constructor runs on it
        try:
            self.schedstat: int | None = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        except OSError:
            self.schedstat = None
        self.ticks, tick_w = os.pipe()
        report_r, self.reports = os.pipe()
        self.done, done_w = os.pipe()
        os.set_blocking(self.ticks, False)
        os.set_blocking(self.reports, False)
        # the pacer runs as a grandchild, so `nvmeof bench --target-pid` (which counts the target's
        # descendants) does not count its CPU as the target's
        subprocess.run([sys.executable, __file__, "--pacer", str(tick_w), str(report_r), str(done_w), out,
                        str(os.getpid()), str(tid), repr(interval)],
                       pass_fds=(tick_w, report_r, done_w), check=True)
        for fd in (tick_w, report_r, done_w):
            os.close(fd)

    def start(self) -> None:
        gc.callbacks.append(self._gc)
        self.loop.add_reader(self.ticks, self._landed)

    def stop(self) -> None:
        """Stop reading ticks, and wait (up to 5 s) for the pacer to write the last reports and exit."""
        try:
            self.loop.remove_reader(self.ticks)
        except (RuntimeError, ValueError):   # the loop closed
            pass
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        os.close(self.reports)
        os.close(self.ticks)
        select.select([self.done], [], [], 5.0)   # EOF once the pacer has exited
        os.close(self.done)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.gc_started = time.perf_counter_ns()
        elif self.gc_started:
            self.gc_worst = max(self.gc_worst, time.perf_counter_ns() - self.gc_started)

    def run_delay(self) -> int:
        """ns the loop's thread has waited on a run queue so far (0 without schedstat)."""
        if self.schedstat is None:
            return 0
        return int(os.pread(self.schedstat, 128, 0).split()[1])

    def _landed(self) -> None:
        try:
            data = os.read(self.ticks, TICK.size * 256)
        except BlockingIOError:
            return
        now = time.monotonic_ns()
        waited_now = self.run_delay()
        for sent, waited in TICK.iter_unpack(data):
            lag = now - sent
            self.lags.append((lag, lag - (waited_now - waited)))
        if now >= self.next_report:
            self.next_report = now + REPORT_NS
            self._report(now)

    def _report(self, now: int) -> None:
        lags, self.lags = self.lags, []
        gc_worst, self.gc_worst = self.gc_worst, 0
        walls, owns = [w for w, _ in lags], [o for _, o in lags]
        line = json.dumps({"t": now, "max_ns": max(walls, default=0), "n": len(lags),
                           "max_own_ns": max(owns, default=0),
                           "over_1ms": sum(1 for v in walls if v > 1_000_000),
                           "over_2ms": sum(1 for v in walls if v > 2_000_000),
                           "own_over_1ms": sum(1 for v in owns if v > 1_000_000),
                           "own_over_2ms": sum(1 for v in owns if v > 2_000_000),
                           "gc_max_ns": gc_worst, "files": file_counts()}) + "\n"
        try:
            os.write(self.reports, line.encode())   # < PIPE_BUF: whole or not at all
        except BlockingIOError:
            pass   # the pacer is far behind: drop this report rather than block the loop


def pacer(tick_w: int, report_r: int, done_w: int, out: str, pid: int, tid: int, interval: float) -> None:
    """The probe's other process: every ``interval`` it notes the time and the loop thread's run-queue
    wait so far and writes both into the tick pipe; it appends the reports the loop sends back to OUT.
    It ends when the loop closes its ends of the pipes."""
    try:
        schedstat: int | None = os.open(f"/proc/{pid}/task/{tid}/schedstat", os.O_RDONLY)
    except OSError:
        schedstat = None
    os.set_blocking(tick_w, False)
    os.set_blocking(report_r, False)
    try:
        # a pacer preempted between its clock reading and its write would add its own delay to both figures:
        # as a real-time task it runs as soon as it wakes, and nothing of normal priority takes the CPU from it
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):
        pass   # not allowed (no root, no CAP_SYS_NICE): the figures may be a little too large under load
    step = int(interval * 1e9)
    next_tick = time.monotonic_ns() + step
    pending = b""
    with open(out, "ab") as f:
        while True:
            delay = next_tick - time.monotonic_ns()
            if delay > 0:
                time.sleep(delay / 1e9)
            sent = time.monotonic_ns()   # before the run-queue reading: a delay in between only adds to "own"
            waited = int(os.pread(schedstat, 128, 0).split()[1]) if schedstat is not None else 0
            try:
                os.write(tick_w, TICK.pack(sent, waited))
            except BlockingIOError:
                pass   # the loop has 4,096 ticks unread: it is stalled, and the oldest tick says for how long
            except BrokenPipeError:
                break
            next_tick = max(next_tick + step, time.monotonic_ns())
            try:
                chunk = os.read(report_r, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                break   # the loop is done
            pending += chunk
            lines, _, pending = pending.rpartition(b"\n")
            if lines:
                f.write(lines + b"\n")
                f.flush()
        os.set_blocking(report_r, True)
        rest = pending + b"".join(iter(lambda: os.read(report_r, 65536), b""))
        f.write(rest[:rest.rfind(b"\n") + 1])
    os.close(done_w)


def _wrap(run: Any, out: str, interval: float) -> Any:
    def wrapped(main: Coroutine[Any, Any, Any], *args: Any, **kwargs: Any) -> Any:
        async def probed() -> Any:
            probe = Probe(asyncio.get_running_loop(), out, interval)
            probe.start()
            try:
                return await main
            finally:
                probe.stop()

        return run(probed(), *args, **kwargs)

    return wrapped


def main(argv: list[str]) -> None:
    if argv[:1] == ["--pacer"]:
        tick_w, report_r, done_w, out, pid, tid, interval = argv[1:8]
        if os.fork():   # the launcher exits at once: the pacer is nobody's child in the target's tree
            os._exit(0)
        os.setsid()
        pacer(int(tick_w), int(report_r), int(done_w), out, int(pid), int(tid), float(interval))
        return
    interval = INTERVAL_S
    if argv[:1] == ["--interval"]:
        interval, argv = float(argv[1]), argv[2:]
    if not argv:
        raise SystemExit("usage: lagprobe.py [--interval SECONDS] OUT.jsonl NVMEOF-ARGS...")
    out, rest = argv[0], argv[1:]
    asyncio.run = _wrap(asyncio.run, out, interval)  # type: ignore[assignment]
    try:
        import uvloop
    except ImportError:
        pass
    else:
        uvloop.run = _wrap(uvloop.run, out, interval)
    _register_file_backends()
    sys.argv = ["nvmeof", *rest]
    runpy.run_module("nvmeof.cli", run_name="__main__", alter_sys=True)


def window(path: str, start_ns: int, end_ns: int) -> dict[str, Any]:
    """The worst lag among the reports written between ``start_ns`` and ``end_ns`` (monotonic_ns)."""
    worst = worst_own = probes = over_1ms = over_2ms = own_over_1ms = own_over_2ms = gc_worst = 0
    first: dict[str, int] | None = None
    last: dict[str, int] = {}
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue   # a line being written
        if start_ns <= rec["t"] <= end_ns:
            worst = max(worst, rec["max_ns"])
            worst_own = max(worst_own, rec.get("max_own_ns", 0))
            probes += rec["n"]
            over_1ms += rec["over_1ms"]
            over_2ms += rec["over_2ms"]
            own_over_1ms += rec.get("own_over_1ms", 0)
            own_over_2ms += rec.get("own_over_2ms", 0)
            gc_worst = max(gc_worst, rec.get("gc_max_ns", 0))
            last = rec.get("files") or {}
            if first is None:
                first = last
    # what the file backends did in the span (counters as differences; a "worst" or "on" figure as last seen)
    files = {k: v - (first or {}).get(k, 0) if not k.startswith(("write_worst", "write_on")) else v
             for k, v in last.items()}
    return {"max_us": worst / 1000 if probes else None, "max_own_us": worst_own / 1000 if probes else None,
            "probes": probes, "over_1ms": over_1ms, "over_2ms": over_2ms, "own_over_1ms": own_over_1ms,
            "own_over_2ms": own_over_2ms, "gc_max_us": gc_worst / 1000 if probes else None, "files": files}


if __name__ == "__main__":
    main(sys.argv[1:])
