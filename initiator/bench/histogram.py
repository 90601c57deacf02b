"""fio's latency histogram (``stat.h``: FIO_IO_U_PLAT_BITS = 6, 29 groups) and its percentiles.

Log-linear buckets keep memory constant however long the run, and a percentile carries at most
1/64 relative error.
"""

from __future__ import annotations

import math
from typing import Any

# fio's latency histogram layout (stat.h)
PLAT_BITS = 6
PLAT_VAL = 1 << PLAT_BITS
PLAT_GROUP_NR = 29
PLAT_NR = PLAT_GROUP_NR * PLAT_VAL

# fio's default clat percentile list (options.c: def_percentile_list)
FIO_PERCENTILES = (1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5,
                   99.9, 99.95, 99.99)


def bucket_index(ns: int) -> int:
    """fio's plat_val_to_idx: values below 128 ns get their own bucket, then 64 buckets per power of 2."""
    msb = ns.bit_length() - 1
    if msb <= PLAT_BITS:
        return ns if ns > 0 else 0
    error_bits = msb - PLAT_BITS
    idx = ((error_bits + 1) << PLAT_BITS) + ((ns >> error_bits) & (PLAT_VAL - 1))
    return idx if idx < PLAT_NR - 1 else PLAT_NR - 1


def bucket_value(idx: int) -> float:
    """fio's plat_idx_to_val: the middle of the bucket's range."""
    if idx < (PLAT_VAL << 1):
        return float(idx)
    error_bits = (idx >> PLAT_BITS) - 1
    base = 1 << (error_bits + PLAT_BITS)
    return base + (idx % PLAT_VAL + 0.5) * (1 << error_bits)


class LatencyHistogram:
    """Latency samples in nanoseconds: fio's buckets plus exact count, sum, sum of squares, min, max."""

    __slots__ = ("buckets", "count", "max", "min", "total", "total_sq")

    def __init__(self) -> None:
        self.buckets = [0] * PLAT_NR
        self.count = 0
        self.total = 0
        self.total_sq = 0
        self.min = 0
        self.max = 0

    def record(self, ns: int) -> None:
        self.buckets[bucket_index(ns)] += 1
        if self.count == 0 or ns < self.min:
            self.min = ns
        if ns > self.max:
            self.max = ns
        self.count += 1
        self.total += ns
        self.total_sq += ns * ns

    def record_many(self, samples: list[int]) -> None:
        """``record`` of each sample, in one loop (the bench's batch path keeps its samples in a list)."""
        if not samples:
            return
        buckets = self.buckets
        last = PLAT_NR - 1
        total = total_sq = 0
        for ns in samples:
            msb = ns.bit_length() - 1
            if msb <= PLAT_BITS:
                idx = ns if ns > 0 else 0
            else:
                error_bits = msb - PLAT_BITS
                idx = ((error_bits + 1) << PLAT_BITS) + ((ns >> error_bits) & (PLAT_VAL - 1))
                if idx > last:
                    idx = last
            buckets[idx] += 1
            total += ns
            total_sq += ns * ns
        low, high = min(samples), max(samples)
        if self.count == 0 or low < self.min:
            self.min = low
        if high > self.max:
            self.max = high
        self.count += len(samples)
        self.total += total
        self.total_sq += total_sq

    def merge(self, other: LatencyHistogram) -> None:
        if other.count == 0:
            return
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]
        self.min = other.min if self.count == 0 else min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.count += other.count
        self.total += other.total
        self.total_sq += other.total_sq

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    @property
    def stdev(self) -> float:
        """Sample standard deviation (n - 1), as fio reports it."""
        if self.count < 2:
            return 0.0
        var = (self.total_sq - self.total * self.total / self.count) / (self.count - 1)
        return math.sqrt(var) if var > 0 else 0.0

    def percentiles(self, points: tuple[float, ...] | list[float] = FIO_PERCENTILES) -> dict[float, int]:
        """fio's calc_clat_percentiles: the first bucket where the running count reaches p% of all
        samples gives the bucket's middle value, kept within the observed min and max."""
        out: dict[float, int] = {}
        if self.count == 0:
            return {p: 0 for p in points}
        order = sorted(points)
        j = 0
        running = 0
        for idx, n in enumerate(self.buckets):
            if not n:
                continue
            running += n
            while j < len(order) and running >= order[j] / 100.0 * self.count:
                value = round(bucket_value(idx))
                out[order[j]] = min(max(value, self.min), self.max)
                j += 1
            if j == len(order):
                break
        for p in order[j:]:  # only reachable through float rounding at 100%
            out[p] = self.max
        return {p: out[p] for p in points}

    def percentile(self, p: float) -> int:
        return self.percentiles((p,))[p]

    def __getstate__(self) -> dict[str, Any]:
        # Sparse: a worker result crosses a pipe; most of the 1856 buckets are empty.
        return {"buckets": {i: n for i, n in enumerate(self.buckets) if n}, "count": self.count,
                "total": self.total, "total_sq": self.total_sq, "min": self.min, "max": self.max}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.buckets = [0] * PLAT_NR
        for i, n in state["buckets"].items():
            self.buckets[i] = n
        self.count, self.total, self.total_sq = state["count"], state["total"], state["total_sq"]
        self.min, self.max = state["min"], state["max"]
