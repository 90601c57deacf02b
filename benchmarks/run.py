"""The benchmark matrix: `nvmeof bench` against `nvmeof serve` (RAM disk) and a raw TCP baseline.

    python3 benchmarks/run.py                  # a few seconds per row
    python3 benchmarks/run.py --runtime 10 --json results.json

Starts ``nvmeof serve`` and the baseline echo server (benchmarks/baseline.py) as subprocesses on
free loopback ports, runs each row of the matrix through ``nvmeof bench --output-format json``
(with ``--target-pid`` so the target's CPU per I/O is measured) and the same traffic through the
baseline client, prints each result with its ratio to the baseline, and checks the issue-6 goals.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Row, free_port, machine, run_bench, run_json, running, serving

BASELINE = Path(__file__).resolve().parent / "baseline.py"

MATRIX = (
    Row("4k-randread-qd1", "randread", 4096, 1),
    Row("4k-randread-qd32", "randread", 4096, 32),
    Row("4k-randwrite-qd32", "randwrite", 4096, 32),
    Row("128k-read-qd8", "read", 131072, 8),
    Row("128k-write-qd8", "write", 131072, 8),
)

GOAL_SEQ_READ_RATIO = 0.70
GOAL_CPU_US = 10.0
GOAL_QD1_LAT_RATIO = 3.0


@contextmanager
def baseline_server() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """The raw TCP echo server (benchmarks/baseline.py) on a free loopback port, once it listens."""
    port = free_port()
    with running([sys.executable, str(BASELINE), "serve", "--port", str(port)], port, "baseline server") as raw:
        yield raw, port


def run_baseline(row: Row, port: int, server_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(BASELINE), "client", "--port", str(port), "--rw", row.rw, "--bs", str(row.bs),
           "--iodepth", str(row.iodepth), "--runtime", str(args.runtime), "--ramp", str(args.ramp),
           "--server-pid", str(server_pid)]
    return run_json(cmd, f"baseline client failed for {row.name}", args.runtime * 4 + 60)


def fmt_rate(bw: float) -> str:
    return f"{bw / (1 << 20):.1f}"


def print_table(results: list[dict[str, Any]]) -> None:
    headers = ("job", "IOPS", "MiB/s", "lat us", "tgt us/IO", "ini us/IO", "raw IOPS", "raw MiB/s",
               "raw lat us", "tput ratio", "lat ratio")
    rows = []
    for r in results:
        b, n = r["baseline"], r["nvmeof"]
        rows.append((
            r["name"], f"{n['iops']:.0f}", fmt_rate(n["bw_bytes"]), f"{n['mean_lat_ns'] / 1e3:.1f}",
            "-" if n["target_cpu_us_per_io"] is None else f"{n['target_cpu_us_per_io']:.1f}",
            f"{n['initiator_cpu_us_per_io']:.1f}", f"{b['iops']:.0f}", fmt_rate(b["bw_bytes"]),
            f"{b['mean_lat_ns'] / 1e3:.1f}", f"{r['throughput_ratio']:.2f}", f"{r['latency_ratio']:.2f}",
        ))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def goals(by_name: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    seq = by_name.get("128k-read-qd8")
    if seq:
        ratio = seq["throughput_ratio"]
        out.append({"goal": f"128K seq read >= {GOAL_SEQ_READ_RATIO:.0%} of raw TCP throughput",
                    "met": ratio >= GOAL_SEQ_READ_RATIO,
                    "figures": f"{fmt_rate(seq['nvmeof']['bw_bytes'])} vs {fmt_rate(seq['baseline']['bw_bytes'])} "
                               f"MiB/s = {ratio:.0%}"})
    rr = by_name.get("4k-randread-qd32")
    if rr:
        t = rr["nvmeof"]["target_cpu_us_per_io"]
        i = rr["nvmeof"]["initiator_cpu_us_per_io"]
        out.append({"goal": f"4K randread QD32 target CPU <= {GOAL_CPU_US:.0f} us/IO",
                    "met": t is not None and t <= GOAL_CPU_US, "figures": f"{t:.1f} us/IO" if t is not None else "n/a"})
        out.append({"goal": f"4K randread QD32 initiator CPU <= {GOAL_CPU_US:.0f} us/IO",
                    "met": i <= GOAL_CPU_US, "figures": f"{i:.1f} us/IO"})
    qd1 = by_name.get("4k-randread-qd1")
    if qd1:
        ratio = qd1["nvmeof"]["mean_lat_ns"] / qd1["baseline"]["mean_lat_ns"]
        out.append({"goal": f"4K randread QD1 mean latency <= {GOAL_QD1_LAT_RATIO:.0f}x raw TCP round trip",
                    "met": ratio <= GOAL_QD1_LAT_RATIO,
                    "figures": f"{qd1['nvmeof']['mean_lat_ns'] / 1e3:.1f} us vs "
                               f"{qd1['baseline']['mean_lat_ns'] / 1e3:.1f} us = {ratio:.2f}x"})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=float, default=3.0, help="measured seconds per row (default 3)")
    ap.add_argument("--ramp", type=float, default=0.5, help="unmeasured warm-up seconds per row (default 0.5)")
    ap.add_argument("--ramdisk-size", default="256M", help="RAM disk size for nvmeof serve (default 256M)")
    ap.add_argument("--numjobs", type=int, default=1, help="nvmeof bench --numjobs (default 1)")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help=f"run only these rows (repeatable): {', '.join(r.name for r in MATRIX)}")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write all results as JSON to FILE")
    args = ap.parse_args(argv)
    rows = [r for r in MATRIX if not args.only or r.name in args.only]
    if args.only and len(rows) != len(set(args.only)):
        unknown = set(args.only) - {r.name for r in MATRIX}
        ap.error(f"unknown --only row(s) {', '.join(sorted(unknown))}")

    results: list[dict[str, Any]] = []
    with serving(args.ramdisk_size, log_level="warning") as (target, io_port), baseline_server() as (raw, raw_port):
        for row in rows:
            print(f"running {row.name} ...", file=sys.stderr, flush=True)
            base = run_baseline(row, raw_port, raw.pid, args)
            ours = run_bench(row, io_port, target.pid, runtime=args.runtime, ramp=args.ramp, numjobs=args.numjobs)
            results.append({
                "name": row.name, "rw": row.rw, "bs": row.bs, "iodepth": row.iodepth,
                "nvmeof": ours, "baseline": base,
                "throughput_ratio": ours["bw_bytes"] / base["bw_bytes"] if base["bw_bytes"] else 0.0,
                "latency_ratio": ours["mean_lat_ns"] / base["mean_lat_ns"] if base["mean_lat_ns"] else 0.0,
            })
    info = machine()
    print(f"machine: {info['cpus']} CPUs, {info['cpu_model']}, Python {info['python']} ({info['event_loop']}), "
          f"kernel {info['kernel']}; runtime {args.runtime:g} s + ramp {args.ramp:g} s per row")
    print_table(results)
    checks = goals({r["name"]: r for r in results})
    print()
    for g in checks:
        print(f"[{'met' if g['met'] else 'MISSED'}] {g['goal']}: {g['figures']}")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "runtime_s": args.runtime, "ramp_s": args.ramp,
                                         "results": results, "goals": checks}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
