#!/usr/bin/env python3
"""Run the `nvmeof` command line (of whichever tree is on PYTHONPATH) with a loop-lag probe in its event loop.

    python3 benchmarks/lagprobe.py OUT.jsonl serve --api none ...     # as `python3 -m nvmeof.cli serve ...`

How late the event loop gets to work that is ready is what a call that blocks on the loop (a buffered
``pwrite`` stuck in dirty-page throttling, say) costs every other queue it serves. The probe measures
it from outside the code under test, so both trees of an A/B are measured the same way:

* ``asyncio.run`` and ``uvloop.run`` are wrapped before the command line is imported, so the probe
  starts inside whichever loop `nvmeof serve` runs (no change to the target's code);
* a thread wakes every ``--interval`` (1 ms), notes time.perf_counter_ns and hands the loop a
  callback with call_soon_threadsafe; the callback's lateness is how long the loop took to get to it
  (the rest of the loop iteration it arrived in, plus the wake-up). A stall of 2 ms or more is seen
  by at least one probe while it lasts, which measures at least its remaining part;
* on a shared machine most lateness is the loop's thread waiting for a CPU (preempted by the bench
  client, say), which no code of the target causes or avoids. The loop thread's run-queue wait
  (/proc/self/task/TID/schedstat, second field, the kernel's sched_info run_delay) is read when a
  probe is sent and when it lands; lateness minus that wait is the part the loop spent running or
  sleeping in a call (a stall of its own: a blocking pwrite, a long batch), reported as ``own``;
* every 100 ms the probe appends one JSON line to OUT: ``t`` (time.monotonic_ns, CLOCK_MONOTONIC,
  comparable across processes), ``max_ns`` and ``max_own_ns`` (the worst lateness that landed in
  those 100 ms, and the worst own part), ``n`` (probes), ``over_1ms`` and ``over_2ms`` (how many
  were later than that), ``own_over_1ms`` and ``own_over_2ms``, ``gc_max_ns`` (the longest garbage
  collection pause in those 100 ms: one cause of lateness that is no call's fault).

Each line also carries ``files``: the summed ``io_counts()`` of the process's file backends (calls
served inline and on the thread pool, the write policy's back-offs where the tree has one), found
by wrapping ``FileBackend._init_io`` where the tree has it.

The probe's own cost: about a thousand wake-ups a second of the loop, the same for every tree.
benchmarks/run.py starts its targets through this script and reports each row's worst lag
(``loop_lag_window``).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import runpy
import sys
import threading
import time
import weakref
from collections.abc import Coroutine
from typing import Any

INTERVAL_S = 0.001
REPORT_NS = 100_000_000
FILES: weakref.WeakSet[Any] = weakref.WeakSet()


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
    def __init__(self, loop: asyncio.AbstractEventLoop, out: str, interval: float) -> None:
        self.loop = loop
        self.out = out
        self.interval = interval
        self.lags: list[tuple[int, int]] = []
        self.gc_started = 0
        self.gc_worst = 0     # the longest garbage collection pause since the last report (any thread)
        try:   # the loop's own thread: the constructor runs on it
            self.schedstat: int | None = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:
            self.schedstat = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="loop-lag-probe", daemon=True)

    def start(self) -> None:
        gc.callbacks.append(self._gc)
        self.thread.start()

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

    def _landed(self, sent: int, waited: int) -> None:
        lag = time.perf_counter_ns() - sent
        self.lags.append((lag, lag - (self.run_delay() - waited)))   # on the loop; list.append is atomic

    def _run(self) -> None:
        clock = time.perf_counter_ns
        next_report = time.monotonic_ns() + REPORT_NS
        with open(self.out, "a", buffering=1) as out:
            while not self.stopped.wait(self.interval):
                try:
                    self.loop.call_soon_threadsafe(self._landed, clock(), self.run_delay())
                except RuntimeError:   # the loop closed
                    break
                now = time.monotonic_ns()
                if now >= next_report:
                    next_report = now + REPORT_NS
                    lags, self.lags = self.lags, []
                    gc_worst, self.gc_worst = self.gc_worst, 0
                    walls, owns = [w for w, _ in lags], [o for _, o in lags]
                    out.write(json.dumps({"t": now, "max_ns": max(walls, default=0), "n": len(lags),
                                          "max_own_ns": max(owns, default=0),
                                          "over_1ms": sum(1 for v in walls if v > 1_000_000),
                                          "over_2ms": sum(1 for v in walls if v > 2_000_000),
                                          "own_over_1ms": sum(1 for v in owns if v > 1_000_000),
                                          "own_over_2ms": sum(1 for v in owns if v > 2_000_000),
                                          "gc_max_ns": gc_worst, "files": file_counts()}) + "\n")


def _wrap(run: Any, out: str, interval: float) -> Any:
    def wrapped(main: Coroutine[Any, Any, Any], *args: Any, **kwargs: Any) -> Any:
        async def probed() -> Any:
            probe = Probe(asyncio.get_running_loop(), out, interval)
            probe.start()
            try:
                return await main
            finally:
                probe.stopped.set()

        return run(probed(), *args, **kwargs)

    return wrapped


def main(argv: list[str]) -> None:
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
    worst = worst_own = probes = over_1ms = over_2ms = own_over_2ms = 0
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
            own_over_2ms += rec.get("own_over_2ms", 0)
            last = rec.get("files") or {}
            if first is None:
                first = last
    # what the file backends did in the span (counters as differences; a "worst" or "on" figure as last seen)
    files = {k: v - (first or {}).get(k, 0) if not k.startswith(("write_worst", "write_on")) else v
             for k, v in last.items()}
    return {"max_us": worst / 1000 if probes else None, "max_own_us": worst_own / 1000 if probes else None,
            "probes": probes, "over_1ms": over_1ms, "over_2ms": over_2ms, "own_over_2ms": own_over_2ms,
            "files": files}


if __name__ == "__main__":
    main(sys.argv[1:])
