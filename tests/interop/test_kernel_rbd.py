"""The Linux kernel host in a QEMU guest against our target serving a Ceph RBD image.

A throwaway one-node cluster (tests/ceph_cluster.py) holds the image; `nvmeof serve --rbd-image`
exports it. One guest boot writes 64 MiB with dd, and the test reads the same bytes back through
`rbd export`, outside our target; fio verifies; a resize through our REST API and one made with
`rbd resize` behind our back both reach the kernel host. The guest reports checks as
test_kernel_host.py's do (`@@CHECK name PASS|FAIL@@`), and the test does its part at `@@HOST step@@`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest

from tests.ceph_cluster import CephCluster
from tests.interop import vm
from tests.interop.ourtarget import OurTarget, serve_target
from tests.interop.test_kernel_host import (
    GUEST_EPILOGUE,
    GUEST_PREAMBLE,
    Barrier,
    Report,
    guest_script_text,
    run_guest,
)

pytestmark = [pytest.mark.vm, pytest.mark.ceph, pytest.mark.timeout(900)]

IMAGE_SIZE = 128 << 20
DD_MIB = 64
RESIZED = 160 << 20        # through our REST API
RESIZED_OUTSIDE = 192 << 20  # with `rbd resize`, which our target notices by itself
STEP_TIMEOUT = 240.0

GUEST_SCRIPT = GUEST_PREAMBLE + r"""
T=@HOST_ADDR@; IOP=@IOP@; NQN=@NQN@; GO=http://@HOST_ADDR@:@GOP@/
SIZE=@SIZE@; RESIZED=@RESIZED@; RESIZED_OUTSIDE=@RESIZED_OUTSIDE@

check_size() {  # $1: bytes
    need_dev || return 1
    sectors=$(cat /sys/block/${DEV#/dev/}/size)
    [ "$sectors" = $(($1 / 512)) ] || { echo "$DEV has $sectors sectors, expected $(($1 / 512))"; return 1; }
}

check_dd_export() {  # $1: MiB written and read back at offset 0 (check_dd), then compared through `rbd export`
    written=""; check_dd $1; rc=$?
    [ -z "$written" ] || echo "@@INFO written_sha256=$written@@" >&3
    return $rc
}

check_resized() {  # $1: host step, $2: bytes the namespace must grow to
    echo "@@HOST $1@@" >&3
    need_dev || return 1
    wait_for 60 "[ \$(cat /sys/block/${DEV#/dev/}/size) = $(($2 / 512)) ]" || {
        echo "$DEV has $(cat /sys/block/${DEV#/dev/}/size) sectors 60 s after $1, expected $(($2 / 512))"; return 1; }
    # the new tail is usable
    dd if=/dev/urandom of=/tmp/tail bs=1M count=1 2>/dev/null
    dd if=/tmp/tail of=$DEV bs=1M seek=$(($2 / 1048576 - 1)) oflag=direct conv=fsync 2>/dev/null || {
        echo "writing the last MiB of the resized $DEV failed"; return 1; }
    [ "$(dd if=$DEV bs=1M skip=$(($2 / 1048576 - 1)) count=1 iflag=direct 2>/dev/null | sha256sum)" = \
      "$(sha256sum < /tmp/tail)" ] || { echo "the last MiB of the resized $DEV reads back different"; return 1; }
    await_host $1
}

run connect_rbd connect $IOP
run size_is_image check_size $SIZE
run dd_64mib_sha256 check_dd_export @DD_MIB@
run rbd_export_step host_step rbd-export
run fio_randrw_4k_qd32 run_fio --rw=randrw --bs=4k --iodepth=32 --size=16M --offset=64M
run fio_seq_128k run_fio --rw=write --bs=128k --iodepth=8 --size=16M --offset=96M
run resize_rest check_resized resize-rest $RESIZED
run resize_outside check_resized resize-outside $RESIZED_OUTSIDE
run disconnect check_disconnect
""" + GUEST_EPILOGUE

GUEST_CHECKS = (
    "connect_rbd", "size_is_image", "dd_64mib_sha256", "rbd_export_step", "fio_randrw_4k_qd32", "fio_seq_128k",
    "resize_rest", "resize_outside", "disconnect",
)  # fmt: skip
HOST_CHECKS = ("rbd_export_matches", "image_resized_by_rest", "rest_sees_outside_resize", "target_log_clean")


class Run:
    """The test's side of the guest's @@HOST@@ steps."""

    def __init__(self, target: OurTarget, cluster: CephCluster, image: str, barrier: Barrier, report: Report) -> None:
        self.target, self.cluster, self.image, self.barrier, self.report = target, cluster, image, barrier, report

    def spec(self) -> str:
        return f"{self.cluster.pool}/{self.image}"

    def image_size(self) -> int:
        import json

        return int(json.loads(self.cluster.rbd("info", "--format", "json", self.spec()))["size"])

    def ns_size(self) -> int:
        return int(self.target.api("GET", f"/subsystems/{self.target.subnqn}/namespaces/1")["size"])

    def step(self, name: str) -> bool:
        report = self.report
        if name == "rbd-export":
            # The bytes the guest wrote, read from the cluster by Ceph's own tool, not through us.
            data = self.cluster.rbd_bytes("export", "--no-progress", self.spec(), "-")
            got = hashlib.sha256(data[: DD_MIB << 20]).hexdigest()
            want = report.info.get("written_sha256")
            report.record("rbd_export_matches", got == want,
                          f"sha256 of the first {DD_MIB} MiB of `rbd export` is {got}, the guest wrote {want}")
        elif name == "resize-rest":
            self.target.resize_namespace(1, RESIZED)
            size = self.image_size()
            report.record("image_resized_by_rest", size == RESIZED, f"image is {size} bytes after the REST resize")
        elif name == "resize-outside":
            self.cluster.rbd("resize", "--no-progress", "--size", f"{RESIZED_OUTSIDE >> 20}M", self.spec())
            deadline = time.monotonic() + 30
            while self.ns_size() != RESIZED_OUTSIDE and time.monotonic() < deadline:
                time.sleep(0.2)
            seen = self.ns_size()
            report.record("rest_sees_outside_resize", seen == RESIZED_OUTSIDE,
                          f"REST shows {seen} bytes 30 s after `rbd resize` to {RESIZED_OUTSIDE}")
            # The guest waits for the kernel to see it; released at once (its wait_for polls).
        elif name == "all-disconnected":
            self.barrier.release("done")
            return True
        else:
            raise AssertionError(f"the guest script asked for an unknown host step {name!r}")
        self.barrier.release(name)
        return False


@pytest.fixture(scope="module")
def rbd_kernel_report(vm_assets: vm.Assets, ceph_cluster: CephCluster,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[Report]:
    log_dir = tmp_path_factory.mktemp("kernel-rbd")
    report = Report(console=log_dir / "guest-console.log", target_log=log_dir / "nvmeof-serve.log")
    image = f"kernel-{log_dir.name}"
    ceph_cluster.rbd("create", "--size", f"{IMAGE_SIZE >> 20}M", f"{ceph_cluster.pool}/{image}")
    barrier = Barrier()
    began = time.monotonic()
    try:
        with serve_target(log_dir, check_clean_exit=False, extra_args=(
                "--ceph-conf", str(ceph_cluster.conf), "--rbd-image", f"{ceph_cluster.pool}/{image}")) as target:
            run = Run(target, ceph_cluster, image, barrier, report)
            guest = vm.Guest(vm_assets, fio=True)
            script = guest_script_text(GUEST_SCRIPT, target.subnqn, {
                "@IOP@": str(target.io_port), "@GOP@": str(barrier.port), "@SIZE@": str(IMAGE_SIZE),
                "@RESIZED@": str(RESIZED), "@RESIZED_OUTSIDE@": str(RESIZED_OUTSIDE), "@DD_MIB@": str(DD_MIB),
            })  # fmt: skip
            run_guest(guest, script, report, run.step, step_timeout=STEP_TIMEOUT)
    finally:
        barrier.close()
        try:
            ceph_cluster.rbd("rm", "--no-progress", f"{ceph_cluster.pool}/{image}")
        except Exception as exc:  # the report says what failed; a leftover image dies with the cluster
            print(f"could not remove {image}: {exc}")
    errors = target.log_errors()
    report.record("target_log_clean", not errors, "target log has errors:\n    " + "\n    ".join(errors[:30]))
    report.seconds = time.monotonic() - began
    report.print_summary("kernel host vs RBD", detail=f"; info {report.info}")
    yield report


def test_dd_written_by_the_kernel_host_is_in_the_image(rbd_kernel_report: Report) -> None:
    rbd_kernel_report.assert_passed("connect_rbd", "size_is_image", "dd_64mib_sha256", "rbd_export_step",
                                    "rbd_export_matches")


def test_fio_verify_on_rbd(rbd_kernel_report: Report) -> None:
    rbd_kernel_report.assert_passed("fio_randrw_4k_qd32", "fio_seq_128k")


def test_resizes_reach_the_kernel_host(rbd_kernel_report: Report) -> None:
    rbd_kernel_report.assert_passed("resize_rest", "image_resized_by_rest", "resize_outside",
                                    "rest_sees_outside_resize")


def test_disconnect_and_clean_log(rbd_kernel_report: Report) -> None:
    rbd_kernel_report.assert_passed("disconnect", "target_log_clean")


def test_every_check_reported(rbd_kernel_report: Report) -> None:
    missing = set(GUEST_CHECKS + HOST_CHECKS) - set(rbd_kernel_report.checks)
    assert not missing, f"checks never reported: {sorted(missing)} ({rbd_kernel_report.error})"
