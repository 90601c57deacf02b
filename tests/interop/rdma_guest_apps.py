"""Runs INSIDE the Debian guest (tests/interop/test_rdma_transport.py): our NVMe/RDMA target and initiator.

    python3 rdma_guest_apps.py target NQN ADDR PORT SIZE_MIB   # serve a RAM namespace over RDMA until killed
    python3 rdma_guest_apps.py initiator NQN ADDR PORT MIB     # connect, identify, write/read/verify MIB
    python3 rdma_guest_apps.py abuse NQN ADDR PORT 0           # rejected request, bad SGL, vanishing host

Each prints marker lines (TARGET-READY, INITIATOR-...) the test parses; failures exit non-zero with a
traceback.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import sys
import time


async def serve(nqn: str, addr: str, port: int, size_mib: int) -> None:
    from target.core import Target
    from target.service import TargetService

    target = Target()
    service = TargetService(target)
    await service.add_subsystem(nqn, allow_any_host=True)
    await service.add_namespace(nqn, backend="ram", size=size_mib << 20)
    await service.add_listener("rdma", addr, port)
    try:
        await service.add_listener("rdma", "0.0.0.0", port + 1)
    except Exception as exc:  # the wildcard refusal must name the reason
        print(f"TARGET-WILDCARD-REFUSED {exc}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print(f"TARGET-READY rdma://{addr}:{port} {nqn}", flush=True)
    await stop.wait()
    await target.close()
    print("TARGET-STOPPED", flush=True)


async def initiate(nqn: str, addr: str, port: int, mib: int) -> None:
    import initiator

    t0 = time.monotonic()
    async with initiator.connect(addr, port, nqn, transport="rdma", nr_io_queues=2, queue_size=32,
                                 timeout=20) as ctrl:
        ident = ctrl.identity
        print(f"INITIATOR-CONNECTED cntlid={ctrl.cntlid} sgls={ident.sgls:#x} mdts={ident.mdts} "
              f"ioccsz={ident.ioccsz} queues={len(ctrl.io_queues)} in {time.monotonic() - t0:.2f}s", flush=True)
        ns = await ctrl.identify_namespace(1)
        geo = await ctrl.namespace_geometry(1)
        print(f"INITIATOR-NS nsze={ns.nsze} block={geo.block_size}", flush=True)
        data = os.urandom(mib << 20)
        t1 = time.monotonic()
        await ctrl.write(1, 0, data)
        t2 = time.monotonic()
        back = await ctrl.read(1, 0, len(data) // geo.block_size)
        t3 = time.monotonic()
        small = os.urandom(geo.block_size)   # fits in-capsule on I/O queues
        await ctrl.write(1, 8, small)
        small_back = await ctrl.read(1, 8, 1)
        a, b = hashlib.sha256(data).hexdigest(), hashlib.sha256(bytes(back)).hexdigest()
        print(f"INITIATOR-SHA {a} {b} write {mib / (t2 - t1):.1f} MiB/s read {mib / (t3 - t2):.1f} MiB/s",
              flush=True)
        if a != b or bytes(small_back) != small:
            raise SystemExit("INITIATOR-MISMATCH")
    print("INITIATOR-OK", flush=True)


async def abuse(nqn: str, addr: str, port: int, _: int) -> None:
    """Bad peers: a rejected CM request, an SGL beyond the registered region, a host that vanishes."""
    import initiator
    from initiator.queue import TransportError
    from initiator.rdma import RdmaQueue

    q = RdmaQueue(1, queue_size=200, name="oversized")   # hsqsize 199 > MQES: the CM request is refused
    try:
        await q.open(addr, port, 10)
        raise SystemExit("ABUSE oversized queue was accepted")
    except TransportError as exc:
        print(f"ABUSE-REJECTED {exc}", flush=True)

    ctrl = await initiator.connect(addr, port, nqn, transport="rdma", nr_io_queues=1, queue_size=16, timeout=10)
    io = ctrl.io_queues[0]
    assert io.pool is not None
    io.pool.region.addr += 64 << 20   # the keyed SGL now names memory the rkey does not cover
    try:
        await ctrl.write(1, 0, os.urandom(64 << 10))
        raise SystemExit("ABUSE write through a bad SGL succeeded")
    except (TransportError, initiator.NvmeError) as exc:
        print(f"ABUSE-BAD-SGL {type(exc).__name__}: {exc}", flush=True)
    await ctrl.close()

    # a host that connects and dies without a word (a fresh process: verbs state does not survive fork)
    child = await asyncio.create_subprocess_exec(sys.executable, __file__, "vanish", nqn, addr, str(port), "0")
    status = await child.wait()
    print(f"ABUSE-VANISHED exit {status}", flush=True)
    await asyncio.sleep(1)
    print("ABUSE-DONE", flush=True)


async def vanish(nqn: str, addr: str, port: int, _: int) -> None:
    import initiator

    await initiator.connect(addr, port, nqn, transport="rdma", nr_io_queues=1, queue_size=16, timeout=10)
    print("ABUSE-VANISHING", flush=True)
    os._exit(0)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    role, nqn, addr, port, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    if role == "target":
        asyncio.run(serve(nqn, addr, port, size))
    elif role == "initiator":
        asyncio.run(initiate(nqn, addr, port, size))
    elif role == "abuse":
        asyncio.run(abuse(nqn, addr, port, size))
    elif role == "vanish":
        asyncio.run(vanish(nqn, addr, port, size))
    else:
        raise SystemExit(f"unknown role {role!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
