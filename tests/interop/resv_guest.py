"""Runs INSIDE the Debian guest (test_kernel_reservations.py): NVMe persistent reservations refereed by Linux.

Stdlib only. The kernel host runs with native multipath off (``nvme_core.multipath=N`` on the kernel command
line), so every controller has its own block device and each `nvme connect --hostnqn/--hostid` is one more
host identity in this one guest: A (the holder), B (a second registrant) and C (never registered).

Scenarios (RESV_SCENARIOS, comma-separated):

- ``single``: our `nvmeof serve` alone. nvme-cli `resv-register`, `resv-acquire`, `resv-report --eds -o json`
  and `resv-release` for every reservation type 1..6, each followed by O_DIRECT `dd` reads and writes from
  A, B and C that must succeed or fail with EBADE (the block layer's errno for Reservation Conflict) exactly
  as the spec's access table says (ACCESS below), the refused writes leaving the blocks untouched; then a
  preempt (B with A's key) and a clear.
- ``ioctl``: the block layer's IOC_PR_REGISTER / RESERVE / PREEMPT / RELEASE / CLEAR (linux/pr.h, the API of
  cluster managers) on the same devices, each effect read back with resv-report and enforced on dd.
- ``mask``: per-host namespace visibility (masking) on another subsystem of the same `nvmeof serve`, whose
  NSID 2 only A sees: `nvme list-ns` and the controllers' namespaces in sysfs differ between A and B; the test
  makes NSID 2 visible to B and hides it from A over REST, and each change reaches the connected controller
  through the Namespace Attribute Changed event (no reconnect, no `nvme ns-rescan`).
- ``group``: two gateways of a gateway group; A registers and acquires Exclusive Access through gateway a,
  B and C see conflicts through gateway b at once, gateway a is killed with SIGKILL (the test does it at a
  host step), and after failover the reservation still holds through b: B and C are refused, A's identity
  reconnected through b is still the holder and writes.

Output, one line per event on the script's own serial port: ``@@CHECK <name> PASS|FAIL <s>s <reason>@@`` (the
table test_kernel_host.py parses), ``@@INFO k=v@@``, ``@@HOST <step>@@`` where the test acts (the guest then
polls the test's HTTP barrier RESV_GO until it lists the step) and ``@@RESV <label> <json>@@`` for every
reservation report, which the test re-checks on its side.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import re
import struct
import subprocess
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BLOCK = 4096  # one dd transfer; the namespaces have 512-byte LBAs
ZERO = bytes(BLOCK)

# NVMe reservation types (Reservation Acquire RTYPE); linux/pr.h numbers its enum pr_type the same way and
# nvme_pr_type() (drivers/nvme/host/pr.c) maps one to the other one to one.
WE, EA, WE_RO, EA_RO, WE_AR, EA_AR = 1, 2, 3, 4, 5, 6
TYPE_NAMES = {WE: "write-exclusive", EA: "exclusive-access", WE_RO: "write-exclusive-registrants-only",
              EA_RO: "exclusive-access-registrants-only", WE_AR: "write-exclusive-all-registrants",
              EA_AR: "exclusive-access-all-registrants"}
ALL_REGISTRANTS = (WE_AR, EA_AR)

# The spec's "Command Behavior in the Presence of a Reservation" for the three roles here, (read, write):
# True = allowed, False = Reservation Conflict. The holder is always allowed; with an all-registrants type
# every registrant is a holder.
ACCESS: dict[int, dict[str, tuple[bool, bool]]] = {
    WE:    {"holder": (True, True), "registrant": (True, False), "other": (True, False)},
    EA:    {"holder": (True, True), "registrant": (False, False), "other": (False, False)},
    WE_RO: {"holder": (True, True), "registrant": (True, True), "other": (True, False)},
    EA_RO: {"holder": (True, True), "registrant": (True, True), "other": (False, False)},
    WE_AR: {"holder": (True, True), "registrant": (True, True), "other": (True, False)},
    EA_AR: {"holder": (True, True), "registrant": (True, True), "other": (False, False)},
}  # fmt: skip

# linux/pr.h: _IOW('p', nr, struct) and the structs' layouts (all little-endian on x86-64)
_IOC_WRITE = 1


def _iow(nr: int, size: int) -> int:
    return (_IOC_WRITE << 30) | (size << 16) | (ord("p") << 8) | nr


PR_REGISTRATION = struct.Struct("<QQII")  # old_key, new_key, flags, __pad
PR_RESERVATION = struct.Struct("<QII")    # key, type, flags
PR_PREEMPT = struct.Struct("<QQII")       # old_key, new_key, type, flags
PR_CLEAR = struct.Struct("<QII")          # key, flags, __pad
IOC_PR_REGISTER = _iow(200, PR_REGISTRATION.size)
IOC_PR_RESERVE = _iow(201, PR_RESERVATION.size)
IOC_PR_RELEASE = _iow(202, PR_RESERVATION.size)
IOC_PR_PREEMPT = _iow(203, PR_PREEMPT.size)
IOC_PR_CLEAR = _iow(205, PR_CLEAR.size)
# 6.5 and later return enum pr_status for a device status (nvme_sc_to_pr_err); 6.1 returns the NVMe status
# field itself (with DNR/More), which its status code 0x83 identifies.
PR_STS_RESERVATION_CONFLICT = 0x18
NVME_SC_RESERVATION_CONFLICT = 0x83

T = os.environ.get("RESV_T", "10.0.2.2")
GO = os.environ.get("RESV_GO", "")
SCENARIOS = [s for s in os.environ.get("RESV_SCENARIOS", "single,ioctl,group").split(",") if s]
IDS: dict[str, dict[str, str]] = json.loads(os.environ.get("RESV_IDS", "{}"))
SINGLE: dict[str, Any] = json.loads(os.environ.get("RESV_SINGLE", "{}"))  # nqn, port
GROUP: dict[str, Any] = json.loads(os.environ.get("RESV_GROUP", "{}"))    # nqn, port_a, port_b
MASK: dict[str, Any] = json.loads(os.environ.get("RESV_MASK", "{}"))      # nqn, port
KERNEL = os.uname().release


# ------------------------------------------------------------------------------- output and checks

def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _clean(text: str, limit: int = 400) -> str:
    return re.sub(r"\s+", " ", text.replace("@", "(at)")).strip()[:limit]


def info(**pairs: object) -> None:
    emit("@@INFO " + " ".join(f"{k}={_clean(str(v), 200).replace(' ', '_')}" for k, v in pairs.items()) + "@@")


class CheckFailed(Exception):
    pass


def check(cond: object, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


def run(name: str, fn: Callable[..., object], *args: object, **kwargs: object) -> bool:
    """One check: PASS when ``fn`` returns, FAIL (with the exception as reason) when it raises; goes on."""
    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        for line in traceback.format_exc().splitlines()[-12:]:
            emit(f"    | {line}")
        emit(f"@@CHECK {name} FAIL {int(time.monotonic() - t0)}s {_clean(f'{type(exc).__name__}: {exc}')}@@")
        return False
    emit(f"@@CHECK {name} PASS {int(time.monotonic() - t0)}s@@")
    return True


def host_step(name: str) -> None:
    """The test acts now (or inspects the target); wait until its barrier lists the step."""
    emit(f"@@HOST {name}@@")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(GO, timeout=5) as resp:
                if name in resp.read().decode().split():
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise CheckFailed(f"the test did not release step {name} within 240 s")


def released(name: str) -> bool:
    try:
        with urllib.request.urlopen(GO, timeout=5) as resp:
            return name in resp.read().decode().split()
    except OSError:
        return False


# ------------------------------------------------------------------------------- guest tools

def sh(*cmd: str, data: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(list(cmd), input=data, capture_output=True, timeout=timeout, check=False)


def nvme(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nvme", *args], capture_output=True, text=True, timeout=60, check=False)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def dmesg_tail(n: int = 15, pattern: str = "nvme") -> list[str]:
    out = sh("dmesg").stdout.decode(errors="replace").splitlines()
    return [line for line in out if pattern in line][-n:]


@dataclass
class Ctrl:
    """One kernel controller of one host identity, with its own block device (multipath off)."""

    who: str
    name: str  # nvme3
    dev: str   # /dev/nvme3n1
    cntlid: int
    port: int


@dataclass
class Host:
    """The guest's host identities and their controllers, by scenario."""

    ctrls: dict[str, Ctrl] = field(default_factory=dict)  # key "<scenario>-<who>"


HOSTS = Host()


def connect(key: str, who: str, nqn: str, port: int, *, reconnect_delay: int = 0, ctrl_loss_tmo: int = 0) -> None:
    """Connect one controller as host identity ``who``, writing the options to /dev/nvme-fabrics as libnvme does.

    Not `nvme connect`: bookworm's nvme-cli 2.3 refuses a second host NQN to the same port and subsystem as
    "already connected", even with --duplicate-connect; the kernel itself tells host identities apart.
    """
    ident = IDS[who]
    before = set(os.listdir("/sys/class/nvme")) if os.path.isdir("/sys/class/nvme") else set()
    opts = f"nqn={nqn},transport=tcp,traddr={T},trsvcid={port},hostnqn={ident['hostnqn']},hostid={ident['hostid']}"
    if reconnect_delay:
        opts += f",reconnect_delay={reconnect_delay}"
    if ctrl_loss_tmo:
        opts += f",ctrl_loss_tmo={ctrl_loss_tmo}"
    try:
        fd = os.open("/dev/nvme-fabrics", os.O_RDWR)
        try:
            os.write(fd, opts.encode())
            answer = os.read(fd, 4096).decode(errors="replace").strip()
        finally:
            os.close(fd)
    except OSError as exc:
        raise CheckFailed(f"connecting as {who} to port {port}: {exc}; {dmesg_tail(3)}") from None
    info(**{f"{key}_fabrics": answer})
    new = [c for c in sorted(set(os.listdir("/sys/class/nvme")) - before)
           if _read(f"/sys/class/nvme/{c}/subsysnqn") == nqn]
    check(len(new) == 1, f"expected one new controller of {nqn}, found {new}")
    name = new[0]
    check(_read(f"/sys/class/nvme/{name}/hostnqn") == ident["hostnqn"], f"{name}'s hostnqn is not {who}'s")
    check(_read(f"/sys/class/nvme/{name}/hostid") == ident["hostid"], f"{name}'s hostid is not {who}'s")
    dev = ""
    deadline = time.monotonic() + 30
    while not dev and time.monotonic() < deadline:
        for node in glob.glob(f"/sys/class/nvme/{name}/nvme*n*"):
            # multipath off: the namespace node under the controller is the block device itself (no nvmeXcYnZ)
            base = os.path.basename(node)
            if re.fullmatch(r"nvme\d+n\d+", base) and os.path.exists(f"/dev/{base}"):
                dev = f"/dev/{base}"
        if not dev:
            time.sleep(0.1)
    check(dev, f"{name} has no block device nvmeXnY after 30 s: {os.listdir(f'/sys/class/nvme/{name}')}")
    cntlid = int(_read(f"/sys/class/nvme/{name}/cntlid"))
    HOSTS.ctrls[key] = Ctrl(who, name, dev, cntlid, port)
    info(**{f"{key}_ctrl": name, f"{key}_dev": dev, f"{key}_cntlid": cntlid})


def ctrl(key: str) -> Ctrl:
    c = HOSTS.ctrls.get(key)
    check(c is not None, f"no controller {key} (its connect failed)")
    assert c is not None
    return c


def disconnect(key: str) -> None:
    c = HOSTS.ctrls.pop(key, None)
    check(c is not None, f"no controller {key} to disconnect")
    assert c is not None
    res = nvme("disconnect", "-d", c.name)
    check(res.returncode == 0, f"nvme disconnect -d {c.name} exited {res.returncode}: {res.stderr.strip()}")
    deadline = time.monotonic() + 15
    while os.path.exists(f"/sys/class/nvme/{c.name}"):
        check(time.monotonic() < deadline, f"{c.name} still present 15 s after disconnect")
        time.sleep(0.1)


def check_multipath_off() -> None:
    mp = _read("/sys/module/nvme_core/parameters/multipath")
    info(kernel=KERNEL, nvme_core_multipath=mp, nvme_cli=nvme("version").stdout.split("\n")[0])
    check(mp == "N", f"nvme_core.multipath is {mp!r}: the two identities would share one multipath head")


# -- reservation commands through nvme-cli

def resv(key: str, action: str, *args: str) -> subprocess.CompletedProcess[str]:
    c = ctrl(key)
    return nvme(f"resv-{action}", c.dev, *args)


def resv_ok(key: str, action: str, *args: str) -> None:
    res = resv(key, action, *args)
    check(res.returncode == 0, f"nvme resv-{action} {' '.join(args)} on {key} exited {res.returncode}: "
          f"{(res.stdout + res.stderr).strip()}")


def resv_conflict(key: str, action: str, *args: str) -> None:
    res = resv(key, action, *args)
    out = (res.stdout + res.stderr).strip()
    # nvme-cli 2.3 prints "NVMe status: Reservation Conflict: ...(0x4083)"; newer ones RESERVATION_CONFLICT
    check(res.returncode != 0 and re.search(r"reservation.conflict", out, re.IGNORECASE),
          f"nvme resv-{action} {' '.join(args)} on {key}: expected Reservation Conflict, got exit "
          f"{res.returncode}: {out}")


def register(key: str, rkey: int) -> None:
    resv_ok(key, "register", f"--nrkey={rkey:#x}", "--rrega=0")


def acquire(key: str, crkey: int, rtype: int) -> None:
    resv_ok(key, "acquire", f"--crkey={crkey:#x}", f"--rtype={rtype}", "--racqa=0")


def release(key: str, crkey: int, rtype: int) -> None:
    resv_ok(key, "release", f"--crkey={crkey:#x}", f"--rtype={rtype}", "--rrela=0")


@dataclass
class Report:
    gen: int
    rtype: int
    ptpls: int
    regs: dict[str, dict[str, int]]  # hostid (32 hex digits) -> {"rkey", "rcsts", "cntlid"}
    raw: dict[str, Any]


def report(key: str, label: str) -> Report:
    """nvme-cli's view (`resv-report --eds -o json`): NVMe-oF host identifiers are 128-bit, so EDS is a must."""
    res = resv(key, "report", "--eds", "-o", "json")
    check(res.returncode == 0, f"nvme resv-report --eds on {key} exited {res.returncode}: "
          f"{(res.stdout + res.stderr).strip()}")
    try:
        doc = json.loads(res.stdout)
    except ValueError as exc:
        raise CheckFailed(f"resv-report -o json printed no JSON ({exc}): {res.stdout[:300]!r}") from None
    emit(f"@@RESV {label} {json.dumps(doc, separators=(',', ':'))}@@")
    entries = doc.get("regctlext", doc.get("regctls", []))
    check(isinstance(entries, list), f"resv-report JSON without a registrant list: {doc}")
    check(int(doc.get("regctl", -1)) == len(entries), f"regctl {doc.get('regctl')} but {len(entries)} entries")
    regs = {}
    for e in entries:
        regs[str(e["hostid"]).lower()] = {"rkey": int(e["rkey"]), "rcsts": int(e["rcsts"]),
                                          "cntlid": int(e["cntlid"])}
    return Report(int(doc["gen"]), int(doc["rtype"]), int(doc.get("ptpls", 0)), regs, doc)


def hostid_hex(who: str) -> str:
    return IDS[who]["hostid"].replace("-", "").lower()


def expect_report(rep: Report, *, rtype: int, keys: dict[str, int], holders: set[str], what: str) -> None:
    """The report names exactly ``keys``' hosts with their keys, ``holders`` with RCSTS bit 0, and ``rtype``."""
    want = {hostid_hex(w): k for w, k in keys.items()}
    got = {h: r["rkey"] for h, r in rep.regs.items()}
    names = {hostid_hex(w): w for w in IDS}
    pretty = {names.get(h, h): f"{k:#x}/rcsts={rep.regs[h]['rcsts']}" for h, k in got.items()}
    check(rep.rtype == rtype, f"{what}: report rtype {rep.rtype}, expected {rtype}; registrants {pretty}")
    check(got == want, f"{what}: registrants {pretty}, expected "
          f"{ {w: f'{k:#x}' for w, k in keys.items()} }")
    held = {names.get(h, h) for h, r in rep.regs.items() if r["rcsts"] & 1}
    check(held == holders, f"{what}: RCSTS holder bit set for {sorted(held)}, expected {sorted(holders)}")


# -- I/O through dd (O_DIRECT): what the block layer returns is the referee's verdict

def pattern(tag: str) -> bytes:
    seed = tag.encode()
    return (seed + b"." + os.urandom(16).hex().encode() + b"|") * (BLOCK // (len(seed) + 34) + 1)


def dd_read(dev: str, block: int) -> tuple[str, bytes]:
    res = sh("dd", f"if={dev}", f"bs={BLOCK}", "count=1", f"skip={block}", "iflag=direct", "status=none")
    return _verdict(res), res.stdout


def dd_write(dev: str, block: int, data: bytes) -> str:
    res = sh("dd", f"of={dev}", f"bs={BLOCK}", "count=1", f"seek={block}", "oflag=direct", "status=none",
             data=data[:BLOCK])
    return _verdict(res)


def _verdict(res: subprocess.CompletedProcess[bytes]) -> str:
    """ok, conflict (EBADE: the block layer's errno for NVMe Reservation Conflict), or the error itself."""
    if res.returncode == 0:
        return "ok"
    err = res.stderr.decode(errors="replace").strip()
    if "Invalid exchange" in err:  # strerror(EBADE)
        return "conflict"
    return "error: " + err


class Blocks:
    """Hands out fresh blocks (never written before, so still zero) for each write probe."""

    def __init__(self, first: int) -> None:
        self.next = first

    def take(self) -> int:
        self.next += 1
        return self.next - 1


_UNVERIFIED: list[tuple[str, int, bytes]] = []


def probe(keys: dict[str, str], expect: dict[str, tuple[bool, bool]], blocks: Blocks, verifier: str | None,
          what: str) -> None:
    """Read and write from each ``keys`` controller (role -> key); compare with ``expect`` (role -> (read,
    write) allowed); then read every probed block back through ``verifier`` (an always-allowed controller;
    None: no such path now): an allowed write left its data, a refused one left the block as it was (zero)."""
    seen, problems, written = {}, [], []
    t_max = 0.0
    for role, key in keys.items():
        dev = ctrl(key).dev
        block = blocks.take()
        t0 = time.monotonic()
        r, _ = dd_read(dev, block)
        data = pattern(f"{what}-{role}")
        w = dd_write(dev, block, data)
        t_max = max(t_max, (time.monotonic() - t0) / 2)
        seen[role] = (r, w)
        for op, verdict, allowed in (("read", r, expect[role][0]), ("write", w, expect[role][1])):
            if verdict != ("ok" if allowed else "conflict"):
                problems.append(f"{role} ({key}) {op}: {verdict}, expected {'ok' if allowed else 'conflict'}")
        written.append((role, block, data if w == "ok" else ZERO))
    if verifier is None:
        _UNVERIFIED.extend(written)  # the next probe with a verifier reads them back
    else:
        written += _UNVERIFIED
        _UNVERIFIED.clear()
    vdev = ctrl(verifier).dev if verifier is not None else ""
    for role, block, want in written if verifier is not None else ():
        r, got = dd_read(vdev, block)
        if r != "ok" or got != want[:BLOCK]:
            problems.append(f"{role}'s block {block} read back through {verifier}: {r}, "
                            f"{'its write' if want is not ZERO else 'zeros'} expected, got {got[:24]!r}")
    info(**{f"{what}_access": ",".join(f"{role}:{r[0][:8]}/{r[1][:8]}" for role, r in seen.items()),
            f"{what}_dd_max_s": f"{t_max:.2f}"})
    if problems:
        for line in dmesg_tail(6):
            emit(f"    dmesg| {line}")
    check(not problems, f"{what}: " + "; ".join(problems))


# ------------------------------------------------------------------------------- scenario: single target

KA, KB = 0xA1A1_0000_0000_00A1, 0xB2B2_0000_0000_00B2  # A's and B's reservation keys


def single() -> None:
    nqn, port = SINGLE["nqn"], int(SINGLE["port"])
    for who in "abc":
        run(f"single_connect_{who}", connect, f"s-{who}", who, nqn, port)
    run("single_distinct_cntlids", lambda: check(
        len({ctrl(f"s-{w}").cntlid for w in "abc"}) == 3,
        f"cntlids {[ctrl(f's-{w}').cntlid for w in 'abc']}"))
    state: dict[str, int] = {}

    def empty_report() -> None:
        rep = report("s-c", "single-initial")
        expect_report(rep, rtype=0, keys={}, holders=set(), what="before any registration")
        state["gen"] = rep.gen

    def reg_both() -> None:
        register("s-a", KA)
        register("s-b", KB)
        rep = report("s-c", "single-registered")
        expect_report(rep, rtype=0, keys={"a": KA, "b": KB}, holders=set(), what="A and B registered")
        # the spec: Generation counts successful Register, Preempt and Clear (not Acquire or Release)
        check(rep.gen == state["gen"] + 2, f"generation {rep.gen} after two registers, was {state['gen']}")
        state["gen"] = rep.gen
        own = {w: ctrl(f"s-{w}").cntlid for w in "ab"}
        got = {w: rep.regs[hostid_hex(w)]["cntlid"] for w in "ab"}
        info(single_report_cntlids=got, single_connect_cntlids=own)
        # CNTLID of an extended entry: the host's controller, or FFFFh (dynamic controller model)
        check(all(got[w] in (own[w], 0xFFFF) for w in "ab"), f"report cntlids {got}, controllers {own}")

    def no_eds_refused() -> None:
        res = resv("s-a", "report", "-o", "json")
        out = (res.stdout + res.stderr).strip()
        info(single_report_without_eds=f"exit_{res.returncode}:{out[:120]}")
        # 128-bit host identifiers (every fabrics host) only fit the extended data structure: Host Identifier
        # Inconsistent Format (02h/18h... generic 18h) for EDS=0
        check(res.returncode != 0 and re.search(r"HOST_ID|0x4018|0x18\)", out),
              f"resv-report without --eds: exit {res.returncode}: {out[:300]}")

    run("single_report_empty", empty_report)
    run("single_register_a_b", reg_both)
    run("single_report_without_eds_refused", no_eds_refused)
    blocks = Blocks(1024)
    roles = {"holder": "s-a", "registrant": "s-b", "other": "s-c"}

    for rtype in range(1, 7):
        t = f"single_t{rtype}"

        def acq(rtype: int = rtype, t: str = t) -> None:
            acquire("s-a", KA, rtype)
            rep = report("s-c", f"{t}-acquired")
            holders = {"a", "b"} if rtype in ALL_REGISTRANTS else {"a"}
            expect_report(rep, rtype=rtype, keys={"a": KA, "b": KB}, holders=holders,
                          what=f"A acquired {TYPE_NAMES[rtype]}")
            check(rep.gen == state["gen"], f"generation moved on Acquire: {state['gen']} -> {rep.gen}")

        def rel(rtype: int = rtype, t: str = t) -> None:
            release("s-a", KA, rtype)
            rep = report("s-c", f"{t}-released")
            expect_report(rep, rtype=0, keys={"a": KA, "b": KB}, holders=set(), what="A released")
            check(rep.gen == state["gen"], f"generation moved on Release: {state['gen']} -> {rep.gen}")

        run(f"{t}_acquire", acq)
        run(f"{t}_access", probe, roles, ACCESS[rtype], blocks, "s-a", t)
        run(f"{t}_release", rel)
        run(f"{t}_restored", probe, roles, {r: (True, True) for r in roles}, blocks, "s-a", f"{t}-released")

    def conflicts() -> None:
        acquire("s-a", KA, WE)
        resv_conflict("s-b", "acquire", f"--crkey={KB:#x}", f"--rtype={WE}", "--racqa=0")
        resv_conflict("s-a", "acquire", f"--crkey={KA + 1:#x}", f"--rtype={WE}", "--racqa=0")  # wrong key
        # a registrant that does not hold the reservation releases it: success without effect
        resv_ok("s-b", "release", f"--crkey={KB:#x}", f"--rtype={WE}", "--rrela=0")
        rep = report("s-c", "single-refusals")
        expect_report(rep, rtype=WE, keys={"a": KA, "b": KB}, holders={"a"},
                      what="after B's acquire, A's wrong key and B's release")
        check(rep.gen == state["gen"], f"generation moved: {state['gen']} -> {rep.gen}")

    def preempt() -> None:
        resv_ok("s-b", "acquire", f"--crkey={KB:#x}", f"--prkey={KA:#x}", f"--rtype={EA}", "--racqa=1")
        rep = report("s-c", "single-preempted")
        expect_report(rep, rtype=EA, keys={"b": KB}, holders={"b"}, what="B preempted A into exclusive access")
        check(rep.gen == state["gen"] + 1, f"generation {rep.gen} after the preempt, was {state['gen']}")
        state["gen"] = rep.gen

    def reregister() -> None:
        register("s-a", KA)
        rep = report("s-c", "single-reregistered")
        expect_report(rep, rtype=EA, keys={"a": KA, "b": KB}, holders={"b"}, what="A registered again")
        state["gen"] = rep.gen

    def clear() -> None:
        resv_ok("s-b", "release", f"--crkey={KB:#x}", "--rrela=1")
        rep = report("s-c", "single-cleared")
        expect_report(rep, rtype=0, keys={}, holders=set(), what="B cleared")
        check(rep.gen == state["gen"] + 1, f"generation {rep.gen} after the clear, was {state['gen']}")

    run("single_acquire_refusals", conflicts)
    run("single_preempt", preempt)
    preempted = {"holder": "s-b", "preempted": "s-a", "other": "s-c"}
    run("single_preempted_access", probe, preempted, {"holder": (True, True), "preempted": (False, False),
                                                      "other": (False, False)}, blocks, "s-b", "preempted")
    run("single_reregister_still_refused", reregister)
    run("single_rest_view", host_step, "single-rest")  # the test compares the target's REST view
    run("single_reregistered_access", probe, {"registrant": "s-a"}, {"registrant": (False, False)}, blocks,
        "s-b", "reregistered")
    run("single_clear", clear)
    run("single_cleared_access", probe, roles, {r: (True, True) for r in roles}, blocks, "s-c", "cleared")


# ------------------------------------------------------------------------------- scenario: block-layer ioctls

def pr_ioctl(key: str, request: int, payload: bytes) -> int:
    """The ioctl's return value: 0, or the device's status (the kernel returns it as a positive number)."""
    buf = bytearray(payload)
    fd = os.open(ctrl(key).dev, os.O_RDWR)
    try:
        return fcntl.ioctl(fd, request, buf, True)
    finally:
        os.close(fd)


def is_conflict(rc: int) -> bool:
    if re.match(r"6\.1\.", KERNEL):
        return rc > 0 and rc & 0xFF == NVME_SC_RESERVATION_CONFLICT and (rc >> 8) & 0x7 == 0
    return rc == PR_STS_RESERVATION_CONFLICT


def ioc_ok(what: str, key: str, request: int, payload: bytes) -> None:
    rc = pr_ioctl(key, request, payload)
    check(rc == 0, f"{what} on {key} returned {rc:#x}")


IKA, IKB, IKB2 = 0x1A_0000_0001, 0x1B_0000_0001, 0x1B_0000_0002
PR = {"WE": 1, "EA": 2, "WE_RO": 3}  # linux/pr.h PR_WRITE_EXCLUSIVE, PR_EXCLUSIVE_ACCESS, ..._REG_ONLY


def ioctl() -> None:
    # the single scenario's controllers (A, B, C on our target); a clear left no registration behind
    blocks = Blocks(4096)
    roles = {"holder": "s-a", "registrant": "s-b", "other": "s-c"}
    state: dict[str, int] = {}

    def register_both() -> None:
        start = report("s-c", "ioctl-initial")
        expect_report(start, rtype=0, keys={}, holders=set(), what="before the ioctls")
        # nvme_pr_register: Register (old key 0) with CPTPL 11b, as the kernel sends it on every register
        ioc_ok("IOC_PR_REGISTER", "s-a", IOC_PR_REGISTER, PR_REGISTRATION.pack(0, IKA, 0, 0))
        ioc_ok("IOC_PR_REGISTER", "s-b", IOC_PR_REGISTER, PR_REGISTRATION.pack(0, IKB, 0, 0))
        rep = report("s-c", "ioctl-registered")
        expect_report(rep, rtype=0, keys={"a": IKA, "b": IKB}, holders=set(), what="IOC_PR_REGISTER of A, B")
        check(rep.gen == start.gen + 2, f"generation {start.gen} -> {rep.gen} after two registers")
        info(ioctl_ptpls_after_register=rep.ptpls)
        state["gen"] = rep.gen

    def replace() -> None:
        # an old key turns the kernel's register into Replace (RREGA 010b)
        ioc_ok("IOC_PR_REGISTER(replace)", "s-b", IOC_PR_REGISTER, PR_REGISTRATION.pack(IKB, IKB2, 0, 0))
        rep = report("s-c", "ioctl-replaced")
        expect_report(rep, rtype=0, keys={"a": IKA, "b": IKB2}, holders=set(), what="B replaced its key")

    def reserve() -> None:
        ioc_ok("IOC_PR_RESERVE", "s-a", IOC_PR_RESERVE, PR_RESERVATION.pack(IKA, PR["EA"], 0))
        rep = report("s-c", "ioctl-reserved")
        expect_report(rep, rtype=EA, keys={"a": IKA, "b": IKB2}, holders={"a"}, what="A IOC_PR_RESERVE EA")

    def reserve_refused() -> None:
        rc = pr_ioctl("s-b", IOC_PR_RESERVE, PR_RESERVATION.pack(IKB2, PR["EA"], 0))
        info(ioctl_reserve_conflict_rc=f"{rc:#x}")
        check(is_conflict(rc), f"B's IOC_PR_RESERVE while A holds: {rc:#x}, expected Reservation Conflict")
        rc = pr_ioctl("s-a", IOC_PR_RESERVE, PR_RESERVATION.pack(IKA + 7, PR["EA"], 0))
        check(is_conflict(rc), f"A's IOC_PR_RESERVE with a wrong key: {rc:#x}, expected Reservation Conflict")

    def preempt() -> None:
        ioc_ok("IOC_PR_PREEMPT", "s-b", IOC_PR_PREEMPT, PR_PREEMPT.pack(IKB2, IKA, PR["WE"], 0))
        rep = report("s-c", "ioctl-preempted")
        expect_report(rep, rtype=WE, keys={"b": IKB2}, holders={"b"}, what="B IOC_PR_PREEMPT A into WE")
        check(rep.gen == state["gen"] + 2, f"generation {state['gen']} -> {rep.gen} after replace + preempt")

    def release_() -> None:
        ioc_ok("IOC_PR_RELEASE", "s-b", IOC_PR_RELEASE, PR_RESERVATION.pack(IKB2, PR["WE"], 0))
        rep = report("s-c", "ioctl-released")
        expect_report(rep, rtype=0, keys={"b": IKB2}, holders=set(), what="B IOC_PR_RELEASE")

    def reserve_ro() -> None:
        ioc_ok("IOC_PR_REGISTER", "s-a", IOC_PR_REGISTER, PR_REGISTRATION.pack(0, IKA, 0, 0))
        ioc_ok("IOC_PR_RESERVE", "s-b", IOC_PR_RESERVE, PR_RESERVATION.pack(IKB2, PR["WE_RO"], 0))
        rep = report("s-c", "ioctl-reserved-ro")
        expect_report(rep, rtype=WE_RO, keys={"a": IKA, "b": IKB2}, holders={"b"},
                      what="B IOC_PR_RESERVE write-exclusive-registrants-only")

    def clear() -> None:
        ioc_ok("IOC_PR_CLEAR", "s-a", IOC_PR_CLEAR, PR_CLEAR.pack(IKA, 0, 0))
        rep = report("s-c", "ioctl-cleared")
        expect_report(rep, rtype=0, keys={}, holders=set(), what="A IOC_PR_CLEAR")

    run("ioctl_register", register_both)
    run("ioctl_register_replace", replace)
    run("ioctl_reserve_ea", reserve)
    run("ioctl_reserve_ea_access", probe, roles, ACCESS[EA], blocks, "s-a", "ioctl-ea")
    run("ioctl_reserve_refused", reserve_refused)
    run("ioctl_preempt", preempt)
    run("ioctl_preempt_access", probe, {"holder": "s-b", "preempted": "s-a", "other": "s-c"},
        {"holder": (True, True), "preempted": (True, False), "other": (True, False)}, blocks, "s-b",
        "ioctl-preempted")
    run("ioctl_release", release_)
    run("ioctl_release_access", probe, roles, {r: (True, True) for r in roles}, blocks, "s-a", "ioctl-released")
    run("ioctl_reserve_we_ro", reserve_ro)
    run("ioctl_reserve_we_ro_access", probe, {"holder": "s-b", "registrant": "s-a", "other": "s-c"},
        ACCESS[WE_RO], blocks, "s-b", "ioctl-we-ro")
    run("ioctl_clear", clear)
    run("ioctl_clear_access", probe, roles, {r: (True, True) for r in roles}, blocks, "s-c", "ioctl-cleared")


# ------------------------------------------------------------------------------- scenario: gateway group

GKA, GKB = 0x6A, 0x6B


def group() -> None:
    nqn, pa, pb = GROUP["nqn"], int(GROUP["port_a"]), int(GROUP["port_b"])
    # a short loss timeout: A's path to the killed gateway is given up (and disconnected) by the script
    opts = {"reconnect_delay": 1, "ctrl_loss_tmo": 30}
    run("group_connect_a_via_a", connect, "g-a", "a", nqn, pa, **opts)
    run("group_connect_b_via_b", connect, "g-b", "b", nqn, pb, **opts)
    run("group_connect_c_via_b", connect, "g-c", "c", nqn, pb, **opts)
    blocks = Blocks(2048)
    kept: dict[str, Any] = {}

    def reg() -> None:
        register("g-a", GKA)
        register("g-b", GKB)
        rep = report("g-b", "group-registered-via-b")
        expect_report(rep, rtype=0, keys={"a": GKA, "b": GKB}, holders=set(),
                      what="A registered through gateway a, B through b, reported through b")

    def acq() -> None:
        acquire("g-a", GKA, EA)
        rep = report("g-c", "group-acquired-via-b")
        expect_report(rep, rtype=EA, keys={"a": GKA, "b": GKB}, holders={"a"},
                      what="A acquired exclusive access through a, reported through b")

    def holder_write() -> None:
        block = blocks.take()
        data = pattern("group-a-before-kill")
        check(dd_write(ctrl("g-a").dev, block, data) == "ok", "A's write through gateway a refused")
        kept["block"], kept["data"] = block, data

    run("group_register", reg)
    run("group_acquire_ea", acq)
    run("group_holder_writes_via_a", holder_write)
    others = {"registrant": "g-b", "other": "g-c"}
    refused = {"registrant": (False, False), "other": (False, False)}
    run("group_conflicts_via_b", probe, others, refused, blocks, "g-a", "group-before-kill")
    run("group_kill_a", host_step, "group-kill")

    def report_after() -> None:
        rep = report("g-b", "group-after-failover")
        expect_report(rep, rtype=EA, keys={"a": GKA, "b": GKB}, holders={"a"},
                      what="after gateway a was killed, reported through b")

    run("group_report_after_failover", report_after)
    run("group_rest_view", host_step, "group-rest")  # gateway b's REST view: A holds, A and B registered
    # no path can read the probed blocks back now (A's is dead, B and C are refused): checked further down
    run("group_conflicts_after_failover", probe, others, refused, blocks, None, "group-after-failover")
    run("group_disconnect_dead_path", disconnect, "g-a")
    run("group_reconnect_a_via_b", connect, "g-a2", "a", nqn, pb, **opts)

    def holder_via_b() -> None:
        rep = report("g-a2", "group-holder-via-b")
        expect_report(rep, rtype=EA, keys={"a": GKA, "b": GKB}, holders={"a"}, what="A's identity through b")
        r, got = dd_read(ctrl("g-a2").dev, kept.get("block", 0))
        check(r == "ok" and got == kept.get("data", b"")[:BLOCK],
              f"A's block written through a, read through b: {r}, {got[:24]!r}")

    run("group_holder_reads_via_b", holder_via_b)
    # the probe's reads through B must fail (EA), so verify through A's new path
    run("group_holder_and_others_via_b", probe, {"holder": "g-a2", **others},
        {"holder": (True, True), **refused}, blocks, "g-a2", "group-after-kill")

    def clear() -> None:
        resv_ok("g-a2", "release", f"--crkey={GKA:#x}", "--rrela=1")
        rep = report("g-b", "group-cleared")
        expect_report(rep, rtype=0, keys={}, holders=set(), what="A cleared through b")

    run("group_clear", clear)
    run("group_cleared_access", probe, others, {r: (True, True) for r in others}, blocks, "g-a2", "group-cleared")
    run("group_disconnect_a2", disconnect, "g-a2")
    run("group_disconnect_b", disconnect, "g-b")
    run("group_disconnect_c", disconnect, "g-c")
    run("group_teardown", host_step, "group-teardown")


# ------------------------------------------------------------------------------- scenario: masking

MASK_EVENT_WAIT = 30.0  # the AEN -> scan work -> sysfs path takes well under a second; TCG is slow


def ns_in_sysfs(key: str) -> list[int]:
    """The NSIDs the kernel attached under one controller (multipath off: its nvmeXnY disks)."""
    c = ctrl(key)
    found = []
    for node in glob.glob(f"/sys/class/nvme/{c.name}/nvme*n*"):
        if re.fullmatch(r"nvme\d+n\d+", os.path.basename(node)) and os.path.exists(f"{node}/nsid"):
            found.append(int(_read(f"{node}/nsid")))
    return sorted(found)


def list_ns(key: str) -> list[int]:
    """`nvme list-ns` (Identify CNS 02h) on the controller's character device."""
    res = nvme("list-ns", f"/dev/{ctrl(key).name}")
    check(res.returncode == 0, f"nvme list-ns /dev/{ctrl(key).name} exited {res.returncode}: {res.stderr.strip()}")
    return sorted(int(m, 16) for m in re.findall(r"\]:\s*(0x[0-9a-fA-F]+)", res.stdout))


def sees(key: str, nsids: list[int]) -> None:
    got = (list_ns(key), ns_in_sysfs(key))
    check(got == (nsids, nsids), f"{key}: list-ns {got[0]}, sysfs {got[1]}; expected {nsids}")


def sees_after_event(key: str, nsids: list[int]) -> None:
    """The change must reach the connected controller by itself (AEN, log 04h, scan): poll sysfs, then compare."""
    deadline = time.monotonic() + MASK_EVENT_WAIT
    while ns_in_sysfs(key) != nsids and time.monotonic() < deadline:
        time.sleep(0.2)
    if ns_in_sysfs(key) != nsids:
        before = ns_in_sysfs(key)
        nvme("ns-rescan", f"/dev/{ctrl(key).name}")
        time.sleep(2)
        raise CheckFailed(f"{key} shows NSIDs {before} {MASK_EVENT_WAIT:.0f} s after the change, expected {nsids} "
                          f"(after `nvme ns-rescan`: {ns_in_sysfs(key)}); {dmesg_tail(5)}")
    sees(key, nsids)


def masking() -> None:
    nqn, port = MASK["nqn"], int(MASK["port"])
    run("mask_setup", host_step, "mask-setup")  # NSID 1 for every allowed host, NSID 2 only for A
    run("mask_connect_a", connect, "m-a", "a", nqn, port)
    run("mask_connect_b", connect, "m-b", "b", nqn, port)
    run("mask_a_sees_1_2", sees, "m-a", [1, 2])
    run("mask_b_sees_1", sees, "m-b", [1])

    def b_cannot_read_2() -> None:
        # Identify Namespace of an NSID B does not see: an inactive NSID, all zeros (nsze 0)
        res = nvme("id-ns", f"/dev/{ctrl('m-b').name}", "--namespace-id=2", "-o", "json")
        check(res.returncode == 0 and json.loads(res.stdout or "{}").get("nsze") == 0,
              f"id-ns NSID 2 through B: exit {res.returncode}, {res.stdout[:200]!r} {res.stderr.strip()}")

    run("mask_b_id_ns_inactive", b_cannot_read_2)
    run("mask_show_b", host_step, "mask-add-b")
    run("mask_b_gains_2_live", sees_after_event, "m-b", [1, 2])
    run("mask_a_keeps_1_2", sees, "m-a", [1, 2])

    def b_reads_2() -> None:
        c = ctrl("m-b")
        disks = [os.path.basename(n) for n in glob.glob(f"/sys/class/nvme/{c.name}/nvme*n*")
                 if re.fullmatch(r"nvme\d+n\d+", os.path.basename(n)) and _read(f"{n}/nsid") == "2"]
        check(disks, f"B has no disk of NSID 2: {os.listdir(f'/sys/class/nvme/{c.name}')}")
        check(dd_read(f"/dev/{disks[0]}", 0)[0] == "ok", f"reading /dev/{disks[0]} (NSID 2 through B) failed")

    run("mask_b_reads_2", b_reads_2)
    run("mask_hide_a", host_step, "mask-remove-a")
    run("mask_a_loses_2_live", sees_after_event, "m-a", [1])
    run("mask_b_keeps_1_2", sees, "m-b", [1, 2])
    run("mask_disconnect_a", disconnect, "m-a")
    run("mask_disconnect_b", disconnect, "m-b")


# ------------------------------------------------------------------------------- main

def main() -> int:
    os.system("dmesg -n 1")
    info(scenarios=",".join(SCENARIOS))
    run("multipath_off", check_multipath_off)
    began = time.monotonic()
    if "single" in SCENARIOS:
        single()
        info(single_seconds=f"{time.monotonic() - began:.1f}")
    if "ioctl" in SCENARIOS:
        t0 = time.monotonic()
        if "single" not in SCENARIOS:
            for who in "abc":
                run(f"single_connect_{who}", connect, f"s-{who}", who, SINGLE["nqn"], int(SINGLE["port"]))
        ioctl()
        info(ioctl_seconds=f"{time.monotonic() - t0:.1f}")
    if "mask" in SCENARIOS:   # on the single scenario's target, before its teardown
        t0 = time.monotonic()
        masking()
        info(mask_seconds=f"{time.monotonic() - t0:.1f}")
    if "single" in SCENARIOS or "ioctl" in SCENARIOS:
        for who in "abc":
            run(f"single_disconnect_{who}", disconnect, f"s-{who}")
        run("single_teardown", host_step, "single-teardown")
    if "group" in SCENARIOS:
        t0 = time.monotonic()
        group()
        info(group_seconds=f"{time.monotonic() - t0:.1f}")
    for line in dmesg_tail(40, "nvme"):
        emit(f"    dmesg| {line}")
    emit("@@HOST all-done@@")
    deadline = time.monotonic() + 120
    while not released("done") and time.monotonic() < deadline:
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
