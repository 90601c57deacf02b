"""The per-command lifecycle every transport runs: parse, fetch the host's data, execute, respond.

Modelled on Linux nvmet: ``nvmet_req_init`` (parse and the SGL check), the transport's data-in step,
``req->execute``, then ``nvmet_req_complete``, which builds the CQE and calls ``ops->queue_response``.
A failure at any step completes the command through ``Target.fail`` (log, error log, CQE); a queue
torn down in between gets no response. The transport side is a `TransportQueue`
(target/transport_ops.py).

``start_command`` runs the command's coroutine inline first: most commands (RAM-disk I/O, admin
commands) finish without suspending and never cost a Task; one that does suspend is finished by a
Task that takes the coroutine over where it stopped (``_Continue``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Generator
from typing import TYPE_CHECKING, Any

from nvmeof.spec.nvme import Direction
from nvmeof.status import NvmeError, Status

if TYPE_CHECKING:
    from target.ports import CommandRouter
    from target.request import Request
    from target.transport_ops import TransportQueue

log = logging.getLogger(__name__)


async def run_command(target: CommandRouter, xq: TransportQueue, req: Request) -> None:
    """One command from its capsule to its response."""
    fetched = False
    try:
        try:
            target.parse(req)
            pending = xq.fetch_data(req)
            if pending is not None:
                await pending
                fetched = True
            assert req.execute is not None
            await req.execute(req)
        except NvmeError as err:
            cqe = target.fail(req, err)
            reply = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, ConnectionError) and xq.closed:
                return   # the queue went away under the command (an RDMA buffer pool torn down)
            ctrl = req.queue.ctrl
            log.exception("command %r failed unexpectedly", req, extra={
                "event": "failure", "qid": req.queue.qid, "peer": req.queue.peer, "reason": f"internal error: {exc}",
                **({"host": ctrl.hostnqn, "subnqn": ctrl.subsystem.nqn, "cntlid": ctrl.cntlid} if ctrl else {})})
            cqe = target.fail(req, NvmeError(Status.INTERNAL, f"internal error: {exc}"))
            reply = None
        else:
            reply = req.reply_payload() if req.direction == Direction.C2H and req.reply is not None else None
            cqe = target.complete(req)
        if xq.closed:
            return   # the queue was torn down while the command ran: nobody to answer
        pending = xq.queue_response(req, cqe, reply)
        if pending is not None:
            await pending
    finally:
        if fetched:
            xq.release(req)


def start_command(target: CommandRouter, xq: TransportQueue, req: Request) -> asyncio.Task[None] | None:
    """Run ``req``; returns the Task that finishes it, or None when it completed at once."""
    coro = run_command(target, xq, req)
    if xq.eager:
        try:
            first = coro.send(None)
        except StopIteration:
            return None   # completed without waiting: no Task
        return asyncio.get_running_loop().create_task(_finish(coro, first))
    return asyncio.get_running_loop().create_task(coro)


class _Continue:
    """Awaitable that finishes a coroutine which was started by hand and suspended at ``first``.

    A coroutine that suspends yields the future it waits on; a Task running this relays that future
    and every later one, and forwards whatever the Task sends or throws (cancellation), as if the
    Task had run it from the start.
    """

    __slots__ = ("coro", "first")

    def __init__(self, coro: Coroutine[Any, Any, None], first: Any) -> None:
        self.coro = coro
        self.first = first

    def __await__(self) -> Generator[Any, None, None]:
        coro = self.coro
        value = self.first
        while True:
            try:
                yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:   # relayed to the coroutine, which decides
                try:
                    value = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    value = coro.send(None)
                except StopIteration:
                    return


async def _finish(coro: Coroutine[Any, Any, None], first: Any) -> None:
    await _Continue(coro, first)
