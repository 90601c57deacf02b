"""The NVMe/TCP TLS pieces of the VM harness, without booting a VM or reaching the archive: which trixie packages
tlstools.py takes, its private apt lists, the wrappers it writes, nvmet's TLS port and Assets.has_nvme_tls."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.interop import tlstools, vm

# `apt-cache depends` of one level, as apt prints it (trimmed to what matters)
DEPENDS = {
    ("keyutils", "ktls-utils", "nvme-cli"): (
        "ktls-utils\n  Depends: libc6\n  Depends: libgnutls30t64\n  Depends: <systemd-sysusers>\n"
        "  Depends: adduser\n"
        "nvme-cli\n  Depends: libnvme1t64\n  Depends: uuid-runtime\n  Recommends: libglib2.0-0t64\n"
        "keyutils\n  Depends: libkeyutils1\n  PreDepends: libc6\n"
    ),
    ("libc6", "libgnutls30t64", "libkeyutils1", "libnvme1t64"): (
        "libc6\n  Depends: libgcc-s1\n"
        "libgnutls30t64\n  Depends: libc6\n |Depends: zlib1g\n  Depends: libp11-kit0\n"
        "libkeyutils1\n  Depends: libc6\n"
        "libnvme1t64\n  Depends: libssl3t64\n"
    ),
    ("libgcc-s1", "libp11-kit0", "libssl3t64", "zlib1g"): (
        "libgcc-s1\n  Depends: libc6\nlibp11-kit0\n  Depends: libc6\nlibssl3t64\n  Depends: libc6\n"
        "zlib1g\n  Depends: libc6\n"
    ),
}


def test_package_closure_follows_library_packages_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    asked: list[tuple[str, ...]] = []

    def fake_run(cmd: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        names = tuple(sorted(a for a in cmd[cmd.index("depends") + 1:] if not a.startswith("--")))
        asked.append(names)
        return subprocess.CompletedProcess(cmd, 0, DEPENDS[names], "")

    monkeypatch.setattr(tlstools.subprocess, "run", fake_run)
    got = tlstools.package_closure(tmp_path)
    # adduser, systemd-sysusers (virtual), uuid-runtime and a Recommends stay out; zlib1g is a library package
    assert got == ["keyutils", "ktls-utils", "libc6", "libgcc-s1", "libgnutls30t64", "libkeyutils1", "libnvme1t64",
                   "libp11-kit0", "libssl3t64", "nvme-cli", "zlib1g"]
    assert len(asked) == 3  # one apt-cache call per level


def test_package_closure_names_a_missing_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def fake_run(cmd: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 0, "ktls-utils\n  Depends: libc6\nkeyutils\n", "")

    monkeypatch.setattr(tlstools.subprocess, "run", fake_run)
    with pytest.raises(tlstools.ToolsUnavailable, match="no package nvme-cli"):
        tlstools.package_closure(tmp_path)


def test_trixie_apt_lists_are_private_and_signed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[list[str]] = []
    answer = {"stdout": "Hit:1 trixie InRelease\n"}

    def fake_run(cmd: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, answer["stdout"], "")

    monkeypatch.setattr(tlstools.subprocess, "run", fake_run)
    monkeypatch.setattr(vm, "BPO_KEYRING", tmp_path / "keyring.gpg")
    (tmp_path / "keyring.gpg").write_bytes(b"")
    monkeypatch.setenv(vm.BPO_MIRROR_ENV, "http://mirror.invalid/debian")
    tlstools._apt_update(tmp_path)
    d = tmp_path / "apt-trixie"
    assert (d / "sources.list").read_text() == \
        f"deb [signed-by={tmp_path / 'keyring.gpg'}] http://mirror.invalid/debian trixie main\n"
    opts = " ".join(calls[-1])
    assert "Dir::Etc::sourceparts=/dev/null" in opts and f"Dir::State::lists={d / 'lists'}" in opts
    answer["stdout"] = "Err:1 http://mirror.invalid/debian trixie InRelease\n"
    with pytest.raises(tlstools.ToolsUnavailable, match="Err:1"):
        tlstools._apt_update(tmp_path)


def test_tlshd_script_names_the_nvme_keyring_and_checks_the_daemon() -> None:
    script = tlstools.guest_tlshd_script("/mnt/tls", loglevel=3)
    assert "keyrings=.nvme" in script and "loglevel=3" in script
    assert "modprobe tls" in script and "/mnt/tls/bin/tlshd -s -c /tmp/tlshd.conf" in script
    assert "kill -0 $TLSHD_PID" in script
    assert tlstools.recipe_hash() == tlstools.recipe_hash() and len(tlstools.recipe_hash()) == 16


def test_kernel_target_tls_port_sets_tsas_before_the_subsystem_link() -> None:
    script = vm.guest_kernel_target_script("nqn.x:s", ((1, 4420), (2, 4421)), tls_ports=(1,))
    p1 = "/sys/kernel/config/nvmet/ports/1"
    step = f"echo tls1.3 > {p1}/addr_tsas"
    assert [line for line in script.splitlines() if "addr_tsas" in line] == [
        f"{step} || {{ echo 'guest_kernel_target: failed: {step}'; exit 1; }}"]
    # nvmet refuses addr_tsas on an enabled port and before addr_trtype is tcp
    assert script.index(f"{p1}/addr_trtype") < script.index(f"{p1}/addr_tsas") < script.index(f"{p1}/subsystems/")
    assert "echo tls1.3 > /sys/kernel/config/nvmet/ports/1/addr_tsas" in script
    assert "addr_tsas" not in vm.guest_kernel_target_script("nqn.x:s")


def test_nvme_tls_is_told_by_the_handshake_upcalls(tmp_path: Path) -> None:
    assets = vm.Assets("pkg", "6.12.0-t", tmp_path / "vmlinux", tmp_path / "i", tmp_path / "f", tmp_path / "m",
                       tmp_path, kernel="6.12")
    assert not assets.has_nvme_tls
    nvme = tmp_path / "m" / "lib" / "modules" / "6.12.0-t" / "kernel" / "drivers" / "nvme"
    (nvme / "host").mkdir(parents=True)
    (nvme / "target").mkdir()
    (nvme / "host" / "nvme-tcp.ko").write_bytes(b"\0tls_client_hello_psk\0")
    (nvme / "target" / "nvmet-tcp.ko").write_bytes(b"\0nvmet_tcp_alloc_queue\0")
    assert not assets.has_nvme_tls  # a host with TLS and a target without is no TLS referee
    (nvme / "target" / "nvmet-tcp.ko").write_bytes(b"\0tls_server_hello_psk\0")
    assert assets.has_nvme_tls
