"""What jobs measured: per direction, per job, and the whole run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from initiator.bench.histogram import LatencyHistogram
from initiator.bench.jobspec import ConnectSpec, JobSpec
from initiator.bench.verify import VerifyResult

EILSEQ = 84  # fio reports verify failures with this errno
EIO = 5      # and any other failed job with this one


@dataclass
class DirStats:
    """One data direction of one job (or of a group of jobs)."""

    ios: int = 0
    bytes: int = 0
    runtime_ns: int = 0
    clat: LatencyHistogram = field(default_factory=LatencyHistogram)

    @property
    def runtime_ms(self) -> int:
        # fio keeps runtimes in whole milliseconds and derives IOPS and bandwidth from them
        return max(1, round(self.runtime_ns / 1e6)) if self.ios else 0

    @property
    def iops(self) -> float:
        return self.ios * 1000.0 / self.runtime_ms if self.ios else 0.0

    @property
    def bw_bytes(self) -> float:
        return self.bytes * 1000.0 / self.runtime_ms if self.ios else 0.0

    def merge(self, other: DirStats) -> None:
        self.ios += other.ios
        self.bytes += other.bytes
        self.runtime_ns = max(self.runtime_ns, other.runtime_ns)
        self.clat.merge(other.clat)


@dataclass
class JobResult:
    name: str
    jobs: int = 1                   # how many jobs this result covers (group_reporting merges)
    pid: int = 0
    read: DirStats = field(default_factory=DirStats)
    write: DirStats = field(default_factory=DirStats)
    runtime_ns: int = 0             # measured window (after the ramp), all phases
    usr_s: float = 0.0              # initiator CPU in the measured window
    sys_s: float = 0.0
    verify: VerifyResult | None = None
    error: str | None = None

    @property
    def total_ios(self) -> int:
        return self.read.ios + self.write.ios

    @property
    def fio_error(self) -> int:
        """The errno fio reports for this job: 0 when it ran clean."""
        if self.verify is not None and self.verify.errors:
            return EILSEQ
        return EIO if self.error else 0

    def merge(self, other: JobResult) -> None:
        self.jobs += other.jobs
        self.read.merge(other.read)
        self.write.merge(other.write)
        self.runtime_ns = max(self.runtime_ns, other.runtime_ns)
        self.usr_s += other.usr_s
        self.sys_s += other.sys_s
        if other.verify is not None:
            if self.verify is None:
                self.verify = VerifyResult()
            self.verify.merge(other.verify)
        if other.error and not self.error:
            self.error = other.error


@dataclass
class BenchReport:
    job: JobSpec
    connect: ConnectSpec
    results: list[JobResult]
    started: float                      # wall clock (time.time) at the start
    target_cpu_s: float | None = None   # target processes' CPU in the measured window
    target_pids: tuple[int, ...] = ()

    def reported(self) -> list[JobResult]:
        """The results a report lists: all jobs as one under ``group_reporting``, else each job."""
        return [self.group()] if self.job.group_reporting else self.results

    def group(self) -> JobResult:
        total = JobResult(name=self.job.name, jobs=0, pid=os.getpid())
        for r in self.results:
            total.merge(r)
        return total

    @property
    def total_ios(self) -> int:
        return sum(r.total_ios for r in self.results)

    def cpu_us_per_io(self) -> dict[str, float | None]:
        ios = self.total_ios
        ini = sum(r.usr_s + r.sys_s for r in self.results)
        return {
            "initiator": ini * 1e6 / ios if ios else None,
            "target": self.target_cpu_s * 1e6 / ios if ios and self.target_cpu_s is not None else None,
        }

    @property
    def failed(self) -> bool:
        return any(r.fio_error for r in self.results)
