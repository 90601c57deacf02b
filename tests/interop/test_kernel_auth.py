"""DH-HMAC-CHAP (NVMe in-band authentication) refereed by the Linux 6.12 kernel, in both directions.

1. The kernel host (`nvme connect --dhchap-secret [--dhchap-ctrl-secret]`, nvme-cli) against our
   `nvmeof serve`, ONE guest boot for every case: each hash (SHA-256/384/512) with each of the DH
   groups null, ffdhe2048 and ffdhe4096, unidirectional and bidirectional, the combination forced by
   allowing only it for that host on our side (the kernel offers every hash and group) and read back
   from the kernel's "qid 0: authenticated with hash hmac(...) dhgroup ..." and our log; dd + sha256 and
   fio verify over an authenticated connection; a wrong host key, a wrong controller key, a missing
   key and an unlisted host refused (our log names the host and the reason); re-authentication:
   `nvme connect` again, and, after the key was rotated over our REST API (the connected controller
   stays), the new key written to the controller's sysfs `dhchap_secret`, after which the old key is
   refused.  Keys come from `nvmeof.auth.generate_secret`; `nvme gen-dhchap-key` in the guest must give
   the very same secret for the same key bytes, hash and NQN.
2. Our initiator against the kernel target (nvmet configfs `hosts/<nqn>/dhchap_key`,
   `dhchap_ctrl_key`, `dhchap_hash`, `dhchap_dhgroup`), ONE guest boot: both directions for every hash
   and group above, I/O, refused with a wrong host key and a wrong controller key, and re-authentication
   after the kernel target's key was rotated in configfs.

Debian's 6.1 kernel has no in-band authentication (no NVME_HOST_AUTH / NVME_TARGET_AUTH): every test
here skips on it with that reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import shlex
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import initiator
from initiator.queue import TransportError
from nvmeof.auth import AuthFailure, generate_secret
from nvmeof.status import NvmeError
from tests.interop import vm
from tests.interop.ourtarget import OurTarget, serve_target
from tests.interop.test_kernel_host import GUEST_PREAMBLE, Barrier, Report, guest_script_text, run_guest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

AUTH_NQN = "nqn.2026-11.io.nvmeof-toolkit:auth"
KT_NQN = "nqn.2026-11.io.nvmeof-toolkit:kernel-auth"
BLOCK = 512
TARGET_SIZE = 64 << 20
HASHES = ("sha256", "sha384", "sha512")
DHGROUPS = ("null", "ffdhe2048", "ffdhe4096")
# nvme gen-dhchap-key: the key length each transformation hash requires (32 for "none" by default)
KEY_LEN = {0: 32, 1: 32, 2: 48, 3: 64}
STEP_TIMEOUT = 300.0  # the longest stretch between two host steps (the 18-case matrix under TCG)


@pytest.fixture(scope="module")
def auth_assets(vm_assets: vm.Assets) -> vm.Assets:
    if not vm_assets.has_inband_auth:
        pytest.skip(f"{vm_assets.kernel} has no NVMe in-band authentication")
    return vm_assets


@dataclasses.dataclass(frozen=True)
class Host:
    """One host identity (NQN and ID from one UUID, as `nvme gen-hostnqn` makes them) and its keys."""

    hostnqn: str
    hostid: str
    key: str = dataclasses.field(repr=False)
    ctrl_key: str | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def new(cls, hmac_id: int = 0, *, bidirectional: bool = False, key_len: int | None = None) -> Host:
        u = uuid.uuid4()
        nqn = f"nqn.2014-08.org.nvmexpress:uuid:{u}"
        length = key_len or KEY_LEN[hmac_id]
        key = generate_secret(key_len=length, hmac_id=hmac_id, nqn=nqn)
        ctrl = generate_secret(key_len=KEY_LEN[(hmac_id + 1) % 4], hmac_id=(hmac_id + 1) % 4, nqn=nqn) \
            if bidirectional else None
        return cls(nqn, str(u), key, ctrl)

    def args(self, *, key: str | None = "", ctrl_key: str | None = "") -> str:
        """nvme connect options for this host; key / ctrl_key override its own ("" keeps, None drops)."""
        k = self.key if key == "" else key
        c = self.ctrl_key if ctrl_key == "" else ctrl_key
        out = f"--hostnqn={shlex.quote(self.hostnqn)} --hostid={self.hostid}"
        if k is not None:
            out += f" --dhchap-secret={shlex.quote(k)}"
        if c is not None:
            out += f" --dhchap-ctrl-secret={shlex.quote(c)}"
        return out


def _other_key(hmac_id: int = 0) -> str:
    return generate_secret(key_len=KEY_LEN[hmac_id], hmac_id=hmac_id, nqn="nqn.2014-08.org.nvmexpress:uuid:other")


# =============================================================================== 1. kernel host -> our target

@dataclasses.dataclass(frozen=True)
class MatrixCase:
    name: str
    hash: str
    dhgroup: str
    host: Host

    @property
    def bidirectional(self) -> bool:
        return self.host.ctrl_key is not None


def _matrix() -> list[MatrixCase]:
    cases = []
    for i, (h, g, bi) in enumerate((h, g, bi) for bi in (False, True) for h in HASHES for g in DHGROUPS):
        # every transformation hash of the secret (DHHC-1:00..03) appears, and every key length
        hmac_id = i % 4
        host = Host.new(hmac_id, bidirectional=bi, key_len=(32, 48, 64)[i % 3] if hmac_id == 0 else None)
        cases.append(MatrixCase(f"auth_{h}_{g}_{'bi' if bi else 'uni'}", h, g, host))
    return cases


KERNEL_HOST_SCRIPT = GUEST_PREAMBLE + r"""
T=@HOST_ADDR@; IOP=@IOP@; NQN=@NQN@; GO=http://@HOST_ADDR@:@GOP@/

# auth_dmesg HASH GROUP BIDIRECTIONAL: the kernel's own account of the admin queue's transaction
# (nvme_queue_auth_work: "qid 0: authenticated with hash ... dhgroup ...", "qid 0: controller authenticated")
auth_dmesg() {
    dmesg | grep -q "$CTRL: qid 0: authenticated with hash hmac($1) dhgroup $2\$" || {
        dmesg | grep -i -e auth -e dhchap | tail -n 10
        echo "dmesg does not say $CTRL qid 0 authenticated with hash hmac($1) dhgroup $2"; return 1; }
    if [ "$3" = 1 ]; then
        dmesg | grep -q "$CTRL: qid 0: controller authenticated" || {
            echo "dmesg does not say $CTRL qid 0: controller authenticated (bidirectional)"; return 1; }
    fi
    ! dmesg | grep -q "authentication failed" || { echo "dmesg reports an authentication failure"; return 1; }
}

# check_auth HASH GROUP BIDIRECTIONAL CONNECT-ARGS...: connect, check what was negotiated, read through
# the (authenticated) I/O queue, disconnect
check_auth() {
    _h=$1; _g=$2; _b=$3; shift 3
    connect $IOP --nr-io-queues 1 "$@" || return 1
    _rc=0
    auth_dmesg $_h $_g $_b || _rc=1
    dd if=$DEV of=/dev/null bs=4k count=64 iflag=direct || { echo "a read through the I/O queue failed"; _rc=1; }
    check_disconnect || _rc=1
    return $_rc
}

# check_refused DMESG-PATTERN CONNECT-ARGS...: nvme connect must fail (and leave no controller); the
# kernel's messages must match DMESG-PATTERN (grep -E; "" for any)
check_refused() {
    _pat=$1; shift
    dmesg -c > /dev/null
    _before=$(ls /sys/class/nvme 2>/dev/null | wc -l)
    if nvme connect -t tcp -a $T -s $IOP -n $NQN --nr-io-queues 1 "$@" > /tmp/refused 2>&1; then
        cat /tmp/refused
        nvme disconnect -n $NQN > /dev/null 2>&1
        echo "nvme connect succeeded where it must be refused"; return 1
    fi
    cat /tmp/refused
    dmesg | grep -i nvme | tail -n 12
    if [ -n "$_pat" ]; then
        dmesg | grep -Eq "$_pat" || { echo "dmesg has no line matching '$_pat'"; return 1; }
    fi
    wait_for 10 '[ "$(ls /sys/class/nvme 2>/dev/null | wc -l)" = "$_before" ]' || {
        echo "a controller was left behind by the refused connect"; return 1; }
}

# check_gen_key HEX HMAC LEN NQN EXPECTED: nvme gen-dhchap-key gives what nvmeof.auth.generate_secret gave
check_gen_key() {
    _got=$(nvme gen-dhchap-key --secret=$1 --hmac=$2 --key-length=$3 --nqn=$4) || {
        echo "nvme gen-dhchap-key exited $?"; return 1; }
    [ "$_got" = "$5" ] || { echo "nvme gen-dhchap-key --hmac=$2 made another secret than generate_secret"; return 1; }
}

# ---- the rotation host: re-authentication on a live controller
check_reauth_connect() {
    connect $IOP "$@" || return 1
    auth_dmesg @R_HASH@ @R_GROUP@ 1 || return 1
    echo "$(cat /sys/class/nvme/$CTRL/cntlid)" > /tmp/r_cntlid
}
check_sysfs_reauth() {  # NEW-KEY: written to the controller's dhchap_secret; the same controller re-authenticates
    need_dev || return 1
    dmesg -c > /dev/null
    printf %s "$1" > /sys/class/nvme/$CTRL/dhchap_secret || { echo "writing $CTRL/dhchap_secret failed"; return 1; }
    wait_for 60 'dmesg | grep -q "$CTRL: qid 0: authenticated with hash"' || {
        dmesg | tail -n 20; echo "no new qid 0 authentication within 60 s of the dhchap_secret write"; return 1; }
    dmesg | grep -i -e auth -e nvme | tail -n 12
    dmesg | grep -q "re-authenticating controller" || {
        echo "dmesg does not say re-authenticating controller"; return 1; }
    sleep 2  # the I/O queues re-authenticate after the admin queue (nvme_ctrl_auth_work)
    ! dmesg | grep -Eq "authentication failed|error recovery|Reconnecting" || {
        echo "the re-authentication failed or the controller was reset"; return 1; }
    [ "$(cat /sys/class/nvme/$CTRL/dhchap_secret)" = "$1" ] || {
        echo "$CTRL/dhchap_secret does not read back"; return 1; }
    [ "$(cat /sys/class/nvme/$CTRL/cntlid)" = "$(cat /tmp/r_cntlid)" ] || {
        echo "cntlid changed: a new controller"; return 1; }
    [ "$(cat /sys/class/nvme/$CTRL/state)" = live ] || { echo "$CTRL is $(cat /sys/class/nvme/$CTRL/state)"; return 1; }
}
check_data_kept() {  # the 16 MiB written before are still there
    need_dev || return 1
    [ "$(dd if=$DEV bs=1M count=16 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)" = "$(cat /tmp/r_sum)" ] || {
        echo "the 16 MiB read back differ from what was written before"; return 1; }
}
check_dd_keep() {
    check_dd 16 || return 1
    # check_dd removed its data file; remember what the device holds now
    dd if=$DEV bs=1M count=16 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1 > /tmp/r_sum
}

@GENKEY_RUNS@

# ---- the matrix: every hash x {null, ffdhe2048, ffdhe4096}, uni- and bidirectional
@MATRIX_RUNS@

# ---- refusals
run refused_wrong_host_key check_refused "authentication failed|error -129|rejected" @WRONG_KEY_ARGS@
run refused_wrong_ctrl_key check_refused "authentication failed|controller authentication|rejected" @WRONG_CTRL_ARGS@
run refused_no_key check_refused "" @NO_KEY_ARGS@
run refused_unlisted_host check_refused "" @UNLISTED_ARGS@

# ---- I/O and re-authentication on one bidirectional controller (2 I/O queues)
run reauth_connect check_reauth_connect @R_ARGS@
run reauth_dd_16mib_sha256 check_dd_keep
run reauth_fio_verify run_fio --rw=randrw --bs=4k --iodepth=16 --size=4M --offset=32M --numjobs=2 \
    --offset_increment=4M --cpus_allowed=0-1 --cpus_allowed_policy=split
run reauth_disconnect check_disconnect
run reauth_connect_again check_reauth_connect @R_ARGS@
run reauth_data_kept check_data_kept
run reauth_rotate_step host_step rotate
run reauth_io_after_rotation check_data_kept
run reauth_sysfs_new_key check_sysfs_reauth @R_NEW_KEY@
run reauth_data_after_sysfs check_data_kept
run reauth_fio_after_sysfs run_fio --rw=randrw --bs=4k --iodepth=16 --size=4M --offset=48M
run reauth_disconnect_2 check_disconnect
run reauth_old_key_refused check_refused "authentication failed|error -129|rejected" @R_ARGS@
run reauth_new_key_connect check_reauth_connect @R_NEW_ARGS@
run reauth_disconnect_3 check_disconnect
""" + r"""
echo "@@HOST all-disconnected@@"
await_host done || echo "the test did not finish its last checks"
exit 0
"""

REAUTH_GUEST_CHECKS = (
    "reauth_connect", "reauth_dd_16mib_sha256", "reauth_fio_verify", "reauth_disconnect", "reauth_connect_again",
    "reauth_data_kept", "reauth_rotate_step", "reauth_io_after_rotation", "reauth_sysfs_new_key",
    "reauth_data_after_sysfs", "reauth_fio_after_sysfs", "reauth_disconnect_2", "reauth_old_key_refused",
    "reauth_new_key_connect", "reauth_disconnect_3",
)
REFUSAL_CHECKS = ("refused_wrong_host_key", "refused_wrong_ctrl_key", "refused_no_key", "refused_unlisted_host")
GENKEY_CHECKS = tuple(f"gen_dhchap_key_hmac{n}" for n in range(4))


@dataclasses.dataclass
class KernelHostRun:
    report: Report
    matrix: list[MatrixCase]
    hosts: dict[str, Host]  # "wrong" (refused with another host key), "bi" (another controller key), "rotate"
    log_text: str


def _allow(target: OurTarget, host: Host, hashes: list[str] | None = None, groups: list[str] | None = None) -> None:
    body: dict[str, object] = {"hostnqn": host.hostnqn, "dhchap_key": host.key}
    if host.ctrl_key is not None:
        body["dhchap_ctrl_key"] = host.ctrl_key
    if hashes is not None:
        body["dhchap_hash"] = hashes
    if groups is not None:
        body["dhchap_dhgroup"] = groups
    target.api("POST", f"/subsystems/{AUTH_NQN}/hosts", json=body)


def _our_auth_lines(log: str, hostnqn: str, qid: int) -> list[str]:
    """target/auth.py's "host H authenticated qid Q of controller C (subsystem S; hash, group[, bidirectional])"."""
    return [line for line in log.splitlines() if f"host {hostnqn} authenticated qid {qid} " in line]


def _kernel_host_script(target: OurTarget, go_port: int, matrix: list[MatrixCase], hosts: dict[str, Host],
                        new_key: str) -> str:
    genkey = []
    for hmac_id in range(4):
        raw = os.urandom(KEY_LEN[hmac_id])
        nqn = hosts["rotate"].hostnqn
        expected = generate_secret(key_len=len(raw), hmac_id=hmac_id, nqn=nqn, secret=raw)
        genkey.append(f"run gen_dhchap_key_hmac{hmac_id} check_gen_key {raw.hex()} {hmac_id} {len(raw)} "
                      f"{shlex.quote(nqn)} {shlex.quote(expected)}")
    runs = [f"run {c.name} check_auth {c.hash} {c.dhgroup} {int(c.bidirectional)} {c.host.args()}" for c in matrix]
    wrong, bi = hosts["wrong"], hosts["bi"]
    r = hosts["rotate"]
    unlisted = Host.new(1)
    values = {
        "@IOP@": str(target.io_port), "@GOP@": str(go_port),
        "@GENKEY_RUNS@": "\n".join(genkey), "@MATRIX_RUNS@": "\n".join(runs),
        "@WRONG_KEY_ARGS@": wrong.args(key=_other_key(1)),
        "@WRONG_CTRL_ARGS@": bi.args(ctrl_key=_other_key(2)),
        "@NO_KEY_ARGS@": wrong.args(key=None),
        "@UNLISTED_ARGS@": unlisted.args(),
        "@R_ARGS@": r.args(), "@R_NEW_ARGS@": r.args(key=new_key), "@R_NEW_KEY@": shlex.quote(new_key),
        "@R_HASH@": "sha512", "@R_GROUP@": "ffdhe2048",
    }
    return guest_script_text(KERNEL_HOST_SCRIPT, AUTH_NQN, values)


def _host_step(name: str, target: OurTarget, barrier: Barrier, report: Report, rotate: Host, new_key: str) -> bool:
    if name == "rotate":
        before = [c for c in target.controllers() if c["hostnqn"] == rotate.hostnqn]
        target.api("PATCH", f"/subsystems/{AUTH_NQN}/hosts/{rotate.hostnqn}", json={"dhchap_key": new_key})
        shown = target.api("GET", f"/subsystems/{AUTH_NQN}/hosts/{rotate.hostnqn}")
        after = [c for c in target.controllers() if c["hostnqn"] == rotate.hostnqn]
        report.record("rest_rotation_keeps_controller", bool(before) and [c["cntlid"] for c in after]
                      == [c["cntlid"] for c in before], f"controllers before {before}, after the key change {after}")
        report.record("rest_never_shows_secret", shown.get("dhchap_key") is True and new_key not in str(shown)
                      and rotate.key not in str(shown), f"GET host answered {sorted(shown)} (must flag, not show)")
        barrier.release("rotate")
        return False
    if name == "all-disconnected":
        deadline = time.monotonic() + 10
        while target.controllers() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = target.controllers()
        report.record("no_leaked_controller", not left, f"controllers left after the last disconnect: {left}")
        barrier.release("done")
        return True
    raise AssertionError(f"the guest script asked for an unknown host step {name!r}")


@pytest.fixture(scope="module")
def kernel_host_run(auth_assets: vm.Assets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelHostRun]:
    log_dir = tmp_path_factory.mktemp("kernel-auth-host")
    report = Report(console=log_dir / "guest-console.log", target_log=log_dir / "nvmeof-serve.log")
    matrix = _matrix()
    hosts = {"wrong": Host.new(1), "bi": Host.new(2, bidirectional=True), "rotate": Host.new(3, bidirectional=True)}
    new_key = generate_secret(key_len=48, hmac_id=2, nqn=hosts["rotate"].hostnqn)
    began = time.monotonic()
    barrier = Barrier()
    try:
        with serve_target(log_dir, size="16M", block_size=BLOCK, check_clean_exit=False) as target:
            target.api("POST", "/subsystems", json={"nqn": AUTH_NQN, "allow_any_host": False})
            target.api("POST", f"/subsystems/{AUTH_NQN}/namespaces",
                       json={"backend": "ram", "size": TARGET_SIZE, "block_size": BLOCK})
            for case in matrix:
                _allow(target, case.host, [case.hash], [case.dhgroup])
            _allow(target, hosts["wrong"])
            _allow(target, hosts["bi"])
            _allow(target, hosts["rotate"], ["sha512"], ["ffdhe2048"])
            guest = vm.Guest(auth_assets, fio=True)
            run_guest(guest, _kernel_host_script(target, barrier.port, matrix, hosts, new_key), report,
                      lambda step: _host_step(step, target, barrier, report, hosts["rotate"], new_key),
                      step_timeout=STEP_TIMEOUT)
            proc = target.proc
    finally:
        barrier.close()
    report.record("target_clean_exit", proc.returncode == 0, f"nvmeof serve exited {proc.returncode} on SIGTERM")
    log_text = target.log_text()
    report.seconds = time.monotonic() - began
    report.print_summary("kernel host auth", detail=f"; target log {report.target_log}")
    yield KernelHostRun(report, matrix, hosts, log_text)


def test_gen_dhchap_key_matches_nvme_cli(kernel_host_run: KernelHostRun) -> None:
    kernel_host_run.report.assert_passed(*GENKEY_CHECKS)


@pytest.mark.parametrize("direction", ["uni", "bi"])
def test_kernel_host_every_hash_and_group(kernel_host_run: KernelHostRun, direction: str) -> None:
    cases = [c for c in kernel_host_run.matrix if c.name.endswith("_" + direction)]
    assert len(cases) == len(HASHES) * len(DHGROUPS)
    kernel_host_run.report.assert_passed(*(c.name for c in cases))
    # Our side agrees: admin and I/O queue authenticated with the one allowed hash and group.
    problems = []
    for c in cases:
        admin = _our_auth_lines(kernel_host_run.log_text, c.host.hostnqn, 0)
        io = _our_auth_lines(kernel_host_run.log_text, c.host.hostnqn, 1)
        want = f"; {c.hash}, {c.dhgroup}{', bidirectional' if c.bidirectional else ')'}"
        if len(admin) != 1 or want not in admin[0]:
            problems.append(f"{c.name}: our log's qid 0 lines {admin}, expected one with {want!r}")
        if len(io) != 1:
            problems.append(f"{c.name}: our log has {len(io)} 'authenticated qid 1' lines, expected 1")
    assert not problems, "\n".join(problems) + f"\ntarget log: {kernel_host_run.report.target_log}"


def test_kernel_host_refused(kernel_host_run: KernelHostRun) -> None:
    kernel_host_run.report.assert_passed(*REFUSAL_CHECKS)
    refusals = [line for line in kernel_host_run.log_text.splitlines() if "authentication refused: host " in line]
    problems = []
    for label, hostnqn in (("wrong host key", kernel_host_run.hosts["wrong"].hostnqn),
                           ("wrong controller key", kernel_host_run.hosts["bi"].hostnqn)):
        mine = [line for line in refusals if f"host {hostnqn}," in line]
        if not mine:
            problems.append(f"{label}: no 'authentication refused: host {hostnqn}, ...' line in our log")
        elif not re.search(r"cntlid \d+: \S", mine[0]):
            problems.append(f"{label}: our refusal names no reason: {mine[0]}")
    assert not problems, "\n".join(problems) + f"\nrefusal lines: {refusals}\ntarget log: " \
        f"{kernel_host_run.report.target_log}"


def test_kernel_host_io_and_reauthentication(kernel_host_run: KernelHostRun) -> None:
    kernel_host_run.report.assert_passed(*REAUTH_GUEST_CHECKS, "rest_rotation_keeps_controller",
                                         "rest_never_shows_secret")


def test_kernel_host_leaves_clean_target(kernel_host_run: KernelHostRun) -> None:
    kernel_host_run.report.assert_passed("no_leaked_controller", "target_clean_exit")
    for secret_line in re.findall(r"DHHC-1:\d\d:[A-Za-z0-9+/=]{20,}:", kernel_host_run.log_text):
        pytest.fail(f"our log shows a secret: {secret_line[:14]}...")
    errors = [line for line in kernel_host_run.log_text.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not errors, "target log has errors:\n" + "\n".join(errors[:30])


# =============================================================================== 2. our initiator -> kernel target

_KT_READY = "@@KERNEL-AUTH-TARGET-READY@@"
_KT_ROTATED = "@@KERNEL-AUTH-TARGET-ROTATED@@"


@dataclasses.dataclass
class KernelAuthTarget:
    port: int
    guest: vm.Guest
    cases: list[tuple[str, str, str, Host]]  # (name, hash, group, host): uni and bidirectional
    wrong: Host
    rotate: Host
    new_key: str
    barrier: Barrier


def _kt_cases() -> list[tuple[str, str, str, Host]]:
    # Each hash and each group in each direction (the kernel target takes the configured hash and group).
    uni = [("sha256", "null"), ("sha384", "ffdhe2048"), ("sha512", "ffdhe4096")]
    bi = [("sha256", "ffdhe4096"), ("sha384", "null"), ("sha512", "ffdhe2048")]
    cases = [(f"kt_{h}_{g}_uni", h, g, Host.new(i % 4)) for i, (h, g) in enumerate(uni)]
    cases += [(f"kt_{h}_{g}_bi", h, g, Host.new((i + 1) % 4, bidirectional=True)) for i, (h, g) in enumerate(bi)]
    return cases


@pytest.fixture(scope="module")
def kernel_auth_target(auth_assets: vm.Assets) -> Iterator[KernelAuthTarget]:
    cases = _kt_cases()
    wrong = Host.new(1)
    rotate = Host.new(0, bidirectional=True)
    new_key = generate_secret(key_len=32, hmac_id=1, nqn=rotate.hostnqn)
    hosts = [vm.KernelTargetHost(host.hostnqn, host.key, host.ctrl_key, f"hmac({h})", g) for _, h, g, host in cases]
    hosts += [vm.KernelTargetHost(wrong.hostnqn, wrong.key), vm.KernelTargetHost(rotate.hostnqn, rotate.key,
                                                                                   rotate.ctrl_key)]
    barrier = Barrier()
    q_rot = shlex.quote(f"/sys/kernel/config/nvmet/hosts/{rotate.hostnqn}/dhchap_key")
    script = vm.guest_kernel_target_script(KT_NQN, ((1, vm.KERNEL_TARGET_PORT),), hosts=hosts) + f"""
# nvmet's choice of hash and DH group is pr_debug (nvmet_auth_negotiate): print it on the console
mount -t debugfs debugfs /sys/kernel/debug && \\
    echo 'file fabrics-cmd-auth.c +p' > /sys/kernel/debug/dynamic_debug/control || echo "no dynamic debug"
dmesg -n 8
echo "{_KT_READY}"
GO=http://{vm.HOST_ADDR}:{barrier.port}/
while :; do
    case " $(timeout 5 wget -q -O - "$GO" 2>/dev/null) " in *" rotate "*) break ;; esac
    sleep 0.5
done
printf %s {shlex.quote(new_key)} > {q_rot} && echo "{_KT_ROTATED}"
while :; do sleep 3600; done
"""
    try:
        guest, (port,) = vm.boot_with_forwards(auth_assets, (vm.KERNEL_TARGET_PORT,), script, _KT_READY)
        try:
            yield KernelAuthTarget(port, guest, cases, wrong, rotate, new_key, barrier)
        finally:
            guest.stop()
    finally:
        barrier.close()


def _connect(kt: KernelAuthTarget, host: Host, *, key: str | None = "", ctrl_key: str | None = "",
             nr_io_queues: int = 1) -> Any:
    return initiator.connect("127.0.0.1", kt.port, KT_NQN, hostnqn=host.hostnqn, hostid=host.hostid,
                             nr_io_queues=nr_io_queues, timeout=60,
                             dhchap_secret=host.key if key == "" else key,
                             dhchap_ctrl_secret=host.ctrl_key if ctrl_key == "" else ctrl_key)


async def test_initiator_every_hash_and_group_against_kernel_target(
        kernel_auth_target: KernelAuthTarget, caplog: pytest.LogCaptureFixture) -> None:
    kt = kernel_auth_target
    problems = []
    for i, (name, h, g, host) in enumerate(kt.cases):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="initiator"):
            try:
                async with _connect(kt, host) as ctrl:
                    assert ctrl.authenticated, f"{name}: the kernel target did not ask for authentication"
                    data = os.urandom(64 << 10)
                    slba = i * (len(data) // BLOCK)
                    await ctrl.write(1, slba, data)
                    back = await ctrl.read(1, slba, len(data) // BLOCK)
                    if back != data:
                        problems.append(f"{name}: data read back differs")
            except (AuthFailure, NvmeError, OSError, TimeoutError) as exc:
                problems.append(f"{name}: connect failed: {exc}")
                continue
        lines = [r.getMessage() for r in caplog.records if "authenticated with hash" in r.getMessage()]
        want = f"authenticated with hash {h}, DH group {g}"
        if not any(want in line for line in lines):
            problems.append(f"{name}: our initiator logged {lines}, expected {want!r}")
        if name.endswith("_bi") and not any("controller authenticated" in line for line in lines):
            problems.append(f"{name}: the controller was not authenticated: {lines}")
    assert not problems, "\n".join(problems)
    # nvmet's own account of the DH group it selected for each controller (dynamic debug on the console)
    selected = re.findall(r"nvmet_auth_negotiate: ctrl \d+ qid 0: selected DH group (\S+)", kt.guest.output)
    if "no dynamic debug" not in kt.guest.script_text:
        assert sorted(selected[: len(kt.cases)]) == sorted(g for _, _, g, _ in kt.cases), (
            f"nvmet selected the DH groups {selected} for the admin queues, expected one of each case's")
        # nvmet falls back to another hash only when the host did not offer the configured one
        fallbacks = re.findall(r"nvmet_auth_negotiate: .*(?:no usable hash found|DH group \S+ not found).*",
                               kt.guest.output)
        assert not fallbacks, fallbacks


# nvmet answers a wrong host key with Failure1 and then nvmet_ctrl_fatal_error: the queue's connection may close
# before the Failure1 reaches the host, so a refusal shows either as the failure or as the closed connection.
_REFUSED = (AuthFailure, NvmeError, TransportError)


def _assert_refused(exc: BaseException) -> None:
    text = str(exc)
    if isinstance(exc, TransportError):
        assert "qid 0" in text, text
    else:
        assert "authentication" in text.lower(), text


async def test_initiator_refused_by_kernel_target_with_wrong_key(kernel_auth_target: KernelAuthTarget) -> None:
    kt = kernel_auth_target
    with pytest.raises(_REFUSED) as wrong_host:
        async with _connect(kt, kt.wrong, key=_other_key(1)):
            pass
    _assert_refused(wrong_host.value)
    # the kernel target proves itself with a controller key we do not expect: our host must refuse it
    bi = next(host for name, _, _, host in kt.cases if name.endswith("_bi"))
    with pytest.raises(AuthFailure) as wrong_ctrl:
        async with _connect(kt, bi, ctrl_key=_other_key(2)):
            pass
    assert "authentication" in str(wrong_ctrl.value).lower(), str(wrong_ctrl.value)
    # no key at all: the target asks (AUTHREQ.ATR), the initiator says which option is missing
    with pytest.raises(NvmeError) as no_key:
        async with _connect(kt, kt.wrong, key=None, ctrl_key=None):
            pass
    assert "dhchap_secret" in str(no_key.value), str(no_key.value)
    assert kt.guest.running


async def test_initiator_reauthenticates_with_kernel_target(kernel_auth_target: KernelAuthTarget) -> None:
    kt = kernel_auth_target
    data = os.urandom(256 << 10)
    slba = (32 << 20) // BLOCK  # past the matrix's blocks, inside the 64 MiB namespace
    async with _connect(kt, kt.rotate, nr_io_queues=2) as ctrl:
        await ctrl.write(1, slba, data)
        # re-authenticate every queue with the same keys (the kernel's nvme_ctrl_auth_work)
        await ctrl.reauthenticate()
        assert await ctrl.read(1, slba, len(data) // BLOCK) == data
        # the kernel target's key is rotated in configfs; the live controller re-authenticates with it
        kt.barrier.release("rotate")
        kt.guest.wait_for(re.escape(_KT_ROTATED), 60)
        await ctrl.reauthenticate(dhchap_secret=kt.new_key)
        assert await ctrl.read(1, slba, len(data) // BLOCK) == data
    # a fresh connect: the old key is refused, the new one accepted
    with pytest.raises(_REFUSED) as old_key:
        async with _connect(kt, kt.rotate):
            pass
    _assert_refused(old_key.value)
    async with _connect(kt, kt.rotate, key=kt.new_key) as ctrl:
        assert ctrl.authenticated
        assert hashlib.sha256(await ctrl.read(1, slba, len(data) // BLOCK)).digest() == hashlib.sha256(data).digest()
    assert kt.guest.running
