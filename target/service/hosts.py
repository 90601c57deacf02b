"""Hosts of a subsystem: the allow-list and each host's DH-HMAC-CHAP settings (target/hostauth.py).

Denying a host disconnects its controllers on that subsystem (SPDK spdk_nvmf_subsystem_remove_host);
changed settings apply from the next (re-)authentication, as nvmet reads the key at each one. Secrets are
never logged: the log names the fields that changed.
"""

from __future__ import annotations

import logging
from typing import Any

from target import hostauth
from target.model import Subsystem
from target.service.base import ServiceBase
from target.service.checks import ServiceError, _host_auth, _nqn

log = logging.getLogger(__name__)


class HostsMixin(ServiceBase):
    async def allow_host(self, subnqn: str, hostnqn: str, **auth: Any) -> Subsystem:
        """Add ``hostnqn`` to the allowed hosts, with its DH-HMAC-CHAP settings (``dhchap_key``,
        ``dhchap_ctrl_key``, ``dhchap_hash``, ``dhchap_dhgroup``) if given."""
        async with self._lock:
            hostnqn = _nqn(hostnqn, "host NQN")
            sub = self.get_subsystem(subnqn)
            if sub.allow_any_host:
                raise ServiceError(
                    409,
                    f"subsystem {subnqn} allows any host; turn allow_any_host off "
                    "first so that the list of hosts takes effect",
                )
            if hostnqn in sub.hosts:
                raise ServiceError(409, f"host {hostnqn} is already allowed on {subnqn}")
            entry = _host_auth(hostnqn, {k: v for k, v in auth.items() if v is not None})
            sub.hosts.add(hostnqn)
            if not entry.empty:
                sub.host_auth[hostnqn] = entry

            async def undo() -> None:
                sub.hosts.discard(hostnqn)
                sub.host_auth.pop(hostnqn, None)

            await self._commit(True, undo)
            self.target.discovery_changed()
            return sub

    async def deny_host(self, subnqn: str, hostnqn: str) -> int:
        """Remove ``hostnqn`` from the allowed hosts and disconnect its controllers on ``subnqn``
        (SPDK spdk_nvmf_subsystem_remove_host does the same); returns how many were disconnected."""
        async with self._lock:
            sub = self.get_subsystem(subnqn)
            if hostnqn not in sub.hosts:
                raise ServiceError(404, f"host {hostnqn} is not in the allowed hosts of {subnqn}")
            sub.hosts.discard(hostnqn)
            auth = sub.host_auth.pop(hostnqn, None)
            restore = self._drop_unadmitted(sub)

            async def undo() -> None:
                sub.hosts.add(hostnqn)
                if auth is not None:
                    sub.host_auth[hostnqn] = auth
                await restore()

            await self._commit(True, undo)
            disconnected = await self._revoke(subnqn)
            self.target.discovery_changed()
            return disconnected

    def get_host(self, subnqn: str, hostnqn: str) -> tuple[Subsystem, Any]:
        """(subsystem, its HostAuth or None) for an allowed host; 404 when the host is not allowed."""
        sub = self.get_subsystem(subnqn)
        if hostnqn not in sub.hosts:
            raise ServiceError(404, f"host {hostnqn} is not in the allowed hosts of {subnqn}; allow it first")
        return sub, sub.host_auth.get(hostnqn)

    async def set_host_auth(self, subnqn: str, hostnqn: str, settings: dict[str, Any]) -> Subsystem:
        """Set, rotate or remove DH-HMAC-CHAP settings of an allowed host: each field given replaces the
        current one (None removes it), the others stay. Connected controllers keep running; their next
        (re-)authentication, and every new queue, uses the new settings (nvmet reads the host's key at
        each authentication too)."""
        async with self._lock:
            sub, old = self.get_host(subnqn, hostnqn)
            entry = _host_auth(hostnqn, settings, old)
            if entry.empty:
                sub.host_auth.pop(hostnqn, None)
            else:
                sub.host_auth[hostnqn] = entry

            async def undo() -> None:
                if old is None:
                    sub.host_auth.pop(hostnqn, None)
                else:
                    sub.host_auth[hostnqn] = old

            await self._commit(True, undo)
            changed = ", ".join(sorted(settings)) or "nothing"
            log.info("DH-HMAC-CHAP settings of host %s on %s changed (%s)", hostnqn, subnqn, changed)
            return sub

    async def clear_host_auth(self, subnqn: str, hostnqn: str) -> Subsystem:
        """Remove every DH-HMAC-CHAP setting of the host: its new queues no longer authenticate."""
        return await self.set_host_auth(subnqn, hostnqn, {field: None for field in hostauth.DHCHAP_FIELDS})
