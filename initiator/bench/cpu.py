"""CPU accounting: this process through getrusage, target processes through /proc."""

from __future__ import annotations

import os
import resource

from initiator.bench.jobspec import BenchError


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


def rusage_seconds() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime
