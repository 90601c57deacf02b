"""A controller that reconnects by itself, for long-lived users.

Like the Linux host's ``ctrl_loss_tmo`` / ``reconnect_delay`` pair, but with exponential backoff: when
any queue breaks (connection drop, TermReq, command timeout) a background task connects a fresh
controller, waiting 0.1 s, 0.2 s, 0.4 s ... up to ``max_delay`` between attempts. A command that failed
with a transport error is retried once on the new controller. NVMe status errors are never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Self, TypeVar

from initiator.controller import AsyncEvent, HostController
from initiator.queue import TransportError
from nvmeof.status import NvmeError

log = logging.getLogger(__name__)

T = TypeVar("T")


async def connect_with_backoff(make: Callable[[], Awaitable[T]], what: str, *, initial_delay: float = 0.1,
                               max_delay: float = 30.0, attempts: int | None = None) -> tuple[T, int]:
    """``await make()`` until it succeeds: (its result, the attempts it took).

    Waits ``initial_delay``, then twice as long each time up to ``max_delay``, between attempts that fail
    with a transport error (OSError, TimeoutError); an NVMe status (the target answered and refused) is
    raised at once, as is a TransportError after ``attempts`` failures (None: never give up).
    """
    delay = initial_delay
    attempt = 0
    while True:
        attempt += 1
        try:
            return await make(), attempt
        except NvmeError:
            raise  # the target answered and refused: retrying will not help
        except (OSError, TimeoutError) as err:  # TransportError is an OSError
            if attempts is not None and attempt >= attempts:
                raise TransportError(what, f"reconnect gave up after {attempt} attempts: {err}") from err
            log.warning("reconnect attempt %d to %s failed: %s; next in %.1f s", attempt, what, err, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay)


class StandInController:
    """disconnect(), close() and ``async with`` of a controller that stands in for others it manages (a
    reconnecting one, every path of a multipath one): both stop what runs in the background and end those
    controllers the one way or the other, in the subclass's ``_finish(how)``."""

    async def _finish(self, how: str) -> None:
        raise NotImplementedError

    async def disconnect(self) -> None:
        """Shut the controllers down (CC.SHN) and stop reconnecting."""
        await self._finish("disconnect")

    async def close(self) -> None:
        """Drop the connections without the shutdown."""
        await self._finish("close")

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.disconnect()


class ReconnectingController(StandInController):
    """Has every public coroutine method of :class:`HostController`; see the module docstring."""

    def __init__(self, traddr: str, trsvcid: int | str, subnqn: str, *, initial_delay: float = 0.1,
                 max_delay: float = 30.0, attempts: int | None = None, **kwargs: Any) -> None:
        if initial_delay <= 0 or max_delay < initial_delay:
            raise ValueError(f"need 0 < initial_delay <= max_delay, got {initial_delay} and {max_delay}")
        if attempts is not None and attempts < 1:
            raise ValueError(f"attempts must be at least 1 (or None for unlimited), got {attempts}")
        self._args = (traddr, trsvcid, subnqn)
        self._kwargs = kwargs
        self.initial_delay = initial_delay
        self.max_delay = max_delay
        self.attempts = attempts
        self._events: asyncio.Queue[AsyncEvent | None] = asyncio.Queue()
        self._ctrl: HostController | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.reconnects = 0

    @property
    def controller(self) -> HostController:
        if self._ctrl is None:
            raise RuntimeError("not connected")
        return self._ctrl

    async def _new_controller(self) -> HostController:
        ctrl = HostController(*self._args, event_queue=self._events, **self._kwargs)
        await ctrl.open()
        ctrl.on_transport_error = self._on_transport_error
        return ctrl

    async def open(self) -> ReconnectingController:
        self._ctrl = await self._new_controller()
        return self

    def _on_transport_error(self, err: TransportError) -> None:
        if self._closed or (self._task is not None and not self._task.done()):
            return
        broken = self._ctrl
        self._task = asyncio.get_running_loop().create_task(self._reconnect(broken))

    async def _reconnect(self, broken: HostController | None) -> None:
        async with self._lock:
            if self._closed or self._ctrl is not broken:
                return  # someone else already replaced it
            if broken is not None:
                await broken.close()
            self._ctrl, attempt = await connect_with_backoff(
                self._new_controller, str(self._args[2]), initial_delay=self.initial_delay,
                max_delay=self.max_delay, attempts=self.attempts)
            self.reconnects += 1
            log.info("reconnected to %s after %d attempt(s)", self._args[2], attempt)

    async def _ensure(self, broken: HostController) -> HostController:
        task = self._task
        if task is None or task.done() or self._ctrl is not broken:
            await self._reconnect(broken)
        else:
            await asyncio.shield(task)
        return self.controller

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("controller is closed")
        ctrl = self.controller
        if self._task is not None and not self._task.done():
            ctrl = await self._ensure(ctrl)
        try:
            return await getattr(ctrl, name)(*args, **kwargs)
        except TransportError as err:
            log.warning("%s failed (%s); reconnecting and retrying once", name, err)
            ctrl = await self._ensure(ctrl)
            return await getattr(ctrl, name)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(HostController, name, None)
        if inspect.iscoroutinefunction(attr) and name not in ("open", "disconnect", "close"):
            async def call(*args: Any, **kwargs: Any) -> Any:
                return await self._call(name, *args, **kwargs)
            call.__name__ = name
            call.__doc__ = attr.__doc__
            return call
        return getattr(self.controller, name)

    async def reauthenticate(self, *, dhchap_secret: Any = None, dhchap_ctrl_secret: Any = None) -> None:
        """HostController.reauthenticate on the current controller; new secrets are kept for reconnects."""
        await self._call("reauthenticate", dhchap_secret=dhchap_secret, dhchap_ctrl_secret=dhchap_ctrl_secret)
        if dhchap_secret is not None:
            self._kwargs["dhchap_secret"] = dhchap_secret
        if dhchap_ctrl_secret is not None:
            self._kwargs["dhchap_ctrl_secret"] = dhchap_ctrl_secret

    async def events(self) -> AsyncIterator[AsyncEvent]:
        """Events from whichever controller is current; ends when this object is closed."""
        while True:
            ev = await self._events.get()
            if ev is None:
                self._events.put_nowait(None)
                return
            yield ev

    async def _finish(self, how: str) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._ctrl is not None:
            await getattr(self._ctrl, how)()
        self._events.put_nowait(None)

