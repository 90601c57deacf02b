#!/usr/bin/env python3
"""A/B of two trees: the benchmarks/run.py matrix for both, row by row, interleaved, with b/a ratios.

    python3 benchmarks/ab.py --a /path/to/before --b /path/to/after            # 2 rounds, 3 s per row
    python3 benchmarks/ab.py --a OLD --b NEW --rounds 3 --seconds 5 --json ab.json
    python3 benchmarks/ab.py --a . --b . --b-serve-arg=--poll-us=20             # one tree, two settings

Each measurement is one `benchmarks/run.py --tree TREE --only ROW` process of *this* checkout (so both
trees are measured by the same harness and baselines; PYTHONPATH is the measured tree alone), with
its own `nvmeof serve` and raw baseline. Rows are interleaved A B, then B A, round after round, so
both trees see the same background load as nearly as possible. The summary gives medians per tree
and b/a for IOPS, mean latency and CPU per I/O, and each tree's ratio to the raw baseline measured
in the same process (throughput at QD > 1, latency at QD1): the figure least moved by the load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import machine, set_tree

RUN = Path(__file__).resolve().parent / "run.py"
FIGURES = (("iops", "IOPS", ".0f", 1.0), ("mean_lat_ns", "mean lat µs", ".1f", 1e3),
           ("target_cpu_us_per_io", "target µs/IO", ".1f", 1.0),
           ("initiator_cpu_us_per_io", "initiator µs/IO", ".1f", 1.0),
           ("loop_lag_max_us", "max loop lag µs", ".0f", 1.0),
           ("loop_lag_own_us", "own loop lag µs", ".0f", 1.0))


def row_names() -> list[str]:
    from run import MATRIX

    return [j.name for j in MATRIX]


def run_one(tree: Path, row: str, args: argparse.Namespace, serve_args: list[str], bench_args: list[str],
            out: Path) -> dict[str, Any]:
    """One run.py process for ``row`` against ``tree``; its one result entry."""
    cmd = [sys.executable, str(RUN), "--tree", str(tree), "--only", row, "--runtime", str(args.seconds),
           "--ramp", str(args.ramp), "--ramdisk-size", args.ramdisk_size, "--poll-us", str(args.poll_us),
           "--json", str(out), *(["--pin", args.pin] if args.pin else []),
           *(f"--serve-arg={a}" for a in serve_args), *(f"--bench-arg={a}" for a in bench_args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds * 8 + 300)
    if proc.returncode != 0:
        raise SystemExit(f"run.py failed for {row} on {tree} (status {proc.returncode}):\n{proc.stderr}")
    return json.loads(out.read_text())["results"][0]


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _base_ratio(entry: dict[str, Any]) -> float | None:
    return entry.get("latency_ratio") if entry.get("iodepth") == 1 else entry.get("throughput_ratio")


def summarize(name: str, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per tree and b/a for one row, from its run.py result entries (skipped ones say why)."""
    out: dict[str, Any] = {"name": name}
    for side, runs in (("a", a), ("b", b)):
        skipped = [r["skipped"] for r in runs if r.get("skipped")]
        if skipped:
            out[f"{side}_skipped"] = skipped[0]
    done_a = [r for r in a if not r.get("skipped")]
    done_b = [r for r in b if not r.get("skipped")]
    for key, *_ in FIGURES:
        each_a = [r["nvmeof"].get(key) for r in done_a]
        each_b = [r["nvmeof"].get(key) for r in done_b]
        ma, mb = _median(each_a), _median(each_b)
        out[key] = {"a": ma, "b": mb, "b/a": mb / ma if ma and mb is not None else None,
                    "a_each": each_a, "b_each": each_b}
    ra, rb = _median([_base_ratio(r) for r in done_a]), _median([_base_ratio(r) for r in done_b])
    qd1 = any(r.get("iodepth") == 1 for r in a + b)
    out["vs_baseline"] = {"a": ra, "b": rb, "kind": "latency" if qd1 else "throughput"}
    return out


def _fmt(v: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v / scale, fmt)


def print_summary(rows: list[dict[str, Any]]) -> None:
    print("| row | " + " | ".join(f"{label} A → B (b/a)" for _, label, _, _ in FIGURES) + " | vs raw baseline A → B |")
    print("|---|" + "---:|" * (len(FIGURES) + 1))
    for r in rows:
        cells = []
        for key, _, fmt, scale in FIGURES:
            f = r[key]
            cells.append(f"{_fmt(f['a'], fmt, scale)} → {_fmt(f['b'], fmt, scale)} ({_fmt(f['b/a'], '.2f')})")
        vb = r["vs_baseline"]
        cells.append(f"{_fmt(vb['a'], '.2f')} → {_fmt(vb['b'], '.2f')} ({vb['kind']})")
        print(f"| {r['name']} | " + " | ".join(cells) + " |")
    for r in rows:
        worst = {(key, side): max((v for v in r[key][f"{side}_each"] if v is not None), default=None)
                 for key in ("loop_lag_max_us", "loop_lag_own_us") for side in ("a", "b")}
        if any(v is not None for v in worst.values()):
            print(f"{r['name']}: worst loop lag over all rounds (own part) A "
                  f"{_fmt(worst['loop_lag_max_us', 'a'], '.0f')} ({_fmt(worst['loop_lag_own_us', 'a'], '.0f')}) µs, "
                  f"B {_fmt(worst['loop_lag_max_us', 'b'], '.0f')} ({_fmt(worst['loop_lag_own_us', 'b'], '.0f')}) µs")
        for side in ("a", "b"):
            if r.get(f"{side}_skipped"):
                print(f"{r['name']}: skipped in {side.upper()}: {r[f'{side}_skipped']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="tree A (before)")
    ap.add_argument("--b", type=Path, required=True, help="tree B (after)")
    ap.add_argument("--rounds", type=int, default=2, help="measurements per row and tree (default 2)")
    ap.add_argument("--seconds", "--runtime", type=float, default=3.0, help="measured seconds per row (default 3)")
    ap.add_argument("--ramp", type=float, default=0.5)
    ap.add_argument("--ramdisk-size", default="256M")
    ap.add_argument("--poll-us", type=int, default=100)
    ap.add_argument("--pin", metavar="SERVER_CPUS:CLIENT_CPUS", help="run.py --pin, e.g. 0:1")
    ap.add_argument("--only", action="append", metavar="NAME", help="rows to run (repeatable; default all)")
    for side in ("a", "b"):
        ap.add_argument(f"--{side}-serve-arg", action="append", default=[], metavar="ARG",
                        help=f"extra nvmeof serve argument for tree {side.upper()} (repeatable)")
        ap.add_argument(f"--{side}-bench-arg", action="append", default=[], metavar="ARG",
                        help=f"extra nvmeof bench argument for tree {side.upper()} (repeatable)")
    ap.add_argument("--json", type=Path, help="write every measurement and the summary here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    for tree in (args.a, args.b):
        set_tree(tree)   # refuses a path that is no checkout of this project
    names = row_names()
    rows = args.only or names
    unknown = set(rows) - set(names)
    if unknown:
        ap.error(f"unknown --only row(s) {', '.join(sorted(unknown))}; rows: {', '.join(names)}")
    trees = {"a": (args.a.resolve(), args.a_serve_arg, args.a_bench_arg),
             "b": (args.b.resolve(), args.b_serve_arg, args.b_bench_arg)}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {row: {"a": [], "b": []} for row in rows}
    with tempfile.TemporaryDirectory(prefix="nvmeof-ab-") as tmp:
        step = 0
        for rnd in range(args.rounds):
            for i, row in enumerate(rows):
                order = ("a", "b") if (rnd + i) % 2 == 0 else ("b", "a")
                for side in order:
                    tree, serve_args, bench_args = trees[side]
                    print(f"round {rnd + 1}/{args.rounds}: {row} on {side.upper()} ({tree})",
                          file=sys.stderr, flush=True)
                    step += 1
                    runs[row][side].append(run_one(tree, row, args, serve_args, bench_args,
                                                   Path(tmp) / f"{step}.json"))
    summary = [summarize(row, runs[row]["a"], runs[row]["b"]) for row in rows]
    print(f"A: {trees['a'][0]} {' '.join(trees['a'][1] + trees['a'][2])}".rstrip())
    print(f"B: {trees['b'][0]} {' '.join(trees['b'][1] + trees['b'][2])}".rstrip())
    print(f"machine: {machine()}; {args.rounds} round(s) per tree, {args.seconds:g} s + {args.ramp:g} s ramp "
          "per row; medians")
    print_summary(summary)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": runs, "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
