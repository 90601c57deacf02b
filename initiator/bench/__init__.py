"""fio-style benchmark engine over the Python initiator (`nvmeof bench`).

One job keeps ``iodepth`` commands in flight on its own controller connection; ``numjobs > 1``
spawns worker processes, each with its own connection, and the parent merges their results.
Latencies go into a histogram with fio's bucket layout, and the report follows fio's JSON layout.

Modules, one job each:

- ``jobspec``: the job (fio's option names and units) and the connection it uses; BenchError
- ``histogram``: fio's latency histogram and percentiles
- ``verify``: the ``--verify crc32c`` block pattern and what a verify pass found
- ``results``: what jobs measured, per direction, per job and for the whole run
- ``cpu``: CPU time of this process and of target processes
- ``engine``: one job on one connected controller (JobRunner, run_job)
- ``workers``: worker processes for ``numjobs > 1``
- ``run``: ``run_bench``, the entry point
- ``report``: fio's JSON report
"""

from initiator.bench.cpu import process_cpu_seconds, target_cpu_seconds
from initiator.bench.engine import (
    PROGRESS_INTERVAL,
    JobRunner,
    Progress,
    ProgressCallback,
    connect,
    namespace_geometry,
    run_job,
)
from initiator.bench.histogram import (
    FIO_PERCENTILES,
    PLAT_BITS,
    PLAT_GROUP_NR,
    PLAT_NR,
    PLAT_VAL,
    LatencyHistogram,
    bucket_index,
    bucket_value,
)
from initiator.bench.jobspec import DEFAULT_RANDSEED, RW_MODES, BenchError, ConnectSpec, JobSpec
from initiator.bench.report import fio_json
from initiator.bench.results import EILSEQ, BenchReport, DirStats, JobResult
from initiator.bench.run import run_bench
from initiator.bench.verify import (
    DEFAULT_VERIFY_SEED,
    VERIFY_HEADER,
    VERIFY_HEADER_SIZE,
    VERIFY_MAGIC,
    VERIFY_MODES,
    VerifyError,
    VerifyResult,
    check_verify_block,
    fill_verify_block,
    verify_payload,
)

__all__ = [
    "DEFAULT_RANDSEED",
    "DEFAULT_VERIFY_SEED",
    "EILSEQ",
    "FIO_PERCENTILES",
    "PLAT_BITS",
    "PLAT_GROUP_NR",
    "PLAT_NR",
    "PLAT_VAL",
    "PROGRESS_INTERVAL",
    "RW_MODES",
    "VERIFY_HEADER",
    "VERIFY_HEADER_SIZE",
    "VERIFY_MAGIC",
    "VERIFY_MODES",
    "BenchError",
    "BenchReport",
    "ConnectSpec",
    "DirStats",
    "JobResult",
    "JobRunner",
    "JobSpec",
    "LatencyHistogram",
    "Progress",
    "ProgressCallback",
    "VerifyError",
    "VerifyResult",
    "bucket_index",
    "bucket_value",
    "check_verify_block",
    "connect",
    "fill_verify_block",
    "fio_json",
    "namespace_geometry",
    "process_cpu_seconds",
    "run_bench",
    "run_job",
    "target_cpu_seconds",
    "verify_payload",
]
