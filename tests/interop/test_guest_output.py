"""How guest output reaches the VM tests, without booting a VM (issue 10, item 10: a torn STEP line).

The CI flake: the RDMA guest's host and controller processes printed to one console, and under
PYTHONUNBUFFERED `print()` writes the text and the "\\n" in two write() calls, so one process's line
landed inside the other's and `^STEP cm-accept OK` did not match. Now each process writes its own
steps file (guest_steps), and the harness reads the kernel console (ttyS0) and the script's port
(ttyS1) separately, joining them only line by line (vm.Guest._read).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tests.interop import guest_steps, rootfs, vm

# The console line of the failing CI run: the host's line, then the controller's, then both newlines.
TORN = ("STEP cm-connect OK crqsize=32 private data sent 0000010020001f00STEP cm-accept OK request 56 bytes "
        "qid=1 hsqsize=31 cntlid=1\n\n")


def test_collector_refuses_the_torn_line_of_the_ci_flake() -> None:
    with pytest.raises(guest_steps.StepFormatError, match="line 1 is not one whole STEP line"):
        guest_steps.parse_steps(TORN, "host")


@pytest.mark.parametrize("text", [
    "STEP cm-accept OK request 56 bytes",              # no newline: torn at the end
    "STEP cm-accept OK a\n\n",                         # an empty line: half of someone's write
    "[1234] STEP cm-accept OK a\n",                    # a console copy, not a steps-file line
    "STEP cm-accept OK a\nERROR controller: boom\n",   # a foreign writer
])
def test_collector_refuses_anything_but_whole_step_lines(text: str) -> None:
    with pytest.raises(guest_steps.StepFormatError):
        guest_steps.parse_steps(text, "controller")


def test_collector_wants_one_file_per_expected_process(tmp_path: Path) -> None:
    (tmp_path / "host.steps").write_text("STEP cm-connect OK crqsize=32\n")
    with pytest.raises(guest_steps.StepFormatError, match="no steps file from \\['controller'\\]"):
        guest_steps.collect(tmp_path, ("host", "controller"))
    (tmp_path / "controller.steps").write_text("")
    (tmp_path / "intruder.steps").write_text("")
    with pytest.raises(guest_steps.StepFormatError, match=r"unexpected processes.*intruder"):
        guest_steps.collect(tmp_path, ("host", "controller"))


def test_writer_refuses_lines_the_collector_could_not_read_back() -> None:
    for name, detail in (("cm-accept", "two\nlines"), ("cm-accept", "x STEP y OK"), ("Bad Name", "")):
        with pytest.raises(ValueError):
            guest_steps.format_step(name, detail)


def test_each_step_line_goes_out_in_one_write_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # print() under PYTHONUNBUFFERED makes two write() calls per line: the cause of the flake
    calls: list[tuple[int, bytes]] = []
    real_write = os.write
    log = guest_steps.StepLog(tmp_path, "host")

    def recording_write(fd: int, data: bytes) -> int:
        calls.append((fd, bytes(data)))
        return real_write(fd, data) if fd != 1 else len(data)

    monkeypatch.setattr(guest_steps.os, "write", recording_write)
    log.step("cm-connect", "crqsize=32")
    log.close()
    line = b"STEP cm-connect OK crqsize=32\n"
    assert [data for _, data in calls] == [line, b"[host] " + line]
    assert (tmp_path / "host.steps").read_bytes() == line


def test_two_processes_writing_at_once_each_keep_their_own_lines(tmp_path: Path) -> None:
    count = 300
    logs = {role: guest_steps.StepLog(tmp_path, role) for role in ("host", "controller")}
    pids = []
    for role, log in logs.items():
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)  # the console copy
                for i in range(count):
                    log.step(f"{role}-{i}", f"from pid {os.getpid()} " + "x" * 200)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    for log in logs.values():
        log.close()
    for pid in pids:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    steps = guest_steps.collect(tmp_path, logs)
    for role, got in steps.items():
        assert [s.name for s in got] == [f"{role}-{i}" for i in range(count)]
        assert all(s.role == role and s.detail.endswith("x" * 200) for s in got)


def _fake_guest(tmp_path: Path) -> vm.Guest:
    missing = tmp_path / "absent"
    assets = vm.Assets(kernel_package="linux-image-test", kernel_version="0", vmlinux=missing, initramfs=missing,
                       fio_layer=missing, modules_root=missing, cache_dir=tmp_path)
    return vm.Guest(assets)


def _wait_until(guest: vm.Guest, condition) -> None:
    with guest._cond:
        assert guest._cond.wait_for(lambda: condition(guest._joined()), timeout=10)


def test_kernel_messages_never_land_inside_a_script_line(tmp_path: Path) -> None:
    guest = _fake_guest(tmp_path)
    proc = object()
    guest._proc = proc  # type: ignore[assignment]
    guest._open_streams = 2
    (console_r, console_w), (script_r, script_w) = os.pipe(), os.pipe()
    readers = [threading.Thread(target=guest._read, args=(proc, console_r, False)),
               threading.Thread(target=guest._read, args=(proc, script_r, True))]
    for reader in readers:
        reader.start()
    try:
        os.write(console_w, b"[   10.8] null_blk: disk nullb0 ")  # printk, half a line so far
        os.write(script_w, b"STEP cm-accept OK request 56 bytes\r\n")
        _wait_until(guest, lambda text: "cm-accept" in text)
        os.write(console_w, b"created\r\n")
        os.write(script_w, b"@@NVMEOF-VM-EXIT t 0")  # the last line, cut by the end of the stream
        _wait_until(guest, lambda text: "created" in text)
        os.close(console_w)
        console_w = -1
        readers[0].join(10)
        assert not guest._eof, "QEMU's console closed but the script's port may still hold lines"
        os.close(script_w)
        script_w = -1
        readers[1].join(10)
    finally:
        for fd in (console_w, script_w):
            if fd >= 0:
                os.close(fd)
    assert guest._eof
    assert guest.output == ("STEP cm-accept OK request 56 bytes\n[   10.8] null_blk: disk nullb0 created\n"
                            "@@NVMEOF-VM-EXIT t 0")
    assert guest.script_text == "STEP cm-accept OK request 56 bytes\n@@NVMEOF-VM-EXIT t 0"
    for fd in (console_r, script_r):
        os.close(fd)


def test_script_output_comes_from_the_script_port_alone() -> None:
    merged = "@@NVMEOF-VM-READY t@@\n[ 3.1] rxe0: link up\nKERNEL-RDMA-OK\n@@NVMEOF-VM-EXIT t 0@@\n"
    script = "@@NVMEOF-VM-READY t@@\nKERNEL-RDMA-OK\n@@NVMEOF-VM-EXIT t 0@@\n"
    assert vm.GuestResult(0, merged, script).script_output == "KERNEL-RDMA-OK\n"
    assert vm.GuestResult(0, merged).script_output == "[ 3.1] rxe0: link up\nKERNEL-RDMA-OK\n"


def test_both_guest_kinds_give_the_script_its_own_serial_port(tmp_path: Path) -> None:
    assert "8250.nr_uarts=2" in vm.KERNEL_CMDLINE and "console=ttyS0" in vm.KERNEL_CMDLINE
    for init in (vm.INIT_SCRIPT, rootfs.STAGE2_INIT):
        assert "OUT=/dev/ttyS1" in init
        assert "run.sh < /dev/null > $OUT 2>&1" in init
        assert 'echo "@@NVMEOF-VM-READY $TOKEN@@" > $OUT' in init
        assert 'echo "@@NVMEOF-VM-EXIT $TOKEN $rc@@" > $OUT' in init
    guest = _fake_guest(tmp_path)
    guest._initrd = tmp_path / "initrd"
    cmd = guest._command(7)
    serials = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "-serial"]
    assert serials == ["stdio", "chardev:script"]
    assert "file,id=script,path=/dev/fd/7" in cmd
