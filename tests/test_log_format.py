"""`nvmeof --log-format json serve`: one JSON object per line, and exactly one line per connect,
disconnect and refused Connect, each with host, queue and reason fields; no secret in any line."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import initiator
from nvmeof.auth.secret import generate_secret
from nvmeof.cli.logformat import JsonFormatter
from nvmeof.status import NvmeError
from tests.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
NQN = "nqn.2026-01.io.nvmeof-toolkit:logs"
HOSTA = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-0000000000a1"
HOSTX = "nqn.2014-08.org.nvmexpress:uuid:eeeeeeee-0000-4000-8000-0000000000e1"


def test_formatter_writes_the_structured_fields() -> None:
    record = logging.LogRecord("target.fabrics", logging.INFO, __file__, 1, "hello %s", ("world",), None)
    record.__dict__.update(host=HOSTA, qid=3, reason="because", unrelated="not written")
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "hello world" and line["level"] == "info" and line["logger"] == "target.fabrics"
    assert line["host"] == HOSTA and line["qid"] == 3 and line["reason"] == "because" and "unrelated" not in line
    assert line["ts"].endswith("+00:00")


async def _wait_listening(port: int, proc: subprocess.Popen, deadline: float = 60.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        assert proc.poll() is None, "the daemon exited"
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        writer.close()
        return
    raise AssertionError(f"port {port} never listened")


async def test_json_log_lines_for_connect_disconnect_and_refusal(tmp_path: Path) -> None:
    io, disc = free_ports(2)
    key = generate_secret(nqn=HOSTA)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "version": 1,
        "subsystems": [{"nqn": NQN, "allow_any_host": False, "hosts": [{"nqn": HOSTA, "dhchap_key": key}],
                        "namespaces": [{"nsid": 1, "backend": "ram", "size": 1 << 20}]}],
        "listeners": [{"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": io}],
    }))
    log = tmp_path / "stderr.log"
    cmd = [sys.executable, "-m", "nvmeof.cli", "--log-format", "json", "serve", "--config", str(config),
           "--api", "none", "--discovery", f"127.0.0.1:{disc}"]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    try:
        await _wait_listening(io, proc)
        ctrl = await initiator.connect("127.0.0.1", io, NQN, hostnqn=HOSTA, dhchap_secret=key, timeout=10)
        cntlid = ctrl.cntlid
        await ctrl.close()
        with pytest.raises(NvmeError):
            await initiator.connect("127.0.0.1", io, NQN, hostnqn=HOSTX, timeout=10)
        end = time.monotonic() + 30
        while time.monotonic() < end and '"event": "refused"' not in log.read_text():
            await asyncio.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is one JSON object
    assert all({"ts", "level", "logger", "message"} <= line.keys() for line in lines)

    def events(kind: str, **match: Any) -> list[dict[str, Any]]:
        return [x for x in lines if x.get("event") == kind and all(x.get(k) == v for k, v in match.items())]

    connects = events("connect", host=HOSTA)
    assert len(connects) == 1, lines
    assert connects[0]["subnqn"] == NQN and connects[0]["qid"] == 0 and connects[0]["cntlid"] == cntlid
    assert connects[0]["peer"].startswith("127.0.0.1:")
    gone = events("disconnect", host=HOSTA, cntlid=cntlid)
    assert len(gone) == 1 and gone[0]["reason"] and gone[0]["subnqn"] == NQN and gone[0]["qid"] == 0, lines
    refused = events("refused", host=HOSTX)
    assert len(refused) == 1, lines
    assert refused[0]["subnqn"] == NQN and refused[0]["qid"] == 0 and "not allowed" in refused[0]["reason"]
    assert refused[0]["peer"].startswith("127.0.0.1:")
    assert key not in text and key.split(":")[2] not in text, "a DH-HMAC-CHAP secret reached the log"
