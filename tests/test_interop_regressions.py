"""Regressions the kernel interoperability suite (tests/interop) found, checked without a VM.

- `nvmeof serve` runs on uvloop when it is installed, and uvloop's TCPTransport does not subclass
  asyncio.Transport: the target's connection_made asserted that it did, so every connection failed.
- `nvmeof discover|identify|read|write` imported a nonexistent `initiator.InitiatorError` before
  doing anything, and `nvmeof discover` called vars() on a slotted dataclass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from target_host import SUBNQN, make_target

import initiator
from nvmeof import defaults
from target.model import Listener

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tests.interop.ourtarget import serve_target  # noqa: E402


def test_target_accepts_connections_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> list[int]:
        tgt = make_target()
        listener = Listener("tcp", "ipv4", "127.0.0.1", 0, portid=1)
        tgt.listeners[listener.id] = listener
        server = await tgt.start_listener(listener)
        try:
            async with initiator.connect("127.0.0.1", server.port, SUBNQN, timeout=5) as ctrl:
                await ctrl.write(1, 0, b"\xa5" * 4096)
                assert await ctrl.read(1, 0, 8) == b"\xa5" * 4096
                return await ctrl.namespaces()
        finally:
            await tgt.close()

    assert uvloop.run(scenario()) == [1]


def _nvmeof(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "nvmeof.cli", *args], input=stdin, capture_output=True,
                          timeout=60, cwd=_REPO, check=False)


def test_host_commands_against_nvmeof_serve(tmp_path: Path) -> None:
    with serve_target(tmp_path, size="16M") as t:
        conn = ["-a", t.traddr, "-s", str(t.io_port), "-n", t.subnqn]
        disc = _nvmeof("discover", "-a", t.traddr, "-s", str(t.discovery_port), "--json")
        assert disc.returncode == 0, disc.stderr.decode()
        rows = json.loads(disc.stdout)["records"]   # nvme-cli's json_discovery_log shape
        assert {(r["subnqn"], r["trsvcid"]) for r in rows} >= {(t.subnqn, str(t.io_port)),
                                                              (defaults.DISCOVERY_NQN, str(t.discovery_port))}
        table = _nvmeof("discover", "-a", t.traddr, "-s", str(t.discovery_port))
        assert table.returncode == 0 and t.subnqn.encode() in table.stdout, table.stderr.decode()

        ident = _nvmeof("identify", *conn, "--json")
        assert ident.returncode == 0, ident.stderr.decode()
        assert json.loads(ident.stdout)["namespaces"][0]["size"] == 16 << 20

        data = os.urandom(4096)
        wrote = _nvmeof("write", *conn, "--slba", "16", stdin=data)
        assert wrote.returncode == 0, wrote.stderr.decode()
        back = _nvmeof("read", *conn, "--slba", "16", "--nlb", "8")
        assert back.returncode == 0 and back.stdout == data, back.stderr.decode()
        t.assert_no_errors()


def test_host_command_unreachable_target_exits_3(tmp_path: Path) -> None:
    # A port nobody listens on: a clear message and exit status 3, not a traceback.
    from tests.interop.vm import free_port

    proc = _nvmeof("discover", "-a", "127.0.0.1", "-s", str(free_port()), "--timeout", "5")
    assert proc.returncode == 3, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr and proc.stderr.startswith(b"nvmeof: ")
