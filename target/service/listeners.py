"""Listeners, referrals and controllers: the addresses this target serves and points hosts to.

A listener starts listening before it is recorded (a port held elsewhere is refused with 409, an address
not on this host with 400); removing one disconnects every controller with a queue through it (SPDK
nvmf_stop_listen). A live add supersedes a copy of the same endpoint that a replay could not restore.
"""

from __future__ import annotations

import errno

from nvmeof import defaults
from target import schema
from target.model import Listener, Referral, endpoint_id
from target.service.base import ServiceBase, locked
from target.service.checks import ServiceError, _bad, _endpoint_key, _nqn


class ListenersMixin(ServiceBase):
    async def _add_listener(
        self,
        trtype: str,
        traddr: str,
        trsvcid: int | str,
        adrfam: str | None = None,
        discovery: bool = False,
        portid: int | None = None,
        tls: str | None = None,
        inline_data_size: int = defaults.IO_INCAPSULE_SIZE,
    ) -> Listener:
        """Listen on an address; ``tls`` none|optional|required (NVMe/TCP only, TP 8011); ``inline_data_size``
        the in-capsule bytes its I/O queues take (nvmet's param_inline_data_size; fixed while it listens)."""
        trtype, adrfam, traddr, port = schema.check_address(trtype, traddr, trsvcid, adrfam)
        tls = schema.check_tls_mode(tls, trtype)
        inline_data_size = schema.check_inline_data_size(inline_data_size, trtype)
        discovery = schema.check_bool(discovery, "discovery")
        lid = endpoint_id(trtype, traddr, port)
        if lid in self.target.listeners:
            raise ServiceError(409, f"listener {lid} already exists")
        used = {lst.portid for lst in self.target.listeners.values()}
        if portid is None:
            ports = range(schema.LISTENER_PORTID.low, schema.LISTENER_PORTID.high + 1)
            portid = next((p for p in ports if p not in used), None)
            if portid is None:
                raise ServiceError(409, f"every port id 1..{schema.LISTENER_PORTID.high} is used by a listener")
        else:
            portid = schema.LISTENER_PORTID.check(portid)
            if portid in used:
                raise ServiceError(
                    409,
                    f"port id {portid} is already used by another listener; leave it out to get a free one",
                )
        listener = Listener(
            trtype=trtype, adrfam=adrfam, traddr=traddr, trsvcid=port, portid=portid, discovery=discovery, tls=tls,
            inline_data_size=inline_data_size,
        )
        try:
            await self.target.start_listener(listener)
        except OSError as exc:
            raise _listen_error(lid, exc) from None
        except (NotImplementedError, RuntimeError, ValueError) as exc:
            raise _bad(f"cannot listen on {lid}: {exc}") from None
        self.target.listeners[lid] = listener
        self._ana_saved.pop(lid, None)   # a listener removed by a reload left its saved states behind

        superseded = [u for u in self._pending("listener") if _endpoint_key(u.item) == lid]
        self._drop_pending_endpoint("listener", lid)

        async def undo() -> None:
            self.target.listeners.pop(lid, None)
            self._unrestored.extend(superseded)
            await self.target.stop_listener(listener)

        await self._commit(True, undo)
        self.target.discovery_changed()
        return listener

    add_listener = locked(_add_listener)

    async def remove_listener(self, listener_id: str) -> int:
        """Stop a listener and disconnect every controller with a queue that came through it (SPDK
        nvmf_stop_listen disconnects that listener's qpairs); returns how many were disconnected."""
        async with self._lock:
            listener = self.get_listener(listener_id)
            del self.target.listeners[listener_id]
            saved = self._ana_saved.pop(listener_id, None)

            async def undo() -> None:
                self.target.listeners[listener_id] = listener
                if saved is not None:
                    self._ana_saved[listener_id] = saved

            await self._commit(True, undo)
            disconnected = self.target.disconnect_listener(listener)
            await self.target.stop_listener(listener)
            self.target.discovery_changed()
            await self._settle()
            return disconnected

    async def _add_referral(
        self,
        traddr: str,
        trsvcid: int | str = defaults.TCP_DISCOVERY_PORT,
        trtype: str = "tcp",
        adrfam: str | None = None,
        subnqn: str = defaults.DISCOVERY_NQN,
        portid: int = 0,
    ) -> Referral:
        """Point hosts to another discovery service (a Discovery Log Page entry of subtype referral)."""
        trtype, adrfam, traddr, port = schema.check_address(trtype, traddr, trsvcid, adrfam)
        if subnqn != defaults.DISCOVERY_NQN:
            subnqn = _nqn(subnqn, "referral subsystem NQN")
        portid = schema.REFERRAL_PORTID.check(portid)
        rid = endpoint_id(trtype, traddr, port)
        if any(r.id == rid for r in self.target.referrals):
            raise ServiceError(409, f"a referral to {rid} already exists")
        if rid in self.target.listeners:
            raise ServiceError(409, f"{rid} is one of this target's own listeners; a referral points elsewhere")
        referral = Referral(trtype=trtype, adrfam=adrfam, traddr=traddr, trsvcid=port, subnqn=subnqn, portid=portid)
        self.target.referrals.append(referral)
        superseded = [u for u in self._pending("referral") if _endpoint_key(u.item) == rid]
        self._drop_pending_endpoint("referral", rid)

        async def undo() -> None:
            self.target.referrals.remove(referral)
            self._unrestored.extend(superseded)

        await self._commit(True, undo)
        self.target.discovery_changed()
        return referral

    add_referral = locked(_add_referral)

    async def remove_referral(self, referral_id: str) -> None:
        async with self._lock:
            index = next((i for i, r in enumerate(self.target.referrals) if r.id == referral_id), None)
            if index is None:
                have = ", ".join(r.id for r in self.target.referrals) or "none"
                raise ServiceError(404, f"no referral {referral_id!r} (referrals: {have})")
            referral = self.target.referrals.pop(index)

            async def undo() -> None:
                self.target.referrals.insert(index, referral)

            await self._commit(True, undo)
            self.target.discovery_changed()

    async def disconnect_controller(self, cntlid: int) -> None:
        cntlid = schema.CNTLID.check(cntlid)
        if not self.target.disconnect_controller(cntlid):
            raise ServiceError(404, f"no connected controller with cntlid {cntlid}")
        await self._settle()  # with worker processes: its I/O queues there are closed before this returns


def _listen_error(lid: str, exc: OSError) -> ServiceError:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        return ServiceError(
            409,
            f"cannot listen on {lid}: the address is already in use; stop whatever holds that port or pick another one",
        )
    if exc.errno in (errno.EADDRNOTAVAIL, errno.EACCES, errno.EPERM):
        return ServiceError(400, f"cannot listen on {lid}: {reason}")
    return ServiceError(500, f"cannot listen on {lid}: {reason}")
