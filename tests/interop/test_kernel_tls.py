"""NVMe/TCP over TLS 1.3 (PSK) refereed by Linux 6.12 (issue 23), **one Debian guest boot** per kernel.

The guest (tests/interop/rootfs.py) runs the kernel's TLS stack: the `tls` module (kTLS record layer), the
net/handshake upcall and tlshd (ktls-utils) doing the handshakes, the PSKs in the kernel's `.nvme` keyring,
with trixie's tlshd, nvme-cli 2.13 and keyctl (tests/interop/tlstools.py: bookworm has no tlshd and its
nvme-cli 2.3 has neither `nvme connect --tls` nor `nvme gen-tls-key --insert`).

Kernel against kernel, in the guest: nvmet-tcp with port 1 (4420) `addr_tsas` tls1.3 (so `addr_treq`
"required") and port 2 (4421) in the clear, both serving one brd namespace; `nvme gen-tls-key --insert` puts
the retained PSK of (host NQN, subsystem NQN) into `.nvme`; `nvme connect --tls` to port 1, the controller's
sysfs `tls_key` names the very key inserted, 16 MiB dd with sha256, disconnect; a clear `nvme connect` to the
TLS port is refused (nvmet answers the ICReq with a handshake that fails), `--tls` for a host with no key in
the keyring is refused by the host kernel itself (no PSK to offer).

6.1 has no NVMe/TCP TLS (Linux 6.7+): its half skips with that reason.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.interop import rootfs, tlstools, vm
from tests.interop.test_kernel_host import Report, _parse_guest
from tests.interop.test_rdma_guest import debian_rootfs  # noqa: F401  (fixture)

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

KSUB = "nqn.2026-11.io.nvmeof-toolkit:kernel-tls"
TLS_PORT, CLEAR_PORT = 4420, 4421  # nvmet ports 1 (TLS 1.3 required) and 2 (clear) in the guest
TOOLS = f"{rootfs.GUEST_SHARE_ROOT}/tls/bin"  # the trixie tools share (tlstools.TlsTools.root)
READY = "@@TLS-GUEST-READY@@"
DD_MIB = 16


@dataclasses.dataclass(frozen=True)
class Identity:
    """A host NQN and host ID made from one UUID (`nvme gen-hostnqn` style); the kernel refuses a host ID
    already used with another host NQN, so every identity in the guest has its own."""

    hostnqn: str
    hostid: str

    @classmethod
    def new(cls) -> Identity:
        u = str(uuid.uuid4())
        return cls(f"nqn.2014-08.org.nvmexpress:uuid:{u}", u)

    def args(self) -> str:
        return f"--hostnqn={shlex.quote(self.hostnqn)} --hostid={shlex.quote(self.hostid)}"


GUEST_PREAMBLE = r"""
set -u
exec 3>&1
T=@TOOLS@
# run NAME FUNCTION ARGS...: one check; its output is shown (indented) only when it fails
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
wait_for() {  # SECONDS SHELL-CONDITION
    _i=0
    while [ $_i -lt $(( $1 * 10 )) ]; do eval "$2" && return 0; sleep 0.1; _i=$((_i + 1)); done
    return 1
}
# insert_key NAME HOSTNQN SUBNQN [KEY]: `nvme gen-tls-key --insert` (a new key) or `check-tls-key --insert` (KEY,
# in the interchange format) puts the retained PSK into .nvme; KEY_<NAME> becomes the key id, never the secret
insert_key() {
    if [ $# -ge 4 ]; then
        _out=$($T/nvme check-tls-key --keydata="$4" --hostnqn="$2" --subsysnqn="$3" --insert) || return 1
    else
        _out=$($T/nvme gen-tls-key --hostnqn="$2" --subsysnqn="$3" --insert) || return 1
        echo "$_out" | grep -q '^NVMeTLSkey-1:0[12]:' || { echo "gen-tls-key printed no NVMeTLSkey-1 key"; return 1; }
    fi
    _id=$(echo "$_out" | sed -n 's/^Inserted TLS key \([0-9a-f]*\)$/\1/p')
    [ -n "$_id" ] || { echo "nvme did not say which key it inserted"; return 1; }
    eval "KEY_$1=$_id"
    $T/keyctl show %:.nvme | grep -q "psk: NVMe0R0[12] $2 $3\$" || { echo "no PSK of $2 $3 in .nvme"; return 1; }
    echo "key $_id inserted for $2 $3"
}
# tls_connect TRADDR TRSVCID SUBNQN KEY-ID CONNECT-ARGS...: nvme connect --tls; sets CTRL and DEV
tls_connect() {
    _addr=$1 _svc=$2 _sub=$3 _key=$4; shift 4
    CTRL=""; DEV=""
    _before=" $(ls /sys/class/nvme 2>/dev/null | tr '\n' ' ') "
    $T/nvme connect -t tcp -a $_addr -s $_svc -n $_sub --tls "$@" || { echo "nvme connect --tls exited $?"; return 1; }
    for _c in $(ls /sys/class/nvme); do
        case "$_before" in *" $_c "*) continue ;; esac
        [ "$(cat /sys/class/nvme/$_c/subsysnqn)" = "$_sub" ] && CTRL=$_c
    done
    [ -n "$CTRL" ] || { echo "no new controller for $_sub"; return 1; }
    wait_for 30 '[ -b /dev/${CTRL}n1 ]' || { echo "$CTRL has no namespace block device"; return 1; }
    DEV=/dev/${CTRL}n1
    _tk=$(cat /sys/class/nvme/$CTRL/tls_key 2>/dev/null)
    echo "@@INFO ctrl_$CTRL=tls_key:$_tk@@" >&3
    [ "$_tk" = "$_key" ] || { echo "$CTRL tls_key is '$_tk', not the inserted key $_key"; return 1; }
    grep -q "traddr=$_addr,trsvcid=$_svc" /sys/class/nvme/$CTRL/address || {
        echo "$CTRL address is $(cat /sys/class/nvme/$CTRL/address)"; return 1; }
}
# refused DESCRIPTION COMMAND...: the command must fail and leave no controller behind
refused() {
    _what=$1; shift
    _n=$(ls /sys/class/nvme 2>/dev/null | wc -l)
    if "$@"; then echo "$_what: the connect succeeded"; return 1; fi
    [ "$(ls /sys/class/nvme 2>/dev/null | wc -l)" = "$_n" ] || { echo "$_what: a controller was left"; return 1; }
    dmesg | tail -n 5
}
check_dd() {  # MiB
    [ -n "$DEV" ] && [ -b "$DEV" ] || { echo "no block device (the connect check failed)"; return 1; }
    dd if=/dev/urandom of=/tmp/data bs=1M count=$1 2>/dev/null || return 1
    dd if=/tmp/data of=$DEV bs=1M oflag=direct conv=fsync status=none || { echo "dd write to $DEV failed"; return 1; }
    _w=$(sha256sum < /tmp/data | cut -d' ' -f1)
    _r=$(dd if=$DEV bs=1M count=$1 iflag=direct status=none | sha256sum | cut -d' ' -f1)
    rm -f /tmp/data
    echo "written $_w read $_r"
    [ "$_w" = "$_r" ] || { echo "sha256 of the $1 MiB read back differs from what was written"; return 1; }
}
check_disconnect() {
    [ -n "$CTRL" ] || { echo "nothing to disconnect (the connect check failed)"; return 1; }
    $T/nvme disconnect -d $CTRL || { echo "nvme disconnect -d $CTRL exited $?"; return 1; }
    wait_for 10 "[ ! -e /sys/class/nvme/$CTRL ]" || { echo "$CTRL still present after disconnect"; return 1; }
    CTRL=""; DEV=""
}
check_handshakes() {  # MIN: tlshd logged at least MIN successful handshakes so far
    _n=$(grep -c "Handshake with .* was successful" /tmp/tlshd.log)
    echo "$_n successful handshakes"
    [ "$_n" -ge "$1" ] || { tail -n 20 /tmp/tlshd.log; return 1; }
}
"""

KERNEL_PART = r"""
# ---- kernel host against kernel target (nvmet), both in this guest
run kk_gen_tls_key_insert insert_key KK @KK_NQN@ @KSUB@
run kk_connect_tls tls_connect 127.0.0.1 @TLS_PORT@ @KSUB@ "${KEY_KK:-none}" @KK_ARGS@ --nr-io-queues=2
# the admin queue and both I/O queues each did a handshake on each side
run kk_handshakes check_handshakes 6
run kk_dd check_dd @DD_MIB@
run kk_disconnect check_disconnect
run kk_clear_refused_by_tls_port refused "clear connect to the TLS port" \
    $T/nvme connect -t tcp -a 127.0.0.1 -s @TLS_PORT@ -n @KSUB@ @KK_ARGS@
run kk_no_key_refused refused "--tls without a key in .nvme" \
    $T/nvme connect -t tcp -a 127.0.0.1 -s @TLS_PORT@ -n @KSUB@ --tls @NOKEY_ARGS@
"""

GUEST_END = r"""
echo "@@INFO tlshd_log_lines=$(wc -l < /tmp/tlshd.log)@@"
echo "@READY@"
while :; do sleep 3600; done
"""

KK_CHECKS = ("kk_gen_tls_key_insert", "kk_connect_tls", "kk_handshakes", "kk_dd", "kk_disconnect",
             "kk_clear_refused_by_tls_port", "kk_no_key_refused")


def guest_script(values: dict[str, str], parts: tuple[str, ...]) -> str:
    target = vm.guest_kernel_target_script(KSUB, ((1, TLS_PORT), (2, CLEAR_PORT)), size_mib=64, tls_ports=(1,))
    tlshd = tlstools.guest_tlshd_script(TOOLS.removesuffix("/bin"), loglevel=7)
    script = GUEST_PREAMBLE + tlshd + target + "".join(parts) + GUEST_END.replace("@READY@", READY)
    values = {"@TOOLS@": TOOLS, "@KSUB@": shlex.quote(KSUB), "@TLS_PORT@": str(TLS_PORT), "@DD_MIB@": str(DD_MIB),
              **values}
    for key, value in values.items():
        script = script.replace(key, value)
    return script


@dataclasses.dataclass
class TlsRun:
    report: Report
    guest: vm.Guest
    tls_port: int  # host port forwarded to the guest's nvmet TLS port
    clear_port: int  # host port forwarded to the guest's clear port
    tools: tlstools.TlsTools


@pytest.fixture(scope="module")
def tls_assets(vm_assets: vm.Assets) -> vm.Assets:
    if not vm_assets.has_nvme_tls:
        pytest.skip(f"{vm_assets.kernel} has no NVMe/TCP TLS (Linux 6.7+: NVME_TCP_TLS, NVME_TARGET_TCP_TLS)")
    return vm_assets


@pytest.fixture(scope="module")
def tls_tools(tls_assets: vm.Assets) -> tlstools.TlsTools:
    try:
        return tlstools.build_tls_tools(tls_assets.cache_dir)
    except tlstools.ToolsUnavailable as exc:
        pytest.skip(f"tlshd and nvme-cli 2.13 from Debian {tlstools.SUITE} cannot be had here: {exc}")


@pytest.fixture(scope="module")
def tls_run(tls_assets: vm.Assets, tls_tools: tlstools.TlsTools, debian_rootfs: rootfs.RootfsAssets,  # noqa: F811
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRun]:
    log_dir = tmp_path_factory.mktemp("kernel-tls")
    report = Report(console=log_dir / "guest-console.log")
    kk, nokey = Identity.new(), Identity.new()
    values = {"@KK_NQN@": shlex.quote(kk.hostnqn), "@KK_ARGS@": kk.args(), "@NOKEY_ARGS@": nokey.args()}
    script = guest_script(values, (KERNEL_PART,))
    began = time.monotonic()
    tls_port, clear_port = vm.free_ports(2)
    guest = rootfs.rootfs_guest(debian_rootfs, shares={"tls": tls_tools.root},
                                hostfwd=((tls_port, TLS_PORT), (clear_port, CLEAR_PORT)))
    try:
        guest.start(script)
        report.boot_seconds = guest.boot_seconds
        try:
            guest.wait_for(READY, 600)
        except (vm.GuestExited, vm.GuestTimeout) as exc:
            report.error = exc.args[0].splitlines()[0]
        _parse_guest(guest.output, report)
        report.seconds = time.monotonic() - began
        print(f"\nkernel TLS: {report.seconds:.1f} s to the ready marker, boot {report.boot_seconds or 0:.1f} s; "
              f"tools {tls_tools.versions.get('ktls-utils')} / nvme-cli {tls_tools.versions.get('nvme-cli')}; "
              f"console {report.console}")
        for name, result in report.checks.items():
            took = f"{result.seconds:4.0f}s" if result.seconds is not None else "    -"
            print(f"  {'PASS' if result.ok else 'FAIL'} {took} {name}{'' if result.ok else ': ' + result.reason}")
        yield TlsRun(report, guest, tls_port, clear_port, tls_tools)
    finally:
        report.console.write_text(guest.output)
        guest.stop()


def test_kernel_host_and_kernel_target_over_tls(tls_run: TlsRun) -> None:
    """The referee's own stack: gen-tls-key --insert, nvme connect --tls, tls_key in sysfs, dd sha256,
    three handshakes per side (admin + 2 I/O queues), clear connect and key-less connect refused."""
    tls_run.report.assert_passed(*KK_CHECKS)
