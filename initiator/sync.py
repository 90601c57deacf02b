"""Blocking wrapper around the asyncio host, for scripts.

    with initiator.sync.connect("127.0.0.1", 4420, subnqn) as ctrl:
        ctrl.write(1, 0, data)
        assert ctrl.read(1, 0, len(data) // 512) == data

One daemon thread runs an event loop for the whole process; every call submits a coroutine to it
and waits. The methods have the names and arguments of :class:`initiator.controller.HostController`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from initiator import discovery
from initiator.connecting import connect as _async_connect
from initiator.connecting import connect_multipath as _async_connect_multipath
from initiator.controller import AsyncEvent, HostController
from initiator.discovery import DiscoveryEntry

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="nvmeof-initiator-loop", daemon=True)
            thread.start()
            _loop = loop
        return _loop


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the background loop and wait for its result (cancelling it on timeout)."""
    loop = _background_loop()
    if _in_loop_thread(loop):
        coro.close()
        raise RuntimeError("initiator.sync called from inside its own event loop; use the async API")
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise TimeoutError(f"operation did not finish within {timeout} s") from None


def _in_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class SyncController:
    """Blocking twin of a HostController (or ReconnectingController); a context manager."""

    def __init__(self, ctrl: Any) -> None:
        self._ctrl = ctrl
        self._events: Any = None

    @property
    def controller(self) -> Any:
        """The wrapped async controller (use it only from the background loop)."""
        return self._ctrl

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._ctrl, name)
        if name.startswith("_") or name == "events" or not inspect.iscoroutinefunction(attr):
            if name.startswith("_"):
                raise AttributeError(name)
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return run(attr(*args, **kwargs))
        call.__name__ = name
        call.__doc__ = attr.__doc__
        return call

    def next_event(self, timeout: float | None = None) -> AsyncEvent | None:
        """The next asynchronous event; None when the controller closed; TimeoutError after ``timeout``."""
        if self._events is None:
            self._events = self._ctrl.events()
        try:
            return run(self._events.__anext__(), timeout)
        except StopAsyncIteration:
            return None

    def events(self, timeout: float | None = None) -> Iterator[AsyncEvent]:
        """Iterate over asynchronous events until the controller closes (or ``timeout`` passes)."""
        while True:
            ev = self.next_event(timeout)
            if ev is None:
                return
            yield ev

    def disconnect(self) -> None:
        run(self._ctrl.disconnect())

    def close(self) -> None:
        run(self._ctrl.close())

    def __enter__(self) -> SyncController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disconnect()


def connect(*args: Any, **kwargs: Any) -> SyncController:
    """Blocking :func:`initiator.connect` (same arguments); returns a SyncController."""
    async def go() -> Any:
        return await _async_connect(*args, **kwargs)
    return SyncController(run(go()))


def connect_multipath(*args: Any, **kwargs: Any) -> SyncController:
    """Blocking :func:`initiator.connect_multipath` (same arguments); a SyncController over the
    MultipathController (its ``paths()`` is a plain call)."""
    async def go() -> Any:
        return await _async_connect_multipath(*args, **kwargs)
    return SyncController(run(go()))


def discover(*args: Any, **kwargs: Any) -> list[DiscoveryEntry]:
    """Blocking :func:`initiator.discover`."""
    return run(discovery.discover(*args, **kwargs))


def connect_all(*args: Any, **kwargs: Any) -> list[SyncController]:
    """Blocking :func:`initiator.connect_all`."""
    ctrls: list[HostController] = run(discovery.connect_all(*args, **kwargs))
    return [SyncController(c) for c in ctrls]
