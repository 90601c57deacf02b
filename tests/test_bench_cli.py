"""`nvmeof bench` command line: option parsing and errors, fio-style output, JSON, verify exit code."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from nvmeof.cli import cli
from nvmeof.cli.commands.bench import ProgressLine, fmt_bw, fmt_count
from target.core import Target
from target.service import TargetService

NQN = "nqn.2026-11.io.nvmeof-toolkit:bench-cli"


def bench(*args: str) -> Any:
    return CliRunner().invoke(cli, ["bench", *args], catch_exceptions=False)


@pytest.mark.parametrize(("args", "message"), [
    (["--bs", "4q"], "Invalid value for '--bs'"),
    (["--bs", "1000"], "1000 bytes is not a positive multiple of 512"),
    (["--rwmixread", "150"], "Invalid value for '--rwmixread': 150 is not in the range 0<=x<=100"),
    (["--rw", "sideways"], "Invalid value for '--rw': 'sideways' is not one of"),
    (["--iodepth", "0"], "Invalid value for '--iodepth'"),
    (["--runtime", "ten"], "'ten' is not a time"),
    (["--time_based"], "--time_based needs --runtime"),
    (["--rw", "randrw", "--verify", "crc32c"], "--verify works with read, write, randread or randwrite"),
    (["--verify", "md5"], "Invalid value for '--verify'"),
    (["--trsvcid", "70000"], "Invalid value for '-s' / '--trsvcid'"),
])
def test_option_errors(args: list[str], message: str) -> None:
    result = bench(*args)
    assert result.exit_code == 2
    assert message in result.output


def test_help_lists_fio_and_nvme_cli_options() -> None:
    result = bench("--help")
    assert result.exit_code == 0
    for opt in ("--rw", "--rwmixread", "--bs", "--iodepth", "--numjobs", "--runtime", "--time_based",
                "--ramp_time", "--size", "--offset", "--verify", "--output-format", "--target-pid",
                "--transport", "--traddr", "--trsvcid", "--nqn", "--hdr-digest", "--data-digest",
                "--nr-io-queues"):
        assert opt in result.output


def test_number_formatting() -> None:
    assert fmt_count(873) == "873"
    assert fmt_count(12345) == "12.3k"
    assert fmt_count(1_234_567) == "1.23M"
    assert fmt_bw(48 * 1024 * 1024) == ("48.0MiB/s", "50.3MB/s")


def test_progress_line_bar_and_rates() -> None:
    class Sink:
        text = ""

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

    sink = Sink()
    line = ProgressLine(sink, runtime=10.0, ramp=0.0, total_bytes=None)  # type: ignore[arg-type]
    line(1.0, [(1000, 4096000, 0, 0)], "run")
    line(4.5, [(13300, 54476800, 0, 0)], "run")
    last = sink.text.split("\r")[-1]
    assert last.startswith("[=============>                ]  45% run r=3.51k IOPS w=0 IOPS 13.7MiB/s eta 00:05")
    line.clear()
    assert sink.text.endswith("\r\033[K")


@pytest.fixture
def tcp_target() -> Iterator[tuple[int, Target, Any]]:
    """A target on 127.0.0.1 served by its own event loop thread, so the CLI can run asyncio.run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def start() -> None:
        t = Target(keep_alive_interval=0.1)
        service = TargetService(t)
        await service.add_subsystem(NQN)
        await service.add_namespace(NQN, backend="ram", size=8 << 20, block_size=512, nsid=1)
        await service.add_listener("tcp", "127.0.0.1", port)
        box["target"] = t

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    def on_target_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    yield port, box["target"], on_target_loop
    asyncio.run_coroutine_threadsafe(box["target"].close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_json_output_over_tcp(tcp_target: tuple[int, Target, Any]) -> None:
    port, _, _ = tcp_target
    result = bench("-s", str(port), "-n", NQN, "--rw", "randwrite", "--bs", "8k", "--iodepth", "4",
                   "--size", "1M", "--output-format", "json", "--name", "w8k")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    job = doc["jobs"][0]
    assert job["jobname"] == "w8k"
    w = job["write"]
    assert w["total_ios"] == 128 and w["io_bytes"] == 1 << 20
    assert w["iops"] == pytest.approx(w["total_ios"] * 1000 / w["runtime"])
    assert job["read"]["total_ios"] == 0
    assert "99.900000" in w["clat_ns"]["percentile"]


def test_normal_output_and_verify_failure_exit(tcp_target: tuple[int, Target, Any]) -> None:
    port, target, on_target_loop = tcp_target
    common = ["-s", str(port), "-n", NQN, "--bs", "4k", "--iodepth", "2", "--size", "256k", "--verify", "crc32c"]
    result = bench("--rw", "write", *common)
    assert result.exit_code == 0, result.output
    assert "write: IOPS=" in result.output and "read: IOPS=" in result.output
    assert "clat percentiles" in result.output and "99.90th=[" in result.output
    assert "Run status group 0 (all jobs):" in result.output
    assert "cpu per I/O  : initiator=" in result.output
    backend = target.subsystems[NQN].namespaces[1].backend
    # overwrite payload bytes of block 12 behind the host's back
    on_target_loop(backend.write(12 * 4096 + 64, b"\x00\x01\x02\x03"))
    result = bench("--rw", "read", *common)
    assert result.exit_code == 1
    assert "verify: bad block 12 (offset 0xc000, LBA 96): crc32c expected" in result.stderr


def test_connection_refused_is_a_clean_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = bench("-s", str(port), "--size", "4k")
    assert result.exit_code == 1
    assert "cannot run against 127.0.0.1" in result.output
