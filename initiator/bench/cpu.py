"""CPU accounting: this process through getrusage, target processes through /proc."""

from __future__ import annotations

import ipaddress
import os
import resource

from initiator.bench.jobspec import BenchError


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return 100


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads) from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError as e:
        raise BenchError(f"--target-pid {pid}: cannot read /proc/{pid}/stat ({e.strerror})") from None
    # the command name may contain spaces and parentheses: fields start after the last ')'
    fields = raw[raw.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _clock_ticks()


def target_cpu_seconds(pids: tuple[int, ...]) -> float:
    """CPU time of the target processes and their live descendants (worker processes)."""
    seen: set[int] = set()
    todo = list(pids)
    total = 0.0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            total += process_cpu_seconds(pid)
        except BenchError:
            if pid in pids:
                raise
            continue  # a descendant that exited meanwhile
        todo += _children(pid)
    return total


def rusage_seconds() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def local_listener_pid(traddr: str, port: int) -> int | None:
    """The PID of the process listening on ``traddr:port`` if it runs on this machine, else None.

    Reads /proc/net/tcp{,6} for a LISTEN socket on the port (bound to that address or a wildcard) and
    finds the process holding that socket inode; None where /proc does not say (another host, a
    container boundary, or no permission).
    """
    try:
        local = ipaddress.ip_address(traddr)
    except ValueError:
        return None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            addr_hex, port_hex = fields[1].rsplit(":", 1)
            if fields[3] != "0A" or int(port_hex, 16) != port:  # 0A = TCP_LISTEN
                continue
            bound = _proc_net_address(addr_hex)
            if bound is None or bound.is_unspecified or bound == local or (
                    bound.version == 6 and bound.ipv4_mapped == local):
                inodes.add(fields[9])
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return int(pid)
            except OSError:
                continue
    return None


def _proc_net_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """/proc/net/tcp prints addresses as host-order 32-bit words in hex."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words) if len(words) in (4, 16) else None
