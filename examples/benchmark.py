"""Run a short fio-style benchmark with `nvmeof bench` and read its fio-format JSON.

    NVMEOF_TRADDR=127.0.0.1 NVMEOF_TRSVCID=4420 NVMEOF_NQN=nqn... python3 examples/benchmark.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

TRADDR = os.environ.get("NVMEOF_TRADDR", "127.0.0.1")
TRSVCID = os.environ.get("NVMEOF_TRSVCID", "4420")
NQN = os.environ.get("NVMEOF_NQN", "nqn.2026-11.io.nvmeof-toolkit:example")
RUNTIME = os.environ.get("NVMEOF_BENCH_RUNTIME", "3")


def main() -> None:
    cmd = [sys.executable, "-m", "nvmeof.cli", "bench", "-a", TRADDR, "-s", TRSVCID, "-n", NQN,
           "--rw", "randread", "--bs", "4k", "--iodepth", "16", "--runtime", RUNTIME, "--time_based",
           "--size", "64M", "--output-format", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out)["jobs"][0]
    read = job["read"]
    pct = read["clat_ns"]["percentile"]
    print(f"4 KiB random read, QD16: {read['iops']:.0f} IOPS, {read['bw_bytes'] / 2**20:.1f} MiB/s, "
          f"p50 {pct['50.000000'] / 1000:.0f} us, p99 {pct['99.000000'] / 1000:.0f} us")


if __name__ == "__main__":
    main()
