"""TransportHost transports by listener trtype (Linux nvmet_register_transport, SPDK spdk_nvmf_transport_register).

Each entry is a `ListenerFactory`: ``(target, listener)`` -> a server with ``async start()`` and
``async stop()``, or the ``"module:attr"`` path of one, imported the first time a listener of that trtype
starts (the RDMA module imports without pyverbs; starting its listener says how to install it). A
`Target` takes its registry at construction (``Target(transports=...)``): the standard one by default;
the daemon, PooledTarget (its worker-aware TCP listener) or a test inject their own listener classes.
A new transport is one module plus one entry here, or one `register_transport` call.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from target.model import Listener
    from target.ports import TransportHost


class ListenerServer(Protocol):
    """One running listener."""

    @property
    def port(self) -> int: ...   # the port it listens on (the one the kernel chose for trsvcid 0)

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class ListenerFactory(Protocol):
    """What a registry entry builds a listener's server with (a listener class such as TcpListener)."""

    def __call__(self, target: TransportHost, listener: Listener, /) -> ListenerServer: ...


TransportEntry = ListenerFactory | str   # a factory, or "module:attr" naming one

STANDARD_TRANSPORTS: Mapping[str, TransportEntry] = {
    "tcp": "target.transports.tcp_batch:BatchTcpListener",   # the one NVMe/TCP engine (issue 26)
    "rdma": "target.transports.rdma:RdmaListener",
}


class TransportRegistry:
    """trtype -> listener factory; ``"module:attr"`` entries are imported when first asked for."""

    def __init__(self, entries: Mapping[str, TransportEntry] = STANDARD_TRANSPORTS) -> None:
        self._entries: dict[str, TransportEntry] = dict(entries)

    def register(self, trtype: str, factory: TransportEntry) -> None:
        self._entries[trtype] = factory

    def with_entries(self, entries: Mapping[str, TransportEntry]) -> TransportRegistry:
        """A copy of this registry with ``entries`` added or replacing those of the same trtype."""
        return TransportRegistry({**self._entries, **entries})

    def trtypes(self) -> list[str]:
        return sorted(self._entries)

    def get(self, trtype: str) -> ListenerFactory:
        entry = self._entries.get(trtype)
        if entry is None:
            raise ValueError(f"no target transport for trtype {trtype!r} (available: {', '.join(self.trtypes())})")
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = self._entries[trtype] = getattr(importlib.import_module(module), attr)
        return entry


_STANDARD = TransportRegistry()


def register_transport(trtype: str, factory: TransportEntry) -> None:
    """Add a transport to the standard registry (every TransportHost built without ``transports=`` uses it)."""
    _STANDARD.register(trtype, factory)


def get_transport(trtype: str) -> ListenerFactory:
    return _STANDARD.get(trtype)


def transports_for(given: TransportRegistry | Mapping[str, TransportEntry] | None) -> TransportRegistry:
    """What ``Target(transports=...)`` serves with: the standard registry for None; a mapping adds its
    entries to (or replaces those of) the standard ones; a registry is taken as it is."""
    if given is None:
        return _STANDARD
    if isinstance(given, TransportRegistry):
        return given
    return _STANDARD.with_entries(given)
