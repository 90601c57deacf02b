"""Reload (SIGHUP, `systemctl reload`): the re-read file applied change by change, all or nothing.

target/reload.py plans the differences; this applies them under the lock in one transaction (one undo
log): removals, access lists, new items through the replay, then the live changes of what stays, each
step's notices (AENs, disconnects, closing removed storage) waiting until the whole change is saved. Any
step, the gateway group's store or the save refusing undoes them all. Items still waiting from a failed
restore that the file keeps as they were stay waiting; a reload does not retry them.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from target import config as configmod
from target import hostauth, masking, schema
from target import qos as qosmod
from target.model import Listener, Namespace, Subsystem
from target.reload import plan_reload
from target.service.base import ServiceBase, Unrestored
from target.service.checks import (
    ServiceError,
    _bad,
    _endpoint_key,
    _given,
    _host_auth,
    _nqn,
    _split_hosts,
    _visibility,
)
from target.transaction import Transaction

log = logging.getLogger(__name__)


class ReloadMixin(ServiceBase):
    async def reload(self, config: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]) -> list[str]:
        """Make the running configuration what ``config`` (the re-read file, already through
        load_config) says, change by change (target/reload.py plans them), so the controllers of
        whatever stays keep running. All or nothing: returns the reasons when refused, and then
        nothing changed; [] when applied (the file is then saved back in canonical form, with the
        nsids and identifiers it left out). Every step runs under the lock in one transaction (one undo
        log, target/transaction.py) and the result is saved once (a gateway group's store first, through
        the change hook): a step, the store or the save refusing undoes them all, which is what a gateway
        group applying the store's version relies on. Items still waiting from a failed restore that the
        file keeps as they were stay
        waiting; those it dropped are forgotten."""
        async with self._lock:
            if callable(config):  # built from what runs now, under the lock (a gateway group's shared part)
                config = config(self.live_config())
            pending = [u for u in self._unrestored if _pending_in(u, config)]
            wanted = _without_pending(config, pending)
            plan = plan_reload(self.live_config(), wanted, _endpoint_key)
            errors = list(plan.problems) + self._resize_problems(plan.resized)
            if errors:
                return errors
            unrestored_before = list(self._unrestored)
            # one transaction for every step: any failure, the store's or the save's included, undoes them all
            async with self._steps() as txn:
                self._unrestored = []
                self._config_policy(config, errors, start_up=True)
                try:
                    if not errors:
                        self._reload_take_away(plan, txn)
                        for item in plan.access:   # before new namespaces, whose host lists it admits
                            self._reload_access(item, txn)
                        nss = [(nqn, f"namespace of {nqn}", item) for nqn, item in plan.new_namespaces]
                        await self._replay([("subsystem", item) for item in plan.new_subsystems], nss,
                                           [("listener", item) for item in plan.new_listeners],
                                           [("referral", item) for item in plan.new_referrals], errors, keep=False)
                    if not errors:
                        await self._reload_live(plan, txn)
                except (ServiceError, configmod.ConfigError) as exc:
                    errors.append(exc.message if isinstance(exc, ServiceError) else str(exc))
                if errors:
                    await txn.roll_back()
                    return errors
                self._unrestored = pending
                try:
                    await self._save(txn)  # the group's store, then the file: once, for all steps
                except ServiceError as exc:
                    return [exc.message]
            await self._reload_side_effects(plan, txn, unrestored_before)
        log.info("configuration %s reloaded: %s", self.config_path, plan.summary())
        return []

    async def _reload_live(self, plan: Any, txn: Transaction) -> None:
        """The changes to namespaces and listeners that stay: sizes (_resize_problems checked them), enabled,
        ANA groups and ANA states, each logged in ``txn``, unsaved; their notices wait until it is saved."""
        for nqn, nsid, size in plan.resized:
            step = await self._resize_step(self.get_namespace(nqn, nsid), size, allow_shrink=True)
            if step is not None:
                txn.undo(step)
                txn.after_sync(lambda nqn=nqn, nsid=nsid: self.target.namespace_changed(nqn, nsid))
        for nqn, nsid, enabled in plan.enabled:
            ns = self.get_namespace(nqn, nsid)
            step = self._enabled_step(ns, enabled)
            if step is not None:
                txn.undo(step)
                txn.after_sync(lambda nqn=nqn, ns=ns: (self.target.namespace_changed(nqn, ns.nsid),
                                                       self._ana_changed(subnqn=nqn, groups=(ns.anagrpid,),
                                                                         concerns=masking.seen_by(ns))))
        for nqn, nsid, anagrpid in plan.anagrpid:
            ns = self.get_namespace(nqn, nsid)
            old = ns.anagrpid
            step = self._anagrpid_step(ns, anagrpid)
            if step is not None:
                txn.undo(step)
                txn.after_sync(lambda nqn=nqn, ns=ns, groups=(old, ns.anagrpid): self._ana_changed(
                    subnqn=nqn, groups=groups, concerns=masking.seen_by(ns)))   # masked: its hosts only
        for nqn, nsid, auto_visible, hosts in plan.visibility:
            ns = self.get_namespace(nqn, nsid)
            auto_visible, hosts = _visibility(self.target.subsystems[nqn], nsid, auto_visible, hosts)
            change = self._visibility_step(ns, auto_visible, hosts)
            if change is not None:
                txn.undo(change[0])
                txn.after_sync(lambda nqn=nqn, ns=ns, c=change[1]: self._visibility_notice(nqn, ns, c))
        for item in plan.access:   # the file narrowed a subsystem's hosts: its namespaces must follow
            stale = masking.unadmitted(self.target.subsystems[item["nqn"]])
            if stale:
                raise _bad(f"subsystem {item['nqn']}: {'; '.join(stale)}, a host the subsystem no longer admits; "
                           "remove it from the namespace's hosts in the file too")
        self._reload_qos(plan, txn)
        for lid, states in plan.ana_states:
            done = self._reload_ana(lid, states)
            if done is not None:
                txn.undo(done[0])
                changed, groups = done[1], done[2]
                if changed:
                    txn.after_sync(lambda changed=changed, groups=groups: self._ana_changed(listeners=changed,
                                                                                            groups=groups))

    def _reload_qos(self, plan: Any, txn: Transaction) -> None:
        for nqn, nsid, item in plan.qos:
            limits, hosts = qosmod.parse_config(item)   # config.item_problems checked it
            txn.undo(self._qos_step(self.get_namespace(nqn, nsid), limits, hosts))
            txn.after_sync(lambda nqn=nqn, nsid=nsid: self.target.namespace_changed(nqn, nsid))

    def _resize_problems(self, resized: list[tuple[str, int, int]]) -> list[str]:
        problems = []
        for nqn, nsid, size in resized:
            ns = self.target.subsystems[nqn].namespaces[nsid]
            if size < ns.block_size or size % ns.block_size:
                problems.append(f"subsystem {nqn} namespace {nsid}: size {size} is not a positive multiple of the "
                                f"block size {ns.block_size}")
            elif size < ns.backend.size and ns.backend.holds_user_data:
                problems.append(f"subsystem {nqn} namespace {nsid}: a reload does not shrink user data "
                                f"({ns.backend.size} -> {size} bytes); shrink it through the API with allow_shrink")
        return problems

    def _reload_take_away(self, plan: Any, txn: Transaction) -> None:
        """The removals, in memory only (logged in ``txn``); once saved, its notices disconnect and close,
        as remove_namespace/remove_subsystem/remove_listener do."""
        for nqn, nsid in plan.removed_namespaces:
            sub = self.target.subsystems[nqn]
            ns = sub.namespaces.pop(nsid)
            txn.undo_sync(lambda sub=sub, ns=ns: sub.namespaces.__setitem__(ns.nsid, ns))
            txn.after(lambda nqn=nqn, ns=ns: self._dropped_namespace(nqn, ns))
        for nqn in plan.removed_subsystems:
            sub = self.target.subsystems.pop(nqn)
            txn.undo_sync(lambda sub=sub: self.target.subsystems.__setitem__(sub.nqn, sub))
            txn.after(lambda sub=sub: self._dropped_subsystem(sub))
        for lid in plan.removed_listeners:
            lst = self.target.listeners.pop(lid)
            txn.undo_sync(lambda lid=lid, lst=lst: self.target.listeners.__setitem__(lid, lst))
            txn.after(lambda lst=lst: self._dropped_listener(lst))
        # (the referrals come back with the rest of what _steps keeps)
        self.target.referrals[:] = [r for r in self.target.referrals if r.id not in plan.removed_referrals]

    async def _dropped_namespace(self, nqn: str, ns: Namespace) -> None:
        self.target.namespace_changed(nqn, ns.nsid, masking.seen_by(ns))
        await self._settle()
        ns.backend.close()

    async def _dropped_subsystem(self, sub: Subsystem) -> None:
        self.target.disconnect_subsystem(sub.nqn)
        for ns in sub.namespaces.values():
            ns.backend.close()

    async def _dropped_listener(self, listener: Listener) -> None:
        self.target.disconnect_listener(listener)
        await self.target.stop_listener(listener)

    def _reload_access(self, item: dict[str, Any], txn: Transaction) -> None:
        """Hosts, allow_any_host and DH-HMAC-CHAP lists of a subsystem as ``item`` has them, checked as
        add_subsystem checks them; the hosts it no longer admits lose their controllers afterwards."""
        sub = self.target.subsystems[item["nqn"]]
        nqns, settings = _split_hosts(_given(item, "hosts", []))
        hosts = {_nqn(h, "host NQN") for h in nqns}
        allow = schema.check_bool(_given(item, "allow_any_host", not hosts), "allow_any_host")
        if allow and hosts:
            raise _bad(f"subsystem {sub.nqn}: give either allow_any_host or a list of hosts, not both")
        auth = {h: entry for h, s in settings.items() if not (entry := _host_auth(h, s)).empty}
        try:
            hashes = hostauth.parse_hashes(item.get("dhchap_hash"))
            groups = hostauth.parse_dhgroups(item.get("dhchap_dhgroup"))
        except hostauth.AuthSettingError as exc:
            raise _bad(f"subsystem {sub.nqn}: {exc}") from None
        old = (sub.hosts, sub.host_auth, sub.allow_any_host, sub.dhchap_hash, sub.dhchap_dhgroup)

        async def back() -> None:
            sub.hosts, sub.host_auth, sub.allow_any_host, sub.dhchap_hash, sub.dhchap_dhgroup = old

        txn.undo(back)
        sub.hosts, sub.host_auth, sub.allow_any_host, sub.dhchap_hash, sub.dhchap_dhgroup = (
            hosts, auth, allow, hashes, groups)

    async def _reload_side_effects(self, plan: Any, txn: Transaction, unrestored_before: list[Unrestored]) -> None:
        """After the reload is saved: what removals and narrower host lists do to connected hosts."""
        await txn.announce()
        for item in plan.access:
            await self._revoke(item["nqn"])
        for u in unrestored_before:
            if u not in self._unrestored:
                log.info("configuration item %s, not restored, is no longer in the file: forgotten", u.where)
        self.target.discovery_changed()
        await self._settle()


def _pending_in(entry: Unrestored, config: dict[str, Any]) -> bool:
    """Whether the re-read file still holds this unrestored item unchanged (then it stays waiting)."""
    if entry.kind == "namespace":
        subs = [s for s in config.get("subsystems", []) if s.get("nqn") == entry.subnqn]
        return any(entry.item in (s.get("namespaces") or []) for s in subs)
    return entry.item in config.get(f"{entry.kind}s", [])


def _without_pending(config: dict[str, Any], pending: list[Unrestored]) -> dict[str, Any]:
    """``config`` without the items still waiting from a failed restore (a reload does not retry them:
    POST /api/v1/config/unrestored/retry does)."""
    out = copy.deepcopy(config)
    for entry in pending:
        if entry.kind == "namespace":
            for sub in out.get("subsystems", []):
                if sub.get("nqn") == entry.subnqn and entry.item in (sub.get("namespaces") or []):
                    sub["namespaces"].remove(entry.item)
        else:
            out[f"{entry.kind}s"].remove(entry.item)
    return out
