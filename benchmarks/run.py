"""The benchmark matrix: `nvmeof bench` against `nvmeof serve` (RAM disk, a file in the page cache) and
raw TCP baselines measured in the same run, with the issue-12 goals checked at the end.

    python3 benchmarks/run.py                  # 3 s + 0.5 s ramp per row
    python3 benchmarks/run.py --seconds 10 --json results.json
    python3 benchmarks/run.py --tree /path/to/other/checkout --only 4k-randread-qd32

Starts ``nvmeof serve`` (nsid 1 a RAM disk, nsid 2 a file of the same size written just before, so in
the page cache), a second ``nvmeof serve --poll-us N`` for the polled QD1 row when the tree has that
option, a third ``nvmeof serve --inline-data-size 131072`` for the in-capsule 128 KiB rows (a write in
one capsule, no R2T: issue 26 part 2 judged there too), and the baselines of benchmarks/baseline.py as
subprocesses on free loopback ports. Each row
runs ``nvmeof bench --output-format json --target-pid ...`` in a fresh process and its baseline: the
asyncio echo pair with the same traffic, the QD1 ping-pong pair with the same polling, or (file rows)
the RAM row of the same shape. ``--tree`` measures another checkout's `nvmeof` with this script
(benchmarks/ab.py does that for two trees, row by row).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
import lagprobe
import tls as tlsbench
from harness import (
    Row,
    cli_supports,
    free_port,
    machine,
    run_bench,
    run_json,
    running,
    serving,
    set_pinning,
    set_tree,
)

BASELINE = Path(__file__).resolve().parent / "baseline.py"


@dataclass(frozen=True)
class Job:
    """A row of the matrix: what `nvmeof bench` runs, against which namespace, compared with what."""

    row: Row
    nsid: int = 1            # 1: the RAM disk, 2: the file in the page cache
    poll: bool = False       # `serve --poll-us N` and `bench --poll-us N`
    baseline: str = "stream"  # "stream" (asyncio echo pair), "pingpong" (QD1 pair, same polling), "ram:ROW",
    #                           "clear:ROW" (that row of this run: the same I/O in the clear)
    tls: bool = False        # over NVMe/TCP TLS 1.3 (SHA-256 PSK) to `serve --tls optional` (benchmarks/tls.py)
    inline: bool = False     # to `serve --inline-data-size INLINE_DATA_SIZE`: 128 KiB writes go in-capsule, no R2T

    @property
    def name(self) -> str:
        return self.row.name


MATRIX = (
    Job(Row("4k-randread-qd1", "randread", 4096, 1), baseline="pingpong"),
    Job(Row("4k-randread-qd1-poll", "randread", 4096, 1), poll=True, baseline="pingpong"),
    Job(Row("4k-randread-qd32", "randread", 4096, 32)),
    Job(Row("4k-randwrite-qd32", "randwrite", 4096, 32)),
    Job(Row("128k-read-qd8", "read", 131072, 8)),
    Job(Row("128k-write-qd8", "write", 131072, 8)),
    Job(Row("file-4k-randread-qd32", "randread", 4096, 32), nsid=2, baseline="ram:4k-randread-qd32"),
    Job(Row("file-4k-randwrite-qd32", "randwrite", 4096, 32), nsid=2, baseline="ram:4k-randwrite-qd32"),
    Job(Row("file-128k-read-qd8", "read", 131072, 8), nsid=2, baseline="ram:128k-read-qd8"),
    # issue 23: the TLS cost per I/O, next to the clear rows of the same run
    Job(Row("tls-4k-randread-qd32", "randread", 4096, 32), tls=True, baseline="clear:4k-randread-qd32"),
    Job(Row("tls-128k-read-qd8", "read", 131072, 8), tls=True, baseline="clear:128k-read-qd8"),
    Job(Row("tls-128k-write-qd8", "write", 131072, 8), tls=True, baseline="clear:128k-write-qd8"),
    # issue 26 part 2 again with the listener's in-capsule size at 128 KiB (nvmetcli's param_inline_data_size)
    Job(Row("inline-128k-read-qd8", "read", 131072, 8), inline=True),
    Job(Row("inline-128k-write-qd8", "write", 131072, 8), inline=True),
)
INLINE_DATA_SIZE = 131072   # the inline rows' listener: a whole 128 KiB write fits in its capsule
INLINE_LABEL = f"in-capsule (inline_data_size {INLINE_DATA_SIZE})"

# issue 12 "Goals", as issue 26 part 5 restates them
GOAL_TARGET_CPU_US = 5.0      # target CPU per 4 KiB random read at QD32
GOAL_INITIATOR_CPU_US = 7.0   # initiator CPU per 4 KiB random read at QD32
GOAL_RANDWRITE_RATIO = 1.2    # target CPU per 4 KiB random write at QD32 / per read
GOAL_POLL_LAT_RATIO = 1.5     # QD1 mean latency with --poll-us on both ends / raw ping-pong, same polling
GOAL_QD1_LAT_RATIO = 1.5      # QD1 mean latency without polling / raw ping-pong without polling
GOAL_SEQ_READ_RATIO = 0.90    # 128 KiB sequential read / raw baseline
# issue 26 "Large writes": 128 KiB sequential write QD8 next to the 128 KiB reads of the same run
GOAL_WRITE_CPU_RATIO = 1.10   # target CPU per byte of the writes / of the reads
GOAL_SEQ_WRITE_RATIO = 0.80   # 128 KiB sequential write / raw baseline
GOAL_FILE_WRITE_IOPS = 3 * 3600   # file-4k-randwrite-qd32: 3x the thread pool's 3.6k IOPS (issue 26)
GOAL_LOOP_STALL_US = 2000     # ... without the target's loop stalling longer (own part: lagprobe.py)


@contextmanager
def baseline_server(*, poll_us: int | None = None) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A baseline server of benchmarks/baseline.py on a free loopback port, once it listens: the
    asyncio echo server, or with ``poll_us`` (0 included) the ping-pong server polling that long."""
    port = free_port()
    if poll_us is None:
        cmd, what = [sys.executable, str(BASELINE), "serve", "--port", str(port)], "baseline server"
    else:
        cmd = [sys.executable, str(BASELINE), "pingserve", "--port", str(port), "--poll-us", str(poll_us)]
        what = f"ping-pong server --poll-us {poll_us}"
    with running(cmd, port, what) as raw:
        yield raw, port


def run_baseline(row: Row, port: int, server_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(BASELINE), "client", "--port", str(port), "--rw", row.rw, "--bs", str(row.bs),
           "--iodepth", str(row.iodepth), "--runtime", str(args.runtime), "--ramp", str(args.ramp),
           "--server-pid", str(server_pid)]
    return run_json(cmd, f"baseline client failed for {row.name}", args.runtime * 4 + 60)


def run_pingpong(row: Row, port: int, server_pid: int, poll_us: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(BASELINE), "pingpong", "--port", str(port), "--bs", str(row.bs),
           "--poll-us", str(poll_us), "--runtime", str(args.runtime), "--ramp", str(args.ramp),
           "--server-pid", str(server_pid)]
    return run_json(cmd, f"ping-pong client failed for {row.name}", args.runtime * 4 + 60)


def precondition(port: int, nsid: int = 1, extra: tuple[str, ...] = ()) -> None:
    """Write the whole namespace once, unmeasured, before its rows (fio users precondition likewise).

    A RAM disk is anonymous memory: the first write of each page costs the kernel a page fault and a
    zeroed page (~15 µs per 4 KiB on the VMs this runs on, more than the copy itself), and a read of a
    page never written maps the one shared zero page (cache-hot whatever the offset). Without this, a
    write row measures the kernel filling the disk and a read row reads one cached page."""
    cmd = [sys.executable, "-m", "nvmeof.cli", "bench", "-a", "127.0.0.1", "-s", str(port), "--rw", "write",
           "--bs", "1M", "--iodepth", "8", "--nsid", str(nsid), "--output-format", "json", "--eta", "never", *extra]
    run_json(cmd, f"writing namespace {nsid} once before the rows failed", 600)


def poll_support() -> str | None:
    """None if the measured tree's `serve` and `bench` both take --poll-us, else why the polled row is skipped."""
    missing = [sub for sub in ("serve", "bench") if not cli_supports(sub, "--poll-us")]
    if not missing:
        return None
    return f"`nvmeof {' / '.join(missing)}` of {harness.TREE} has no --poll-us option"


def tls_support() -> str | None:
    """None if the measured tree's `serve` takes --tls and `bench` --tls-key, else why the TLS rows are skipped."""
    needed = (("serve", "--tls"), ("bench", "--tls-key"))
    missing = [f"{sub} {opt}" for sub, opt in needed if not cli_supports(sub, opt)]
    return f"`nvmeof {' / '.join(missing)}` missing in {harness.TREE}" if missing else None


def inline_support() -> str | None:
    """None if the measured tree's `serve` takes --inline-data-size, else why the in-capsule rows are skipped."""
    if cli_supports("serve", "--inline-data-size"):
        return None
    return f"`nvmeof serve` of {harness.TREE} has no --inline-data-size option"


def fmt_rate(bw: float) -> str:
    return f"{bw / (1 << 20):.1f}"


def _f(value: float | None, fmt: str = ".1f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, fmt)


def print_table(results: list[dict[str, Any]]) -> None:
    headers = ("job", "IOPS", "MiB/s", "lat us", "tgt us/IO", "ini us/IO", "baseline", "base IOPS", "base MiB/s",
               "base lat us", "base srv us/IO", "base cli us/IO", "tput ratio", "lat ratio", "max loop lag us",
               "own lag us")
    rows = []
    for r in results:
        if r.get("skipped"):
            rows.append((r["name"], *("-" * 5), "skipped", *("-" * 9)))
            continue
        b, n = r["baseline"] or {}, r["nvmeof"]
        rows.append((
            r["name"], f"{n['iops']:.0f}", fmt_rate(n["bw_bytes"]), _f(n["mean_lat_ns"], scale=1e3),
            _f(n["target_cpu_us_per_io"]), _f(n["initiator_cpu_us_per_io"]), r["baseline_kind"],
            _f(b.get("iops"), ".0f"), "-" if "bw_bytes" not in b else fmt_rate(b["bw_bytes"]),
            _f(b.get("mean_lat_ns"), scale=1e3),
            _f(b.get("server_cpu_us_per_io", b.get("target_cpu_us_per_io"))),
            _f(b.get("client_cpu_us_per_io", b.get("initiator_cpu_us_per_io"))),
            _f(r["throughput_ratio"], ".2f"), _f(r["latency_ratio"], ".2f"), _f(n.get("loop_lag_max_us"), ".0f"),
            _f(n.get("loop_lag_own_us"), ".0f"),
        ))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    for r in results:
        if r.get("skipped"):
            print(f"  {r['name']} skipped: {r['skipped']}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goals(by_name: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each issue-12 goal as a line: status met / MISSED / info / skipped, and the figures behind it."""
    out: list[dict[str, Any]] = []

    def add(goal: str, status: str, figures: str) -> None:
        out.append({"goal": goal, "status": status, "met": status == "met", "figures": figures})

    def usable(name: str) -> dict[str, Any] | None:
        r = by_name.get(name)
        if r is not None and r.get("skipped"):
            add(f"{name}", "skipped", r["skipped"])
            return None
        return r

    rr = usable("4k-randread-qd32")
    if rr:
        n, b = rr["nvmeof"], rr["baseline"]
        for side, key, raw_key, goal in (
                ("target", "target_cpu_us_per_io", "server_cpu_us_per_io", GOAL_TARGET_CPU_US),
                ("initiator", "initiator_cpu_us_per_io", "client_cpu_us_per_io", GOAL_INITIATOR_CPU_US)):
            v, raw = n[key], b.get(raw_key)
            add(f"4K randread QD32 {side} CPU <= {goal:g} us/IO",
                "MISSED" if v is None or v > goal else "met",
                f"{_f(v)} us/IO (raw TCP {'server' if side == 'target' else 'client'} {_f(raw)} us/IO, "
                f"{_f(_ratio(v, raw), '.2f')}x of it)")
        rw = by_name.get("4k-randwrite-qd32")
        if rw and not rw.get("skipped"):
            w, r = rw["nvmeof"]["target_cpu_us_per_io"], n["target_cpu_us_per_io"]
            ratio = _ratio(w, r)
            add(f"4K randwrite QD32 target CPU <= {GOAL_RANDWRITE_RATIO:g}x the 4K randread's",
                "met" if ratio is not None and ratio <= GOAL_RANDWRITE_RATIO else "MISSED",
                f"{_f(w)} vs {_f(r)} us/IO = {_f(ratio, '.2f')}x")
    for name, poll in (("4k-randread-qd1-poll", True), ("4k-randread-qd1", False)):
        r = usable(name)
        if not r:
            continue
        n, b, ratio = r["nvmeof"], r["baseline"], r["latency_ratio"]
        figures = (f"{_f(n['mean_lat_ns'], scale=1e3)} us vs raw ping-pong {_f(b['mean_lat_ns'], scale=1e3)} us "
                   f"(poll {r['poll_us']} us) = {_f(ratio, '.2f')}x; CPU target {_f(n['target_cpu_us_per_io'])} / "
                   f"initiator {_f(n['initiator_cpu_us_per_io'])} us/IO, raw {_f(b['server_cpu_us_per_io'])} / "
                   f"{_f(b['client_cpu_us_per_io'])}")
        if poll:
            add(f"4K QD1 mean latency, --poll-us on both ends, <= {GOAL_POLL_LAT_RATIO:g}x raw ping-pong "
                "with the same polling", "met" if ratio is not None and ratio <= GOAL_POLL_LAT_RATIO else "MISSED",
                figures)
        else:
            add(f"4K QD1 mean latency without polling <= {GOAL_QD1_LAT_RATIO:g}x raw ping-pong without polling",
                "met" if ratio is not None and ratio <= GOAL_QD1_LAT_RATIO else "MISSED", figures)
    def throughput_goal(r: dict[str, Any], what: str, goal: float) -> None:
        ratio = r["throughput_ratio"]
        add(f"128K seq {what} >= {goal:.0%} of raw TCP throughput",
            "met" if ratio is not None and ratio >= goal else "MISSED",
            f"{fmt_rate(r['nvmeof']['bw_bytes'])} vs {fmt_rate(r['baseline']['bw_bytes'])} MiB/s = "
            f"{_f(ratio * 100 if ratio is not None else None, '.0f')} %")

    # issue 26 part 2 on the default listener (writes by R2T), then on the in-capsule one
    for prefix, label in (("", ""), ("inline-", f", {INLINE_LABEL}")):
        seq = usable(f"{prefix}128k-read-qd8")
        if seq:
            throughput_goal(seq, f"read{label}", GOAL_SEQ_READ_RATIO)
        wr = usable(f"{prefix}128k-write-qd8")
        if not wr:
            continue
        throughput_goal(wr, f"write{label}", GOAL_SEQ_WRITE_RATIO)
        if seq:
            # same block size: CPU per I/O is CPU per byte
            w, r = wr["nvmeof"]["target_cpu_us_per_io"], seq["nvmeof"]["target_cpu_us_per_io"]
            cpu = _ratio(w, r)
            add(f"128K seq write target CPU per byte <= {GOAL_WRITE_CPU_RATIO:g}x the 128K reads'{label}",
                "met" if cpu is not None and cpu <= GOAL_WRITE_CPU_RATIO else "MISSED",
                f"{_f(w)} vs {_f(r)} us/IO = {_f(cpu, '.2f')}x (raw TCP server: "
                f"{_f(wr['baseline'].get('server_cpu_us_per_io'))} vs "
                f"{_f(seq['baseline'].get('server_cpu_us_per_io'))} us/IO)")
    for job in MATRIX:
        if not job.baseline.startswith("ram:"):
            continue
        r = usable(job.name)
        if not r:
            continue
        n, b = r["nvmeof"], r["baseline"]
        add(f"{job.name} next to RAM (file in the page cache)", "info",
            f"{n['iops']:.0f} vs {_f(b and b['iops'], '.0f')} IOPS = {_f(r['throughput_ratio'], '.2f')}x; "
            f"target {_f(n['target_cpu_us_per_io'])} vs {_f(b and b['target_cpu_us_per_io'])} us/IO")
    fw = usable("file-4k-randwrite-qd32")
    if fw and fw["nvmeof"].get("loop_lag"):
        n, lag = fw["nvmeof"], fw["nvmeof"]["loop_lag"]
        files, own = lag.get("files") or {}, lag.get("max_own_us")
        ok = n["iops"] >= GOAL_FILE_WRITE_IOPS and own is not None and own <= GOAL_LOOP_STALL_US
        # which road the writes took (target/backends/file.py): RWF_NOWAIT where the file system takes it
        # for buffered writes, else inline timed by the write policy, and the thread pool
        add(f"file-4k-randwrite-qd32 >= {GOAL_FILE_WRITE_IOPS} IOPS with no loop stall over "
            f"{GOAL_LOOP_STALL_US / 1000:g} ms (own part)", "met" if ok else "MISSED",
            f"{n['iops']:.0f} IOPS; worst loop lag {_f(lag.get('max_us'), '.0f')} us, own {_f(own, '.0f')} us; "
            f"probes late > 1 ms {lag.get('over_1ms')} (own {lag.get('own_over_1ms')}), > 2 ms {lag.get('over_2ms')} "
            f"(own {lag.get('own_over_2ms')}) of {lag.get('probes')}; longest GC pause "
            f"{_f(lag.get('gc_max_us'), '.0f')} us; writes inline by RWF_NOWAIT {files.get('write_nowait', '-')}, "
            f"inline timed {files.get('write_timed', '-')}, on the pool {files.get('thread', '-')} "
            f"({files.get('write_backoffs', '-')} back-offs, worst inline write "
            f"{files.get('write_worst_inline_us', '-')} us)")
    for job in MATRIX:
        if not job.tls:
            continue
        r = usable(job.name)
        if not r or not r["baseline"]:
            continue
        n, b = r["nvmeof"], r["baseline"]
        extra = {k: _f(n[k] - b[k] if n[k] is not None and b[k] is not None else None)
                 for k in ("target_cpu_us_per_io", "initiator_cpu_us_per_io")}
        add(f"{job.name}: TLS cost per I/O against the clear row of this run", "info",
            f"{n['iops']:.0f} vs {b['iops']:.0f} IOPS = {_f(r['throughput_ratio'], '.2f')}x; CPU per I/O target "
            f"{_f(n['target_cpu_us_per_io'])} vs {_f(b['target_cpu_us_per_io'])} us (+{extra['target_cpu_us_per_io']})"
            f", initiator {_f(n['initiator_cpu_us_per_io'])} vs {_f(b['initiator_cpu_us_per_io'])} us "
            f"(+{extra['initiator_cpu_us_per_io']})")
    return out


def select(only: list[str] | None) -> list[Job]:
    jobs = [j for j in MATRIX if not only or j.name in only]
    unknown = set(only or ()) - {j.name for j in MATRIX}
    if unknown:
        raise SystemExit(f"unknown --only row(s) {', '.join(sorted(unknown))}; rows: "
                         f"{', '.join(j.name for j in MATRIX)}")
    return jobs


def measure(jobs: list[Job], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run ``jobs`` (in MATRIX order) with only the targets and baselines they need started."""
    poll_skip = poll_support() if any(j.poll for j in jobs) else None
    tls_skip = tls_support() if any(j.tls for j in jobs) else None
    inline_skip = inline_support() if any(j.inline for j in jobs) else None
    serve_args = tuple(args.serve_arg or ())
    bench_args = tuple(args.bench_arg or ())
    results: list[dict[str, Any]] = []
    by_name: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        lag_dir = None if args.no_loop_lag else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lag-")))
        lag_files = {False: None, True: None} if lag_dir is None else {False: lag_dir / "serve.jsonl",
                                                                       True: lag_dir / "serve-poll.jsonl"}
        plain = [j for j in jobs if not j.poll and not j.tls and not j.inline]
        target = io_port = None
        if plain:
            target, io_port = stack.enter_context(serving(args.ramdisk_size, log_level="warning",
                                                          file_ns=any(j.nsid == 2 for j in plain),
                                                          extra_args=serve_args, lag_file=lag_files[False]))
            if args.precondition and any(j.nsid == 1 for j in plain):
                precondition(io_port)
        poll_target = poll_port = None
        if poll_skip is None and any(j.poll for j in jobs):
            poll_target, poll_port = stack.enter_context(serving(
                args.ramdisk_size, log_level="warning", extra_args=(*serve_args, "--poll-us", str(args.poll_us)),
                lag_file=lag_files[True]))
            if args.precondition:
                precondition(poll_port)
        tls_target = tls_port = None
        tls_key = None
        if tls_skip is None and any(j.tls for j in jobs):
            # its own target: `--tls optional` and the host list with the PSK (benchmarks/tls.py)
            tls_key = tlsbench.new_key()
            tls_target, tls_port = stack.enter_context(tlsbench.tls_serving(
                args.ramdisk_size, tls_key, log_level="warning", extra_args=serve_args))
            if args.precondition:
                precondition(tls_port, extra=tlsbench.host_args(None))
        inline_target = inline_port = None
        if inline_skip is None and any(j.inline for j in jobs):
            # its own target: the -l listener takes 128 KiB capsules (`serve --inline-data-size`)
            inline_target, inline_port = stack.enter_context(serving(
                args.ramdisk_size, log_level="warning",
                extra_args=(*serve_args, "--inline-data-size", str(INLINE_DATA_SIZE))))
            if args.precondition:
                precondition(inline_port)
        raw: dict[Any, tuple[subprocess.Popen[bytes], int]] = {}

        def raw_server(poll_us: int | None) -> tuple[subprocess.Popen[bytes], int]:
            if poll_us not in raw:
                raw[poll_us] = stack.enter_context(baseline_server(poll_us=poll_us))
            return raw[poll_us]

        for job in jobs:
            row = job.row
            entry: dict[str, Any] = {"name": job.name, "rw": row.rw, "bs": row.bs, "iodepth": row.iodepth,
                                     "nsid": job.nsid, "poll_us": args.poll_us if job.poll else 0,
                                     "baseline_kind": job.baseline.split(":")[0], "baseline": None,
                                     "throughput_ratio": None, "latency_ratio": None}
            skip = poll_skip if job.poll else tls_skip if job.tls else inline_skip if job.inline else None
            if skip:
                entry["skipped"] = skip
                print(f"skipping {job.name}: {skip}", file=sys.stderr, flush=True)
                results.append(entry)
                continue
            print(f"running {job.name} ...", file=sys.stderr, flush=True)
            base: dict[str, Any] | None
            if job.baseline == "stream":
                proc, port = raw_server(None)
                base = run_baseline(row, port, proc.pid, args)
            elif job.baseline == "pingpong":
                proc, port = raw_server(entry["poll_us"])
                base = run_pingpong(row, port, proc.pid, entry["poll_us"], args)
            else:   # "ram:ROW" / "clear:ROW": that row of this run
                same = by_name.get(job.baseline.split(":", 1)[1])
                base = same["nvmeof"] if same and not same.get("skipped") else None
            if job.tls:
                pid, port = tls_target.pid, tls_port  # type: ignore[union-attr]
            elif job.inline:
                pid, port = inline_target.pid, inline_port  # type: ignore[union-attr]
            else:
                pid, port = (poll_target.pid, poll_port) if job.poll else (target.pid, io_port)  # type: ignore[union-attr]
            extra = (*bench_args, *(("--poll-us", str(args.poll_us)) if job.poll else ()),
                     *(tlsbench.host_args(tls_key) if job.tls else ()))
            started = time.monotonic_ns()
            ours = run_bench(row, port, pid, runtime=args.runtime, ramp=args.ramp, numjobs=args.numjobs,
                             nsid=job.nsid, extra_args=extra)
            lag_file = None if job.tls or job.inline else lag_files[job.poll]
            if lag_file is not None:
                # the target's event loop from the probe's 100 ms reports (benchmarks/lagprobe.py): over the
                # last --runtime seconds before the bench exited (about its measured window; the process start,
                # connect and ramp come before), and over the whole bench run
                ended = time.monotonic_ns()
                time.sleep(0.15)   # the report covering the row's last 100 ms
                lag = lagprobe.window(str(lag_file), ended - int(args.runtime * 1e9), ended + 100_000_000)
                whole = lagprobe.window(str(lag_file), started, ended + 100_000_000)
                ours.update(loop_lag_max_us=lag["max_us"], loop_lag_own_us=lag["max_own_us"], loop_lag=lag,
                            loop_lag_whole_run=whole)
            entry.update(nvmeof=ours, baseline=base,
                         throughput_ratio=_ratio(ours["bw_bytes"], base and base["bw_bytes"]),
                         latency_ratio=_ratio(ours["mean_lat_ns"], base and base["mean_lat_ns"]))
            results.append(entry)
            by_name[job.name] = entry
    return results


def parse_pin(text: str, ap: argparse.ArgumentParser) -> tuple[set[int], set[int]]:
    """``0:1`` or ``0,1:2,3`` as the server and client CPU sets."""
    try:
        server, client = (set(int(c) for c in part.split(",")) for part in text.split(":"))
    except ValueError:
        ap.error(f"--pin {text!r}: give SERVER_CPUS:CLIENT_CPUS, CPU numbers separated by commas, e.g. 0:1")
    return server, client


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", "--seconds", type=float, default=3.0, help="measured seconds per row (default 3)")
    ap.add_argument("--ramp", type=float, default=0.5, help="unmeasured warm-up seconds per row (default 0.5)")
    ap.add_argument("--ramdisk-size", default="256M",
                    help="RAM disk size for nvmeof serve, and the size of the file namespace (default 256M)")
    ap.add_argument("--numjobs", type=int, default=1, help="nvmeof bench --numjobs (default 1)")
    ap.add_argument("--poll-us", type=int, default=100,
                    help="polling window of the polled QD1 row, on both ends and in its baseline (default 100)")
    ap.add_argument("--tree", type=Path, help="measure this checkout's nvmeof (default: the one holding this script)")
    ap.add_argument("--pin", metavar="SERVER_CPUS:CLIENT_CPUS",
                    help="bind targets and baseline servers to the first CPU list and bench and baseline clients "
                         "to the second, e.g. --pin 0:1 (default: not pinned)")
    ap.add_argument("--serve-arg", action="append", metavar="ARG",
                    help="extra argument for every nvmeof serve, e.g. --serve-arg=--poll-us=20 (repeatable)")
    ap.add_argument("--bench-arg", action="append", metavar="ARG", help="extra argument for every nvmeof bench")
    ap.add_argument("--no-precondition", dest="precondition", action="store_false",
                    help="measure the RAM disks as started, without writing them once first (the first writes "
                         "then pay the kernel's page faults, and reads of unwritten pages read the zero page)")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help=f"run only these rows (repeatable): {', '.join(j.name for j in MATRIX)}")
    ap.add_argument("--no-loop-lag", action="store_true",
                    help="start the targets without the loop-lag probe (benchmarks/lagprobe.py); by default each "
                         "row reports the worst lateness of the target's event loop while it ran")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write all results as JSON to FILE")
    args = ap.parse_args(argv)
    if args.poll_us <= 0:
        ap.error("--poll-us must be positive (the unpolled QD1 row is 4k-randread-qd1)")
    set_tree(args.tree)
    if args.pin:
        server, client = parse_pin(args.pin, ap)
        set_pinning(server, client)
    jobs = select(args.only)
    results = measure(jobs, args)
    info = machine() | {"tree": str(harness.TREE), "pin": args.pin}
    print(f"machine: {info['cpus']} CPUs, {info['cpu_model']}, Python {info['python']} ({info['event_loop']}), "
          f"kernel {info['kernel']}; tree {info['tree']}; runtime {args.runtime:g} s + ramp {args.ramp:g} s per row"
          + (f"; pinned servers:clients {args.pin}" if args.pin else ""))
    print_table(results)
    checks = goals({r["name"]: r for r in results})
    print()
    for g in checks:
        print(f"[{g['status']}] {g['goal']}: {g['figures']}")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "runtime_s": args.runtime, "ramp_s": args.ramp,
                                         "poll_us": args.poll_us, "results": results, "goals": checks},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
