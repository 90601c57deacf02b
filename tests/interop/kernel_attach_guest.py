"""Runs INSIDE the Debian guest (tests/interop/test_kernel_attach.py): kernel attach through initiator.kernel.

Configuration comes from the environment: KA_NQN / KA_PORT / KA_DPORT for our target (`nvmeof serve`,
started here), KA_KNQN / KA_KPORT for the kernel target (nvmet, configured by the test's setup shell).
Each check prints `STEP <name> OK <seconds>s <detail>`; the first failure raises (traceback, exit 1)
after dumping the target's log and the kernel's NVMe messages.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from initiator import kernel

NQN = os.environ["KA_NQN"]
PORT = int(os.environ["KA_PORT"])
DPORT = int(os.environ["KA_DPORT"])
KNQN = os.environ["KA_KNQN"]
KPORT = int(os.environ["KA_KPORT"])
OUR_SIZE = 64 << 20      # --ramdisk-size 64M
KERNEL_SIZE = 32 << 20   # the brd disk the setup shell gives nvmet
DD_MIB = 8
SERVE_OUT = Path("/tmp/serve.out")
SERVE_ERR = Path("/tmp/serve.err")


def step(name: str, began: float, detail: str = "") -> None:
    print(f"STEP {name} OK {time.monotonic() - began:.2f}s {detail}".rstrip(), flush=True)


def check(cond: object, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nvmeof.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def dmesg_nvme(last: int = 12) -> list[str]:
    out = subprocess.run(["dmesg"], capture_output=True, text=True, check=False).stdout.splitlines()
    return [line for line in out if "nvme" in line][-last:]


def wait_until(cond, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def is_block(path: str) -> bool:
    try:
        return stat.S_ISBLK(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def disk_bytes(dev: str) -> int:
    return int(Path("/sys/class/block", os.path.basename(dev), "size").read_text()) * 512


def dd_roundtrip(dev: str) -> str:
    """Write DD_MIB MiB of random data with O_DIRECT, read it back the same way; return a detail line."""
    pattern = os.urandom(DD_MIB << 20)
    Path("/tmp/pattern").write_bytes(pattern)
    t0 = time.monotonic()
    subprocess.run(["dd", "if=/tmp/pattern", f"of={dev}", "bs=1M", f"count={DD_MIB}", "oflag=direct",
                    "conv=fsync", "status=none"], check=True)
    t1 = time.monotonic()
    subprocess.run(["dd", f"if={dev}", "of=/tmp/back", "bs=1M", f"count={DD_MIB}", "iflag=direct",
                    "status=none"], check=True)
    t2 = time.monotonic()
    a = hashlib.sha256(pattern).hexdigest()
    b = hashlib.sha256(Path("/tmp/back").read_bytes()).hexdigest()
    print(f"SHA {dev} {a} {b}", flush=True)
    check(a == b, f"{dev}: the data read back differs from what dd wrote")
    return f"write {DD_MIB / (t1 - t0):.1f} MiB/s read {DD_MIB / (t2 - t1):.1f} MiB/s"


def gone(name: str, devices: list[str]) -> bool:
    return not (kernel.SYS_NVME / name).exists() and not any(os.path.exists(d) for d in devices)


def attach_detach(label: str, port: int, nqn: str, size: int) -> None:
    """initiator.kernel.connect -> block devices -> dd -> controllers() -> disconnect, all checked."""
    t = time.monotonic()
    ctrl = kernel.connect("127.0.0.1", port, subnqn=nqn)
    check(re.fullmatch(r"nvme\d+", ctrl.name) and ctrl.name == f"nvme{ctrl.instance}", f"bad name {ctrl!r}")
    check(ctrl.cntlid >= 0 and (kernel.SYS_NVME / ctrl.name).is_dir(), f"{ctrl!r}: no sysfs controller")
    check((kernel.SYS_NVME / ctrl.name / "cntlid").read_text().strip() == str(ctrl.cntlid),
          "cntlid differs from sysfs")
    check(len(ctrl.block_devices) == 1, f"{label}: expected one namespace, got {ctrl.block_devices}")
    dev = ctrl.block_devices[0]
    check(re.fullmatch(r"/dev/nvme\d+n1", dev) and is_block(dev), f"{dev} is not a block device")
    check(disk_bytes(dev) == size, f"{dev} has {disk_bytes(dev)} bytes, the {label} namespace {size}")
    step(f"{label}-connect", t, f"{ctrl.name} cntlid={ctrl.cntlid} devices={ctrl.block_devices}")

    t = time.monotonic()
    step(f"{label}-dd", t, dd_roundtrip(dev))

    t = time.monotonic()
    listed = [c for c in kernel.controllers() if c["name"] == ctrl.name]
    check(len(listed) == 1, f"controllers() lacks {ctrl.name}: {kernel.controllers()}")
    c = listed[0]
    check(c["subsysnqn"] == nqn and c["transport"] == "tcp" and c["state"] == "live", f"listed as {c}")
    check("traddr=127.0.0.1" in c["address"] and f"trsvcid={port}" in c["address"], f"address {c['address']!r}")
    check(c["block_devices"] == ctrl.block_devices and c["cntlid"] == str(ctrl.cntlid), f"listed as {c}")
    step(f"{label}-controllers", t, json.dumps(c))

    t = time.monotonic()
    try:
        kernel.connect("127.0.0.1", port, subnqn=nqn, wait_for_devices=0)
    except kernel.KernelAttachError as e:
        check("already connected" in str(e), f"duplicate connect said {e}")
        step(f"{label}-duplicate-refused", t, str(e))
    else:
        raise AssertionError("a second connect to the same subsystem and address was accepted")

    t = time.monotonic()
    kernel.disconnect(ctrl.name)
    wait_until(lambda: gone(ctrl.name, ctrl.block_devices), 20, f"{ctrl.name} and {dev} to disappear")
    check(all(c["name"] != ctrl.name for c in kernel.controllers()), "controllers() still lists it")
    check(kernel.block_devices(ctrl.name) == [], "block_devices() still finds devices")
    step(f"{label}-disconnect", t, f"{ctrl.name} and {dev} gone")


def start_target() -> subprocess.Popen[bytes]:
    t = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nvmeof.cli", "serve", "--api", "none", "--listen", f"tcp://127.0.0.1:{PORT}",
         "--discovery", f"tcp://127.0.0.1:{DPORT}", "--ramdisk-size", "64M", "--nqn", NQN],
        stdout=SERVE_OUT.open("wb"), stderr=SERVE_ERR.open("wb"), stdin=subprocess.DEVNULL)
    wait_until(lambda: "nvmeof target is running" in SERVE_OUT.read_text(errors="replace")
               or proc.poll() is not None, 90, "nvmeof serve to start", interval=0.2)
    check(proc.poll() is None, f"nvmeof serve exited {proc.returncode}: {SERVE_ERR.read_text()[-3000:]}")
    step("our-target-started", t, f"pid {proc.pid}")
    return proc


def cli_checks() -> None:
    t = time.monotonic()
    r = cli("connect", "-a", "127.0.0.1", "-s", str(PORT), "-n", NQN, "--json")
    check(r.returncode == 0, f"nvmeof connect exited {r.returncode}: {r.stderr}")
    info = json.loads(r.stdout)
    name, devs = info["name"], info["block_devices"]
    check(info["subnqn"] == NQN and len(devs) == 1 and is_block(devs[0]), f"connect --json gave {info}")
    check(disk_bytes(devs[0]) == OUR_SIZE, f"{devs[0]} is not our 64 MiB namespace")
    step("cli-connect", t, r.stdout.strip().replace("\n", " "))

    t = time.monotonic()
    r = cli("connect", "--list", "--json")
    check(r.returncode == 0, f"connect --list --json exited {r.returncode}: {r.stderr}")
    rows = [c for c in json.loads(r.stdout) if c["name"] == name]
    check(len(rows) == 1 and rows[0]["subsysnqn"] == NQN and rows[0]["block_devices"] == devs,
          f"connect --list --json: {r.stdout}")
    r = cli("connect", "--list")
    check(r.returncode == 0 and name in r.stdout and NQN in r.stdout and devs[0] in r.stdout,
          f"connect --list exited {r.returncode}: {r.stdout} {r.stderr}")
    step("cli-list", t, r.stdout.strip().splitlines()[-1])

    t = time.monotonic()
    r = cli("disconnect", "-n", NQN)
    check(r.returncode == 0 and name in r.stdout, f"disconnect -n exited {r.returncode}: {r.stdout} {r.stderr}")
    wait_until(lambda: gone(name, devs), 20, f"{name} to disappear after nvmeof disconnect")
    step("cli-disconnect", t, r.stdout.strip())

    t = time.monotonic()
    r = cli("disconnect", "-n", NQN)
    check(r.returncode == 4 and "no controller" in r.stderr, f"second disconnect: {r.returncode} {r.stderr}")
    r2 = cli("disconnect", "-d", "nvme97")
    check(r2.returncode == 4 and "no controller nvme97" in r2.stderr, f"disconnect -d: {r2.returncode} {r2.stderr}")
    r3 = cli("connect", "-a", "127.0.0.1", "-s", str(PORT))
    check(r3.returncode == 2 and "--nqn" in r3.stderr, f"connect without -n: {r3.returncode} {r3.stderr}")
    step("cli-errors", t, f"exit 4: {r.stderr.strip()} | exit 4: {r2.stderr.strip()} | exit 2 without -n")


def wrong_nqn() -> None:
    bad = NQN + "-missing"
    t = time.monotonic()
    try:
        kernel.connect("127.0.0.1", PORT, subnqn=bad, wait_for_devices=0)
    except kernel.KernelAttachError as e:
        msg = str(e)
    else:
        raise AssertionError(f"connect to the unknown subsystem {bad} succeeded")
    check("dmesg" in msg and "NQN" in msg and bad in msg, f"wrong-NQN message: {msg}")
    print("DMESG " + " | ".join(dmesg_nvme(3)), flush=True)
    step("wrong-nqn-api", t, msg)
    t = time.monotonic()
    r = cli("connect", "-a", "127.0.0.1", "-s", str(PORT), "-n", bad)
    check(r.returncode == 4, f"CLI connect to a wrong NQN exited {r.returncode}, not 4: {r.stderr}")
    check("dmesg" in r.stderr and "NQN" in r.stderr, f"CLI wrong-NQN message: {r.stderr}")
    step("wrong-nqn-cli", t, f"exit 4: {r.stderr.strip()}")


def start_udevd() -> None:
    t = time.monotonic()
    udevd = next((p for p in ("/usr/lib/systemd/systemd-udevd", "/lib/systemd/systemd-udevd")
                  if os.path.exists(p)), None)
    check(udevd, "systemd-udevd is not in the image")
    subprocess.run([udevd, "--daemon"], check=True)
    subprocess.run(["udevadm", "trigger", "--action=add"], check=True)
    subprocess.run(["udevadm", "settle", "--timeout=30"], check=True)
    step("udevd-started", t, f"/run/udev/data exists: {os.path.isdir('/run/udev/data')}")


def pyudev_view(label: str) -> None:
    """What pyudev sees with (or without) udevd: the device node and whether udev initialized it."""
    import pyudev

    ctx = pyudev.Context()
    ctrl = kernel.connect("127.0.0.1", KPORT if label == "udevd" else PORT,
                          subnqn=KNQN if label == "udevd" else NQN)
    try:
        if label == "udevd":
            subprocess.run(["udevadm", "settle", "--timeout=30"], check=True)
        dev = pyudev.Devices.from_device_file(ctx, ctrl.block_devices[0])
        print(f"PYUDEV {label} run_udev={os.path.isdir('/run/udev')} node={dev.device_node} "
              f"devtype={dev.device_type} initialized={dev.is_initialized} "
              f"wwid={dev.properties.get('ID_WWN') or dev.attributes.get('wwid')}", flush=True)
    finally:
        kernel.disconnect(ctrl.name)
        wait_until(lambda: gone(ctrl.name, ctrl.block_devices), 20, f"{ctrl.name} to disappear")


def fabrics_unloaded() -> None:
    t = time.monotonic()
    check(not [c for c in kernel.controllers() if c["transport"] != "pcie"], "controllers left before rmmod")
    for mod in ("nvme_tcp", "nvme_rdma", "nvme_fabrics"):
        if Path("/sys/module", mod).exists():
            subprocess.run(["rmmod", mod], check=True)
    check(not os.path.exists(kernel.FABRICS_DEV), f"{kernel.FABRICS_DEV} is still there after rmmod")
    step("rmmod-fabrics", t)

    t = time.monotonic()
    try:
        kernel.connect("127.0.0.1", PORT, subnqn=NQN)
    except kernel.KernelAttachError as e:
        msg = str(e)
    else:
        raise AssertionError("connect without nvme-fabrics succeeded")
    r = cli("connect", "-a", "127.0.0.1", "-s", str(PORT), "-n", NQN)
    check(r.returncode == 4 and msg in r.stderr, f"CLI without nvme-fabrics: {r.returncode} {r.stderr}")
    load = re.search(r"'(modprobe [^']+)'", msg)
    check(load, f"the message names no modprobe command: {msg}")
    step("no-fabrics-message", t, f"exit 4: {msg}")

    # The message must be right, not just present: run exactly what it says, then attach again.
    t = time.monotonic()
    subprocess.run(shlex.split(load.group(1)), check=True)
    wait_until(lambda: os.path.exists(kernel.FABRICS_DEV), 10, f"{kernel.FABRICS_DEV} after {load.group(1)}")
    check(Path("/sys/module/nvme_tcp").is_dir(), f"{load.group(1)} did not load nvme_tcp")
    r = cli("connect", "-a", "127.0.0.1", "-s", str(PORT), "-n", NQN, "--json")
    check(r.returncode == 0, f"connect after {load.group(1)}: {r.returncode} {r.stderr}")
    info = json.loads(r.stdout)
    r = cli("disconnect", "-d", info["name"])
    check(r.returncode == 0, f"disconnect -d {info['name']}: {r.returncode} {r.stderr}")
    wait_until(lambda: gone(info["name"], info["block_devices"]), 20, f"{info['name']} to disappear")
    step("modprobe-as-told", t, f"{load.group(1)} then connect {info['name']} {info['block_devices']} and disconnect")


def stop_target(proc: subprocess.Popen[bytes]) -> None:
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    log = SERVE_ERR.read_text(errors="replace")
    check(code == 0, f"nvmeof serve exited {code} on SIGTERM")
    check("Traceback" not in log, "traceback in the target's log")
    step("our-target-stopped", t, f"exit {code}")


def main() -> None:
    began = time.monotonic()
    print(f"ENV kernel={os.uname().release} fabrics_dev={os.path.exists(kernel.FABRICS_DEV)} "
          f"run_udev={os.path.isdir('/run/udev')}", flush=True)
    proc = start_target()
    try:
        # Phase 1, no udevd running (this image's init starts none): pyudev reads sysfs alone.
        check(not os.path.isdir("/run/udev/data"), "udev data exists before udevd was started")
        attach_detach("ours", PORT, NQN, OUR_SIZE)
        pyudev_view("no-udevd")
        cli_checks()
        wrong_nqn()
        # Phase 2, the kernel target as referee, with systemd-udevd running.
        start_udevd()
        attach_detach("nvmet", KPORT, KNQN, KERNEL_SIZE)
        pyudev_view("udevd")
        fabrics_unloaded()
        stop_target(proc)
    except BaseException:
        print("--- target stdout\n" + SERVE_OUT.read_text(errors="replace"), flush=True)
        print("--- target log\n" + "\n".join(SERVE_ERR.read_text(errors="replace").splitlines()[-60:]))
        print("--- dmesg (nvme)\n" + "\n".join(dmesg_nvme(40)), flush=True)
        if proc.poll() is None:
            proc.kill()
        raise
    print(f"KERNEL-ATTACH-ALL-OK {time.monotonic() - began:.1f}s", flush=True)


if __name__ == "__main__":
    main()
