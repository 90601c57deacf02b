"""NVM command set I/O for HostController: Read, Write, Compare, Flush, Write Zeroes, Dataset Management.

Requests larger than one command may carry are split by MDTS (Identify ``mdts``) and by the 16-bit
NLB field, and the pieces run in parallel on the least busy I/O queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from construct import Container

from initiator import commands as c
from initiator.engine import BatchQueue
from initiator.queue import DEFAULT_TIMEOUT, HostQueue
from nvmeof.spec.identify import flbas_index
from nvmeof.spec.nvme import DSM_AD, DSM_RANGE_SIZE, Command, Completion, DsmRange, IoOpcode
from nvmeof.status import NvmeError, Status

Buffer = bytes | bytearray | memoryview

MAX_NLB = 65536              # CDW12 NLB is 16 bits, 0's based
MAX_DSM_RANGES = 256
_READ = int(IoOpcode.READ)
_WRITE = int(IoOpcode.WRITE)
_COMPARE = int(IoOpcode.COMPARE)


@dataclasses.dataclass(frozen=True, slots=True)
class NamespaceGeometry:
    nsid: int
    block_size: int
    nsze: int


class NvmIo:
    """The I/O half of :class:`initiator.controller.HostController` (which provides these attributes)."""

    io_queues: list[HostQueue]
    mdts_bytes: int
    subnqn: str
    _rr: int
    _ns_cache: dict[int, NamespaceGeometry]

    def _queue_name(self, qid: int) -> str:
        raise NotImplementedError

    async def identify_namespace(self, nsid: int) -> Container:
        raise NotImplementedError


    def _io_queue(self) -> HostQueue:
        queues = self.io_queues
        if not queues:
            raise RuntimeError(f"{self._queue_name(0)}: the controller has no I/O queues")
        n = len(queues)
        if n == 1:
            return queues[0]
        self._rr = (self._rr + 1) % n
        best = queues[self._rr]
        for q in queues:
            if q.inflight < best.inflight:
                best = q
        return best

    async def io_command(self, cmd: Command, *, data_out: Buffer | None = None,
                         data_in: bytearray | memoryview | None = None,
                         timeout: Any = DEFAULT_TIMEOUT) -> Completion:
        """Send any I/O command on the least busy I/O queue (passthrough)."""
        return await self._io_queue().submit(cmd, data_out=data_out, data_in=data_in, timeout=timeout)

    async def namespace_geometry(self, nsid: int) -> NamespaceGeometry:
        geo = self._ns_cache.get(nsid)
        if geo is None:
            ns = await self.identify_namespace(nsid)
            if ns.nsze == 0:
                raise NvmeError(Status.INVALID_NS, f"namespace {nsid} is not active on {self.subnqn} "
                                "(Identify Namespace returned NSZE 0)")
            lbads = ns.lbaf[flbas_index(ns.flbas)].lbads
            if not 9 <= lbads <= 16:
                raise RuntimeError(f"namespace {nsid}: LBA data size 2**{lbads} is not supported")
            geo = NamespaceGeometry(nsid, 1 << lbads, ns.nsze)
            self._ns_cache[nsid] = geo
        return geo

    def _max_blocks(self, block_size: int) -> int:
        if self.mdts_bytes:
            return max(1, min(MAX_NLB, self.mdts_bytes // block_size))
        return MAX_NLB

    async def _run_all(self, coros: Sequence[Any]) -> None:
        """Run the pieces of one request in parallel; wait for all, then raise the first failure."""
        if len(coros) == 1:
            await coros[0]
            return
        results = await asyncio.gather(*coros, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    def _start_one(self, opcode: int, nsid: int, slba: int, nlb: int, view: memoryview,
                   write: bool) -> asyncio.Future[None] | None:
        """A transfer that fits one command, started on the batch engine's callback path
        (``BatchQueue.start_awaitable``: one Future, no Task, dict entry or Command object, the engine's fast
        PDU parsing, sends of one loop iteration batched); None where it cannot go that way (not a batch
        queue, above MDTS, no cid free right now): the caller takes :meth:`_transfer`."""
        queues = self.io_queues
        queue = queues[0] if len(queues) == 1 else self._io_queue()
        if not isinstance(queue, BatchQueue) or nlb > MAX_NLB or (self.mdts_bytes and len(view) > self.mdts_bytes):
            return None
        return queue.start_awaitable(opcode, nsid, slba, nlb, view, write)

    async def _transfer(self, opcode: int, nsid: int, slba: int, nlb: int, view: memoryview | None,
                        bs: int, *, write: bool, fua: bool = False) -> None:
        step = self._max_blocks(bs)
        if nlb <= step:
            # One command: straight to a queue, without the gather machinery.
            cmd = c.rw(opcode, nsid, slba, nlb, fua=fua)
            if write:
                await self._io_queue().submit(cmd, data_out=view)
            else:
                await self._io_queue().submit(cmd, data_in=view)
            return
        pieces = []
        for first in range(0, nlb, step):
            n = min(step, nlb - first)
            cmd = c.rw(opcode, nsid, slba + first, n, fua=fua)
            part = view[first * bs:(first + n) * bs] if view is not None else None
            if write:
                pieces.append(self.io_command(cmd, data_out=part))
            else:
                pieces.append(self.io_command(cmd, data_in=part))
        await self._run_all(pieces)

    async def read(self, nsid: int, slba: int, nlb: int, *,
                   buf: bytearray | memoryview | None = None) -> bytes | None:
        """Read ``nlb`` blocks at ``slba``; returns bytes, or fills ``buf`` (and returns None)."""
        if not 0 <= slba < 1 << 64 or nlb < 1:
            _check_lba(slba, nlb)
        geo = self._ns_cache.get(nsid)
        bs = (geo or await self.namespace_geometry(nsid)).block_size
        total = nlb * bs
        out = None
        if buf is None:
            out = bytearray(total)
            view = memoryview(out)
        else:
            view = memoryview(buf) if type(buf) is bytearray else _byte_view(buf)
            if view.readonly:
                raise ValueError("buf must be writable (bytearray or writable memoryview)")
            if len(view) != total:
                if len(view) < total:
                    raise ValueError(f"buf holds {len(view)} bytes; {nlb} blocks of {bs} need {total}")
                view = view[:total]
        # _start_one, inlined for one batch queue (the commonest case, once per I/O)
        queues = self.io_queues
        queue = queues[0] if len(queues) == 1 else None
        if isinstance(queue, BatchQueue) and nlb <= MAX_NLB and (total <= self.mdts_bytes or not self.mdts_bytes):
            fut = queue.start_awaitable(_READ, nsid, slba, nlb, view, False)
        else:
            fut = self._start_one(_READ, nsid, slba, nlb, view, False)
        if fut is not None:
            await fut
        else:
            await self._transfer(_READ, nsid, slba, nlb, view, bs, write=False)
        return None if out is None else bytes(out)

    async def _data_blocks(self, nsid: int, data: Buffer) -> tuple[memoryview, int, int]:
        view = _byte_view(data)
        bs = (await self.namespace_geometry(nsid)).block_size
        return view, bs, _whole_blocks(view, nsid, bs)

    async def write(self, nsid: int, slba: int, data: Buffer, *, fua: bool = False) -> None:
        geo = self._ns_cache.get(nsid)
        if geo is None:
            view, bs, nlb = await self._data_blocks(nsid, data)
        else:
            # The cached geometry spares a coroutine per I/O; the checks are _data_blocks' own.
            view = memoryview(data) if type(data) is bytes or type(data) is bytearray else _byte_view(data)
            bs = geo.block_size
            nlb = _whole_blocks(view, nsid, bs)
        if not 0 <= slba < 1 << 64:
            _check_lba(slba, nlb)
        # FUA is a CDW12 bit the engine's capsule does not carry: such writes take submit()
        fut = None if fua else self._start_one(_WRITE, nsid, slba, nlb, view, True)
        if fut is not None:
            await fut
        else:
            await self._transfer(_WRITE, nsid, slba, nlb, view, bs, write=True, fua=fua)

    async def compare(self, nsid: int, slba: int, data: Buffer) -> None:
        """Compare; a mismatch raises NvmeError with Status.COMPARE_FAILED."""
        view, bs, nlb = await self._data_blocks(nsid, data)
        _check_lba(slba, nlb)
        fut = self._start_one(_COMPARE, nsid, slba, nlb, view, True)
        if fut is not None:
            await fut
        else:
            await self._transfer(_COMPARE, nsid, slba, nlb, view, bs, write=True)

    async def flush(self, nsid: int = c.NSID_ALL) -> None:
        await self.io_command(c.flush(nsid))

    async def write_zeroes(self, nsid: int, slba: int, nlb: int, deallocate: bool = False) -> None:
        _check_lba(slba, nlb)
        await self._run_all([
            self.io_command(c.write_zeroes(nsid, slba + first, min(MAX_NLB, nlb - first),
                                           deallocate=deallocate))
            for first in range(0, nlb, MAX_NLB)])

    async def deallocate(self, nsid: int, ranges: Iterable[tuple[int, int]]) -> None:
        """Dataset Management with Attribute Deallocate over (slba, nlb) ranges."""
        items = list(ranges)
        if not items:
            raise ValueError("deallocate needs at least one (slba, nlb) range")
        for slba, nlb in items:
            if slba < 0 or not 1 <= nlb <= 0xFFFFFFFF:
                raise ValueError(f"range (slba={slba}, nlb={nlb}): nlb must be 1..2**32-1, slba >= 0")
        pieces = []
        for first in range(0, len(items), MAX_DSM_RANGES):
            group = items[first:first + MAX_DSM_RANGES]
            payload = b"".join(DsmRange.build({"cattr": 0, "nlb": nlb, "slba": slba}) for slba, nlb in group)
            assert len(payload) == DSM_RANGE_SIZE * len(group)
            pieces.append(self.io_command(c.dataset_management(nsid, len(group), attributes=DSM_AD),
                                          data_out=payload))
        await self._run_all(pieces)


def _check_lba(slba: int, nlb: int) -> None:
    if slba < 0 or slba >= 1 << 64:
        raise ValueError(f"slba must be 0..2**64-1, got {slba}")
    if nlb < 1:
        raise ValueError(f"nlb must be at least 1, got {nlb}")


def _whole_blocks(view: memoryview, nsid: int, bs: int) -> int:
    if not view or len(view) % bs:
        raise ValueError(f"data is {len(view)} bytes; it must be a positive multiple of namespace "
                         f"{nsid}'s block size {bs}")
    return len(view) // bs


def _byte_view(data: Buffer) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view
