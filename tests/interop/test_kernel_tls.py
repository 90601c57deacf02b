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

The kernel host against our target (`nvmeof serve --tls required` on the VM host): keys derived by
nvmeof.tls.psk (keyctl padd), and keys inserted by nvme-cli 2.13 itself (libnvme's compat derivation, NVMe0R01),
served for a host marked tls_compat and refused, with a log line naming the flag, for one that is not.

6.1 has no NVMe/TCP TLS (Linux 6.7+): its half skips with that reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import initiator
from initiator.queue import TransportError
from nvmeof.status import NvmeError
from nvmeof.tls.psk import TlsKey
from tests.interop import rootfs, tlstools, vm
from tests.interop.ourtarget import OurTarget, serve_target
from tests.interop.test_kernel_host import GUEST_RUN, Report, _parse_guest
from tests.interop.test_rdma_guest import debian_rootfs  # noqa: F401  (fixture)

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

KSUB = "nqn.2026-11.io.nvmeof-toolkit:kernel-tls"
OSUB = "nqn.2026-11.io.nvmeof-toolkit:tls"  # our target's subsystem
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
""" + GUEST_RUN + r"""wait_for() {  # SECONDS SHELL-CONDITION
    _i=0
    while [ $_i -lt $(( $1 * 10 )) ]; do eval "$2" && return 0; sleep 0.1; _i=$((_i + 1)); done
    return 1
}
# insert_key NAME HOSTNQN SUBNQN [KEY [IDENTITY-VERSION [HMAC]]]: `nvme gen-tls-key --insert` (a new key) or
# `check-tls-key --insert` (KEY, in the interchange format) puts the PSK into .nvme under the identity NVMe0R0N
# (version 0) or NVMe1R0N ... digest (version 1); KEY_<NAME> becomes the key id (the secret is never printed)
insert_key() {
    if [ $# -ge 4 ] && [ -n "$4" ]; then
        _out=$($T/nvme check-tls-key --keydata="$4" --hostnqn="$2" --subsysnqn="$3" --identity="${5:-0}" \
            --insert) || return 1
    else
        _out=$($T/nvme gen-tls-key --hostnqn="$2" --subsysnqn="$3" --hmac="${6:-1}" --identity="${5:-0}" \
            --insert) || return 1
        echo "$_out" | grep -q '^NVMeTLSkey-1:0[12]:' || { echo "gen-tls-key printed no NVMeTLSkey-1 key"; return 1; }
    fi
    _id=$(echo "$_out" | sed -n 's/^Inserted TLS key \([0-9a-f]*\)$/\1/p')
    [ -n "$_id" ] || { echo "nvme did not say which key it inserted"; return 1; }
    eval "KEY_$1=$_id"
    $T/keyctl show %:.nvme | grep -q "psk: NVMe${5:-0}R0[12] $2 $3" || { echo "no PSK of $2 $3 in .nvme"; return 1; }
    echo "key $_id inserted for $2 $3"
}
# raw_key NAME IDENTITY HEX: the TLS PSK as bytes under IDENTITY (keyctl padd), for keys derived by the VM host
raw_key() {
    _id=$(python3 -c 'import sys; sys.stdout.buffer.write(bytes.fromhex(sys.argv[1]))' "$3" \
        | $T/keyctl padd psk "$2" %:.nvme) || { echo "keyctl padd psk failed"; return 1; }
    eval "KEY_$1=$(printf %08x $_id)"
    echo "key $(printf %08x $_id) added as $2"
}
run_fio() {  # fio arguments; passes only with exit 0 and "err= 0"
    [ -n "$DEV" ] && [ -b "$DEV" ] || { echo "no block device (the connect check failed)"; return 1; }
    fio --name=check --filename=$DEV --ioengine=libaio --direct=1 --verify=crc32c --verify_fatal=1 \
        --group_reporting "$@" > /tmp/fio 2>&1
    _rc=$?
    cat /tmp/fio
    [ $_rc = 0 ] || { echo "fio exited $_rc"; return 1; }
    grep -q "err= 0" /tmp/fio || { echo "fio reported an error"; return 1; }
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
# a SHA-384 PSK (NVMe0R02, TLS_AES_256_GCM_SHA384)
kk_sha384() {
    insert_key KK384 @KK384_NQN@ @KSUB@ "" 0 2 || return 1
    tls_connect 127.0.0.1 @TLS_PORT@ @KSUB@ "$KEY_KK384" @KK384_ARGS@ --nr-io-queues=1 || return 1
    check_dd 4 && check_disconnect
}
run kk_sha384 kk_sha384
"""

# ---- the kernel host against OUR target (`nvmeof serve --tls required` on the VM host, 10.0.2.2)
OURS_PART = r"""
run ours_key raw_key OURS @OURS_IDENT@ @OURS_PSK@
run ours_connect_tls tls_connect @HOST_ADDR@ @OPORT@ @OSUB@ "${KEY_OURS:-none}" @OURS_ARGS@ --nr-io-queues=2
run ours_dd check_dd @DD_MIB@
run ours_fio run_fio --rw=randrw --bs=4k --iodepth=16 --size=8M --time_based=0
run ours_disconnect check_disconnect
run ours_clear_refused refused "clear connect to our --tls required listener" \
    $T/nvme connect -t tcp -a @HOST_ADDR@ -s @OPORT@ -n @OSUB@ @OURS_ARGS@
wrong_key() {
    raw_key WRONG @WRONG_IDENT@ @WRONG_PSK@ || return 1
    refused "--tls with a key our target does not hold" \
        $T/nvme connect -t tcp -a @HOST_ADDR@ -s @OPORT@ -n @OSUB@ --tls @WRONG_ARGS@
}
run ours_wrong_key_refused wrong_key
missing_key() {
    raw_key NOKEY @NOKEY_IDENT@ @NOKEY_PSK@ || return 1
    refused "--tls for a host our target has no key for" \
        $T/nvme connect -t tcp -a @HOST_ADDR@ -s @OPORT@ -n @OSUB@ --tls @NOKEY2_ARGS@
}
run ours_missing_key_refused missing_key
ours_sha384() {
    raw_key OURS384 @OURS384_IDENT@ @OURS384_PSK@ || return 1
    tls_connect @HOST_ADDR@ @OPORT@ @OSUB@ "$KEY_OURS384" @OURS384_ARGS@ --nr-io-queues=1 || return 1
    check_dd 4 && check_disconnect
}
run ours_sha384 ours_sha384
# the key as trixie's nvme-cli 2.13 (libnvme 1.13) derives it from the same configured PSK (compat encoding, an
# NVMe0R01 identity): our target serves it for a host marked tls_compat, refuses it for one that is not
run ours_nvmecli_key insert_key CLI @CLI_NQN@ @OSUB@ @CLI_KEY@ 0
cli_connect() {
    tls_connect @HOST_ADDR@ @OPORT@ @OSUB@ "${KEY_CLI:-none}" @CLI_ARGS@ --nr-io-queues=2 || return 1
    check_dd @DD_MIB@ && check_disconnect
}
run ours_nvmecli_compat_connect cli_connect
cli_plain() {
    insert_key CLIPLAIN @CLIPLAIN_NQN@ @OSUB@ @CLIPLAIN_KEY@ 0 || return 1
    refused "an nvme-cli 2.13 key for a host not marked tls_compat" \
        $T/nvme connect -t tcp -a @HOST_ADDR@ -s @OPORT@ -n @OSUB@ --tls @CLIPLAIN_ARGS@
}
run ours_nvmecli_without_compat_refused cli_plain
"""

# ---- keys of our initiator (host side, through the forwarded port) for nvmet: made on the VM host by trixie's
# `nvme gen-tls-key`, so neither end's derivation is ours
OI_PART = r"""
run oi_key_sha256_v0 insert_key OI256V0 @OI_NQN@ @KSUB@ @OI_KEY256@ 0
run oi_key_sha256_v1 insert_key OI256V1 @OI_NQN@ @KSUB@ @OI_KEY256@ 1
run oi_key_sha384_v0 insert_key OI384V0 @OI_NQN@ @KSUB@ @OI_KEY384@ 0
run oi_key_sha384_v1 insert_key OI384V1 @OI_NQN@ @KSUB@ @OI_KEY384@ 1
run oi_raw_v0 raw_key RAWV0 @RAW_IDENT_V0@ @RAW_PSK_V0@
run oi_raw_v1 raw_key RAWV1 @RAW_IDENT_V1@ @RAW_PSK_V1@
run oi_raw384_v0 raw_key RAW384V0 @RAW384_IDENT_V0@ @RAW384_PSK_V0@
run oi_raw384_v1 raw_key RAW384V1 @RAW384_IDENT_V1@ @RAW384_PSK_V1@
"""

GUEST_END = r"""
echo "@@INFO tlshd_log_lines=$(wc -l < /tmp/tlshd.log)@@"
echo "@READY@"
while :; do sleep 3600; done
"""

OURS_CHECKS = ("ours_key", "ours_connect_tls", "ours_dd", "ours_fio", "ours_disconnect")
OURS_REFUSED = ("ours_clear_refused", "ours_wrong_key_refused", "ours_missing_key_refused")
OI_RAW_CHECKS = ("oi_raw_v0", "oi_raw_v1", "oi_raw384_v0", "oi_raw384_v1")
OI_KEY_CHECKS = ("oi_key_sha256_v0", "oi_key_sha256_v1", "oi_key_sha384_v0", "oi_key_sha384_v1")
KK_CHECKS = ("kk_gen_tls_key_insert", "kk_connect_tls", "kk_handshakes", "kk_dd", "kk_disconnect",
             "kk_clear_refused_by_tls_port", "kk_no_key_refused", "kk_sha384")


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
    oi: Identity  # our initiator's identity, with these keys in the guest's .nvme keyring
    oi_keys: dict[int, str] = dataclasses.field(repr=False)  # hmac id (1: SHA-256, 2: SHA-384) -> configured PSK
    target: OurTarget  # `nvmeof serve --tls required` on the VM host
    oi_raw: Identity  # our initiator's identity whose TLS PSKs the guest got as bytes (keyctl padd)
    oi_raw_keys: dict[int, str] = dataclasses.field(repr=False)  # its configured PSKs by hmac id
    cli_plain: Identity  # a host with an nvme-cli 2.13-inserted key that our target does not mark tls_compat


def gen_tls_key(tools: tlstools.TlsTools, hmac_id: int, hostnqn: str, subnqn: str) -> str:
    """A configured PSK made by trixie's `nvme gen-tls-key` on the VM host (no --insert: no keyring here)."""
    proc = subprocess.run([str(tools.bin("nvme")), "gen-tls-key", f"--hmac={hmac_id}", f"--hostnqn={hostnqn}",
                           f"--subsysnqn={subnqn}"], capture_output=True, text=True, check=False)
    key = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and key.startswith(f"NVMeTLSkey-1:0{hmac_id}:"), (
        f"nvme gen-tls-key --hmac={hmac_id} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return key


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


def _raw(key: str, ident: Identity, subnqn: str, version: int = 0) -> tuple[str, str]:
    """(identity, TLS PSK hex) as nvmeof.tls.psk derives them (RFC 8446 HKDF-Expand-Label), for keyctl padd."""
    tk = TlsKey.parse(key)
    identity = tk.identity(ident.hostnqn, subnqn, version)
    return str(identity), tk.tls_psk(identity).hex()


def _allow(target: OurTarget, ident: Identity, key: str | None, compat: bool = False) -> None:
    body: dict[str, object] = {"hostnqn": ident.hostnqn}
    if key is not None:
        body["tls_key"] = key
    if compat:
        body["tls_compat"] = True
    target.api("POST", f"/subsystems/{OSUB}/hosts", json=body)


@pytest.fixture(scope="module")
def tls_run(tls_assets: vm.Assets, tls_tools: tlstools.TlsTools, debian_rootfs: rootfs.RootfsAssets,  # noqa: F811
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRun]:
    log_dir = tmp_path_factory.mktemp("kernel-tls")
    report = Report(console=log_dir / "guest-console.log", target_log=log_dir / "nvmeof-serve.log")
    kk, nokey, oi = Identity.new(), Identity.new(), Identity.new()
    ours, wrong, nokey2, cli, cli_plain = (Identity.new() for _ in range(5))
    kk384, ours384 = Identity.new(), Identity.new()
    ours384_key = gen_tls_key(tls_tools, 2, ours384.hostnqn, OSUB)
    ours384_ident, ours384_psk = _raw(ours384_key, ours384, OSUB)
    oi_keys = {h: gen_tls_key(tls_tools, h, oi.hostnqn, KSUB) for h in (1, 2)}
    ours_key, wrong_key, cli_key, cli_plain_key = (gen_tls_key(tls_tools, 1, i.hostnqn, OSUB)
                                                   for i in (ours, wrong, cli, cli_plain))
    ours_ident, ours_psk = _raw(ours_key, ours, OSUB)
    # the guest holds a key for `wrong` that our target does not; our target holds none at all for `nokey2`
    wrong_ident, wrong_psk = _raw(gen_tls_key(tls_tools, 1, wrong.hostnqn, OSUB), wrong, OSUB)
    nokey_ident, nokey_psk = _raw(gen_tls_key(tls_tools, 1, nokey2.hostnqn, OSUB), nokey2, OSUB)
    # a host of its own: its NVMe0R01 identity must not replace the one nvme-cli inserted for `oi`
    oi_raw = Identity.new()
    oi_raw_key = gen_tls_key(tls_tools, 1, oi_raw.hostnqn, KSUB)
    oi_raw_key384 = gen_tls_key(tls_tools, 2, oi_raw.hostnqn, KSUB)
    raw_v0 = _raw(oi_raw_key, oi_raw, KSUB, 0)
    raw_v1 = _raw(oi_raw_key, oi_raw, KSUB, 1)
    raw384_v0 = _raw(oi_raw_key384, oi_raw, KSUB, 0)
    raw384_v1 = _raw(oi_raw_key384, oi_raw, KSUB, 1)
    q = shlex.quote
    began = time.monotonic()
    with serve_target(log_dir, size="16M", extra_args=("--tls", "required"), check_clean_exit=False) as target:
        target.api("POST", "/subsystems", json={"nqn": OSUB, "allow_any_host": False})
        target.api("POST", f"/subsystems/{OSUB}/namespaces", json={"backend": "ram", "size": 64 << 20,
                                                                  "block_size": BLOCK})
        for ident, key in ((ours, ours_key), (wrong, wrong_key), (nokey2, None), (cli_plain, cli_plain_key),
                           (ours384, ours384_key)):
            _allow(target, ident, key)
        _allow(target, cli, cli_key, compat=True)   # its key is nvme-cli 2.13's NVMe0R01 (compat derivation)
        values = {"@KK_NQN@": q(kk.hostnqn), "@KK_ARGS@": kk.args(), "@NOKEY_ARGS@": nokey.args(),
                  "@OI_NQN@": q(oi.hostnqn), "@OI_KEY256@": q(oi_keys[1]), "@OI_KEY384@": q(oi_keys[2]),
                  "@RAW_IDENT_V0@": q(raw_v0[0]), "@RAW_PSK_V0@": raw_v0[1],
                  "@RAW_IDENT_V1@": q(raw_v1[0]), "@RAW_PSK_V1@": raw_v1[1],
                  "@RAW384_IDENT_V0@": q(raw384_v0[0]), "@RAW384_PSK_V0@": raw384_v0[1],
                  "@RAW384_IDENT_V1@": q(raw384_v1[0]), "@RAW384_PSK_V1@": raw384_v1[1],
                  "@HOST_ADDR@": vm.HOST_ADDR, "@OPORT@": str(target.io_port), "@OSUB@": q(OSUB),
                  "@OURS_IDENT@": q(ours_ident), "@OURS_PSK@": ours_psk, "@OURS_ARGS@": ours.args(),
                  "@WRONG_IDENT@": q(wrong_ident), "@WRONG_PSK@": wrong_psk, "@WRONG_ARGS@": wrong.args(),
                  "@NOKEY_IDENT@": q(nokey_ident), "@NOKEY_PSK@": nokey_psk, "@NOKEY2_ARGS@": nokey2.args(),
                  "@CLI_NQN@": q(cli.hostnqn), "@CLI_KEY@": q(cli_key), "@CLI_ARGS@": cli.args(),
                  "@CLIPLAIN_NQN@": q(cli_plain.hostnqn), "@CLIPLAIN_KEY@": q(cli_plain_key),
                  "@CLIPLAIN_ARGS@": cli_plain.args(),
                  "@KK384_NQN@": q(kk384.hostnqn), "@KK384_ARGS@": kk384.args(),
                  "@OURS384_IDENT@": q(ours384_ident), "@OURS384_PSK@": ours384_psk, "@OURS384_ARGS@": ours384.args()}
        script = guest_script(values, (KERNEL_PART, OURS_PART, OI_PART))
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
            report.print_summary("kernel TLS", detail=f"; tools {tls_tools.versions.get('ktls-utils')} / nvme-cli "
                                 f"{tls_tools.versions.get('nvme-cli')}; target log {report.target_log}")
            yield TlsRun(report, guest, tls_port, clear_port, tls_tools, oi, oi_keys, target, oi_raw,
                         {1: oi_raw_key, 2: oi_raw_key384}, cli_plain)
        finally:
            report.console.write_text(guest.output)
            guest.stop()


def test_kernel_host_and_kernel_target_over_tls(tls_run: TlsRun) -> None:
    """The referee's own stack: gen-tls-key --insert, nvme connect --tls, tls_key in sysfs, dd sha256,
    three handshakes per side (admin + 2 I/O queues), clear connect and key-less connect refused."""
    tls_run.report.assert_passed(*KK_CHECKS)


# ---- our initiator (on the VM host) against nvmet-tcp + tlshd in the guest, through the forwarded ports

BLOCK = 512


def _connect(run: TlsRun, *, port: int | None = None, key: str | None = None, version: int = 1,
             nr_io_queues: int = 2, ident: Identity | None = None, compat: bool = False,
             sha256_binder: bool = False) -> Any:
    ident = ident or run.oi
    return initiator.connect("127.0.0.1", port or run.tls_port, KSUB, hostnqn=ident.hostnqn, hostid=ident.hostid,
                             nr_io_queues=nr_io_queues, timeout=60, tls_key=key, tls_identity_version=version,
                             **({"tls_compat": True} if compat else {}),
                             **({"tls_sha256_binder": True} if sha256_binder else {}))


# tlshd 1.0.0 as the server (nvmet's handshakes) takes every PSK with a SHA-256 binder and a SHA-256 suite: GnuTLS
# before 3.8.11 (trixie: 3.8.9) cannot bind an external PSK to SHA-384 (gnutls_psk_allocate_server_credentials2 is
# 3.8.11's), so tlshd to tlshd (kk_sha384) negotiates CHACHA20-POLY1305-SHA256 for a SHA-384 PSK. Our host binds it
# to SHA-384 and offers TLS_AES_256_GCM_SHA384 as TP 8011 says, which tlshd refuses (GnuTLS -55, illegal parameter)
# unless the host is told tls_sha256_binder=True: the SHA-384 rows below pass it, and
# test_initiator_sha384_without_sha256_binder_is_refused keeps the default's refusal shown.
HASH_CASES = [(1, 0), (1, 1), (2, 0), (2, 1)]
HASH_IDS = ["sha256-NVMe0R", "sha256-NVMe1R", "sha384-NVMe0R", "sha384-NVMe1R"]


@pytest.mark.parametrize(("hmac_id", "version"), HASH_CASES, ids=HASH_IDS)
async def test_initiator_over_tls_against_kernel_target(tls_run: TlsRun, hmac_id: int, version: int) -> None:
    """The TLS PSK (as nvmeof.tls.psk derives it) under the identity our initiator offers, added with keyctl:
    connect through tlshd (a SHA-384 key with tls_sha256_binder), identify, write/read 1 MiB (sha256), flush."""
    tls_run.report.assert_passed(*OI_RAW_CHECKS)
    async with _connect(tls_run, key=tls_run.oi_raw_keys[hmac_id], version=version, ident=tls_run.oi_raw,
                        sha256_binder=hmac_id == 2) as ctrl:
        assert {q._tls.cipher_name for q in [ctrl.admin, *ctrl.io_queues]} <= {
            "TLS_AES_128_GCM_SHA256", "TLS_CHACHA20_POLY1305_SHA256"}
        await _identify_and_rw(ctrl, 4 + (hmac_id - 1) * 2 + version)


@pytest.mark.parametrize("version", [0, 1], ids=["NVMe0R", "NVMe1R"])
async def test_initiator_sha384_without_sha256_binder_is_refused(tls_run: TlsRun, version: int) -> None:
    """The default (TP 8011: a SHA-384 PSK bound to SHA-384, TLS_AES_256_GCM_SHA384) against tlshd on GnuTLS 3.8.9:
    refused, the reason tls_sha256_binder exists. Should tlshd learn SHA-384 binders, this fails and says so."""
    tls_run.report.assert_passed(*OI_RAW_CHECKS)
    with pytest.raises(TransportError, match="qid 0"):
        async with _connect(tls_run, key=tls_run.oi_raw_keys[2], version=version, ident=tls_run.oi_raw,
                            nr_io_queues=1):
            pass


@pytest.mark.parametrize(("hmac_id", "version"), [(1, 0), (1, 1), (2, 0), (2, 1)],
                         ids=["sha256-NVMe0R", "sha256-NVMe1R", "sha384-NVMe0R", "sha384-NVMe1R"])
async def test_initiator_refused_with_nvme_cli_2_13_derived_keys(tls_run: TlsRun, hmac_id: int, version: int) -> None:
    """What is, today: with the keyring's key inserted by trixie's `nvme check-tls-key --insert` (libnvme 1.13's
    derivation, see test_nvme_cli_2_13_derived_key_is_not_ours) the handshake fails for every hash and identity
    version (NVMe1R: tlshd finds no key for our digest; NVMe0R: the binder does not verify)."""
    tls_run.report.assert_passed(*OI_KEY_CHECKS)
    with pytest.raises(TransportError, match="qid 0"):
        async with _connect(tls_run, key=tls_run.oi_keys[hmac_id], version=version, nr_io_queues=1):
            pass


@pytest.mark.parametrize(("hmac_id", "version"), HASH_CASES, ids=HASH_IDS)
async def test_initiator_tls_compat_with_nvme_cli_2_13_derived_keys(tls_run: TlsRun, hmac_id: int,
                                                                    version: int) -> None:
    """The same keys with ``tls_compat=True`` (libnvme's derivation without the length prefixes; a SHA-384 key with
    tls_sha256_binder): connect through tlshd, identify, write/read 1 MiB (sha256), flush."""
    tls_run.report.assert_passed(*OI_KEY_CHECKS)
    async with _connect(tls_run, key=tls_run.oi_keys[hmac_id], version=version, compat=True,
                        sha256_binder=hmac_id == 2) as ctrl:
        await _identify_and_rw(ctrl, 8 + (hmac_id - 1) * 2 + version)


async def _identify_and_rw(ctrl: Any, slot: int) -> None:
    idc = await ctrl.identify_controller()
    assert idc.subnqn == KSUB
    ns = await ctrl.identify_namespace(1)
    assert ns.nsze * BLOCK == 64 << 20
    data = os.urandom(1 << 20)
    slba = slot * (len(data) // BLOCK)
    await ctrl.write(1, slba, data)
    back = await ctrl.read(1, slba, len(data) // BLOCK)
    assert hashlib.sha256(bytes(back)).hexdigest() == hashlib.sha256(data).hexdigest()
    await ctrl.flush(1)


async def test_initiator_refused_by_kernel_target(tls_run: TlsRun) -> None:
    """A key the keyring does not hold for our identity, clear NVMe/TCP to the TLS port and TLS to the clear
    port: each refused, and a good connect still works after them."""
    tls_run.report.assert_passed(*OI_RAW_CHECKS)
    wrong = gen_tls_key(tls_run.tools, 1, tls_run.oi_raw.hostnqn, KSUB)
    problems = []
    # version 0: the identity (NVMe0R01 host subsystem) is the one the keyring holds, only the key differs
    for name, kwargs in (("wrong key", {"key": wrong, "version": 0}),
                         ("clear to the TLS port", {"key": None}),
                         ("TLS to the clear port", {"key": tls_run.oi_raw_keys[1], "port": tls_run.clear_port})):
        try:
            async with _connect(tls_run, nr_io_queues=1, ident=tls_run.oi_raw, **kwargs):  # type: ignore[arg-type]
                problems.append(f"{name}: the connect succeeded")
        except (TransportError, NvmeError, OSError, TimeoutError) as exc:
            print(f"{name}: refused: {type(exc).__name__}: {exc}")
    assert not problems, problems
    async with _connect(tls_run, key=tls_run.oi_raw_keys[1], nr_io_queues=1, ident=tls_run.oi_raw) as ctrl:
        assert (await ctrl.identify_controller()).subnqn == KSUB


# ---- the kernel host against our target


def test_kernel_host_against_our_target_over_tls(tls_run: TlsRun) -> None:
    """nvme connect --tls to `nvmeof serve --tls required` with the host's key configured over REST and the same
    TLS PSK in the guest's .nvme keyring: 2 I/O queues, dd 16 MiB sha256, fio randrw verify, disconnect."""
    tls_run.report.assert_passed(*OURS_CHECKS)


def test_our_target_refuses_clear_wrong_and_missing_keys(tls_run: TlsRun) -> None:
    """A clear nvme connect, a key our target does not hold and a host our target has no key for: refused."""
    tls_run.report.assert_passed(*OURS_REFUSED)
    assert not [c for c in tls_run.target.controllers() if c["subnqn"] == OSUB]


def test_kernel_host_sha384_against_our_target(tls_run: TlsRun) -> None:
    """nvme connect --tls with a SHA-384 PSK (NVMe0R02) to our target: dd 4 MiB sha256, disconnect. tlshd
    (GnuTLS 3.8.9) binds the PSK to SHA-256 and offers no TLS_AES_128_GCM_SHA256 for it; our target sees the
    32-byte binder and takes the PSK with TLS_CHACHA20_POLY1305_SHA256 (nvmeof/tls/openssl.py), logging why."""
    tls_run.report.assert_passed("ours_sha384")
    assert "SHA-256 binder" in tls_run.target.log_text()


def test_kernel_host_with_nvme_cli_2_13_key_and_tls_compat(tls_run: TlsRun) -> None:
    """Debian trixie's nvme-cli 2.13 / libnvme 1.13 insert the kernel host's key derived with HKDF-Expand-Label
    *without* RFC 8446's length prefixes (nvmeof.tls.psk's ``compat``) under an NVMe0R01 identity, which carries no
    digest to tell the derivation by (Linux 6.12's nvme_tls_psk_default looks up NVMe0R identities only). With the
    host marked tls_compat on our target: nvme connect --tls, 2 I/O queues, dd 16 MiB sha256, disconnect."""
    tls_run.report.assert_passed("ours_nvmecli_key", "ours_nvmecli_compat_connect")
    # the NVMe1R digest nvme-cli prints is the compat derivation's, not the RFC one: the derivation is nvme-cli's
    ident = Identity.new()
    key = gen_tls_key(tls_run.tools, 1, ident.hostnqn, OSUB)
    proc = subprocess.run([str(tls_run.tools.bin("nvme")), "check-tls-key", f"--keydata={key}",
                           f"--hostnqn={ident.hostnqn}", f"--subsysnqn={OSUB}", "--identity=1"],
                          capture_output=True, text=True, check=True)
    printed = proc.stdout.strip().splitlines()[-1]
    tk = TlsKey.parse(key)
    assert printed == str(tk.identity(ident.hostnqn, OSUB, 1, compat=True))
    assert printed != str(tk.identity(ident.hostnqn, OSUB, 1))


def test_nvme_cli_2_13_key_without_tls_compat_is_refused_with_the_cause(tls_run: TlsRun) -> None:
    """The same kind of key for a host not marked tls_compat: refused (the binder does not verify), and the
    target's one log line for it names the likely cause and the flag to set (and never the key)."""
    tls_run.report.assert_passed("ours_nvmecli_without_compat_refused")
    host = tls_run.cli_plain.hostnqn
    lines = [line for line in tls_run.target.log_lines("WARNING") if "TLS handshake" in line and host in line]
    assert lines, f"no TLS handshake refusal naming {host} in {tls_run.target.log_path}"
    assert all("--tls-compat" in line and "libnvme" in line for line in lines), lines
