"""Issue 10 through the REST API and `nvmeof serve`: where file namespaces may live (item 1), never
changing a file unasked (item 2), resolved paths (item 5), and the path/size inputs that gave 500 (item 7).
TargetService and the backends have their own tests (test_service.py, test_backends.py)."""

from __future__ import annotations

import os
import resource

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from api.app import create_app
from nvmeof.cli import cli
from nvmeof.cli.daemon import Daemon, DaemonOptions
from nvmeof.uri import TransportAddress
from target.core import Target
from target.service import TargetService
from tests.ports import free_ports

NQN = "nqn.2026-01.com.example:backing"
TOKEN = "t0ken-for-the-backing-tests"
NS = f"/api/v1/subsystems/{NQN}/namespaces"


@pytest.fixture
def disks(tmp_path):
    folder = tmp_path / "disks"
    folder.mkdir()
    return folder


@pytest.fixture
def service(tmp_path, disks):
    return TargetService(Target(), config_path=tmp_path / "config.json", backing_dirs=[disks])


@pytest.fixture
def client(service):
    with TestClient(create_app(service, token=TOKEN), headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        assert c.post("/api/v1/subsystems", json={"nqn": NQN}).status_code == 201
        yield c
        c.portal.call(service.target.close)


def refused(client, body: dict, *fragments: str, status: int = 400) -> str:
    r = client.post(NS, json=body)
    assert r.status_code == status, r.text
    text = r.text
    for fragment in fragments:
        assert fragment in text, text
    return text


def test_paths_outside_the_backing_dirs_are_refused(client, service, disks, tmp_path):
    (disks / "passwd-link.img").symlink_to("/etc/passwd")
    outside = tmp_path / "outside.img"
    outside.write_bytes(bytes(4096))
    before = (tmp_path / "config.json").read_bytes()
    hint = "add --backing-dir DIR to nvmeof serve, or backing_dirs to its configuration file"
    refused(client, {"backend": "file", "path": "/etc/shadow"},
            f"path /etc/shadow is outside the backing directories ({disks}); {hint}")
    refused(client, {"backend": "file", "path": "../../etc/passwd"}, "is relative; give an absolute path")
    refused(client, {"backend": "file", "path": "/proc/self/mem"}, "is under /proc", "--allow-block-device PATH")
    refused(client, {"backend": "file", "path": str(disks / "passwd-link.img")},
            "(which resolves to /etc/passwd) is outside the backing directories")
    refused(client, {"backend": "file", "path": "/dev/zero"}, "/dev/zero is under /dev", "--allow-block-device")
    refused(client, {"backend": "file", "path": str(outside)}, "is outside the backing directories")
    assert service.list_namespaces(NQN) == [] and (tmp_path / "config.json").read_bytes() == before


def test_a_nul_byte_in_the_path_is_a_4xx_naming_the_field(client, disks):
    r = client.post(NS, json={"backend": "file", "path": f"{disks}/a\u0000b.img", "size": 4096, "create": True})
    assert 400 <= r.status_code < 500, r.text  # was a 500 (ValueError: embedded null byte)
    assert "path" in r.text and "NUL byte" in r.text
    assert os.listdir(disks) == []


def test_a_1_pib_create_is_a_4xx_naming_size_and_reason(client, disks):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 40, hard))  # every file system refuses 1 PiB now
    try:
        r = client.post(NS, json={"backend": "file", "path": f"{disks}/pib.img", "size": 1 << 50, "create": True})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert r.status_code == 400, r.text  # was a 500 (OSError EFBIG from ftruncate)
    assert "1125899906842624 bytes long" in r.text and "EFBIG" in r.text and "smaller size" in r.text
    assert os.listdir(disks) == []


def test_stored_resolved_and_shown_resolved(client, disks, tmp_path):
    (tmp_path / "alias").symlink_to(disks)
    (disks / "a.img").write_bytes(bytes(8192))
    r = client.post(NS, json={"backend": "file", "path": f"{tmp_path}/alias/./a.img"})
    assert r.status_code == 201, r.text
    assert r.json()["path"] == str(disks / "a.img")
    assert client.get("/api/v1/config").json()["subsystems"][0]["namespaces"][0]["path"] == str(disks / "a.img")


def test_an_existing_file_is_not_grown_and_a_shrink_needs_allow_shrink(client, disks):
    path = disks / "six.img"
    content = os.urandom(600)
    path.write_bytes(content)
    refused(client, {"backend": "file", "path": str(path), "size": 1024}, "is 600 bytes, less than the size 1024",
            "create")
    assert path.read_bytes() == content
    r = client.post(NS, json={"backend": "file", "path": str(path), "size": 1024, "create": True})
    assert r.status_code == 201, r.text
    nsid = r.json()["nsid"]
    r = client.post(f"{NS}/{nsid}/resize", json={"size": 512})
    assert r.status_code == 400 and "allow_shrink" in r.text and path.stat().st_size == 1024
    r = client.post(f"{NS}/{nsid}/resize", json={"size": 512, "allow_shrink": True})
    assert r.status_code == 200 and r.json()["size"] == 512
    assert path.read_bytes() == content[:512]


def test_an_nvmetcli_import_of_a_device_names_the_option(client, service):
    dump = {"subsystems": [{"nqn": NQN + "2", "namespaces": [{"nsid": 1, "device": {"path": "/dev/sda"}}]}]}
    r = client.post("/api/v1/config/nvmetcli", json=dump)
    assert r.status_code == 200, r.text
    errors = r.json()["errors"]
    assert len(errors) == 1 and "/dev/sda is under /dev" in errors[0] and "--allow-block-device PATH" in errors[0]
    assert service.list_namespaces(NQN + "2") == []


def test_serve_refuses_a_backing_dir_under_dev():
    r = CliRunner().invoke(cli, ["serve", "--api", "none", "--backing-dir", "/dev/shm"])
    assert r.exit_code == 1, r.output
    assert "backing directory /dev/shm is under /dev, where no namespace file may live" in r.stderr


async def test_daemon_start_creates_the_default_backing_dir_0700(tmp_path):
    io, disc = free_ports(2)
    state = tmp_path / "state"
    daemon = Daemon(DaemonOptions(api=None, state_dir=state, ramdisk_size=1 << 20,
                                  listen=[TransportAddress("tcp", "127.0.0.1", io)],
                                  discovery=[TransportAddress("tcp", "127.0.0.1", disc)]))
    try:
        assert daemon.service.backing.part("file").backing_dirs == (str(state / "disks"),)
        await daemon.start()
        assert (state / "disks").is_dir() and (state / "disks").stat().st_mode & 0o777 == 0o700
    finally:
        await daemon.stop()
