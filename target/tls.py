"""NVMe/TCP TLS on the target: which PSK a connection's identity gets (TP 8011 / TP 8018).

The identity a host offers names its host NQN and the subsystem (``NVMe0R0C <hostnqn> <subnqn>`` or, with
the PSK digest, ``NVMe1R0C ... <digest>``; nvmeof/tls/psk.py). The PSK is the configured key of that host on
that subsystem (``Subsystem.host_auth[host].tls_key``, SPDK's nvmf_subsystem_add_host --psk), and only while
the subsystem admits the host. A discovery connection names the discovery NQN: it uses any key configured for the host
(a version-1 identity's digest picks the key that made it), as the kernel host sends the subsystem key's
identity-with-discovery-NQN to reach the discovery controller.

The Connect of a TLS queue must then name the same host (and subsystem or discovery): the identity is what
the PSK proved (`check_connect`).
"""

from __future__ import annotations

from collections.abc import Mapping

from nvmeof import defaults
from nvmeof.tls.psk import PskIdentity, TlsKey
from target.model import Subsystem


class PskRefused(Exception):
    """No PSK for this identity; the message says why (it names NQNs, never keys)."""


def find_psk(subsystems: Mapping[str, Subsystem], raw_identity: bytes) -> tuple[PskIdentity, bytes, int]:
    """(identity, TLS PSK, cipher hash id) for a ClientHello's identity, or PskRefused."""
    try:
        identity = PskIdentity.parse(raw_identity)
    except ValueError as exc:
        raise PskRefused(str(exc)) from None
    if identity.generated:
        raise PskRefused("generated PSKs (secure channel concatenation after DH-HMAC-CHAP) are not supported")
    host = identity.hostnqn
    if identity.subnqn == defaults.DISCOVERY_NQN:
        keys = [k for s in subsystems.values() if (k := _key_of(s, host)) is not None]
    else:
        subsystem = subsystems.get(identity.subnqn)
        if subsystem is None:
            raise PskRefused(f"PSK identity names subsystem {identity.subnqn}, which does not exist")
        if not subsystem.host_allowed(host):
            raise PskRefused(f"host {host} is not allowed on {identity.subnqn}")
        key = _key_of(subsystem, host)
        keys = [key] if key is not None else []
    if not keys:
        raise PskRefused(f"no TLS PSK is configured for host {host} on {identity.subnqn} "
                         "(nvmeof host add ... --tls-key)")
    why = "no configured key matches"
    for key in _unique(keys):
        try:
            return identity, key.tls_psk(identity, compat=None), key.cipher
        except ValueError as exc:
            why = str(exc)
    raise PskRefused(f"PSK identity of host {host} for {identity.subnqn}: {why}")


def _key_of(subsystem: Subsystem, hostnqn: str) -> TlsKey | None:
    """The host's configured PSK on the subsystem, while the subsystem admits the host."""
    entry = subsystem.host_auth.get(hostnqn)
    if entry is None or hostnqn not in subsystem.hosts or not subsystem.host_allowed(hostnqn):
        return None
    return entry.tls_key


def _unique(keys: list[TlsKey]) -> list[TlsKey]:
    out: list[TlsKey] = []
    for key in keys:
        if key not in out:
            out.append(key)
    return out


def check_connect(identity: PskIdentity | None, hostnqn: str, subnqn: str) -> str | None:
    """Why a Connect on a TLS queue names another host or subsystem than its PSK identity, or None."""
    if identity is None:
        return None
    if hostnqn != identity.hostnqn:
        return f"host NQN {hostnqn} is not the TLS PSK identity's ({identity.hostnqn})"
    if subnqn != identity.subnqn and subnqn != defaults.DISCOVERY_NQN:
        return f"subsystem {subnqn} is not the TLS PSK identity's ({identity.subnqn})"
    return None
