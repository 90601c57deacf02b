"""Subsystems: create (NQN, serial, model, who may connect, DH-HMAC-CHAP lists), remove, allow_any_host.

A new subsystem is refused while a copy of the same NQN waits among the unrestored items; removing one
with namespaces needs ``force`` (which also drops its namespaces that were not restored) and disconnects
its controllers. Turning allow_any_host off revokes the hosts the list no longer admits (masking drops
them from namespace host lists too).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Any

from nvmeof import defaults
from target import hostauth, schema
from target.model import Subsystem
from target.nqn import generate_nqn
from target.service.base import ServiceBase, locked
from target.service.checks import ServiceError, _bad, _host_auth, _nqn


class SubsystemsMixin(ServiceBase):
    async def _add_subsystem(
        self,
        nqn: str | None = None,
        serial: str | None = None,
        model: str = defaults.MODEL,
        allow_any_host: bool | None = None,
        hosts: Iterable[str] = (),
        max_namespaces: int = defaults.MAX_NAMESPACES,
        *,
        host_auth: dict[str, dict[str, Any]] | None = None,
        dhchap_hash: Any = None,
        dhchap_dhgroup: Any = None,
    ) -> Subsystem:
        """Create a subsystem. ``allow_any_host`` defaults to True when no hosts are listed.
        ``host_auth``: DH-HMAC-CHAP settings per listed host (hostauth.FIELDS); ``dhchap_hash`` /
        ``dhchap_dhgroup``: the subsystem's allowed hashes and DH groups (default all)."""
        nqn = generate_nqn() if nqn is None else _nqn(nqn, "subsystem NQN")
        if nqn in self.target.subsystems:
            raise ServiceError(409, f"subsystem {nqn} already exists")
        for u in self._pending("subsystem"):
            if u.item.get("nqn") == nqn:
                raise self._pending_conflict(f"subsystem {nqn}", u)
        if serial is None:
            serial = secrets.token_hex(schema.SERIAL_MAX // 2)
        else:
            serial = schema.check_ascii(serial, "serial", schema.SERIAL_MAX)
        model = schema.check_ascii(model, "model", schema.MODEL_MAX)
        if isinstance(hosts, str):
            raise _bad("hosts must be a list of host NQNs, not a single string")
        host_set = {_nqn(h, "host NQN") for h in hosts}
        if allow_any_host is None:
            allow_any_host = not host_set
        elif schema.check_bool(allow_any_host, "allow_any_host") and host_set:
            raise _bad(
                "give either allow_any_host or a list of hosts, not both: "
                "with allow_any_host every host may connect and the list would mean nothing"
            )
        max_namespaces = schema.MAX_NAMESPACES.check(max_namespaces)
        auth = {}
        for hostnqn, settings in (host_auth or {}).items():
            if hostnqn not in host_set:
                raise _bad(f"DH-HMAC-CHAP settings for host {hostnqn}, which is not in the subsystem's hosts")
            entry = _host_auth(hostnqn, settings)
            if not entry.empty:
                auth[hostnqn] = entry
        try:
            hashes = hostauth.parse_hashes(dhchap_hash)
            groups = hostauth.parse_dhgroups(dhchap_dhgroup)
        except hostauth.AuthSettingError as exc:
            raise _bad(f"subsystem {nqn}: {exc}") from None
        sub = Subsystem(
            nqn=nqn,
            serial=serial,
            model=model,
            allow_any_host=allow_any_host,
            hosts=host_set,
            max_namespaces=max_namespaces,
            host_auth=auth,
            dhchap_hash=hashes,
            dhchap_dhgroup=groups,
        )
        self.target.subsystems[nqn] = sub

        async def undo() -> None:
            self.target.subsystems.pop(nqn, None)
            self.target.disconnect_subsystem(nqn)   # a host may have connected while the change was saved

        await self._commit(True, undo)
        self.target.discovery_changed()
        return sub

    add_subsystem = locked(_add_subsystem)

    async def remove_subsystem(self, nqn: str, force: bool = False) -> int:
        """Remove subsystem ``nqn``; returns how many controllers were disconnected with it."""
        async with self._lock:
            sub = self.get_subsystem(nqn)
            waiting = [u for u in self._pending("namespace") if u.subnqn == nqn]
            if sub.namespaces and not force:
                also = f" (and {len(waiting)} more that were not restored)" if waiting else ""
                raise ServiceError(
                    409,
                    f"subsystem {nqn} still has namespaces {sorted(sub.namespaces)}{also}; "
                    "remove them first or pass force",
                )
            if waiting and not force:
                raise ServiceError(
                    409,
                    f"subsystem {nqn} has namespaces in the configuration that were not restored "
                    f"({', '.join(u.where for u in waiting)}); pass force to remove them with it",
                )
            del self.target.subsystems[nqn]
            for u in waiting:
                self._unrestored.remove(u)

            async def undo() -> None:
                self.target.subsystems[nqn] = sub
                self._unrestored.extend(waiting)

            await self._commit(True, undo)
            disconnected = self.target.disconnect_subsystem(nqn)
            for ns in sub.namespaces.values():
                ns.backend.close()
            self.target.discovery_changed()
            await self._settle()
            return disconnected

    async def set_allow_any_host(self, nqn: str, allow: bool) -> int:
        """Set allow_any_host; turning it off disconnects the controllers of hosts not in the list.
        Returns how many controllers were disconnected."""
        async with self._lock:
            sub = self.get_subsystem(nqn)
            allow = schema.check_bool(allow, "allow_any_host")
            if allow and sub.hosts:
                raise ServiceError(
                    409,
                    f"subsystem {nqn} lists allowed hosts {sorted(sub.hosts)}; deny them first, then allow any host",
                )
            old = sub.allow_any_host
            sub.allow_any_host = allow
            restore = self._drop_unadmitted(sub)

            async def undo() -> None:
                sub.allow_any_host = old
                await restore()

            await self._commit(True, undo)
            disconnected = await self._revoke(nqn)
            self.target.discovery_changed()
            return disconnected

    async def set_subsystem_dhchap(self, subnqn: str, settings: dict[str, Any]) -> Subsystem:
        """The subsystem's allowed hashes/DH groups (``dhchap_hash``, ``dhchap_dhgroup``; None: all),
        used by hosts that name none of their own."""
        async with self._lock:
            sub = self.get_subsystem(subnqn)
            unknown = sorted(set(settings) - set(hostauth.LIST_FIELDS))
            if unknown:
                raise _bad(f"unknown subsystem setting(s) {', '.join(unknown)}; use dhchap_hash, dhchap_dhgroup")
            old = (sub.dhchap_hash, sub.dhchap_dhgroup)
            try:
                hashes = hostauth.parse_hashes(settings["dhchap_hash"]) if "dhchap_hash" in settings else old[0]
                groups = (hostauth.parse_dhgroups(settings["dhchap_dhgroup"]) if "dhchap_dhgroup" in settings
                          else old[1])
            except hostauth.AuthSettingError as exc:
                raise _bad(f"subsystem {subnqn}: {exc}") from None
            sub.dhchap_hash, sub.dhchap_dhgroup = hashes, groups

            async def undo() -> None:
                sub.dhchap_hash, sub.dhchap_dhgroup = old

            await self._commit(True, undo)
            return sub

