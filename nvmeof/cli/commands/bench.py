"""`nvmeof bench`: fio-style jobs through the Python initiator, with fio's option names and output."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any, TextIO

import click

from nvmeof import __version__, defaults
from nvmeof.spec.identify import NSID_MAX

from .common import parse_size, run_async
from .host import dhchap_options, tls_binder_option, tls_kwargs, tls_options

_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h)?\s*$", re.IGNORECASE)
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class SizeType(click.ParamType):
    """fio sizes: a number with an optional K, M, G or T suffix (binary units)."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class TimeType(click.ParamType):
    """fio times: seconds by default, or with a us, ms, s, m or h suffix."""

    name = "TIME"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        m = _TIME.match(value)
        if not m:
            self.fail(f"{value!r} is not a time: use seconds, or a number with us, ms, s, m or h", param, ctx)
        return float(m.group(1)) * _TIME_UNITS[(m.group(2) or "s").lower()]


SIZE = SizeType()
TIME = TimeType()


# --- number formatting in fio's style ----------------------------------------------------------------

def fmt_count(v: float) -> str:
    """IOPS as fio prints them: 873, 12.3k, 1234k -> 1.23M."""
    for suffix in ("", "k", "M", "G"):
        if v < 1000 or suffix == "G":
            if suffix == "":
                return f"{v:.0f}"
            return f"{v:.2f}{suffix}" if v < 10 else f"{v:.1f}{suffix}" if v < 100 else f"{v:.0f}{suffix}"
        v /= 1000
    raise AssertionError("unreachable")


def _scaled(v: float, base: int, units: tuple[str, ...]) -> str:
    for unit in units:
        if v < 1000 or unit == units[-1]:
            return f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"
        v /= base
    raise AssertionError("unreachable")


def fmt_bw(bytes_per_s: float) -> tuple[str, str]:
    """('48.0MiB/s', '50.3MB/s'): binary first, decimal in parentheses, as fio shows bandwidth."""
    return (_scaled(bytes_per_s, 1024, ("B/s", "KiB/s", "MiB/s", "GiB/s", "TiB/s")),
            _scaled(bytes_per_s, 1000, ("B/s", "kB/s", "MB/s", "GB/s", "TB/s")))


def fmt_bytes(n: float) -> tuple[str, str]:
    return (_scaled(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB")), _scaled(n, 1000, ("B", "kB", "MB", "GB", "TB")))


def _lat_unit(min_ns: float) -> tuple[str, float]:
    """fio picks the unit from the smallest value shown, so nothing reads as 0."""
    if min_ns >= 10_000_000:
        return "msec", 1e6
    if min_ns >= 10_000:
        return "usec", 1e3
    return "nsec", 1.0


# --- progress line ---------------------------------------------------------------------------------

class ProgressLine:
    """fio's status line on stderr: bar, percentage, IOPS and bandwidth since the last update, ETA."""

    WIDTH = 30

    def __init__(self, stream: TextIO, *, runtime: float | None, ramp: float, total_bytes: int | None) -> None:
        self.stream = stream
        self.span = (runtime + ramp) if runtime is not None else None
        self.total_bytes = total_bytes
        self._last: tuple[float, int, int, int] | None = None
        self._shown = False

    def __call__(self, elapsed: float, jobs: list[tuple[int, int, int, int]], phase: str) -> None:
        rios = sum(j[0] for j in jobs)
        wios = sum(j[2] for j in jobs)
        nbytes = sum(j[1] + j[3] for j in jobs)
        riops = wiops = bw = 0.0
        if self._last is not None and elapsed > self._last[0]:
            dt = elapsed - self._last[0]
            riops = (rios - self._last[1]) / dt
            wiops = (wios - self._last[2]) / dt
            bw = (nbytes - self._last[3]) / dt
        self._last = (elapsed, rios, wios, nbytes)
        fraction = None
        eta = None
        if self.span:
            fraction = min(1.0, elapsed / self.span)
            eta = max(0.0, self.span - elapsed)
        if self.total_bytes:
            done = min(1.0, nbytes / self.total_bytes)
            if fraction is None or done > fraction:
                fraction = done
                eta = (self.total_bytes - nbytes) / bw if bw > 0 else None
        if fraction is None:
            bar, pct = "[" + "?" * self.WIDTH + "]", "  ?%"
        else:
            filled = int(fraction * self.WIDTH)
            arrow = ">" if filled < self.WIDTH else ""
            bar = "[" + "=" * filled + arrow + " " * (self.WIDTH - filled - len(arrow)) + "]"
            pct = f"{fraction * 100:3.0f}%"
        eta_s = "--:--" if eta is None else f"{int(eta) // 60:02d}:{int(eta) % 60:02d}"
        line = (f"{bar} {pct} {phase} r={fmt_count(riops)} IOPS w={fmt_count(wiops)} IOPS "
                f"{fmt_bw(bw)[0]} eta {eta_s}")
        self.stream.write("\r" + line + "\033[K")
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


# --- fio's normal output ------------------------------------------------------------------------------

def _dir_lines(label: str, d: Any) -> list[str]:
    from initiator.bench.histogram import FIO_PERCENTILES

    if not d.ios:
        return []
    bw_bin, bw_dec = fmt_bw(d.bw_bytes)
    io_bin, _ = fmt_bytes(d.bytes)
    h = d.clat
    unit, div = _lat_unit(h.min)
    lines = [
        f"  {label}: IOPS={fmt_count(d.iops)}, BW={bw_bin} ({bw_dec})({io_bin}/{d.runtime_ms}msec)",
        f"    clat ({unit}): min={h.min / div:.0f}, max={h.max / div:.0f}, avg={h.mean / div:.2f}, "
        f"stdev={h.stdev / div:.2f}",
    ]
    pct = h.percentiles()
    punit, pdiv = _lat_unit(min(pct.values()))
    width = max(len(f"{v / pdiv:.0f}") for v in pct.values())
    cells = [f"{p:5.2f}th=[{v / pdiv:{width}.0f}]" for p, v in zip(FIO_PERCENTILES, pct.values(), strict=True)]
    lines.append(f"     clat percentiles ({punit}):")
    for i in range(0, len(cells), 4):
        row = ", ".join(cells[i:i + 4])
        lines.append(f"     | {row}{',' if i + 4 < len(cells) else ''}")
    return lines


def format_normal(report: Any) -> str:
    results = report.reported()
    cpu = report.cpu_us_per_io()
    out: list[str] = []
    for r in results:
        out.append(f"{r.name}: (groupid=0, jobs={r.jobs}): err={r.fio_error:2d}: pid={r.pid}: "
                   f"{time.ctime(report.started)}")
        out += _dir_lines("read", r.read)
        out += _dir_lines("write", r.write)
        runtime_s = max(r.runtime_ns / 1e9, 1e-9)
        out.append(f"  cpu          : usr={100 * r.usr_s / runtime_s:.2f}%, sys={100 * r.sys_s / runtime_s:.2f}%")
        if r.verify is not None:
            v = r.verify
            out.append(f"  verify       : {v.blocks} blocks checked, {v.errors} bad")
        if r.error:
            out.append(f"  error        : {r.error}")
    ini = "n/a" if cpu["initiator"] is None else f"{cpu['initiator']:.1f} us"
    tgt = "n/a (target not local; give --target-pid)" if cpu["target"] is None else f"{cpu['target']:.1f} us"
    out.append(f"  cpu per I/O  : initiator={ini}, target={tgt}")
    group = report.group()
    out.append("")
    out.append("Run status group 0 (all jobs):")
    for label, attr in (("READ", "read"), ("WRITE", "write")):
        per_job = [getattr(r, attr) for r in report.results if getattr(r, attr).ios]
        if not per_job:
            continue
        g = getattr(group, attr)
        bw_bin, bw_dec = fmt_bw(g.bw_bytes)
        lo = min(d.bw_bytes for d in per_job)
        hi = max(d.bw_bytes for d in per_job)
        io_bin, io_dec = fmt_bytes(g.bytes)
        out.append(f"  {label:>5}: bw={bw_bin} ({bw_dec}), {fmt_bw(lo)[0]}-{fmt_bw(hi)[0]} "
                   f"({fmt_bw(lo)[1]}-{fmt_bw(hi)[1]}), io={io_bin} ({io_dec}), "
                   f"run={min(d.runtime_ms for d in per_job)}-{max(d.runtime_ms for d in per_job)}msec")
    return "\n".join(out)


# --- the command -------------------------------------------------------------------------------------

@click.command(context_settings={"show_default": True})
@click.option("--name", default="nvmeof", help="Job name (fio --name).")
@click.option("--rw", type=click.Choice(["read", "write", "randread", "randwrite", "randrw", "readwrite", "rw"]),
              default="read", help="I/O pattern, as fio's --rw.")
@click.option("--rwmixread", type=click.IntRange(0, 100), default=50,
              help="Percentage of reads in a mixed workload (randrw, readwrite).")
@click.option("--bs", type=SIZE, default="4k", help="Block size per I/O (K, M suffixes).")
@click.option("--iodepth", type=click.IntRange(1, 65535), default=1, help="Commands in flight per job.")
@click.option("--numjobs", type=click.IntRange(1, 256), default=1,
              help="Jobs, each a worker process with its own controller connection.")
@click.option("--runtime", type=TIME, default=None,
              help="Stop after this long (seconds, or with ms/s/m/h); without --time_based, "
                   "also stop after one pass over --size.")
@click.option("--time_based", "time_based", is_flag=True,
              help="Keep looping over the region until --runtime has passed.")
@click.option("--ramp_time", "ramp_time", type=TIME, default=0.0,
              help="Run this long before counting I/O.")
@click.option("--size", type=SIZE, default=None,
              help="Region length from --offset (default: to the end of the namespace); also the "
                   "amount of I/O per job unless --time_based.")
@click.option("--offset", type=SIZE, default="0", help="Start of the region on the namespace.")
@click.option("--nsid", type=click.IntRange(1, NSID_MAX), default=1, help="Namespace ID.")
@click.option("--verify", type=click.Choice(["crc32c", "none"]), default="none",
              help="crc32c: write a checkable pattern (write jobs), read it back and check it.")
@click.option("--verify_seed", "verify_seed", type=int, default=None, hidden=True)
@click.option("--randseed", type=int, default=None, help="Seed of the random offsets.")
@click.option("--group_reporting", "group_reporting", is_flag=True,
              help="Report the jobs together as one (fio --group_reporting).")
@click.option("--output-format", "output_format", type=click.Choice(["normal", "json"]), default="normal",
              help="normal: fio's text summary; json: fio's JSON layout.")
@click.option("--output", type=click.File("w"), default=None, help="Write the report to this file.")
@click.option("--eta", type=click.Choice(["auto", "always", "never"]), default="auto",
              help="Progress line on stderr: auto shows it when stderr is a terminal.")
@click.option("--target-pid", "target_pids", type=int, multiple=True,
              help="PID of a local target process: report its CPU time per I/O (repeatable). "
                   "Default: the local process listening on the target address, if any.")
@click.option("-t", "--transport", type=click.Choice(["tcp", "rdma"]), default="tcp", help="Transport type.")
@click.option("-a", "--traddr", default=defaults.LISTEN_ADDRESS, help="Target address.")
@click.option("-s", "--trsvcid", type=click.IntRange(1, defaults.PORT_MAX), default=defaults.TCP_IO_PORT,
              help="Target port.")
@click.option("-n", "--nqn", default=defaults.DEFAULT_SUBSYSTEM_NQN, help="Subsystem NQN.")
@click.option("-q", "--hostnqn", default=None, help="Host NQN (default: generated).")
@click.option("-g", "--hdr-digest", "hdr_digest", is_flag=True, help="Enable the NVMe/TCP header digest.")
@click.option("-G", "--data-digest", "data_digest", is_flag=True, help="Enable the NVMe/TCP data digest.")
@click.option("-i", "--nr-io-queues", "nr_io_queues", type=click.IntRange(1, defaults.MAX_IO_QUEUES), default=1,
              help="I/O queues per job connection.")
@click.option("-Q", "--queue-size", "queue_size", type=click.IntRange(2, 65536), default=defaults.MAX_QUEUE_SIZE,
              help="I/O queue size.")
@click.option("--poll-us", "poll_us", type=click.IntRange(0, 1_000_000), default=defaults.POLL_US,
              help="Hybrid polling: after a batch, busy-try non-blocking receives this many µs before sleeping "
                   "(0 = off; its CPU shows in the CPU-per-I/O figures).")
@click.option("--disable-sqflow", "disable_sqflow", is_flag=True,
              help="Connect with SQ flow control disabled (nvme-cli --disable-sqflow): the target may end a "
                   "successful read with a C2HData SUCCESS flag instead of a CapsuleResp.")
@dhchap_options
@tls_options
@tls_binder_option
def bench(**opts: Any) -> None:
    """Measure a namespace the way fio does, through the Python initiator.

    \b
    Examples:
      nvmeof bench --rw randread --bs 4k --iodepth 32 --runtime 10 --time_based
      nvmeof bench --rw write --bs 128k --size 64M --verify crc32c
      nvmeof bench --rw randrw --rwmixread 70 --numjobs 2 --runtime 5 --output-format json
    """
    from initiator.bench.cpu import local_listener_pid
    from initiator.bench.jobspec import DEFAULT_RANDSEED, BenchError, ConnectSpec, JobSpec
    from initiator.bench.report import fio_json
    from initiator.bench.run import run_bench
    from initiator.bench.verify import DEFAULT_VERIFY_SEED

    if opts["bs"] <= 0 or opts["bs"] % 512:
        raise click.BadParameter(f"{opts['bs']} bytes is not a positive multiple of 512", param_hint="'--bs'")
    spec = JobSpec(
        name=opts["name"], rw=opts["rw"], bs=opts["bs"], iodepth=opts["iodepth"], numjobs=opts["numjobs"],
        rwmixread=opts["rwmixread"], runtime=opts["runtime"], time_based=opts["time_based"],
        ramp_time=opts["ramp_time"], size=opts["size"], offset=opts["offset"], nsid=opts["nsid"],
        verify=None if opts["verify"] == "none" else opts["verify"],
        verify_seed=DEFAULT_VERIFY_SEED if opts["verify_seed"] is None else opts["verify_seed"],
        randseed=DEFAULT_RANDSEED if opts["randseed"] is None else opts["randseed"],
        group_reporting=opts["group_reporting"],
    )
    try:
        spec.validate()
    except BenchError as e:
        raise click.UsageError(str(e)) from None
    if opts["poll_us"] and opts["transport"] != "tcp":
        raise click.UsageError(f"--poll-us {opts['poll_us']}: poll_us=N needs the TCP batch engine "
                               f"(--transport tcp), not --transport {opts['transport']}")
    tls = tls_kwargs(opts["tls"], opts["tls_key"], opts["tls_identity_version"], opts["tls_sha256_binder"])
    cspec = ConnectSpec(
        transport=opts["transport"], traddr=opts["traddr"], trsvcid=opts["trsvcid"], subnqn=opts["nqn"],
        hostnqn=opts["hostnqn"], hdr_digest=opts["hdr_digest"], data_digest=opts["data_digest"],
        nr_io_queues=opts["nr_io_queues"], queue_size=opts["queue_size"],
        dhchap_secret=opts["dhchap_secret"], dhchap_ctrl_secret=opts["dhchap_ctrl_secret"],
        poll_us=opts["poll_us"], disable_sqflow=opts["disable_sqflow"], **tls,
    )
    show = opts["eta"] == "always" or (opts["eta"] == "auto" and sys.stderr.isatty())
    progress = None
    if show:
        total = None
        if spec.size is not None and not spec.time_based:
            total = spec.size * spec.numjobs * (2 if spec.verify and spec.read_fraction == 0.0 else 1)
        progress = ProgressLine(sys.stderr, runtime=spec.runtime, ramp=spec.ramp_time, total_bytes=total)
    try:
        target_pids = tuple(opts["target_pids"])
        if not target_pids and cspec.transport == "tcp":
            # A target on this machine: measure its CPU per I/O without being asked (fio-like `cpu` lines).
            pid = local_listener_pid(cspec.traddr, cspec.trsvcid)
            target_pids = (pid,) if pid is not None and pid != os.getpid() else ()
        report = run_async(run_bench(cspec, spec, target_pids=target_pids, progress=progress))
    except BenchError as e:
        raise click.ClickException(str(e)) from None
    except (OSError, ConnectionError, TimeoutError, ValueError) as e:
        raise click.ClickException(f"cannot run against {cspec.traddr}:{cspec.trsvcid} "
                                   f"({cspec.subnqn}): {e}") from None
    except Exception as e:  # NvmeError and friends: name the command that failed
        from nvmeof.status import NvmeError

        if isinstance(e, NvmeError):
            raise click.ClickException(f"NVMe command failed: {e}") from None
        raise
    finally:
        if progress is not None:
            progress.clear()
    out = opts["output"] or sys.stdout
    if opts["output_format"] == "json":
        out.write(json.dumps(fio_json(report, __version__), indent=2) + "\n")
    else:
        out.write(format_normal(report) + "\n")
    out.flush()
    for r in report.results:
        if r.verify is not None and r.verify.first is not None:
            click.echo(f"{r.name}: {r.verify.first.describe()} ({r.verify.errors} bad of "
                       f"{r.verify.blocks} blocks)", err=True)
        if r.error:
            click.echo(f"{r.name}: {r.error}", err=True)
    if report.failed:
        sys.exit(1)


def register(cli: click.Group) -> None:
    cli.add_command(bench)
