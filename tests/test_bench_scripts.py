"""benchmarks/run.py goals, benchmarks/ab.py summaries and the ping-pong baseline (issue 12), without
measuring anything long: the figures here are made up or come from a fraction of a second."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import ab  # noqa: E402
import harness  # noqa: E402
import lagprobe  # noqa: E402
import run  # noqa: E402


def _ours(iops: float, lat_us: float, tgt: float | None, ini: float) -> dict:
    return {"iops": iops, "bw_bytes": iops * 4096, "mean_lat_ns": lat_us * 1e3, "target_cpu_us_per_io": tgt,
            "initiator_cpu_us_per_io": ini}


def _entry(name: str, ours: dict | None, base: dict | None, *, iodepth: int = 32, poll_us: int = 0,
           skipped: str | None = None) -> dict:
    e = {"name": name, "iodepth": iodepth, "poll_us": poll_us, "nvmeof": ours, "baseline": base}
    if skipped:
        e["skipped"] = skipped
        return e
    e["throughput_ratio"] = ours["bw_bytes"] / base["bw_bytes"]
    e["latency_ratio"] = ours["mean_lat_ns"] / base["mean_lat_ns"]
    return e


def test_goals_say_met_missed_info_and_skipped_with_their_figures() -> None:
    raw = {"iops": 100.0, "bw_bytes": 100.0 * 4096, "mean_lat_ns": 50e3, "server_cpu_us_per_io": 8.0,
           "client_cpu_us_per_io": 10.0}
    results = [
        _entry("4k-randread-qd32", _ours(90, 300, 4.5, 7.5), raw),
        _entry("4k-randwrite-qd32", _ours(90, 300, 5.5, 6.0), raw),
        _entry("4k-randread-qd1", _ours(10, 100, 50.0, 60.0), raw, iodepth=1),
        _entry("4k-randread-qd1-poll", None, None, iodepth=1, poll_us=100, skipped="no --poll-us here"),
        _entry("128k-read-qd8", _ours(95, 300, 50.0, 50.0), raw),
        _entry("file-4k-randread-qd32", _ours(45, 300, 9.0, 6.0), _ours(90, 300, 4.5, 6.0)),
    ]
    by_goal = {g["goal"]: g for g in run.goals({r["name"]: r for r in results})}
    assert by_goal["4K randread QD32 target CPU <= 5 us/IO"]["status"] == "met"
    init = by_goal["4K randread QD32 initiator CPU <= 7 us/IO"]
    assert init["status"] == "MISSED" and "7.5 us/IO (raw TCP client 10.0 us/IO, 0.75x" in init["figures"]
    write = by_goal["4K randwrite QD32 target CPU <= 1.2x the 4K randread's"]
    assert write["status"] == "MISSED" and "5.5 vs 4.5 us/IO = 1.22x" in write["figures"]
    assert by_goal["4k-randread-qd1-poll"] == {"goal": "4k-randread-qd1-poll", "status": "skipped", "met": False,
                                               "figures": "no --poll-us here"}
    qd1 = by_goal["4K QD1 mean latency without polling <= 1.5x raw ping-pong without polling"]
    assert qd1["status"] == "MISSED" and "= 2.00x" in qd1["figures"]
    seq = by_goal["128K seq read >= 90% of raw TCP throughput"]
    assert seq["status"] == "met" and "= 95 %" in seq["figures"]
    file_row = by_goal["file-4k-randread-qd32 next to RAM (file in the page cache)"]
    assert file_row["status"] == "info" and "= 0.50x" in file_row["figures"]


def test_large_write_goals_compare_with_the_reads_and_the_raw_baseline() -> None:
    raw = {"iops": 100.0, "bw_bytes": 100.0 * 4096, "mean_lat_ns": 50e3, "server_cpu_us_per_io": 8.0,
           "client_cpu_us_per_io": 10.0}
    read = _entry("128k-read-qd8", _ours(95, 300, 50.0, 50.0), raw)
    for iops, cpu, status in ((85, 54.0, "met"), (75, 54.0, "MISSED"), (85, 56.0, "MISSED")):
        write = _entry("128k-write-qd8", _ours(iops, 300, cpu, 50.0), raw)
        by_goal = {g["goal"]: g for g in run.goals({r["name"]: r for r in (read, write)})}
        tput = by_goal["128K seq write >= 80% of raw TCP throughput"]
        per_byte = by_goal["128K seq write target CPU per byte <= 1.1x the 128K reads'"]
        assert f"= {iops} %" in tput["figures"] and f"{cpu:.1f} vs 50.0 us/IO" in per_byte["figures"]
        assert "MISSED" not in (tput["status"], per_byte["status"]) if status == "met" else \
            "MISSED" in (tput["status"], per_byte["status"])


def test_large_write_goals_are_judged_on_the_incapsule_rows_too() -> None:
    raw = {"iops": 100.0, "bw_bytes": 100.0 * 4096, "mean_lat_ns": 50e3, "server_cpu_us_per_io": 8.0,
           "client_cpu_us_per_io": 10.0}
    rows = [_entry("128k-read-qd8", _ours(95, 300, 50.0, 50.0), raw),
            _entry("128k-write-qd8", _ours(85, 300, 70.0, 50.0), raw),
            _entry("inline-128k-read-qd8", _ours(95, 300, 50.0, 50.0), raw),
            _entry("inline-128k-write-qd8", _ours(85, 300, 54.0, 50.0), raw)]
    by_goal = {g["goal"]: g for g in run.goals({r["name"]: r for r in rows})}
    label = "in-capsule (inline_data_size 131072)"
    assert by_goal["128K seq write target CPU per byte <= 1.1x the 128K reads'"]["status"] == "MISSED"
    inline = by_goal[f"128K seq write target CPU per byte <= 1.1x the 128K reads', {label}"]
    assert inline["status"] == "met" and "54.0 vs 50.0 us/IO" in inline["figures"]
    assert by_goal[f"128K seq write, {label} >= 80% of raw TCP throughput"]["status"] == "met"
    assert {j.name for j in run.MATRIX if j.inline} == {"inline-128k-read-qd8", "inline-128k-write-qd8"}


def test_tls_rows_give_their_cost_per_io_against_the_clear_row_of_the_run() -> None:
    clear = _ours(100, 300, 5.0, 6.0)
    tls = _entry("tls-4k-randread-qd32", _ours(80, 400, 7.5, 9.0), clear)
    (g,) = run.goals({tls["name"]: tls})
    assert g["status"] == "info" and g["goal"].startswith("tls-4k-randread-qd32: TLS cost per I/O")
    assert "80 vs 100 IOPS = 0.80x" in g["figures"]
    assert "target 7.5 vs 5.0 us (+2.5)" in g["figures"] and "initiator 9.0 vs 6.0 us (+3.0)" in g["figures"]
    assert {j.baseline for j in run.MATRIX if j.tls} == {"clear:4k-randread-qd32", "clear:128k-read-qd8",
                                                         "clear:128k-write-qd8"}
    skipped = _entry("tls-128k-read-qd8", None, None, skipped="no --tls here")
    assert run.goals({skipped["name"]: skipped})[0]["status"] == "skipped"


def test_goals_of_a_polled_row_compare_with_the_same_polling() -> None:
    ping = {"iops": 1.0, "bw_bytes": 4096.0, "mean_lat_ns": 20e3, "server_cpu_us_per_io": 20.0,
            "client_cpu_us_per_io": 20.0}
    for lat, status in ((29.0, "met"), (31.0, "MISSED")):
        r = _entry("4k-randread-qd1-poll", _ours(1, lat, 30.0, 30.0), ping, iodepth=1, poll_us=50)
        (g,) = run.goals({r["name"]: r})
        assert g["status"] == status and "(poll 50 us)" in g["figures"]


def test_an_unknown_row_is_refused_with_the_list() -> None:
    with pytest.raises(SystemExit, match=r"unknown --only row.*nope.*4k-randread-qd1-poll"):
        run.select(["nope"])
    assert [j.name for j in run.select(["file-128k-read-qd8"])] == ["file-128k-read-qd8"]


def test_ab_summary_gives_medians_and_b_over_a() -> None:
    raw = {"iops": 100.0, "bw_bytes": 100.0 * 4096, "mean_lat_ns": 50e3}
    a = [_entry("r", _ours(v, 100, 20.0, 30.0), raw) for v in (100, 120, 110)]
    b = [_entry("r", _ours(v, 50, 10.0, 15.0), raw) for v in (220, 200)]
    s = ab.summarize("r", a, b)
    assert s["iops"]["a"] == 110 and s["iops"]["b"] == 210 and s["iops"]["b/a"] == pytest.approx(210 / 110)
    assert s["target_cpu_us_per_io"]["b/a"] == 0.5 and s["mean_lat_ns"]["b/a"] == 0.5
    assert s["vs_baseline"] == {"a": 1.1, "b": 2.1, "kind": "throughput"}
    skipped = ab.summarize("p", [_entry("p", None, None, iodepth=1, skipped="why")], b)
    assert skipped["a_skipped"] == "why" and skipped["iops"]["a"] is None and skipped["iops"]["b/a"] is None
    assert skipped["vs_baseline"]["kind"] == "latency"


@pytest.mark.parametrize("poll_us", [0, 20])
def test_the_ping_pong_baseline_answers_with_and_without_polling(poll_us: int) -> None:
    port = harness.free_port()
    cmd = [sys.executable, str(BENCH / "baseline.py"), "pingserve", "--port", str(port), "--poll-us", str(poll_us)]
    with harness.running(cmd, port, "ping-pong server") as server:
        out = harness.run_json([sys.executable, str(BENCH / "baseline.py"), "pingpong", "--port", str(port),
                                "--poll-us", str(poll_us), "--runtime", "0.2", "--ramp", "0",
                                "--server-pid", str(server.pid)], "ping-pong client", 60)
    assert out["poll_us"] == poll_us and out["ios"] > 0 and out["mean_lat_ns"] > 0
    assert out["bw_bytes"] == pytest.approx(out["iops"] * 4096)
    assert out["server_cpu_us_per_io"] is not None


def test_options_of_the_measured_tree_are_read_from_its_help() -> None:
    assert harness.cli_supports("bench", "--iodepth")
    assert not harness.cli_supports("serve", "--no-such-option-anywhere")


def test_a_tree_that_is_no_checkout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=f"--tree {tmp_path}: not a checkout"):
        harness.set_tree(tmp_path)
    assert harness.TREE == harness.ROOT


def test_sizes_read_like_the_ramdisk_option() -> None:
    assert harness.parse_size("256M") == 256 << 20 and harness.parse_size("1g") == 1 << 30
    assert harness.parse_size("4096") == 4096 and harness.parse_size("64KiB") == 64 << 10


def test_ab_refuses_a_path_that_is_no_tree(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(BENCH / "ab.py"), "--a", str(tmp_path), "--b", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "not a checkout of this project" in out.stderr


def test_pinning_reads_two_cpu_lists_and_refuses_cpus_not_available() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    assert run.parse_pin("0:1", ap) == ({0}, {1}) and run.parse_pin("0,2:1,3", ap) == ({0, 2}, {1, 3})
    with pytest.raises(SystemExit):
        run.parse_pin("0-1", ap)
    with pytest.raises(SystemExit, match=r"--pin: CPU\(s\) \[4096\] are not available"):
        harness.set_pinning({4096}, None)
    assert harness.PIN == {}


def test_loop_lag_window_takes_the_reports_of_its_time_span(tmp_path: Path) -> None:
    out = tmp_path / "lag.jsonl"
    lines = [{"t": t, "max_ns": lag, "max_own_ns": own, "n": 90, "over_1ms": o1, "over_2ms": o2, "own_over_1ms": o1,
              "own_over_2ms": o2, "gc_max_ns": t * 1000,
              "files": {"inline": t * t // 1000, "thread": t // 20, "write_worst_inline_us": 3 * t}}
             for t, lag, own, o1, o2 in ((100, 9_000_000, 8_000_000, 3, 2), (200, 1_500_000, 700_000, 1, 0),
                                         (300, 2_500_000, 2_100_000, 2, 1), (400, 50_000_000, 1, 9, 9))]
    out.write_text("".join(json.dumps(rec) + "\n" for rec in lines) + '{"t": 5')   # the last line half written
    got = lagprobe.window(str(out), 150, 350)
    assert got == {"max_us": 2500.0, "max_own_us": 2100.0, "probes": 180, "over_1ms": 3, "over_2ms": 1,
                   "own_over_1ms": 3, "own_over_2ms": 1, "gc_max_us": 300.0,
                   "files": {"inline": 50, "thread": 5, "write_worst_inline_us": 900}}
    assert lagprobe.window(str(out), 500, 600)["max_us"] is None
    assert lagprobe.window(str(tmp_path / "none.jsonl"), 0, 1)["probes"] == 0


def test_the_loop_lag_probe_sees_a_stalled_loop(tmp_path: Path) -> None:
    """The probe, wrapped around asyncio.run as lagprobe.py does for `nvmeof serve`, reports a loop
    that blocks for 300 ms in one callback (a lower bound: any probe sent during the stall waits)."""
    import asyncio
    import time

    out = tmp_path / "lag.jsonl"

    async def stalls() -> None:
        await asyncio.sleep(0.05)
        time.sleep(0.3)          # the loop's thread blocked, as in a slow pwrite
        await asyncio.sleep(0.25)

    lagprobe._wrap(asyncio.run, str(out), 0.001)(stalls())
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    assert reports and max(r["max_ns"] for r in reports) >= 100_000_000
    assert sum(r["over_2ms"] for r in reports) >= 1


def test_the_loop_lag_probe_adds_no_thread_and_no_child_to_the_target(tmp_path: Path) -> None:
    """A probe thread in the target needs its GIL for every probe, and one preempted while holding it
    made the loop sleep on the GIL for milliseconds (a stall the probe then reported): the ticks come
    from another process, which is not the target's child either (`nvmeof bench --target-pid` counts
    the target's descendants as target CPU)."""
    import asyncio
    import os
    import threading

    out = tmp_path / "lag.jsonl"
    seen: dict[str, object] = {}

    def children() -> set[str]:   # of this process (the test run may have some from other tests)
        return {c for t in os.listdir("/proc/self/task")
                for c in Path(f"/proc/self/task/{t}/children").read_text().split()}

    before = (threading.active_count(), children())

    async def serves() -> None:
        await asyncio.sleep(0.25)
        seen.update(threads=threading.active_count(), new_children=children() - before[1])

    lagprobe._wrap(asyncio.run, str(out), 0.001)(serves())
    assert seen == {"threads": before[0], "new_children": set()}
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    assert reports and sum(r["n"] for r in reports) >= 50


def test_libapi_goal_is_the_median_ratio() -> None:
    import libapi

    assert libapi.goal_line([{"ratio": 1.2}, {"ratio": 1.9}, {"ratio": 1.4}]).startswith(
        "[met] library API initiator CPU per I/O <= 1.5x the bench's: median ratio 1.40 (rounds: 1.20, 1.90, 1.40)")
    assert libapi.goal_line([{"ratio": 1.6}, {"ratio": 1.4}, {"ratio": 1.7}]).startswith("[MISSED]")
    assert libapi.goal_line([{"ratio": 1.0}, {"ratio": None}]).startswith("[MISSED]")


async def test_libapi_client_reads_through_host_controller() -> None:
    """The library client of benchmarks/libapi.py, a fraction of a second against an in-process target."""
    import libapi

    from target.core import Target
    from target.service import TargetService
    from tests.ports import free_port

    target = Target()
    service = TargetService(target)
    nqn = "nqn.2026-11.io.nvmeof-toolkit:libapi-test"
    await service.add_subsystem(nqn)
    await service.add_namespace(nqn, backend="ram", size=4 << 20, block_size=512, nsid=1)
    port = free_port()
    await service.add_listener("tcp", "127.0.0.1", port)
    try:
        out = await libapi.library_client("127.0.0.1", port, nqn, 1, 4096, 4, 0.2, 0.05, 1)
    finally:
        await target.close()
    assert out["ios"] > 0 and out["initiator_cpu_us_per_io"] > 0 and out["iops"] > 0
