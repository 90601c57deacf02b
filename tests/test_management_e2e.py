"""Management end to end: the real daemon (in-process or `nvmeof serve`), REST over httpx, the
Python initiator over TCP; plus the service/config fixes these flows depend on (unrestored items
kept in the file, nvmetcli shape errors, imports saved under the service lock)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import initiator
from api.app import create_app
from initiator.discovery import read_discovery_log
from nvmeof import defaults
from nvmeof.cli.daemon import Daemon, DaemonOptions
from nvmeof.status import NvmeError, Status
from nvmeof.uri import TransportAddress
from target.config import ConfigError, import_nvmetcli, load_config, save_config, validate_config
from target.core import Target
from target.service import ServiceError, TargetService
from tests.ports import free_ports
from tests.procs import stop_process

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
NQN = "nqn.2026-01.io.nvmeof-toolkit:e2e-vol1"
NQN2 = "nqn.2026-01.io.nvmeof-toolkit:e2e-vol2"
NQN3 = "nqn.2026-01.io.nvmeof-toolkit:e2e-vol3"
HOSTA = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001"
HOSTB = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-000000000002"
V1 = "/api/v1"


def ns_url(nqn: str, nsid: int | None = None, action: str = "") -> str:
    url = f"{V1}/subsystems/{nqn}/namespaces"
    if nsid is not None:
        url += f"/{nsid}"
    return url + (f"/{action}" if action else "")


def ok(r: httpx.Response, status: int = 200) -> Any:
    assert r.status_code == status, f"{r.request.method} {r.request.url}: {r.status_code} {r.text}"
    return r.json() if r.content else None


async def next_event(ctrl: initiator.HostController, nsid: int, timeout: float = 10.0) -> initiator.AsyncEvent:
    """The next namespace-attribute event naming ``nsid`` (other events are skipped)."""

    async def wait() -> initiator.AsyncEvent:
        async for ev in ctrl.events():
            if nsid in ev.changed_nsids:
                return ev
        raise AssertionError("the controller closed before the event came")

    return await asyncio.wait_for(wait(), timeout)


async def genctr(port: int) -> tuple[int, list[str]]:
    ctrl = initiator.HostController("127.0.0.1", port, defaults.DISCOVERY_NQN, hostnqn=HOSTA,
                                    nr_io_queues=0, kato=0, timeout=10)
    await ctrl.open()
    try:
        gen, entries = await read_discovery_log(ctrl)
    finally:
        await ctrl.disconnect()
    return gen, [e.subnqn for e in entries]


# ---- the daemon, in-process ------------------------------------------------------------------------


class Running:
    def __init__(self, daemon: Daemon, io: int, disc: int, api: int) -> None:
        self.daemon, self.io, self.disc, self.api = daemon, io, disc, api
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{api}", timeout=10,
                                      headers={"Authorization": f"Bearer {daemon.api_token}"})

    def connect(self, hostnqn: str = HOSTA, port: int | None = None, **kw: Any) -> Any:
        return initiator.connect("127.0.0.1", port or self.io, NQN, hostnqn=hostnqn, timeout=10, **kw)


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    io, disc, api = free_ports(3)
    daemon = Daemon(DaemonOptions(
        config_path=tmp_path / "config.json",
        backing_dirs=[tmp_path],
        listen=[TransportAddress("tcp", "127.0.0.1", io)],
        discovery=[TransportAddress("tcp", "127.0.0.1", disc)],
        api=("127.0.0.1", api),
        ramdisk_size=MiB,
    ))
    await daemon.start()
    run = Running(daemon, io, disc, api)
    try:
        for _ in range(100):  # uvicorn starts serving on the next loop iterations
            with contextlib.suppress(httpx.TransportError):
                if (await run.http.get("/health")).status_code == 200:
                    break
            await asyncio.sleep(0.05)
        yield run
    finally:
        await run.http.aclose()
        await daemon.stop()


async def test_live_changes_reach_a_connected_initiator(running: Running, tmp_path: Path) -> None:
    http = running.http
    ok(await http.post(f"{V1}/subsystems", json={"nqn": NQN, "hosts": [HOSTA, HOSTB]}), 201)
    disk = tmp_path / "disk.img"
    ok(await http.post(ns_url(NQN), json={"backend": "file", "path": str(disk), "size": 4 * MiB,
                                          "create": True}), 201)
    assert disk.stat().st_size == 4 * MiB

    async with running.connect() as ctrl:
        # data path
        payload = os.urandom(8 * 512)
        await ctrl.write(1, 16, payload)
        assert await ctrl.read(1, 16, 8) == payload
        with open(disk, "rb") as f:
            f.seek(16 * 512)
            assert f.read(len(payload)) == payload  # it went to the file itself

        # add a namespace while connected: AEN + Changed Namespace List, then Identify shows it
        ok(await http.post(ns_url(NQN), json={"backend": "ram", "size": MiB}), 201)
        ev = await next_event(ctrl, 2)
        assert ev.type == 2 and ev.info == 0 and ev.lid == 0x04  # notice, NS attribute changed, log 04h
        assert await ctrl.namespaces() == [1, 2]

        # resize: the host is told and sees the new NSZE
        assert (await ctrl.identify_namespace(1)).nsze == 4 * MiB // 512
        out = ok(await http.post(ns_url(NQN, 1, "resize"), json={"size": 8 * MiB}))
        assert out["blocks"] == 8 * MiB // 512
        await next_event(ctrl, 1)
        assert (await ctrl.identify_namespace(1)).nsze == 8 * MiB // 512
        assert disk.stat().st_size == 8 * MiB
        assert await ctrl.read(1, 16, 8) == payload

        # remove the added namespace: the host is told and it is gone from the active list
        ok(await http.delete(ns_url(NQN, 2)), 204)
        await next_event(ctrl, 2)
        assert await ctrl.namespaces() == [1]

        # the REST view of the connected controller
        [info] = ok(await http.get(f"{V1}/controllers"))
        assert info["hostnqn"] == HOSTA and info["subnqn"] == NQN and len(info["queues"]) == 2


async def test_denied_host_and_removed_listener(running: Running) -> None:
    http = running.http
    ok(await http.post(f"{V1}/subsystems", json={"nqn": NQN, "hosts": [HOSTA, HOSTB]}), 201)
    ok(await http.post(ns_url(NQN), json={"backend": "ram", "size": MiB}), 201)

    async with running.connect(HOSTB) as ctrl:  # allowed before the change
        assert await ctrl.namespaces() == [1]
    assert ok(await http.delete(f"{V1}/subsystems/{NQN}/hosts/{HOSTB}")) == {"disconnected": 0}
    with pytest.raises(NvmeError) as err:
        await running.connect(HOSTB)
    assert err.value.status == Status.CONNECT_INVALID_HOST
    assert f"host NQN {HOSTB!r} is not allowed to access subsystem {NQN!r}" in str(err.value)
    async with running.connect(HOSTA) as ctrl:  # the other host is unaffected
        assert await ctrl.namespaces() == [1]

    # a second listener accepts, and after its removal nothing answers there
    (extra,) = free_ports(1)
    ok(await http.post(f"{V1}/listeners", json={"traddr": "127.0.0.1", "trsvcid": extra}), 201)
    async with running.connect(port=extra) as ctrl:
        assert await ctrl.namespaces() == [1]
    assert ok(await http.delete(f"{V1}/listeners/tcp/127.0.0.1/{extra}")) == {"disconnected": 0}
    with pytest.raises(initiator.TransportError, match="cannot connect"):
        await running.connect(port=extra)
    with socket.socket() as s:  # the port is free again, not merely refusing
        s.bind(("127.0.0.1", extra))
    saved = load_config(running.daemon.options.config_path)
    assert [lst["trsvcid"] for lst in saved["listeners"]] == [running.io, running.disc]
    assert saved["subsystems"][1]["hosts"] == [HOSTA]


async def test_discovery_generation_moves_when_a_subsystem_is_added(running: Running) -> None:
    before, entries = await genctr(running.disc)
    assert NQN2 not in entries
    ok(await running.http.post(f"{V1}/subsystems", json={"nqn": NQN2}), 201)
    after, entries = await genctr(running.disc)
    assert after > before
    assert NQN2 in entries
    # and a removal moves it again
    assert ok(await running.http.delete(f"{V1}/subsystems/{NQN2}")) == {"disconnected": 0}
    again, entries = await genctr(running.disc)
    assert again > after and NQN2 not in entries


# ---- `nvmeof serve` as a process: restart and the broken namespace ---------------------------------


class Served:
    """`nvmeof serve` in a subprocess, stopped with SIGTERM."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config, self.log = config, log
        self.io, self.disc, self.api = free_ports(3)
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        cmd = [sys.executable, "-m", "nvmeof.cli", "serve", "--config", str(self.config),
               "--backing-dir", str(self.config.parent),
               "--listen", f"127.0.0.1:{self.io}", "--discovery", f"127.0.0.1:{self.disc}",
               "--api", f"127.0.0.1:{self.api}", "--ramdisk-size", "1M"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        async with httpx.AsyncClient() as http:
            for _ in range(300):
                if self.proc.poll() is not None:
                    raise AssertionError(f"nvmeof serve exited {self.proc.returncode}:\n{self.log.read_text()}")
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                await asyncio.sleep(0.1)
        raise AssertionError(f"nvmeof serve did not answer within 30 s:\n{self.log.read_text()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api}"

    @property
    def auth(self) -> dict[str, str]:
        """The token `nvmeof serve` generated, from its state directory (NVMEOF_STATE_DIR, per test)."""
        token = (Path(defaults.state_dir()) / defaults.API_TOKEN_FILE).read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    def stop(self) -> int | None:
        assert self.proc is not None
        return stop_process(self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def served(tmp_path: Path) -> Any:
    made: list[Served] = []

    def make(config: Path | None = None) -> Served:
        s = Served(config or tmp_path / "config.json", tmp_path / "serve.log")
        made.append(s)
        return s

    yield make
    for s in made:
        s.kill()


async def test_restart_brings_back_configuration_and_data(served: Callable[..., Served], tmp_path: Path) -> None:
    first = served()
    await first.start()
    disk = tmp_path / "data.img"
    payload = os.urandom(64 * 512)
    try:
        async with httpx.AsyncClient(base_url=first.url, headers=first.auth, timeout=10) as http:
            ok(await http.post(f"{V1}/subsystems", json={"nqn": NQN, "hosts": [HOSTA], "serial": "E2E0001"}), 201)
            ok(await http.post(ns_url(NQN), json={"backend": "file", "path": str(disk), "size": 2 * MiB,
                                                  "create": True, "nsid": 3}), 201)
            ok(await http.post(ns_url(NQN), json={"backend": "ram", "size": MiB}), 201)
            ok(await http.post(f"{V1}/referrals", json={"traddr": "192.0.2.7", "trsvcid": 8009}), 201)
            before = ok(await http.get(f"{V1}/config"))
        async with initiator.connect("127.0.0.1", first.io, NQN, hostnqn=HOSTA, timeout=10) as ctrl:
            await ctrl.write(3, 100, payload)
    finally:
        assert first.stop() == 0, first.log.read_text()
    assert json.loads(first.config.read_text()) == before

    second = served()
    second.io, second.disc = first.io, first.disc  # the listeners in the file are the same ports
    await second.start()
    try:
        async with httpx.AsyncClient(base_url=second.url, headers=second.auth, timeout=10) as http:
            assert ok(await http.get(f"{V1}/config")) == before
            assert ok(await http.get(f"{V1}/config/unrestored")) == []
            sub = ok(await http.get(f"{V1}/subsystems/{NQN}"))
            assert sub["serial"] == "E2E0001" and sub["hosts"] == [HOSTA]
        async with initiator.connect("127.0.0.1", second.io, NQN, hostnqn=HOSTA, timeout=10) as ctrl:
            assert await ctrl.namespaces() == [1, 3]
            assert await ctrl.read(3, 100, 64) == payload
            assert (await ctrl.identify_namespace(3)).nsze == 2 * MiB // 512
    finally:
        assert second.stop() == 0, second.log.read_text()


async def test_broken_namespace_is_reported_kept_and_retried(served: Callable[..., Served], tmp_path: Path) -> None:
    good, gone = tmp_path / "good.img", tmp_path / "later" / "gone.img"
    good.write_bytes(b"G" * MiB)
    config_path = tmp_path / "config.json"
    daemon = served(config_path)
    broken = {"nsid": 2, "backend": "file", "path": str(gone), "block_size": 512,
              "uuid": "6c1f8e64-9d0b-4e0a-9a53-1d2f3e4a5b6c"}
    config = {
        "version": 1,
        "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
            {"nsid": 1, "backend": "file", "path": str(good), "block_size": 512}, broken]}],
        "listeners": [{"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": daemon.io, "portid": 1}],
        "referrals": [],
    }
    save_config(config_path, config)
    await daemon.start()
    try:
        log = daemon.log.read_text()
        assert "subsystems[0].namespaces[1]" in log and "gone.img" in log
        assert "kept in the file and retried at the next start" in log
        async with httpx.AsyncClient(base_url=daemon.url, headers=daemon.auth, timeout=10) as http:
            [entry] = ok(await http.get(f"{V1}/config/unrestored"))
            assert entry["kind"] == "namespace" and entry["subsystem"] == NQN
            assert entry["where"] == "subsystems[0].namespaces[1]" and "gone.img" in entry["error"]
            assert entry["item"] == broken
            # the rest is served
            async with initiator.connect("127.0.0.1", daemon.io, NQN, hostnqn=HOSTA, timeout=10) as ctrl:
                assert await ctrl.namespaces() == [1]
                assert await ctrl.read(1, 0, 1) == b"G" * 512
                # the NSID of the missing namespace stays reserved for it
                r = await http.post(ns_url(NQN), json={"backend": "ram", "size": MiB, "nsid": 2})
                assert r.status_code == 409 and "was not restored" in r.json()["detail"]
                added = ok(await http.post(ns_url(NQN), json={"backend": "ram", "size": MiB}), 201)
                assert added["nsid"] == 3
                # that mutation saved the file, and the broken namespace is still in it
                saved = load_config(config_path)["subsystems"][0]["namespaces"]
                assert [ns["nsid"] for ns in saved] == [1, 2, 3] and saved[1] == broken
                # the disk shows up: a retry restores it, and the connected host is told
                gone.parent.mkdir()
                gone.write_bytes(b"L" * MiB)
                assert ok(await http.post(f"{V1}/config/unrestored/retry")) == {"errors": [], "warnings": []}
                await next_event(ctrl, 2)
                assert await ctrl.namespaces() == [1, 2, 3]
                assert await ctrl.read(2, 0, 1) == b"L" * 512
            assert ok(await http.get(f"{V1}/config/unrestored")) == []
            restored = ok(await http.get(ns_url(NQN, 2)))
            assert restored["uuid"] == broken["uuid"]
    finally:
        assert daemon.stop() == 0, daemon.log.read_text()
    assert [ns["nsid"] for ns in load_config(config_path)["subsystems"][0]["namespaces"]] == [1, 2, 3]


# ---- the service fixes, without sockets ---------------------------------------------------------------


def _broken_config(tmp_path: Path) -> dict[str, Any]:
    good = tmp_path / "good.img"
    good.write_bytes(bytes(MiB))
    return {
        "version": 1,
        "subsystems": [
            {"nqn": NQN, "namespaces": [
                {"nsid": 1, "backend": "file", "path": str(good)},
                {"nsid": 4, "backend": "file", "path": str(tmp_path / "missing.img")},
            ]},
            {"nqn": NQN3, "serial": "S" * 30, "namespaces": [{"nsid": 1, "backend": "ram", "size": MiB}]},
        ],
        "listeners": [{"trtype": "tcp", "traddr": "192.0.2.200", "trsvcid": 4420}],  # not on this machine
        "referrals": [],
    }


async def test_unrestored_items_stay_in_the_file(tmp_path: Path) -> None:
    config = _broken_config(tmp_path)
    cfg = tmp_path / "config.json"
    save_config(cfg, config)
    target = Target()
    svc = TargetService(target, config_path=cfg, backing_dirs=[tmp_path])
    try:
        errors = await svc.restore(load_config(cfg))
        assert len(errors) == 3, errors
        kept = svc.unrestored()
        assert [(k["kind"], k["where"]) for k in kept] == [
            ("subsystem", "subsystems[1]"),
            ("namespace", "subsystems[0].namespaces[1]"),
            ("listener", "listeners[0]"),
        ]
        assert kept[1]["subsystem"] == NQN and "missing.img does not exist" in kept[1]["error"]
        assert cfg.read_text() == json.dumps(config, indent=2) + "\n"  # start-up does not rewrite the file

        # an unrelated change saves the file: every unrestored item is still in it
        await svc.add_subsystem(NQN2)
        saved = load_config(cfg)
        assert [s["nqn"] for s in saved["subsystems"]] == [NQN, NQN2, NQN3]
        assert [ns["nsid"] for ns in saved["subsystems"][0]["namespaces"]] == [1, 4]
        assert saved["subsystems"][0]["namespaces"][1] == config["subsystems"][0]["namespaces"][1]
        assert saved["subsystems"][2] == config["subsystems"][1]
        assert saved["listeners"] == config["listeners"]
        assert validate_config(saved) == saved

        # collisions with what is waiting are refused, not silently merged
        await _expect(409, "was not restored", svc.add_namespace(NQN, backend="ram", size=MiB, nsid=4))
        await _expect(409, "was not restored", svc.add_namespace(
            NQN2, backend="file", path=str(tmp_path / "missing.img"), size=MiB, create=True))
        assert not (tmp_path / "missing.img").exists()
        await _expect(409, "was not restored", svc.add_subsystem(NQN3))
        ns = await svc.add_namespace(NQN, backend="ram", size=MiB)
        assert ns.nsid == 2  # lowest free NSID that is not waiting for its file
        await _expect(409, "not restored", svc.remove_subsystem(NQN, force=False))

        # the file appears: a retry restores the namespace; the others fail again and stay
        (tmp_path / "missing.img").write_bytes(bytes(2 * MiB))
        errors = await svc.retry_unrestored()
        assert len(errors) == 2 and "subsystems[1]" in errors[0] and "listeners[0]" in errors[1]
        assert sorted(svc.get_subsystem(NQN).namespaces) == [1, 2, 4]
        assert [k["where"] for k in svc.unrestored()] == ["subsystems[1]", "listeners[0]"]
        assert [ns["nsid"] for ns in load_config(cfg)["subsystems"][0]["namespaces"]] == [1, 2, 4]

        # discarding drops them from memory and from the file
        assert await svc.discard_unrestored() == 2
        saved = load_config(cfg)
        assert svc.unrestored() == [] and [s["nqn"] for s in saved["subsystems"]] == [NQN, NQN2]
        assert saved["listeners"] == []
    finally:
        await target.close()


async def test_live_listener_supersedes_the_unrestored_one(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    target = Target()
    svc = TargetService(target, config_path=cfg, backing_dirs=[tmp_path])
    try:
        errors = await svc.restore({"version": 1, "listeners": [{"traddr": "127.0.0.1", "trsvcid": port}]})
        assert len(errors) == 1 and "already in use" in errors[0]
        assert [k["kind"] for k in svc.unrestored()] == ["listener"]
        busy.close()  # whatever held the port is gone; the operator adds the listener again
        await svc.add_listener("tcp", "127.0.0.1", port)
        assert svc.unrestored() == []
        assert [lst["trsvcid"] for lst in load_config(cfg)["listeners"]] == [port]  # once, not twice
    finally:
        busy.close()
        await target.close()


async def test_removing_a_subsystem_with_force_drops_its_unrestored_namespaces(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    target = Target()
    svc = TargetService(target, config_path=cfg, backing_dirs=[tmp_path])
    try:
        await svc.restore({"version": 1, "subsystems": [
            {"nqn": NQN, "namespaces": [{"nsid": 1, "backend": "file", "path": str(tmp_path / "x.img")}]}]})
        assert len(svc.unrestored()) == 1
        await svc.remove_subsystem(NQN, force=True)
        assert svc.unrestored() == [] and load_config(cfg)["subsystems"] == []
    finally:
        await target.close()


async def test_restore_with_persist_saves_and_undoes_a_failed_save(tmp_path: Path) -> None:
    folder = tmp_path / "etc"
    folder.mkdir()
    cfg = folder / "config.json"
    target = Target()
    svc = TargetService(target, config_path=cfg, backing_dirs=[tmp_path])
    port = free_ports(1)[0]
    config = {"version": 1,
              "subsystems": [{"nqn": NQN, "namespaces": [{"backend": "ram", "size": MiB},
                                                           {"backend": "file", "path": "/nonexistent/x"}]}],
              "listeners": [{"traddr": "127.0.0.1", "trsvcid": port}],
              "referrals": [{"traddr": "192.0.2.1", "trsvcid": 8009}]}
    try:
        errors = await svc.restore(config, persist=True)
        assert len(errors) == 1 and "/nonexistent/x" in errors[0]
        assert svc.unrestored() == []  # an import reports its failures to the caller instead
        assert load_config(cfg) == svc.snapshot()

        await svc.add_subsystem(NQN2)
        before = svc.snapshot()
        folder.rename(tmp_path / "moved")  # saving fails from now on
        port2 = free_ports(1)[0]
        more = {"version": 1,
                "subsystems": [{"nqn": NQN3, "namespaces": [{"backend": "ram", "size": MiB}]}],
                "listeners": [{"traddr": "127.0.0.1", "trsvcid": port2}],
                "referrals": [{"traddr": "192.0.2.2", "trsvcid": 8009}]}
        more["subsystems"].append({"nqn": NQN2, "namespaces": [{"backend": "ram", "size": MiB}]})
        with pytest.raises(ServiceError) as err:
            await svc.restore(more, persist=True)
        assert err.value.status == 500 and "the import was undone" in err.value.message
        assert svc.snapshot() == before
        with socket.socket() as s:
            s.bind(("127.0.0.1", port2))  # the listener the import started was stopped again
    finally:
        await target.close()


async def _expect(status: int, fragment: str, coro: Any) -> None:
    with pytest.raises(ServiceError) as err:
        await coro
    assert err.value.status == status and fragment in err.value.message, err.value.message


# ---- the REST side of those fixes ----------------------------------------------------------------------


@pytest.fixture
def rest(tmp_path: Path) -> Any:
    service = TargetService(Target(), config_path=tmp_path / "config.json", backing_dirs=[tmp_path])
    client = TestClient(create_app(service, token="e2e"), headers={"Authorization": "Bearer e2e"})
    client.__enter__()
    yield client, service
    client.portal.call(service.target.close)
    client.__exit__(None, None, None)


def test_rest_unrestored_list_retry_discard(rest: Any, tmp_path: Path) -> None:
    client, service = rest
    late = tmp_path / "late.img"
    config = {"version": 1, "subsystems": [{"nqn": NQN, "namespaces": [
        {"nsid": 1, "backend": "file", "path": str(late)},
        {"nsid": 2, "backend": "file", "path": str(tmp_path / "never.img")}]}]}
    assert len(client.portal.call(service.restore, config)) == 2
    listed = client.get(f"{V1}/config/unrestored").json()
    assert [(e["kind"], e["where"], e["subsystem"]) for e in listed] == [
        ("namespace", "subsystems[0].namespaces[0]", NQN), ("namespace", "subsystems[0].namespaces[1]", NQN)]
    assert listed[0]["item"] == config["subsystems"][0]["namespaces"][0]
    assert [ns["nsid"] for ns in client.get(f"{V1}/config").json()["subsystems"][0]["namespaces"]] == [1, 2]

    late.write_bytes(bytes(MiB))
    r = client.post(f"{V1}/config/unrestored/retry")
    assert r.status_code == 200 and len(r.json()["errors"]) == 1 and "never.img" in r.json()["errors"][0]
    assert [e["where"] for e in client.get(f"{V1}/config/unrestored").json()] == ["subsystems[0].namespaces[1]"]
    assert client.get(ns_url(NQN, 1)).status_code == 200

    assert client.delete(f"{V1}/config/unrestored").status_code == 204
    assert client.get(f"{V1}/config/unrestored").json() == []
    saved = json.loads((tmp_path / "config.json").read_text())
    assert [ns["nsid"] for ns in saved["subsystems"][0]["namespaces"]] == [1]


def test_rest_import_is_saved_by_the_service_and_undone_when_it_cannot_be(rest: Any, tmp_path: Path) -> None:
    client, service = rest
    body = {"version": 1, "subsystems": [{"nqn": NQN, "namespaces": [{"backend": "ram", "size": MiB}]}]}
    r = client.post(f"{V1}/config", json=body)
    assert r.status_code == 200 and r.json()["errors"] == []
    assert load_config(tmp_path / "config.json") == service.snapshot()

    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()  # renaming the new file over a folder fails, even for root
    r = client.post(f"{V1}/config", json={"version": 1, "subsystems": [
        {"nqn": NQN2, "namespaces": [{"backend": "ram", "size": MiB}]}]})
    assert r.status_code == 500 and "the import was undone" in r.json()["detail"]
    assert [s.nqn for s in service.list_subsystems()] == [NQN]


# ---- nvmetcli import: wrong shapes are errors that name the place ------------------------------------------


@pytest.mark.parametrize(("dump", "place"), [
    ({"subsystems": "nope"}, "subsystems: expected a list, got str 'nope'"),
    ({"subsystems": [{"nqn": NQN, "allowed_hosts": 5}]},
     "subsystems[0].allowed_hosts: expected a list of host NQN strings, got int 5"),
    ({"subsystems": [{"nqn": NQN, "allowed_hosts": [HOSTA, 7]}]},
     "subsystems[0].allowed_hosts[1]: expected host NQN strings, got int 7"),
    ({"subsystems": [{"nqn": 12}]}, "subsystems[0].nqn: expected an NQN string, got int 12"),
    ({"subsystems": [{"nqn": NQN, "attr": ["allow_any_host"]}]}, "subsystems[0].attr: expected an object"),
    ({"subsystems": [{"nqn": NQN, "namespaces": [{"nsid": "1", "device": {"path": "/x"}}]}]},
     "subsystems[0].namespaces[0].nsid: expected an integer, got str '1'"),
    ({"subsystems": [{"nqn": NQN, "namespaces": [{"nsid": 1, "device": {"path": 3}}]}]},
     "subsystems[0].namespaces[0].device.path: expected a string, got int 3"),
    ({"subsystems": [{"nqn": NQN, "namespaces": [None]}]}, "subsystems[0].namespaces[0]: expected an object, got null"),
    ({"ports": [{"portid": 1, "addr": {"trtype": "tcp"}, "referrals": [42]}]},
     "ports[0].referrals[0]: expected an object, got int 42"),
    ({"ports": [{"portid": 1, "addr": {"trtype": "tcp"}, "referrals": [{"addr": 9}]}]},
     "ports[0].referrals[0].addr: expected an object, got int 9"),
    ({"ports": [{"portid": 1, "addr": {"trtype": ["tcp"]}}]}, "ports[0].addr.trtype: expected a string"),
    ({"ports": [{"portid": [1]}]}, "ports[0].portid: expected a port number"),
    ({"ports": [{"portid": 1, "subsystems": NQN}]}, "ports[0].subsystems: expected a list of subsystem NQN"),
    ({"hosts": [{"nqn": None}]}, "hosts[0].nqn: expected a host NQN string, got null"),
    ({"hosts": {}}, "hosts: expected a list, got dict"),
    ({"subsystems": [{"nqn": NQN, "passthru": {"device": {}}}]}, "subsystems[0].passthru: expected a list"),
])
def test_import_nvmetcli_refuses_wrong_shapes(dump: dict[str, Any], place: str) -> None:
    with pytest.raises(ConfigError) as err:
        import_nvmetcli(dump)
    assert str(err.value).startswith("malformed nvmetcli configuration:")
    assert place in str(err.value)


def test_import_nvmetcli_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as err:
        import_nvmetcli({"subsystems": [{"nqn": NQN, "allowed_hosts": 5}, 3], "ports": "x"})
    lines = str(err.value).splitlines()[1:]
    assert lines == ["subsystems[0].allowed_hosts: expected a list of host NQN strings, got int 5",
                     "subsystems[1]: expected an object, got int 3",
                     "ports: expected a list, got str 'x'"]


def test_import_nvmetcli_unused_passthru_node_and_padded_serial() -> None:
    """A kernel with passthru support dumps a passthru node for every subsystem; only one with a
    device is a passthru controller. configfs pads attr_serial with spaces."""
    def dump(path: str) -> dict[str, Any]:
        return {"subsystems": [{"nqn": NQN, "attr": {"serial": "abc123      ", "model": "Linux"}, "passthru": [
            {"admin_timeout": 0, "clear_ids": 0, "device": {"path": path}, "io_timeout": 0}]}]}

    out = import_nvmetcli(dump(""))
    assert out.warnings == [] and out["subsystems"][0]["serial"] == "abc123"
    out = import_nvmetcli(dump("/dev/nvme0"))
    assert out.warnings == [f"subsystems[0] ({NQN}): passthru controllers are not supported, dropped"]


def test_rest_nvmetcli_import_names_the_place(rest: Any) -> None:
    client, service = rest
    r = client.post(f"{V1}/config/nvmetcli", json={"subsystems": [{"nqn": NQN, "allowed_hosts": 5}]})
    assert r.status_code == 400
    assert "subsystems[0].allowed_hosts: expected a list of host NQN strings, got int 5" in r.json()["detail"]
    r = client.post(f"{V1}/config/nvmetcli", json={"ports": [{"portid": 1, "referrals": [1]}]})
    assert r.status_code == 400 and "ports[0].referrals[0]: expected an object" in r.json()["detail"]
    assert service.list_subsystems() == []


SAMPLE = {
    "discovery": {"nqn": defaults.DISCOVERY_NQN},
    "hosts": [{"dhchap": {}, "nqn": HOSTA}],
    "ports": [{
        "addr": {"adrfam": "ipv4", "traddr": "192.0.2.33", "treq": "not specified", "trsvcid": "4420",
                 "trtype": "tcp", "tsas": "none"},
        "ana_groups": [{"ana": {"state": "optimized"}, "grpid": 1}],
        "param": {"inline_data_size": "16384", "pi_enable": "0"},
        "portid": 1,
        "referrals": [{"addr": {"adrfam": "ipv4", "portid": "2", "traddr": "192.0.2.40", "treq": "not specified",
                                "trsvcid": "8009", "trtype": "tcp"}, "enable": 1, "name": "peer"}],
        "subsystems": [NQN],
    }],
    "subsystems": [{
        "allowed_hosts": [HOSTA],
        "attr": {"allow_any_host": "0", "model": "Linux", "serial": "0123456789abcdef", "version": "1.3"},
        "namespaces": [{"ana": {}, "ana_grpid": 1, "device": {
            "nguid": "3b2c1d4e-5f60-4718-8293-a4b5c6d7e8f9", "path": "/dev/ram0",
            "uuid": "d592cdf3-5d1c-44e0-8412-3fcf7d99df27"}, "enable": 1, "nsid": 1, "resv": {}}],
        "nqn": NQN,
    }],
}

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70000) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


_SAMPLE_PATHS = _paths(SAMPLE)[1:]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(_SAMPLE_PATHS), _json), min_size=1, max_size=3))
def test_import_nvmetcli_never_crashes(replacements: list[tuple[tuple[Any, ...], Any]]) -> None:
    """Any value of any type anywhere in a real dump: a conversion or a ConfigError, nothing else."""
    dump = json.loads(json.dumps(SAMPLE))
    for path, value in replacements:
        node = dump
        try:
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier replacement changed the shape above this path
    try:
        out = import_nvmetcli(dump)
    except ConfigError as exc:
        assert str(exc).startswith(("malformed nvmetcli configuration:", "nvmetcli config:"))
        return
    validate_config(dict(out))  # what comes out is always a loadable configuration
