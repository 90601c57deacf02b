"""Prometheus text exposition (format 0.0.4), written out by hand: the values already live in the
model (NamespaceStats, the controllers registry), so a client library would only copy them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from target.model import latency_bounds

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, type, help, NamespaceStats attribute, scale)
_NS_METRICS = (
    ("nvmeof_namespace_reads_total", "counter", "Read commands completed", "reads", 1),
    ("nvmeof_namespace_writes_total", "counter", "Write commands completed", "writes", 1),
    ("nvmeof_namespace_read_bytes_total", "counter", "Bytes read", "read_bytes", 1),
    ("nvmeof_namespace_written_bytes_total", "counter", "Bytes written", "write_bytes", 1),
    ("nvmeof_namespace_errors_total", "counter", "I/O commands completed with an error", "errors", 1),
    ("nvmeof_namespace_throttled_total", "counter", "Commands a QoS limit delayed", "throttled", 1),
    ("nvmeof_namespace_throttled_seconds_total", "counter", "Time commands waited for a QoS limit",
     "throttled_ns", 1e-9),
)
# The same counters per host NQN on each subsystem (Subsystem.host_stats).
_HOST_METRICS = (
    ("nvmeof_host_reads_total", "counter", "Read commands completed for the host", "reads", 1),
    ("nvmeof_host_writes_total", "counter", "Write commands completed for the host", "writes", 1),
    ("nvmeof_host_read_bytes_total", "counter", "Bytes the host read", "read_bytes", 1),
    ("nvmeof_host_written_bytes_total", "counter", "Bytes the host wrote", "write_bytes", 1),
    ("nvmeof_host_errors_total", "counter", "The host's I/O commands completed with an error", "errors", 1),
    ("nvmeof_host_throttled_total", "counter", "The host's commands a QoS limit delayed", "throttled", 1),
    ("nvmeof_host_throttled_seconds_total", "counter", "Time the host's commands waited for a QoS limit",
     "throttled_ns", 1e-9),
)
# Latency as Prometheus histograms: _bucket{le=...} over fixed power-of-two buckets (target/model.py
# LATENCY_SHIFT), _sum (seconds) and _count, all monotonic. histogram_quantile() gives p50/p99.
_LATENCY = (
    ("read_latency_seconds", "Read latency", "read_latency_ns", "reads", "read_hist"),
    ("write_latency_seconds", "Write latency", "write_latency_ns", "writes", "write_hist"),
)
_LE = [repr(bound) for bound in latency_bounds()]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: Any) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _histogram(lines: list[str], name: str, stats: Any, hist_attr: str, sum_attr: str, count_attr: str,
               labels: dict[str, Any]) -> None:
    cumulative = 0
    for le, count in zip(_LE, stats.exported_hist(getattr(stats, hist_attr)), strict=True):
        cumulative += count
        lines.append(f"{name}_bucket{_labels(**labels, le=le)} {cumulative}")
    total = getattr(stats, count_attr)
    lines.append(f"{name}_bucket{_labels(**labels, le='+Inf')} {total}")
    lines.append(f"{name}_sum{_labels(**labels)} {getattr(stats, sum_attr) / 1e9!r}")
    lines.append(f"{name}_count{_labels(**labels)} {total}")


def _io_families(lines: list[str], scalars: tuple, prefix: str, rows: list[tuple[dict[str, Any], Any]]) -> None:
    """Counters and latency histograms of (labels, NamespaceStats) rows."""
    for name, kind, help_text, attr, scale in scalars:
        lines += _header(name, kind, help_text)
        for labels, stats in rows:
            lines.append(f"{name}{_labels(**labels)} {getattr(stats, attr) * scale}")
    for suffix, help_text, sum_attr, count_attr, hist_attr in _LATENCY:
        name = f"{prefix}_{suffix}"
        lines += _header(name, "histogram", help_text)
        for labels, stats in rows:
            _histogram(lines, name, stats, hist_attr, sum_attr, count_attr, labels)


def render(subsystems: Iterable[Any], controllers: list[dict[str, Any]]) -> str:
    subsystems = list(subsystems)
    namespaces = [(sub.nqn, ns) for sub in subsystems for _, ns in sorted(sub.namespaces.items())]
    lines: list[str] = []
    _io_families(lines, _NS_METRICS, "nvmeof_namespace",
                 [({"subnqn": nqn, "nsid": ns.nsid}, ns.stats) for nqn, ns in namespaces])
    _io_families(lines, _HOST_METRICS, "nvmeof_host",
                 [({"subnqn": sub.nqn, "hostnqn": hostnqn}, stats) for sub in subsystems
                  for hostnqn, stats in sorted(sub.host_stats.items())])
    lines += _header("nvmeof_namespace_size_bytes", "gauge", "Namespace capacity")
    for nqn, ns in namespaces:
        lines.append(f"nvmeof_namespace_size_bytes{_labels(subnqn=nqn, nsid=ns.nsid)} {ns.backend.size}")
    lines += _header("nvmeof_namespace_enabled", "gauge", "1 when the namespace is attached")
    for nqn, ns in namespaces:
        lines.append(f"nvmeof_namespace_enabled{_labels(subnqn=nqn, nsid=ns.nsid)} {int(ns.enabled)}")
    lines += _header("nvmeof_subsystems", "gauge", "NVM subsystems configured")
    lines.append(f"nvmeof_subsystems {len(subsystems)}")
    per_subsystem = Counter(info["subnqn"] for info in controllers)
    lines += _header("nvmeof_controllers", "gauge", "Connected controllers, by subsystem")
    for nqn in sorted(per_subsystem):
        lines.append(f"nvmeof_controllers{_labels(subnqn=nqn)} {per_subsystem[nqn]}")
    return "\n".join(lines) + "\n"


def _io_row(stats: Any) -> dict[str, Any]:
    return {**stats.as_dict(), "read_hist": stats.exported_hist(stats.read_hist),
            "write_hist": stats.exported_hist(stats.write_hist)}


def snapshot(subsystems: Iterable[Any], now: float) -> dict[str, Any]:
    """The counters /metrics exports, as JSON for the dashboard (api/routers/ui.py): cumulative values
    with the time they were read; the page takes differences of two snapshots for rates and percentiles.
    Histograms are per bucket (not cumulative), bounds in ``latency_bounds`` (seconds)."""
    subsystems = list(subsystems)
    return {
        "time": now,
        "latency_bounds": latency_bounds(),
        "namespaces": [{"subnqn": sub.nqn, "nsid": ns.nsid, **_io_row(ns.stats)}
                       for sub in subsystems for _, ns in sorted(sub.namespaces.items())],
        "hosts": [{"subnqn": sub.nqn, "hostnqn": hostnqn, **_io_row(stats)}
                  for sub in subsystems for hostnqn, stats in sorted(sub.host_stats.items())],
    }
