"""What a benchmark runs: the job (fio's options) and where it connects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from initiator.bench.verify import DEFAULT_VERIFY_SEED, VERIFY_HEADER_SIZE, VERIFY_MODES
from nvmeof import defaults
from nvmeof.spec.identify import NSID_MAX

RW_MODES = ("read", "write", "randread", "randwrite", "randrw", "readwrite", "rw")
DEFAULT_RANDSEED = 0x3C5A7E19


class BenchError(Exception):
    """The job cannot run as specified; the message names the option and the problem."""


@dataclass
class ConnectSpec:
    """Where the jobs connect (the nvme-cli connect options)."""

    transport: str = "tcp"
    traddr: str = defaults.LISTEN_ADDRESS
    trsvcid: int = defaults.TCP_IO_PORT
    subnqn: str = defaults.DEFAULT_SUBSYSTEM_NQN
    hostnqn: str | None = None
    hdr_digest: bool = False
    data_digest: bool = False
    nr_io_queues: int = 1
    queue_size: int = defaults.MAX_QUEUE_SIZE
    target: Any = None  # an in-process target.core.Target for transport="loop" (tests)
    # DH-HMAC-CHAP secrets as nvmeof.auth.DhchapSecret (their repr hides the key)
    dhchap_secret: Any = field(default=None, repr=False)
    dhchap_ctrl_secret: Any = field(default=None, repr=False)
    poll_us: int = defaults.POLL_US          # connect(poll_us=): busy polling after a batch, µs
    disable_sqflow: bool = False             # connect(disable_sqflow=): a read may end with C2HData SUCCESS
    tls_key: Any = field(default=None, repr=False)   # connect(tls_key=): an nvmeof.tls.TlsKey (TLS 1.3 with PSK)
    tls_identity_version: int = defaults.TLS_IDENTITY_VERSION
    tls_sha256_binder: bool = False          # connect(tls_sha256_binder=): a SHA-384 PSK under SHA-256 (interop)

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "trsvcid": self.trsvcid, "subnqn": self.subnqn, "hostnqn": self.hostnqn,
            "transport": self.transport, "nr_io_queues": self.nr_io_queues, "queue_size": self.queue_size,
            "hdr_digest": self.hdr_digest, "data_digest": self.data_digest,
        }
        if self.target is not None:
            kw["target"] = self.target
        if self.poll_us != defaults.POLL_US:
            kw["poll_us"] = self.poll_us
        if self.disable_sqflow:
            kw["disable_sqflow"] = True
        if self.dhchap_secret is not None:
            kw["dhchap_secret"] = self.dhchap_secret
            kw["dhchap_ctrl_secret"] = self.dhchap_ctrl_secret
        if self.tls_key is not None:
            kw["tls_key"] = self.tls_key
            kw["tls_identity_version"] = self.tls_identity_version
            if self.tls_sha256_binder:
                kw["tls_sha256_binder"] = True
        return kw


@dataclass
class JobSpec:
    """One fio job, in fio's option names and units (bytes, seconds)."""

    name: str = "nvmeof"
    rw: str = "read"
    bs: int = 4096
    iodepth: int = 1
    numjobs: int = 1
    rwmixread: int = 50
    runtime: float | None = None
    time_based: bool = False
    ramp_time: float = 0.0
    size: int | None = None       # region length; None: from offset to the end of the namespace
    offset: int = 0
    nsid: int = 1
    verify: str | None = None
    verify_seed: int = DEFAULT_VERIFY_SEED
    randseed: int = DEFAULT_RANDSEED
    group_reporting: bool = False

    def __post_init__(self) -> None:
        if self.rw == "readwrite" or self.rw == "rw":
            self.rw = "readwrite"

    def validate(self) -> None:
        if self.rw not in RW_MODES:
            raise BenchError(f"--rw {self.rw!r} is not supported: use one of {', '.join(RW_MODES)}")
        if not 0 <= self.rwmixread <= 100:
            raise BenchError(f"--rwmixread {self.rwmixread} is out of range: give a percentage 0-100")
        if self.bs <= 0 or self.bs % 512:
            raise BenchError(f"--bs {self.bs} must be a positive multiple of 512 bytes")
        if self.iodepth < 1:
            raise BenchError(f"--iodepth {self.iodepth} must be at least 1")
        if self.numjobs < 1:
            raise BenchError(f"--numjobs {self.numjobs} must be at least 1")
        if self.runtime is not None and self.runtime <= 0:
            raise BenchError(f"--runtime {self.runtime} must be positive")
        if self.time_based and self.runtime is None:
            raise BenchError("--time_based needs --runtime (how long to keep looping over the region)")
        if self.ramp_time < 0:
            raise BenchError(f"--ramp_time {self.ramp_time} must not be negative")
        if self.size is not None and self.size <= 0:
            raise BenchError(f"--size {self.size} must be positive")
        if self.offset < 0:
            raise BenchError(f"--offset {self.offset} must not be negative")
        if not 1 <= self.nsid <= NSID_MAX:
            raise BenchError(f"--nsid {self.nsid} is not a valid namespace ID (1 to {NSID_MAX:#X})")
        if self.verify is not None:
            if self.verify not in VERIFY_MODES:
                raise BenchError(f"--verify {self.verify!r} is not supported: use {', '.join(VERIFY_MODES)}")
            if self.rw in ("randrw", "readwrite"):
                raise BenchError(f"--verify works with read, write, randread or randwrite, not {self.rw}")
            if self.ramp_time:
                raise BenchError("--ramp_time cannot be combined with --verify (every block is checked)")
            if self.bs <= VERIFY_HEADER_SIZE:
                raise BenchError(f"--bs {self.bs} is too small for --verify (header is {VERIFY_HEADER_SIZE} B)")

    @property
    def random(self) -> bool:
        return self.rw.startswith("rand")

    @property
    def read_fraction(self) -> float:
        if self.rw in ("read", "randread"):
            return 1.0
        if self.rw in ("write", "randwrite"):
            return 0.0
        return self.rwmixread / 100.0
