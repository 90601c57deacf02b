"""benchmarks/harness.py: the one `nvmeof bench` runner that benchmarks/run.py and workers.py share."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402


def _side(iops: float) -> dict:
    return {"iops": iops, "bw_bytes": iops * 4096, "clat_ns": {"mean": 1000.0 + iops, "percentile": {"99.000000": 7}},
            "total_ios": int(iops), "runtime": 500}


def test_bench_figures_read_the_side_of_the_row_and_the_cpu_per_io() -> None:
    report = {"jobs": [{"read": _side(10.0), "write": _side(20.0)}],
              "cpu_us_per_io": {"target": 3.5, "initiator": 4.5}}
    read = harness.bench_figures(report, harness.Row("r", "randread", 4096, 1))
    write = harness.bench_figures(report, harness.Row("w", "write", 4096, 1))
    assert read["iops"] == 10.0 and read["mean_lat_ns"] == 1010.0 and read["p99_ns"] == 7
    assert write["iops"] == 20.0 and write["bw_bytes"] == 20.0 * 4096 and write["runtime_ms"] == 500
    assert read["target_cpu_us_per_io"] == 3.5 and read["initiator_cpu_us_per_io"] == 4.5


def test_a_failing_client_stops_the_run_with_its_stderr() -> None:
    with pytest.raises(SystemExit, match=r"bench failed for x \(status 3\):\nboom"):
        harness.run_json([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"],
                         "bench failed for x", 30)


@pytest.mark.parametrize("script", ["run.py", "workers.py", "ab.py"])
def test_both_scripts_start_from_the_shared_harness(script: str) -> None:
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--runtime" in out.stdout
    assert "from harness import" in (BENCH / script).read_text()
