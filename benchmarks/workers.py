#!/usr/bin/env python3
"""`nvmeof serve --workers N` for several N in one run, through `nvmeof bench` with 2 client processes.

For each round and each worker count: start ``nvmeof serve --api none --workers W`` with a RAM disk,
run every row with ``nvmeof bench --numjobs J --nr-io-queues Q --group_reporting`` (J client
processes, one controller each; target CPU measured over the serve process and its live
descendants, i.e. the workers), stop the target. Worker counts alternate within a round so both
see the same background load as far as possible. The end says how IOPS scale from the first count
to the others, and projects beyond the machine from the target's CPU per I/O (one core serves at
most 1e6 / (µs per I/O) I/Os per second, so N worker cores N times that while clients have cores
of their own).

    python3 benchmarks/workers.py                      # 2 rounds, workers 1 and 2, 3 s per row
    python3 benchmarks/workers.py --workers 0 --workers 2 --rounds 3 --runtime 5 --json out.json
    python3 benchmarks/workers.py --tree /path/to/other/checkout --serve-arg=--poll-us=50
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from harness import Row, machine, run_bench, serving, set_tree

ROWS = (
    Row("4k-randread-qd32", "randread", 4096, 32),
    Row("4k-randwrite-qd32", "randwrite", 4096, 32),
    Row("128k-read-qd8", "read", 131072, 8),
)


def run_target(workers: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    with serving(args.ramdisk_size, workers=workers, extra_args=tuple(args.serve_arg or ())) as (target, port):
        return {row.name: run_bench(row, port, target.pid, runtime=args.runtime, ramp=args.ramp,
                                    numjobs=args.numjobs, nr_io_queues=args.nr_io_queues) for row in ROWS}


def _median(runs: list[dict[str, dict[str, Any]]], row: str, key: str) -> float | None:
    vals = [r[row][key] for r in runs if r[row][key] is not None]
    return statistics.median(vals) if vals else None


def scaling(runs: dict[int, list[dict[str, dict[str, Any]]]], counts: list[int]) -> list[str]:
    """Per row: IOPS of every worker count relative to the first, and the per-core projection."""
    lines = []
    first = counts[0]
    for row in ROWS:
        base = _median(runs[first], row.name, "iops")
        parts = []
        for w in counts[1:]:
            iops = _median(runs[w], row.name, "iops")
            parts.append(f"{w} workers {iops / base:.2f}x" if base and iops is not None else f"{w} workers -")
        last = counts[-1]
        us = _median(runs[last], row.name, "target_cpu_us_per_io")
        proj = (f"; target {us:.1f} µs/IO at --workers {last}: one core serves at most {1e6 / us:.0f} IOPS, "
                f"N worker cores about N x that with clients on other cores") if us else ""
        lines.append(f"{row.name}: IOPS vs --workers {first}: {', '.join(parts) or '-'}{proj}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, action="append", help="worker counts to compare (default 1 and 2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runtime", "--seconds", type=float, default=3.0)
    parser.add_argument("--ramp", type=float, default=0.5)
    parser.add_argument("--numjobs", type=int, default=2)
    parser.add_argument("--nr-io-queues", type=int, default=2)
    parser.add_argument("--ramdisk-size", default="256M")
    parser.add_argument("--tree", type=Path, help="measure this checkout's nvmeof (default: this one)")
    parser.add_argument("--serve-arg", action="append", metavar="ARG", help="extra nvmeof serve argument")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args(argv)
    set_tree(args.tree)
    counts = args.workers or [1, 2]
    runs: dict[int, list[dict[str, dict[str, Any]]]] = {w: [] for w in counts}
    for rnd in range(args.rounds):
        for w in counts if rnd % 2 == 0 else list(reversed(counts)):
            print(f"round {rnd + 1}: --workers {w}", file=sys.stderr, flush=True)
            runs[w].append(run_target(w, args))
    print(f"machine: {machine()}; tree {harness.TREE}; {args.rounds} round(s), {args.runtime:g} s + {args.ramp:g} s "
          f"ramp per row, --numjobs {args.numjobs} --nr-io-queues {args.nr_io_queues}; medians")
    print("| job | workers | IOPS | MiB/s | mean lat µs | target µs/IO | initiator µs/IO | IOPS per round |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for row in ROWS:
        for w in counts:
            got = [r[row.name] for r in runs[w]]

            def med(key: str, got: list[dict[str, Any]] = got) -> float:
                vals = [g[key] for g in got if g[key] is not None]
                return statistics.median(vals) if vals else float("nan")

            each = ", ".join(f"{g['iops']:.0f}" for g in got)
            print(f"| {row.name} | {w} | {med('iops'):.0f} | {med('bw_bytes') / 2**20:.1f} | "
                  f"{med('mean_lat_ns') / 1000:.1f} | {med('target_cpu_us_per_io'):.1f} | "
                  f"{med('initiator_cpu_us_per_io'):.1f} | {each} |")
    print()
    for line in scaling(runs, counts):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": {str(w): r for w, r in runs.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
