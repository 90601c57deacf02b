"""The `nvmeof serve` processes tests start: stopping them, and finding their children (the workers)."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


def stop_process(proc: subprocess.Popen[Any], timeout: float = 20) -> int | None:
    """SIGTERM ``proc`` if it still runs and wait for it to exit: its exit status, or None when it did not
    exit within ``timeout`` seconds and had to be killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def child_pids(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc/<pid>/stat; the field after the ")" that ends the command
    name, which may itself hold spaces and parentheses), sorted; processes that go meanwhile are skipped."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(name))
    return sorted(out)
