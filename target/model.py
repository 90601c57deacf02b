"""The target's objects: subsystems, namespaces, listeners, referrals. No protocol code here.

Identity: a subsystem by its NQN, a namespace by (subsystem NQN, NSID), a listener by
``trtype:traddr:trsvcid``, a referral by the same address form. TargetService is the only writer.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from nvmeof import defaults
from nvmeof.spec.logs import AnaState
from nvmeof.status import Status
from nvmeof.tls.psk import TlsKey
from target.backends.base import Backend
from target.qos import NamespaceQos
from target.reservations import EMPTY as EMPTY_RESERVATION
from target.reservations import ReservationState
from target.schema import AdrFam, TrType

# What I/O to a namespace gets on a path where its ANA group is in this state (nvmet_check_ana_state);
# optimized and non-optimized groups serve I/O.
ANA_IO_STATUS: dict[AnaState, int] = {
    AnaState.INACCESSIBLE: Status.ANA_INACCESSIBLE,
    AnaState.PERSISTENT_LOSS: Status.ANA_PERSISTENT_LOSS,
    AnaState.CHANGE: Status.ANA_TRANSITION,
}


# I/O latency histogram: bucket i counts latencies below 2**(LATENCY_SHIFT + i) ns (and, for i > 0, at
# least 2**(LATENCY_SHIFT + i - 1)): power-of-two buckets as SPDK's histogram_data.h keeps them, found
# with one shift and bit_length() on the hot path. The list is long enough for any latency (2**73 ns),
# so no bound check runs; /metrics exports LATENCY_BUCKETS of them (1 us .. 8.6 s) and +Inf.
LATENCY_SHIFT = 10
LATENCY_BUCKETS = 24
_HIST_SLOTS = 64


def latency_bounds() -> list[float]:
    """Upper bound of each exported bucket, in seconds (Prometheus ``le``)."""
    return [(1 << (LATENCY_SHIFT + i)) / 1e9 for i in range(LATENCY_BUCKETS)]


def _histogram() -> list[int]:
    return [0] * _HIST_SLOTS


@dataclass(slots=True)
class NamespaceStats:
    """I/O counters of one namespace, or of one host on one subsystem (``Subsystem.host_stats``)."""

    reads: int = 0
    writes: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    errors: int = 0
    read_latency_ns: int = 0  # sum over all reads; divide by reads for the mean
    write_latency_ns: int = 0
    read_hist: list[int] = field(default_factory=_histogram)    # read latencies, see LATENCY_SHIFT
    write_hist: list[int] = field(default_factory=_histogram)
    throttled: int = 0      # commands a QoS limit delayed (target/qos.py), and their time waiting
    throttled_ns: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "reads": self.reads,
            "writes": self.writes,
            "read_bytes": self.read_bytes,
            "write_bytes": self.write_bytes,
            "errors": self.errors,
            "read_latency_ns": self.read_latency_ns,
            "write_latency_ns": self.write_latency_ns,
            "throttled": self.throttled,
            "throttled_ns": self.throttled_ns,
        }

    def exported_hist(self, hist: list[int]) -> list[int]:
        """The LATENCY_BUCKETS exported buckets, the slow tail folded into the last (it joins +Inf)."""
        out = hist[:LATENCY_BUCKETS]
        out[-1] += sum(hist[LATENCY_BUCKETS:])
        return out

    def to_row(self) -> list:
        """What a worker process reports (target/worker.py); ``add_row`` adds it up in the main process."""
        return [self.reads, self.writes, self.read_bytes, self.write_bytes, self.errors, self.read_latency_ns,
                self.write_latency_ns, list(self.read_hist), list(self.write_hist), self.throttled, self.throttled_ns]

    def add_row(self, row: list) -> None:
        self.reads += row[0]
        self.writes += row[1]
        self.read_bytes += row[2]
        self.write_bytes += row[3]
        self.errors += row[4]
        self.read_latency_ns += row[5]
        self.write_latency_ns += row[6]
        for hist, counts in ((self.read_hist, row[7] if len(row) > 7 else ()),
                             (self.write_hist, row[8] if len(row) > 8 else ())):
            for i, n in enumerate(counts[:_HIST_SLOTS]):
                hist[i] += n
        if len(row) > 10:
            self.throttled += row[9]
            self.throttled_ns += row[10]

    def busy(self) -> bool:
        return bool(self.reads or self.writes or self.errors)


@dataclass(eq=False)
class Namespace:
    nsid: int
    backend: Backend
    block_size: int = defaults.DEFAULT_BLOCK_SIZE
    uuid: uuid.UUID = field(default_factory=uuid.uuid4)
    nguid: bytes = bytes(16)
    eui64: bytes = bytes(8)
    read_only: bool = False
    enabled: bool = True
    anagrpid: int = defaults.DEFAULT_ANAGRPID  # its ANA group, 1..ANAGRPMAX (Identify Namespace ANAGRPID)
    # Masking (SPDK nvmf_ns_add_host, --no-auto-visible): auto_visible, every allowed host sees it; else only
    # the controllers of the host NQNs in ``hosts`` do (an inactive NSID for every other one).
    auto_visible: bool = True
    hosts: set[str] = field(default_factory=set)
    spec: dict[str, Any] = field(default_factory=dict)  # the creation request, persisted as given
    stats: NamespaceStats = field(default_factory=NamespaceStats)
    # Reservations (target/pr.py): the committed state, its version in the target's PrStore, the lock that
    # serializes changes, and commands in flight per HOSTID while anyone is registered (preempt and abort)
    pr: ReservationState = EMPTY_RESERVATION
    pr_version: int = 0
    pr_lock: asyncio.Lock | None = None
    pr_inflight: dict[bytes, int] = field(default_factory=dict)
    # QoS throttles (target/qos.py), None while nothing limits the namespace: the I/O paths test only this
    qos: NamespaceQos | None = None

    def visible_to(self, hostnqn: str) -> bool:
        return self.auto_visible or hostnqn in self.hosts

    def visibility(self) -> frozenset[str] | None:
        """The host NQNs that see it, None for every host: compare two with ``view_changed``."""
        return None if self.auto_visible else frozenset(self.hosts)

    @property
    def nsze(self) -> int:
        """Namespace size in logical blocks (Identify Namespace NSZE = NCAP = NUSE)."""
        return self.backend.size // self.block_size

    @property
    def lba_shift(self) -> int:
        return self.block_size.bit_length() - 1

    @property
    def writable(self) -> bool:
        return not (self.read_only or self.backend.read_only)


@dataclass(eq=False)
class HostAuth:
    """DH-HMAC-CHAP settings of one allowed host (nvmet configfs ``hosts/<nqn>/dhchap_*``).

    The secrets are ``nvmeof.auth.DhchapSecret`` objects, whose repr never shows the key. A hash or
    DH group list of None means "the subsystem's" (which defaults to all of them, like nvmet)."""

    dhchap_key: Any = None           # the host's secret: the host proves it knows it
    dhchap_ctrl_key: Any = None      # the controller's secret (bidirectional authentication)
    dhchap_hash: tuple[int, ...] | None = None     # allowed hash ids (1 SHA-256, 2 SHA-384, 3 SHA-512)
    dhchap_dhgroup: tuple[int, ...] | None = None  # allowed DH group ids (0 null, 1..5 ffdhe2048..8192)
    # NVMe/TCP TLS: the host's configured PSK on this subsystem (SPDK nvmf_subsystem_add_host --psk); a TLS
    # connection whose PSK identity names this host and subsystem uses it (target/tls.py)
    tls_key: TlsKey | None = None
    # the host's TLS PSK for an identity without a digest (NVMe0R) is derived the way libnvme's *_compat
    # functions do (nvme-cli 2.13 / libnvme 1.13 insert keys so); off: RFC 8446's HKDF-Expand-Label
    tls_compat: bool = False

    def __repr__(self) -> str:
        return (f"HostAuth(dhchap_key={self.dhchap_key is not None}, "
                f"dhchap_ctrl_key={self.dhchap_ctrl_key is not None}, dhchap_hash={self.dhchap_hash}, "
                f"dhchap_dhgroup={self.dhchap_dhgroup}, tls_key={self.tls_key is not None}, "
                f"tls_compat={self.tls_compat})")

    @property
    def empty(self) -> bool:
        return (self.dhchap_key is None and self.dhchap_ctrl_key is None and self.dhchap_hash is None
                and self.dhchap_dhgroup is None and self.tls_key is None and not self.tls_compat)


@dataclass(eq=False)
class Subsystem:
    nqn: str
    serial: str
    model: str = defaults.MODEL
    allow_any_host: bool = True
    hosts: set[str] = field(default_factory=set)
    max_namespaces: int = defaults.MAX_NAMESPACES
    namespaces: dict[int, Namespace] = field(default_factory=dict)
    subtype: Literal["nvm", "discovery"] = "nvm"
    # DH-HMAC-CHAP: per allowed host (keys only for hosts in ``hosts``, as nvmet looks the host up in
    # the subsystem's allowed_hosts), and the subsystem's allowed hashes/DH groups (None: all).
    host_auth: dict[str, HostAuth] = field(default_factory=dict)
    dhchap_hash: tuple[int, ...] | None = None
    dhchap_dhgroup: tuple[int, ...] | None = None
    # I/O counters per host NQN, kept across reconnects (Prometheus counters stay monotonic); a
    # controller holds its host's entry (Controller.host_stats). Bounded: see stats_for_host.
    host_stats: dict[str, NamespaceStats] = field(default_factory=dict)

    def stats_for_host(self, hostnqn: str) -> NamespaceStats:
        """The host's counters, made at its first connect. Past HOST_STATS_MAX hosts (any host may connect
        to an allow-any-host subsystem, each with a new NQN) the oldest entry is dropped, so /metrics stays
        bounded; a dropped host that is still connected keeps counting in an entry nobody exports."""
        entry = self.host_stats.get(hostnqn)
        if entry is None:
            while len(self.host_stats) >= defaults.HOST_STATS_MAX:
                del self.host_stats[next(iter(self.host_stats))]
            entry = self.host_stats[hostnqn] = NamespaceStats()
        return entry

    def active_nsids(self, hostnqn: str | None = None) -> list[int]:
        """The enabled NSIDs, ascending; with ``hostnqn``, those that host's controllers see (masking)."""
        return sorted(nsid for nsid, ns in self.namespaces.items()
                      if ns.enabled and (hostnqn is None or ns.visible_to(hostnqn)))

    def active_namespace(self, nsid: int, hostnqn: str) -> Namespace | None:
        """The namespace ``nsid`` if it is active for ``hostnqn``'s controllers: enabled and visible."""
        ns = self.namespaces.get(nsid)
        return ns if ns is not None and ns.enabled and ns.visible_to(hostnqn) else None

    def host_allowed(self, hostnqn: str) -> bool:
        return self.allow_any_host or hostnqn in self.hosts

    def auth_for(self, hostnqn: str) -> HostAuth | None:
        """The host's DH-HMAC-CHAP entry when it must authenticate (it has a host key), else None."""
        entry = self.host_auth.get(hostnqn)
        if entry is None or entry.dhchap_key is None or hostnqn not in self.hosts:
            return None
        return entry


def view_changed(before: frozenset[str] | None, after: frozenset[str] | None, hostnqn: str) -> bool:
    """Whether a host sees a namespace in one of two ``Namespace.visibility()`` values and not in the other."""
    return (before is None or hostnqn in before) != (after is None or hostnqn in after)


def format_address(traddr: str, trsvcid: int | str) -> str:
    """``host:port`` with IPv6 literals bracketed, so the string splits unambiguously."""
    if ":" in traddr and not traddr.startswith("["):
        return f"[{traddr}]:{trsvcid}"
    return f"{traddr}:{trsvcid}"


def endpoint_id(trtype: str, traddr: str, trsvcid: int | str) -> str:
    return f"{trtype}:{format_address(traddr, trsvcid)}"


@dataclass(eq=False)
class Listener:
    trtype: TrType
    adrfam: AdrFam
    traddr: str
    trsvcid: int
    portid: int
    discovery: bool = False  # serves the discovery subsystem (usually port 8009)
    # ANA state per group on this port (nvmet ports/<n>/ana_groups/<g>/ana_state); a group that is not
    # here is in ana_default. What every controller whose admin queue came through this listener reports.
    # Change it with set_ana_state(s) / set_ana_default, which keep ana_blocked in step.
    ana_states: dict[int, AnaState] = field(default_factory=dict)
    # anagrpid -> the status I/O to that group fails with here (only groups I/O cannot reach): the
    # one dict target/io.py looks up per command; controllers hold this very object.
    ana_blocked: dict[int, int] = field(default_factory=dict, repr=False)
    # The state of every group not in ana_states: optimized on a lone target; a gateway group member
    # makes it its standby state (Target.set_ana_default) so that a group it holds no lock for is never
    # served optimized, whatever adds the group or the listener.
    ana_default: AnaState = field(default=AnaState.OPTIMIZED, repr=False)
    # NVMe/TCP secure channel (TP 8011): "none" (clear only), "optional" (TLS or clear, told apart by the
    # first byte) or "required" (TLS 1.3 only); discovery shows it as SECTYPE/TREQ (target/discovery.py)
    tls: str = "none"
    # In-capsule data bytes its I/O queues accept and Identify's IOCCSZ advertises (nvmet's port
    # param_inline_data_size); fixed while it listens, as nvmet refuses to change an enabled port's
    inline_data_size: int = defaults.IO_INCAPSULE_SIZE

    @property
    def id(self) -> str:
        return endpoint_id(self.trtype, self.traddr, self.trsvcid)

    def ana_state(self, anagrpid: int) -> AnaState:
        return self.ana_states.get(anagrpid, self.ana_default)

    def set_ana_state(self, anagrpid: int, state: AnaState) -> None:
        state = AnaState(state)
        if state == self.ana_default:
            self.ana_states.pop(anagrpid, None)
        else:
            self.ana_states[anagrpid] = state
        self._block(anagrpid, state)

    def _block(self, anagrpid: int, state: AnaState) -> None:
        blocked = ANA_IO_STATUS.get(state)
        if blocked is None:
            self.ana_blocked.pop(anagrpid, None)
        else:
            self.ana_blocked[anagrpid] = blocked

    def set_ana_states(self, states: dict[int, AnaState]) -> None:
        """Replace every group's state (groups not named take ana_default), in place."""
        for anagrpid in list(self.ana_states):
            if anagrpid not in states:
                self.set_ana_state(anagrpid, self.ana_default)
        for anagrpid, state in states.items():
            self.set_ana_state(anagrpid, state)

    def set_ana_default(self, state: AnaState) -> None:
        """Every group not set explicitly is in ``state`` from now on. ana_blocked lists each group id
        (1..ANAGRPMAX) explicitly, so target/io.py keeps its single lookup per command."""
        explicit = {g: self.ana_state(g) for g in self.ana_states}
        self.ana_default = AnaState(state)
        self.ana_states.clear()
        for anagrpid in range(1, defaults.ANAGRPMAX + 1):
            if anagrpid in explicit:
                self.set_ana_state(anagrpid, explicit[anagrpid])
            else:
                self._block(anagrpid, self.ana_default)


@dataclass(eq=False)
class Referral:
    trtype: TrType
    adrfam: AdrFam
    traddr: str
    trsvcid: int
    subnqn: str = defaults.DISCOVERY_NQN
    portid: int = 0

    @property
    def id(self) -> str:
        return endpoint_id(self.trtype, self.traddr, self.trsvcid)
