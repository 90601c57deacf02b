"""Run every program in examples/ against a target started by examples/serve_from_config.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NQN = "nqn.2026-11.io.nvmeof-toolkit:example"


@pytest.fixture(scope="module")
def example_target(tmp_path_factory):
    io_port, disc_port, api_port = free_ports(3)
    config = json.loads((EXAMPLES / "target.json").read_text())
    for listener in config["listeners"]:
        listener["trsvcid"] = disc_port if listener["discovery"] else io_port
    path = tmp_path_factory.mktemp("example") / "target.json"
    path.write_text(json.dumps(config))
    log = path.with_suffix(".log")
    # Module-scoped: set up before the per-test NVMEOF_STATE_DIR of conftest, so it gets its own.
    state = tmp_path_factory.mktemp("example-state")
    base_env = {k: v for k, v in os.environ.items() if k not in ("NVMEOF_API", "NVMEOF_API_TOKEN")}
    base_env["NVMEOF_STATE_DIR"] = str(state)
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "serve_from_config.py"), str(path),
                             "--api", f"127.0.0.1:{api_port}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True, env=base_env)
    try:
        banner = proc.stdout.readline()
        assert "running" in banner, f"target did not start: {banner!r}\n{log.read_text()}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", api_port)) == 0:
                    break
            time.sleep(0.1)
        # No NVMEOF_API / NVMEOF_API_TOKEN: rest_manage.py finds both in the state directory, as
        # the README tells a newcomer.
        env = dict(base_env, NVMEOF_TRADDR="127.0.0.1", NVMEOF_TRSVCID=str(io_port), NVMEOF_NQN=NQN,
                   NVMEOF_BENCH_RUNTIME="1", PYTHONPATH=str(ROOT))
        yield env
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(15)
    assert code == 0, f"serve_from_config.py exited {code}:\n{log.read_text()}"
    assert " ERROR " not in log.read_text(), log.read_text()


def run_example(name: str, env: dict) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_write_read(example_target):
    out = run_example("write_read.py", example_target)
    assert f"connected to {NQN}" in out
    assert "namespace 1: 262144 blocks of 512 bytes" in out
    assert out.rstrip().endswith(": match")


def test_async_many_ios(example_target):
    assert "1024 I/Os of 4 KiB verified" in run_example("async_many_ios.py", example_target)


def test_rest_manage(example_target):
    out = run_example("rest_manage.py", example_target)
    assert "resized namespace 1 to 64 MiB" in out
    assert "deleted nqn.2026-11.io.nvmeof-toolkit:rest-example" in out


def test_benchmark(example_target):
    out = run_example("benchmark.py", example_target)
    assert out.startswith("4 KiB random read, QD16: ")
    iops = float(out.split(": ")[1].split(" IOPS")[0])
    assert iops > 0
