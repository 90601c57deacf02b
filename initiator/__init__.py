"""The Python NVMe-oF host: ``await initiator.connect(...)``, ``await initiator.discover(...)``.

``initiator.sync`` wraps the same API for scripts; ``initiator.kernel`` attaches through the Linux
kernel host instead.
"""

from initiator.connecting import connect, connect_multipath
from initiator.controller import AsyncEvent, HostController, default_hostnqn
from initiator.discovery import DiscoveryEntry, DiscoveryLogChanging, connect_all, discover, read_discovery_log
from initiator.multipath import MultipathController, MultipathError, NoPathError, PathInfo
from initiator.nvm import NamespaceGeometry
from initiator.queue import CommandTimeout, HostQueue, TransportError
from initiator.reconnect import ReconnectingController
from initiator.reservations import ReservationNotification
from nvmeof.auth import AuthFailure, generate_secret
from nvmeof.spec.reservations import (
    AcquireAction,
    Cptpl,
    RegisterAction,
    ReleaseAction,
    ReservationReport,
    ReservationType,
)
from nvmeof.status import NvmeError, Status

__all__ = [
    "AcquireAction",
    "AsyncEvent",
    "AuthFailure",
    "CommandTimeout",
    "Cptpl",
    "DiscoveryEntry",
    "DiscoveryLogChanging",
    "HostController",
    "HostQueue",
    "MultipathController",
    "MultipathError",
    "NamespaceGeometry",
    "NoPathError",
    "NvmeError",
    "PathInfo",
    "ReconnectingController",
    "RegisterAction",
    "ReleaseAction",
    "ReservationNotification",
    "ReservationReport",
    "ReservationType",
    "Status",
    "TransportError",
    "connect",
    "connect_all",
    "connect_multipath",
    "default_hostnqn",
    "discover",
    "generate_secret",
    "read_discovery_log",
]
