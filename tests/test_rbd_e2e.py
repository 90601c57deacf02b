"""`nvmeof serve` exporting an RBD image, driven by our initiator over NVMe/TCP (marker ``ceph``).

Data the initiator writes is read back from the cluster by Ceph's own `rbd export`; `nvmeof bench
--verify crc32c` runs against the image; a resize made with `rbd resize` behind the target's back
reaches the host as a Namespace Attribute Changed event; and with the OSD stopped (SIGSTOP) a command
fails with a retryable NVMe status within the configured bound while keep-alive and a RAM namespace of
the same controller keep working, and I/O works again once the OSD continues. A daemon stopping after an
outside resize shuts its librados client down before exit() tears libceph-common down.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from initiator.connecting import connect
from nvmeof.status import NvmeError
from tests.interop.ourtarget import OurTarget, serve_target

pytestmark = [pytest.mark.ceph, pytest.mark.slow, pytest.mark.timeout(300)]

MiB = 1 << 20
IMAGE_SIZE = 64 * MiB
OP_TIMEOUT = 4.0   # --rbd-op-timeout: how long a command may wait for a stopped OSD
BLOCK = 512


@pytest.fixture
def rbd_target(ceph_cluster: Any, rbd_image: str, tmp_path: Path) -> Iterator[OurTarget]:
    ceph_cluster.rbd("create", "--size", f"{IMAGE_SIZE // MiB}M", f"{ceph_cluster.pool}/{rbd_image}")
    with serve_target(tmp_path, extra_args=(
            "--ceph-conf", str(ceph_cluster.conf), "--rbd-image", f"{ceph_cluster.pool}/{rbd_image}",
            "--rbd-op-timeout", str(OP_TIMEOUT))) as target:
        yield target
    target.assert_no_errors()


def test_rbd_namespace_is_the_image(rbd_target: OurTarget, ceph_cluster: Any, rbd_image: str) -> None:
    ns = rbd_target.api("GET", f"/subsystems/{rbd_target.subnqn}/namespaces/1")
    assert (ns["backend"], ns["pool"], ns["image"], ns["size"]) == ("rbd", ceph_cluster.pool, rbd_image, IMAGE_SIZE)
    data = os.urandom(16 * MiB)

    async def go() -> bytes:
        async with connect("127.0.0.1", rbd_target.io_port, rbd_target.subnqn) as ctrl:
            await ctrl.write(1, 1024, data)          # at 512 KiB
            await ctrl.flush(1)
            back = await ctrl.read(1, 1024, len(data) // BLOCK)
            assert back == data
            return back

    asyncio.run(go())
    exported = ceph_cluster.rbd_bytes("export", "--no-progress", f"{ceph_cluster.pool}/{rbd_image}", "-")
    assert len(exported) == IMAGE_SIZE
    assert hashlib.sha256(exported[512 * 1024: 512 * 1024 + len(data)]).digest() == hashlib.sha256(data).digest()


def test_bench_verify_on_rbd(rbd_target: OurTarget) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "nvmeof.cli", "bench", "-a", "127.0.0.1", "-s", str(rbd_target.io_port),
         "-n", rbd_target.subnqn, "--rw", "randwrite", "--bs", "4k", "--iodepth", "16", "--size", "8M",
         "--verify", "crc32c", "--output-format", "json", "--eta", "never"],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)["jobs"][0]
    assert job["error"] == 0 and job["write"]["total_ios"] == 8 * MiB // 4096
    assert job["verify"]["blocks"] == 8 * MiB // 4096 and job["verify"]["errors"] == 0, job["verify"]


def test_outside_resize_reaches_our_initiator(rbd_target: OurTarget, ceph_cluster: Any, rbd_image: str) -> None:
    async def go() -> int:
        events: asyncio.Queue[Any] = asyncio.Queue()
        async with connect("127.0.0.1", rbd_target.io_port, rbd_target.subnqn,
                           event_callback=events.put_nowait) as ctrl:
            before = (await ctrl.identify_namespace(1)).nsze
            assert before == IMAGE_SIZE // BLOCK
            await asyncio.to_thread(ceph_cluster.rbd, "resize", "--no-progress", "--size", "96M",
                                    f"{ceph_cluster.pool}/{rbd_image}")
            await asyncio.wait_for(events.get(), 30)   # Namespace Attribute Changed
            after = (await ctrl.identify_namespace(1)).nsze
            # the new tail is usable
            await ctrl.write(1, after - 8, b"\x5a" * 8 * BLOCK)
            assert await ctrl.read(1, after - 8, 8) == b"\x5a" * 8 * BLOCK
            return after

    assert asyncio.run(go()) == 96 * MiB // BLOCK


# Loaded into `nvmeof serve` through sitecustomize: an exit handler registered before librados loads runs
# after libceph-common's static destructors, and keeps the process there LINGER_US. A librados client left
# up meets its next MonClient tick in that time and aborts (boost::bad_get) or crashes, where a plain exit
# gives it a few milliseconds only (the flake this reproduces). glibc calls it as usleep(LINGER_US).
LINGER_US = 4_000_000
EXIT_LINGER = f"""\
import ctypes
libc = ctypes.CDLL(None)
libc.__cxa_atexit(ctypes.cast(libc.usleep, ctypes.c_void_p), ctypes.c_void_p({LINGER_US}), None)
"""


async def _resize_behind_and_write_tail(target: OurTarget, ceph_cluster: Any, image: str) -> None:
    events: asyncio.Queue[Any] = asyncio.Queue()
    async with connect("127.0.0.1", target.io_port, target.subnqn, event_callback=events.put_nowait) as ctrl:
        await asyncio.to_thread(ceph_cluster.rbd, "resize", "--no-progress", "--size", "96M",
                                f"{ceph_cluster.pool}/{image}")
        await asyncio.wait_for(events.get(), 30)   # Namespace Attribute Changed
        after = (await ctrl.identify_namespace(1)).nsze
        await ctrl.write(1, after - 8, b"\x5a" * 8 * BLOCK)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or platform.machine() not in ("x86_64", "aarch64"),
                    reason="the exit-linger hook needs glibc's __cxa_atexit and a register calling convention")
def test_stop_after_outside_resize_shuts_librados_down(ceph_cluster: Any, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(EXIT_LINGER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p))
    for run in range(2):
        image = f"t-exit-{os.getpid()}-{run}"
        ceph_cluster.rbd("create", "--size", f"{IMAGE_SIZE // MiB}M", f"{ceph_cluster.pool}/{image}")
        try:
            # serve_target asserts exit status 0 after SIGTERM
            with serve_target(tmp_path / f"run{run}", extra_args=(
                    "--ceph-conf", str(ceph_cluster.conf), "--rbd-image", f"{ceph_cluster.pool}/{image}",
                    "--rbd-op-timeout", str(OP_TIMEOUT))) as target:
                asyncio.run(_resize_behind_and_write_tail(target, ceph_cluster, image))
            target.assert_no_errors()
        finally:
            ceph_cluster.rbd("rm", "--no-progress", f"{ceph_cluster.pool}/{image}")


def test_stopped_osd_fails_commands_in_time_and_io_resumes(rbd_target: OurTarget, ceph_cluster: Any) -> None:
    rbd_target.add_namespace(8 * MiB, nsid=2)   # a RAM namespace next to the image

    async def go() -> tuple[float, NvmeError]:
        async with connect("127.0.0.1", rbd_target.io_port, rbd_target.subnqn, kato=2000, timeout=60) as ctrl:
            await ctrl.write(1, 0, b"\x11" * 4096)
            ceph_cluster.suspend_osd()
            try:
                began = time.monotonic()
                stuck = asyncio.ensure_future(ctrl.write(1, 8, b"\x22" * 4096))
                # Meanwhile the RAM namespace and keep-alive (kato 2 s, several intervals) carry on.
                for i in range(10):
                    await ctrl.write(2, i * 8, b"\x33" * 4096)
                    await asyncio.sleep(0.3)
                with pytest.raises(NvmeError) as err:
                    await stuck
                took = time.monotonic() - began
            finally:
                ceph_cluster.resume_osd()
            # I/O works again once the cluster is back (the first call may still meet the OSD catching up).
            deadline = time.monotonic() + 60
            while True:
                try:
                    await ctrl.write(1, 16, b"\x44" * 4096)
                    break
                except NvmeError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            assert await ctrl.read(1, 16, 8) == b"\x44" * 4096
            assert await ctrl.read(2, 0, 8) == b"\x33" * 4096
            return took, err.value

    took, error = asyncio.run(go())
    # --rbd-op-timeout bounds it (the default is 10 s), with a margin for a loaded machine.
    assert OP_TIMEOUT - 0.5 <= took < OP_TIMEOUT + 3, f"the stuck write failed after {took:.1f} s"
    assert not error.dnr, f"{error} has Do Not Retry set; a host must be allowed to retry it"
    ctrls = rbd_target.controllers()
    assert ctrls == [], f"the controller should have disconnected cleanly, REST still lists {ctrls}"
