"""Who may manage the target: `nvmeof serve` as root in a subprocess, probed by root and by an
unprivileged local user (uid 65534 through setpriv), over loopback TCP and a Unix socket.

The defaults under test: the API always needs the token; the token is generated at start and
written 0600 into a 0700 state directory, with the endpoint next to it, both removed at a clean
exit; the `nvmeof` CLI finds both by itself; foreign Host and Origin headers, non-JSON state
changes and oversize bodies are refused before anything reaches a route.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nvmeof import defaults
from nvmeof.cli.daemon import DaemonError, state_directory, write_private_file
from tests.ports import free_ports
from tests.procs import stop_process

REPO = Path(__file__).resolve().parents[1]
NQN = defaults.DEFAULT_SUBSYSTEM_NQN
NOBODY = 65534
SETPRIV = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]


def _can_drop_privileges() -> bool:
    return os.geteuid() == 0 and shutil.which("setpriv") is not None


needs_setpriv = pytest.mark.skipif(not _can_drop_privileges(),
                                   reason="needs root and setpriv(1) to act as the unprivileged uid 65534")


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A directory every user may traverse (pytest's tmp_path is 0700 and would hide everything
    from uid 65534 for the wrong reason)."""
    path = Path(tempfile.mkdtemp(prefix="nvmeof-sec-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Serve:
    """`nvmeof serve` (as root, the test's user) with its own state directory."""

    def __init__(self, base: Path, api: str | None = None, extra: tuple[str, ...] = ()) -> None:
        self.base = base
        self.state = base / "state"
        self.io, self.disc, self.port = free_ports(3)
        self.api = api or f"127.0.0.1:{self.port}"
        self.stdout, self.stderr = base / "serve.out", base / "serve.log"
        cmd = [sys.executable, "-m", "nvmeof.cli", "serve", "--state-dir", str(self.state),
               "--listen", f"127.0.0.1:{self.io}", "--discovery", f"127.0.0.1:{self.disc}",
               "--api", self.api, "--ramdisk-size", "1M", *extra]
        env = {k: v for k, v in os.environ.items() if k not in ("NVMEOF_API_TOKEN", "NVMEOF_API")}
        with open(self.stdout, "wb") as out, open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return (self.state / defaults.API_TOKEN_FILE).read_text().strip()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"nvmeof serve exited {self.proc.returncode}:\n{self.stderr.read_text()}")
            if "Stop with Ctrl-C" in self.stdout.read_text():
                return
            time.sleep(0.05)
        raise AssertionError(f"nvmeof serve did not start:\n{self.stderr.read_text()}")

    def stop(self) -> int | None:
        return stop_process(self.proc)


@pytest.fixture
def serve(public_tmp: Path) -> Iterator[Any]:
    started: list[Serve] = []

    def start(api: str | None = None, *extra: str, ready: bool = True) -> Serve:
        daemon = Serve(public_tmp, api, extra)
        started.append(daemon)
        if ready:
            daemon.wait_ready()
        return daemon

    yield start
    for daemon in started:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()


# What uid 65534 tries, with nothing but the standard library (-I -S: no site-packages).
NOBODY_SCRIPT = r"""
import http.client, json, socket, sys
port, state, sock_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
out = {}
def req(method, path, headers=None, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read().decode(errors="replace")
    c.close()
    return [r.status, data]
for name in ("api-token", "api-endpoint"):
    try:
        open(state + "/" + name).read()
        out[name] = "read"
    except PermissionError:
        out[name] = "EACCES"
    except OSError as e:
        out[name] = type(e).__name__
if port:
    out["no_token"] = req("GET", "/api/v1/subsystems")
    out["health"] = req("GET", "/health")
    out["health_v1"] = req("GET", "/api/v1/health")
    out["login"] = req("GET", "/login?token=guess")
    out["foreign_host"] = req("GET", "/api/v1/subsystems", {"Host": "rebound.example:%d" % port})
    out["form_post"] = req("POST", "/api/v1/subsystems/%s/namespaces/1/disable" % sys.argv[4],
                           {"Origin": "http://evil.example", "Content-Type": "application/x-www-form-urlencoded"},
                           b"x=1")
    # Only the headers of a 400 MiB body: the answer must come before any of it is sent.
    out["oversize"] = req("POST", "/api/v1/config", {"Content-Type": "application/json",
                                                     "Content-Length": str(400 << 20)})
if sock_path:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sock_path)
        out["unix_connect"] = "connected"
    except PermissionError:
        out["unix_connect"] = "EACCES"
    except OSError as e:
        out["unix_connect"] = type(e).__name__
print(json.dumps(out))
"""


def as_nobody(port: int, state: Path, sock_path: str = "") -> dict[str, Any]:
    proc = subprocess.run([*SETPRIV, sys.executable, "-I", "-S", "-c", NOBODY_SCRIPT, str(port), str(state),
                           sock_path, NQN.replace(":", "%3A")], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def cli(*args: str, state: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("NVMEOF_API_TOKEN", "NVMEOF_API")}
    environ.update(NVMEOF_STATE_DIR=str(state), **(env or {}))
    return subprocess.run([sys.executable, "-m", "nvmeof.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=environ)


# -- loopback TCP --------------------------------------------------------------------------------------


@needs_setpriv
def test_an_unprivileged_user_cannot_manage_the_target(serve) -> None:
    daemon = serve()
    token = daemon.token
    seen = as_nobody(daemon.port, daemon.state)
    assert seen["api-token"] == "EACCES" and seen["api-endpoint"] == "EACCES"
    assert seen["no_token"][0] == 401 and "api-token" in seen["no_token"][1]
    assert seen["health"] == [200, '{"status":"ok"}']
    assert seen["health_v1"][0] == 401 and seen["login"][0] == 401
    assert seen["foreign_host"][0] == 403 and "Host header" in seen["foreign_host"][1]
    assert seen["form_post"][0] == 403 and "Origin" in seen["form_post"][1]
    assert seen["oversize"][0] == 413 and "--api-max-body" in seen["oversize"][1]
    # Even a state directory others may enter does not give the token away: the file is 0600.
    daemon.state.chmod(0o755)
    assert as_nobody(0, daemon.state)["api-token"] == "EACCES"
    daemon.state.chmod(0o700)
    # Root (the daemon's user) with the token still manages it; the namespace was not disabled.
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as http:
        assert http.get(f"/api/v1/subsystems/{NQN}/namespaces/1").json()["enabled"] is True
        r = http.post(f"/api/v1/subsystems/{NQN}/namespaces/1/disable", content=b"x=1",
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 415
        assert http.get("/api/v1/subsystems", headers={"Host": f"rebound.example:{daemon.port}"}).status_code == 403
        assert http.get("/api/v1/subsystems", headers={"Host": f"localhost:{daemon.port}"}).status_code == 200
    assert daemon.stop() == 0


def test_token_file_endpoint_file_banner_and_clean_exit(serve) -> None:
    daemon = serve()
    token_file, endpoint_file = daemon.state / defaults.API_TOKEN_FILE, daemon.state / defaults.API_ENDPOINT_FILE
    assert stat.S_IMODE(daemon.state.stat().st_mode) == 0o700
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(endpoint_file.stat().st_mode) == 0o600
    token = daemon.token
    assert len(token) >= 32
    assert endpoint_file.read_text().strip() == daemon.url
    banner = daemon.stdout.read_text()
    # Printed once, as a login link (Jupyter-style); never in a log line.
    assert banner.count(token) == 1 and f"{daemon.url}/login?token={token}" in banner
    assert str(token_file) in banner
    with httpx.Client(base_url=daemon.url, timeout=10) as http:
        r = http.get(f"/login?token={token}", follow_redirects=False)
        assert r.status_code == 303 and "SameSite=Strict" in r.headers["set-cookie"]
        assert http.get("/docs").status_code == 200   # the cookie opens /docs
        assert http.get("/api/v1/subsystems", headers={"Origin": "http://evil.example"}).status_code == 403
    assert daemon.stop() == 0
    assert token not in daemon.stderr.read_text()
    assert not token_file.exists() and not endpoint_file.exists()


def test_every_start_generates_a_new_token_and_an_explicit_one_is_used(serve) -> None:
    first = serve()
    old = first.token
    assert first.stop() == 0
    second = serve()
    assert second.token != old
    assert second.stop() == 0
    third = serve(None, "--api-token", "given-token-0123456789")
    assert third.token == "given-token-0123456789"
    with httpx.Client(base_url=third.url, timeout=10) as http:
        assert http.get("/api/v1/subsystems", headers={"Authorization": "Bearer given-token-0123456789"}).is_success
    assert third.stop() == 0


def test_cli_reads_the_token_and_endpoint_itself_and_never_prints_the_token(serve, public_tmp: Path) -> None:
    daemon = serve()
    token = daemon.token
    r = cli("subsystem", "list", "--json", state=daemon.state)
    assert r.returncode == 0, r.stderr
    assert [s["nqn"] for s in json.loads(r.stdout)] == [NQN]
    assert token not in r.stdout + r.stderr
    # Another state directory: no token to send; the 401 says where it looked.
    empty = public_tmp / "empty"
    empty.mkdir(mode=0o700)
    r = cli("subsystem", "list", "--api", daemon.url, state=empty)
    assert r.returncode == 1 and "unauthorized" in r.stderr and str(empty / "api-token") in r.stderr
    # The file's token goes only to the endpoint recorded next to it, never to another --api.
    r = cli("subsystem", "list", "--api", f"http://localhost:{daemon.port}", state=daemon.state)
    assert r.returncode == 1 and "not sent" in r.stderr
    assert token not in r.stdout + r.stderr
    assert daemon.stop() == 0


@needs_setpriv
def test_cli_as_another_user_is_told_it_cannot_read_the_token(serve) -> None:
    daemon = serve()
    env = {k: v for k, v in os.environ.items() if k not in ("NVMEOF_API_TOKEN", "NVMEOF_API")}
    env.update(NVMEOF_STATE_DIR=str(daemon.state), HOME="/nonexistent")
    r = subprocess.run([*SETPRIV, sys.executable, "-m", "nvmeof.cli", "subsystem", "list", "--api", daemon.url],
                       capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    if "ModuleNotFoundError" in r.stderr:
        pytest.skip("the Python packages are not readable by uid 65534 here")
    assert r.returncode == 1 and "unauthorized" in r.stderr and "Permission denied" in r.stderr, r.stderr
    assert daemon.stop() == 0


# -- the state directory --------------------------------------------------------------------------------


def test_state_directory_is_created_private(tmp_path: Path) -> None:
    made = state_directory(tmp_path / "a" / "state")
    assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o700


def test_state_directory_writable_by_others_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(DaemonError, match=r"writable by group or others.*--state-dir"):
        state_directory(shared)
    shared.chmod(0o770)
    with pytest.raises(DaemonError, match="writable by group or others"):
        state_directory(shared)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_state_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(DaemonError, match=f"belongs to uid {NOBODY}"):
        state_directory(theirs)


def test_serve_refuses_a_shared_state_directory(serve, public_tmp: Path) -> None:
    (public_tmp / "state").mkdir(mode=0o777)
    (public_tmp / "state").chmod(0o777)
    daemon = serve(ready=False)
    assert daemon.proc.wait(30) == 1
    assert "writable by group or others" in daemon.stderr.read_text()


def test_private_file_replaces_atomically_with_mode_0600(tmp_path: Path) -> None:
    target = tmp_path / "api-token"
    target.write_text("old\n")
    target.chmod(0o644)
    write_private_file(target, "new")
    assert target.read_text() == "new\n" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["api-token"]
    # A symlink planted at the file's name is replaced, never followed (the temp file is opened
    # O_CREAT | O_EXCL | O_NOFOLLOW under a random name and renamed over it).
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    write_private_file(link, "x")
    assert not (tmp_path / "elsewhere").exists() and link.read_text() == "x\n" and not link.is_symlink()


# -- the Unix socket ------------------------------------------------------------------------------------


def test_unix_socket_api(serve, public_tmp: Path) -> None:
    sock_path = public_tmp / "api.sock"
    daemon = serve(f"unix:{sock_path}")
    st = os.lstat(sock_path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert (daemon.state / defaults.API_ENDPOINT_FILE).read_text().strip() == f"unix:{sock_path}"
    assert "login?token" not in daemon.stdout.read_text()   # no browser reaches a Unix socket
    transport = httpx.HTTPTransport(uds=str(sock_path))
    with httpx.Client(transport=transport, base_url="http://anything", timeout=10) as http:
        # The token is required on the socket too; the Host check does not apply there.
        assert http.get("/api/v1/subsystems").status_code == 401
        ok = http.get("/api/v1/subsystems", headers={"Authorization": f"Bearer {daemon.token}"})
        assert ok.status_code == 200 and [s["nqn"] for s in ok.json()] == [NQN]
        r = http.post(f"/api/v1/subsystems/{NQN}/namespaces/1/disable", content=b"x=1",
                      headers={"Authorization": f"Bearer {daemon.token}", "Origin": "http://evil.example",
                               "Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 403
    # The CLI finds the socket and the token by itself, or takes --api unix:PATH.
    r = cli("subsystem", "list", "--json", state=daemon.state)
    assert r.returncode == 0 and json.loads(r.stdout)[0]["nqn"] == NQN, r.stderr
    r = cli("subsystem", "list", "--api", f"unix:{sock_path}", state=daemon.state)
    assert r.returncode == 0 and NQN in r.stdout, r.stderr
    if _can_drop_privileges():
        assert as_nobody(0, daemon.state, str(sock_path))["unix_connect"] == "EACCES"
    assert daemon.stop() == 0
    assert not sock_path.exists()


def test_unix_socket_refuses_to_replace_a_file_and_replaces_a_stale_socket(serve, public_tmp: Path) -> None:
    regular = public_tmp / "not-a-socket"
    regular.write_text("precious\n")
    daemon = serve(f"unix:{regular}", ready=False)
    assert daemon.proc.wait(30) == 1
    assert "is not a socket; refusing to replace it" in daemon.stderr.read_text()
    assert regular.read_text() == "precious\n"
    stale = public_tmp / "stale.sock"
    with socket.socket(socket.AF_UNIX) as old:
        old.bind(str(stale))   # bound, never listening: what a killed daemon leaves behind
    again = serve(f"unix:{stale}")
    assert stat.S_IMODE(os.lstat(stale).st_mode) == 0o600
    assert again.stop() == 0
