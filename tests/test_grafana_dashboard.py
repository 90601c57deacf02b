"""examples/grafana/nvmeof-dashboard.json: every PromQL query (panel targets and template variables)
names only metrics that a running target's /metrics exports, read from a live daemon with a
namespace, a connected host and some I/O."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import initiator
from nvmeof.cli.daemon import Daemon, DaemonOptions
from nvmeof.uri import TransportAddress
from tests.ports import free_ports

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "nvmeof-dashboard.json"
NQN = "nqn.2026-01.io.nvmeof-toolkit:grafana"
HOST = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-0000000000f1"

# PromQL words that are not metric names: functions are followed by "(", these are not always.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}
FUNCTIONS_WITH_METRIC_ARG = {"label_values"}  # Grafana's variable query: label_values(metric{...}, label)


def queries(node: Any) -> Iterator[str]:
    """Every ``expr`` of a panel target and every query of a template variable, anywhere in the JSON."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                yield value["query"]
            elif key == "definition":
                continue
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a small lexer: no PromQL parser in Python here)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals
    text = re.sub(r"\{[^}]*\}", "", text)                       # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)                      # range selectors [5m], [$__rate_interval]
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    text = re.sub(r"\$\{?\w+\}?", "", text)                      # Grafana variables
    text = re.sub(r",\s*\w+\s*\)", ")", text) if "label_values" in text else text  # label_values' label
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)\s*(\()?", text):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in KEYWORDS:
            continue
        names.add(word)
    return names


def test_the_lexer_finds_metric_names() -> None:
    assert metric_names('histogram_quantile(0.99, sum by (le, subnqn) (rate(a_bucket{x=~"$v"}[$__rate_interval])))') \
        == {"a_bucket"}
    assert metric_names("sum(rate(x_total[5m]) + rate(y_total[5m])) or vector(0)") == {"x_total", "y_total"}
    assert metric_names('label_values(nvmeof_host_reads_total{subnqn=~"$s"}, hostnqn)') == {"nvmeof_host_reads_total"}
    assert metric_names("up") == {"up"}


def exported(text: str) -> set[str]:
    """Series names of a Prometheus text exposition: every sample line, and every declared family
    (a histogram's _bucket/_sum/_count), so a family with no sample yet still counts."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            names.add(re.match(r"[A-Za-z_:][\w:]*", line).group(0))
    return names


@pytest.fixture
async def live_metrics(tmp_path: Path) -> str:
    io, disc, api = free_ports(3)
    daemon = Daemon(DaemonOptions(config_path=None, listen=[TransportAddress("tcp", "127.0.0.1", io)],
                                  discovery=[TransportAddress("tcp", "127.0.0.1", disc)], api=("127.0.0.1", api),
                                  subsystem_nqn=NQN, ramdisk_size=1 << 20, state_dir=tmp_path / "state"))
    await daemon.start()
    try:
        ctrl = await initiator.connect("127.0.0.1", io, NQN, hostnqn=HOST, timeout=10)
        try:
            await ctrl.write(1, 0, b"\x5a" * 4096)
            assert bytes(await ctrl.read(1, 0, 8)) == b"\x5a" * 4096
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api}", timeout=10,
                                         headers={"Authorization": f"Bearer {daemon.api_token}"}) as http:
                for _ in range(100):  # uvicorn starts serving within a few loop iterations
                    try:
                        r = await http.get("/metrics")
                    except httpx.TransportError:
                        await asyncio.sleep(0.05)
                        continue
                    assert r.status_code == 200, r.text
                    return r.text
                raise AssertionError("the REST API never answered")
        finally:
            await ctrl.close()
    finally:
        await daemon.stop()


async def test_every_dashboard_query_names_an_exported_metric(live_metrics: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    have = exported(live_metrics)
    assert "nvmeof_namespace_reads_total" in have and "nvmeof_controllers" in have, live_metrics[:500]
    found = list(queries(dashboard))
    assert len(found) >= 20, "the dashboard lost its queries"
    used: set[str] = set()
    for expr in found:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        missing = names - have
        assert not missing, f"{expr!r} uses {sorted(missing)}, which /metrics does not export"
        used |= names
    # the dashboard covers what the issue asks for: IOPS, throughput, latency, errors, controllers, sizes
    for needed in ("nvmeof_namespace_reads_total", "nvmeof_namespace_read_bytes_total",
                   "nvmeof_namespace_read_latency_seconds_bucket", "nvmeof_namespace_errors_total",
                   "nvmeof_controllers", "nvmeof_namespace_size_bytes", "nvmeof_host_reads_total"):
        assert needed in used, f"no panel shows {needed}"
