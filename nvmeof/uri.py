"""Transport addresses as users write them: ``tcp://127.0.0.1:4420``, ``rdma://[fe80::1]:4420``,
``127.0.0.1`` (TCP, default port)."""

from __future__ import annotations

import ipaddress
from typing import NamedTuple

from nvmeof import defaults

TRANSPORTS = ("tcp", "rdma", "loop")


class TransportAddress(NamedTuple):
    trtype: str
    traddr: str
    trsvcid: int

    @property
    def adrfam(self) -> str:
        return "ipv6" if ":" in self.traddr else "ipv4"

    def __str__(self) -> str:
        host = f"[{self.traddr}]" if ":" in self.traddr else self.traddr
        return f"{self.trtype}://{host}:{self.trsvcid}"


def parse_address(text: str, default_port: int, default_trtype: str = "tcp") -> TransportAddress:
    """Parse ``[trtype://]host[:port]``; raise ValueError naming what is wrong."""
    rest = text.strip()
    trtype = default_trtype
    if "://" in rest:
        trtype, rest = rest.split("://", 1)
        trtype = trtype.lower()
        if trtype not in TRANSPORTS:
            raise ValueError(f"unknown transport {trtype!r} in {text!r}: use one of {', '.join(TRANSPORTS)}")
    port: int | str = default_port
    if rest.startswith("["):
        host, sep, tail = rest[1:].partition("]")
        if not sep:
            raise ValueError(f"missing ']' in IPv6 address {text!r}")
        if tail:
            if not tail.startswith(":"):
                raise ValueError(f"expected ':PORT' after ']' in {text!r}")
            port = tail[1:]
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    else:
        host = rest
    if not host:
        raise ValueError(f"no host address in {text!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise ValueError(f"{host!r} in {text!r} is not an IP address (NVMe-oF addresses are numeric)") from None
        host = "127.0.0.1"
    try:
        port_num = int(port)
    except ValueError:
        raise ValueError(f"port {port!r} in {text!r} is not a number") from None
    if not 0 < port_num <= defaults.PORT_MAX:
        raise ValueError(f"port {port_num} in {text!r} is out of range 1-{defaults.PORT_MAX}")
    return TransportAddress(trtype, host, port_num)
