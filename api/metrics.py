"""Prometheus text exposition (format 0.0.4), written out by hand: the values already live in the
model (NamespaceStats, the controllers registry), so a client library would only copy them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, type, help, NamespaceStats attribute, scale)
_NS_METRICS = (
    ("nvmeof_namespace_reads_total", "counter", "Read commands completed", "reads", 1),
    ("nvmeof_namespace_writes_total", "counter", "Write commands completed", "writes", 1),
    ("nvmeof_namespace_read_bytes_total", "counter", "Bytes read", "read_bytes", 1),
    ("nvmeof_namespace_written_bytes_total", "counter", "Bytes written", "write_bytes", 1),
    ("nvmeof_namespace_errors_total", "counter", "I/O commands completed with an error", "errors", 1),
)
# Latency as Prometheus summaries without quantiles: _sum (seconds) and _count, both monotonic.
_NS_LATENCY = (
    ("nvmeof_namespace_read_latency_seconds", "Read latency", "read_latency_ns", "reads"),
    ("nvmeof_namespace_write_latency_seconds", "Write latency", "write_latency_ns", "writes"),
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: Any) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def render(subsystems: Iterable[Any], controllers: list[dict[str, Any]]) -> str:
    subsystems = list(subsystems)
    namespaces = [(sub.nqn, ns) for sub in subsystems for _, ns in sorted(sub.namespaces.items())]
    lines: list[str] = []
    for name, kind, help_text, attr, scale in _NS_METRICS:
        lines += _header(name, kind, help_text)
        for nqn, ns in namespaces:
            lines.append(f"{name}{_labels(subnqn=nqn, nsid=ns.nsid)} {getattr(ns.stats, attr) * scale}")
    for name, help_text, attr, count_attr in _NS_LATENCY:
        lines += _header(name, "summary", help_text)
        for nqn, ns in namespaces:
            labels = _labels(subnqn=nqn, nsid=ns.nsid)
            lines.append(f"{name}_sum{labels} {getattr(ns.stats, attr) / 1e9!r}")
            lines.append(f"{name}_count{labels} {getattr(ns.stats, count_attr)}")
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
