"""sd_notify(3) by hand: tell systemd (Type=notify) that the daemon is ready, reloading or stopping.

The protocol is one datagram of newline-separated KEY=VALUE lines sent to the AF_UNIX socket named
by $NOTIFY_SOCKET; a name starting with '@' is in the abstract namespace (a leading NUL byte), as
libsystemd's sd_pid_notify_with_fds() reads it. Without $NOTIFY_SOCKET (not under systemd) every
call does nothing, so the daemon needs no systemd library.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("nvmeof.daemon")


def notify(**fields: str | int) -> bool:
    """Send ``READY=1``-style fields (``notify(READY=1, STATUS="...")``); True if a socket took them."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address[0] == "@":
        address = "\0" + address[1:]
    message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message)
    except OSError as e:  # systemd gone or the socket unusable: the daemon itself keeps running
        log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), e.strerror or e)
        return False
    return True


def reloading() -> bool:
    """RELOADING=1 with MONOTONIC_USEC, which Type=notify-reload needs to match the READY=1 that follows."""
    return notify(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000,
                  STATUS="reloading the configuration")
