"""The dashboard's server side without a browser: the open page shell and the credentialed /ui/stats,
the /login?next= redirect, the latency histograms and per-host counters behind /metrics and the page,
and the digests the controllers list shows. The page itself runs in tests/test_ui_browser.py."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

import httpx
import pytest

import initiator
from nvmeof import defaults
from nvmeof.cli.daemon import Daemon, DaemonOptions
from nvmeof.uri import TransportAddress
from target.model import LATENCY_BUCKETS, LATENCY_SHIFT, NamespaceStats, Subsystem, latency_bounds
from tests.ports import free_ports

MiB = 1 << 20
NQN = defaults.DEFAULT_SUBSYSTEM_NQN
HOSTA = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-00000000000a"


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[tuple[Daemon, int, httpx.AsyncClient]]:
    io, disc, api = free_ports(3)
    daemon = Daemon(DaemonOptions(
        config_path=tmp_path / "config.json", backing_dirs=[tmp_path],
        listen=[TransportAddress("tcp", "127.0.0.1", io)], discovery=[TransportAddress("tcp", "127.0.0.1", disc)],
        api=("127.0.0.1", api), ramdisk_size=MiB,
    ))
    await daemon.start()
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{api}", timeout=10)
    try:
        for _ in range(200):  # uvicorn starts serving on the next loop iterations
            with contextlib.suppress(httpx.TransportError):
                if (await http.get("/health")).status_code == 200:
                    break
            await asyncio.sleep(0.05)
        yield daemon, io, http
    finally:
        await http.aclose()
        await daemon.stop()


async def test_shell_is_open_data_needs_the_token(running) -> None:
    daemon, _io, http = running
    page = await http.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp
    assert 'id="login-form"' in page.text and NQN not in page.text   # the shell carries no target data
    for asset, kind in (("/ui/ui.js", "text/javascript"), ("/ui/ui.css", "text/css")):
        r = await http.get(asset)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    assert (await http.get("/ui/stats")).status_code == 401
    # The token form's and the banner's link: the cookie, then on to /ui only (no open redirect).
    r = await http.get("/login", params={"token": daemon.api_token, "next": "/ui"})
    assert r.status_code == 303 and r.headers["location"] == "/ui"
    assert "HttpOnly" in r.headers["set-cookie"]
    stats = await http.get("/ui/stats")   # the client kept the cookie
    assert stats.status_code == 200 and stats.json()["namespaces"][0]["subnqn"] == NQN
    bad = await http.get("/login", params={"token": daemon.api_token, "next": "https://evil.example/"})
    assert bad.status_code == 400 and "not a page of this API" in bad.json()["detail"]
    assert daemon.api_token not in bad.text
    # The banner prints the token once, in the dashboard's login link.
    banner = daemon.banner()
    assert banner.count(daemon.api_token) == 1
    assert f"/login?token={daemon.api_token}&next=/ui" in banner


def test_static_files_fetch_nothing_from_the_network() -> None:
    static = resources.files("api").joinpath("static")
    names = sorted(p.name for p in static.iterdir())
    assert names == ["index.html", "ui.css", "ui.js"]
    for name in names:
        text = static.joinpath(name).read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), f"{name} names another site"
        assert "innerHTML" not in text, f"{name}: target strings go in with textContent only"
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'api = ["static/*"]' in pyproject   # shipped as package data


async def test_io_fills_histograms_host_counters_and_digests(running) -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    daemon, io, http = running
    http.headers["Authorization"] = f"Bearer {daemon.api_token}"
    async with initiator.connect("127.0.0.1", io, NQN, hostnqn=HOSTA, hdr_digest=True, data_digest=True,
                                 timeout=10) as ctrl:
        for i in range(3):
            await ctrl.write(1, i, bytes([i]) * 512)
        for i in range(5):
            await ctrl.read(1, i, 1)
        ctrls = (await http.get("/api/v1/controllers")).json()
        assert [(q["hdgst"], q["ddgst"]) for q in ctrls[0]["queues"]] == [(True, True), (True, True)]
        text = (await http.get("/metrics")).text
        snap = (await http.get("/ui/stats")).json()

    samples: dict[tuple[str, tuple], float] = {}
    types = {}
    for family in parser.text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert types["nvmeof_namespace_read_latency_seconds"] == "histogram"
    assert types["nvmeof_host_write_latency_seconds"] == "histogram"
    ns = (("nsid", "1"), ("subnqn", NQN))
    host = (("hostnqn", HOSTA), ("subnqn", NQN))
    for labels, reads, writes in ((ns, 5, 3), (host, 5, 3)):
        prefix = "nvmeof_namespace" if labels is ns else "nvmeof_host"
        assert samples[(f"{prefix}_reads_total", labels)] == reads
        assert samples[(f"{prefix}_writes_total", labels)] == writes
        assert samples[(f"{prefix}_written_bytes_total", labels)] == writes * 512
        for kind, count in (("read", reads), ("write", writes)):
            name = f"{prefix}_{kind}_latency_seconds"
            buckets = [samples[(f"{name}_bucket", tuple(sorted((*labels, ("le", le)))))]
                       for le in [repr(b) for b in latency_bounds()] + ["+Inf"]]
            assert buckets == sorted(buckets) and buckets[-1] == count      # cumulative, +Inf = _count
            assert samples[(f"{name}_count", labels)] == count
            assert 0 < samples[(f"{name}_sum", labels)] < 10
    # The page's JSON: the same counters, per-bucket histograms with their bounds.
    assert snap["latency_bounds"] == latency_bounds()
    (row,) = snap["namespaces"]
    assert (row["reads"], row["writes"], sum(row["read_hist"]), sum(row["write_hist"])) == (5, 3, 5, 3)
    (hrow,) = snap["hosts"]
    assert hrow["hostnqn"] == HOSTA and hrow["reads"] == 5 and hrow["read_bytes"] == 5 * 512


def test_latency_buckets_bound_each_latency() -> None:
    bounds_ns = [1 << (LATENCY_SHIFT + i) for i in range(LATENCY_BUCKETS)]
    for latency in (0, 1, 1023, 1024, 1025, 4096, 123_456, 10**9, 10**12, (1 << 63) - 1):
        bucket = (latency >> LATENCY_SHIFT).bit_length()   # what target/io.py computes
        stats = NamespaceStats()
        stats.read_hist[bucket] += 1                         # in range for any 63-bit latency
        exported = stats.exported_hist(stats.read_hist)
        i = exported.index(1)
        if latency < bounds_ns[-1]:
            assert latency < bounds_ns[i] and (i == 0 or latency >= bounds_ns[i - 1]), latency
        else:
            assert i == LATENCY_BUCKETS - 1   # folded into the last exported bucket; +Inf counts it too


def test_worker_rows_carry_histograms() -> None:
    worker = NamespaceStats(reads=2, writes=1, read_bytes=8192, write_bytes=4096, errors=1,
                            read_latency_ns=3000, write_latency_ns=900)
    worker.read_hist[2] = 2
    worker.write_hist[0] = 1
    main = NamespaceStats(reads=1)
    main.read_hist[2] = 1
    main.add_row(worker.to_row())
    assert (main.reads, main.writes, main.errors, main.read_latency_ns) == (3, 1, 1, 3000)
    assert main.read_hist[2] == 3 and main.write_hist[0] == 1
    main.add_row(worker.to_row()[:7])   # a row without histograms (an older worker) still adds up
    assert main.reads == 5 and main.read_hist[2] == 3


def test_host_stats_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(defaults, "HOST_STATS_MAX", 3)
    sub = Subsystem(nqn=NQN, serial="s")
    first = sub.stats_for_host("h0")
    assert sub.stats_for_host("h0") is first   # kept across reconnects
    for i in range(1, 5):
        sub.stats_for_host(f"h{i}")
    assert list(sub.host_stats) == ["h2", "h3", "h4"]
