#!/usr/bin/env python3
"""An RBD namespace next to a RAM disk and a file in the page cache, with librbd itself as the baseline.

One run: start a throwaway one-node Ceph cluster (tests/ceph_cluster.py: one monitor, one memstore
OSD), fill an image, measure librbd's own 4 KiB QD32 rates from Python (aio calls, 32 in flight,
the figure an RBD namespace cannot beat), then start one `nvmeof serve` exporting a RAM disk (nsid 1),
a file (nsid 2) and the image (nsid 3) and run the same `nvmeof bench` rows against each.

    python3 benchmarks/rbd_bench.py                  # 3 s per row
    python3 benchmarks/rbd_bench.py --runtime 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import Row, free_port, machine, run_bench, running

from tests.ceph_cluster import CephCluster

SIZE = 256 << 20
NQN = "nqn.2026-12.io.nvmeof-toolkit:bench-rbd"
ROWS = (
    Row("4k-randread-qd32", "randread", 4096, 32),
    Row("4k-randwrite-qd32", "randwrite", 4096, 32),
    Row("128k-read-qd8", "read", 131072, 8),
)
NAMESPACES = ((1, "ram"), (2, "file"), (3, "rbd"))


def librbd_rate(conf: Path, pool: str, image: str, *, write: bool, runtime: float, depth: int = 32) -> float:
    """4 KiB random I/O per second through librbd's aio calls with ``depth`` in flight."""
    from target.backends.rbd import load_rbd

    rados, rbd = load_rbd()
    cluster = rados.Rados(conffile=str(conf))
    cluster.connect(timeout=10)
    try:
        with cluster.open_ioctx(pool) as ioctx, rbd.Image(ioctx, image) as img:
            slots = threading.Semaphore(depth)
            done = [0]
            lock = threading.Lock()
            buf = os.urandom(4096)
            blocks = SIZE // 4096

            def finished(*_: Any) -> None:
                with lock:
                    done[0] += 1
                slots.release()

            end = time.monotonic() + runtime
            began = time.monotonic()
            while time.monotonic() < end:
                slots.acquire()
                offset = random.randrange(blocks) * 4096
                if write:
                    img.aio_write(buf, offset, finished)
                else:
                    img.aio_read(offset, 4096, finished)
            for _ in range(depth):
                slots.acquire()
            return done[0] / (time.monotonic() - began)
    finally:
        cluster.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", type=float, default=3.0)
    parser.add_argument("--ramp", type=float, default=0.5)
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nvmeof-bench-rbd-") as tmp:
        work = Path(tmp)
        cluster = CephCluster(work / "ceph")
        cluster.start()
        try:
            cluster.rbd("create", "--size", f"{SIZE >> 20}M", f"{cluster.pool}/bench")
            # Every object exists before anything is measured, so reads are real reads on every side.
            cluster.rbd("bench", "--io-type", "write", "--io-size", "4M", "--io-total", f"{SIZE >> 20}M",
                        "--io-pattern", "seq", f"{cluster.pool}/bench")
            baseline = {
                "4k-randwrite-qd32": librbd_rate(cluster.conf, cluster.pool, "bench", write=True, runtime=args.runtime),
                "4k-randread-qd32": librbd_rate(cluster.conf, cluster.pool, "bench", write=False, runtime=args.runtime),
            }
            disks = work / "disks"
            disks.mkdir()
            (disks / "bench.img").write_bytes(os.urandom(1 << 20) * (SIZE >> 20))  # in the page cache now
            config = {"version": 1, "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
                {"nsid": 1, "backend": "ram", "size": SIZE},
                {"nsid": 2, "backend": "file", "path": str(disks / "bench.img")},
                {"nsid": 3, "backend": "rbd", "pool": cluster.pool, "image": "bench"},
            ]}]}  # fmt: skip
            cfg = work / "config.json"
            cfg.write_text(json.dumps(config))
            io_port = free_port()
            cmd = [sys.executable, "-m", "nvmeof.cli", "serve", "--api", "none", "--config", str(cfg),
                   "--listen", f"tcp://127.0.0.1:{io_port}", "--discovery", f"tcp://127.0.0.1:{free_port()}",
                   "--backing-dir", str(disks), "--ceph-conf", str(cluster.conf)]
            results: dict[str, dict[str, Any]] = {}
            with running(cmd, io_port, "nvmeof serve") as proc:
                for nsid, kind in NAMESPACES:
                    for row in ROWS:
                        print(f"{kind}: {row.name}", file=sys.stderr, flush=True)
                        results[f"{kind}/{row.name}"] = run_bench(
                            row, io_port, proc.pid, runtime=args.runtime, ramp=args.ramp, numjobs=1,
                            nsid=nsid, nqn=NQN)
        finally:
            cluster.stop()
    print(f"machine: {machine()}; {args.runtime:g} s + {args.ramp:g} s ramp per row, one job")
    print("librbd from Python (aio, 32 in flight): "
          + ", ".join(f"{name} {rate:.0f} IOPS" for name, rate in baseline.items()))
    print("| job | backend | IOPS | MiB/s | mean lat µs | target µs/IO | initiator µs/IO | vs librbd |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in ROWS:
        for _, kind in NAMESPACES:
            got = results[f"{kind}/{row.name}"]
            ratio = f"{got['iops'] / baseline[row.name]:.2f}x" if kind == "rbd" and row.name in baseline else ""
            print(f"| {row.name} | {kind} | {got['iops']:.0f} | {got['bw_bytes'] / 2**20:.1f} | "
                  f"{got['mean_lat_ns'] / 1000:.1f} | {got['target_cpu_us_per_io']:.1f} | "
                  f"{got['initiator_cpu_us_per_io']:.1f} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "baseline_librbd_iops": baseline,
                                         "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
