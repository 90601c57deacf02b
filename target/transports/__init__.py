"""Target transports by listener trtype: each entry builds a server object with ``async start()`` and
``async stop()`` from ``(target, listener)``. Transports that need optional packages (RDMA) register
themselves with :func:`register_transport` when imported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_transport(trtype: str, factory: Callable[..., Any]) -> None:
    _REGISTRY[trtype] = factory


def get_transport(trtype: str) -> Callable[..., Any]:
    if trtype not in _REGISTRY and trtype == "tcp":
        from target.transports.tcp import TcpListener

        register_transport("tcp", TcpListener)
    elif trtype not in _REGISTRY and trtype == "rdma":
        # importable without pyverbs: starting the listener says how to install it
        from target.transports.rdma import RdmaListener

        register_transport("rdma", RdmaListener)
    factory = _REGISTRY.get(trtype)
    if factory is None:
        have = ", ".join(sorted({*_REGISTRY, "tcp", "rdma"}))
        raise ValueError(f"no target transport for trtype {trtype!r} (available: {have})")
    return factory
