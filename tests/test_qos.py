"""QoS limits (target/qos.py): the buckets with an injected clock, and a limited namespace on both TCP engines."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import pytest
import test_tcp_batch
from target_host import HOSTNQN, SUBNQN, admin_session, make_target
from test_fast_paths import _batch, _rd, _wr
from test_tcp_batch import _fast_count, _io_recording

from nvmeof import defaults
from target import qos
from target.backends.ram import RamBackend
from target.model import Namespace
from target.qos import MIB, NamespaceQos, QosError, QosLimits, Throttle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def greedy(throttle: Throttle, clock: Clock, seconds: float, *, nbytes: int = 4096, is_read: bool = True) -> int:
    """Commands a host that always has one more to send gets through in ``seconds`` of the fake clock."""
    end = clock.now + seconds
    done = 0
    while True:
        wait = throttle.delay(is_read, nbytes, clock.now)
        if clock.now + wait > end:
            return done
        clock.now += wait
        throttle.charge(is_read, nbytes)
        done += 1


# --- buckets, deterministic -----------------------------------------------------------------------


def test_unlimited_never_waits() -> None:
    clock = Clock()
    t = Throttle(qos.UNLIMITED, clock=clock)
    for _ in range(1000):
        assert t.try_take(True, 1 << 20)


@pytest.mark.parametrize("rate", [1, 200, 5000])
def test_iops_limit_holds_within_the_documented_burst(rate: int) -> None:
    clock = Clock()
    t = Throttle(QosLimits(rw_ios_per_second=rate), clock=clock)
    seconds = 10.0
    done = greedy(t, clock, seconds)
    burst = max(rate * defaults.QOS_BURST_SECONDS, 1.0) + 1   # a full bucket, plus the command that overdraws it
    assert rate * seconds <= done <= rate * seconds + burst


def test_first_commands_take_the_burst_then_wait_one_interval() -> None:
    clock = Clock()
    t = Throttle(QosLimits(rw_ios_per_second=100), clock=clock)   # bucket of 2 (20 ms of 100/s)
    assert [t.try_take(True, 512) for _ in range(4)] == [True, True, True, False]
    assert t.delay(True, 512, clock.now) == pytest.approx(0.01)    # one command in debt: 1/100 s
    clock.now += 0.01
    assert t.try_take(True, 512)


def test_io_larger_than_the_burst_passes_and_its_debt_delays_the_next() -> None:
    # SPDK lets an I/O larger than a timeslice's quota through and carries the debt; so do we.
    clock = Clock()
    t = Throttle(QosLimits(rw_mbytes_per_second=1), clock=clock)   # bucket of 20.97 KB
    assert t.try_take(False, 1 << 20)
    assert t.delay(False, 4096, clock.now) == pytest.approx((MIB - MIB * defaults.QOS_BURST_SECONDS) / MIB)
    assert not t.try_take(False, 4096)


def test_bandwidth_limits_by_direction() -> None:
    clock = Clock()
    t = Throttle(QosLimits(r_mbytes_per_second=1), clock=clock)
    assert t.try_take(True, 1 << 20)
    assert not t.try_take(True, 512)
    assert all(t.try_take(False, 1 << 20) for _ in range(10))   # writes have no limit
    t2 = Throttle(QosLimits(w_mbytes_per_second=2, rw_mbytes_per_second=4), clock=clock)
    done = greedy(t2, clock, 10.0, nbytes=64 * 1024, is_read=False)
    assert done * 64 * 1024 <= (2 * 10 + 2 * defaults.QOS_BURST_SECONDS) * MIB + 64 * 1024
    assert done * 64 * 1024 >= 2 * 10 * MIB - 64 * 1024


def test_bytes_and_ios_both_apply() -> None:
    clock = Clock()
    t = Throttle(QosLimits(rw_ios_per_second=1000, rw_mbytes_per_second=1), clock=clock)
    # 128 KiB commands: the byte limit (8/s) binds long before the IOPS limit
    done = greedy(t, clock, 10.0, nbytes=128 * 1024)
    assert 80 <= done <= 80 + 2


def test_live_change_lowered_keeps_debt_at_the_new_rate_raised_forgives_it() -> None:
    clock = Clock()
    t = Throttle(QosLimits(rw_ios_per_second=100), clock=clock)
    for _ in range(6):
        t.charge(True, 512)          # deep in debt: 6 - 2 (capacity) = 4 commands
    assert t.delay(True, 512, clock.now) == pytest.approx(0.04)
    t.set_limits(QosLimits(rw_ios_per_second=10))
    assert t.delay(True, 512, clock.now) == pytest.approx(0.4)    # lowered: the same debt, paid 10 times slower
    t.set_limits(QosLimits(rw_ios_per_second=10, rw_mbytes_per_second=1))   # the IOPS rate stays: debt stays
    assert t.delay(True, 512, clock.now) == pytest.approx(0.4)
    t.set_limits(QosLimits(rw_ios_per_second=1000, rw_mbytes_per_second=1))
    assert t.delay(True, 512, clock.now) == 0                      # raised: effective at once, the debt is gone
    assert t.try_take(True, 512)
    assert not t.try_take(True, 512)                               # from an empty bucket, not a full one
    for _ in range(10):
        t.charge(True, 4 << 20)                                    # 40 MiB of debt at 1 MiB/s
    t.set_limits(QosLimits(rw_mbytes_per_second=2))                # the IOPS bucket is gone; bytes raised
    assert t.delay(True, 512, clock.now) == 0


async def test_raised_limit_releases_waiting_commands_at_once() -> None:
    clock = Clock()   # frozen: without the raise nobody could go
    t = Throttle(QosLimits(rw_mbytes_per_second=1), clock=clock)
    t.charge(False, 8 << 20)             # a command far larger than the burst: 8 s of debt at 1 MiB/s
    waiting = asyncio.ensure_future(t.take(False, 4096))
    await asyncio.sleep(0)
    assert not waiting.done()
    t.set_limits(QosLimits(rw_mbytes_per_second=100))   # 80 ms of debt at the new rate if it were kept
    await asyncio.sleep(0)
    assert waiting.done()
    t.close()


def test_refund_undoes_a_charge() -> None:
    clock = Clock()
    t = Throttle(QosLimits(rw_ios_per_second=50, rw_mbytes_per_second=1), clock=clock)
    assert t.try_take(True, 1 << 20)
    assert t.delay(True, 1, clock.now) > 0
    t.refund(True, 1 << 20)
    assert t.delay(True, 1, clock.now) == 0


def test_host_and_namespace_limits_both_apply() -> None:
    clock = Clock()
    q = NamespaceQos(QosLimits(rw_ios_per_second=1000), {"nqn.h:a": QosLimits(rw_ios_per_second=50)}, clock=clock)
    taken_a = sum(q.try_take("nqn.h:a", True, 512) for _ in range(100))
    taken_b = sum(q.try_take("nqn.h:b", True, 512) for _ in range(100))
    assert taken_a == 2                  # host a: a bucket of 1 plus one into debt
    assert taken_b == 21 - taken_a       # the namespace's bucket (20) plus one, less what host a took


def test_worker_share_scales_every_rate() -> None:
    clock = Clock()
    t = Throttle(QosLimits(rw_ios_per_second=300), share=1 / 3, clock=clock)
    done = greedy(t, clock, 10.0)
    assert 1000 <= done <= 1000 + 100 * defaults.QOS_BURST_SECONDS + 2


@pytest.mark.parametrize(("values", "field"), [
    ({"rw_ios_per_second": -1}, "rw_ios_per_second"),
    ({"r_mbytes_per_second": defaults.QOS_MBYTES_MAX + 1}, "r_mbytes_per_second"),
    ({"w_mbytes_per_second": True}, "w_mbytes_per_second"),
    ({"rw_mbytes_per_second": 1.5}, "rw_mbytes_per_second"),
    ({"rw_iops": 5}, "rw_iops"),
])
def test_bad_limits_name_the_field(values: dict, field: str) -> None:
    with pytest.raises(QosError, match=field):
        qos.UNLIMITED.merged(values)


def test_config_round_trip_and_errors() -> None:
    item = {"rw_ios_per_second": 200, "hosts": {"nqn.h:a": {"w_mbytes_per_second": 5}}}
    q = qos.build(item)
    assert q is not None and q.config() == item
    assert qos.build({"rw_ios_per_second": 0}) is None
    with pytest.raises(QosError, match=r"qos\.hosts\['nqn.h:a'\]\.r_mbytes_per_second"):
        qos.parse_config({"hosts": {"nqn.h:a": {"r_mbytes_per_second": -3}}})


# --- the waiting queue -----------------------------------------------------------------------------


async def test_waiters_go_in_order_and_a_removed_limit_releases_them() -> None:
    clock = Clock()   # frozen: only a limit change can release anyone
    t = Throttle(QosLimits(rw_ios_per_second=1), clock=clock)
    assert t.try_take(True, 512) and t.try_take(True, 512)
    order: list[int] = []

    async def one(i: int) -> None:
        await t.take(True, 512)
        order.append(i)

    tasks = [asyncio.create_task(one(i)) for i in range(5)]
    await asyncio.sleep(0.01)
    assert order == [] and len(t.waiters) == 5
    assert not t.try_take(True, 512)     # no overtaking the queue
    t.set_limits(QosLimits(rw_ios_per_second=1000))   # the change re-times the queue: one more goes, the
    clock.now += 1.0                                  # next waits 1 ms, by when a second passed: bucket full (20)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == [0, 1, 2, 3, 4]
    late = [asyncio.create_task(one(i)) for i in range(5, 200)]
    await asyncio.sleep(0.01)
    assert len(order) < 200
    t.close()
    await asyncio.wait_for(asyncio.gather(*late), 5)
    assert order == list(range(200))


async def test_cancelled_waiter_does_not_block_the_queue() -> None:
    clock = Clock()
    t = Throttle(QosLimits(rw_ios_per_second=1), clock=clock)
    t.charge(True, 512)
    t.charge(True, 512)
    first = asyncio.create_task(t.take(True, 512))
    second = asyncio.create_task(t.take(True, 512))
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.sleep(0)
    clock.now += 2.0
    t.set_limits(QosLimits(rw_ios_per_second=1))   # re-time: enough tokens for one
    await asyncio.wait_for(second, 5)
    assert first.cancelled()


async def test_due_commands_go_in_one_release_and_the_next_waits_the_release_interval() -> None:
    """One pump lets every command whose turn came go at once; the one timer it arms is never sooner than
    QOS_RELEASE_SECONDS after that release (not one wake-up per command at the rate's spacing)."""
    clock = Clock()
    rate = 2000                                         # a turn every 0.5 ms
    t = Throttle(QosLimits(rw_ios_per_second=rate), clock=clock)
    while t.try_take(True, 512):
        pass
    futs = [asyncio.ensure_future(t.take(True, 512)) for _ in range(40)]
    await asyncio.sleep(0)
    assert t._timer is not None and len(t.waiters) == 40
    clock.now += 0.005                                  # 10 turns came
    before = asyncio.get_running_loop().time()
    t._pump()
    assert len(t.waiters) == 40 - 10 and t.releases == 1
    await asyncio.sleep(0)
    assert sum(f.done() for f in futs) == 10            # woken together, in one loop iteration
    # the next head is due in 0.5 ms, but the timer waits for the interval: its tokens accrue meanwhile
    assert t._timer is not None and t._timer.when() >= before + defaults.QOS_RELEASE_SECONDS
    clock.now += defaults.QOS_RELEASE_SECONDS
    t._pump()
    assert len(t.waiters) == 30 - rate * defaults.QOS_RELEASE_SECONDS and t.releases == 2
    t.close()
    await asyncio.gather(*futs)


async def test_a_first_waiter_after_a_quiet_spell_waits_only_for_its_turn() -> None:
    clock = Clock()
    t = Throttle(QosLimits(rw_ios_per_second=1000), clock=clock)
    while t.try_take(True, 512):
        pass
    before = asyncio.get_running_loop().time()
    fut = asyncio.ensure_future(t.take(True, 512))
    await asyncio.sleep(0)
    # no release happened lately: the timer is the command's turn (1 ms), not the release interval
    assert t._timer is not None and t._timer.when() < before + defaults.QOS_RELEASE_SECONDS
    t.close()
    await fut


async def test_the_timer_is_never_armed_shorter_than_the_loop_can_wait() -> None:
    """uvloop rounds a delay to whole milliseconds: a turn 0.1 ms away would fire at once, again and again,
    spinning the loop until it came. The pump waits at least QOS_TIMER_MIN_SECONDS instead."""
    clock = Clock()
    t = Throttle(QosLimits(rw_ios_per_second=10_000), clock=clock)   # a turn every 0.1 ms
    while t.try_take(True, 512):
        pass
    before = asyncio.get_running_loop().time()
    fut = asyncio.ensure_future(t.take(True, 512))
    await asyncio.sleep(0)
    assert t._timer is not None and t._timer.when() >= before + defaults.QOS_TIMER_MIN_SECONDS
    t.close()
    await fut


# --- a limited namespace on the target ---------------------------------------------------------------


ENGINES = pytest.mark.parametrize("engine", ["stream", "batch"])


async def _limited_target(limits: QosLimits, engine: str, monkeypatch: pytest.MonkeyPatch, *,
                          per_host: bool = False) -> tuple:
    """A target whose nsid 1 has ``limits`` (the namespace's, or with ``per_host`` the connecting host's) and
    nsid 2 none, an admin and an I/O queue, on ``engine``."""
    if engine == "batch":
        test_tcp_batch._use_batch(monkeypatch)
    tgt = make_target()
    sub = tgt.subsystems[SUBNQN]
    sub.namespaces[2] = Namespace(2, RamBackend(1 << 20))
    sub.namespaces[1].qos = NamespaceQos(qos.UNLIMITED, {HOSTNQN: limits}) if per_host else NamespaceQos(limits)
    admin, cntlid = await admin_session(tgt, SUBNQN)
    rec = await _io_recording(tgt, cntlid, sqflow_off=False)
    return tgt, admin, rec


async def _close(tgt, *hosts) -> None:  # type: ignore[no-untyped-def]
    for h in hosts:
        h.close()
    await asyncio.sleep(0.05)
    await tgt.close()


@ENGINES
@pytest.mark.parametrize("per_host", [False, True])
async def test_limited_namespace_is_delayed_and_the_unlimited_one_untouched(
        engine: str, per_host: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    tgt, admin, rec = await _limited_target(QosLimits(rw_ios_per_second=200), engine, monkeypatch,
                                            per_host=per_host)
    data = os.urandom(4096)
    sends = [_wr(i * 8, data, nsid=n) for n in (1, 2) for i in range(4)]
    sends += [_rd(i, 8, nsid=n) for n in (1, 2) for i in range(20)]
    results = await _batch(rec, sends)
    assert [status for status, _ in results] == [0] * len(sends)   # delayed, never failed
    assert results[8][1][:4096] == data                          # a throttled read still reads the data
    ns1, ns2 = (tgt.subsystems[SUBNQN].namespaces[n] for n in (1, 2))
    assert ns1.stats.reads == ns2.stats.reads == 20 and ns1.stats.writes == ns2.stats.writes == 4
    assert ns1.stats.throttled > 0 and ns1.stats.throttled_ns > 0
    assert ns2.stats.throttled == 0 and ns2.stats.throttled_ns == 0
    host = tgt.subsystems[SUBNQN].host_stats
    assert sum(s.throttled for s in host.values()) == ns1.stats.throttled
    if engine == "batch":
        assert _fast_count() >= 24   # the unlimited namespace stayed on the fast path (and ns 1 within its burst)
    await _close(tgt, admin, rec)


@ENGINES
async def test_throttled_command_waits_without_holding_up_others(
        engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tgt, admin, rec = await _limited_target(QosLimits(rw_ios_per_second=1), engine, monkeypatch)
    ns1 = tgt.subsystems[SUBNQN].namespaces[1]
    assert ns1.qos is not None and ns1.qos.namespace is not None
    for _ in range(600):
        ns1.qos.namespace.charge(True, 512)   # ten minutes of debt at 1/s: every command below waits
    first = [rec.send(*_rd(i, 1)[:1], read_len=512) for i in range(4)]
    other = await _batch(rec, [_rd(i, 1, nsid=2) for i in range(16)])
    assert [s for s, _ in other] == [0] * 16
    assert not any(f.done() for f in first)     # the unlimited namespace went by the waiting commands
    # a live change applies to the commands waiting: without the limit they go at once
    assert ns1.qos is not None
    ns1.qos.close()
    ns1.qos = None
    results = await asyncio.wait_for(asyncio.gather(*first), 5)
    assert [r.status for r in results] == [0] * 4
    assert ns1.stats.throttled == 4
    await _close(tgt, admin, rec)


async def test_a_stalled_loop_does_not_cost_waiting_commands_their_turn() -> None:
    """Commands waiting while the process could not run go when it runs again (up to QOS_CATCHUP_SECONDS late);
    tokens nobody waited for stay capped at the burst."""
    clock = Clock()
    rate = 100
    t = Throttle(QosLimits(rw_ios_per_second=rate), clock=clock)   # burst 2
    while t.try_take(True, 512):
        pass                                   # bucket in debt by one
    futs = [asyncio.ensure_future(t.take(True, 512)) for _ in range(200)]
    await asyncio.sleep(0)
    clock.now += 0.2 + 1 / rate                # the loop stalled 200 ms past the first turn
    t._pump()
    released = 200 - len(t.waiters)
    assert released == 0.2 * rate + 1          # each command whose turn came during the stall goes now
    clock.now += 10.0                          # a stall longer than the catch-up: at most that much goes
    t._pump()
    released = 200 - len(t.waiters) - released
    cap = max(rate * defaults.QOS_BURST_SECONDS, 1) + rate * defaults.QOS_CATCHUP_SECONDS
    assert released == int(cap) + 1
    t.close()
    await asyncio.gather(*futs)
    # idle time fills only the burst
    clock.now += 10.0
    assert sum(t.try_take(True, 512) for _ in range(100)) == 0 + 100   # no limit now (closed)
    t.set_limits(QosLimits(rw_ios_per_second=rate))
    clock.now += 10.0
    assert sum(t.try_take(True, 512) for _ in range(100)) == max(rate * defaults.QOS_BURST_SECONDS, 1) + 1


async def _in_one_wakeup(rec: Any, reads: int, writes: Sequence[bytes] = ()) -> list[Any]:
    """``reads`` 512-byte reads (cids 0..) and one write per item of ``writes`` (cids 100..) sent in one wake-up
    of the target, then the loop run a few rounds: their futures."""
    rec.hold = True
    futs = [rec.send(*_rd(i, 1)[:1], read_len=512) for i in range(reads)]
    futs += [rec.send(*_wr(100 + i, data)[:2]) for i, data in enumerate(writes)]
    rec.hold = False
    rec.flush()
    for _ in range(20):
        await asyncio.sleep(0)
    return futs


@ENGINES
async def test_commands_released_together_answer_in_one_write(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replies of the commands one QoS release lets go leave in one write, not one each (the host then
    sends its next commands together too)."""
    tgt, admin, rec = await _limited_target(QosLimits(rw_ios_per_second=1), engine, monkeypatch)
    ns1 = tgt.subsystems[SUBNQN].namespaces[1]
    assert ns1.qos is not None and ns1.qos.namespace is not None
    for _ in range(600):
        ns1.qos.namespace.charge(True, 512)   # every command below waits
    data = os.urandom(512)
    futs = await _in_one_wakeup(rec, 12, [data] * 4)
    assert len(ns1.qos.namespace.waiters) == 16 and not any(f.done() for f in futs)
    writes: list[int] = []
    deliver = rec.data_received

    def counting(chunk: bytes) -> None:
        writes.append(len(chunk))
        deliver(chunk)

    monkeypatch.setattr(rec, "data_received", counting)
    ns1.qos.namespace.close()   # the limit removed: one release lets all 16 go
    results = await asyncio.wait_for(asyncio.gather(*futs), 5)
    assert [r.status for r in results] == [0] * 16
    assert len(writes) == 1, f"the target answered the released commands in {len(writes)} writes"
    assert ns1.stats.throttled == 16
    await _close(tgt, admin, rec)


async def test_batch_fast_path_takes_the_tokens_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read the limit delays is not read by the fast path first (and again when it goes)."""
    calls: list[int] = []

    class CountingRam(RamBackend):
        def memory_view(self) -> memoryview | None:
            return None   # not the RAM disk's hot lane: the fast path calls read_nowait

        def read_nowait(self, offset: int, length: int) -> memoryview:
            calls.append(offset)
            return super().read_nowait(offset, length)

    test_tcp_batch._use_batch(monkeypatch)
    tgt = make_target()
    sub = tgt.subsystems[SUBNQN]
    sub.namespaces[1] = Namespace(1, CountingRam(1 << 20))
    sub.namespaces[1].qos = NamespaceQos(QosLimits(rw_ios_per_second=1))
    admin, cntlid = await admin_session(tgt, SUBNQN)
    rec = await _io_recording(tgt, cntlid, sqflow_off=False)
    ns1 = sub.namespaces[1]
    assert ns1.qos is not None and ns1.qos.namespace is not None
    for _ in range(2):
        ns1.qos.namespace.charge(True, 512)   # the bucket (1) is spent and in debt: every read waits
    futs = await _in_one_wakeup(rec, 8)
    assert len(ns1.qos.namespace.waiters) == 8
    assert calls == [], "the fast path read data for commands the limit then delayed"
    ns1.qos.close()
    ns1.qos = None
    results = await asyncio.wait_for(asyncio.gather(*futs), 5)
    assert [r.status for r in results] == [0] * 8
    await _close(tgt, admin, rec)


# --- the batch engine parks a limited read (no Request, no Task) and runs it inline when it goes -----------


def _parked() -> int:
    return sum(len(c._parked) for c in test_tcp_batch.BatchLoopConnection.instances)


def _tasks() -> int:
    return sum(len(c._tasks) for c in test_tcp_batch.BatchLoopConnection.instances)


@pytest.mark.parametrize("per_host", [False, True])
async def test_batch_parks_a_limited_read_and_runs_it_inline_when_let_go(
        per_host: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    test_tcp_batch.BatchLoopConnection.instances.clear()
    tgt, admin, rec = await _limited_target(QosLimits(rw_ios_per_second=1), "batch", monkeypatch,
                                            per_host=per_host)
    ns1 = tgt.subsystems[SUBNQN].namespaces[1]
    data = os.urandom(4096)
    ns1.backend.memory_view()[:4096] = data
    assert ns1.qos is not None
    throttle = ns1.qos.hosts[HOSTNQN] if per_host else ns1.qos.namespace
    assert throttle is not None
    for _ in range(600):
        throttle.charge(True, 512)   # every read below waits
    futs = await _in_one_wakeup(rec, 8)
    assert len(throttle.waiters) == 8 and not any(f.done() for f in futs)
    assert _parked() == 8 and _tasks() == 0   # waiting without a Request or a Task each
    fast = _fast_count()
    throttle.close()   # the limit removed: the parked reads go
    results = await asyncio.wait_for(asyncio.gather(*futs), 5)
    assert [r.status for r in results] == [0] * 8
    assert [r.data for r in results] == [data[i * 512:(i + 1) * 512] for i in range(8)]
    assert _fast_count() - fast == 8 and _parked() == 0
    assert ns1.stats.throttled == 8 and ns1.stats.reads == 8
    await _close(tgt, admin, rec)


async def test_parked_reads_leave_the_queue_when_their_connection_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    test_tcp_batch.BatchLoopConnection.instances.clear()
    tgt, admin, rec = await _limited_target(QosLimits(rw_ios_per_second=1), "batch", monkeypatch)
    ns1 = tgt.subsystems[SUBNQN].namespaces[1]
    assert ns1.qos is not None and ns1.qos.namespace is not None
    throttle = ns1.qos.namespace
    for _ in range(600):
        throttle.charge(True, 512)
    for i in range(4):
        rec.send(*_rd(i, 1)[:1], read_len=512)
    for _ in range(20):
        await asyncio.sleep(0)
    assert _parked() == 4
    rec.close()
    await asyncio.sleep(0.05)
    assert _parked() == 0
    assert [w for w in throttle.waiters if not w[0].done()] == []   # nothing left to release into a closed queue
    await _close(tgt, admin)


async def test_parked_read_of_a_namespace_disabled_meanwhile_gets_io_parse_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    test_tcp_batch.BatchLoopConnection.instances.clear()
    tgt, admin, rec = await _limited_target(QosLimits(rw_ios_per_second=1), "batch", monkeypatch)
    ns1 = tgt.subsystems[SUBNQN].namespaces[1]
    assert ns1.qos is not None and ns1.qos.namespace is not None
    for _ in range(600):
        ns1.qos.namespace.charge(True, 512)
    futs = [rec.send(*_rd(i, 1)[:1], read_len=512) for i in range(2)]
    for _ in range(20):
        await asyncio.sleep(0)
    assert _parked() == 2
    ns1.enabled = False
    ns1.qos.close()
    results = await asyncio.wait_for(asyncio.gather(*futs), 5)
    assert [r.status & 0x7FF for r in results] == [0x00B, 0x00B]   # Invalid Namespace, as io.parse answers
    await _close(tgt, admin, rec)


async def test_parked_read_whose_backend_would_wait_is_charged_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let go, a parked read whose backend cannot answer inline runs through the lifecycle with its tokens
    already taken: it does not queue at the limit a second time."""
    class SlowRam(RamBackend):
        def memory_view(self) -> memoryview | None:
            return None

        def read_nowait(self, offset: int, length: int) -> memoryview | None:
            return None   # always "would wait": read() answers

    charges: list[int] = []
    real_charge = Throttle.charge

    def counting(self: Throttle, is_read: bool, nbytes: int, ios: int = 1) -> None:
        charges.append(ios)
        real_charge(self, is_read, nbytes, ios)

    test_tcp_batch.BatchLoopConnection.instances.clear()
    tgt, admin, rec = await _limited_target(QosLimits(rw_ios_per_second=1), "batch", monkeypatch)
    sub = tgt.subsystems[SUBNQN]
    ns1 = Namespace(1, SlowRam(1 << 20))
    ns1.qos = NamespaceQos(QosLimits(rw_ios_per_second=1))
    sub.namespaces[1] = ns1
    assert ns1.qos.namespace is not None
    for _ in range(600):
        ns1.qos.namespace.charge(True, 512)
    monkeypatch.setattr(Throttle, "charge", counting)
    futs = [rec.send(*_rd(i, 1)[:1], read_len=512) for i in range(3)]
    for _ in range(20):
        await asyncio.sleep(0)
    assert _parked() == 3
    ns1.qos.update(QosLimits(rw_ios_per_second=100_000), {})   # raised: the debt is forgiven, they go
    results = await asyncio.wait_for(asyncio.gather(*futs), 5)
    assert [r.status for r in results] == [0] * 3
    assert charges.count(1) == 3 and -1 not in charges   # each charged once, none refunded and charged again
    assert ns1.stats.throttled == 3 and ns1.stats.reads == 3
    await _close(tgt, admin, rec)
