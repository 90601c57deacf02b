"""Reload (SIGHUP): the daemon re-reads --config and applies only the differences
(target/reload.py plans them, TargetService.reload applies them all or nothing), so the hosts of
whatever stays keep their controllers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import initiator
from nvmeof.cli.daemon import Daemon, DaemonOptions
from nvmeof.uri import TransportAddress
from target.reload import plan_reload
from target.service import _endpoint_key
from tests.ports import free_ports

MiB = 1 << 20
NQN = "nqn.2026-01.io.nvmeof-toolkit:reload1"
NQN2 = "nqn.2026-01.io.nvmeof-toolkit:reload2"
HOSTA = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-00000000000a"
HOSTB = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-00000000000b"


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    io, disc = free_ports(2)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "version": 1,
        "subsystems": [{"nqn": NQN, "allow_any_host": False, "hosts": [HOSTA, HOSTB],
                        "namespaces": [{"nsid": 1, "backend": "ram", "size": MiB},
                                       {"nsid": 2, "backend": "ram", "size": MiB}]}],
        "listeners": [{"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": io}],
    }))
    d = Daemon(DaemonOptions(config_path=config, backing_dirs=[tmp_path], api=None,
                             discovery=[TransportAddress("tcp", "127.0.0.1", disc)]))
    await d.start()
    d.io_port = io  # type: ignore[attr-defined]
    try:
        yield d
    finally:
        await d.stop()


def edit(d: Daemon, change: Any) -> str:
    """Apply ``change`` to the config file as an operator would; returns the text before."""
    path = d.options.config_path
    assert path is not None
    before = path.read_text()
    data = json.loads(before)
    change(data)
    path.write_text(json.dumps(data))
    return before


async def connect(d: Daemon, hostnqn: str) -> Any:
    return await initiator.connect("127.0.0.1", d.io_port, NQN, hostnqn=hostnqn, timeout=10)  # type: ignore


async def test_an_unchanged_file_plans_nothing(daemon: Daemon) -> None:
    plan = plan_reload(daemon.service.live_config(), json.loads(daemon.options.config_path.read_text()),
                       _endpoint_key)
    assert plan.empty() and not plan.problems, plan
    assert await daemon.reload() == []


async def test_reload_keeps_allowed_hosts_and_drops_the_denied_one(daemon: Daemon) -> None:
    a, b = await connect(daemon, HOSTA), await connect(daemon, HOSTB)
    try:
        cntlid_a = a.cntlid
        port2 = free_ports(1)[0]

        def change(data: dict[str, Any]) -> None:
            sub = data["subsystems"][0]
            sub["hosts"] = [HOSTA]
            sub["namespaces"] = [ns for ns in sub["namespaces"] if ns["nsid"] != 2]
            sub["namespaces"][0]["size"] = 2 * MiB
            sub["namespaces"].append({"backend": "ram", "size": MiB, "nsid": 7})
            data["subsystems"].append({"nqn": NQN2, "namespaces": [{"backend": "null", "size": MiB}]})
            data["listeners"].append({"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": port2})

        edit(daemon, change)
        assert await daemon.reload() == []
        assert await a.namespaces() == [1, 7]
        assert a.cntlid == cntlid_a and cntlid_a in daemon.target.controllers
        assert not any(c.hostnqn == HOSTB for c in daemon.target.controllers.values()), "denied host still on"
        assert (await a.identify_namespace(1)).nsze * 512 == 2 * MiB
        assert NQN2 in daemon.target.subsystems
        assert any(lst.trsvcid == port2 for lst in daemon.target.listeners.values())
        saved = json.loads(daemon.options.config_path.read_text())
        assert saved["subsystems"][0]["hosts"] == [HOSTA] and saved["subsystems"][1]["namespaces"][0]["nsid"] == 1
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d["subsystems"][0].update(serial="CHANGED"), "serial cannot change"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(block_size=4096), "block_size cannot change"),
    # the host change and the removal of nsid 2 alone would apply; the namespace that cannot open takes them back
    (lambda d: (d["subsystems"][0].update(hosts=[HOSTA]), d["subsystems"][0]["namespaces"].pop(),
                d["subsystems"][0]["namespaces"].append({"backend": "file", "path": "/nonexistent/x.img"})),
     "x.img"),
    (lambda d: d["subsystems"][0].update(allow_any_host=True), "not both"),
])
async def test_a_refused_reload_changes_nothing(daemon: Daemon, change: Any, fragment: str) -> None:
    b = await connect(daemon, HOSTB)
    try:
        live = daemon.service.live_config()
        edit(daemon, change)
        edited = daemon.options.config_path.read_text()
        errors = await daemon.reload()
        assert errors and any(fragment in e for e in errors), errors
        assert daemon.service.live_config() == live
        assert daemon.options.config_path.read_text() == edited, "the refused file was overwritten"
        assert await b.namespaces() == [1, 2]
    finally:
        await b.close()


async def test_a_file_that_does_not_load_is_refused(daemon: Daemon, caplog: pytest.LogCaptureFixture) -> None:
    live = daemon.service.live_config()
    daemon.options.config_path.write_text('{"version": 1, "subsystems": [{"nqn": 5}]}')
    errors = await daemon.reload()
    assert errors and "nqn" in errors[0]
    assert daemon.service.live_config() == live
    assert "reload refused, nothing changed" in caplog.text
