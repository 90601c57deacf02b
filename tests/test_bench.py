"""`nvmeof bench` engine: histogram math, fio JSON, latency against a known delay, verify."""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import socket
import statistics
from typing import Any

import pytest

from initiator.bench import (
    FIO_PERCENTILES,
    PLAT_NR,
    VERIFY_HEADER_SIZE,
    BenchError,
    ConnectSpec,
    JobSpec,
    LatencyHistogram,
    bucket_index,
    bucket_value,
    check_verify_block,
    fill_verify_block,
    fio_json,
    run_bench,
)
from target.core import Target
from target.service import TargetService
from tests.ports import free_port

NQN = "nqn.2026-11.io.nvmeof-toolkit:bench-test"
NS_SIZE = 16 << 20


# ---- histogram ------------------------------------------------------------------------------------


def test_small_values_have_exact_buckets() -> None:
    for v in range(128):
        assert bucket_index(v) == v
        assert bucket_value(v) == v


def test_bucket_error_is_bounded_and_index_monotonic() -> None:
    rng = random.Random(1)
    values = sorted(rng.randrange(1, 1 << 33) for _ in range(20000))
    last = -1
    for v in values:
        idx = bucket_index(v)
        assert 0 <= idx < PLAT_NR
        assert idx >= last
        last = idx
        # 64 buckets per power of two: the bucket middle is within 1/128 of any value in it
        assert abs(bucket_value(idx) - v) <= v / 128 + 1


def test_bucket_boundaries_match_fio_layout() -> None:
    # 128 ns starts group 2 (index 128) with 2 ns wide buckets; 256 ns starts group 3 (index 192)
    assert bucket_index(128) == 128 and bucket_index(129) == 128 and bucket_index(130) == 129
    assert bucket_value(128) == 129.0
    assert bucket_index(255) == 191 and bucket_index(256) == 192
    assert bucket_index(1 << 60) == PLAT_NR - 1


def test_percentiles_of_exact_samples() -> None:
    h = LatencyHistogram()
    for v in (100, 10, 90, 20, 80, 30, 70, 40, 60, 50):
        h.record(v)
    p = h.percentiles((1.0, 10.0, 50.0, 90.0, 99.0, 99.9, 100.0))
    assert p == {1.0: 10, 10.0: 10, 50.0: 50, 90.0: 90, 99.0: 100, 99.9: 100, 100.0: 100}
    assert (h.min, h.max, h.count, h.mean) == (10, 100, 10, 55.0)
    assert h.stdev == pytest.approx(statistics.stdev(range(10, 101, 10)))


def test_percentiles_of_a_uniform_range() -> None:
    h = LatencyHistogram()
    samples = [i * 1000 for i in range(1, 10001)]   # 1 us .. 10 ms
    random.Random(2).shuffle(samples)
    for v in samples:
        h.record(v)
    pct = h.percentiles((50.0, 90.0, 99.0, 99.9))
    for p, expected in ((50.0, 5_000_000), (90.0, 9_000_000), (99.0, 9_900_000), (99.9, 9_990_000)):
        assert abs(pct[p] - expected) <= expected / 64, (p, pct[p])
    assert h.percentile(100.0) == 10_000_000 == h.max
    assert h.min == 1000
    assert h.mean == pytest.approx(statistics.fmean(samples))
    assert h.stdev == pytest.approx(statistics.stdev(samples))


def test_merge_and_pickle_equal_one_histogram() -> None:
    rng = random.Random(3)
    values = [int(rng.lognormvariate(11, 1)) for _ in range(5000)]
    whole, a, b = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    for i, v in enumerate(values):
        whole.record(v)
        (a if i % 3 else b).record(v)
    a.merge(pickle.loads(pickle.dumps(b)))
    assert a.buckets == whole.buckets
    assert (a.count, a.total, a.total_sq, a.min, a.max) == (whole.count, whole.total, whole.total_sq,
                                                            whole.min, whole.max)
    assert a.percentiles() == whole.percentiles()


def test_empty_histogram() -> None:
    h = LatencyHistogram()
    assert h.mean == 0.0 and h.stdev == 0.0
    assert set(h.percentiles().values()) == {0}


# ---- verify pattern -------------------------------------------------------------------------------


def test_verify_block_round_trip_and_each_field() -> None:
    buf = memoryview(bytearray(4096))
    fill_verify_block(buf, 7, 1000)
    assert check_verify_block(buf, 7, 1000) is None
    assert check_verify_block(buf, 7, 1008) == ("slba", "1008", "1000")
    assert check_verify_block(buf, 8, 1000)[0] == "seed"
    corrupt = bytearray(buf)
    corrupt[VERIFY_HEADER_SIZE + 5] ^= 0x01
    assert check_verify_block(memoryview(corrupt), 7, 1000)[0] == "crc32c"
    assert check_verify_block(memoryview(bytearray(4096)), 7, 1000)[0] == "magic"


# ---- against a target -----------------------------------------------------------------------------


class SlowReads:
    """Wraps a backend: every read takes at least ``delay`` seconds more."""

    def __init__(self, inner: Any, delay: float) -> None:
        self._inner = inner
        self._delay = delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def read(self, offset: int, length: int) -> Any:
        await asyncio.sleep(self._delay)
        return await self._inner.read(offset, length)

    async def read_into(self, offset: int, buf: memoryview) -> None:
        await asyncio.sleep(self._delay)
        await self._inner.read_into(offset, buf)


@pytest.fixture
async def target():
    t = Target(keep_alive_interval=0.1)
    service = TargetService(t)
    await service.add_subsystem(NQN)
    await service.add_namespace(NQN, backend="ram", size=NS_SIZE, block_size=512, nsid=1)
    yield t, service
    await t.close()


def loop_spec(t: Target) -> ConnectSpec:
    return ConnectSpec(transport="loop", traddr="loop", trsvcid=0, subnqn=NQN, target=t)


def namespace(t: Target) -> Any:
    return t.subsystems[NQN].namespaces[1]


async def test_known_delay_gives_latency_and_iops(target) -> None:
    t, _ = target
    ns = namespace(t)
    ns.backend = SlowReads(ns.backend, 0.002)
    spec = JobSpec(rw="randread", bs=4096, iodepth=4, runtime=0.6, time_based=True, ramp_time=0.1)
    report = await run_bench(loop_spec(t), spec)
    (r,) = report.results
    assert r.write.ios == 0
    h = r.read.clat
    assert h.count == r.read.ios > 20
    assert h.min >= 2_000_000
    assert h.mean >= 2_000_000
    # Little's law: in-flight commands = IOPS x latency; never more than iodepth
    in_flight = r.read.iops * h.mean / 1e9
    assert 0.5 * spec.iodepth <= in_flight <= 1.1 * spec.iodepth
    assert r.read.iops <= spec.iodepth / 0.002
    assert r.read.bytes == r.read.ios * 4096


async def test_size_limit_moves_exactly_one_pass(target) -> None:
    t, _ = target
    spec = JobSpec(rw="randrw", rwmixread=70, bs=8192, iodepth=8, size=2 << 20, offset=1 << 20)
    report = await run_bench(loop_spec(t), spec)
    (r,) = report.results
    assert r.read.ios + r.write.ios == (2 << 20) // 8192
    assert r.read.ios > r.write.ios > 0
    assert r.read.bytes + r.write.bytes == 2 << 20


async def test_fio_json_fields(target) -> None:
    t, _ = target
    spec = JobSpec(name="j1", rw="randrw", bs=4096, iodepth=4, size=1 << 20)
    report = await run_bench(loop_spec(t), spec, target_pids=(os.getpid(),))
    doc = fio_json(report, "test")
    assert doc["fio version"] == "nvmeof-bench-test"
    (job,) = doc["jobs"]
    assert job["jobname"] == "j1"
    assert job["read"]["total_ios"] + job["write"]["total_ios"] == 256
    for ddir in ("read", "write"):
        d = job[ddir]
        assert d["total_ios"] > 0
        assert d["runtime"] > 0
        assert d["iops"] == pytest.approx(d["total_ios"] / (d["runtime"] / 1000))
        assert d["bw_bytes"] == pytest.approx(d["io_bytes"] / (d["runtime"] / 1000), abs=1)
        assert d["bw"] == round(d["bw_bytes"] / 1024)
        assert d["io_bytes"] == d["total_ios"] * 4096
        clat = d["clat_ns"]
        assert {"min", "max", "mean", "stddev", "percentile"} <= clat.keys()
        assert clat["min"] <= clat["percentile"]["50.000000"] <= clat["percentile"]["99.900000"] <= clat["max"]
        assert list(clat["percentile"]) == [f"{p:f}" for p in FIO_PERCENTILES]
        assert clat["min"] <= clat["mean"] <= clat["max"]
    cpu = doc["cpu_us_per_io"]
    assert cpu["initiator"] > 0 and cpu["target"] is not None and cpu["target"] >= 0
    assert job["cpu_us_per_io"]["initiator"] == pytest.approx(cpu["initiator"])


async def test_verify_passes_then_catches_a_corrupted_block(target) -> None:
    t, _ = target
    offset = 1 << 20
    spec = JobSpec(rw="randwrite", bs=4096, iodepth=8, size=1 << 20, offset=offset, verify="crc32c")
    report = await run_bench(loop_spec(t), spec)
    (r,) = report.results
    assert r.verify is not None and r.verify.blocks == 256 and r.verify.errors == 0
    assert not report.failed
    # corrupt payload bytes of block 37 of the region, then read back and verify only
    backend = namespace(t).backend
    await backend.write(offset + 37 * 4096 + 1000, b"\xde\xad\xbe\xef")
    check = JobSpec(rw="read", bs=4096, iodepth=4, size=1 << 20, offset=offset, verify="crc32c")
    report = await run_bench(loop_spec(t), check)
    (r,) = report.results
    assert report.failed
    assert r.verify.errors == 1
    first = r.verify.first
    assert (first.block, first.offset, first.slba, first.field) == (37, offset + 37 * 4096,
                                                                     (offset + 37 * 4096) // 512, "crc32c")
    assert "bad block 37" in first.describe()
    doc = fio_json(report, "t")
    assert doc["jobs"][0]["error"] == 84
    assert doc["jobs"][0]["verify"]["first_error"]["block"] == 37


async def test_verify_reports_the_lowest_misplaced_block(target) -> None:
    t, _ = target
    spec = JobSpec(rw="write", bs=4096, iodepth=4, size=256 << 10, verify="crc32c")
    await run_bench(loop_spec(t), spec)
    backend = namespace(t).backend
    block5 = bytes(await backend.read(5 * 4096, 4096))
    await backend.write(40 * 4096, block5)     # a stale copy: valid crc, wrong LBA
    await backend.write(9 * 4096, block5)
    check = JobSpec(rw="randread", bs=4096, iodepth=4, size=256 << 10, verify="crc32c")
    (r,) = (await run_bench(loop_spec(t), check)).results
    assert r.verify.errors == 2
    assert (r.verify.first.block, r.verify.first.field) == (9, "slba")
    assert (r.verify.first.expected, r.verify.first.actual) == (str(9 * 8), str(5 * 8))


async def test_region_errors_name_the_option(target) -> None:
    t, _ = target
    with pytest.raises(BenchError, match=r"--offset .* past the end"):
        await run_bench(loop_spec(t), JobSpec(offset=NS_SIZE, size=4096))
    with pytest.raises(BenchError, match="--size"):
        await run_bench(loop_spec(t), JobSpec(offset=NS_SIZE - 4096, size=8192))
    with pytest.raises(BenchError, match=r"--size 2048: the region is smaller than one --bs 4096 block"):
        await run_bench(loop_spec(t), JobSpec(size=2048))
    with pytest.raises(BenchError, match="--numjobs"):
        await run_bench(loop_spec(t), JobSpec(numjobs=2, size=4096))
    with pytest.raises(BenchError, match="--target-pid"):
        await run_bench(loop_spec(t), JobSpec(size=4096), target_pids=(2 ** 22 + 12345,))


async def test_numjobs_workers_over_tcp(target) -> None:
    _, service = target
    port = free_port()
    await service.add_listener("tcp", "127.0.0.1", port)
    cspec = ConnectSpec(traddr="127.0.0.1", trsvcid=port, subnqn=NQN)
    spec = JobSpec(rw="randread", bs=4096, iodepth=4, numjobs=2, size=512 << 10, group_reporting=True)
    seen: list[int] = []
    report = await run_bench(cspec, spec, progress=lambda e, jobs, phase: seen.append(len(jobs)))
    assert len(report.results) == 2
    assert {r.pid for r in report.results}.isdisjoint({os.getpid()})
    assert [r.read.ios for r in report.results] == [128, 128]
    group = report.group()
    assert group.jobs == 2 and group.read.ios == 256 and group.read.clat.count == 256
    (job,) = fio_json(report, "t")["jobs"]
    assert job["read"]["total_ios"] == 256
    assert set(seen) <= {2}


def test_local_listener_pid_finds_the_process_that_listens():
    import os

    from initiator.bench.cpu import local_listener_pid

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert local_listener_pid("127.0.0.1", port) == os.getpid()
        assert local_listener_pid("192.0.2.1", port) is None       # bound to loopback only: not that address
        assert local_listener_pid("not-an-address", port) is None
    assert local_listener_pid("127.0.0.1", port) is None            # closed: nobody listens
    with socket.socket(socket.AF_INET6) as s6:
        s6.bind(("::", 0))
        s6.listen()
        assert local_listener_pid("127.0.0.1", s6.getsockname()[1]) == os.getpid()   # wildcard (dual-stack)
