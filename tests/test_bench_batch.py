"""`nvmeof bench` on the host's batch engine: the callback-driven slots (initiator/bench/batch.py) keep
fio's stop rules and counters, and the reference model (HostQueue alone: every PDU through the sans-IO
TcpConnection) and polling give the same counts."""

from __future__ import annotations

from typing import Any

import pytest

from initiator.bench import ConnectSpec, JobSpec, run_bench
from initiator.controller import HostController
from target.core import Target
from target.service import TargetService
from tests.ports import free_port

NQN = "nqn.2026-11.io.nvmeof-toolkit:bench-batch"


@pytest.fixture
async def tcp_target():
    t = Target(keep_alive_interval=0.1)
    service = TargetService(t)
    await service.add_subsystem(NQN)
    await service.add_namespace(NQN, backend="ram", size=8 << 20, block_size=512, nsid=1)
    port = free_port()
    await service.add_listener("tcp", "127.0.0.1", port)
    yield port
    await t.close()


@pytest.mark.parametrize(("engine", "poll_us", "queues"), [("batch", 0, 1), ("batch", 50, 2), ("stream", 0, 1)])
async def test_size_limit_and_mix_on_each_engine(tcp_target: int, driver_runs: list[Any], engine: str,
                                                 poll_us: int, queues: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # "stream": the reference model the batch engine's fast path is checked against (tests only, no user switch)
    monkeypatch.setattr(HostController, "_reference_queues", engine == "stream")
    cspec = ConnectSpec(traddr="127.0.0.1", trsvcid=tcp_target, subnqn=NQN, poll_us=poll_us, nr_io_queues=queues)
    spec = JobSpec(rw="randrw", rwmixread=70, bs=8192, iodepth=8, size=2 << 20, offset=1 << 20)
    report = await run_bench(cspec, spec)
    (r,) = report.results
    assert r.read.ios + r.write.ios == (2 << 20) // 8192
    assert r.read.ios > r.write.ios > 0
    assert r.read.clat.count == r.read.ios and r.write.clat.count == r.write.ios
    assert r.usr_s + r.sys_s > 0
    (driver,) = driver_runs
    assert (driver is not None) == (engine == "batch")


async def test_time_based_batch_job_and_verify(tcp_target: int, driver_runs: list[Any]) -> None:
    cspec = ConnectSpec(traddr="127.0.0.1", trsvcid=tcp_target, subnqn=NQN)
    spec = JobSpec(rw="randread", bs=4096, iodepth=16, runtime=0.3, time_based=True, ramp_time=0.1)
    (r,) = (await run_bench(cspec, spec)).results
    assert r.read.ios > 0 and r.runtime_ns > 0 and driver_runs[0] is not None
    # a write pass then a read pass of every block, through the same engine (verify runs its own loop)
    spec = JobSpec(rw="randwrite", bs=4096, iodepth=8, size=1 << 20, verify="crc32c")
    (r,) = (await run_bench(cspec, spec)).results
    assert r.verify is not None and r.verify.errors == 0 and r.verify.blocks == (1 << 20) // 4096


async def test_more_slots_than_free_cids_takes_the_coroutine_path(tcp_target: int, driver_runs: list[Any]) -> None:
    cspec = ConnectSpec(traddr="127.0.0.1", trsvcid=tcp_target, subnqn=NQN, queue_size=4)
    spec = JobSpec(rw="randread", bs=4096, iodepth=8, size=256 << 10)
    (r,) = (await run_bench(cspec, spec)).results
    assert r.read.ios == 64 and driver_runs == [None]


def test_record_many_equals_record_one_by_one() -> None:
    import random

    from initiator.bench.histogram import LatencyHistogram

    rng = random.Random(5)
    samples = [0, 1, 127, 128, 129, 1 << 40, *(int(rng.expovariate(1e-5)) for _ in range(5000))]
    one, many = LatencyHistogram(), LatencyHistogram()
    for ns in samples:
        one.record(ns)
    many.record_many(samples[:100])
    many.record_many(samples[100:])
    many.record_many([])
    assert (one.buckets, one.count, one.total, one.total_sq, one.min, one.max) == (
        many.buckets, many.count, many.total, many.total_sq, many.min, many.max)
