"""`nvmeof bench --poll-us N` and `--disable-sqflow`: parsed, passed to connect(), same counts. There is one
host NVMe/TCP engine (issue 26): `--tcp-engine` and connect(engine=) are gone."""

from __future__ import annotations

import json
from typing import Any

import pytest

from initiator.controller import HostController
from tests.test_bench_cli import NQN, bench, tcp_target  # noqa: F401 -- the fixture, for the test below


@pytest.mark.parametrize("extra", [[], ["--poll-us", "20"], ["--poll-us", "5", "--nr-io-queues", "2"],
                                   ["--disable-sqflow"], ["--disable-sqflow", "--poll-us", "5"]])
def test_engine_and_polling_options(tcp_target: tuple[int, Any, Any], extra: list[str]) -> None:  # noqa: F811
    port, _, _ = tcp_target
    result = bench("-s", str(port), "-n", NQN, "--rw", "randread", "--bs", "4k", "--iodepth", "4", "--size", "256k",
                   "--output-format", "json", *extra)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["jobs"][0]["read"]["total_ios"] == 64
    assert doc["cpu_us_per_io"]["initiator"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--tcp-engine", "stream"], "No such option '--tcp-engine'"),
    (["--poll-us", "-1"], "Invalid value for '--poll-us'"),
    (["--poll-us", "5", "--transport", "rdma"], "poll_us=N needs the TCP batch engine"),
])
def test_option_errors(args: list[str], message: str) -> None:
    result = bench(*args)
    assert result.exit_code == 2 and message in result.output


def test_connect_has_no_engine_choice_and_refuses_negative_poll() -> None:
    with pytest.raises(TypeError, match="engine"):
        HostController("127.0.0.1", engine="stream")   # type: ignore[call-arg]
    assert HostController("127.0.0.1").engine == "batch"
    with pytest.raises(ValueError, match="poll_us must be an integer >= 0"):
        HostController("127.0.0.1", poll_us=-5)
    assert HostController("127.0.0.1", transport="loop", target=_Loop()).engine == "stream"
    with pytest.raises(ValueError, match="poll_us=5 needs the TCP batch engine"):
        HostController("127.0.0.1", transport="loop", target=_Loop(), poll_us=5)


class _Loop:
    async def connect_loop(self, factory: Any) -> Any:
        raise NotImplementedError


@pytest.mark.parametrize("command", [["bench"], ["serve"]])
def test_no_tcp_engine_switch(command: list[str]) -> None:
    """One NVMe/TCP engine per role (issue 26): neither the host bench nor the target daemon takes a choice."""
    from click.testing import CliRunner

    from nvmeof.cli import cli

    result = CliRunner().invoke(cli, [*command, "--tcp-engine", "stream"], catch_exceptions=False)
    assert result.exit_code == 2 and "No such option '--tcp-engine'" in result.output
