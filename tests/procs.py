"""Stopping the `nvmeof serve` processes tests start."""

from __future__ import annotations

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
