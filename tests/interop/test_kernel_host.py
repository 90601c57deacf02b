"""The Linux kernel host (nvme-tcp, nvme-cli, fio) in a QEMU guest against our `nvmeof serve`.

One guest boot runs every check (a boot costs 8-15 s under TCG).  The guest script prints one
`@@CHECK <name> PASS|FAIL <seconds>s <reason>@@` line per check and keeps going after a failure; at
`@@HOST <step>@@` lines the test changes the target over its REST API (add, resize, remove a
namespace) or inspects it, while the guest polls for the effect or waits on a tiny HTTP "barrier" the
test serves.  Host-side checks land in the same table, and each pytest test below asserts a group of
checks, so a failure names exactly which check failed and why.
"""

from __future__ import annotations

import dataclasses
import http.server
import re
import shlex
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from nvmeof.spec.tcp import PduType
from tests.interop import vm
from tests.interop.ourtarget import IcSniffer, OurTarget, serve_target
from tests.ports import free_port

# The module's one guest run (~1.5-2 min under TCG) is set up inside the first test.
pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

TARGET_SIZE = 128 << 20
BLOCK = 512
INLINE_DATA_SIZE = 131072   # the second I/O listener's in-capsule size: a 128 KiB write in one capsule
NS2_SIZE = 16 << 20
NS2_RESIZED = 32 << 20
STEP_TIMEOUT = 180.0  # the longest stretch between two host steps (dd + fio under TCG: ~60 s)
# QoS steps: limits well below what the guest does (~2,500 4K IOPS and ~20 MiB/s through user networking on a
# quiet machine; on a loaded one ~1,000 IOPS and 2-3 MiB/s of writes were measured), each measured by a timed fio
# run of QOS_RUNTIME s after 1 s of ramp. Above the limit only the bucket's burst (20 ms of the rate, + 1
# command: 0.3 % of a 10 s run) and fio's window edge (up to iodepth commands: 16 / 2,000 = 0.8 % for IOPS,
# 4 x 16 KiB / 10 MiB = 0.6 % for bandwidth) can show: 5 % is margin enough. Below it, a stall of the emulated
# guest longer than the target's catch-up (250 ms) costs its time, so the floor only says the limit did not
# throttle far below itself.
QOS_RUNTIME = 10
QOS_IOPS = 200
QOS_MBYTES = 1
QOS_ABOVE, QOS_BELOW = 1.05, 0.80


# ------------------------------------------------------------------------------- the guest scripts

# The guest scripts' one check runner: a check's output is shown only when it fails, and the harness reads
# its @@CHECK@@ marker (_parse_guest).
GUEST_RUN = r"""# run NAME FUNCTION ARGS...: one check; its output is shown (indented) only when it fails
run() {
    _name=$1; shift
    _t0=$(date +%s)
    if "$@" > /tmp/check.log 2>&1; then
        echo "@@CHECK $_name PASS $(( $(date +%s) - _t0 ))s@@"
    else
        _rc=$?
        tail -n 40 /tmp/check.log | sed 's/^/    | /'
        echo "@@CHECK $_name FAIL $(( $(date +%s) - _t0 ))s rc=$_rc: $(tail -n 1 /tmp/check.log | tr -d '@')@@"
    fi
}
"""
# The shell both kernel-host guest scripts (this module's and test_kernel_host_workers.py's) start
# with: the check runner, the HTTP barrier, connect and the I/O checks.  A script sets T, IOP, NQN,
# GO (and what its own checks use) after it; guest_script_text() fills in the @NAME@ placeholders.
GUEST_PREAMBLE = r"""
# The markers travel on the script's own serial port (vm.INIT_SCRIPT), where no kernel message can
# tear them; keeping kernel messages off the console just keeps the saved console short (dmesg still
# has them, and failing checks print what they need).
dmesg -n 1
exec 3>&1
echo "@@INFO hostnqn=$(cat /etc/nvme/hostnqn)@@"

""" + GUEST_RUN + r"""# await_host STEP: wait until the test has done its part of STEP (it serves the released steps)
await_host() {
    _i=0
    while [ $_i -lt 600 ]; do
        # busybox 1.35's `wget -T` crashes (SIGSEGV): bound it with timeout instead
        case " $(timeout 5 wget -q -O - "$GO" 2>/dev/null) " in *" $1 "*) return 0 ;; esac
        sleep 0.2; _i=$((_i + 1))
    done
    echo "the test did not release step $1 within 120 s"; return 1
}
# host_step NAME: the test acts on (or inspects) the target now; wait until it is done
host_step() {
    echo "@@HOST $1@@" >&3
    await_host $1
}
need_dev() { [ -n "$DEV" ] && [ -b "$DEV" ] || { echo "no block device (the connect check failed)"; return 1; }; }
# wait_for SECONDS SHELL-CONDITION
wait_for() {
    _i=0
    while [ $_i -lt $(( $1 * 10 )) ]; do eval "$2" && return 0; sleep 0.1; _i=$((_i + 1)); done
    return 1
}

# connect PORT EXTRA-ARGS: sets CTRL and DEV
connect() {
    CTRL=""; DEV=""; rm -f /tmp/conn
    dmesg -c > /dev/null
    _port=$1; shift
    ( @CONNECT@
      echo "$CTRL $DEV" > /tmp/conn ) || return 1
    read CTRL DEV < /tmp/conn
    echo "@@INFO connected=$CTRL dev=$DEV cntlid=$(cat /sys/class/nvme/$CTRL/cntlid)@@" >&3
    dmesg | grep -i nvme
}

check_dd() {  # $1: MiB
    need_dev || return 1
    dd if=/dev/urandom of=/tmp/data bs=1M count=$1 2>/dev/null || { echo "cannot make random data"; return 1; }
    dd if=/tmp/data of=$DEV bs=1M oflag=direct conv=fsync || { echo "dd write of $1 MiB to $DEV failed"; return 1; }
    written=$(sha256sum < /tmp/data | cut -d' ' -f1)
    read_back=$(dd if=$DEV bs=1M count=$1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
    rm -f /tmp/data
    echo "written $written read $read_back"
    [ "$written" = "$read_back" ] || { echo "sha256 of the $1 MiB read back differs from what was written"; return 1; }
}

ENGINE=libaio
fio --enghelp 2>/dev/null | grep -qw libaio || ENGINE=io_uring
run_fio() {  # fio arguments; passes only with exit 0, "err= 0" for every job and no verify complaint
    need_dev || return 1
    fio --name=check --filename=$DEV --ioengine=$ENGINE --direct=1 --verify=crc32c --verify_fatal=1 \
        --group_reporting "$@" > /tmp/fio 2>&1
    rc=$?
    cat /tmp/fio
    [ $rc = 0 ] || { echo "fio exited $rc"; return 1; }
    grep -q "err= 0" /tmp/fio || { echo "fio reported an error"; return 1; }
    ! grep -qi "verify.*\(bad\|fail\|mismatch\)" /tmp/fio || { echo "fio reported verify errors"; return 1; }
    grep -E "^ *(read|write):" /tmp/fio | sed 's/^ */@@INFO fio_/; s/:.*IOPS=\([^,]*\),.*/_iops=\1@@/' >&3
}

check_disconnect() {
    [ -n "$CTRL" ] || { echo "nothing to disconnect (the connect check failed)"; return 1; }
    nvme disconnect -d $CTRL || { echo "nvme disconnect -d $CTRL exited $?"; return 1; }
    wait_for 10 "[ ! -e /sys/class/nvme/$CTRL ]" || { echo "$CTRL still present after disconnect"; return 1; }
    CTRL=""; DEV=""
}

check_mapped_queues() {  # $1: queue count
    dmesg | grep "mapped" || true
    dmesg | grep -q "mapped $1/0/0 default/read/poll queues" || {
        echo "dmesg has no 'mapped $1/0/0 default/read/poll queues'"; return 1; }
}
"""

GUEST_EPILOGUE = r"""
echo "@@HOST all-disconnected@@"
await_host done || echo "the test did not finish its last checks"
dmesg | grep -i -e nvme -e tcp | tail -n 40 | sed 's/^/    dmesg| /'
exit 0
"""


def guest_script_text(script: str, subnqn: str, values: dict[str, str]) -> str:
    """``script`` with its @NAME@ placeholders filled in: @HOST_ADDR@, @NQN@ and connect's @CONNECT@
    here, the rest from ``values``."""
    connect = vm.guest_nvme_connect_script(vm.HOST_ADDR, "PORTVAR", subnqn, '"$@"')
    connect = connect.replace("-s PORTVAR", '-s "$_port"').replace(":PORTVAR", ":$_port")
    values = {"@HOST_ADDR@": vm.HOST_ADDR, **values, "@NQN@": shlex.quote(subnqn), "@CONNECT@": connect}
    for key, value in values.items():
        script = script.replace(key, value)
    return script


GUEST_SCRIPT = GUEST_PREAMBLE + r"""
T=@HOST_ADDR@; IOP=@IOP@; DP=@DP@; DIGP=@DIGP@; INP=@INP@; NQN=@NQN@; GO=http://@HOST_ADDR@:@GOP@/
SIZE=@SIZE@; NS2_SIZE=@NS2_SIZE@; NS2_RESIZED=@NS2_RESIZED@

check_discover() {  # $1: port
    nvme discover -t tcp -a $T -s $1 > /tmp/disc || { echo "nvme discover -s $1 exited $?"; return 1; }
    cat /tmp/disc
    grep -Eq "subnqn: *$NQN( |\$)" /tmp/disc || { echo "$NQN missing from the discovery log on port $1"; return 1; }
    grep -Eq "trsvcid: *$IOP( |\$)" /tmp/disc || { echo "no entry with trsvcid $IOP on port $1"; return 1; }
}

check_list() {
    need_dev || return 1
    nvme list > /tmp/list || { echo "nvme list exited $?"; return 1; }
    cat /tmp/list
    grep -q "^$DEV " /tmp/list || { echo "nvme list does not show $DEV"; return 1; }
}

check_id_ctrl() {
    need_dev || return 1
    nvme id-ctrl /dev/$CTRL > /tmp/idc || { echo "nvme id-ctrl exited $?"; return 1; }
    head -n 20 /tmp/idc
    sub=$(sed -n 's/^subnqn *: *//p' /tmp/idc)
    [ "$sub" = "$NQN" ] || { echo "id-ctrl subnqn is '$sub', expected $NQN"; return 1; }
    idc_cntlid=$(( $(sed -n 's/^cntlid *: *//p' /tmp/idc) ))
    sys_cntlid=$(cat /sys/class/nvme/$CTRL/cntlid)
    [ "$idc_cntlid" = "$sys_cntlid" ] || { echo "id-ctrl cntlid $idc_cntlid != connect cntlid $sys_cntlid"; return 1; }
    echo "@@INFO id_ctrl_cntlid=$idc_cntlid@@" >&3
}

check_id_ns() {
    need_dev || return 1
    nvme id-ns $DEV > /tmp/idns || { echo "nvme id-ns exited $?"; return 1; }
    head -n 12 /tmp/idns
    nsze=$(( $(sed -n 's/^nsze *: *//p' /tmp/idns) ))
    [ "$nsze" = $((SIZE / @BLOCK@)) ] || { echo "id-ns nsze $nsze, expected $((SIZE / @BLOCK@))"; return 1; }
    grep -q "in use" /tmp/idns || { echo "id-ns shows no LBA format in use"; return 1; }
    sectors=$(cat /sys/block/${DEV#/dev/}/size)
    [ "$sectors" = $((SIZE / 512)) ] || { echo "/sys/block size $sectors sectors, expected $((SIZE / 512))"; return 1; }
}

QOS_RUNTIME=@QOS_RUNTIME@
run_fio_rate() {  # TAG fio-arguments: a timed run (no verify); reports TAG_iops, TAG_kibps (reads + writes)
    need_dev || return 1
    _tag=$1; shift
    fio --name=rate --filename=$DEV --ioengine=$ENGINE --direct=1 --time_based --runtime=$QOS_RUNTIME \
        --ramp_time=1 --group_reporting --output-format=terse --terse-version=3 "$@" > /tmp/fio 2>&1
    rc=$?
    cat /tmp/fio
    [ $rc = 0 ] || { echo "fio exited $rc"; return 1; }
    # terse v3: 5 error, 7/8 read KiB/s and IOPS, 48/49 write KiB/s and IOPS
    _line=$(grep '^3;' /tmp/fio | tail -n 1)
    [ -n "$_line" ] || { echo "fio printed no terse line"; return 1; }
    echo "$_line" | awk -F';' -v t="$_tag" \
        '{ printf "@@INFO %s_iops=%d %s_kibps=%d %s_err=%s@@\n", t, $8 + $49, t, $7 + $48, t, $5 }' >&3
    [ "$(echo "$_line" | cut -d';' -f5)" = 0 ] || { echo "fio reported an error"; return 1; }
}

check_smart_log() {
    need_dev || return 1
    nvme smart-log /dev/$CTRL > /tmp/smart || { echo "nvme smart-log exited $?"; return 1; }
    cat /tmp/smart
    grep -q "^critical_warning" /tmp/smart || { echo "smart-log output has no critical_warning"; return 1; }
}

check_error_log() {
    need_dev || return 1
    nvme error-log /dev/$CTRL > /tmp/elog || { echo "nvme error-log exited $?"; return 1; }
    head -n 20 /tmp/elog
    grep -q "Error Log Entries" /tmp/elog || { echo "error-log output has no entries header"; return 1; }
}

check_ioccsz() {  # $1: the IOCCSZ the listener's inline_data_size gives ((64 + size) / 16)
    need_dev || return 1
    ioccsz=$(( $(nvme id-ctrl /dev/$CTRL | sed -n 's/^ioccsz *: *//p') ))
    echo "ioccsz $ioccsz"
    [ "$ioccsz" = $1 ] || { echo "id-ctrl ioccsz is $ioccsz, expected $1"; return 1; }
}

check_dd_128k() {  # $1: MiB, in 128 KiB direct writes and reads (each within an in-capsule size of 128 KiB)
    need_dev || return 1
    dd if=/dev/urandom of=/tmp/data bs=1M count=$1 2>/dev/null || { echo "cannot make random data"; return 1; }
    dd if=/tmp/data of=$DEV bs=128k oflag=direct conv=fsync || { echo "dd write to $DEV failed"; return 1; }
    written=$(sha256sum < /tmp/data | cut -d' ' -f1)
    read_back=$(dd if=$DEV bs=128k count=$(( $1 * 8 )) iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
    rm -f /tmp/data
    echo "written $written read $read_back"
    [ "$written" = "$read_back" ] || { echo "sha256 of the $1 MiB read back differs from what was written"; return 1; }
}

# Each namespace step prints its @@HOST@@ line first, so the test's sequence goes on even when the
# step cannot work.
check_ns_add() {
    echo "@@HOST ns-add@@" >&3
    need_dev || return 1
    NS2=${DEV%n1}n2
    wait_for 30 "[ -b $NS2 ]" || { echo "$NS2 did not appear within 30 s of the namespace add"; return 1; }
    wait_for 10 "[ \$(cat /sys/block/${NS2#/dev/}/size) = $((NS2_SIZE / 512)) ]" || {
        echo "$NS2 has $(cat /sys/block/${NS2#/dev/}/size) sectors, expected $((NS2_SIZE / 512))"; return 1; }
}

check_ns_resize() {
    echo "@@HOST ns-resize@@" >&3
    [ -n "$NS2" ] && [ -b "$NS2" ] || { echo "no second namespace (ns_add failed)"; return 1; }
    wait_for 30 "[ \$(cat /sys/block/${NS2#/dev/}/size) = $((NS2_RESIZED / 512)) ]" || {
        echo "$NS2 still has $(cat /sys/block/${NS2#/dev/}/size) sectors 30 s after the resize"; return 1; }
    bytes=$(blockdev --getsize64 $NS2)
    [ "$bytes" = $NS2_RESIZED ] || { echo "blockdev --getsize64 $NS2 says $bytes"; return 1; }
    # The new capacity is usable: write and read back the last MiB.
    dd if=/dev/urandom of=/tmp/tail bs=1M count=1 2>/dev/null
    dd if=/tmp/tail of=$NS2 bs=1M seek=$((NS2_RESIZED / 1048576 - 1)) oflag=direct 2>/dev/null || {
        echo "writing the last MiB of the resized $NS2 failed"; return 1; }
    [ "$(dd if=$NS2 bs=1M skip=$((NS2_RESIZED / 1048576 - 1)) iflag=direct 2>/dev/null | sha256sum)" = \
      "$(sha256sum < /tmp/tail)" ] || { echo "the last MiB of the resized $NS2 reads back different"; return 1; }
}

check_ns_remove() {
    echo "@@HOST ns-remove@@" >&3
    [ -n "$NS2" ] || { echo "no second namespace (ns_add failed)"; return 1; }
    wait_for 30 "[ ! -e $NS2 ]" || { echo "$NS2 still present 30 s after the namespace was removed"; return 1; }
    [ -b "$DEV" ] || { echo "$DEV vanished together with $NS2"; return 1; }
}

# ---- discovery
run discover_discovery_port check_discover $DP
run discover_io_port check_discover $IOP

# ---- plain connect: identify, logs, I/O, namespace changes
run connect_plain connect $IOP
run nvme_list check_list
run id_ctrl check_id_ctrl
run id_ns check_id_ns
run smart_log check_smart_log
run error_log check_error_log
run dd_64mib_sha256 check_dd 64
run fio_randrw_4k_qd32 run_fio --rw=randrw --bs=4k --iodepth=32 --size=8M --numjobs=2 --offset_increment=8M \
    --cpus_allowed=0-1 --cpus_allowed_policy=split
run fio_seq_128k run_fio --rw=write --bs=128k --iodepth=8 --size=32M --offset=64M
# ---- QoS: the test limits namespace 1, fio measures what it gets (the test compares, host side)
run rest_step_qos_iops host_step qos-iops
run qos_iops_fio run_fio_rate qos_iops --rw=randrw --bs=4k --iodepth=16 --size=64M
run rest_step_qos_bw host_step qos-bw
run qos_bw_fio run_fio_rate qos_bw --rw=write --bs=16k --iodepth=4 --size=64M
run rest_step_qos_off host_step qos-off
run ns_add check_ns_add
run ns_resize check_ns_resize
run ns_remove check_ns_remove
run disconnect_plain check_disconnect

# ---- header and data digests (through the test's ICReq/ICResp sniffer on port DIGP)
run connect_digests connect $DIGP --hdr-digest --data-digest
run digests_dd_16mib_sha256 check_dd 16
run digests_fio_randrw run_fio --rw=randrw --bs=4k --iodepth=16 --size=4M
run disconnect_digests check_disconnect

# ---- a listener with inline_data_size 131072 (through the test's PDU counter on port INP): 128 KiB writes
# go in their command capsule, with no R2T
run connect_inline connect $INP
run inline_ioccsz check_ioccsz @INLINE_IOCCSZ@
run inline_dd_16mib_128k_sha256 check_dd_128k 16
run disconnect_inline check_disconnect

# ---- two I/O queues
run connect_2_io_queues connect $IOP --nr-io-queues 2
run dmesg_2_io_queues check_mapped_queues 2
run rest_step_queues host_step queues
run two_queue_fio run_fio --rw=randrw --bs=4k --iodepth=16 --size=4M --numjobs=2 --offset_increment=4M \
    --cpus_allowed=0-1 --cpus_allowed_policy=split
run disconnect_2_io_queues check_disconnect
""" + GUEST_EPILOGUE

GUEST_CHECKS = (
    "discover_discovery_port", "discover_io_port",
    "connect_plain", "nvme_list", "id_ctrl", "id_ns", "smart_log", "error_log",
    "dd_64mib_sha256", "fio_randrw_4k_qd32", "fio_seq_128k",
    "rest_step_qos_iops", "qos_iops_fio", "rest_step_qos_bw", "qos_bw_fio", "rest_step_qos_off",
    "ns_add", "ns_resize", "ns_remove", "disconnect_plain",
    "connect_digests", "digests_dd_16mib_sha256", "digests_fio_randrw", "disconnect_digests",
    "connect_inline", "inline_ioccsz", "inline_dd_16mib_128k_sha256", "disconnect_inline",
    "connect_2_io_queues", "dmesg_2_io_queues", "rest_step_queues", "two_queue_fio", "disconnect_2_io_queues",
)  # fmt: skip
HOST_CHECKS = (
    "rest_cntlid_matches", "rest_two_io_queues", "digests_negotiated", "inline_writes_without_r2t",
    "qos_iops_within_limit", "qos_bw_within_limit", "qos_throttled_in_metrics",
    "no_leaked_controller", "target_log_clean", "target_clean_exit",
)  # fmt: skip


def guest_script(*, io_port: int, disc_port: int, digest_port: int, go_port: int, subnqn: str,
                 inline_port: int = 0) -> str:
    return guest_script_text(GUEST_SCRIPT, subnqn, {
        "@IOP@": str(io_port), "@DP@": str(disc_port), "@DIGP@": str(digest_port), "@GOP@": str(go_port),
        "@INP@": str(inline_port), "@INLINE_IOCCSZ@": str((64 + INLINE_DATA_SIZE) // 16),
        "@SIZE@": str(TARGET_SIZE), "@BLOCK@": str(BLOCK), "@NS2_SIZE@": str(NS2_SIZE),
        "@NS2_RESIZED@": str(NS2_RESIZED), "@QOS_RUNTIME@": str(QOS_RUNTIME),
    })  # fmt: skip


# ------------------------------------------------------------------------------- host side


class Barrier:
    """Serves the names of the released steps over HTTP; the guest polls it with busybox wget."""

    def __init__(self) -> None:
        self.released: list[str] = []
        released = self.released

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = (" ".join(released) + "\n").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def release(self, step: str) -> None:
        self.released.append(step)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclasses.dataclass
class CheckResult:
    ok: bool
    seconds: float | None
    reason: str


@dataclasses.dataclass
class Report:
    checks: dict[str, CheckResult] = dataclasses.field(default_factory=dict)
    info: dict[str, str] = dataclasses.field(default_factory=dict)
    error: str = ""  # why the run stopped early, if it did
    console: Path | None = None
    target_log: Path | None = None
    seconds: float = 0.0
    boot_seconds: float | None = None

    def record(self, name: str, ok: bool, reason: str = "", seconds: float | None = None) -> None:
        self.checks[name] = CheckResult(ok, seconds, reason)

    def assert_passed(self, *names: str) -> None:
        problems = []
        for name in names:
            result = self.checks.get(name)
            if result is None:
                problems.append(f"{name}: not reported ({self.error or 'the guest never reached it'})")
            elif not result.ok:
                problems.append(f"{name}: FAILED: {result.reason}")
        assert not problems, ("kernel host checks failed:\n  " + "\n  ".join(problems)
                              + f"\nguest console: {self.console}\ntarget log: {self.target_log}")

    def print_summary(self, title: str, expected: Iterable[str] = (), detail: str = "") -> None:
        """The run's header line (``title``, total and boot seconds, the console's path, then ``detail``) and
        print_checks(``expected``): what a kernel VM test prints at the end of its run."""
        print(f"\n{title}: {self.seconds:.1f} s total, boot {self.boot_seconds or 0:.1f} s; console {self.console}"
              f"{detail}")
        self.print_checks(expected)

    def print_checks(self, expected: Iterable[str] = ()) -> None:
        """One line a check (PASS/FAIL, seconds, the reason of a failure), then MISSING for each ``expected``
        check the run never reported: the summary every kernel VM test prints under its header line."""
        for name, result in self.checks.items():
            took = f"{result.seconds:4.0f}s" if result.seconds is not None else "    -"
            print(f"  {'PASS' if result.ok else 'FAIL'} {took} {name}{'' if result.ok else ': ' + result.reason}")
        for name in sorted(set(expected) - set(self.checks)):
            print(f"  MISSING     {name}")


_CHECK_RE = re.compile(r"@@CHECK (\S+) (PASS|FAIL) (\d+)s(?: ([^@\n]*))?@@")
_INFO_RE = re.compile(r"@@INFO ([^@\n]*)@@")


def _parse_guest(output: str, report: Report) -> None:
    for m in _INFO_RE.finditer(output):
        for pair in m.group(1).split():
            key, _, value = pair.partition("=")
            report.info.setdefault(key, value)
    for m in _CHECK_RE.finditer(output):
        report.record(m.group(1), m.group(2) == "PASS", m.group(4) or "", float(m.group(3)))


def _poll(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def drive_guest(guest: vm.Guest, report: Report, on_step: Callable[[str], bool], *, step_timeout: float,
                on_output: Callable[[str], None] | None = None) -> None:
    """Answer the guest's @@HOST step@@ lines in order with ``on_step`` (True after the last one), then
    wait for the script to exit; a guest that exits early, stalls past ``step_timeout`` or fails becomes
    the report's error. ``on_output`` sees the console after each step line (more to parse)."""
    try:
        pos = 0
        while True:
            match = guest.wait_for(r"@@HOST (\S+)@@", step_timeout, start=pos)
            pos = match.end()
            _parse_guest(guest.output, report)
            if on_output is not None:
                on_output(guest.output)
            if on_step(match.group(1)):
                break
        code = guest.wait_exit(60)
        if code != 0:
            report.error = f"guest script exited with status {code}"
    except (vm.GuestExited, vm.GuestTimeout) as exc:
        report.error = exc.args[0].splitlines()[0]


def run_guest(guest: vm.Guest, script: str, report: Report, on_step: Callable[[str], bool], *,
              step_timeout: float, on_output: Callable[[str], None] | None = None) -> None:
    """Start ``guest`` on ``script`` and answer its host steps (drive_guest); the console goes to
    report.console and the guest is stopped whatever happens, then its checks and info go into ``report``."""
    try:
        guest.start(script)
        report.boot_seconds = guest.boot_seconds
        drive_guest(guest, report, on_step, step_timeout=step_timeout, on_output=on_output)
    finally:
        report.console.write_text(guest.output)
        guest.stop()
    _parse_guest(guest.output, report)


def _namespace_ids(target: OurTarget) -> set[int]:
    return {ns["nsid"] for ns in target.api("GET", f"/subsystems/{target.subnqn}/namespaces")}


def _host_step(name: str, target: OurTarget, barrier: Barrier, sniffer: IcSniffer, report: Report) -> bool:
    """Do the test's part of one guest step; True after the last one."""
    if name == "ns-add":
        # Still connected with the plain controller: the REST view must list the cntlid the guest saw.
        _rest_cntlid_check(target, report)
        target.add_namespace(NS2_SIZE, nsid=2)
    elif name == "ns-resize":
        if 2 in _namespace_ids(target):
            target.resize_namespace(2, NS2_RESIZED)
    elif name == "ns-remove":
        if 2 in _namespace_ids(target):
            target.remove_namespace(2)
    elif name.startswith("qos-"):
        _qos_step(name, target, report)
        barrier.release(name)
    elif name == "queues":
        mine = [c for c in target.controllers()
                if c["subnqn"] == target.subnqn and c["hostnqn"] == report.info.get("hostnqn")]
        qids = [sorted(q["qid"] for q in c["queues"]) for c in mine]
        report.record("rest_two_io_queues", qids == [[0, 1, 2]],
                      f"REST queues of the guest's controller(s): {qids}, expected [[0, 1, 2]]")
        barrier.release("queues")
    elif name == "all-disconnected":
        _final_checks(target, barrier, sniffer, report)
        return True
    else:
        raise AssertionError(f"the guest script asked for an unknown host step {name!r}")
    return False


def _qos_step(name: str, target: OurTarget, report: Report) -> None:
    """Set namespace 1's limit for the next fio run, and judge the run before (its figures are in report.info)."""
    url = f"/subsystems/{target.subnqn}/namespaces/1/qos"
    if name == "qos-iops":
        target.api("PUT", url, json={"rw_ios_per_second": QOS_IOPS})
    elif name == "qos-bw":
        _qos_judge(report, "qos_iops_within_limit", "qos_iops", QOS_IOPS, "IOPS")
        target.api("PUT", url, json={"rw_ios_per_second": 0, "rw_mbytes_per_second": QOS_MBYTES})
    else:
        _qos_judge(report, "qos_bw_within_limit", "qos_bw_kibps", QOS_MBYTES * 1024, "KiB/s")
        target.api("PUT", url, json={"rw_mbytes_per_second": 0})
        base = target.api_url.rsplit("/api/v1", 1)[0]
        text = target.client.get(base + "/metrics").text
        line = f'nvmeof_namespace_throttled_total{{subnqn="{target.subnqn}",nsid="1"}} '
        counts = [int(x.split()[-1]) for x in text.splitlines() if x.startswith(line)]
        report.record("qos_throttled_in_metrics", counts != [] and counts[0] > 0,
                      f"/metrics {line.strip()}: {counts}")


def _qos_judge(report: Report, check: str, key: str, limit: int, unit: str) -> None:
    raw = report.info.get(key if key.endswith("kibps") else f"{key}_iops")
    got = int(raw) if raw is not None and raw.isdigit() else None
    ok = got is not None and QOS_BELOW * limit <= got <= QOS_ABOVE * limit
    report.record(check, ok, f"fio measured {got} {unit} under a limit of {limit} {unit} (allowed "
                             f"{QOS_BELOW * limit:.0f}..{QOS_ABOVE * limit:.0f})")
    print(f"QoS {check}: fio {got} {unit}, limit {limit}")


def _rest_cntlid_check(target: OurTarget, report: Report) -> None:
    cntlid = report.info.get("id_ctrl_cntlid")
    ctrls = target.controllers()
    mine = [c for c in ctrls if c["subnqn"] == target.subnqn and c["hostnqn"] == report.info.get("hostnqn")]
    report.record("rest_cntlid_matches", cntlid is not None and [c["cntlid"] for c in mine] == [int(cntlid)],
                  f"guest id-ctrl cntlid {cntlid}, REST controllers of the guest: {mine}")


def _final_checks(target: OurTarget, barrier: Barrier, sniffer: IcSniffer, report: Report) -> None:
    leftovers: list[dict] = []

    def none_left() -> bool:
        leftovers[:] = target.controllers()
        return not leftovers

    report.record("no_leaked_controller", _poll(none_left, 10),
                  f"controllers still listed 10 s after the last disconnect: {leftovers}")
    barrier.release("done")

    # Every connection of the digest controller (admin + I/O queues) asked for and got HDGST|DDGST.
    req, resp = list(sniffer.icreq_digests), list(sniffer.icresp_digests)
    report.record("digests_negotiated", bool(req) and set(req) == {3} and set(resp) == {3} and len(req) == len(resp),
                  f"ICReq digest bytes {req}, ICResp digest bytes {resp}; expected 3 (HDGST|DDGST) on each")


@pytest.fixture(scope="module")
def kernel_host_report(vm_assets: vm.Assets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Report]:
    log_dir = tmp_path_factory.mktemp("kernel-host")
    report = Report(console=log_dir / "guest-console.log", target_log=log_dir / "nvmeof-serve.log")
    began = time.monotonic()
    barrier = Barrier()
    try:
        with serve_target(log_dir, size=f"{TARGET_SIZE >> 20}M", block_size=BLOCK, check_clean_exit=False) as target:
            sniffer = IcSniffer(target.io_port)
            # a second I/O listener taking 128 KiB capsules, reached through a counter of the target's PDUs
            inline_port = free_port()
            target.api("POST", "/listeners", json={"traddr": "127.0.0.1", "trsvcid": inline_port,
                                                   "inline_data_size": INLINE_DATA_SIZE})
            counter = IcSniffer(inline_port)
            counter.pdu_counts = {}
            guest = vm.Guest(vm_assets, fio=True)
            try:
                script = guest_script(io_port=target.io_port, disc_port=target.discovery_port,
                                      digest_port=sniffer.port, go_port=barrier.port, subnqn=target.subnqn,
                                      inline_port=counter.port)
                run_guest(guest, script, report, lambda step: _host_step(step, target, barrier, sniffer, report),
                          step_timeout=STEP_TIMEOUT)
            finally:
                sniffer.close()
                counter.close()
            counts = counter.count_pdus()
            # the dd wrote 16 MiB in 128 KiB writes: with IOCCSZ covering them, the target asks for no data
            report.record("inline_writes_without_r2t",
                          counts.get(PduType.R2T, 0) == 0 and counts.get(PduType.CAPSULE_RESP, 0) >= 128,
                          f"PDUs the target sent on the inline_data_size {INLINE_DATA_SIZE} listener, by type: "
                          f"{counts}; expected no R2T (0x9) and at least 128 responses (0x5)")
            target_proc = target.proc
    finally:
        barrier.close()
    code = target_proc.returncode
    report.record("target_clean_exit", code == 0, f"nvmeof serve exited with status {code} on SIGTERM")
    errors = target.log_errors()
    report.record("target_log_clean", not errors, "target log has errors:\n    " + "\n    ".join(errors[:30]))
    report.seconds = time.monotonic() - began
    report.print_summary("kernel host interop", GUEST_CHECKS + HOST_CHECKS)
    yield report


def test_discover_on_discovery_and_io_ports(kernel_host_report: Report) -> None:
    kernel_host_report.assert_passed("discover_discovery_port", "discover_io_port")


def test_connect_identify_and_logs(kernel_host_report: Report) -> None:
    kernel_host_report.assert_passed("connect_plain", "nvme_list", "id_ctrl", "id_ns", "smart_log", "error_log",
                                     "rest_cntlid_matches")


def test_dd_64mib_sha256(kernel_host_report: Report) -> None:
    kernel_host_report.assert_passed("dd_64mib_sha256")


def test_fio_verify(kernel_host_report: Report) -> None:
    kernel_host_report.assert_passed("fio_randrw_4k_qd32", "fio_seq_128k")


def test_qos_limits_hold_for_the_kernel_host(kernel_host_report: Report) -> None:
    """fio in the guest against namespace 1 limited to QOS_IOPS IOPS, then QOS_MBYTES MiB/s (tolerance: QOS_ABOVE)."""
    kernel_host_report.assert_passed("rest_step_qos_iops", "qos_iops_fio", "qos_iops_within_limit",
                                     "rest_step_qos_bw", "qos_bw_fio", "qos_bw_within_limit", "rest_step_qos_off",
                                     "qos_throttled_in_metrics")


def test_namespace_add_resize_remove_reach_the_host(kernel_host_report: Report) -> None:
    kernel_host_report.assert_passed("ns_add", "ns_resize", "ns_remove")


def test_header_and_data_digests(kernel_host_report: Report) -> None:
    kernel_host_report.assert_passed("connect_digests", "digests_negotiated", "digests_dd_16mib_sha256",
                                     "digests_fio_randrw", "disconnect_digests")


def test_large_inline_data_size_listener(kernel_host_report: Report) -> None:
    kernel_host_report.assert_passed("connect_inline", "inline_ioccsz", "inline_dd_16mib_128k_sha256",
                                     "disconnect_inline", "inline_writes_without_r2t")


def test_two_io_queues(kernel_host_report: Report) -> None:
    kernel_host_report.assert_passed("connect_2_io_queues", "dmesg_2_io_queues", "rest_step_queues",
                                     "rest_two_io_queues", "two_queue_fio", "disconnect_2_io_queues")


def test_disconnect_leaves_no_controller_and_no_error(kernel_host_report: Report) -> None:
    kernel_host_report.assert_passed("disconnect_plain", "no_leaked_controller", "target_log_clean",
                                     "target_clean_exit")


def test_every_check_reported(kernel_host_report: Report) -> None:
    missing = set(GUEST_CHECKS + HOST_CHECKS) - set(kernel_host_report.checks)
    unknown = set(kernel_host_report.checks) - set(GUEST_CHECKS + HOST_CHECKS)
    assert not missing and not unknown, (f"checks not reported: {sorted(missing)}; unexpected: {sorted(unknown)}; "
                                         f"{kernel_host_report.error}")
