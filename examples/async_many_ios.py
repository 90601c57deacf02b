"""Many commands in flight with the asyncio API, spread over two I/O queues, all verified.

    NVMEOF_TRADDR=127.0.0.1 NVMEOF_TRSVCID=4420 NVMEOF_NQN=nqn... python3 examples/async_many_ios.py
"""

from __future__ import annotations

import asyncio
import os
import time

import initiator

TRADDR = os.environ.get("NVMEOF_TRADDR", "127.0.0.1")
TRSVCID = int(os.environ.get("NVMEOF_TRSVCID", "4420"))
NQN = os.environ.get("NVMEOF_NQN", "nqn.2026-11.io.nvmeof-toolkit:example")
COUNT = 512


async def main() -> None:
    async with initiator.connect(TRADDR, TRSVCID, subnqn=NQN, nr_io_queues=2, queue_size=64) as ctrl:
        nsid = (await ctrl.namespaces())[0]
        blocks = [os.urandom(4096) for _ in range(COUNT)]
        start = time.perf_counter()
        # 4 KiB writes to LBA 8*i: the controller spreads them over both I/O queues
        await asyncio.gather(*(ctrl.write(nsid, 8 * i, b) for i, b in enumerate(blocks)))
        back = await asyncio.gather(*(ctrl.read(nsid, 8 * i, 8) for i in range(COUNT)))
        elapsed = time.perf_counter() - start
        bad = [i for i, (a, b) in enumerate(zip(blocks, back, strict=True)) if a != b]
        if bad:
            raise SystemExit(f"{len(bad)} blocks differ, first at LBA {8 * bad[0]}")
        print(f"{2 * COUNT} I/Os of 4 KiB verified in {elapsed:.2f} s ({2 * COUNT / elapsed:.0f} IOPS)")


if __name__ == "__main__":
    asyncio.run(main())
