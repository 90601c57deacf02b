"""Raw TCP baseline: the same bytes as an NVMe/TCP job, over a plain asyncio socket pair on loopback.

No NVMe at all: a read is a 64-byte request answered by ``bs`` bytes, a write is a 64-byte request
followed by ``bs`` bytes answered by 16 bytes, with ``iodepth`` requests in flight on one
connection. It is what Python's asyncio itself costs for this traffic, so ``nvmeof bench`` can be
reported as a ratio to it.

    python3 benchmarks/baseline.py serve --port 15000
    python3 benchmarks/baseline.py client --port 15000 --rw randread --bs 4096 --iodepth 32 --runtime 3

The ping-pong pair measures the QD1 round trip with the hybrid polling of `--poll-us` on both ends
(issue 12): plain non-blocking sockets and ``selectors``, no asyncio; after handling what arrived,
each end keeps trying a non-blocking ``recv`` for up to N µs before it sleeps in ``select`` (SPDK's
pollers, the kernel's busy poll). ``--poll-us 0`` is the same pair without polling.

    python3 benchmarks/baseline.py pingserve --port 15001 --poll-us 50
    python3 benchmarks/baseline.py pingpong --port 15001 --bs 4096 --poll-us 50 --runtime 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import resource
import selectors
import socket
import struct
import sys
import time

REQUEST = struct.Struct("<IBxxxIQ44x")  # magic, op, length, tag: 64 bytes like an SQE
REQUEST_SIZE = REQUEST.size
REPLY_SIZE = 16                         # like a CQE
MAGIC = 0x52415754                      # "TWAR"
OP_READ, OP_WRITE = 0, 1


class _Server(asyncio.Protocol):
    """Answers requests in order; read payloads come from one preallocated buffer."""

    def __init__(self, payload: memoryview) -> None:
        self.payload = payload
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        out = _answer(self.buf, self.payload)
        assert self.transport is not None
        if out is None:
            self.transport.close()
        elif out:
            self.transport.writelines(out)


def _answer(buf: bytearray, payload: memoryview) -> list[bytes | memoryview] | None:
    """The replies to every complete request at the start of ``buf``, which loses those bytes (a read
    answers with ``payload``'s first bytes, a write with its tag); None for a bad request."""
    pos, n = 0, len(buf)
    out: list[bytes | memoryview] = []
    while n - pos >= REQUEST_SIZE:
        magic, op, length, tag = REQUEST.unpack_from(buf, pos)
        if magic != MAGIC or length > len(payload):
            return None
        if op == OP_READ:
            pos += REQUEST_SIZE
            out.append(payload[:length])
        else:
            if n - pos < REQUEST_SIZE + length:
                break
            pos += REQUEST_SIZE + length
            out.append(tag.to_bytes(REPLY_SIZE, "little"))
    if pos:
        del buf[:pos]
    return out


async def serve(host: str, port: int, max_bs: int) -> None:
    payload = memoryview(bytearray(os.urandom(max_bs)))
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Server(payload), host, port)
    print(f"ready {os.getpid()} {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


class _Client(asyncio.Protocol):
    """Pipelined requests on one connection; replies arrive in order, so a FIFO of waiters suffices."""

    def __init__(self) -> None:
        self.waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self.need = 0          # bytes still missing for the oldest reply
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        n = len(data)
        waiters = self.waiters
        while n:
            if not self.need:
                self.need = waiters[0][0]
            take = n if n < self.need else self.need
            self.need -= take
            n -= take
            if not self.need:
                fut = waiters.popleft()[1]
                if not fut.done():
                    fut.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        for _, fut in self.waiters:
            if not fut.done():
                fut.set_exception(ConnectionError("baseline server closed the connection"))


async def client(host: str, port: int, rw: str, bs: int, iodepth: int, runtime: float,
                 ramp: float, server_pid: int | None) -> dict[str, float | int | str]:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(_Client, host, port)
    transport = proto.transport
    assert transport is not None
    is_read = "read" in rw
    reply_len = bs if is_read else REPLY_SIZE
    start = time.perf_counter_ns()
    mstart = start + int(ramp * 1e9)
    deadline = mstart + int(runtime * 1e9)
    stats = {"ios": 0, "lat_ns": 0}
    marks: dict[str, tuple[float, float]] = {}

    def snap() -> tuple[float, float]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime, _proc_cpu(server_pid) if server_pid else 0.0

    async def slot(i: int) -> None:
        request = REQUEST.pack(MAGIC, OP_READ if is_read else OP_WRITE, bs, i)
        data = memoryview(bytearray(os.urandom(bs)))
        clock = time.perf_counter_ns
        while True:
            t0 = clock()
            if t0 >= deadline:
                return
            fut = loop.create_future()
            proto.waiters.append((reply_len, fut))
            if is_read:
                transport.write(request)
            else:
                transport.writelines((request, data))
            await fut
            t1 = clock()
            if t0 >= mstart:
                stats["ios"] += 1
                stats["lat_ns"] += t1 - t0

    def measure_start() -> None:
        marks["start"] = snap()

    loop.call_later(ramp, measure_start)
    await asyncio.gather(*(slot(i) for i in range(iodepth)))
    end = snap()
    elapsed = (time.perf_counter_ns() - mstart) / 1e9
    transport.close()
    ios = stats["ios"]
    c0, s0 = marks.get("start", (0.0, 0.0))
    return {
        "rw": rw, "bs": bs, "iodepth": iodepth, "ios": ios, "runtime_s": elapsed,
        "iops": ios / elapsed, "bw_bytes": ios * bs / elapsed,
        "mean_lat_ns": stats["lat_ns"] / ios if ios else 0.0,
        "client_cpu_us_per_io": (end[0] - c0) * 1e6 / ios if ios else 0.0,
        "server_cpu_us_per_io": (end[1] - s0) * 1e6 / ios if ios and server_pid else None,
    }


class _PingConn:
    """One connection of the ping-pong server: requests in, read payloads (or write replies) out."""

    def __init__(self, sock: socket.socket, payload: memoryview) -> None:
        self.sock = sock
        self.payload = payload
        self.buf = bytearray()

    def pump(self) -> int | None:
        """Take what the socket has and answer every complete request; bytes received (0: nothing
        there now), or None when the peer closed or sent garbage."""
        try:
            data = self.sock.recv(1 << 18)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            return None
        if not data:
            return None
        self.buf += data
        out = _answer(self.buf, self.payload)
        if out is None:
            return None
        if out:
            _send_all(self.sock, out)
        return len(data)


def _send_all(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """sendmsg until everything left; a full socket buffer (rare at QD1) waits in select."""
    views = [memoryview(p) for p in parts]
    while views:
        try:
            sent = sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            _wait(sock, selectors.EVENT_WRITE)
            continue
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _wait(sock: socket.socket, events: int) -> None:
    with selectors.DefaultSelector() as sel:
        sel.register(sock, events)
        sel.select()


def ping_serve(host: str, port: int, max_bs: int, poll_us: int) -> None:
    """The ping-pong server: one ``selectors`` loop over every connection; with ``poll_us``, after a
    round of work it retries non-blocking receives on every connection for up to that long (the
    window restarts whenever something arrives) before sleeping in ``select``."""
    payload = memoryview(bytearray(os.urandom(max_bs)))
    listener = socket.create_server((host, port), reuse_port=False)
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    conns: dict[int, _PingConn] = {}
    poll_ns = poll_us * 1000
    clock = time.perf_counter_ns
    print(f"ready {os.getpid()} {host}:{port} poll_us={poll_us}", flush=True)

    def drop(conn: _PingConn) -> None:
        conns.pop(conn.sock.fileno(), None)
        sel.unregister(conn.sock)
        conn.sock.close()

    while True:
        for key, _ in sel.select():
            if key.data is None:
                try:
                    sock, _addr = listener.accept()
                except BlockingIOError:
                    continue
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = _PingConn(sock, payload)
                conns[sock.fileno()] = conn
                sel.register(sock, selectors.EVENT_READ, conn)
            elif key.data.pump() is None:
                drop(key.data)
        if not poll_ns:
            continue
        until = clock() + poll_ns
        while conns and clock() < until:
            for conn in list(conns.values()):
                got = conn.pump()
                if got is None:
                    drop(conn)
                elif got:
                    until = clock() + poll_ns


def ping_client(host: str, port: int, bs: int, poll_us: int, runtime: float, ramp: float,
                server_pid: int | None) -> dict[str, float | int | str | None]:
    """QD1 4 KiB-style reads, one at a time: send the request, then poll a non-blocking ``recv_into``
    for up to ``poll_us`` before waiting in ``select``, until the whole reply is in."""
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    request = REQUEST.pack(MAGIC, OP_READ, bs, 0)
    buf = memoryview(bytearray(bs))
    poll_ns = poll_us * 1000
    clock = time.perf_counter_ns
    start = clock()
    mstart = start + int(ramp * 1e9)
    deadline = mstart + int(runtime * 1e9)
    ios = lat = 0
    c0 = s0 = 0.0
    measuring = False
    while True:
        t0 = clock()
        if t0 >= deadline:
            break
        if not measuring and t0 >= mstart:
            measuring = True
            c0, s0 = _rusage_cpu(), _proc_cpu(server_pid) if server_pid else 0.0
        sock.send(request)
        got = 0
        while got < bs:
            try:
                n = sock.recv_into(buf[got:])
            except BlockingIOError:
                if poll_ns and clock() - t0 < poll_ns:
                    continue
                sel.select()
                continue
            if n == 0:
                raise SystemExit("ping-pong server closed the connection")
            got += n
        if measuring:
            ios += 1
            lat += clock() - t0
    c1, s1 = _rusage_cpu(), _proc_cpu(server_pid) if server_pid else 0.0
    elapsed = (clock() - mstart) / 1e9
    sock.close()
    return {
        "rw": "randread", "bs": bs, "iodepth": 1, "poll_us": poll_us, "ios": ios, "runtime_s": elapsed,
        "iops": ios / elapsed if elapsed > 0 else 0.0, "bw_bytes": ios * bs / elapsed if elapsed > 0 else 0.0,
        "mean_lat_ns": lat / ios if ios else 0.0,
        "client_cpu_us_per_io": (c1 - c0) * 1e6 / ios if ios else 0.0,
        "server_cpu_us_per_io": (s1 - s0) * 1e6 / ios if ios and server_pid else None,
    }


def _rusage_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    fields = raw[raw.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the echo server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--max-bs", type=int, default=1 << 20)
    c = sub.add_parser("client", help="run one job against the server and print JSON")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--rw", choices=["read", "randread", "write", "randwrite"], required=True)
    c.add_argument("--bs", type=int, required=True)
    c.add_argument("--iodepth", type=int, default=1)
    c.add_argument("--runtime", type=float, default=3.0)
    c.add_argument("--ramp", type=float, default=0.5)
    c.add_argument("--server-pid", type=int, default=None)
    ps = sub.add_parser("pingserve", help="run the ping-pong server (selectors, optional polling)")
    ps.add_argument("--host", default="127.0.0.1")
    ps.add_argument("--port", type=int, required=True)
    ps.add_argument("--max-bs", type=int, default=1 << 20)
    ps.add_argument("--poll-us", type=int, default=0, help="busy-poll window after each round of work")
    pp = sub.add_parser("pingpong", help="run one QD1 read ping-pong against pingserve and print JSON")
    pp.add_argument("--host", default="127.0.0.1")
    pp.add_argument("--port", type=int, required=True)
    pp.add_argument("--bs", type=int, default=4096)
    pp.add_argument("--poll-us", type=int, default=0, help="busy-poll window before sleeping in select")
    pp.add_argument("--runtime", type=float, default=3.0)
    pp.add_argument("--ramp", type=float, default=0.5)
    pp.add_argument("--server-pid", type=int, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "pingserve":
        try:
            ping_serve(args.host, args.port, args.max_bs, args.poll_us)
        except KeyboardInterrupt:
            pass
        return 0
    if args.cmd == "pingpong":
        json.dump(ping_client(args.host, args.port, args.bs, args.poll_us, args.runtime, args.ramp,
                              args.server_pid), sys.stdout)
        sys.stdout.write("\n")
        return 0
    if args.cmd == "serve":
        try:
            asyncio.run(serve(args.host, args.port, args.max_bs))
        except KeyboardInterrupt:
            pass
        return 0
    result = asyncio.run(client(args.host, args.port, args.rw, args.bs, args.iodepth, args.runtime,
                                args.ramp, args.server_pid))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
