"""initiator.kernel without a kernel: option strings, the missing-module message, and block device / controller
discovery against a fake sysfs tree laid out as Linux lays it out (the VM test, tests/interop/
test_kernel_attach.py, proves the same calls against the real kernel host).
"""

from __future__ import annotations

import errno
import json
import os
import types
import uuid
from pathlib import Path

import pytest
import pyudev
from click.testing import CliRunner

from initiator import kernel
from nvmeof.cli import cli

NQN = "nqn.2026-11.io.nvmeof-toolkit:unit"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427"
HOSTID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"


# --------------------------------------------------------------------------- build_options


def test_build_options_matches_the_nvme_cli_spelling() -> None:
    opts = kernel.build_options(subnqn=NQN, transport="tcp", traddr="10.0.0.1", trsvcid=4420, hostnqn=HOSTNQN,
                                hostid=HOSTID, nr_io_queues=4, queue_size=64, kato=30, ctrl_loss_tmo=-1,
                                reconnect_delay=2, hdr_digest=True, data_digest=True, disable_sqflow=True,
                                host_traddr="10.0.0.2")
    assert opts == (f"nqn={NQN},transport=tcp,traddr=10.0.0.1,trsvcid=4420,host_traddr=10.0.0.2,"
                    f"hostnqn={HOSTNQN},hostid={HOSTID},nr_io_queues=4,queue_size=64,keep_alive_tmo=30,"
                    "ctrl_loss_tmo=-1,reconnect_delay=2,hdr_digest,data_digest,disable_sqflow")


def test_build_options_minimal_and_loop() -> None:
    assert kernel.build_options(subnqn=NQN, transport="rdma", traddr="192.168.1.5", trsvcid=4420,
                                hostnqn=HOSTNQN, hostid=HOSTID) == (
        f"nqn={NQN},transport=rdma,traddr=192.168.1.5,trsvcid=4420,hostnqn={HOSTNQN},hostid={HOSTID}")
    # nvme-loop has no address: the kernel rejects traddr/trsvcid it does not expect
    assert kernel.build_options(subnqn=NQN, transport="loop", traddr="unused", trsvcid=0, hostnqn=HOSTNQN,
                                hostid=HOSTID) == f"nqn={NQN},transport=loop,hostnqn={HOSTNQN},hostid={HOSTID}"


@pytest.mark.parametrize(("field", "value"), [("subnqn", "nqn.x,transport=rdma"), ("traddr", ""),
                                              ("hostnqn", "nqn.a\nnqn.b"), ("subnqn", "")])
def test_build_options_refuses_values_that_would_inject_options(field: str, value: str) -> None:
    args = {"subnqn": NQN, "transport": "tcp", "traddr": "10.0.0.1", "trsvcid": 4420, "hostnqn": HOSTNQN,
            "hostid": HOSTID, field: value}
    with pytest.raises(kernel.KernelAttachError, match=f"invalid {field}"):
        kernel.build_options(**args)


def test_build_options_refuses_an_unknown_transport() -> None:
    with pytest.raises(kernel.KernelAttachError, match="unknown transport 'fc'"):
        kernel.build_options(subnqn=NQN, transport="fc", traddr="a", trsvcid=1, hostnqn=HOSTNQN, hostid=HOSTID)


# --------------------------------------------------------------------------- /dev/nvme-fabrics missing


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_missing_fabrics_device_says_how_to_load_it(monkeypatch, tmp_path: Path, transport: str) -> None:
    monkeypatch.setattr(kernel, "FABRICS_DEV", str(tmp_path / "nvme-fabrics"))
    with pytest.raises(kernel.KernelAttachError) as info:
        kernel.connect("10.0.0.1", 4420, subnqn=NQN, transport=transport)
    msg = str(info.value)
    assert f"{tmp_path / 'nvme-fabrics'} does not exist" in msg
    # exactly one module per modprobe: further words would be taken as module parameters
    assert f"'modprobe nvme-{transport}'" in msg
    assert f"CONFIG_NVME_{transport.upper()}" in msg


def test_cli_connect_without_fabrics_exits_4(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kernel, "FABRICS_DEV", str(tmp_path / "nvme-fabrics"))
    res = CliRunner().invoke(cli, ["connect", "-a", "10.0.0.1", "-s", "4420", "-n", NQN])
    assert res.exit_code == 4, res.output
    assert "'modprobe nvme-tcp'" in res.output


def test_cli_connect_needs_an_nqn() -> None:
    res = CliRunner().invoke(cli, ["connect", "-a", "10.0.0.1"])
    assert res.exit_code == 2 and "--nqn" in res.output


# --------------------------------------------------------------------------- a fake sysfs tree


class FakeUdevDevice:
    """What block_devices() reads from a pyudev Device."""

    def __init__(self, sys_path: Path, devname: str | None) -> None:
        self.sys_path = str(sys_path)
        self.sys_name = sys_path.name
        self.device_node = devname


class FakeSysfs:
    """/sys/devices, /sys/class/nvme, /sys/class/nvme-subsystem and the block disks, as Linux 6.x builds them:
    fabrics controllers under devices/virtual/nvme-fabrics/ctl, multipath heads under their nvme-subsystem
    device, hidden per-path disks (nvmeXcYnZ) under the controller."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.devices = root / "devices" / "virtual"
        self.class_nvme = root / "class" / "nvme"
        self.class_subsys = root / "class" / "nvme-subsystem"
        self.disks: list[tuple[Path, str | None]] = []
        for d in (self.class_nvme, self.class_subsys):
            d.mkdir(parents=True)

    def controller(self, name: str, *, transport: str = "tcp", nqn: str = NQN, parent: str = "nvme-fabrics/ctl",
                   subsys: str | None = None) -> Path:
        ctrl = self.devices / parent / name
        ctrl.mkdir(parents=True)
        attrs = {"transport": transport, "subsysnqn": nqn, "state": "live", "cntlid": "1",
                 "address": "traddr=10.0.0.1,trsvcid=4420,src_addr=10.0.0.2"}
        for key, value in attrs.items():
            (ctrl / key).write_text(value + "\n")
        (ctrl / "delete_controller").write_text("")
        os.symlink(os.path.relpath(ctrl, self.class_nvme), self.class_nvme / name)
        if subsys is not None:
            sub = self.devices / "nvme-subsystem" / subsys
            sub.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(ctrl, sub), sub / name)
            if not (self.class_subsys / subsys).exists():
                os.symlink(os.path.relpath(sub, self.class_subsys), self.class_subsys / subsys)
        return ctrl

    def disk(self, parent: Path, name: str, *, devnode: bool = True) -> None:
        disk = parent / name
        disk.mkdir()
        os.symlink(os.path.relpath(parent, disk), disk / "device")
        self.disks.append((disk, f"/dev/{name}" if devnode else None))

    def head(self, subsys: str, name: str) -> None:
        self.disk(self.devices / "nvme-subsystem" / subsys, name)

    def context_class(self) -> type:
        disks = self.disks

        class Context:
            def list_devices(self, **match):
                assert match == {"subsystem": "block", "DEVTYPE": "disk"}, match
                return iter([FakeUdevDevice(path, node) for path, node in disks])

        return Context


@pytest.fixture
def sysfs(monkeypatch, tmp_path: Path) -> FakeSysfs:
    fake = FakeSysfs(tmp_path / "sys")
    monkeypatch.setattr(kernel, "SYS_NVME", fake.class_nvme)
    monkeypatch.setattr(kernel, "SYS_NVME_SUBSYS", fake.class_subsys)
    monkeypatch.setattr(pyudev, "Context", fake.context_class())
    return fake


def populate(sysfs: FakeSysfs) -> None:
    """nvme3: multipath, head nvme2n1 (+ hidden nvme2c3n1); nvme4: another subsystem with nvme4n1;
    nvme12: no multipath, nvme12n1, nvme12n2, nvme12n10; nvme0: a local PCIe drive with nvme0n1; sda."""
    c3 = sysfs.controller("nvme3", subsys="nvme-subsys2")
    sysfs.head("nvme-subsys2", "nvme2n1")
    sysfs.disk(c3, "nvme2c3n1")
    c4 = sysfs.controller("nvme4", nqn=NQN + "-other", subsys="nvme-subsys4")
    sysfs.head("nvme-subsys4", "nvme4n1")
    sysfs.disk(c4, "nvme4c4n1")
    c12 = sysfs.controller("nvme12", transport="rdma")
    for n in ("nvme12n10", "nvme12n2", "nvme12n1"):
        sysfs.disk(c12, n, devnode=n != "nvme12n2")   # no DEVNAME: the name gives the node
    c0 = sysfs.controller("nvme0", transport="pcie", nqn="nqn.2014.08.org.nvmexpress:local",
                          parent="pci0/0000:01:00.0/nvme")
    sysfs.disk(c0, "nvme0n1")
    scsi = sysfs.devices / "scsi" / "host0"
    scsi.mkdir(parents=True)
    sysfs.disk(scsi, "sda")


def test_block_devices_follow_the_multipath_head_and_plain_disks(sysfs: FakeSysfs) -> None:
    populate(sysfs)
    assert kernel.block_devices("nvme3") == ["/dev/nvme2n1"]       # the head, never the hidden path disk
    assert kernel.block_devices("nvme4") == ["/dev/nvme4n1"]
    assert kernel.block_devices("nvme12") == ["/dev/nvme12n1", "/dev/nvme12n2", "/dev/nvme12n10"]
    assert kernel.block_devices("nvme7") == []


def test_controllers_lists_fabrics_controllers_only(sysfs: FakeSysfs) -> None:
    populate(sysfs)
    listed = kernel.controllers()
    assert [c["name"] for c in listed] == ["nvme3", "nvme4", "nvme12"]    # numeric order, PCIe nvme0 left out
    assert listed[0] == {"name": "nvme3", "transport": "tcp",
                         "address": "traddr=10.0.0.1,trsvcid=4420,src_addr=10.0.0.2", "subsysnqn": NQN,
                         "state": "live", "cntlid": "1", "block_devices": ["/dev/nvme2n1"]}
    assert listed[2]["transport"] == "rdma"


def test_disconnect_writes_delete_controller(sysfs: FakeSysfs) -> None:
    populate(sysfs)
    kernel.disconnect("nvme4")
    assert (sysfs.class_nvme / "nvme4" / "delete_controller").read_text() == "1"
    assert (sysfs.class_nvme / "nvme3" / "delete_controller").read_text() == ""
    with pytest.raises(kernel.KernelAttachError, match="'sda' is not a controller name"):
        kernel.disconnect("sda")
    with pytest.raises(kernel.KernelAttachError, match="no controller nvme9"):
        kernel.disconnect("nvme9")


def test_disconnect_nqn_deletes_every_controller_of_the_subsystem(sysfs: FakeSysfs) -> None:
    populate(sysfs)
    assert kernel.disconnect_nqn(NQN) == ["nvme3", "nvme12"]     # every transport, every address
    assert (sysfs.class_nvme / "nvme3" / "delete_controller").read_text() == "1"
    assert (sysfs.class_nvme / "nvme12" / "delete_controller").read_text() == "1"
    assert (sysfs.class_nvme / "nvme4" / "delete_controller").read_text() == ""
    assert kernel.disconnect_nqn("nqn.2014.08.org.nvmexpress:local") == []   # never a PCIe drive
    assert (sysfs.class_nvme / "nvme0" / "delete_controller").read_text() == ""


def test_cli_list_and_disconnect(sysfs: FakeSysfs) -> None:
    populate(sysfs)
    runner = CliRunner()
    res = runner.invoke(cli, ["connect", "--list", "--json"])
    assert res.exit_code == 0, res.output
    assert [c["name"] for c in json.loads(res.output)] == ["nvme3", "nvme4", "nvme12"]
    res = runner.invoke(cli, ["connect", "--list"])
    assert res.exit_code == 0 and "nvme2n1" in res.output and NQN + "-other" in res.output
    res = runner.invoke(cli, ["disconnect", "-n", NQN + "-other"])
    assert res.exit_code == 0 and "disconnected 1 controller(s): nvme4" in res.output
    res = runner.invoke(cli, ["disconnect", "-n", "nqn.2026-11.io.nvmeof-toolkit:nobody"])
    assert res.exit_code == 4 and "no controller is connected" in res.output
    res = runner.invoke(cli, ["disconnect", "-d", "/dev/nvme9"])
    assert res.exit_code == 4 and "no controller nvme9" in res.output
    res = runner.invoke(cli, ["disconnect"])
    assert res.exit_code == 2


# --------------------------------------------------------------------------- connect, the kernel simulated


class FakeFabricsOs(types.SimpleNamespace):
    """The os module as kernel.connect sees it, with /dev/nvme-fabrics answering like nvmf_dev_write/show."""

    def __init__(self, device: str, reply: str | OSError) -> None:
        super().__init__()
        self.device, self.reply, self.written = device, reply, []

    def __getattr__(self, name: str):
        return getattr(os, name)

    def write(self, fd: int, data: bytes) -> int:
        if isinstance(self.reply, OSError):
            raise self.reply
        self.written.append(data.decode())
        return len(data)

    def read(self, fd: int, n: int) -> bytes:
        return self.reply.encode()


def fake_fabrics(monkeypatch, tmp_path: Path, reply: str | OSError) -> FakeFabricsOs:
    dev = tmp_path / "nvme-fabrics"
    dev.write_text("")
    monkeypatch.setattr(kernel, "FABRICS_DEV", str(dev))
    fake = FakeFabricsOs(str(dev), reply)
    monkeypatch.setattr(kernel, "os", fake)
    return fake


def test_connect_writes_options_and_finds_the_devices(monkeypatch, tmp_path: Path, sysfs: FakeSysfs) -> None:
    populate(sysfs)
    fake = fake_fabrics(monkeypatch, tmp_path, "instance=3,cntlid=7\n")
    ctrl = kernel.connect("10.0.0.1", 4420, subnqn=NQN, hostnqn=HOSTNQN, hostid=HOSTID, nr_io_queues=2,
                          hdr_digest=True)
    assert fake.written == [f"nqn={NQN},transport=tcp,traddr=10.0.0.1,trsvcid=4420,hostnqn={HOSTNQN},"
                            f"hostid={HOSTID},nr_io_queues=2,hdr_digest"]
    assert ctrl == kernel.KernelController(name="nvme3", instance=3, cntlid=7, subnqn=NQN, transport="tcp",
                                           traddr="10.0.0.1", trsvcid=4420, block_devices=["/dev/nvme2n1"])
    assert ctrl.device == "/dev/nvme3"


def test_connect_presents_the_default_host_identity(monkeypatch, tmp_path: Path, sysfs: FakeSysfs) -> None:
    populate(sysfs)
    ident = ("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000042",
             uuid.UUID("00000000-0000-0000-0000-000000000042"))
    monkeypatch.setattr(kernel, "default_host_identity", lambda: ident)
    fake = fake_fabrics(monkeypatch, tmp_path, "instance=12,cntlid=1\n")
    ctrl = kernel.connect("10.0.0.1", 4420, subnqn=NQN, transport="rdma")
    assert f"hostnqn={ident[0]},hostid={ident[1]}" in fake.written[0]
    assert ctrl.block_devices == ["/dev/nvme12n1", "/dev/nvme12n2", "/dev/nvme12n10"]


def test_connect_waits_for_namespaces_then_gives_up(monkeypatch, tmp_path: Path, sysfs: FakeSysfs) -> None:
    sysfs.controller("nvme5")          # connected, but the subsystem has no namespace
    fake_fabrics(monkeypatch, tmp_path, "instance=5,cntlid=2\n")
    ctrl = kernel.connect("10.0.0.1", 4420, subnqn=NQN, hostnqn=HOSTNQN, hostid=HOSTID, wait_for_devices=0.2)
    assert ctrl.name == "nvme5" and ctrl.block_devices == []


@pytest.mark.parametrize(("err", "expect"), [
    (errno.EIO, "wrong subsystem NQN"),
    (errno.ECONNREFUSED, "is the target listening"),
    (errno.EALREADY, "already connected"),
    (errno.EINVAL, "modprobe nvme-tcp"),
])
def test_connect_errors_explain_themselves(monkeypatch, tmp_path: Path, err: int, expect: str) -> None:
    fake_fabrics(monkeypatch, tmp_path, OSError(err, os.strerror(err)))
    with pytest.raises(kernel.KernelAttachError) as info:
        kernel.connect("10.0.0.1", 4420, subnqn=NQN, hostnqn=HOSTNQN, hostid=HOSTID)
    msg = str(info.value)
    assert expect in msg and NQN in msg and "tcp://10.0.0.1:4420" in msg


def test_cli_connect_wrong_nqn_exits_4(monkeypatch, tmp_path: Path) -> None:
    fake_fabrics(monkeypatch, tmp_path, OSError(errno.EIO, os.strerror(errno.EIO)))
    res = CliRunner().invoke(cli, ["connect", "-a", "10.0.0.1", "-n", NQN, "-q", HOSTNQN, "-I", HOSTID])
    assert res.exit_code == 4
    assert "dmesg" in res.output and "NQN" in res.output


def test_connect_rejects_a_garbled_reply(monkeypatch, tmp_path: Path) -> None:
    fake_fabrics(monkeypatch, tmp_path, "instance=-1,cntlid=-1,transport=%s")
    with pytest.raises(kernel.KernelAttachError, match="created no controller"):
        kernel.connect("10.0.0.1", 4420, subnqn=NQN, hostnqn=HOSTNQN, hostid=HOSTID)
    fake_fabrics(monkeypatch, tmp_path, "ok\n")
    with pytest.raises(kernel.KernelAttachError, match=r"unexpected reply from .*'ok\\n'"):
        kernel.connect("10.0.0.1", 4420, subnqn=NQN, hostnqn=HOSTNQN, hostid=HOSTID)
