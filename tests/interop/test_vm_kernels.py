"""The VM harness's two kernels (6.1 and 6.12), without booting a VM: which package each label resolves
to, how the zstd-compressed 6.12 image and its .ko.xz modules are unpacked, per-kernel caching, and the
kernel target's DH-HMAC-CHAP host settings."""

from __future__ import annotations

import lzma
import shutil
import struct
from pathlib import Path

import pytest

from tests.interop import rootfs, vm

ELF = b"\x7fELF" + b"\x02\x01\x01" + bytes(57) + b"vmlinux body " * 100


def _bzimage(payload: bytes, setup_sects: int = 3) -> bytes:
    """A bzImage as the boot protocol lays it out: setup sectors with the header, then the payload."""
    setup = bytearray((setup_sects + 1) * 512)
    setup[0x1F1] = setup_sects
    setup[0x202:0x206] = b"HdrS"
    offset = 100  # the payload sits this far into the protected-mode code
    struct.pack_into("<II", setup, 0x248, offset, len(payload))
    return bytes(setup) + b"\0" * offset + payload + b"trailing code"


@pytest.mark.skipif(shutil.which("zstd") is None, reason="zstd is not installed (install_deps.sh installs it)")
def test_extract_vmlinux_from_a_zstd_bzimage(tmp_path: Path) -> None:
    import subprocess

    compressed = subprocess.run(["zstd", "-q", "-c"], input=ELF, capture_output=True, check=True).stdout
    # the kernel's build appends the uncompressed size (cmd_zstd22_with_size); the frame stops before it
    image = _bzimage(compressed + struct.pack("<I", len(ELF)))
    assert vm.extract_vmlinux(image) == ELF


def test_extract_vmlinux_from_an_xz_bzimage() -> None:
    compressed = lzma.compress(ELF, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32)
    assert vm.extract_vmlinux(_bzimage(compressed + struct.pack("<I", len(ELF)))) == ELF
    # without a boot header the xz stream is still found (how the 6.1 image was always read)
    assert vm.extract_vmlinux(b"junk" * 100 + compressed) == ELF


def test_extract_vmlinux_names_what_is_missing() -> None:
    with pytest.raises(vm.VmSetupError, match="no xz or zstd stream"):
        vm.extract_vmlinux(_bzimage(b"\x1f\x8b\x08gzip is not what Debian builds"))


def test_decompress_modules_turns_ko_xz_into_ko(tmp_path: Path) -> None:
    tree = tmp_path / "lib" / "modules" / "6.12.0-test"
    (tree / "kernel" / "drivers" / "nvme" / "common").mkdir(parents=True)
    (tree / "kernel" / "drivers" / "nvme" / "common" / "nvme-auth.ko.xz").write_bytes(lzma.compress(b"module"))
    (tree / "kernel" / "plain.ko").write_bytes(b"already plain")
    (tree / "modules.order").write_text("kernel/drivers/nvme/common/nvme-auth.ko.xz\nkernel/plain.ko\n")
    assert vm.decompress_modules(tree) == 1
    assert (tree / "kernel" / "drivers" / "nvme" / "common" / "nvme-auth.ko").read_bytes() == b"module"
    assert not list(tree.rglob("*.xz"))
    assert (tree / "modules.order").read_text() == "kernel/drivers/nvme/common/nvme-auth.ko\nkernel/plain.ko\n"


def _fake_apt(monkeypatch: pytest.MonkeyPatch, answers: dict[tuple[str, ...], str]) -> None:
    monkeypatch.setattr(vm, "_apt_cache", lambda *args: answers.get(args, ""))


def test_612_resolves_to_the_newest_downloadable_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NVMEOF_VM_KERNEL_PACKAGE_6_12", raising=False)
    names = ("linux-image-6.12.9+deb12-amd64-unsigned linux-image-6.12.117+deb12-amd64-unsigned "
             "linux-image-6.12.120+deb12-amd64-unsigned linux-image-6.12.118+deb12-cloud-amd64-unsigned "
             "linux-image-6.12.119+deb12-amd64-dbg")
    _fake_apt(monkeypatch, {
        ("pkgnames", "linux-image-6.12."): names.replace(" ", "\n"),
        # 120 is listed but has no candidate any more: the newest one apt can download is 117
        ("policy", "linux-image-6.12.120+deb12-amd64-unsigned"): "  Installed: (none)\n  Candidate: (none)\n",
        ("policy", "linux-image-6.12.117+deb12-amd64-unsigned"): "  Candidate: 6.12.117-1~deb12u1\n",
        ("policy", "linux-image-6.12.9+deb12-amd64-unsigned"): "  Candidate: 6.12.9-1\n",
    })
    assert vm.resolve_kernel_package(tmp_path, "6.12") == "linux-image-6.12.117+deb12-amd64-unsigned"


def test_kernel_packages_can_be_pinned_per_label(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_apt(monkeypatch, {})
    monkeypatch.setenv("NVMEOF_VM_KERNEL_PACKAGE", "linux-image-6.1.0-99-amd64")
    monkeypatch.setenv("NVMEOF_VM_KERNEL_PACKAGE_6_12", "linux-image-6.12.1+deb12-amd64-unsigned")
    assert vm.resolve_kernel_package(tmp_path, "6.1") == "linux-image-6.1.0-99-amd64"
    assert vm.resolve_kernel_package(tmp_path, "6.12") == "linux-image-6.12.1+deb12-amd64-unsigned"
    with pytest.raises(vm.VmSetupError, match=r"unknown kernel label '5\.10'"):
        vm.resolve_kernel_package(tmp_path, "5.10")


def test_without_apt_lists_each_label_reuses_only_its_own_cached_kernel(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NVMEOF_VM_KERNEL_PACKAGE", raising=False)
    monkeypatch.delenv("NVMEOF_VM_KERNEL_PACKAGE_6_12", raising=False)
    _fake_apt(monkeypatch, {})
    for name in ("linux-image-6.1.0-57-amd64", "linux-image-6.12.117+deb12-amd64-unsigned"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vmlinux").write_bytes(b"x")
    assert vm.resolve_kernel_package(tmp_path, "6.1") == "linux-image-6.1.0-57-amd64"
    assert vm.resolve_kernel_package(tmp_path, "6.12") == "linux-image-6.12.117+deb12-amd64-unsigned"
    shutil.rmtree(tmp_path / "linux-image-6.12.117+deb12-amd64-unsigned")
    with pytest.raises(vm.VmSetupError, match="NVMEOF_VM_KERNEL_PACKAGE_6_12"):
        vm.resolve_kernel_package(tmp_path, "6.12")


def test_selected_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vm.KERNELS_ENV, raising=False)
    assert vm.selected_kernels() == ("6.1", "6.12")
    monkeypatch.setenv(vm.KERNELS_ENV, "6.12")
    assert vm.selected_kernels() == ("6.12",)
    monkeypatch.setenv(vm.KERNELS_ENV, "6.12, 4.19")
    with pytest.raises(vm.VmSetupError, match=r"unknown kernel label\(s\) \['4.19'\]"):
        vm.selected_kernels()


def test_inband_auth_is_told_by_the_nvme_auth_module(tmp_path: Path) -> None:
    assets = vm.Assets("pkg", "6.12.0-t", tmp_path / "vmlinux", tmp_path / "i", tmp_path / "f", tmp_path / "m",
                       tmp_path, kernel="6.12")
    assert not assets.has_inband_auth
    common = tmp_path / "m" / "lib" / "modules" / "6.12.0-t" / "kernel" / "drivers" / "nvme" / "common"
    common.mkdir(parents=True)
    (common / "nvme-auth.ko").write_bytes(b"")
    assert assets.has_inband_auth


def test_rootfs_clean_up_spares_the_other_kernels_files(tmp_path: Path) -> None:
    old_61, new_61, k612 = (tmp_path / f"bookworm-{k}.ext4" for k in ("a61old", "a61new", "b612"))
    legacy = tmp_path / "bookworm-legacy.ext4"  # built before per-kernel caching: no owner record
    for image in (old_61, new_61, k612, legacy):
        image.write_bytes(b"")
    rootfs._claim(old_61, "linux-image-6.1.0-57-amd64")
    rootfs._claim(k612, "linux-image-6.12.117+deb12-amd64-unsigned")
    rootfs._remove_stale(tmp_path, "bookworm-*.ext4", "linux-image-6.1.0-57-amd64", keep=new_61)
    assert not old_61.exists() and not rootfs._owner_file(old_61).exists()
    assert new_61.exists() and k612.exists() and legacy.exists()


def test_kernel_target_hosts_with_keys_never_print_a_secret() -> None:
    key, ctrl = "DHHC-1:00:" + "A" * 44 + ":", "DHHC-1:01:" + "B" * 44 + ":"
    host = vm.KernelTargetHost("nqn.2014-08.org.nvmexpress:uuid:1", key, ctrl, "hmac(sha384)", "ffdhe2048")
    script = vm.guest_kernel_target_script("nqn.x", hosts=[host])
    assert "echo 0 > /sys/kernel/config/nvmet/subsystems/nqn.x/attr_allow_any_host" in script
    assert f"echo {key} > /sys/kernel/config/nvmet/hosts/nqn.2014-08.org.nvmexpress:uuid:1/dhchap_key" in script
    assert "dhchap_ctrl_key" in script and "'hmac(sha384)'" in script and "ffdhe2048 >" in script
    assert ("ln -s /sys/kernel/config/nvmet/hosts/nqn.2014-08.org.nvmexpress:uuid:1 "
            "/sys/kernel/config/nvmet/subsystems/nqn.x/allowed_hosts/") in script
    for line in script.splitlines():
        message = line.partition("|| {")[2]
        assert key not in message and ctrl not in message, line
    assert key not in repr(host) and ctrl not in repr(host)
    # without hosts: any host, exactly as before
    assert "echo 1 > /sys/kernel/config/nvmet/subsystems/nqn.x/attr_allow_any_host" in \
        vm.guest_kernel_target_script("nqn.x")


def test_an_unused_passthru_node_of_612_is_no_passthru_controller() -> None:
    from target.config import import_nvmetcli

    # Debian's 6.12 has NVME_TARGET_PASSTHRU: every subsystem's passthru/device_path reads "(null)"
    sub = {"nqn": "nqn.2026-11.io.nvmeof-toolkit:x", "attr": {"allow_any_host": "1"}, "namespaces": [],
           "passthru": [{"device": {"path": "(null)"}, "clear_ids": 0, "admin_timeout": 0, "io_timeout": 0}]}
    assert not [w for w in import_nvmetcli({"subsystems": [sub]}).warnings if "passthru" in w]
    sub["passthru"][0]["device"]["path"] = "/dev/nvme0"
    assert [w for w in import_nvmetcli({"subsystems": [sub]}).warnings if "passthru" in w]


# ---- the "bpo" kernel: trixie-backports through private apt lists -------------------------------------------

BPO_NAMES = """linux-image-7.3.4+deb13-amd64
linux-image-7.3.4+deb13-amd64-dbg
linux-image-7.3.4+deb13-cloud-amd64
linux-image-7.2.12+deb13-amd64
linux-image-7.10.1+deb13-amd64
linux-image-6.12.117+deb13-amd64-unsigned
linux-image-6.16.12+deb13-rt-amd64"""


def _fake_bpo_apt(monkeypatch: pytest.MonkeyPatch, answers: dict[tuple[str, ...], str], updated: list[Path]) -> None:
    monkeypatch.setattr(vm, "bpo_apt_update", updated.append)
    monkeypatch.setattr(vm, "_bpo_apt_cache", lambda _root, *args: answers.get(args, ""))


def test_bpo_is_asked_for_by_name_and_never_runs_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    assert vm.BPO_KERNEL not in vm.KERNELS and vm.BPO_KERNEL in vm.KNOWN_KERNELS
    monkeypatch.setenv(vm.KERNELS_ENV, "bpo")
    with pytest.raises(vm.VmSetupError, match="unknown kernel label"):
        vm.selected_kernels()


def test_bpo_resolves_to_the_newest_downloadable_trixie_image(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NVMEOF_VM_KERNEL_PACKAGE_BPO", raising=False)
    updated: list[Path] = []
    _fake_bpo_apt(monkeypatch, {
        ("pkgnames", "linux-image-"): BPO_NAMES,
        # 7.10.1 sorts above 7.3.4 by number, not by text; it has no candidate, so 7.3.4 it is
        ("policy", "linux-image-7.10.1+deb13-amd64"): "  Candidate: (none)\n",
        ("policy", "linux-image-7.3.4+deb13-amd64"): "  Candidate: 7.3.4-1~bpo13+1\n",
        ("policy", "linux-image-7.2.12+deb13-amd64"): "  Candidate: 7.2.12-1~bpo13+1\n",
    }, updated)
    assert vm.resolve_kernel_package(tmp_path, "bpo") == "linux-image-7.3.4+deb13-amd64"
    assert updated == [tmp_path]   # the private lists were refreshed first
    monkeypatch.setenv("NVMEOF_VM_KERNEL_PACKAGE_BPO", "linux-image-7.2.12+deb13-amd64")
    assert vm.resolve_kernel_package(tmp_path, "bpo") == "linux-image-7.2.12+deb13-amd64"


def test_bpo_without_the_archive_reuses_a_cached_kernel_or_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.delenv("NVMEOF_VM_KERNEL_PACKAGE_BPO", raising=False)

    def unreachable(_root: Path) -> None:
        raise vm.KernelUnavailable("apt-get update of trixie-backports failed: Err: no route")

    monkeypatch.setattr(vm, "bpo_apt_update", unreachable)
    with pytest.raises(vm.KernelUnavailable, match=r"no route.*NVMEOF_VM_KERNEL_PACKAGE_BPO"):
        vm.resolve_kernel_package(tmp_path, "bpo")
    (tmp_path / "linux-image-6.12.117+deb12-amd64-unsigned").mkdir()   # another label's kernel is not taken
    (tmp_path / "linux-image-6.12.117+deb12-amd64-unsigned" / "vmlinux").write_bytes(b"x")
    with pytest.raises(vm.KernelUnavailable):
        vm.resolve_kernel_package(tmp_path, "bpo")
    (tmp_path / "linux-image-7.3.4+deb13-amd64").mkdir()
    (tmp_path / "linux-image-7.3.4+deb13-amd64" / "vmlinux").write_bytes(b"x")
    assert vm.resolve_kernel_package(tmp_path, "bpo") == "linux-image-7.3.4+deb13-amd64"


def test_bpo_apt_lists_are_private_and_signed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import subprocess

    calls: list[list[str]] = []
    answer = {"stdout": "Hit:1 trixie-backports InRelease\n"}

    def fake_run(cmd: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, answer["stdout"], "")

    monkeypatch.setattr(vm.subprocess, "run", fake_run)
    monkeypatch.setattr(vm, "BPO_KEYRING", tmp_path / "keyring.gpg")
    (tmp_path / "keyring.gpg").write_bytes(b"")
    monkeypatch.setenv(vm.BPO_MIRROR_ENV, "http://mirror.invalid/debian")
    vm.bpo_apt_update(tmp_path)
    d = tmp_path / "apt-trixie-backports"
    assert (d / "sources.list").read_text() == \
        f"deb [signed-by={tmp_path / 'keyring.gpg'}] http://mirror.invalid/debian trixie-backports main\n"
    opts = " ".join(calls[-1])
    assert calls[-1][0] == "apt-get" and calls[-1][-1] == "update"
    # the host's sources.list.d and lists are never read or written
    assert "Dir::Etc::sourceparts=/dev/null" in opts and f"Dir::Etc::sourcelist={d / 'sources.list'}" in opts
    assert f"Dir::State::lists={d / 'lists'}" in opts and f"Dir::Cache={d / 'cache'}" in opts
    assert (d / "lists" / "partial").is_dir()
    answer["stdout"] = "Err:1 http://mirror.invalid/debian trixie-backports InRelease\nW: Failed to fetch\n"
    with pytest.raises(vm.KernelUnavailable, match="Failed to fetch"):
        vm.bpo_apt_update(tmp_path)   # apt-get update exits 0 on a failed source: its W:/Err: lines tell
    (tmp_path / "keyring.gpg").unlink()
    with pytest.raises(vm.KernelUnavailable, match="debian-archive-keyring"):
        vm.bpo_apt_update(tmp_path)


def test_bpo_mirror_is_the_archive_of_the_hosts_release(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    out = ("http://sec.invalid/debian-security/ bookworm-security Packages\n"
           "http://main.invalid/debian/ bookworm-updates Packages\n"
           "http://main.invalid/debian/ bookworm Translations\n"
           "http://main.invalid/debian/ bookworm Packages\n")
    monkeypatch.delenv(vm.BPO_MIRROR_ENV, raising=False)
    monkeypatch.setattr(vm.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, out, ""))
    assert vm.bpo_mirror() == "http://main.invalid/debian/"
    monkeypatch.setattr(vm.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "", ""))
    with pytest.raises(vm.KernelUnavailable, match=vm.BPO_MIRROR_ENV):
        vm.bpo_mirror()


def test_trixies_split_kernel_packages_are_all_downloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    depends = {
        "linux-image-7.3.4+deb13-amd64": "linux-image-7.3.4+deb13-amd64\n |Depends: dracut\n  Depends: "
        "linux-base-7.3.4+deb13-amd64\n  Depends: linux-binary-7.3.4+deb13-amd64\n  Depends: "
        "linux-modules-7.3.4+deb13-amd64\n  PreDepends: linux-base\n",
        # bookworm's image package carries everything; linux-base (no version) is the tools package
        "linux-image-6.1.0-57-amd64": "linux-image-6.1.0-57-amd64\n  Depends: kmod\n  Depends: linux-base\n",
    }
    monkeypatch.setattr(vm.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, depends[cmd[-1]], ""))
    assert vm._kernel_debs("linux-image-7.3.4+deb13-amd64", []) == [
        "linux-image-7.3.4+deb13-amd64", "linux-base-7.3.4+deb13-amd64", "linux-binary-7.3.4+deb13-amd64",
        "linux-modules-7.3.4+deb13-amd64"]
    assert vm._kernel_debs("linux-image-6.1.0-57-amd64", []) == ["linux-image-6.1.0-57-amd64"]


def test_unpacked_kernel_in_either_layout(tmp_path: Path) -> None:
    trixie = tmp_path / "trixie"
    (trixie / "usr" / "lib" / "modules" / "7.3.4+deb13-amd64" / "kernel").mkdir(parents=True)
    (trixie / "usr" / "lib" / "modules" / "7.3.4+deb13-amd64" / "vmlinuz").write_bytes(b"bz")
    kver, tree, image = vm._unpacked_kernel(trixie, "p")
    assert (kver, tree, image.name) == ("7.3.4+deb13-amd64", trixie / "usr/lib/modules/7.3.4+deb13-amd64", "vmlinuz")
    bookworm = tmp_path / "bookworm"
    (bookworm / "lib" / "modules" / "6.1.0-57-amd64").mkdir(parents=True)
    (bookworm / "boot").mkdir()
    (bookworm / "boot" / "vmlinuz-6.1.0-57-amd64").write_bytes(b"bz")
    assert vm._unpacked_kernel(bookworm, "p")[0] == "6.1.0-57-amd64"
    (bookworm / "boot" / "vmlinuz-6.1.0-57-amd64").unlink()
    with pytest.raises(vm.VmSetupError, match="0 kernel images"):
        vm._unpacked_kernel(bookworm, "p")


def test_kernel_target_namespaces_with_reservations() -> None:
    script = vm.guest_kernel_target_script("nqn.x", namespaces=3, resv_enable=True, size_mib=4)
    assert "modprobe brd rd_nr=3 rd_size=4096" in script and "[ -b /dev/ram2 ]" in script
    ns = "/sys/kernel/config/nvmet/subsystems/nqn.x/namespaces"
    for nsid in (1, 2, 3):
        device = script.index(f"echo -n /dev/ram{nsid - 1} > {ns}/{nsid}/device_path")
        resv = script.index(f"echo 1 > {ns}/{nsid}/resv_enable")
        assert device < resv < script.index(f"echo 1 > {ns}/{nsid}/enable")   # nvmet refuses it once enabled
    assert "resv_enable" not in vm.guest_kernel_target_script("nqn.x")
    with pytest.raises(ValueError, match="namespaces"):
        vm.guest_kernel_target_script("nqn.x", namespaces=0)
