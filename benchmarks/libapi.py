#!/usr/bin/env python3
"""The library API against the bench's own path: initiator CPU per I/O of both, and their ratio (issue 26).

For each round: start one ``nvmeof serve --api none`` with a RAM disk, then against that same target
run (a) ``nvmeof bench`` 4K random read at QD32 (the batch engine's callback path) and (b) this
script's ``client``: one ``HostController`` (``initiator.connect``), 32 asyncio tasks each looping
``await ctrl.read(nsid, slba, nlb, buf=...)`` (``--rw randwrite``: ``ctrl.write`` and a bench of random
writes) at random 4K-aligned LBAs, for the same ramp and
runtime. Both report process CPU (getrusage) over the measured window divided by the I/Os completed
in it. The order of (a) and (b) alternates round after round. Goal: (b) / (a) <= 1.5.

    python3 benchmarks/libapi.py                              # 3 rounds, 3 s + 0.5 s ramp each
    python3 benchmarks/libapi.py --pin 0:1 --json out.json    # target on CPU 0, clients on CPU 1
    python3 benchmarks/libapi.py --tree /work/main            # measure another checkout's library
    python3 benchmarks/libapi.py client --port 4420 --runtime 3 --ramp 0.5     # (b) alone
    python3 benchmarks/libapi.py client ... --profile out.prof                 # (b) under cProfile

``--tree`` puts that checkout alone on PYTHONPATH for the target, the bench and the client (the client
code is this file; it uses nothing but ``initiator.connect`` and ``HostController.read``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

GOAL_RATIO = 1.5


# ---- (b): the library client, run in its own process ------------------------------------------------

def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def library_client(host: str, port: int, nqn: str | None, nsid: int, bs: int, tasks: int,
                         runtime: float, ramp: float, seed: int, write: bool = False) -> dict[str, Any]:
    import initiator

    kwargs: dict[str, Any] = {"subnqn": nqn} if nqn else {}
    ctrl = await initiator.connect(host, port, **kwargs)
    try:
        geo = await ctrl.namespace_geometry(nsid)
        nlb = bs // geo.block_size
        units = geo.nsze // nlb
        rng = random.Random(seed)
        clock = time.perf_counter_ns
        t_start = clock()
        mstart = t_start + int(ramp * 1e9)
        deadline = mstart + int(runtime * 1e9)
        counted = [0]
        lat_sum = [0]
        cpu0 = [0.0]
        last = [mstart]

        def measure_start() -> None:
            cpu0[0] = _cpu()

        async def worker() -> None:
            buf = bytearray(bs)
            read, rand = ctrl.read, rng.random
            write_ = ctrl.write
            n = 0
            lat = 0
            while True:
                t0 = clock()
                if t0 >= deadline:
                    break
                if write:
                    await write_(nsid, int(rand() * units) * nlb, buf)
                else:
                    await read(nsid, int(rand() * units) * nlb, nlb, buf=buf)
                if t0 >= mstart:
                    t1 = clock()
                    n += 1
                    lat += t1 - t0
                    if t1 > last[0]:
                        last[0] = t1
            counted[0] += n
            lat_sum[0] += lat

        loop = asyncio.get_running_loop()
        timer = loop.call_later(ramp, measure_start) if ramp else None
        if timer is None:
            measure_start()
        await asyncio.gather(*(worker() for _ in range(tasks)))
        cpu = _cpu() - cpu0[0]
    finally:
        await ctrl.disconnect()
    ios = counted[0]
    secs = max(last[0] - mstart, 1) / 1e9
    return {"ios": ios, "iops": ios / secs, "mean_lat_ns": lat_sum[0] / ios if ios else None,
            "initiator_cpu_us_per_io": cpu * 1e6 / ios if ios else None, "cpu_s": cpu}


def client_main(args: argparse.Namespace) -> int:
    coro = library_client(args.host, args.port, args.nqn, args.nsid, args.bs, args.tasks, args.runtime,
                          args.ramp, args.seed, args.rw == "randwrite")
    try:
        import uvloop  # the loop `nvmeof bench` runs on when installed (nvmeof/cli/commands/common.py)
        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        out = runner(coro)
        prof.disable()
        prof.dump_stats(args.profile)
    else:
        out = runner(coro)
    print(json.dumps(out))
    return 0


# ---- the comparison ------------------------------------------------------------------------------

def run_client(port: int, args: argparse.Namespace) -> dict[str, Any]:
    from harness import run_json

    cmd = [sys.executable, str(Path(__file__).resolve()), "client", "--port", str(port), "--runtime",
           str(args.runtime), "--ramp", str(args.ramp), "--tasks", str(args.tasks), "--rw", args.rw]
    return run_json(cmd, "library client failed", args.runtime * 4 + 60)


def goal_line(rounds: list[dict[str, Any]]) -> str:
    """The verdict over the rounds' ratios (library / bench initiator CPU per I/O): their median against
    GOAL_RATIO; a round without a ratio (no I/O completed) makes it MISSED."""
    ratios = [r.get("ratio") for r in rounds]
    if not ratios or any(x is None for x in ratios):
        return "[MISSED] library API initiator CPU per I/O: a round completed no I/O"
    med = statistics.median(ratios)
    status = "met" if med <= GOAL_RATIO else "MISSED"
    return (f"[{status}] library API initiator CPU per I/O <= {GOAL_RATIO:g}x the bench's: median ratio {med:.2f} "
            f"(rounds: {', '.join(format(x, '.2f') for x in ratios)})")


def compare_main(args: argparse.Namespace) -> int:
    import harness
    from harness import Row, machine, run_bench, serving, set_pinning, set_tree

    set_tree(args.tree)
    if args.pin:
        from run import parse_pin

        server, client = parse_pin(args.pin, argparse.ArgumentParser(prog="libapi.py"))
        set_pinning(server, client)
    row = Row(f"4k-{args.rw}-qd{args.tasks}", args.rw, 4096, args.tasks)
    rounds = []
    for i in range(args.rounds):
        with serving(args.ramdisk_size) as (target, port):
            entry: dict[str, Any] = {}
            order = ("bench", "library") if i % 2 == 0 else ("library", "bench")
            for what in order:
                if what == "bench":
                    entry["bench"] = run_bench(row, port, target.pid, runtime=args.runtime, ramp=args.ramp,
                                               numjobs=1)
                else:
                    entry["library"] = run_client(port, args)
        b, lib = entry["bench"]["initiator_cpu_us_per_io"], entry["library"]["initiator_cpu_us_per_io"]
        entry["ratio"] = lib / b if b and lib else None
        rounds.append(entry)
        print(f"round {i + 1}: bench {entry['bench']['iops']:,.0f} IOPS {b or 0:.1f} µs/IO; library "
              f"{entry['library']['iops']:,.0f} IOPS {lib or 0:.1f} µs/IO; ratio {entry['ratio'] or 0:.2f}",
              flush=True)
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    med = statistics.median(ratios) if ratios else None
    info = machine() | {"tree": str(harness.TREE), "pin": args.pin}
    print(f"machine: {info['cpus']} CPUs, {info['cpu_model']}, Python {info['python']} ({info['event_loop']}); "
          f"tree {info['tree']}; {args.runtime:g} s + ramp {args.ramp:g} s"
          + (f"; pinned {args.pin}" if args.pin else ""))
    call = "write" if args.rw == "randwrite" else "read"
    for key, label in (("bench", "nvmeof bench (callback path)"), ("library", f"{args.tasks} tasks x ctrl.{call}")):
        iops = statistics.median(r[key]["iops"] for r in rounds)
        cpu = statistics.median(r[key]["initiator_cpu_us_per_io"] or 0.0 for r in rounds)
        print(f"  {label:32} {iops:>10,.0f} IOPS  {cpu:6.1f} µs/IO initiator (medians)")
    print(goal_line(rounds))
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "runtime_s": args.runtime, "ramp_s": args.ramp,
                                         "rounds": rounds, "median_ratio": med, "goal": GOAL_RATIO}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["client"]:
        cp = argparse.ArgumentParser(prog="libapi.py client", description="(b) alone: prints one JSON object")
        cp.add_argument("--host", default="127.0.0.1")
        cp.add_argument("--port", type=int, required=True)
        cp.add_argument("--nqn")
        cp.add_argument("--nsid", type=int, default=1)
        cp.add_argument("--bs", type=int, default=4096)
        cp.add_argument("--rw", choices=["randread", "randwrite"], default="randread")
        cp.add_argument("--tasks", type=int, default=32)
        cp.add_argument("--runtime", type=float, default=3.0)
        cp.add_argument("--ramp", type=float, default=0.5)
        cp.add_argument("--seed", type=int, default=1)
        cp.add_argument("--profile", metavar="FILE", help="run under cProfile and dump the stats to FILE")
        return client_main(cp.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", "--seconds", type=float, default=3.0, help="measured seconds (default 3)")
    ap.add_argument("--ramp", type=float, default=0.5, help="unmeasured warm-up seconds (default 0.5)")
    ap.add_argument("--tasks", type=int, default=32, help="tasks of the library client = bench iodepth (32)")
    ap.add_argument("--rw", choices=["randread", "randwrite"], default="randread",
                    help="4K random reads (default) or writes, for both (a) and (b)")
    ap.add_argument("--ramdisk-size", default="256M")
    ap.add_argument("--tree", type=Path, help="measure this checkout (default: the one holding this script)")
    ap.add_argument("--pin", metavar="SERVER_CPUS:CLIENT_CPUS", help="e.g. 0:1 (default: not pinned)")
    ap.add_argument("--json", type=Path, metavar="FILE")
    return compare_main(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
