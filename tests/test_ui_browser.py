"""The dashboard in a real browser: Debian's chromium, driven by Playwright (the PyPI package, no
`playwright install`: it launches /usr/bin/chromium), against `nvmeof serve` in a subprocess.

It opens /ui without a cookie (the token form shows), logs in through the link `nvmeof serve` printed,
finds the subsystem, adds a namespace through the page's form and checks a connected initiator gets
the namespace-attribute AEN and sees it in the active namespace list; runs `nvmeof bench` and checks
the IOPS series the charts draw moved (read from the page's JS state, not from pixels); resizes and
removes a namespace and allows and denies a host from the page. With NVMEOF_SCREENSHOT_DIR set
(``NVMEOF_SCREENSHOT_DIR=docs/img``), it saves the README's screenshots there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import initiator.sync
from nvmeof import defaults
from tests.ports import free_ports
from tests.procs import stop_process

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
REPO = Path(__file__).resolve().parents[1]
NQN = defaults.DEFAULT_SUBSYSTEM_NQN
NQN2 = "nqn.2026-11.io.nvmeof-toolkit:dashboard-hosts"
HOSTA = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-0000000000b1"
BENCH_HOST = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-0000000000b2"
ALLOWED = "nqn.2014-08.org.nvmexpress:uuid:cccccccc-0000-4000-8000-0000000000b3"
MiB = 1 << 20
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                               "(pip install -e '.[dev]')")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (tests/install_browser_deps.sh)",
                allow_module_level=True)


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Serve:
    def __init__(self, base: Path) -> None:
        self.io, self.disc, self.port = free_ports(3)
        self.stdout, self.stderr = base / "serve.out", base / "serve.log"
        cmd = [sys.executable, "-m", "nvmeof.cli", "serve", "--state-dir", str(base / "state"),
               "--listen", f"127.0.0.1:{self.io}", "--discovery", f"127.0.0.1:{self.disc}",
               "--api", f"127.0.0.1:{self.port}", "--ramdisk-size", "64M"]
        env = {k: v for k, v in os.environ.items() if k not in ("NVMEOF_API_TOKEN", "NVMEOF_API")}
        with open(self.stdout, "wb") as out, open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, env=env)
        try:
            wait_for(lambda: self.proc.poll() is not None or "Stop with Ctrl-C" in self.stdout.read_text(),
                     "nvmeof serve to start")
        except AssertionError:
            self.stop()
            raise
        assert self.proc.poll() is None, f"nvmeof serve exited:\n{self.stderr.read_text()}"

    def login_url(self) -> str:
        match = re.search(r"Dashboard \(login\)\s+(\S+)", self.stdout.read_text())
        assert match, f"no dashboard login link in the banner:\n{self.stdout.read_text()}"
        return match.group(1)

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    daemon = Serve(tmp_path)
    yield daemon
    daemon.stop()


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        # A persistent context is Playwright's way to give chromium a --user-data-dir (fresh: tmp_path).
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=ARGS,
            viewport={"width": 1280, "height": 900})
        try:
            pg = context.new_page()
            pg.on("dialog", lambda dialog: dialog.accept())   # the page confirms removals and denials
            yield pg
        finally:
            context.close()


def series_peak(page: Any, group: str, key_part: str, field: str) -> float:
    """Largest value the page's charts hold for a series whose key contains ``key_part``."""
    return page.evaluate("""([group, part, field]) => {
        let peak = 0;
        for (const [key, points] of Object.entries(window.nvmeofDashboard.series[group]))
            if (key.includes(part)) for (const p of points) peak = Math.max(peak, p[field] || 0);
        return peak;
    }""", [group, key_part, field])


SCREENSHOTS = os.environ.get("NVMEOF_SCREENSHOT_DIR")   # where to save the README's screenshots (longer bench)


def shot(page: Any, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SCREENSHOTS) / name), full_page=True)


def test_dashboard_in_chromium(serve: Serve, page: Any, tmp_path: Path) -> None:
    base = f"http://127.0.0.1:{serve.port}"
    # Without the cookie: the token form, and no data.
    page.goto(f"{base}/ui")
    page.wait_for_selector("#login-form", state="visible")
    assert page.is_hidden("#main")

    login = serve.login_url()
    assert login.startswith(f"{base}/login?token=") and login.endswith("&next=/ui")
    page.goto(login)
    page.wait_for_url(f"{base}/ui")
    sub = page.locator(f'.subsystem[data-nqn="{NQN}"]')
    sub.wait_for(state="visible")
    assert sub.locator('tr[data-nsid="1"]').count() == 1
    assert sub.locator('tr[data-nsid="1"] td.visibility').inner_text() == "all hosts"   # masking: not masked

    with initiator.sync.connect("127.0.0.1", serve.io, NQN, hostnqn=HOSTA, timeout=10) as host:
        assert host.namespaces() == [1]
        page.wait_for_selector(f"#controllers td:text-is('{HOSTA}')")

        # Add nsid 2 (8 MiB RAM) through the page's form; the host hears of it and sees it.
        form = sub.locator("form.add-namespace")
        form.locator("select[name=backend]").select_option("ram")
        form.locator("input[name=size]").fill("8")
        form.locator("button[type=submit]").click()
        sub.locator('tr[data-nsid="2"]').wait_for(state="visible")
        event = host.next_event(timeout=30)
        assert event is not None and 2 in event.changed_nsids
        assert host.namespaces() == [1, 2]
        assert host.identify_namespace(2).nsze == 8 * MiB // 512

        # I/O from `nvmeof bench` (another host NQN) moves the charts of nsid 1 and of that host.
        bench = subprocess.run(
            [sys.executable, "-m", "nvmeof.cli", "bench", "-a", "127.0.0.1", "-s", str(serve.io), "-n", NQN,
             "-q", BENCH_HOST, "--rw", "randrw", "--bs", "4k", "--iodepth", "4",
             "--runtime", "15" if SCREENSHOTS else "4", "--time_based", "--eta", "never", "--output-format", "json"],
            cwd=REPO, capture_output=True, text=True, timeout=120)
        assert bench.returncode == 0, bench.stderr
        wait_for(lambda: series_peak(page, "ns", f"{NQN} nsid 1", "iops") > 0, "the namespace IOPS chart to move")
        wait_for(lambda: series_peak(page, "host", BENCH_HOST, "iops") > 0, "the host IOPS chart to move")
        assert series_peak(page, "ns", f"{NQN} nsid 1", "mbps") > 0
        p99 = series_peak(page, "ns", f"{NQN} nsid 1", "p99")
        assert 0 < p99 < 10e6, p99   # microseconds, from the histogram buckets
        assert series_peak(page, "ns", f"{NQN} nsid 2", "iops") == 0   # nothing ran on nsid 2
        shot(page, "dashboard.png")

        # Resize nsid 2 to 16 MiB, then remove it: both from the page, both reach the host.
        row = sub.locator('tr[data-nsid="2"]')
        row.locator("form.resize input").fill("16")
        row.locator("form.resize button").click()
        wait_for(lambda: host.identify_namespace(2).nsze == 16 * MiB // 512, "the host to see the new size")
        sub.locator('tr[data-nsid="2"] button.remove').click()
        sub.locator('tr[data-nsid="2"]').wait_for(state="detached")
        wait_for(lambda: host.namespaces() == [1], "nsid 2 to leave the host's active namespace list")

    # Allow a host, then deny it, from the page, on a subsystem with a host list; the REST API agrees.
    token = (tmp_path / "state" / defaults.API_TOKEN_FILE).read_text().strip()
    api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert api.post("/api/v1/subsystems", json={"nqn": NQN2, "allow_any_host": False}).status_code == 201
    assert sub.locator("form.allow-host").count() == 0   # allow-any-host: no host list to edit
    sub = page.locator(f'.subsystem[data-nqn="{NQN2}"]')
    sub.wait_for(state="visible")   # the page re-reads the configuration every few seconds
    hosts_url = f"/api/v1/subsystems/{NQN2}/hosts"
    form = sub.locator("form.allow-host")
    form.locator("input[name=hostnqn]").fill(ALLOWED)
    form.locator("button[type=submit]").click()
    sub.locator(f"ul.hosts li:has-text('{ALLOWED}')").wait_for(state="visible")
    assert ALLOWED in api.get(hosts_url).json()["hosts"]
    shot(page, "dashboard-subsystem.png")
    sub.locator(f"ul.hosts li:has-text('{ALLOWED}') button.deny").click()
    sub.locator(f"ul.hosts li:has-text('{ALLOWED}')").wait_for(state="detached")
    assert ALLOWED not in api.get(hosts_url).json()["hosts"]
    # A refused change shows the API's reason in the status line.
    form.locator("input[name=hostnqn]").fill("not an nqn")
    form.locator("button[type=submit]").click()
    page.wait_for_selector("#status.error")
    assert "allow host failed" in page.text_content("#status")
    api.close()
    assert token not in serve.stderr.read_text()

