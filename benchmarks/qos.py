#!/usr/bin/env python3
"""QoS limits under load: a limited namespace holds its limit while an unlimited one on the same target keeps
its throughput, all in one run of one `nvmeof serve`.

    python3 benchmarks/qos.py                         # 4 s per measurement, 2 rounds, 500 IOPS and 20 MiB/s
    python3 benchmarks/qos.py --seconds 8 --rounds 3 --json qos.json

The target has two RAM namespaces: nsid 1 with a limit (set through the config file, as an operator would),
nsid 2 without. Per round, per case (an IOPS limit with 4 KiB random reads, a bandwidth limit with 128 KiB
reads): nsid 2 alone, nsid 1 alone, nsid 1 and nsid 2 at the same time (two `nvmeof bench` processes), nsid 2
alone again. Figures: limited IOPS or MiB/s over the limit, alone and beside the unlimited namespace (goal:
within 5 %); the unlimited namespace's throughput beside the limited one over the mean of its two runs alone
(goal: >= 0.9); and what one limited I/O costs the target while nsid 1 runs alone, from utime + stime (what
`nvmeof bench --target-pid` reports) and from the scheduler's runtime (schedstat), and as the slope of that
runtime between nsid 1 and nsid 3 (twice nsid 1's limit), which takes out each bench connection's fixed cost.
With `--pin 0:1` the target runs on CPU 0 and both bench processes on CPU 1: the limited namespace's target
work competes with the unlimited one's on CPU 0, and the two clients share CPU 1 (other work on the machine
lands on both). Each round line shows the load average before and after it: on a shared machine the unlimited
namespace's throughput alone moves more between runs than any effect measured here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import DEFAULT_NQN, Row, machine, parse_size, run_bench, serving, set_pinning, set_tree

CASES = (
    # (name, the limit for nsid 1, the bench row, the figure compared with the limit)
    ("iops", {"rw_ios_per_second": 500}, Row("4k-randread-qd32", "randread", 4096, 32)),
    ("bandwidth", {"rw_mbytes_per_second": 20}, Row("128k-read-qd8", "read", 131072, 8)),
)
MIB = 1 << 20


def _config(size: int, limit: dict[str, int]) -> dict[str, Any]:
    return {"version": 1, "subsystems": [{"nqn": DEFAULT_NQN, "allow_any_host": True, "namespaces": [
        {"nsid": 1, "backend": "ram", "size": size, "qos": limit},
        {"nsid": 2, "backend": "ram", "size": size},
        # twice nsid 1's limit: the slope between the two takes out each bench connection's fixed cost
        {"nsid": 3, "backend": "ram", "size": size, "qos": {key: 2 * value for key, value in limit.items()}},
    ]}]}  # fmt: skip


def _limit_value(limit: dict[str, int], figures: dict[str, Any]) -> tuple[float, float, str]:
    if "rw_ios_per_second" in limit:
        return figures["iops"], limit["rw_ios_per_second"], "IOPS"
    return figures["bw_bytes"] / MIB, limit["rw_mbytes_per_second"], "MiB/s"


def _run_ns(pid: int) -> int:
    """Nanoseconds ``pid`` (all its threads) ran, as the scheduler counts them (/proc/PID/task/*/schedstat).
    `nvmeof bench --target-pid` reads utime + stime, which this kernel samples at its tick (250 Hz): a process
    that wakes briefly, as the target of a limited namespace does every release, is charged whole ticks often
    enough to double its figure."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def _slope_us(ran: int, figures: dict[str, Any], ran_double: int, double: dict[str, Any], seconds: float) -> float:
    """Target run time per I/O between two runs at different limits: (ran2 - ran1) / (ios2 - ios1)."""
    extra_ios = (double["iops"] - figures["iops"]) * seconds
    return (ran_double - ran) / 1e3 / extra_ios if extra_ios > 0 else float("nan")


def measure(args: argparse.Namespace, name: str, limit: dict[str, int], row: Row) -> dict[str, Any]:
    size = parse_size(args.ramdisk_size)
    with tempfile.TemporaryDirectory(prefix="nvmeof-qos-") as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps(_config(size, limit)))
        with serving(args.ramdisk_size, extra_args=("--config", str(cfg))) as (proc, port):
            def bench(nsid: int) -> dict[str, Any]:
                return run_bench(row, port, proc.pid, runtime=args.seconds, ramp=args.ramp, numjobs=1, nsid=nsid)

            load_before = os.getloadavg()[0]
            alone_1 = bench(2)
            ran = _run_ns(proc.pid)
            limited_alone = bench(1)
            ran = _run_ns(proc.pid) - ran
            ran_double = _run_ns(proc.pid)
            double_alone = bench(3)
            ran_double = _run_ns(proc.pid) - ran_double
            with ThreadPoolExecutor(2) as pool:
                limited_f, beside_f = pool.submit(bench, 1), pool.submit(bench, 2)
                limited, beside = limited_f.result(), beside_f.result()
            alone_2 = bench(2)
            load_after = os.getloadavg()[0]
    got, want, unit = _limit_value(limit, limited)
    got_alone = _limit_value(limit, limited_alone)[0]
    # nsid 2 alone before and after the run beside nsid 1: the mean of both takes out a drift of the load
    alone = (alone_1["iops"] + alone_2["iops"]) / 2
    return {"case": name, "limit": want, "unit": unit, "limited": got, "limited_over_limit": got / want,
            "limited_alone_over_limit": got_alone / want,
            "unlimited_alone_iops": alone, "unlimited_alone_iops_each": [alone_1["iops"], alone_2["iops"]],
            "unlimited_beside_iops": beside["iops"],
            "unlimited_beside_over_alone": beside["iops"] / alone,
            "unlimited_alone_cpu_us_per_io": alone_1["target_cpu_us_per_io"],
            # while nsid 1 runs alone, the target's CPU is all its: what one limited I/O costs the target
            "limited_target_cpu_us_per_io": limited_alone["target_cpu_us_per_io"],
            "limited_initiator_cpu_us_per_io": limited_alone["initiator_cpu_us_per_io"],
            # the same from the scheduler's own count (ramp included; the target is idle while the bench starts)
            "limited_target_run_us_per_io": ran / 1e3 / (limited_alone["iops"] * (args.seconds + args.ramp)),
            # the same between nsid 1 and nsid 3 (twice the limit): what one more limited I/O costs, without
            # the fixed cost of a bench connection (its set-up, keep-alive, tear-down), which the figure above
            # spreads over the few I/Os a limit lets through
            "limited_target_slope_us_per_io": _slope_us(ran, limited_alone, ran_double, double_alone,
                                                        args.seconds + args.ramp),
            "limited_mean_lat_us": limited["mean_lat_ns"] / 1e3, "load_average": [load_before, load_after]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0, help="measured seconds per bench (default 4)")
    ap.add_argument("--ramp", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ramdisk-size", default="64M")
    ap.add_argument("--tree", help="measure this checkout's nvmeof (default: this one)")
    ap.add_argument("--pin", metavar="SERVER_CPUS:CLIENT_CPUS", help="bind the target and the clients, e.g. 0:1")
    ap.add_argument("--iops-limit", type=int, default=500, help="rw_ios_per_second of the IOPS case (default 500)")
    ap.add_argument("--mbytes-limit", type=int, default=20, help="rw_mbytes_per_second of the bandwidth case")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    set_tree(args.tree)
    if args.pin:
        server, _, client = args.pin.partition(":")
        set_pinning({int(c) for c in server.split(",") if c}, {int(c) for c in client.split(",") if c})
    cases = [(name, {key: args.iops_limit if key == "rw_ios_per_second" else args.mbytes_limit for key in limit}, row)
             for name, limit, row in CASES]
    runs = [measure(args, name, limit, row) for _ in range(args.rounds) for name, limit, row in cases]
    print(f"machine: {machine()}; {args.rounds} round(s), {args.seconds:g} s + {args.ramp:g} s ramp per bench; "
          "medians")
    for r in runs:
        print(f"  round {r['case']:<10} got/limit {r['limited_over_limit']:.3f} "
              f"(alone {r['limited_alone_over_limit']:.3f})"
              f"  nsid2 beside/alone {r['unlimited_beside_over_alone']:.3f} ({r['unlimited_beside_iops']:.0f} / "
              f"{'+'.join(f'{x:.0f}' for x in r['unlimited_alone_iops_each'])})  target us per limited I/O "
              f"{r['limited_target_cpu_us_per_io']:.1f} (ticks) {r['limited_target_run_us_per_io']:.1f} (ran) "
              f"{r['limited_target_slope_us_per_io']:.1f} (slope)  "
              f"load {r['load_average'][0]:.2f}-{r['load_average'][1]:.2f}")
    print(f"{'case':<10} {'limit':>12} {'alone/limit':>11} {'limited got':>12} {'got/limit':>9} {'nsid2 alone':>12} "
          f"{'nsid2 beside':>12} {'beside/alone':>12} {'tgt us/lim IO':>13} {'(ran)':>6} {'(slope)':>7}")
    summary = []
    for name, _limit, _row in cases:
        mine = [r for r in runs if r["case"] == name]

        def med(key: str, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[key] for r in mine)

        line = {"case": name, "limit": mine[0]["limit"], "unit": mine[0]["unit"],
                **{k: med(k) for k in ("limited", "limited_over_limit", "limited_alone_over_limit",
                                       "unlimited_alone_iops",
                                       "unlimited_beside_iops", "unlimited_beside_over_alone",
                                       "limited_target_cpu_us_per_io", "limited_target_run_us_per_io",
                                       "limited_target_slope_us_per_io",
                                       "limited_initiator_cpu_us_per_io")}}
        summary.append(line)
        print(f"{name:<10} {line['limit']:>6g} {line['unit']:<5} {line['limited_alone_over_limit']:>11.3f} "
              f"{line['limited']:>12.1f} "
              f"{line['limited_over_limit']:>9.3f} {line['unlimited_alone_iops']:>12.0f} "
              f"{line['unlimited_beside_iops']:>12.0f} {line['unlimited_beside_over_alone']:>12.3f} "
              f"{line['limited_target_cpu_us_per_io']:>13.1f} {line['limited_target_run_us_per_io']:>6.1f} "
              f"{line['limited_target_slope_us_per_io']:>7.1f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "runs": runs, "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
