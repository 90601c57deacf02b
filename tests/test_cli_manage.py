"""The management command line (`nvmeof subsystem|ns|host|listener|controller|config ...`) against
the real API served by uvicorn on a loopback port, through click's CliRunner."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import click
import pytest
import uvicorn
from click.testing import CliRunner

from api.app import create_app
from nvmeof.cli.commands import manage
from target.core import Target
from target.service import TargetService
from tests.ports import free_port

NQN = "nqn.2024-01.com.example:cli1"
TOKEN = "cli-t0ken-for-the-tests"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:7d1f5a52-9d8e-4c1b-8f0e-0d6c1c2b3a41"


class LiveServer:
    """The app on 127.0.0.1:<free port>, in a thread with its own event loop."""

    def __init__(self, service: TargetService, token: str = TOKEN) -> None:
        self.service = service
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = create_app(service, token=token)
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self.sock])

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.service.target.close(), self.loop).result(10)
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@click.group()
def root() -> None:
    pass


manage.register(root)


@pytest.fixture
def server(tmp_path):
    live = LiveServer(TargetService(Target(), config_path=tmp_path / "config.json", backing_dirs=[tmp_path]))
    yield live
    live.close()


@pytest.fixture
def run(server, monkeypatch):
    monkeypatch.setenv("NVMEOF_API_TOKEN", TOKEN)
    monkeypatch.setenv("NVMEOF_API", server.url)
    runner = CliRunner()

    def invoke(*args: str, code: int = 0, **kwargs):
        result = runner.invoke(root, list(args), catch_exceptions=False, **kwargs)
        assert result.exit_code == code, (args, result.output)
        return result

    return invoke


def test_registered_on_the_real_command_line():
    from nvmeof.cli import cli

    for name in ("subsystem", "ns", "host", "listener", "referral", "controller", "config"):
        assert isinstance(cli.commands[name], click.Group), name
    with pytest.raises(RuntimeError, match="registered twice"):
        manage.register(cli)


def test_subsystem_commands(run, server):
    out = run("subsystem", "add", NQN, "--serial", "SERIAL1").stdout
    assert out.strip() == f"created subsystem {NQN} (serial SERIAL1)"
    table = run("subsystem", "list").stdout.splitlines()
    assert table[0].split() == ["NQN", "NAMESPACES", "HOSTS", "SERIAL", "MODEL"]
    assert table[2].split()[:4] == [NQN, "0", "any", "SERIAL1"]
    listed = json.loads(run("subsystem", "list", "--json").stdout)
    assert [s["nqn"] for s in listed] == [NQN]
    shown = run("subsystem", "show", NQN).stdout
    assert f"nqn:            {NQN}" in shown and "serial:         SERIAL1" in shown
    r = run("subsystem", "add", NQN, code=1)
    assert r.stderr.strip() == f"error: subsystem {NQN} already exists"
    r = run("subsystem", "add", "nqn.bad", code=1)
    assert "is not of the form" in r.stderr
    run("ns", "add", NQN, "--size", "1M")
    r = run("subsystem", "del", NQN, code=1)
    assert "still has namespaces" in r.stderr and "force" in r.stderr
    deleted = run("subsystem", "del", NQN, "--force").stdout.strip()
    assert deleted == f"deleted subsystem {NQN} (0 controllers disconnected)"
    assert server.service.list_subsystems() == []
    assert "no subsystem" in run("subsystem", "show", NQN, code=1).stderr


def test_generated_nqn(run):
    created = json.loads(run("subsystem", "add", "--json").stdout)
    assert created["nqn"].startswith("nqn.2014-08.org.nvmexpress:uuid:")


def test_namespace_commands(run, server, tmp_path):
    run("subsystem", "add", NQN)
    out = run("ns", "add", NQN, "--size", "1M").stdout
    assert out.startswith(f"added namespace 1 to {NQN}: ram 1.0 MiB")
    disk = tmp_path / "disk.img"
    added = json.loads(run("ns", "add", NQN, "--path", str(disk), "--size", "64K", "--create",
                           "--block-size", "4096", "--nsid", "5", "--json").stdout)
    assert (added["nsid"], added["backend"], added["size"], added["block_size"]) == (5, "file", 65536, 4096)
    assert disk.stat().st_size == 65536
    r = run("ns", "resize", NQN, "5", "32K", code=1)  # a shrink cuts data: asked for explicitly only
    assert "allow_shrink" in r.stderr and disk.stat().st_size == 65536
    run("ns", "resize", NQN, "5", "32K", "--allow-shrink")
    assert disk.stat().st_size == 32768
    rows = run("ns", "list", NQN).stdout.splitlines()
    assert rows[0].split()[:4] == ["NSID", "BACKEND", "PATH", "SIZE"]
    assert [r.split()[0] for r in rows[2:]] == ["1", "5"]
    out = run("ns", "resize", NQN, "1", "2M").stdout
    assert out.strip() == f"namespace 1 of {NQN} is now 2.0 MiB (4096 blocks of 512 bytes)"
    assert server.service.get_namespace(NQN, 1).backend.size == 2 << 20
    assert run("ns", "disable", NQN, "5").stdout.strip() == f"namespace 5 of {NQN} disabled"
    assert server.service.get_namespace(NQN, 5).enabled is False
    run("ns", "enable", NQN, "5")
    assert server.service.get_namespace(NQN, 5).enabled is True
    shown = run("ns", "show", NQN, "1").stdout
    assert "reads:" in shown and "size:             2097152" in shown
    assert run("ns", "del", NQN, "5").stdout.strip() == f"removed namespace 5 from {NQN}"
    assert [ns.nsid for ns in server.service.list_namespaces(NQN)] == [1]


def test_namespace_errors(run, server):
    run("subsystem", "add", NQN)
    r = run("ns", "add", NQN, "--path", "/nonexistent/disk.img", code=1)
    assert "/nonexistent/disk.img is outside the backing directories" in r.stderr and "--backing-dir" in r.stderr
    r = run("ns", "add", NQN, "--path", "disk.img", code=1)
    assert "is relative; give an absolute path" in r.stderr
    r = run("ns", "add", NQN, "--size", "1000", code=1)
    assert "not a multiple of the block size 512" in r.stderr
    run("ns", "add", NQN, "--size", "4K")
    r = run("ns", "add", NQN, "--size", "4K", "--nsid", "1", code=1)
    assert "NSID 1 is already in use" in r.stderr
    r = run("ns", "resize", NQN, "1", "1000", code=1)
    assert "not a multiple" in r.stderr
    r = run("ns", "add", NQN, "--size", "4K", "--nguid", "zz", code=1)
    assert r.stderr.startswith("error: nguid: ")  # the API's 422 names the field
    assert [ns.nsid for ns in server.service.list_namespaces(NQN)] == [1]


@pytest.mark.parametrize("args", [
    ("ns", "resize", NQN, "one", "1M"),
    ("ns", "add", NQN, "--size", "lots"),
    ("ns", "add", NQN, "--backend", "tape"),
    ("listener", "add", "udp://1.2.3.4"),
    ("controller", "disconnect", "-1"),
    ("subsystem", "frobnicate"),
])
def test_usage_errors_exit_2(run, args):
    run(*args, code=2)


def test_host_commands(run, server):
    run("subsystem", "add", NQN, "--no-allow-any-host")
    assert run("host", "allow", NQN, HOSTNQN).stdout.strip() == f"host {HOSTNQN} may connect to {NQN}"
    assert run("host", "list", NQN).stdout.splitlines()[2].split() == [HOSTNQN, "no", "no", "default", "default", "no"]
    assert server.service.get_subsystem(NQN).host_allowed(HOSTNQN)
    assert "already allowed" in run("host", "allow", NQN, HOSTNQN, code=1).stderr
    run("host", "deny", NQN, HOSTNQN)
    assert not server.service.get_subsystem(NQN).host_allowed(HOSTNQN)
    assert "not in the allowed hosts" in run("host", "deny", NQN, HOSTNQN, code=1).stderr


def test_listener_commands(run, server):
    port = free_port()
    out = run("listener", "add", f"tcp://127.0.0.1:{port}").stdout
    assert out.strip() == f"listening on tcp:127.0.0.1:{port} (port id 1)"
    rows = run("listener", "list").stdout.splitlines()
    assert rows[2].split() == ["tcp", "127.0.0.1", str(port), "1", "no", "none", "8192"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = run("listener", "add", f"127.0.0.1:{busy.getsockname()[1]}", code=1)
    assert "already in use" in r.stderr
    run("listener", "del", f"127.0.0.1:{port}")
    assert server.service.list_listeners() == []
    run("listener", "add", f"127.0.0.1:{port}", "--inline-data-size", "131072")
    assert run("listener", "list").stdout.splitlines()[2].split()[-1] == "131072"
    assert "multiple of 16" in run("listener", "add", f"127.0.0.1:{free_port()}", "--inline-data-size", "1000",
                                   code=1).stderr
    run("listener", "del", f"127.0.0.1:{port}")
    assert "no listener" in run("listener", "del", f"127.0.0.1:{port}", code=1).stderr


def test_referral_commands(run):
    run("referral", "add", "192.0.2.10")
    assert run("referral", "list").stdout.splitlines()[2].split()[:3] == ["tcp", "192.0.2.10", "8009"]
    run("referral", "del", "192.0.2.10:8009")
    assert json.loads(run("referral", "list", "--json").stdout) == []


def test_controller_commands(run, server):
    run("subsystem", "add", NQN)
    assert run("controller", "list", "--json").stdout.strip() == "[]"
    ctrl = server.service.target.create_controller(server.service.get_subsystem(NQN), HOSTNQN, bytes(16), 5000)
    rows = run("controller", "list").stdout.splitlines()
    assert rows[2].split()[:3] == [str(ctrl.cntlid), NQN, HOSTNQN]
    assert run("controller", "disconnect", str(ctrl.cntlid)).stdout.strip() == f"controller {ctrl.cntlid} disconnected"
    assert "no connected controller" in run("controller", "disconnect", str(ctrl.cntlid), code=1).stderr


def test_config_commands(run, server, tmp_path):
    run("subsystem", "add", NQN)
    run("ns", "add", NQN, "--size", "1M")
    saved = tmp_path / "saved.json"
    run("config", "save", str(saved))
    assert json.loads(saved.read_text()) == server.service.snapshot()
    assert json.loads(run("config", "save").stdout) == server.service.snapshot()
    dump = tmp_path / "nvmet.json"
    r = run("config", "export-nvmetcli", str(dump))
    assert "ram backend has no nvmetcli equivalent" in r.stderr
    assert [s["nqn"] for s in json.loads(dump.read_text())["subsystems"]] == [NQN]

    other = LiveServer(TargetService(Target()))
    try:
        assert run("config", "load", str(saved), "--api", other.url).stdout.strip() == f"load {saved}: applied"
        assert other.service.snapshot() == server.service.snapshot()
        r = run("config", "load", str(saved), "--api", other.url, code=1)
        assert "already exists" in r.stderr and "not applied" in r.stderr
    finally:
        other.close()
    third = LiveServer(TargetService(Target()))
    try:
        run("config", "import-nvmetcli", str(dump), "--api", third.url)
        assert [s.nqn for s in third.service.list_subsystems()] == [NQN]
    finally:
        third.close()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "line 1 column 2" in run("config", "load", str(bad), code=2).stderr
    assert "No such file" in run("config", "load", str(tmp_path / "missing.json"), code=2).stderr


def test_unreachable_exit_3(run):
    url = f"http://127.0.0.1:{free_port()}"
    r = run("subsystem", "list", "--api", url, code=3)
    assert f"cannot reach the nvmeof API at {url}" in r.stderr and "nvmeof serve" in r.stderr


def test_token(tmp_path, monkeypatch):
    live = LiveServer(TargetService(Target()), token="t0ken")
    try:
        monkeypatch.delenv("NVMEOF_API_TOKEN", raising=False)
        runner = CliRunner()
        r = runner.invoke(root, ["subsystem", "list", "--api", live.url])
        assert r.exit_code == 1 and "unauthorized" in r.stderr and "--token" in r.stderr
        r = runner.invoke(root, ["subsystem", "list", "--api", live.url, "--token", "t0ken"])
        assert r.exit_code == 0, r.output
        r = runner.invoke(root, ["subsystem", "add", NQN, "--api", live.url], env={"NVMEOF_API_TOKEN": "t0ken"})
        assert r.exit_code == 0, r.output
        assert [s.nqn for s in live.service.list_subsystems()] == [NQN]
        assert "t0ken" not in r.output
    finally:
        live.close()


@pytest.fixture
def state_files(server, monkeypatch, tmp_path):
    """The files `nvmeof serve` would write for ``server``, in a private state directory."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "api-token").write_text(TOKEN + "\n")
    (state / "api-endpoint").write_text(server.url + "\n")
    monkeypatch.setenv("NVMEOF_STATE_DIR", str(state))
    monkeypatch.delenv("NVMEOF_API_TOKEN", raising=False)
    monkeypatch.delenv("NVMEOF_API", raising=False)
    return state


def test_endpoint_and_token_come_from_the_state_directory(state_files, server):
    runner = CliRunner()
    r = runner.invoke(root, ["subsystem", "add", NQN])
    assert r.exit_code == 0, r.output
    assert [s.nqn for s in server.service.list_subsystems()] == [NQN]
    assert TOKEN not in r.output
    # The same endpoint given explicitly (a trailing slash is the same place) still gets the token.
    assert runner.invoke(root, ["subsystem", "list", "--api", server.url + "/"]).exit_code == 0


def test_the_file_token_is_sent_only_to_its_endpoint(state_files, server):
    other = LiveServer(TargetService(Target()), token="other")
    try:
        r = CliRunner().invoke(root, ["subsystem", "list", "--api", other.url])
        assert r.exit_code == 1
        assert f"belongs to {server.url}, not {other.url}, so it was not sent" in r.stderr
        assert TOKEN not in r.output
    finally:
        other.close()


def test_401_names_the_missing_or_unreadable_token_file(state_files, server, monkeypatch):
    token_file = state_files / "api-token"
    token_file.unlink()
    r = CliRunner().invoke(root, ["subsystem", "list"])
    assert r.exit_code == 1 and f"there is no {token_file}" in r.stderr and "NVMEOF_STATE_DIR" in r.stderr
    token_file.write_text(TOKEN)
    real = Path.read_text

    def denied(self, *args, **kwargs):
        if self == token_file:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)   # what uid 65534 gets from a root daemon's 0600 file
    r = CliRunner().invoke(root, ["subsystem", "list"])
    assert r.exit_code == 1 and f"cannot read {token_file}: Permission denied" in r.stderr
    assert "run as the user that started `nvmeof serve`, or root" in r.stderr


def test_no_state_files_fall_back_to_the_default_endpoint(monkeypatch, tmp_path):
    monkeypatch.setenv("NVMEOF_STATE_DIR", str(tmp_path / "nothing"))
    monkeypatch.delenv("NVMEOF_API", raising=False)
    url, token, why = manage.resolve_endpoint(None, None)
    assert url == manage.DEFAULT_API and token is None and "there is no" in why


def test_config_unrestored_lists_retries_and_discards(run, server, tmp_path):
    """A namespace whose file is missing at restore is listed, then restored by --retry once it exists."""
    image = tmp_path / "disk.img"
    config = {"version": 1, "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
        {"nsid": 1, "backend": "file", "path": str(image), "block_size": 512}]}],
        "listeners": [], "referrals": []}
    errors = asyncio.run_coroutine_threadsafe(server.service.restore(config), server.loop).result(10)
    assert len(errors) == 1 and str(image) in errors[0]
    out = run("config", "unrestored").stdout
    assert "namespace" in out and str(image) in out
    listed = json.loads(run("config", "unrestored", "--json").stdout)
    assert [i["kind"] for i in listed] == ["namespace"]
    run("config", "unrestored", "--retry", code=1)           # still missing: reported, exit 1
    image.write_bytes(bytes(1 << 20))
    run("config", "unrestored", "--retry")
    assert run("config", "unrestored").stdout.strip() == "everything in the configuration was restored"
    assert [n["nsid"] for n in json.loads(run("ns", "list", NQN, "--json").stdout)] == [1]
    run("config", "unrestored", "--retry", "--discard", code=2)


def test_config_unrestored_discard(run, server, tmp_path):
    config = {"version": 1, "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
        {"nsid": 1, "backend": "file", "path": str(tmp_path / "missing.img"), "block_size": 512}]}],
        "listeners": [], "referrals": []}
    asyncio.run_coroutine_threadsafe(server.service.restore(config), server.loop).result(10)
    run("config", "unrestored", "--discard")
    assert json.loads(run("config", "unrestored", "--json").stdout) == []


def test_output_format_json_on_every_management_command(run, server):
    # nvme-cli's -o/--output-format: every API command takes it, -o json equals the older --json
    def commands(group: click.Group, prefix: tuple[str, ...] = ()):
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                yield from commands(cmd, (*prefix, name))
            else:
                yield (*prefix, name), cmd
    listed = list(commands(root))
    assert len(listed) > 20
    for path, cmd in listed:
        opts = {o for p in cmd.params for o in p.opts}
        assert {"-o", "--output-format", "--json"} <= opts, path
    run("subsystem", "add", NQN, "--serial", "SERIAL1")
    run("ns", "add", NQN, "--size", "1M")
    for args in (("subsystem", "list"), ("ns", "list", NQN), ("listener", "list"), ("controller", "list")):
        assert json.loads(run(*args, "-o", "json").stdout) == json.loads(run(*args, "--json").stdout), args
    assert [s["nqn"] for s in json.loads(run("subsystem", "list", "--output-format", "json").stdout)] == [NQN]
    assert run("subsystem", "list", "-o", "normal").stdout.split()[:1] == ["NQN"]
    r = run("ns", "resize", NQN, "1", "2M", "-o", "json")
    assert json.loads(r.stdout)["size"] == 2 << 20
    assert "'xml' is not one of 'normal', 'json'" in run("subsystem", "list", "-o", "xml", code=2).stderr


def test_ns_reservations_view_redacts_keys(run, server):
    from target.reservations import ReservationState

    run("subsystem", "add", NQN)
    run("ns", "add", NQN, "--backend", "ram", "--size", "1M")
    out = run("ns", "reservations", NQN, "1").stdout
    assert "type:         none" in out and "registrants:  none" in out
    ns = server.service.target.subsystems[NQN].namespaces[1]
    a, b = bytes(range(16)), bytes(range(16, 32))
    ns.pr = ReservationState(generation=3, registrants=((a, 0x1234567), (b, 0x89ABCDE)), rtype=3, holder=a, ptpl=True)
    shown = json.loads(run("ns", "reservations", NQN, "1", "-o", "json").stdout)
    assert shown["type"] == "write-exclusive-registrants-only" and shown["holder"] == a.hex()
    assert shown["generation"] == 3 and shown["ptpl"] is True
    assert [(r["hostid"], r["holds"], r["rkey"]) for r in shown["registrants"]] == \
        [(a.hex(), True, "<redacted>"), (b.hex(), False, "<redacted>")]
    text = run("ns", "reservations", NQN, "1").stdout
    assert a.hex() in text and "<redacted>" in text and "1234567" not in text and str(0x1234567) not in text
    r = run("ns", "reservations", NQN, "7", code=1)
    assert "namespace 7" in r.stderr
