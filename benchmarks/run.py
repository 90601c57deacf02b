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
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASELINE = Path(__file__).resolve().parent / "baseline.py"


@dataclass(frozen=True)
class Row:
    name: str
    rw: str
    bs: int
    iodepth: int


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode} before listening on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not listen on port {port} within {timeout:.0f} s")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "kernel": platform.release(), "event_loop": loop}


def run_bench(row: Row, port: int, target_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "nvmeof.cli", "bench", "-a", "127.0.0.1", "-s", str(port),
           "--name", row.name, "--rw", row.rw, "--bs", str(row.bs), "--iodepth", str(row.iodepth),
           "--runtime", str(args.runtime), "--time_based", "--ramp_time", str(args.ramp),
           "--numjobs", str(args.numjobs), "--group_reporting",
           "--output-format", "json", "--eta", "never", "--target-pid", str(target_pid)]
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=args.runtime * 4 + 120)
    if out.returncode != 0:
        raise SystemExit(f"nvmeof bench failed for {row.name} (status {out.returncode}):\n{out.stderr}")
    report = json.loads(out.stdout)
    job = report["jobs"][0]
    d = job["read"] if "read" in row.rw else job["write"]
    return {
        "iops": d["iops"], "bw_bytes": d["bw_bytes"], "mean_lat_ns": d["clat_ns"]["mean"],
        "p99_ns": d["clat_ns"].get("percentile", {}).get("99.000000"), "total_ios": d["total_ios"],
        "runtime_ms": d["runtime"], "target_cpu_us_per_io": report["cpu_us_per_io"]["target"],
        "initiator_cpu_us_per_io": report["cpu_us_per_io"]["initiator"],
    }


def run_baseline(row: Row, port: int, server_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(BASELINE), "client", "--port", str(port), "--rw", row.rw, "--bs", str(row.bs),
           "--iodepth", str(row.iodepth), "--runtime", str(args.runtime), "--ramp", str(args.ramp),
           "--server-pid", str(server_pid)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.runtime * 4 + 60)
    if out.returncode != 0:
        raise SystemExit(f"baseline client failed for {row.name} (status {out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout)


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


def stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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

    io_port, disc_port, raw_port = free_port(), free_port(), free_port()
    target = subprocess.Popen(
        [sys.executable, "-m", "nvmeof.cli", "--log-level", "warning", "serve", "--api", "none",
         "--listen", f"tcp://127.0.0.1:{io_port}", "--discovery", f"tcp://127.0.0.1:{disc_port}",
         "--ramdisk-size", args.ramdisk_size], env=env(), stdout=subprocess.DEVNULL)
    raw = subprocess.Popen([sys.executable, str(BASELINE), "serve", "--port", str(raw_port)],
                           stdout=subprocess.DEVNULL)
    results: list[dict[str, Any]] = []
    try:
        wait_port(io_port, target, "nvmeof serve")
        wait_port(raw_port, raw, "baseline server")
        for row in rows:
            print(f"running {row.name} ...", file=sys.stderr, flush=True)
            base = run_baseline(row, raw_port, raw.pid, args)
            ours = run_bench(row, io_port, target.pid, args)
            results.append({
                "name": row.name, "rw": row.rw, "bs": row.bs, "iodepth": row.iodepth,
                "nvmeof": ours, "baseline": base,
                "throughput_ratio": ours["bw_bytes"] / base["bw_bytes"] if base["bw_bytes"] else 0.0,
                "latency_ratio": ours["mean_lat_ns"] / base["mean_lat_ns"] if base["mean_lat_ns"] else 0.0,
            })
    finally:
        stop(target)
        stop(raw)
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
