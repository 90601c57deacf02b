"""`nvmeof serve` as a subprocess for the interoperability tests.

`serve_target()` starts our target on free loopback ports with a RAM-disk namespace and the REST API,
waits until the REST API answers and both NVMe/TCP listeners accept connections, captures the
daemon's stderr log to a file, and on exit stops it with SIGTERM and asserts a clean exit status.
No pytest dependency beyond plain asserts, so ad-hoc scripts can use it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.interop import vm
from tests.procs import stop_process

SUBNQN = "nqn.2026-11.io.nvmeof-toolkit:interop"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0

_REPO = Path(__file__).resolve().parents[2]
# A line as logging.basicConfig formats it in nvmeof/cli/__init__.py: "<date> <time> LEVEL logger: message".
_LOG_LEVEL_RE = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ", re.MULTILINE)


@dataclasses.dataclass
class OurTarget:
    """A running `nvmeof serve`: where it listens and how to drive its REST API."""

    subnqn: str
    traddr: str  # host-side address of the listeners (127.0.0.1)
    io_port: int
    discovery_port: int
    api_url: str  # http://127.0.0.1:PORT/api/v1
    size: int  # namespace 1 size in bytes
    block_size: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    client: httpx.Client

    # -- REST helpers (each asserts success and names the call that failed)

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = self.client.request(method, self.api_url + path, **kwargs)
        assert resp.is_success, f"REST {method} {path} answered {resp.status_code}: {resp.text}"
        return resp.json() if resp.content else None

    def controllers(self) -> list[dict[str, Any]]:
        return self.api("GET", "/controllers")

    def add_namespace(self, size: int, *, nsid: int | None = None, block_size: int | None = None) -> dict:
        body: dict[str, Any] = {"backend": "ram", "size": size, "block_size": block_size or self.block_size}
        if nsid is not None:
            body["nsid"] = nsid
        return self.api("POST", f"/subsystems/{self.subnqn}/namespaces", json=body)

    def resize_namespace(self, nsid: int, size: int) -> dict:
        return self.api("POST", f"/subsystems/{self.subnqn}/namespaces/{nsid}/resize", json={"size": size})

    def remove_namespace(self, nsid: int) -> None:
        self.api("DELETE", f"/subsystems/{self.subnqn}/namespaces/{nsid}")

    # -- log inspection

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_lines(self, *levels: str) -> list[str]:
        """Log lines at one of `levels` (ERROR, WARNING, ...), continuation lines of tracebacks included."""
        out = []
        current: str | None = None
        for line in self.log_text().splitlines():
            match = _LOG_LEVEL_RE.match(line)
            if match:
                current = match.group(1)
            if current in levels:
                out.append(line)
        return out

    def log_errors(self) -> list[str]:
        """ERROR and CRITICAL log lines (tracebacks included), and any traceback printed outside logging
        (an unhandled exception in a callback): what makes a target log unclean."""
        return self.log_lines("ERROR", "CRITICAL") + [
            line for line in self.log_text().splitlines() if line.startswith("Traceback")]

    def assert_no_errors(self) -> None:
        bad = self.log_errors()
        assert not bad, f"target log {self.log_path} has errors:\n" + "\n".join(bad[:40])


def _wait_listening(port: int, deadline: float) -> None:
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _start(log_path: Path, *, subnqn: str, size: str, block_size: int, extra_args: Sequence[str] = (),
           ports: Sequence[int] | None = None, append_log: bool = False) -> OurTarget:
    # `ports` (io, discovery, api): a restarted daemon comes back where the hosts knew it.
    io_port, disc_port, api_port = ports if ports is not None else vm.free_ports(3)
    # The daemon's own state directory (its API token file), next to its log.
    state_dir = log_path.parent / "nvmeof-state"
    cmd = [
        sys.executable, "-m", "nvmeof.cli", "--log-level", "info", "serve",
        "--nqn", subnqn,
        "--ramdisk-size", size,
        "--block-size", str(block_size),
        "--listen", f"127.0.0.1:{io_port}",
        "--discovery", f"127.0.0.1:{disc_port}",
        "--api", f"127.0.0.1:{api_port}",
        "--state-dir", str(state_dir),
        *extra_args,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("NVMEOF_API_TOKEN", None)
    log = open(log_path, "ab" if append_log else "wb")  # the child writes it; ours is closed once it started
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env,
                                cwd=_REPO)
    finally:
        log.close()
    client = httpx.Client(timeout=10)
    api_url = f"http://127.0.0.1:{api_port}/api/v1"
    health_url = f"http://127.0.0.1:{api_port}/health"  # the only route open without the token
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"nvmeof serve exited with status {proc.returncode} at start:\n"
                                     f"{log_path.read_text(errors='replace')[-3000:]}")
            try:
                if client.get(health_url).is_success:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"nvmeof serve's REST API did not answer within {START_TIMEOUT:g} s:\n"
                                     f"{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        _wait_listening(io_port, deadline)
        _wait_listening(disc_port, deadline)
        # Every other route needs the token `nvmeof serve` generated and wrote (0600) to its state directory.
        token = (state_dir / "api-token").read_text().strip()
        client.headers["Authorization"] = f"Bearer {token}"
        sub = client.get(f"{api_url}/subsystems/{subnqn}").json()
        # A gateway of a group may start before the group's configuration gave it namespace 1.
        ns1 = next((ns for ns in sub.get("namespaces", []) if ns["nsid"] == 1), {"size": 0, "block_size": block_size})
    except BaseException:
        client.close()
        _stop(proc)
        raise
    return OurTarget(subnqn=subnqn, traddr="127.0.0.1", io_port=io_port, discovery_port=disc_port, api_url=api_url,
                     size=ns1["size"], block_size=ns1["block_size"], log_path=log_path, proc=proc, client=client)


def _stop(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM, wait; SIGKILL if it hangs. Returns the exit status, or None if it had to be killed."""
    return stop_process(proc, STOP_TIMEOUT)


def start_serve(log_path: Path, *, subnqn: str = SUBNQN, size: str = "128M", block_size: int = 512,
                extra_args: Sequence[str] = (), ports: Sequence[int] | None = None,
                append_log: bool = False) -> OurTarget:
    """Start `nvmeof serve` outside a `with` block, for tests that kill and restart it (stop it with
    stop_serve). `ports` (io, discovery, api) reuses a previous run's; `append_log` keeps its log."""
    return _start(log_path, subnqn=subnqn, size=size, block_size=block_size, extra_args=extra_args, ports=ports,
                  append_log=append_log)


def stop_serve(target: OurTarget) -> int | None:
    """SIGTERM (SIGKILL after STOP_TIMEOUT s); the exit status, or None if it had to be killed."""
    target.client.close()
    return _stop(target.proc)


@contextlib.contextmanager
def serve_target(log_dir: Path, *, subnqn: str = SUBNQN, size: str = "128M", block_size: int = 512,
                 check_clean_exit: bool = True, extra_args: Sequence[str] = ()) -> Iterator[OurTarget]:
    """Run `nvmeof serve` for the duration of the block; its stderr goes to `log_dir/nvmeof-serve.log`.

    `extra_args` are appended to the `serve` command line (e.g. ("--workers", "2")).

    On exit the daemon gets SIGTERM and must exit 0 within STOP_TIMEOUT s (asserted unless
    `check_clean_exit` is false or the block raised).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "nvmeof-serve.log"
    target = _start(log_path, subnqn=subnqn, size=size, block_size=block_size, extra_args=extra_args)
    failed = True
    try:
        yield target
        failed = False
    finally:
        target.client.close()
        code = _stop(target.proc)
    if check_clean_exit and not failed:
        assert code == 0, (f"nvmeof serve did not exit cleanly on SIGTERM (status {code}); log {log_path}:\n"
                           f"{target.log_text()[-3000:]}")


class IcSniffer:
    """A TCP forwarder from 127.0.0.1:`port` to 127.0.0.1:`target_port` that records, per connection,
    the digest byte of the NVMe/TCP ICReq (host -> target) and ICResp (target -> host).

    The kernel exposes no negotiated digests in sysfs; this proves what both ends agreed on.
    """

    IC_DIGEST_OFFSET = 11  # after the 8-byte common header, pfv (2 B) and hpda/cpda (1 B): bit 0 HDGST, bit 1 DDGST

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.icreq_digests: list[int] = []
        self.icresp_digests: list[int] = []
        # {PDU type: count} of the target's PDUs when a test asks for them (None: not counted)
        self.pdu_counts: dict[int, int] | None = None
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._socks: list[socket.socket] = []
        self._upstream_ports: list[int] = []   # the local port of each connection made to the target
        self._thread = threading.Thread(target=self._accept, daemon=True, name="ic-sniffer")
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._socks += [client, upstream]
                self._upstream_ports.append(upstream.getsockname()[1])
            threading.Thread(target=self._pump, args=(client, upstream, self.icreq_digests), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.icresp_digests), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, digests: list[int]) -> None:
        head = b""
        counts = self.pdu_counts if digests is self.icresp_digests else None
        pdu_head, skip = b"", 0   # the PDU walk: a common header being gathered, payload bytes still to pass
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                i = 0
                while counts is not None and i < len(data):
                    if skip:
                        n = min(skip, len(data) - i)
                        skip -= n
                        i += n
                        continue
                    take = data[i:i + 8 - len(pdu_head)]
                    pdu_head += take
                    i += len(take)
                    if len(pdu_head) == 8:
                        with self._lock:
                            counts[pdu_head[0]] = counts.get(pdu_head[0], 0) + 1
                        skip = int.from_bytes(pdu_head[4:8], "little") - 8
                        pdu_head = b""
                if len(head) <= self.IC_DIGEST_OFFSET:
                    head += data[: self.IC_DIGEST_OFFSET + 1 - len(head)]
                    if len(head) > self.IC_DIGEST_OFFSET:
                        with self._lock:
                            digests.append(head[self.IC_DIGEST_OFFSET])
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def count_pdus(self) -> dict[int, int]:
        """The PDUs the target sent on every connection so far, by PDU type (pdu_counts must be set before the
        first connection; connections without digests only: the walk follows PLEN)."""
        with self._lock:
            return dict(self.pdu_counts or {})

    def upstream_ports(self) -> set[int]:
        """The local ports of the connections this forwarder opened to the target, so far."""
        with self._lock:
            return set(self._upstream_ports)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for s in self._socks:
                s.close()
