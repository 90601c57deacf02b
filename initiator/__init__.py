"""The Python NVMe-oF host: ``await initiator.connect(...)``, ``await initiator.discover(...)``.

``initiator.sync`` wraps the same API for scripts; ``initiator.kernel`` attaches through the Linux
kernel host instead.
"""

from initiator.connecting import connect
from initiator.controller import AsyncEvent, HostController, default_hostnqn
from initiator.discovery import DiscoveryEntry, DiscoveryLogChanging, connect_all, discover, read_discovery_log
from initiator.nvm import NamespaceGeometry
from initiator.queue import CommandTimeout, HostQueue, TransportError
from initiator.reconnect import ReconnectingController
from nvmeof.auth import AuthFailure, generate_secret
from nvmeof.status import NvmeError, Status

__all__ = [
    "AsyncEvent",
    "AuthFailure",
    "CommandTimeout",
    "DiscoveryEntry",
    "DiscoveryLogChanging",
    "HostController",
    "HostQueue",
    "NamespaceGeometry",
    "NvmeError",
    "ReconnectingController",
    "Status",
    "TransportError",
    "connect",
    "connect_all",
    "default_hostnqn",
    "discover",
    "generate_secret",
    "read_discovery_log",
]
