"""The Linux kernel's native NVMe multipath against two gateways of our target (issue 15, part 4).

One guest boot per kernel runs every scenario, each against its own subsystem and its own pair of
`nvmeof serve` processes on the VM host (different ports, one namespace with the same NSID, UUID,
NGUID and EUI-64 behind both, disjoint CNTLID ranges):

- ``ana``: two independent gateways on one file, ANA states set by hand over REST
  (PUT /listeners/{id}/ana/{grp}): A optimized, B non-optimized; fio writes with crc32c verification
  while A's listener turns inaccessible (I/O moves to B: B's write counter grows, A's stands still),
  B optimized, then both back. sysfs ``ana_state`` of each path follows every change.
- ``dir``: a gateway group with a directory store on the VM host and a file namespace; fio
  randwrite with ``--verify=crc32c`` while the owning gateway is killed with SIGKILL (the survivor's
  path turns optimized) and later started again (failback: its path optimized again, the survivor
  non-optimized). fio must report no error and verify every block.
- ``rbd`` (marker ceph): the same with an RBD image of the one-node cluster and ``--group-store
  rados:POOL``.

The kernel host connects to both gateways (`nvme connect` twice); ``nvme list-subsys -o json``
shows the two paths with their ANA states. Failover time (from just before the guest asks for the
kill to the survivor's path being optimized in sysfs: an upper bound) and failback time are printed
in the report, with fio's totals and its longest completion latency (the I/O pause of the failover).

Checks are `@@CHECK name PASS|FAIL@@` lines as in test_kernel_host.py; the test does its part (start,
kill, restart gateways, set ANA states) at `@@HOST step@@` lines and releases the guest through the
HTTP barrier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.interop import vm
from tests.interop.ourtarget import SUBNQN, OurTarget, start_serve, stop_serve
from tests.interop.test_kernel_host import (
    GUEST_EPILOGUE,
    GUEST_PREAMBLE,
    Barrier,
    Report,
    _poll,
    guest_script_text,
    run_guest,
)

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1200)]

ANAGRPID = 1
BLOCK = 512
FILE_SIZE = 64 << 20
STEP_TIMEOUT = 240.0  # the longest stretch between two host steps (a fio run to its end under TCG)
CNTLID_RANGES = ("1-2040", "2041-4080")  # the manual pair's; a group derives its own from the member index
# fio runs in passes, back to back, from before the first ANA change (or the kill) until after the last
# one, whatever the machine's speed: each pass writes FIO_PASS_MIB of 4 KiB random blocks (QD16) in one
# of FIO_REGIONS regions, reads every 64 written blocks back and checks them (verify_backlog), and
# uses its own --randseed, so a lost write leaves another pass's block, which fails verification.
FIO_PASS_MIB = 4
FIO_REGIONS = 4
FIO_ARGS = "--rw=randwrite --bs=4k --iodepth=16 --verify_backlog=64"

SCENARIOS = ("ana", "dir", "rbd")
# NVMEOF_MP_SCENARIOS=ana,dir runs only those (comma-separated); the others' tests skip.
SCENARIOS_ENV = "NVMEOF_MP_SCENARIOS"
# an expected controller or ANA state in a list-subsys check: one value, any of a set, or anything
Want = str | frozenset[str] | None


def selected_scenarios() -> list[str]:
    text = os.environ.get(SCENARIOS_ENV, "").strip()
    if not text:
        return list(SCENARIOS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        raise ValueError(f"{SCENARIOS_ENV}={text!r}: unknown scenario(s) {bad}; choose from {', '.join(SCENARIOS)}")
    return [n for n in SCENARIOS if n in names]


# ------------------------------------------------------------------------------- the guest script

MP_LIB = r"""
now() { cut -d' ' -f1 /proc/uptime; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
path_node() { for _n in /sys/class/nvme/$1/nvme*c*n1; do [ -e "$_n" ] && { echo $_n; return 0; }; done; return 1; }
ana_of() { _n=$(path_node "$1") && cat $_n/ana_state 2>/dev/null || echo none; }
state_of() { cat /sys/class/nvme/$1/state 2>/dev/null || echo gone; }
describe_paths() {
    echo "a=$CTRL_a $(state_of $CTRL_a) $(ana_of $CTRL_a), b=$CTRL_b $(state_of $CTRL_b) $(ana_of $CTRL_b)"
}
paths_are() {  # $1, $2: the ANA states of paths a and b, both controllers live
    [ "$(state_of $CTRL_a)" = live ] && [ "$(state_of $CTRL_b)" = live ] &&
    [ "$(ana_of $CTRL_a)" = "$1" ] && [ "$(ana_of $CTRL_b)" = "$2" ]
}
wait_paths() {  # $1: seconds, $2, $3: states of a and b
    wait_for $1 "paths_are $2 $3" || { echo "after $1 s: $(describe_paths); expected a $2, b $3"; return 1; }
    echo "$(describe_paths)"
}

check_multipath_enabled() {
    mp=$(cat /sys/module/nvme_core/parameters/multipath 2>/dev/null)
    echo "nvme_core multipath=$mp iopolicy=$(cat /sys/module/nvme_core/parameters/iopolicy 2>/dev/null)"
    [ "$mp" = Y ] || { echo "nvme_core.multipath is '$mp', not Y: no native multipath"; return 1; }
}

# mp_connect a|b PORT [nvme connect args]: sets CTRL_a / CTRL_b and DEV (the multipath head)
mp_connect() {
    _path=$1; _port=$2; shift 2
    CTRL=""; rm -f /tmp/conn
    ( @MPCONNECT@
      echo "$CTRL $DEV" > /tmp/conn ) || return 1
    read CTRL DEV < /tmp/conn
    eval "CTRL_$_path=$CTRL"
    echo "@@INFO ${S}_ctrl_$_path=$CTRL ${S}_cntlid_$_path=$(cat /sys/class/nvme/$CTRL/cntlid) ${S}_dev=$DEV@@" >&3
}

check_two_paths() {  # two controllers of $NQN, each with a path node of the one head $DEV, distinct cntlids
    need_dev || return 1
    [ -n "$CTRL_a" ] && [ -n "$CTRL_b" ] && [ "$CTRL_a" != "$CTRL_b" ] || {
        echo "need two controllers, have a='$CTRL_a' b='$CTRL_b'"; return 1; }
    for c in $CTRL_a $CTRL_b; do
        [ "$(cat /sys/class/nvme/$c/subsysnqn)" = "$NQN" ] || { echo "$c is not a controller of $NQN"; return 1; }
        _n=$(path_node $c) || { echo "$c has no path node nvme*c*n1"; return 1; }
        [ "$(basename $_n | sed 's/c[0-9]*n/n/')" = "${DEV#/dev/}" ] || { echo "$_n is not a path of $DEV"; return 1; }
    done
    _sub=/sys/class/nvme-subsystem/nvme-subsys${DEV#/dev/nvme}; _sub=${_sub%n*}
    ls $_sub
    [ -e $_sub/$CTRL_a ] && [ -e $_sub/$CTRL_b ] || { echo "$_sub does not hold both $CTRL_a and $CTRL_b"; return 1; }
    ca=$(cat /sys/class/nvme/$CTRL_a/cntlid); cb=$(cat /sys/class/nvme/$CTRL_b/cntlid)
    [ "$ca" != "$cb" ] || { echo "both controllers have cntlid $ca"; return 1; }
    echo "$DEV: paths $(path_node $CTRL_a) $(path_node $CTRL_b), cntlids $ca $cb, subsystem $_sub"
}

check_list_subsys() {  # $1: label; the test reads the JSON
    need_dev || return 1
    nvme list-subsys -o json $DEV > /tmp/ls.json 2>&1 || {
        cat /tmp/ls.json; echo "nvme list-subsys exited $?"; return 1; }
    cat /tmp/ls.json
    echo "@@SUBSYS $S-$1 $(tr -d '\n@' < /tmp/ls.json)@@" >&3
}

check_discover_both() {  # $1: the discovery port of gateway a
    nvme discover -t tcp -a $T -s $1 > /tmp/disc || { echo "nvme discover -s $1 exited $?"; return 1; }
    cat /tmp/disc
    for p in $PA $PB; do
        grep -Eq "trsvcid: *$p( |\$)" /tmp/disc || {
            echo "gateway a's discovery log has no entry for port $p"; return 1; }
    done
}

# fio_loop: passes of fio (FIO_ARGS) on the multipath head until /tmp/fio_stop_$S exists or one fails;
# pass N's output in /tmp/fio_$S.N, one "PASS N" / "FAIL N rc" line per pass in /tmp/fio_$S.passes
fio_loop() {
    _i=0
    while :; do
        _i=$((_i + 1))
        fio --name=$S --filename=$DEV --ioengine=$ENGINE --direct=1 --verify=crc32c --verify_fatal=1 \
            --group_reporting @FIO_ARGS@ --size=@FIO_PASS_MIB@M --randseed=$_i \
            --offset=$(( (_i - 1) % @FIO_REGIONS@ * @FIO_PASS_MIB@ ))M > /tmp/fio_$S.$_i 2>&1
        _rc=$?
        if [ $_rc = 0 ] && grep -q "err= 0" /tmp/fio_$S.$_i &&
           ! grep -qi "verify.*\(bad\|fail\|mismatch\)" /tmp/fio_$S.$_i; then echo "PASS $_i" >> /tmp/fio_$S.passes
        else echo "FAIL $_i $_rc" >> /tmp/fio_$S.passes; return 1
        fi
        [ -e /tmp/fio_stop_$S ] && return 0
    done
}
fio_start() {
    need_dev || return 1
    dmesg -c >> /tmp/dmesg.before 2>/dev/null
    rm -f /tmp/fio_stop_$S /tmp/fio_$S.passes
    FIO_T0=$(now)
    fio_loop &
    FIO_PID=$!
    # writes in flight on path a (the optimized one) before the test changes anything
    wait_for 20 "[ \$(awk '{ print \$1 + \$2 }' \$(path_node \$CTRL_a)/inflight) -gt 0 ]" || {
        echo "no I/O in flight on path a 20 s after fio started: $(cat /tmp/fio_$S.* 2>/dev/null | tail -n 20)"
        return 1; }
}
fio_running() {  # the passes go on through this step: none failed, the loop still runs
    ! grep -q FAIL /tmp/fio_$S.passes 2>/dev/null || { echo "a fio pass failed: $(cat /tmp/fio_$S.passes)"; return 1; }
    [ -n "$FIO_PID" ] && kill -0 $FIO_PID 2>/dev/null || {
        echo "fio is no longer running ($(since $FIO_T0) s after its start): it does not span this step"; return 1; }
}
fio_wait() {  # stop after the current pass; every pass exited 0 with "err= 0" and no verify complaint
    [ -n "$FIO_PID" ] || { echo "no fio running (its start failed)"; return 1; }
    touch /tmp/fio_stop_$S
    wait $FIO_PID; rc=$?; FIO_PID=""
    for f in $(ls /tmp/fio_$S.[0-9]* | sort -t. -k3 -n); do
        grep -E "err=|IOPS=|clat \(|READ:|WRITE:|verify" $f | tr -d '@' | sed "s/^/@@FIOLINE $S /; s/\$/@@/" >&3
    done
    passes=$(grep -c PASS /tmp/fio_$S.passes)
    echo "@@INFO ${S}_fio_seconds=$(since $FIO_T0) ${S}_fio_passes=$passes ${S}_fio_rc=$rc@@" >&3
    cat /tmp/fio_$S.passes
    [ $rc = 0 ] || { _last=$(ls /tmp/fio_$S.[0-9]* | sort -t. -k3 -n | tail -n 1); cat $_last
        echo "fio pass failed: $(tail -n 1 /tmp/fio_$S.passes)"; return 1; }
}

check_no_io_errors() {  # no I/O error reached the multipath head (a path's own errors are failed over)
    dmesg | grep -i -e "I/O error" -e "Buffer I/O" -e "critical medium" > /tmp/ioerr
    head_errs=$(grep -c "dev ${DEV#/dev/}[, ]" /tmp/ioerr)
    echo "@@INFO ${S}_dmesg_io_error_lines=$(wc -l < /tmp/ioerr) ${S}_head_io_errors=$head_errs@@" >&3
    cat /tmp/ioerr
    [ "$head_errs" = 0 ] || { echo "$head_errs I/O errors on $DEV in dmesg"; return 1; }
}

ana_move() {  # $1: host step, $2, $3: the states paths a and b must reach
    echo "@@HOST $S-$1@@" >&3
    await_host $S-$1 || return 1
    _m0=$(now)
    wait_paths 30 $2 $3 || return 1
    echo "@@INFO ${S}_$(echo $1 | tr - _)_s=$(since $_m0)@@" >&3
}

kill_owner() {  # the test kills gateway a (the owner) with SIGKILL
    _m0=$(now)
    echo "@@HOST $S-kill@@" >&3
    await_host $S-kill || return 1
    wait_for 30 "[ \"\$(state_of \$CTRL_a)\" != live ]" || { echo "path a still live 30 s after the kill"; return 1; }
    _down=$(since $_m0)
    wait_for 60 "[ \"\$(ana_of \$CTRL_b)\" = optimized ] && [ \"\$(state_of \$CTRL_b)\" = live ]" || {
        echo "60 s after the kill: $(describe_paths); expected b optimized"; return 1; }
    _opt=$(since $_m0)
    echo "@@INFO ${S}_path_a_down_s=$_down ${S}_failover_s=$_opt ${S}_a_state_after_kill=$(state_of $CTRL_a)@@" >&3
    echo "$(describe_paths): path a down after ${_down} s, b optimized after ${_opt} s"
}

restart_owner() {  # the test starts gateway a again; its path reconnects and the group fails back
    echo "@@HOST $S-restart@@" >&3
    await_host $S-restart || return 1
    _m0=$(now)
    wait_for 90 "[ \"\$(state_of \$CTRL_a)\" = live ]" || {
        echo "90 s after the restart: $(describe_paths)"; return 1; }
    _live=$(since $_m0)
    wait_paths 60 optimized non-optimized || return 1
    echo "@@INFO ${S}_reconnect_s=$_live ${S}_failback_s=$(since $_m0)@@" >&3
}

mp_disconnect() {
    [ -n "$CTRL_a$CTRL_b" ] || { echo "nothing to disconnect (the connects failed)"; return 1; }
    nvme disconnect -n "$NQN" || { echo "nvme disconnect -n $NQN exited $?"; return 1; }
    for c in $CTRL_a $CTRL_b; do
        wait_for 15 "[ ! -e /sys/class/nvme/$c ]" || { echo "$c still present after disconnect"; return 1; }
    done
    CTRL_a=""; CTRL_b=""; DEV=""
}

setup_done() {  # the test could start the scenario's gateways (else it released "$S-setup-failed")
    case " $(timeout 5 wget -q -O - "$GO" 2>/dev/null) " in *" $S-setup-failed "*) return 1 ;; esac
}

scenario_end() {
    dmesg | grep -i nvme | tail -n 60 | sed "s/^/    dmesg[$S]| /"
    dmesg -c >> /tmp/dmesg.before 2>/dev/null
}

run multipath_enabled check_multipath_enabled
"""

# connect with a short reconnect delay: the returning gateway is found within a second
CONNECT_ARGS = "--reconnect-delay 1 --ctrl-loss-tmo 120"


def _scenario_head(name: str, subnqn: str, port_a: int, port_b: int) -> str:
    return f"""
# ======== scenario {name}
S={name}; NQN={shlex.quote(subnqn)}; PA={port_a}; PB={port_b}; CTRL_a=""; CTRL_b=""; DEV=""; FIO_PID=""
run {name}_setup host_step {name}-setup
if setup_done; then
"""


def _scenario_tail() -> str:
    return """fi
scenario_end
"""


def ana_script(subnqn: str, port_a: int, port_b: int) -> str:
    return _scenario_head("ana", subnqn, port_a, port_b) + f"""
run ana_connect_a mp_connect a $PA {CONNECT_ARGS}
run ana_connect_b mp_connect b $PB {CONNECT_ARGS}
run ana_two_paths check_two_paths
run ana_initial_states wait_paths 20 optimized non-optimized
run ana_list_subsys check_list_subsys initial
run ana_fio_start fio_start
run ana_a_inaccessible ana_move a-inaccessible inaccessible non-optimized
run ana_io_moved host_step ana-io-moved
run ana_b_optimized ana_move b-optimized inaccessible optimized
run ana_list_subsys_moved check_list_subsys moved
run ana_restored ana_move restore optimized non-optimized
run ana_fio_spans fio_running
run ana_fio_verify fio_wait
run ana_no_io_errors check_no_io_errors
run ana_disconnect mp_disconnect
run ana_teardown host_step ana-teardown
""" + _scenario_tail()


def failover_script(name: str, subnqn: str, port_a: int, port_b: int, disc_a: int) -> str:
    return _scenario_head(name, subnqn, port_a, port_b) + f"""
run {name}_discovery_lists_both check_discover_both {disc_a}
run {name}_connect_a mp_connect a $PA {CONNECT_ARGS}
run {name}_connect_b mp_connect b $PB {CONNECT_ARGS}
run {name}_two_paths check_two_paths
run {name}_initial_states wait_paths 30 optimized non-optimized
run {name}_list_subsys check_list_subsys initial
run {name}_fio_start fio_start
run {name}_kill_owner kill_owner
run {name}_list_subsys_failover check_list_subsys failover
run {name}_fio_spans_failover fio_running
run {name}_restart_owner restart_owner
run {name}_fio_spans_failback fio_running
run {name}_list_subsys_failback check_list_subsys failback
run {name}_fio_verify fio_wait
run {name}_no_io_errors check_no_io_errors
run {name}_disconnect mp_disconnect
run {name}_teardown host_step {name}-teardown
""" + _scenario_tail()


def _connect_fragment() -> str:
    """vm.guest_nvme_connect_script with the port and subsystem NQN taken from shell variables."""
    text = vm.guest_nvme_connect_script(vm.HOST_ADDR, "PORTVAR", "NQNVAR", '"$@"')
    return text.replace("-s PORTVAR", '-s "$_port"').replace(":PORTVAR", ":$_port").replace("NQNVAR", '"$NQN"')


def guest_checks(name: str) -> tuple[str, ...]:
    """The guest checks of one scenario, in the order its script runs them."""
    script = ana_script("x", 1, 2) if name == "ana" else failover_script(name, "x", 1, 2, 3)
    return tuple(re.findall(r"^run (\S+) ", script, re.MULTILINE))


def host_checks(name: str) -> tuple[str, ...]:
    if name == "ana":
        return ("ana_cntlids_disjoint", "ana_io_moved_to_b", "ana_subsys_json_states", "ana_logs_clean",
                "ana_clean_exit")
    return tuple(f"{name}_{c}" for c in (
        "initial_owner", "rest_failover", "failover_logged", "rest_failback", "cntlids_disjoint",
        "subsys_json_states", "logs_clean", "clean_exit"))  # fmt: skip


# ------------------------------------------------------------------------------- host side


@dataclasses.dataclass
class Gateway:
    """One `nvmeof serve` of a pair: killed and restarted on the same ports and state directory."""

    name: str
    log_dir: Path
    subnqn: str
    args: list[str]
    ports: tuple[int, int, int]  # io, discovery, api
    target: OurTarget | None = None
    starts: int = 0
    exit_codes: list[int | None] = dataclasses.field(default_factory=list)
    killed: bool = False

    @property
    def io_port(self) -> int:
        return self.ports[0]

    @property
    def listener_id(self) -> str:
        return f"tcp:127.0.0.1:{self.io_port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / "nvmeof-serve.log"

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.target = start_serve(self.log_path, subnqn=self.subnqn, size="16M", block_size=BLOCK,
                                  extra_args=self.args, ports=self.ports, append_log=self.starts > 0)
        self.starts += 1

    def kill(self) -> None:
        """SIGKILL: no shutdown code of ours runs; the kernel closes its sockets and drops its flocks."""
        assert self.target is not None
        self.target.proc.send_signal(signal.SIGKILL)
        self.target.proc.wait(10)
        self.target.client.close()
        self.killed = True
        self.target = None

    def stop(self) -> None:
        if self.target is not None:
            self.exit_codes.append(stop_serve(self.target))
            self.target = None

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        assert self.target is not None, f"{self.name} is not running"
        return self.target.api(method, path, **kwargs)

    def try_api(self, method: str, path: str, **kwargs: Any) -> Any:
        """None instead of an assertion when the call fails (for polling)."""
        if self.target is None:
            return None
        try:
            resp = self.target.client.request(method, self.target.api_url + path, **kwargs)
        except Exception:
            return None
        return resp.json() if resp.is_success and resp.content else None

    def log_errors(self) -> list[str]:
        if not self.log_path.exists():
            return [f"{self.log_path} missing"]
        text = self.log_path.read_text(errors="replace")
        level = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) ")
        return [line for line in text.splitlines() if level.match(line) or line.startswith("Traceback")]

    # -- ANA and namespaces (the REST interface of issue 15)

    def set_ana(self, anagrpid: int, state: str) -> None:
        self.api("PUT", f"/listeners/tcp/127.0.0.1/{self.io_port}/ana/{anagrpid}", json={"state": state})

    def ana_state(self, anagrpid: int) -> str | None:
        """This gateway's state of `anagrpid` on its I/O listener, from GET /ana (None: it does not answer)."""
        report = self.try_api("GET", "/ana")
        for entry in (report or {}).get("listeners", []):
            if entry.get("listener_id") == self.listener_id:
                return entry.get("states", {}).get(str(anagrpid))
        return None

    def namespace_writes(self, nsid: int = 1) -> int:
        return int(self.api("GET", f"/subsystems/{self.subnqn}/namespaces/{nsid}/stats")["writes"])

    def my_cntlids(self, hostnqn: str | None) -> list[int]:
        return [c["cntlid"] for c in self.api("GET", "/controllers")
                if c["subnqn"] == self.subnqn and c["hostnqn"] == hostnqn]


def _file_namespace(path: Path, seed: str) -> dict[str, Any]:
    """One file namespace with fixed identifiers, the same on every gateway that serves it."""
    ident = uuid.uuid5(uuid.NAMESPACE_URL, f"nvmeof-toolkit/multipath/{seed}")
    return {"backend": "file", "path": str(path), "nsid": 1, "block_size": BLOCK, "uuid": str(ident),
            "nguid": ident.hex, "eui64": "0022a1" + ident.hex[:10], "anagrpid": ANAGRPID}


def _replace_namespace_1(gw: Gateway, body: dict[str, Any]) -> None:
    """The daemon's default RAM namespace 1 gives way to the shared one."""
    if any(ns["nsid"] == 1 for ns in gw.api("GET", f"/subsystems/{gw.subnqn}/namespaces")):
        gw.api("DELETE", f"/subsystems/{gw.subnqn}/namespaces/1")
    gw.api("POST", f"/subsystems/{gw.subnqn}/namespaces", json=body)


def _in_range(cntlid: int, text: str) -> bool:
    lo, hi = (int(x) for x in text.split("-"))
    return lo <= cntlid <= hi


class Scenario:
    """One scenario's gateways and its host steps."""

    def __init__(self, name: str, run: MultipathRun, ports: list[int]) -> None:
        self.name = name
        self.run = run
        self.report = run.report
        self.subnqn = f"{SUBNQN}-mp-{name}"
        self.dir = run.log_dir / name
        self.gateways: list[Gateway] = []
        self.ports = ports  # 6: io, discovery, api of a, then of b
        self.kill_time: float | None = None

    def gw_ports(self, i: int) -> tuple[int, int, int]:
        return tuple(self.ports[3 * i: 3 * i + 3])  # type: ignore[return-value]

    def a(self) -> Gateway:
        return self.gateways[0]

    def b(self) -> Gateway:
        return self.gateways[1]

    def record(self, check: str, ok: bool, reason: str) -> None:
        self.report.record(f"{self.name}_{check}", ok, reason)

    def step(self, step: str) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        """Stop both gateways (SIGTERM, clean exit) and look at their logs."""
        for gw in self.gateways:
            gw.stop()
        codes = {gw.name: gw.exit_codes for gw in self.gateways}
        self.record("clean_exit", all(c and all(x == 0 for x in c) for c in codes.values()),
                    f"exit statuses on SIGTERM: {codes}")
        errors = {gw.name: gw.log_errors() for gw in self.gateways}
        bad = {k: v[:10] for k, v in errors.items() if v}
        self.record("logs_clean", not bad, f"ERROR lines in the gateways' logs: {bad}")

    def check_subsys_json(self) -> None:
        """Each `nvme list-subsys -o json` the guest printed names two paths with the expected ANA states."""
        expected = self.expected_subsys_states()
        problems = []
        for label, states in expected.items():
            doc = self.run.subsys.get(f"{self.name}-{label}")
            if doc is None:
                problems.append(f"{label}: the guest printed no list-subsys")
                continue
            got = paths_from_list_subsys(doc)
            ports = {str(gw.io_port): role for role, gw in zip("ab", self.gateways, strict=True)}
            seen = {ports.get(p["trsvcid"], p["trsvcid"]): (p["state"], p["ana"]) for p in got}
            if not subsys_states_match(seen, states):
                problems.append(f"{label}: paths {seen}, expected {states} (None: any; a set: one of)")
        self.report.record(f"{self.name}_subsys_json_states", not problems, "; ".join(problems))

    def expected_subsys_states(self) -> dict[str, dict[str, tuple[Want, Want]]]:
        raise NotImplementedError


def subsys_states_match(seen: dict[str, tuple[str, str]], expected: dict[str, tuple[Want, Want]]) -> bool:
    """Each expected path (a, b) with its (controller state, ANA state)."""
    return seen.keys() == expected.keys() and all(
        want is None or (got in want if isinstance(want, frozenset) else got == want)
        for path, pair in expected.items() for want, got in zip(pair, seen[path], strict=True))


def paths_from_list_subsys(doc: Any) -> list[dict[str, str]]:
    """(trsvcid, controller state, ANA state) per path from nvme-cli 2.x `list-subsys -o json DEV`."""
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "Paths" in node and isinstance(node["Paths"], list):
                for p in node["Paths"]:
                    addr = str(p.get("Address", ""))
                    m = re.search(r"trsvcid=(\d+)", addr)
                    found.append({"trsvcid": m.group(1) if m else addr, "state": str(p.get("State", "")),
                                  "ana": str(p.get("ANAState", ""))})
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    return found


class ManualAna(Scenario):
    """Two independent gateways, ANA states set over REST."""

    def step(self, step: str) -> None:
        if step == "setup":
            self.dir.mkdir(parents=True, exist_ok=True)
            backing = self.dir / "shared.img"
            with open(backing, "wb") as f:
                f.truncate(FILE_SIZE)
            body = _file_namespace(backing, self.subnqn)
            for i, (role, cntlids) in enumerate(zip("ab", CNTLID_RANGES, strict=True)):
                gw = Gateway(f"gw-{role}", self.dir / f"gw-{role}", self.subnqn, [
                    "--cntlid-range", cntlids, "--backing-dir", str(self.dir)], self.gw_ports(i))  # fmt: skip
                self.gateways.append(gw)
                gw.start()
                _replace_namespace_1(gw, body)
            self.b().set_ana(ANAGRPID, "non-optimized")
        elif step == "a-inaccessible":
            self.a().set_ana(ANAGRPID, "inaccessible")
        elif step == "io-moved":
            # fio keeps writing: B's counter grows, A's (inaccessible) stands still
            a0, b0 = self.a().namespace_writes(), self.b().namespace_writes()
            time.sleep(3)
            a1, b1 = self.a().namespace_writes(), self.b().namespace_writes()
            self.report.info["ana_writes_in_3s_a_inaccessible"] = f"a:{a1 - a0},b:{b1 - b0}"
            self.report.record("ana_io_moved_to_b", a1 == a0 and b1 > b0,
                               f"writes in 3 s with A inaccessible: A {a1 - a0}, B {b1 - b0}")
        elif step == "b-optimized":
            self.b().set_ana(ANAGRPID, "optimized")
        elif step == "restore":
            self.b().set_ana(ANAGRPID, "non-optimized")
            self.a().set_ana(ANAGRPID, "optimized")
        elif step == "teardown":
            self.check_subsys_json()
            self.teardown()
        else:
            raise AssertionError(f"unknown step {step!r} of scenario ana")

    def teardown(self) -> None:
        ok, why = True, []
        for gw, rng in zip(self.gateways, CNTLID_RANGES, strict=True):
            cntlid = self.report.info.get(f"ana_cntlid_{gw.name[-1]}")
            if cntlid is None or not _in_range(int(cntlid), rng):
                ok = False
            why.append(f"{gw.name}: cntlid {cntlid}, range {rng}")
        self.report.record("ana_cntlids_disjoint", ok, "; ".join(why))
        super().teardown()

    def expected_subsys_states(self) -> dict[str, dict[str, tuple[Want, Want]]]:
        return {"initial": {"a": ("live", "optimized"), "b": ("live", "non-optimized")},
                "moved": {"a": ("live", "inaccessible"), "b": ("live", "optimized")}}


class GroupFailover(Scenario):
    """Two members of one gateway group; the owner of the ANA group is killed and restarted."""

    def __init__(self, name: str, run: MultipathRun, ports: list[int], *, store: str,
                 make_namespace: Callable[[], dict[str, Any]], store_args: list[str]) -> None:
        super().__init__(name, run, ports)
        self.store = store
        self.make_namespace = make_namespace
        self.store_args = store_args
        self.failover_rest_s: float | None = None
        self.failback_rest_s: float | None = None
        # one group per run: a RADOS pool outlives a run (the next kernel's run uses the same cluster)
        self.group = f"mp-{name}-{uuid.uuid4().hex[:8]}"

    def member_args(self, role: str) -> list[str]:
        return ["--gateway-group", self.group, "--gateway-name", f"gw-{role}", "--group-store", self.store,
                *self.store_args]

    def step(self, step: str) -> None:
        if step == "setup":
            self.dir.mkdir(parents=True, exist_ok=True)
            for i, role in enumerate("ab"):
                self.gateways.append(Gateway(f"gw-{role}", self.dir / f"gw-{role}", self.subnqn,
                                             self.member_args(role), self.gw_ports(i)))
            # a first: it joins with index 0 and prefers ANA group 1 ((1 - 1) % 2 = 0)
            self.a().start()
            _replace_namespace_1(self.a(), self.make_namespace())
            self.b().start()
            ok = _poll(lambda: self.b().try_api("GET", f"/subsystems/{self.subnqn}/namespaces/1") is not None
                       and self.b().ana_state(ANAGRPID) == "non-optimized"
                       and self.a().ana_state(ANAGRPID) == "optimized", 30)
            self.record("initial_owner", ok, f"30 s after both started: a {self.a().ana_state(ANAGRPID)}, "
                        f"b {self.b().ana_state(ANAGRPID)} (expected optimized / non-optimized), b's namespace 1: "
                        f"{self.b().try_api('GET', f'/subsystems/{self.subnqn}/namespaces/1')}")
        elif step == "kill":
            self.kill_time = time.monotonic()
            self.a().kill()
            self.run.barrier.release(f"{self.name}-kill")  # the guest measures its side from here on
            ok = _poll(lambda: self.b().ana_state(ANAGRPID) == "optimized", 60)
            self.failover_rest_s = time.monotonic() - self.kill_time
            self.report.info[f"{self.name}_rest_failover_s"] = f"{self.failover_rest_s:.2f}"
            self.record("rest_failover", ok, f"b's REST shows group {ANAGRPID} {self.b().ana_state(ANAGRPID)} "
                        f"{self.failover_rest_s:.1f} s after a was killed")
            moved: list[str] = []

            def logged() -> bool:
                moved[:] = [line for line in self.b().log_path.read_text(errors="replace").splitlines()
                            if f"ANA group {ANAGRPID}: gw-b takes ownership" in line]
                return bool(moved)

            self.record("failover_logged", _poll(logged, 10), f"b's log says no 'ANA group {ANAGRPID}: gw-b takes "
                        f"ownership' 10 s after the kill; see {self.b().log_path}")
            if moved:
                self.report.info[f"{self.name}_failover_log"] = moved[0].split(": ", 1)[-1].replace(" ", "_")
        elif step == "restart":
            began = time.monotonic()
            self.a().start()
            self.report.info[f"{self.name}_restart_s"] = f"{time.monotonic() - began:.2f}"
            began = time.monotonic()
            self.run.barrier.release(f"{self.name}-restart")  # a answers again: the guest's clock starts
            ok = _poll(lambda: self.a().ana_state(ANAGRPID) == "optimized"
                       and self.b().ana_state(ANAGRPID) == "non-optimized", 60)
            self.failback_rest_s = time.monotonic() - began
            self.report.info[f"{self.name}_rest_failback_s"] = f"{self.failback_rest_s:.2f}"
            self.record("rest_failback", ok, f"{self.failback_rest_s:.1f} s after a answered again: a "
                        f"{self.a().ana_state(ANAGRPID)}, b {self.b().ana_state(ANAGRPID)}")
        elif step == "teardown":
            # member index 0 and 1: CNTLID ranges [1, CNTLID_SPAN] and [CNTLID_SPAN + 1, 2 * CNTLID_SPAN]
            cntlids = {r: self.report.info.get(f"{self.name}_cntlid_{r}") for r in "ab"}
            ok = all(v is not None and _in_range(int(v), rng)
                     for v, rng in zip(cntlids.values(), CNTLID_RANGES, strict=True))
            self.record("cntlids_disjoint", ok, f"cntlids of the paths at connect: {cntlids}, expected in the "
                        f"ranges of member indexes 0 and 1: {CNTLID_RANGES}")
            self.check_subsys_json()
            self.teardown()
        else:
            raise AssertionError(f"unknown step {step!r} of scenario {self.name}")

    def expected_subsys_states(self) -> dict[str, dict[str, tuple[Want, Want]]]:
        # a dead path keeps the last ANA state it read (the kernel cannot ask a gateway that is gone); it is
        # "resetting" until the kernel's error recovery has torn it down, then "connecting"
        return {"initial": {"a": ("live", "optimized"), "b": ("live", "non-optimized")},
                "failover": {"a": (frozenset({"resetting", "connecting"}), None), "b": ("live", "optimized")},
                "failback": {"a": ("live", "optimized"), "b": ("live", "non-optimized")}}


class MultipathRun:
    """The host's side of the one guest run: dispatches `@@HOST <scenario>-<step>@@`."""

    def __init__(self, log_dir: Path, barrier: Barrier, report: Report) -> None:
        self.log_dir = log_dir
        self.barrier = barrier
        self.report = report
        self.scenarios: dict[str, Scenario] = {}
        self.subsys: dict[str, Any] = {}

    def all_gateways(self) -> list[Gateway]:
        return [gw for sc in self.scenarios.values() for gw in sc.gateways]

    def step(self, name: str) -> bool:
        if name == "all-disconnected":
            self.barrier.release("done")
            return True
        scenario, _, step = name.partition("-")
        sc = self.scenarios.get(scenario)
        if sc is None:
            raise AssertionError(f"the guest script asked for a step of unknown scenario {name!r}")
        try:
            sc.step(step)
        except Exception as exc:  # the guest goes on; the check table names the failed step
            self.report.record(f"{scenario}_host_step_{step.replace('-', '_')}", False, f"{type(exc).__name__}: {exc}")
            if step == "setup":  # the guest skips the scenario instead of waiting out every check
                self.barrier.release(f"{scenario}-setup-failed")
        if name not in self.barrier.released:  # kill and restart release the guest themselves, early
            self.barrier.release(name)
        return False

    def parse_subsys(self, output: str) -> None:
        for m in re.finditer(r"@@SUBSYS (\S+) ([^@\n]*)@@", output):
            with contextlib.suppress(ValueError):
                self.subsys.setdefault(m.group(1), json.loads(m.group(2)))


_SIZE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_TIME_UNITS = {"nsec": 1e-6, "usec": 1e-3, "msec": 1.0}


def fio_figures(output: str, scenario: str) -> dict[str, Any]:
    """Totals over one scenario's fio passes (their @@FIOLINE lines): passes, MiB written and read back
    (verify_backlog's reads), the sum of the jobs' err= values, the longest completion latency (ms)."""
    lines = [m.group(1) for m in re.finditer(rf"@@FIOLINE {re.escape(scenario)} ([^@\n]*)@@", output)]
    out: dict[str, Any] = {"passes": 0, "written_mib": 0.0, "read_mib": 0.0, "errors": 0, "clat_max_ms": 0.0}
    for line in lines:
        if m := re.match(r"\s*(READ|WRITE): .*io=([\d.]+)([KMG]?i?B) ", line):
            key = "written_mib" if m.group(1) == "WRITE" else "read_mib"
            out[key] += float(m.group(2)) * _SIZE_UNITS.get(m.group(3), 1) / (1 << 20)
        elif m := re.search(r"\bclat \((\w+)\): min=\S+ max=([\d.]+)([km]?),", line):
            scale = {"": 1, "k": 1e3, "m": 1e6}[m.group(3)]
            out["clat_max_ms"] = max(out["clat_max_ms"], float(m.group(2)) * scale * _TIME_UNITS.get(m.group(1), 0))
        elif m := re.search(r"\(groupid=\d+, jobs=\d+\): err=\s*(\d+)", line):
            out["passes"] += 1
            out["errors"] += int(m.group(1))
    for key in ("written_mib", "read_mib", "clat_max_ms"):
        out[key] = round(out[key], 1)
    return out


def _ceph_selected(request: pytest.FixtureRequest) -> bool:
    """Whether a selected test of this module needs the RBD scenario (marker ceph)."""
    return any(item.get_closest_marker("ceph") is not None and getattr(item, "module", None) is request.module
               for item in request.session.items)


@pytest.fixture(scope="module")
def multipath_report(vm_assets: vm.Assets, tmp_path_factory: pytest.TempPathFactory,
                     request: pytest.FixtureRequest) -> Iterator[Report]:
    log_dir = tmp_path_factory.mktemp("kernel-multipath")
    report = Report(console=log_dir / "guest-console.log", target_log=log_dir)
    began = time.monotonic()
    barrier = Barrier()
    run = MultipathRun(log_dir, barrier, report)
    ports = vm.free_ports(6 * len(SCENARIOS))
    wanted = selected_scenarios()
    run.scenarios["ana"] = ManualAna("ana", run, ports[0:6])
    run.scenarios["dir"] = GroupFailover(
        "dir", run, ports[6:12], store=f"dir:{log_dir / 'dir' / 'store'}", store_args=[
            "--backing-dir", str(log_dir / "dir")],
        make_namespace=lambda: _dir_namespace(log_dir / "dir"))  # fmt: skip
    cluster = None
    image = f"mp-{log_dir.name}"
    if "rbd" not in wanted:
        report.info["rbd_skipped"] = f"not in {SCENARIOS_ENV}"
    elif _ceph_selected(request):
        try:
            cluster = request.getfixturevalue("ceph_cluster")
        except pytest.skip.Exception as exc:
            report.info["rbd_skipped"] = str(exc).replace(" ", "_")[:200]
    if cluster is not None:
        cluster.rbd("create", "--size", f"{FILE_SIZE >> 20}M", f"{cluster.pool}/{image}")
        rbd_body = {"backend": "rbd", "pool": cluster.pool, "image": image, "nsid": 1, "block_size": BLOCK,
                    "anagrpid": ANAGRPID}
        run.scenarios["rbd"] = GroupFailover(
            "rbd", run, ports[12:18], store=f"rados:{cluster.pool}",
            store_args=["--ceph-conf", str(cluster.conf)], make_namespace=lambda: dict(rbd_body))
    names = [n for n in wanted if n in run.scenarios]
    for name in set(run.scenarios) - set(names):
        del run.scenarios[name]
    script = GUEST_PREAMBLE + MP_LIB + "".join(
        ana_script(sc.subnqn, sc.gw_ports(0)[0], sc.gw_ports(1)[0]) if name == "ana"
        else failover_script(name, sc.subnqn, sc.gw_ports(0)[0], sc.gw_ports(1)[0], sc.gw_ports(0)[1])
        for name in names for sc in [run.scenarios[name]]) + GUEST_EPILOGUE
    script = script.replace("@MPCONNECT@", _connect_fragment()).replace("@FIO_ARGS@", FIO_ARGS)
    script = script.replace("@FIO_PASS_MIB@", str(FIO_PASS_MIB)).replace("@FIO_REGIONS@", str(FIO_REGIONS))
    script = guest_script_text(f"T=@HOST_ADDR@; GO=http://@HOST_ADDR@:@GOP@/\n{script}", SUBNQN,
                               {"@GOP@": str(barrier.port)})
    try:
        guest = vm.Guest(vm_assets, fio=True)
        run_guest(guest, script, report, run.step, step_timeout=STEP_TIMEOUT, on_output=run.parse_subsys)
        run.parse_subsys(guest.output)
    finally:
        barrier.close()
        for gw in run.all_gateways():
            with contextlib.suppress(Exception):
                gw.stop()
        if cluster is not None:
            try:
                cluster.rbd("rm", "--no-progress", f"{cluster.pool}/{image}")
            except Exception as exc:  # a leftover image dies with the cluster
                print(f"could not remove {image}: {exc}")
    report.seconds = time.monotonic() - began
    _print_report(report, run, names, guest.output)
    yield report


def _dir_namespace(directory: Path) -> dict[str, Any]:
    backing = directory / "shared.img"
    if not backing.exists():
        with open(backing, "wb") as f:
            f.truncate(FILE_SIZE)
    return _file_namespace(backing, "dir")


def _print_report(report: Report, run: MultipathRun, names: list[str], output: str) -> None:
    print(f"\nkernel multipath: {report.seconds:.1f} s total, boot {report.boot_seconds or 0:.1f} s; "
          f"console {report.console}; gateway logs under {run.log_dir}")
    for name in names:
        info = {k: v for k, v in report.info.items() if k.startswith(f"{name}_")}
        fio = fio_figures(output, name)
        print(f"  [{name}] fio: {fio or 'no figures'}")
        if name != "ana":
            print(f"  [{name}] failover: guest sysfs survivor optimized <= {info.get(f'{name}_failover_s', '?')} s "
                  f"after the kill (path a down after {info.get(f'{name}_path_a_down_s', '?')} s), target REST "
                  f"{info.get(f'{name}_rest_failover_s', '?')} s; failback: reconnect "
                  f"{info.get(f'{name}_reconnect_s', '?')} s, states back {info.get(f'{name}_failback_s', '?')} s "
                  f"after a answered again (REST {info.get(f'{name}_rest_failback_s', '?')} s; a took "
                  f"{info.get(f'{name}_restart_s', '?')} s to start)")
        print(f"  [{name}] info: {info}")
    expected = {c for n in names for c in guest_checks(n) + host_checks(n)} | {"multipath_enabled"}
    report.print_checks(expected)


def _ran_or_skip(report: Report, name: str) -> None:
    if f"{name}_setup" not in report.checks:
        why = report.info.get("rbd_skipped", "no Ceph cluster") if name == "rbd" else f"not in {SCENARIOS_ENV}"
        pytest.skip(f"the {name} scenario did not run: {why}")


# ------------------------------------------------------------------------------- the tests


def test_kernel_has_native_multipath(multipath_report: Report) -> None:
    multipath_report.assert_passed("multipath_enabled")


def test_manual_ana_two_paths_with_their_states(multipath_report: Report) -> None:
    _ran_or_skip(multipath_report, "ana")
    multipath_report.assert_passed("ana_setup", "ana_connect_a", "ana_connect_b", "ana_two_paths",
                                   "ana_cntlids_disjoint", "ana_initial_states", "ana_list_subsys",
                                   "ana_subsys_json_states")


def test_manual_ana_inaccessible_moves_io_and_sysfs_follows(multipath_report: Report) -> None:
    _ran_or_skip(multipath_report, "ana")
    multipath_report.assert_passed("ana_a_inaccessible", "ana_io_moved", "ana_io_moved_to_b", "ana_b_optimized",
                                   "ana_list_subsys_moved", "ana_restored", "ana_fio_spans")


def test_manual_ana_fio_verify_no_errors(multipath_report: Report) -> None:
    _ran_or_skip(multipath_report, "ana")
    multipath_report.assert_passed("ana_fio_start", "ana_fio_verify", "ana_no_io_errors", "ana_disconnect",
                                   "ana_teardown", "ana_logs_clean", "ana_clean_exit")


def _group_paths(report: Report, name: str) -> None:
    report.assert_passed(*(f"{name}_{c}" for c in (
        "setup", "initial_owner", "discovery_lists_both", "connect_a", "connect_b", "two_paths", "cntlids_disjoint",
        "initial_states", "list_subsys")))  # fmt: skip


def _group_failover(report: Report, name: str) -> None:
    report.assert_passed(*(f"{name}_{c}" for c in (
        "fio_start", "kill_owner", "rest_failover", "failover_logged", "list_subsys_failover",
        "fio_spans_failover", "restart_owner", "rest_failback", "fio_spans_failback", "list_subsys_failback",
        "subsys_json_states")))  # fmt: skip


def _group_data(report: Report, name: str) -> None:
    report.assert_passed(*(f"{name}_{c}" for c in (
        "fio_verify", "no_io_errors", "disconnect", "teardown", "logs_clean", "clean_exit")))  # fmt: skip


def test_group_dir_store_two_paths(multipath_report: Report) -> None:
    _ran_or_skip(multipath_report, "dir")
    _group_paths(multipath_report, "dir")


def test_group_dir_store_kill9_fails_over_and_back(multipath_report: Report) -> None:
    _ran_or_skip(multipath_report, "dir")
    _group_failover(multipath_report, "dir")


def test_group_dir_store_fio_verify_zero_errors(multipath_report: Report) -> None:
    _ran_or_skip(multipath_report, "dir")
    _group_data(multipath_report, "dir")


@pytest.mark.ceph
def test_group_rbd_two_paths(multipath_report: Report) -> None:
    _ran_or_skip(multipath_report, "rbd")
    _group_paths(multipath_report, "rbd")


@pytest.mark.ceph
def test_group_rbd_kill9_fails_over_and_back(multipath_report: Report) -> None:
    _ran_or_skip(multipath_report, "rbd")
    _group_failover(multipath_report, "rbd")


@pytest.mark.ceph
def test_group_rbd_fio_verify_zero_errors(multipath_report: Report) -> None:
    _ran_or_skip(multipath_report, "rbd")
    _group_data(multipath_report, "rbd")


def test_every_check_reported(multipath_report: Report) -> None:
    names = [n for n in SCENARIOS if f"{n}_setup" in multipath_report.checks]
    expected = {c for n in names for c in guest_checks(n) + host_checks(n)} | {"multipath_enabled"}
    missing = expected - set(multipath_report.checks)
    unknown = set(multipath_report.checks) - expected
    assert not missing and not unknown, (f"checks not reported: {sorted(missing)}; unexpected: {sorted(unknown)}; "
                                         f"{multipath_report.error}")

