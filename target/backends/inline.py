"""When a call that may block runs on the event loop anyway: while such calls stay fast.

``InlinePolicy`` runs a buffered write that RWF_NOWAIT cannot bound inline while such writes complete fast,
and sends them to the thread pool for a doubling back-off after a slow one that slept in the kernel or ran
on the CPU for longer than the bound (not one that only waited for a CPU), or while the page cache's dirty
pages are at the background writeback threshold. The reasons and the measurements: ARCHITECTURE.md, "Inline writes".
"""

from __future__ import annotations

import fcntl
import os
import resource
import time
from collections.abc import Callable
from typing import Any

from nvmeof import defaults

PRESSURE_CHECK_NS = 100_000_000   # at most one /proc/meminfo read per 100 ms and process
_pressure_checked_ns = -PRESSURE_CHECK_NS
_pressure = False


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _read_int(path: str) -> int:
    try:
        return int(_read_file(path))
    except (OSError, ValueError):
        return 0


def dirty_pressure() -> bool:
    """Whether dirty + writeback page-cache pages have reached the background writeback threshold.

    domain_dirty_limits (mm/page-writeback.c): the thresholds are vm.dirty_background_bytes /
    vm.dirty_bytes when set, else their ratios of the dirtyable memory (free pages plus the file LRU,
    global_dirtyable_memory); a background threshold not below the hard one is taken as half of it.
    Writers are throttled from the midpoint of the two (dirty_freerun_ceiling); stopping at the
    background threshold leaves the inline path before that. False when /proc cannot be read.
    """
    try:
        text = _read_file("/proc/meminfo")
    except OSError:
        return False
    info: dict[bytes, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(b":")
        if key in (b"MemFree", b"Active(file)", b"Inactive(file)", b"Dirty", b"Writeback"):
            info[key] = int(rest.split()[0]) * 1024
    dirtyable = info.get(b"MemFree", 0) + info.get(b"Active(file)", 0) + info.get(b"Inactive(file)", 0)
    hard = _read_int("/proc/sys/vm/dirty_bytes") or _read_int("/proc/sys/vm/dirty_ratio") * dirtyable // 100
    background = (_read_int("/proc/sys/vm/dirty_background_bytes")
                  or _read_int("/proc/sys/vm/dirty_background_ratio") * dirtyable // 100)
    if hard and background >= hard:
        background = hard // 2
    if not background:
        return False
    return info.get(b"Dirty", 0) + info.get(b"Writeback", 0) >= background


def thread_switches() -> Any:
    """The calling thread's context switches so far: ``ru_nvcsw`` (voluntary: it slept) and
    ``ru_nivcsw`` (involuntary: preempted)."""
    return resource.getrusage(resource.RUSAGE_THREAD)


def _cached_pressure(now_ns: int) -> bool:
    # one reading shared by every file of the process: the page cache is global
    global _pressure_checked_ns, _pressure
    if now_ns - _pressure_checked_ns >= PRESSURE_CHECK_NS:
        _pressure_checked_ns = now_ns
        _pressure = dirty_pressure()
    return _pressure


class InlinePolicy:
    """Inline or thread pool, for one file's calls that may block: see the module docstring.

    ``inline_now()`` is asked before each call (cheap while inline: one attribute test), and
    ``record(start_ns, end_ns, switches, cpu_ns)`` is told how long each inline call took, on ``clock``'s
    scale (time.perf_counter_ns; tests give a fake clock), with ``switches()`` as it was before the call and,
    while ``cpu_timed``, ``cpu()`` (the thread's CPU time) too, else -1.
    Counters: ``slow`` calls seen, ``ran`` (slow ones timed on the CPU clock that ran for longer than the
    bound without sleeping: a back-off), ``preempted`` (slow ones that did neither and were preempted: they
    waited for a CPU, no back-off), ``unswitched`` (slow ones with no context switch at all: the time went
    to the hypervisor, no back-off), ``backoffs`` entered (slow calls that slept or ran, and dirty-page
    pressure), ``probes`` (first calls after a back-off).
    """

    __slots__ = ("_backoff", "_checked_ns", "_cpu_left", "_probing", "_until", "backoff_max_ns", "backoff_ns",
                 "backoffs", "clock", "cpu", "cpu_timed", "cpu_timed_calls", "preempted", "pressure", "probes", "ran",
                 "slow", "slow_ns", "switches", "unswitched", "worst_ns")

    def __init__(
        self,
        slow_ns: int | None = None,
        backoff_ns: int | None = None,
        backoff_max_ns: int | None = None,
        cpu_timed_calls: int | None = None,
        clock: Callable[[], int] = time.perf_counter_ns,
        pressure: Callable[[int], bool] | None = _cached_pressure,
        switches: Callable[[], Any] = thread_switches,
        cpu: Callable[[], int] = time.thread_time_ns,
    ) -> None:
        self.slow_ns = defaults.FILE_INLINE_SLOW_US * 1000 if slow_ns is None else slow_ns
        self.backoff_ns = defaults.FILE_INLINE_BACKOFF_MS * 1_000_000 if backoff_ns is None else backoff_ns
        self.backoff_max_ns = (defaults.FILE_INLINE_BACKOFF_MAX_MS * 1_000_000 if backoff_max_ns is None
                               else backoff_max_ns)
        self.cpu_timed_calls = defaults.FILE_INLINE_CPU_TIMED_WRITES if cpu_timed_calls is None else cpu_timed_calls
        self.clock = clock
        self.pressure = pressure
        self.switches = switches
        self.cpu = cpu
        self.cpu_timed = False    # calls are timed on the CPU clock too (_cpu_left more of them)
        self._cpu_left = 0
        self._until = 0           # clock value before which calls go to the pool; 0: inline
        self._backoff = self.backoff_ns
        self._probing = False     # the next inline call is the first after a back-off
        self._checked_ns = clock()
        self.slow = self.ran = self.preempted = self.unswitched = self.backoffs = self.probes = 0
        self.worst_ns = 0         # the longest inline call seen

    def inline_now(self) -> bool:
        if not self._until:
            return True
        now = self.clock()
        if now < self._until:
            return False
        pressure = self.pressure
        if pressure is not None and pressure(time.monotonic_ns()):
            # still past the writeback threshold: another back-off, without a write stalling the loop to learn it
            self._checked_ns = now
            self._enter_backoff(now)
            return False
        self._until = 0
        self._probing = True
        self.probes += 1
        return True

    def record(self, start_ns: int, end_ns: int, before: Any, cpu_before: int) -> None:
        elapsed = end_ns - start_ns
        if elapsed > self.worst_ns:
            self.worst_ns = elapsed
        if self.cpu_timed:
            self._cpu_left -= 1
            if self._cpu_left <= 0:
                self.cpu_timed = False
        if elapsed > self.slow_ns:
            self.slow += 1
            after = self.switches()
            if after.ru_nvcsw == before.ru_nvcsw:
                # It never slept. If it ran on the CPU for longer than the bound (reclaim or compaction that
                # does not sleep, a long copy; interrupts too, with no IRQ_TIME_ACCOUNTING), the next such
                # call stalls the loop as long: back off. Otherwise it waited for a CPU (preempted) or, with
                # no context switch at all, for a hypervisor holding the vCPU, which a pool thread would wait
                # as well. The thread's CPU clock (CLOCK_THREAD_CPUTIME_ID, task_sched_runtime) tells them
                # apart: exact to the nanosecond, without the time the hypervisor stole where the kernel
                # accounts it (PARAVIRT_TIME_ACCOUNTING); getrusage's CPU times lag by up to a tick for a
                # running thread. That clock is a system call (about 1 us a write here, a fifth of an
                # inline 4 KiB write; each read also updates the thread's run time, where the scheduler may
                # end its slice), so it is read only for the cpu_timed_calls calls after a slow one
                # that did not sleep: the first call of a condition that keeps the CPU busy stalls the loop
                # unnoticed, the next slow one backs off.
                if cpu_before >= 0 and self.cpu() - cpu_before > self.slow_ns:
                    self.ran += 1
                else:
                    self.cpu_timed = True
                    self._cpu_left = self.cpu_timed_calls
                    if after.ru_nivcsw != before.ru_nivcsw:
                        self.preempted += 1
                    else:
                        self.unswitched += 1
                    return
            # a slow probe: the condition lasted the whole back-off, so wait longer next time
            self._backoff = min(self._backoff * 2, self.backoff_max_ns) if self._probing else self.backoff_ns
            self._enter_backoff(end_ns)
            if cpu_before >= 0:
                self.cpu_timed = True   # the probe after it is timed too
                self._cpu_left = self.cpu_timed_calls
            return
        if self._probing:
            self._probing = False
            self._backoff = self.backoff_ns
        pressure = self.pressure
        if pressure is not None and end_ns - self._checked_ns >= PRESSURE_CHECK_NS:
            self._checked_ns = end_ns
            if pressure(time.monotonic_ns()):
                self._enter_backoff(end_ns)

    def _enter_backoff(self, now_ns: int) -> None:
        self.backoffs += 1
        self._probing = False
        self._until = (now_ns + self._backoff) or 1

    def counts(self) -> dict[str, int]:
        return {"slow": self.slow, "ran": self.ran, "preempted": self.preempted, "unswitched": self.unswitched,
                "backoffs": self.backoffs, "probes": self.probes, "worst_inline_us": self.worst_ns // 1000,
                "on_pool": int(bool(self._until))}


def sync_flags(fd: int) -> int:
    """The O_DIRECT / O_SYNC / O_DSYNC flags of an open file: its writes wait for the device, never inline."""
    direct = getattr(os, "O_DIRECT", 0)
    return fcntl.fcntl(fd, fcntl.F_GETFL) & (direct | os.O_SYNC | os.O_DSYNC)
