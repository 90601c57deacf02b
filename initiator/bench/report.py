"""The report in fio's JSON layout (fio 3.x field names), plus cpu_us_per_io and verify."""

from __future__ import annotations

import time
from typing import Any

from initiator.bench.histogram import LatencyHistogram
from initiator.bench.results import BenchReport, DirStats
from initiator.bench.verify import VerifyResult


def _clat_json(h: LatencyHistogram) -> dict[str, Any]:
    out: dict[str, Any] = {"min": h.min, "max": h.max, "mean": h.mean, "stddev": h.stdev, "N": h.count}
    if h.count:
        out["percentile"] = {f"{p:f}": v for p, v in h.percentiles().items()}
    return out


def _dir_json(d: DirStats) -> dict[str, Any]:
    clat = _clat_json(d.clat)
    return {
        "io_bytes": d.bytes,
        "io_kbytes": d.bytes >> 10,
        "bw_bytes": round(d.bw_bytes),
        "bw": round(d.bw_bytes / 1024),
        "iops": d.iops,
        "runtime": d.runtime_ms,
        "total_ios": d.ios,
        "short_ios": 0,
        "drop_ios": 0,
        "clat_ns": clat,
        # issue to completion is all one measurement here: lat = clat, no separate submission latency
        "lat_ns": {k: v for k, v in clat.items() if k != "percentile"},
    }


def fio_json(report: BenchReport, version: str) -> dict[str, Any]:
    """The report in fio's JSON layout (fio 3.x field names), plus cpu_us_per_io and verify."""
    spec = report.job
    results = report.reported()
    cpu = report.cpu_us_per_io()
    options = {
        "name": spec.name, "rw": spec.rw, "bs": str(spec.bs), "iodepth": str(spec.iodepth),
        "numjobs": str(spec.numjobs), "nsid": str(spec.nsid), "offset": str(spec.offset),
    }
    if spec.rw in ("randrw", "readwrite"):
        options["rwmixread"] = str(spec.rwmixread)
    if spec.size is not None:
        options["size"] = str(spec.size)
    if spec.runtime is not None:
        options["runtime"] = str(spec.runtime)
    if spec.time_based:
        options["time_based"] = "1"
    if spec.ramp_time:
        options["ramp_time"] = str(spec.ramp_time)
    if spec.verify:
        options["verify"] = spec.verify
    jobs = []
    for r in results:
        ios = r.total_ios
        runtime_ms = max(1, round(r.runtime_ns / 1e6))
        job: dict[str, Any] = {
            "jobname": r.name,
            "groupid": 0,
            "error": r.fio_error,
            "eta": 0,
            "elapsed": max(1, round(r.runtime_ns / 1e9)),
            "job options": options,
            "read": _dir_json(r.read),
            "write": _dir_json(r.write),
            "job_runtime": runtime_ms,
            "usr_cpu": 100.0 * r.usr_s * 1000 / runtime_ms,
            "sys_cpu": 100.0 * r.sys_s * 1000 / runtime_ms,
            "cpu_us_per_io": {
                "initiator": (r.usr_s + r.sys_s) * 1e6 / ios if ios else None,
                # the target's CPU cannot be split per job; a single (or grouped) job gets it all
                "target": cpu["target"] if len(results) == 1 else None,
            },
        }
        if r.verify is not None:
            job["verify"] = _verify_json(r.verify)
        if r.error:
            job["error_message"] = r.error
        jobs.append(job)
    return {
        "fio version": f"nvmeof-bench-{version}",
        "timestamp": int(report.started),
        "timestamp_ms": int(report.started * 1000),
        "time": time.ctime(report.started),
        "global options": {"transport": report.connect.transport, "traddr": report.connect.traddr,
                           "trsvcid": str(report.connect.trsvcid), "subnqn": report.connect.subnqn},
        "jobs": jobs,
        "cpu_us_per_io": cpu,
        "target_pids": list(report.target_pids),
    }


def _verify_json(v: VerifyResult) -> dict[str, Any]:
    out: dict[str, Any] = {"blocks": v.blocks, "errors": v.errors}
    if v.first is not None:
        f = v.first
        out["first_error"] = {"block": f.block, "offset": f.offset, "slba": f.slba, "field": f.field,
                              "expected": f.expected, "actual": f.actual}
    return out
