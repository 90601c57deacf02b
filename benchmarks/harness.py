"""What every benchmark script shares: start `nvmeof serve`, run `nvmeof bench`, read its JSON.

benchmarks/run.py (the matrix against the raw TCP baseline) and benchmarks/workers.py (`--workers 0`
against `--workers N`) both go through ``serving`` and ``run_bench``, so a row means the same
`nvmeof bench` command line, and the same figures are read from its report, in each.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The tree whose `nvmeof serve` / `nvmeof bench` are measured (its directory goes first on PYTHONPATH):
# this one unless ``set_tree`` names another (benchmarks/ab.py runs the same matrix on two trees).
TREE = ROOT
DEFAULT_NQN = "nqn.2026-11.io.nvmeof-toolkit:ramdisk0"   # nvmeof/defaults.py DEFAULT_SUBSYSTEM_NQN
LAGPROBE = Path(__file__).resolve().parent / "lagprobe.py"


def set_tree(tree: str | os.PathLike[str] | None) -> None:
    """Measure the `nvmeof` of ``tree`` (a checkout: its nvmeof/ and target/ are imported) from now on."""
    global TREE
    path = Path(tree).resolve() if tree else ROOT
    if not (path / "nvmeof" / "cli").is_dir():
        raise SystemExit(f"--tree {path}: not a checkout of this project (no nvmeof/cli in it)")
    TREE = path


@dataclass(frozen=True)
class Row:
    name: str
    rw: str
    bs: int
    iodepth: int


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
    # Only the measured tree: another checkout on the inherited PYTHONPATH would shadow nothing (the
    # tree comes first) but could supply modules the tree lacks, mixing two versions.
    e["PYTHONPATH"] = str(TREE)
    return e


# CPUs the servers (targets, baseline servers) and the clients (bench, baseline clients) are bound to:
# the issue-12 measurements pin the target to one core and the client to the other, which is what
# makes busy polling mean anything on a small machine. Empty: not pinned.
PIN: dict[str, set[int]] = {}


def set_pinning(server: set[int] | None, client: set[int] | None) -> None:
    """Bind every server started from now on to ``server`` and every client to ``client`` (None: free)."""
    PIN.clear()
    for role, cpus in (("server", server), ("client", client)):
        if cpus:
            bad = cpus - os.sched_getaffinity(0)
            if bad:
                raise SystemExit(f"--pin: CPU(s) {sorted(bad)} are not available to this process "
                                 f"(allowed: {sorted(os.sched_getaffinity(0))})")
            PIN[role] = set(cpus)


def _bind(role: str) -> Any:
    cpus = PIN.get(role)
    return None if not cpus else (lambda: os.sched_setaffinity(0, cpus))


def cli_supports(subcommand: str, option: str) -> bool:
    """Whether the measured tree's `nvmeof SUBCOMMAND` takes ``option`` (read from its --help)."""
    out = subprocess.run([sys.executable, "-m", "nvmeof.cli", subcommand, "--help"], env=env(),
                         capture_output=True, text=True, timeout=60, cwd=TREE)
    return out.returncode == 0 and option in out.stdout


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


def stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_json(cmd: list[str], what: str, timeout: float) -> Any:
    """Run a benchmark client and return the JSON it prints; a failure stops the run with its stderr."""
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout,
                         preexec_fn=_bind("client"))
    if out.returncode != 0:
        raise SystemExit(f"{what} (status {out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout)


@contextmanager
def running(cmd: list[str], port: int, what: str) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` started (stdout dropped), yielded once it listens on ``port``, stopped on the way out."""
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, cwd=TREE, preexec_fn=_bind("server"))
    try:
        wait_port(port, proc, what)
        yield proc
    finally:
        stop(proc)


def parse_size(text: str) -> int:
    """``256M`` and friends (K, M, G: powers of 1024), as `nvmeof serve --ramdisk-size` reads them."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)


def fill_file(path: Path, size: int) -> None:
    """Write ``size`` bytes of non-zero data to ``path``; the page cache keeps them (a file namespace
    measured "in the page cache" is exactly this)."""
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(chunk)
        f.write(chunk[: size & ((1 << 20) - 1)])


@contextmanager
def serving(ramdisk_size: str, *, workers: int | None = None, log_level: str | None = None,
            file_ns: bool = False, extra_args: tuple[str, ...] = (),
            lag_file: Path | None = None) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`nvmeof serve --api none` with a RAM disk (nsid 1) on free loopback ports: yields the process
    and its I/O port once it listens, and stops it (SIGINT, as Ctrl-C) on the way out. ``file_ns``:
    also a file of the same size, written just before (so in the page cache), as nsid 2 of the same
    subsystem. ``extra_args`` go to `nvmeof serve` as given (--poll-us N, --workers N ...). ``lag_file``:
    started through benchmarks/lagprobe.py, which appends the event loop's lateness there."""
    io_port, disc_port = free_port(), free_port()
    launcher = ["-m", "nvmeof.cli"] if lag_file is None else [str(LAGPROBE), str(lag_file)]
    cmd = [sys.executable, *launcher, *(["--log-level", log_level] if log_level else []),
           "serve", "--api", "none", "--listen", f"tcp://127.0.0.1:{io_port}",
           "--discovery", f"tcp://127.0.0.1:{disc_port}", "--ramdisk-size", ramdisk_size, *extra_args]
    what = "nvmeof serve" + "".join(f" {a}" for a in extra_args)
    if workers is not None:
        cmd += ["--workers", str(workers)]
        what += f" --workers {workers}"
    with tempfile.TemporaryDirectory(prefix="nvmeof-bench-") as tmp:
        if file_ns:
            size = parse_size(ramdisk_size)
            disks = Path(tmp) / "disks"
            disks.mkdir()
            fill_file(disks / "bench.img", size)
            config = {"version": 1, "subsystems": [{"nqn": DEFAULT_NQN, "allow_any_host": True, "namespaces": [
                {"nsid": 1, "backend": "ram", "size": size},
                {"nsid": 2, "backend": "file", "path": str(disks / "bench.img")},
            ]}]}  # fmt: skip
            cfg = Path(tmp) / "config.json"
            cfg.write_text(json.dumps(config))
            cmd += ["--config", str(cfg), "--backing-dir", str(disks)]
        with running(cmd, io_port, what) as proc:
            yield proc, io_port


def run_bench(row: Row, port: int, target_pid: int, *, runtime: float, ramp: float, numjobs: int,
              nr_io_queues: int | None = None, nsid: int = 1, nqn: str | None = None,
              extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """One row through `nvmeof bench --output-format json` (``--target-pid``: the target's CPU per
    I/O, its worker processes included) and the figures of its first (grouped) job."""
    cmd = [sys.executable, "-m", "nvmeof.cli", "bench", "-a", "127.0.0.1", "-s", str(port),
           "--name", row.name, "--rw", row.rw, "--bs", str(row.bs), "--iodepth", str(row.iodepth),
           "--runtime", str(runtime), "--time_based", "--ramp_time", str(ramp), "--numjobs", str(numjobs),
           *(["--nr-io-queues", str(nr_io_queues)] if nr_io_queues is not None else []), "--group_reporting",
           "--nsid", str(nsid), *(["--nqn", nqn] if nqn else []),
           "--output-format", "json", "--eta", "never", "--target-pid", str(target_pid), *extra_args]
    report = run_json(cmd, f"nvmeof bench failed for {row.name}", runtime * 4 + 120)
    return bench_figures(report, row)


def bench_figures(report: dict[str, Any], row: Row) -> dict[str, Any]:
    """The figures the benchmark scripts print and save, from an `nvmeof bench` JSON report."""
    job = report["jobs"][0]
    d = job["read"] if "read" in row.rw else job["write"]
    return {
        "iops": d["iops"], "bw_bytes": d["bw_bytes"], "mean_lat_ns": d["clat_ns"]["mean"],
        "p99_ns": d["clat_ns"].get("percentile", {}).get("99.000000"), "total_ios": d["total_ios"],
        "runtime_ms": d["runtime"], "target_cpu_us_per_io": report["cpu_us_per_io"]["target"],
        "initiator_cpu_us_per_io": report["cpu_us_per_io"]["initiator"],
    }
