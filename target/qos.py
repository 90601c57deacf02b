"""QoS: read/write rate limits per namespace, and per host on a namespace. Commands are delayed, never failed.

The limits are SPDK's (bdev_set_qos_limit) under the Ceph gateway's names (``namespace set_qos``):
``rw_ios_per_second`` (reads and writes together), ``rw_mbytes_per_second``, ``r_mbytes_per_second``,
``w_mbytes_per_second``; 0 is unlimited; 1 MB is 2**20 bytes, as SPDK converts its rpc value.

SPDK (lib/bdev/bdev.c) gives each limit a quota per 1 ms timeslice and lets an I/O through while the
quota left is positive, charging its whole size: one larger than a slice drives the quota negative and
the next slices pay the debt (bdev_qos_rw_queue_io, bdev_qos_reset_timeslice); quota left over at the
end of a slice is dropped. Here each limit is a token bucket refilled continuously at its rate (no
timeslice timer), with the same rule: a command goes when every bucket it draws on is not in debt, and
takes its whole cost, so any size passes and the debt delays what follows. While no command waits a bucket
holds at most QOS_BURST_SECONDS of its rate, so over any interval T a limit lets through at most
``rate * (T + QOS_BURST_SECONDS)`` plus one command (the one that went into debt): the documented burst.

SPDK's poller owns a core; our event loop shares one, and a process that is not scheduled for longer than
the burst (a loaded machine stalls it 50-300 ms) would lose the tokens of that time although commands were
waiting for them: measured, a 200 IOPS limit gave 130-155 IOPS under load. So while commands wait, the
bucket may fill past its burst by up to QOS_CATCHUP_SECONDS of its rate: a waiting command whose turn came
during a stall goes when the loop runs again, as it would have on time. After a stall the commands it held
back leave together; over any interval that contains the stall the rate still holds, and no interval sees
more than ``rate * (T + QOS_BURST_SECONDS + QOS_CATCHUP_SECONDS)`` plus one command. Tokens a waiting queue
did not use are dropped back to the burst once it is empty.

Commands let go together answer together: a throttle wakes at most every QOS_RELEASE_SECONDS (one timer
per throttle, never one per command) and lets go every waiting command whose turn came by then; the tokens of
that interval stay in the bucket (it may hold up to the catch-up while commands wait), so the rate holds, and a
waiting command goes at most that much later than its turn. Each of them is marked (``Request.coalesce``) and
the TCP transports send the replies of one release in one write at the end of the loop iteration that runs
them, instead of one ``sendmsg`` each: a host at a limit then sees its replies, and sends its next commands, in
batches, and a limited namespace's I/O stops costing the target what a QD1 I/O does (which took the CPU an
unlimited namespace beside it needed). SPDK's QoS releases its queued I/O once per 1 ms timeslice the same way
(bdev_qos_reset_timeslice, then bdev_qos_io_submit).

A raised limit takes effect at once: the debt a bucket ran up at the old, lower rate is forgiven (a command
larger than the burst must not keep a namespace at its old rate for seconds after the operator raised it); a
lowered one keeps its debt, paid at the new rate.

Waiting commands queue in arrival order per bucket set (a small command does not overtake a large one
that waits, so none starves). Like SPDK, only Read, Write (and Compare, a read) are limited; Flush,
Write Zeroes and Dataset Management are not. Buckets are pure and take ``now`` from the caller, so
tests drive them with their own clock.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from nvmeof import defaults
from target import schema

MIB = 1 << 20
LIMIT_KEYS = tuple(schema.QOS)  # the limits and their ranges are declared there
# A bucket within this many seconds of refill counts as refilled: the timer that wakes a waiter fires
# at the computed instant, and rounding must not make it sleep again for a microsecond.
_SLACK = 1e-6


class QosError(ValueError):
    """A limit that is not a whole number in range; the message names the field."""


@dataclass(frozen=True, slots=True)
class QosLimits:
    rw_ios_per_second: int = 0
    rw_mbytes_per_second: int = 0
    r_mbytes_per_second: int = 0
    w_mbytes_per_second: int = 0

    def limited(self) -> bool:
        return any(getattr(self, key) for key in LIMIT_KEYS)

    def as_dict(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in LIMIT_KEYS}

    def merged(self, values: Mapping[str, Any], where: str = "") -> QosLimits:
        """These limits with ``values`` laid over them (keys not given stay); QosError names a bad field."""
        out = self.as_dict()
        for key, value in values.items():
            name = f"{where}{key}"
            if key not in LIMIT_KEYS:
                raise QosError(f"unknown QoS limit {name!r} (the limits are {', '.join(LIMIT_KEYS)})")
            if value is None:
                continue
            if not schema.is_json(int, value):
                raise QosError(f"{name} must be a whole number, got {value!r}")
            limit = schema.QOS[key].range
            assert limit is not None  # schema.QOS declares each limit with its range, 0 (unlimited) first
            if not limit.accepts(value):
                raise QosError(f"{name} must be 0 (unlimited) .. {limit.high}, got {value}")
            out[key] = value
        return QosLimits(**out)


UNLIMITED = QosLimits()
assert tuple(f.name for f in fields(QosLimits)) == LIMIT_KEYS


class Bucket:
    """One rate: tokens refill at ``rate`` per second up to ``capacity``; a charge may leave it in debt."""

    __slots__ = ("capacity", "catchup", "rate", "stamp", "tokens")

    def __init__(self, rate: float, now: float, tokens: float | None = None) -> None:
        self.rate = rate
        # At least one unit, so that a bucket whose burst rounds below one I/O still lets one through.
        self.capacity = max(rate * defaults.QOS_BURST_SECONDS, 1.0)
        self.catchup = self.capacity + rate * defaults.QOS_CATCHUP_SECONDS   # the cap while commands wait
        self.tokens = self.capacity if tokens is None else min(tokens, self.capacity)
        self.stamp = now

    def refill(self, now: float, waiting: bool = False) -> None:
        if now > self.stamp:
            cap = self.catchup if waiting else self.capacity
            self.tokens = min(cap, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def settle(self) -> None:
        """The queue emptied: what it did not use is dropped back to the burst."""
        if self.tokens > self.capacity:
            self.tokens = self.capacity

    def wait(self, now: float, waiting: bool = False) -> float:
        """Seconds until this bucket is out of debt (0: a command may take from it now)."""
        self.refill(now, waiting)
        if self.tokens >= -self.rate * _SLACK:
            return 0.0
        return -self.tokens / self.rate


class Throttle:
    """The buckets of one limit set (a namespace's, or one host's on a namespace), and the commands waiting.

    ``share`` scales every rate: a worker process enforces its share of the namespace's limit."""

    def __init__(self, limits: QosLimits, *, share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.share = share
        self.limits = UNLIMITED
        self._ios: Bucket | None = None
        self._rw: Bucket | None = None
        self._r: Bucket | None = None
        self._w: Bucket | None = None
        # [future, is_read, nbytes]; a cancelled waiter's future is done and is skipped
        self.waiters: collections.deque[list[Any]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._released_at = -defaults.QOS_RELEASE_SECONDS   # clock time of the last release (the pump's pace)
        self.releases = 0                                   # pump runs that let commands go (tests, diagnostics)
        self.set_limits(limits)

    def set_limits(self, limits: QosLimits) -> None:
        """Change the rates live: a bucket kept keeps its tokens (a lowered one its debt, now paid at the new
        rate; a raised one forgets its debt), a new one starts full; the commands waiting are re-timed at once
        (released when the limit is gone)."""
        now = self.clock()
        old = {"_ios": self._ios, "_rw": self._rw, "_r": self._r, "_w": self._w}
        rates = {"_ios": limits.rw_ios_per_second, "_rw": limits.rw_mbytes_per_second * MIB,
                 "_r": limits.r_mbytes_per_second * MIB, "_w": limits.w_mbytes_per_second * MIB}
        for name, rate in rates.items():
            prev = old[name]
            if not rate:
                setattr(self, name, None)
                continue
            tokens = None
            if prev is not None:
                prev.refill(now)
                tokens = prev.tokens
                if rate * self.share > prev.rate and tokens < 0:
                    tokens = 0.0   # raised: the debt run up at the lower rate is forgiven, the new rate applies now
            setattr(self, name, Bucket(rate * self.share, now, tokens))
        self.limits = limits
        if self.waiters:
            self._pump()

    def delay(self, is_read: bool, nbytes: int, now: float, waiting: bool = False) -> float:
        """Seconds until a command of this kind may go (0: now); ``waiting``: the queue's head asks."""
        wait = 0.0
        for bucket in (self._ios, self._rw, self._r if is_read else self._w):
            if bucket is not None:
                wait = max(wait, bucket.wait(now, waiting))
        return wait

    def charge(self, is_read: bool, nbytes: int, ios: int = 1) -> None:
        if self._ios is not None:
            self._ios.tokens -= ios
        if self._rw is not None:
            self._rw.tokens -= nbytes
        bucket = self._r if is_read else self._w
        if bucket is not None:
            bucket.tokens -= nbytes

    def refund(self, is_read: bool, nbytes: int) -> None:
        """Undo a charge (the command did not run after all)."""
        self.charge(is_read, -nbytes, ios=-1)

    def try_take(self, is_read: bool, nbytes: int) -> bool:
        """Charge and return True when the command may go now without overtaking a waiting one."""
        if self.waiters or self.delay(is_read, nbytes, self.clock()):
            return False
        self.charge(is_read, nbytes)
        return True

    async def take(self, is_read: bool, nbytes: int) -> None:
        """Wait (in arrival order) until the command may go, then charge it."""
        if self.try_take(is_read, nbytes):
            return
        fut = asyncio.get_running_loop().create_future()
        self._enqueue(fut, is_read, nbytes)
        try:
            await fut
        except asyncio.CancelledError:
            # Gone while waiting (its queue was torn down): charged only if the pump had let it through.
            if self.waiters and self.waiters[0][0] is fut:
                self._pump()
            raise

    def _enqueue(self, waiter: Any, is_read: bool, nbytes: int) -> None:
        """Queue a waiter (a future, or a Parked command: anything with done() and set_result())."""
        self.waiters.append([waiter, is_read, nbytes])
        if len(self.waiters) == 1:
            self._pump()

    def _pump(self) -> None:
        """Let the head waiters go while the buckets allow, all in this one call (their replies leave
        together); arm one timer for the next, no sooner than QOS_RELEASE_SECONDS after this release."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiters = self.waiters
        now = self.clock()
        released = False
        while waiters:
            fut, is_read, nbytes = waiters[0]
            if fut.done():
                waiters.popleft()
                continue
            wait = self.delay(is_read, nbytes, now, waiting=True)
            if wait:
                if released:
                    self._released_at = now
                    self.releases += 1
                # The head's turn, or the end of the release interval if that is later: the tokens of the
                # interval accrue meanwhile (the bucket holds up to its catch-up while commands wait). Never
                # less than QOS_TIMER_MIN_SECONDS: uvloop (libuv) rounds a delay to whole milliseconds, so a
                # shorter one fires at once, and re-arming for the rest spun the loop until the turn came.
                wait = max(wait, self._released_at + defaults.QOS_RELEASE_SECONDS - now, defaults.QOS_TIMER_MIN_SECONDS)
                self._timer = asyncio.get_running_loop().call_later(wait, self._pump)
                return
            waiters.popleft()
            self.charge(is_read, nbytes)
            fut.set_result(None)
            released = True
        if released:
            self._released_at = now
            self.releases += 1
        for bucket in (self._ios, self._rw, self._r, self._w):
            if bucket is not None:
                bucket.settle()

    def close(self) -> None:
        """Limit removed: release everything waiting."""
        self.set_limits(UNLIMITED)


class Parked:
    """A command the batch engine parked at a limit instead of handing it to io.parse's road (no Request,
    no Task, no future): it waits in the throttles' queues like a ``take`` and ``go(self)`` is called, from
    the pump, once its host's throttle and then its namespace's let it through (charged). ``cancel`` takes
    it out (its connection closed); a throttle that already let it go keeps the charge, as ``take`` does."""

    __slots__ = ("at", "cmd", "go", "is_read", "nbytes", "next", "state", "waiting_on")

    def __init__(self, is_read: bool, nbytes: int, go: Callable[[Parked], None], next_throttle: Throttle | None,
                 at: Throttle | None) -> None:
        self.is_read = is_read
        self.nbytes = nbytes
        self.go = go
        self.next = next_throttle   # the namespace's throttle, while the host's is the one waited on
        self.waiting_on = at
        self.state = 0              # 0 waiting, 1 let through, 2 cancelled
        self.at = time.perf_counter_ns()
        self.cmd: Any = None        # the caller's: what to run when it goes

    def done(self) -> bool:
        return self.state != 0 or self.waiting_on is None

    def set_result(self, _value: Any) -> None:
        """The throttle waited on let it through (and charged it): on to the next, or go."""
        nxt = self.next
        self.next = None
        if nxt is not None and not nxt.try_take(self.is_read, self.nbytes):
            self.waiting_on = nxt
            nxt._enqueue(self, self.is_read, self.nbytes)
            return
        self.waiting_on = None
        self.state = 1
        self.go(self)

    def cancel(self) -> None:
        throttle = self.waiting_on
        if self.state or throttle is None:
            return
        self.state = 2
        self.waiting_on = None
        if throttle.waiters and throttle.waiters[0][0] is self:
            throttle._pump()   # the next in line must not wait behind a command that left


class NamespaceQos:
    """A namespace's throttles: its own limit and per-host limits. A command passes its host's, then the
    namespace's. ``share`` (a worker process's part of the rates) applies to both."""

    def __init__(self, limits: QosLimits = UNLIMITED, hosts: Mapping[str, QosLimits] | None = None, *,
                 share: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.clock = clock
        self.namespace: Throttle | None = None
        self.hosts: dict[str, Throttle] = {}
        self.limits = UNLIMITED
        self.host_limits: dict[str, QosLimits] = {}
        self.update(limits, hosts or {})

    def limited(self) -> bool:
        return self.namespace is not None or bool(self.hosts)

    def update(self, limits: QosLimits, hosts: Mapping[str, QosLimits]) -> None:
        """Apply new limits live (throttles kept where a limit stays, so waiting commands keep their place)."""
        self.limits = limits
        self.host_limits = {h: lim for h, lim in hosts.items() if lim.limited()}
        self.namespace = self._retune(self.namespace, limits)
        for hostnqn in set(self.hosts) | set(self.host_limits):
            throttle = self._retune(self.hosts.get(hostnqn), self.host_limits.get(hostnqn, UNLIMITED))
            if throttle is None:
                self.hosts.pop(hostnqn, None)
            else:
                self.hosts[hostnqn] = throttle

    def _retune(self, throttle: Throttle | None, limits: QosLimits) -> Throttle | None:
        if not limits.limited():
            if throttle is not None:
                throttle.close()
            return None
        if throttle is None:
            return Throttle(limits, share=self.share, clock=self.clock)
        throttle.set_limits(limits)
        return throttle

    def close(self) -> None:
        self.update(UNLIMITED, {})

    def try_take(self, hostnqn: str, is_read: bool, nbytes: int) -> bool:
        """The batch fast path's check: True (and charged) when the command may run now, inline."""
        host = self.hosts.get(hostnqn)
        ns = self.namespace
        now = self.clock()
        for throttle in (host, ns):
            if throttle is not None and (throttle.waiters or throttle.delay(is_read, nbytes, now)):
                return False
        for throttle in (host, ns):
            if throttle is not None:
                throttle.charge(is_read, nbytes)
        return True

    def refund(self, hostnqn: str, is_read: bool, nbytes: int) -> None:
        for throttle in (self.hosts.get(hostnqn), self.namespace):
            if throttle is not None:
                throttle.refund(is_read, nbytes)

    async def take(self, hostnqn: str, is_read: bool, nbytes: int) -> int:
        """Wait until the command may go; returns the nanoseconds it waited (0: not throttled)."""
        if self.try_take(hostnqn, is_read, nbytes):
            return 0
        start = time.perf_counter_ns()
        host = self.hosts.get(hostnqn)
        if host is not None:
            await host.take(is_read, nbytes)
        ns = self.namespace
        if ns is not None:
            await ns.take(is_read, nbytes)
        return max(1, time.perf_counter_ns() - start)

    def park(self, hostnqn: str, is_read: bool, nbytes: int, go: Callable[[Parked], None], cmd: Any = None) -> Parked:
        """``take`` without a coroutine, for a command ``try_take`` refused: it queues (host's throttle, then the
        namespace's, FIFO with every other waiter) and ``go`` is called once it is let through and charged."""
        host = self.hosts.get(hostnqn)
        ns = self.namespace
        first = host if host is not None else ns
        if first is None:   # no limit left: let through at once
            parked = Parked(is_read, nbytes, go, None, None)
            parked.cmd = cmd
            parked.set_result(None)
            return parked
        parked = Parked(is_read, nbytes, go, ns if host is not None else None, first)
        parked.cmd = cmd
        if first.try_take(is_read, nbytes):
            parked.set_result(None)
        else:
            first._enqueue(parked, is_read, nbytes)
        return parked

    def config(self) -> dict[str, Any]:
        """The config-file form: the namespace's non-zero limits and ``hosts`` {hostnqn: limits}."""
        out: dict[str, Any] = {k: v for k, v in self.limits.as_dict().items() if v}
        if self.host_limits:
            out["hosts"] = {h: {k: v for k, v in lim.as_dict().items() if v}
                            for h, lim in sorted(self.host_limits.items())}
        return out


def parse_config(item: Any, where: str = "qos") -> tuple[QosLimits, dict[str, QosLimits]]:
    """A namespace's ``qos`` entry (NamespaceQos.config form) -> (limits, per-host limits); QosError names
    the bad field."""
    if item is None:
        return UNLIMITED, {}
    if not isinstance(item, dict):
        raise QosError(f"{where} must be an object, got {type(item).__name__}")
    hosts_item = item.get("hosts") or {}
    if not isinstance(hosts_item, dict):
        raise QosError(f"{where}.hosts must be an object {{host NQN: limits}}, got {type(hosts_item).__name__}")
    if len(hosts_item) > defaults.QOS_HOSTS_MAX:
        raise QosError(f"{where}.hosts: at most {defaults.QOS_HOSTS_MAX} hosts, got {len(hosts_item)}")
    limits = UNLIMITED.merged({k: v for k, v in item.items() if k != "hosts"}, f"{where}.")
    hosts = {}
    for hostnqn, values in hosts_item.items():
        if not isinstance(values, dict):
            raise QosError(f"{where}.hosts[{hostnqn!r}] must be an object, got {type(values).__name__}")
        hosts[hostnqn] = UNLIMITED.merged(values, f"{where}.hosts[{hostnqn!r}].")
    return limits, hosts


def build(item: Any, *, share: float = 1.0) -> NamespaceQos | None:
    """The runtime throttles of a ``qos`` entry, or None when it limits nothing."""
    limits, hosts = parse_config(item)
    if not limits.limited() and not any(lim.limited() for lim in hosts.values()):
        return None
    return NamespaceQos(limits, hosts, share=share)
