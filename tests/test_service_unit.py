"""examples/systemd/nvmeof.service: its ExecStart line, run as written, speaks sd_notify and reloads.

Not under systemd (none runs here), but the way systemd would run it: the [Service] section's
Environment= lines become the environment, ${NAME} in ExecStart is expanded from them, and
NOTIFY_SOCKET names an abstract AF_UNIX datagram socket this test binds. Only what must not touch
the machine is moved, as a drop-in would: every Environment= value naming /etc, /var or /run points
into a temp dir (the unit's ConfigurationDirectory/StateDirectory/RuntimeDirectory are created
there with the unit's modes), the listeners go to free loopback ports, and `python3` on PATH is the
interpreter running this test (the unit runs `/usr/bin/env python3`), with the repository as the
working directory so `-m nvmeof` is this tree's code.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvmeof import defaults
from tests.ports import free_ports

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "examples" / "systemd" / "nvmeof.service"
MOVED = ("/etc/", "/var/", "/run/")


def unit_section(path: Path, section: str) -> list[tuple[str, str]]:
    """(key, value) pairs of one section, in order, repeated keys kept (systemd.syntax(7))."""
    out: list[tuple[str, str]] = []
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = line.strip("[]")
            continue
        if current == section:
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """systemd.service(5) "Command lines": ${NAME} is replaced inside a word; $NAME alone as a word
    is split at whitespace into several."""
    out: list[str] = []
    for word in argv:
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            out += env.get(whole.group(1), "").split()
            continue
        out.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word))
    return out


def moved(value: str, root: Path) -> str:
    for prefix in MOVED:
        value = re.sub(rf"(?<![\w/]){re.escape(prefix)}", f"{root}{prefix}", value)
    return value


class Notifications:
    """The NOTIFY_SOCKET end systemd would hold: an abstract datagram socket ('@' in the variable)."""

    def __init__(self) -> None:
        self.name = f"@nvmeof-test-{os.getpid()}-{secrets.token_hex(4)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name[1:])
        self.seen: list[dict[str, str]] = []

    def next(self, proc: subprocess.Popen, timeout: float = 60.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(0.5)
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                assert proc.poll() is None, f"the daemon exited with {proc.returncode} before notifying"
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.seen.append(fields)
            return fields
        raise AssertionError(f"no sd_notify message within {timeout} s (got {self.seen})")

    def drain(self) -> None:
        """Read what is still queued (after the daemon exited)."""
        self.sock.setblocking(False)
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return
            self.seen.append(dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line))

    def wait_for(self, key: str, proc: subprocess.Popen) -> dict[str, str]:
        while True:
            fields = self.next(proc)
            if key in fields:
                return fields


def port_listens(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def start_unit(tmp_path: Path, notify: Notifications) -> tuple[subprocess.Popen, dict[str, str], int, Path]:
    service = unit_section(UNIT, "Service")
    values = dict(service)
    assert values["Type"] == "notify", "the unit must wait for READY=1"
    env = {key: moved(value, tmp_path) for key, _, value in
           (v.partition("=") for k, v in service if k == "Environment")}
    io_port, disc_port = free_ports(2)
    assert env["NVMEOF_LISTEN"].endswith(":4420") and env["NVMEOF_DISCOVERY"].endswith(":8009")
    env["NVMEOF_LISTEN"] = f"tcp://127.0.0.1:{io_port}"
    env["NVMEOF_DISCOVERY"] = f"tcp://127.0.0.1:{disc_port}"
    for kind, base in (("Configuration", "etc"), ("State", "var/lib"), ("Runtime", "run")):
        mode = int(values.get(f"{kind}DirectoryMode", "0755"), 8)
        directory = tmp_path / base / values[f"{kind}Directory"]
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(mode)
    for path in (v for k, v in service if k == "EnvironmentFile"):
        assert path.startswith("-"), "an EnvironmentFile= the test does not have must be optional ('-')"
    argv = expand(shlex.split(values["ExecStart"]), env)
    assert argv[:4] == ["/usr/bin/env", "python3", "-m", "nvmeof"], argv
    assert str(tmp_path) in env["NVMEOF_CONFIG"] and str(tmp_path) in env["NVMEOF_STATE_DIR"]
    full = {**os.environ, **env, "NOTIFY_SOCKET": notify.name,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=full, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return proc, env, io_port, log


def test_unit_file_passes_systemd_analyze_verify() -> None:
    if not Path("/usr/bin/systemd-analyze").exists():
        pytest.skip("systemd-analyze is not installed")
    r = subprocess.run(["systemd-analyze", "verify", str(UNIT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_unit_exec_start_notifies_ready_and_reloads_without_dropping_hosts(tmp_path: Path) -> None:
    import initiator.sync as host

    notify = Notifications()
    proc, env, io_port, log = start_unit(tmp_path, notify)
    ctrl = None
    try:
        ready = notify.wait_for("READY", proc)
        # READY=1 means the listeners accept connections now, not soon.
        assert port_listens(io_port), "READY=1 came before the I/O port listened"
        assert "1 namespace(s)" in ready.get("STATUS", ""), ready
        config = Path(env["NVMEOF_CONFIG"])
        assert config.exists(), "the first start writes the default configuration to --config"
        ctrl = host.connect("127.0.0.1", io_port, subnqn=defaults.DEFAULT_SUBSYSTEM_NQN)
        cntlid = ctrl.controller.cntlid
        assert ctrl.namespaces() == [1]

        # A file that does not parse: refused, nothing changes, still READY.
        good = config.read_text()
        config.write_text(good[: len(good) // 2])
        proc.send_signal(signal.SIGHUP)
        assert "RELOADING" in notify.next(proc)
        again = notify.wait_for("READY", proc)
        assert "refused" in again.get("STATUS", ""), again
        assert ctrl.namespaces() == [1]

        # The file now names a second namespace: SIGHUP adds it; the host stays connected.
        data = json.loads(good)
        data["subsystems"][0]["namespaces"].append({"backend": "ram", "size": 16 << 20})
        config.write_text(json.dumps(data))
        proc.send_signal(signal.SIGHUP)
        reloading = notify.next(proc)
        assert reloading.get("RELOADING") == "1" and "MONOTONIC_USEC" in reloading, reloading
        after = notify.wait_for("READY", proc)
        assert "2 namespace(s)" in after.get("STATUS", ""), after
        assert ctrl.namespaces() == [1, 2], "the connected controller does not see the new namespace"
        assert ctrl.controller.cntlid == cntlid
        assert "torn down" not in log.read_text(), "a controller was dropped by the reload"
        saved = json.loads(config.read_text())
        assert [ns["nsid"] for ns in saved["subsystems"][0]["namespaces"]] == [1, 2], "file not saved back"
    finally:
        if ctrl is not None:
            ctrl.close()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    text = log.read_text()
    assert code == 0, text
    notify.drain()
    assert any("STOPPING" in m for m in notify.seen), notify.seen
    assert "reload refused" in text and "reloaded" in text, text
