"""NVMe/TCP TLS on the target: which PSK a connection's identity gets (TP 8011 / TP 8018).

The identity a host offers names its host NQN and the subsystem (``NVMe0R0C <hostnqn> <subnqn>`` or, with
the PSK digest, ``NVMe1R0C ... <digest>``; nvmeof/tls/psk.py). The PSK is the configured key of that host on
that subsystem (``Subsystem.host_auth[host].tls_key``, SPDK's nvmf_subsystem_add_host --psk), and only while
the subsystem admits the host. A discovery connection names the discovery NQN: it uses any key configured for the host
(a version-1 identity's digest picks the key that made it), as the kernel host sends the subsystem key's
identity-with-discovery-NQN to reach the discovery controller.

The Connect of a TLS queue must then name the same host (and subsystem or discovery): the identity is what
the PSK proved (`check_connect`).

Derivation: a version-1 identity's digest tells which HKDF-Expand-Label encoding made the PSK (RFC 8446's or
libnvme's pre-RFC "compat" one; nvmeof/tls/psk.py). A version-0 identity (``NVMe0R0x host sub``, what Linux
6.12's nvme_tls_psk_default looks up) carries no digest, so nothing tells them apart: the target uses RFC 8446's
unless the host entry has ``tls_compat`` (as nvme-cli 2.13 / libnvme 1.13 insert keys for the kernel host, their
derive_retained_key_compat / derive_tls_key_compat). A failed handshake of such an identity gets `handshake_hint`.
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
    if identity.subnqn != defaults.DISCOVERY_NQN:
        subsystem = subsystems.get(identity.subnqn)
        if subsystem is None:
            raise PskRefused(f"PSK identity names subsystem {identity.subnqn}, which does not exist")
        if not subsystem.host_allowed(host):
            raise PskRefused(f"host {host} is not allowed on {identity.subnqn}")
    keys = _keys_for(subsystems, identity)
    if not keys:
        raise PskRefused(f"no TLS PSK is configured for host {host} on {identity.subnqn} "
                         "(nvmeof host add ... --tls-key)")
    why = "no configured key matches"
    for key, compat in keys:
        try:
            # a digest decides by itself (None); a version-0 identity takes the host's setting
            mode = None if identity.version == 1 else compat
            return identity, key.tls_psk(identity, compat=mode), key.cipher
        except ValueError as exc:
            why = str(exc)
    raise PskRefused(f"PSK identity of host {host} for {identity.subnqn}: {why}")


def handshake_hint(subsystems: Mapping[str, Subsystem], identity: PskIdentity | None, error: str) -> str:
    """Why a handshake whose identity found a PSK may still have failed, for the log line ("" if nothing to say).

    With a version-0 identity a PSK of the wrong derivation fails only at the binder check (OpenSSL's
    SSL_R_BINDER_DOES_NOT_VERIFY, ``error`` being the handshake's error text), exactly like a wrong key; the
    likeliest cause is a keyring key inserted by nvme-cli 2.13 / libnvme 1.13 (compat encoding) while the host
    entry is not marked tls_compat, or the other way round."""
    if identity is None or identity.version != 0 or "binder does not verify" not in error:
        return ""
    keys = _keys_for(subsystems, identity)
    if not keys:
        return ""
    host = identity.hostnqn
    sub = identity.subnqn if identity.subnqn != defaults.DISCOVERY_NQN else "<subsystem>"
    if any(compat for _, compat in keys):
        return (f"; host {host} is marked tls_compat (libnvme's pre-RFC 8446 derivation for identities "
                "without a digest): if its key was inserted another way (nvmeof, or nvme-cli with the RFC derivation), "
                f"turn it off (nvmeof host set-key {sub} {host} --no-tls-compat), else the host holds another key")
    return (f"; the likely cause, if the host holds this configured key: its TLS PSK was derived the pre-RFC 8446 "
            f"way libnvme's compat functions use (keys inserted by nvme-cli 2.13 / libnvme 1.13 for an NVMe0R "
            f"identity); mark the host: nvmeof host set-key {sub} {host} --tls-compat")


def _keys_for(subsystems: Mapping[str, Subsystem], identity: PskIdentity) -> list[tuple[TlsKey, bool]]:
    host = identity.hostnqn
    if identity.subnqn == defaults.DISCOVERY_NQN:
        return _unique([k for s in subsystems.values() if (k := _key_of(s, host)) is not None])
    subsystem = subsystems.get(identity.subnqn)
    key = _key_of(subsystem, host) if subsystem is not None else None
    return [key] if key is not None else []


def _key_of(subsystem: Subsystem, hostnqn: str) -> tuple[TlsKey, bool] | None:
    """The host's configured PSK on the subsystem and its tls_compat, while the subsystem admits the host."""
    entry = subsystem.host_auth.get(hostnqn)
    if entry is None or entry.tls_key is None or hostnqn not in subsystem.hosts \
            or not subsystem.host_allowed(hostnqn):
        return None
    return entry.tls_key, entry.tls_compat


def _unique(keys: list[tuple[TlsKey, bool]]) -> list[tuple[TlsKey, bool]]:
    out: list[tuple[TlsKey, bool]] = []
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
