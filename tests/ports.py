"""Free TCP ports on loopback for tests that start servers (the target, the API, QEMU's hostfwd)."""

from __future__ import annotations

import socket


def free_ports(count: int = 1, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` right now (held together so they differ)."""
    if count < 1:
        raise ValueError(f"free_ports: count must be at least 1, got {count}")
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
