#!/usr/bin/env python3
"""How long management calls take on a survivor after kill -9 of another gateway (RADOS group store).

A dead member's watch on the group's config object lingers on the OSD until osd_client_watch_timeout (30 s);
meanwhile every RADOS notify waits for its timeout. This script measures what that costs a management call:
a throwaway one-node Ceph cluster (tests/ceph_cluster.py), two `nvmeof serve` gateways over a rados store,
then on the survivor a shared-configuration change (add a subsystem, remove it again) every 0.5 s, from
before the kill until 40 s after it. It prints each call's latency and a summary (median before the kill,
median and max in the 30 s after it). Not a test: it asserts nothing; run it before and after a change.

    python3 scripts/gateway_kill9_mgmt_latency.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.ceph_cluster import CephCluster, install_if_missing  # noqa: E402
from tests.test_gateway_e2e import OPT, SETTLE, SUBNQN, Gateway, wait_states  # noqa: E402

EXTRA = "nqn.2026-12.io.nvmeof-toolkit:latency"


def change(gw: Gateway, n: int) -> float:
    """One shared-configuration change through ``gw``'s REST API (add a subsystem, remove it again): seconds."""
    start = time.monotonic()
    if n % 2 == 0:
        gw.api("POST", "/subsystems", json={"nqn": EXTRA})
    else:
        gw.api("DELETE", f"/subsystems/{EXTRA}")
    return time.monotonic() - start


def main() -> int:
    reason = install_if_missing()
    if reason:
        print(f"no Ceph cluster: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gw-latency-") as tmp:
        root = Path(tmp)
        with CephCluster(root / "ceph") as cluster:
            cluster.rbd("create", "--size", "8M", f"{cluster.pool}/lat")
            common = ["--nqn", SUBNQN, "--ceph-conf", str(cluster.conf), "--rbd-image", f"{cluster.pool}/lat",
                      "--group-store", f"rados:{cluster.pool}", "--gateway-lease", "3", "--gateway-group", "lat"]
            a = Gateway(root, "lat-a", common).start()
            b = Gateway(root, "lat-b", common).start()
            try:
                wait_states(a, {1: OPT}, SETTLE)
                before = [change(b, n) for n in range(10)]
                a.kill9()
                killed = time.monotonic()
                after: list[tuple[float, float]] = []
                n = 0
                while time.monotonic() - killed < 40:
                    at = time.monotonic() - killed
                    took = change(b, n)
                    n += 1
                    after.append((at, took))
                    print(f"t={at:5.1f} s after kill -9: {took * 1000:7.1f} ms", flush=True)
                    time.sleep(0.5)
                first30 = [took for at, took in after if at < 30]
                print(f"before the kill: median {statistics.median(before) * 1000:.1f} ms over {len(before)} calls")
                print(f"0-30 s after:    median {statistics.median(first30) * 1000:.1f} ms, "
                      f"max {max(first30) * 1000:.1f} ms over {len(first30)} calls")
                late = [took for at, took in after if at >= 30]
                if late:
                    print(f"30-40 s after:   median {statistics.median(late) * 1000:.1f} ms over {len(late)} calls")
            finally:
                b.stop()
                a.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
