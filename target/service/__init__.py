"""TargetService: every management change, validated, serialized, persisted, then applied live.

Daemon start-up, config restore, the REST API and the CLI all come through here. Each mutation:
1. takes the one asyncio.Lock, so changes never interleave;
2. validates everything before touching anything, so a refused request changes nothing;
3. applies the change in memory, each step logging its undo in one Transaction (target/transaction.py),
   and saves the whole configuration once, atomically (when a config path is set); if the save fails
   the log undoes the change and the caller gets a 500 (a replay and a reload are one transaction too);
4. calls the Target's live hooks (namespace_changed, discovery_changed, disconnects).

Items of a replayed configuration that cannot be restored (a file on a disk not mounted yet, a port
still held by another process) are remembered with their error: ``snapshot()`` writes them back,
so the next save keeps them in the file and the next start retries them. ``unrestored()`` lists
them, ``retry_unrestored()`` tries again, ``discard_unrestored()`` drops them for good. A live
request that would collide with one of them (same NQN, same NSID, same file) is refused with 409.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from collections.abc import Callable
from typing import Any

from nvmeof import defaults
from target import config as configmod
from target import hostauth, masking
from target import qos as qosmod
from target.backends import (
    BackendError,
    spec_of,
)
from target.model import (
    Listener,
    Namespace,
    Subsystem,
)
from target.service.ana import AnaMixin
from target.service.base import GatewayMember, Placed, PlacedNs, ServiceBase, TargetHooks, Unrestored
from target.service.checks import (
    ServiceError,
    _bad,
    _bool,
    _endpoint_key,
    _given,
    _host_auth,
    _nqn,
    _split_hosts,
    _visibility,
)
from target.service.hosts import HostsMixin
from target.service.listeners import ListenersMixin
from target.service.namespace_settings import NamespaceSettingsMixin
from target.service.namespaces import NamespacesMixin
from target.service.subsystems import SubsystemsMixin
from target.transaction import Transaction

log = logging.getLogger(__name__)

__all__ = ["GatewayMember", "ServiceError", "TargetHooks", "TargetService", "Unrestored", "_endpoint_key", "configmod"]


class TargetService(AnaMixin, NamespaceSettingsMixin, NamespacesMixin, HostsMixin, SubsystemsMixin, ListenersMixin,
                    ServiceBase):
    async def retry_unrestored(self) -> list[str]:
        """Replay the unrestored items again (say, once the missing disk is mounted) and save.

        Returns the errors of the items that still fail; those stay remembered."""
        async with self._lock, self._steps() as txn:
            pending, self._unrestored = self._unrestored, []
            errors: list[str] = []
            await self._replay(
                [(u.where, u.item) for u in pending if u.kind == "subsystem"],
                [(u.subnqn or "", u.where, u.item) for u in pending if u.kind == "namespace"],
                [(u.where, u.item) for u in pending if u.kind == "listener"],
                [(u.where, u.item) for u in pending if u.kind == "referral"],
                errors,
                keep=True,
            )
            await self._save(txn, "the retry")
            return errors

    async def discard_unrestored(self) -> int:
        """Forget every unrestored item (they leave the config file); returns how many there were."""
        async with self._lock:
            dropped, self._unrestored = self._unrestored, []

            async def undo() -> None:
                self._unrestored = dropped

            await self._commit(bool(dropped), undo)
            for u in dropped:
                log.warning("discarded the unrestored configuration item %s: %s", u.where, u.error)
            return len(dropped)

    # --- subsystems ----------------------------------------------------------------------------

    # --- namespaces ----------------------------------------------------------------------------

    # --- masking: per-host visibility (target/masking.py) -----------------------------------------

    # --- Asymmetric Namespace Access -----------------------------------------------------------

    # --- listeners and referrals ---------------------------------------------------------------

    # --- controllers ---------------------------------------------------------------------------

    # --- whole configuration -------------------------------------------------------------------

    def snapshot(self, *, redact: bool = False) -> dict[str, Any]:
        """The whole configuration in config-file form (version 1), unrestored items included.
        ``redact`` (what the API returns): host secrets become presence flags (``"dhchap_key": true``)."""
        subsystems = []
        for sub in self.list_subsystems():
            entry = _subsystem_entry(sub, redact=redact)
            waiting = [copy.deepcopy(u.item) for u in self._pending("namespace") if u.subnqn == sub.nqn]
            if waiting:
                entry["namespaces"] = sorted(entry["namespaces"] + waiting, key=_nsid_order)
            subsystems.append(entry)
        subsystems += [copy.deepcopy(u.item) for u in self._pending("subsystem")]
        if redact:
            subsystems = [hostauth.redact_item(item) for item in subsystems]
        return {
            "version": configmod.CONFIG_VERSION,
            **copy.deepcopy(self._config_backing),
            "subsystems": subsystems,
            "listeners": [
                {
                    "trtype": lst.trtype,
                    "adrfam": lst.adrfam,
                    "traddr": lst.traddr,
                    "trsvcid": lst.trsvcid,
                    "portid": lst.portid,
                    "discovery": lst.discovery,
                    **({"tls": lst.tls} if lst.tls != "none" else {}),
                    **self._ana_entry(lst),
                }
                for lst in self.target.listeners.values()
            ]
            + [copy.deepcopy(u.item) for u in self._pending("listener")],
            "referrals": [
                {
                    "trtype": r.trtype,
                    "adrfam": r.adrfam,
                    "traddr": r.traddr,
                    "trsvcid": r.trsvcid,
                    "subnqn": r.subnqn,
                    "portid": r.portid,
                }
                for r in self.target.referrals
            ]
            + [copy.deepcopy(u.item) for u in self._pending("referral")],
        }

    async def restore(self, config: dict[str, Any], *, persist: bool = False) -> list[str]:
        """Replay a configuration through the same steps as live calls, in reference order
        (subsystems with their hosts, namespaces, listeners, referrals). An item that fails is
        reported and skipped; the rest is restored.

        ``persist=False`` (daemon start-up): the file being replayed is not rewritten, and every
        item that failed is remembered (``unrestored()``) so that later saves keep it in the file.
        ``persist=True`` (an import): the result is saved under the same lock as any mutation; the
        caller gets the errors back and failed items are not kept. If that save fails, everything
        the import added is taken out again and ServiceError(500) is raised.
        """
        errors: list[str] = []
        if not isinstance(config, dict):
            return [f"configuration must be an object, got {type(config).__name__}"]
        if config.get("version", configmod.CONFIG_VERSION) != configmod.CONFIG_VERSION:
            return [
                f"configuration version {config.get('version')!r} is not supported; "
                f"this program reads version {configmod.CONFIG_VERSION}"
            ]
        placed = [
            [(f"{key}[{i}]", item) for i, item in enumerate(_items(config, key, errors))]
            for key in ("subsystems", "listeners", "referrals")
        ]
        async with self._lock, self._steps() as txn:
            self._config_policy(config, errors, start_up=not persist)
            await self._replay(placed[0], [], placed[1], placed[2], errors, keep=not persist)
            if persist:
                await self._save(txn, "the import")
        return errors

    def _config_policy(self, config: dict[str, Any], errors: list[str], *, start_up: bool) -> None:
        """Take the configuration's ``backing_dirs``/``allow_block_devices``. The file the daemon
        starts from is the operator's (only the daemon writes it, from these same keys): its
        entries add to the command line's. An import comes through the API, whose admins must not
        choose where files may live: entries it would add are refused, each named."""
        given: dict[str, list[str]] = {}
        for key, (option, _) in configmod.POLICY_KEYS.items():
            value = config.get(key)
            if value is None:
                continue
            entries = value if isinstance(value, list) else []
            good = [e for e in entries if isinstance(e, str) and os.path.isabs(e) and "\0" not in e]
            if len(good) != len(entries) or not isinstance(value, list):
                errors.append(f"{key}: expected a list of absolute paths, got {value!r}; the bad entries are ignored")
            if start_up:
                given[key] = good
                continue
            extra = self.backing.widens(**{configmod.POLICY_KEYS[key][1]: good})
            if extra:
                errors.append(
                    f"{key}: an import cannot widen where namespace files may live ({', '.join(extra)} ignored); "
                    f"the operator allows them with nvmeof serve {option} or {key} in its configuration file"
                )
        if not start_up:
            return
        policy = self._flag_backing
        kept: dict[str, list[str]] = {}
        for key, entries in given.items():
            for entry in entries:
                kept.setdefault(key, []).append(entry)  # kept in the file even if refused, like unrestored items
                try:
                    policy = policy.widened(**{configmod.POLICY_KEYS[key][1]: [entry]})
                except BackendError as exc:
                    errors.append(f"{key}: {exc}; ignored")
        self.backing, self._config_backing = policy, kept

    async def _replay(
        self,
        subsystems: Placed,
        namespaces: PlacedNs,
        listeners: Placed,
        referrals: Placed,
        errors: list[str],
        *,
        keep: bool,
    ) -> None:
        """Apply items in reference order; ``namespaces`` belong to subsystems that already exist.
        With ``keep``, an item that fails on its meaning (not its structure) is remembered."""

        def failed(kind: str, where: str, item: Any, message: str, subnqn: str | None = None) -> None:
            if keep and _keepable(kind, item):
                self._unrestored.append(Unrestored(kind, where, message, copy.deepcopy(item), subnqn))

        def sound(kind: str, where: str, item: Any) -> bool:
            """Whether ``item`` is structurally sound; its problems, if any, go to ``errors``."""
            problems = configmod.item_problems(kind, item, where)
            errors.extend(problems)
            return not problems

        todo = list(namespaces)
        for base, item in subsystems:
            await asyncio.sleep(0)  # a large import yields to NVMe I/O between items
            where = base + (f" ({item['nqn']})" if isinstance(item, dict) and "nqn" in item else "")
            if not sound("subsystem", where, item):
                continue
            try:
                hosts, host_auth = _split_hosts(_given(item, "hosts", ()))
                await self._add_subsystem(
                    item["nqn"],
                    item.get("serial"),
                    _given(item, "model", defaults.MODEL),
                    item.get("allow_any_host"),
                    hosts,
                    _given(item, "max_namespaces", defaults.MAX_NAMESPACES),
                    persist=False,
                    host_auth=host_auth,
                    dhchap_hash=item.get("dhchap_hash"),
                    dhchap_dhgroup=item.get("dhchap_dhgroup"),
                )
            except ServiceError as exc:
                errors.append(f"{where}: {exc.message}; skipped with its namespaces")
                failed("subsystem", base, item, exc.message)
                continue
            todo += [(item["nqn"], f"{base}.namespaces[{j}]", ns) for j, ns in enumerate(item.get("namespaces") or [])]
        for nqn, where, item in todo:
            await asyncio.sleep(0)  # a large import yields to NVMe I/O between items
            if not sound("namespace", where, item):
                continue
            args = {key: item.get(key) for key in ("nsid", "path", "size", "uuid", "nguid", "eui64")}
            args["options"] = spec_of(item).options
            try:
                ns = await self._add_namespace(
                    nqn,
                    backend=item["backend"],
                    block_size=_given(item, "block_size", defaults.DEFAULT_BLOCK_SIZE),
                    read_only=_given(item, "read_only", False),
                    enabled=_given(item, "enabled", True),
                    create=False,
                    persist=False,
                    anagrpid=_given(item, "anagrpid", defaults.DEFAULT_ANAGRPID),
                    auto_visible=_given(item, "auto_visible", True),
                    hosts=_given(item, "hosts", ()),
                    **args,
                )
                if item.get("qos"):
                    ns.qos = qosmod.build(item["qos"])
                    self.target.namespace_changed(nqn, ns.nsid)
            except ServiceError as exc:
                errors.append(f"{where}: {exc.message}; skipped")
                # A namespace whose subsystem is gone (removed since) has nowhere to live.
                if nqn in self.target.subsystems:
                    failed("namespace", where, item, exc.message, nqn)
        for where, item in listeners:
            await asyncio.sleep(0)  # a large import yields to NVMe I/O between items
            if not sound("listener", where, item):
                continue
            try:
                listener = await self._add_listener(
                    _given(item, "trtype", "tcp"),
                    item["traddr"],
                    item["trsvcid"],
                    item.get("adrfam"),
                    _given(item, "discovery", False),
                    item.get("portid"),
                    persist=False,
                    tls=item.get("tls"),
                )
                self._restore_ana(listener, item.get("ana_states"))
            except ServiceError as exc:
                errors.append(f"{where}: {exc.message}; skipped")
                failed("listener", where, item, exc.message)
        for where, item in referrals:
            await asyncio.sleep(0)  # a large import yields to NVMe I/O between items
            if not sound("referral", where, item):
                continue
            try:
                await self._add_referral(
                    item["traddr"],
                    item["trsvcid"],
                    _given(item, "trtype", "tcp"),
                    item.get("adrfam"),
                    _given(item, "subnqn", defaults.DISCOVERY_NQN),
                    _given(item, "portid", 0),
                    persist=False,
                )
            except ServiceError as exc:
                errors.append(f"{where}: {exc.message}; skipped")
                failed("referral", where, item, exc.message)

    def live_config(self) -> dict[str, Any]:
        """snapshot() of what runs, without the items kept from a failed restore."""
        pending, self._unrestored = self._unrestored, []
        try:
            return self.snapshot()
        finally:
            self._unrestored = pending

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
        from target.reload import plan_reload

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
                                                       self._ana_changed(subnqn=nqn, groups=(ns.anagrpid,))))
        for nqn, nsid, anagrpid in plan.anagrpid:
            ns = self.get_namespace(nqn, nsid)
            old = ns.anagrpid
            step = self._anagrpid_step(ns, anagrpid)
            if step is not None:
                txn.undo(step)
                txn.after_sync(lambda nqn=nqn, groups=(old, ns.anagrpid): self._ana_changed(subnqn=nqn,
                                                                                            groups=groups))
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
        allow = _bool(_given(item, "allow_any_host", not hosts), "allow_any_host")
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


def _items(config: dict[str, Any], key: str, errors: list[str]) -> list[Any]:
    value = config.get(key, [])
    if not isinstance(value, list):
        errors.append(f"{key!r} must be a list, got {type(value).__name__}; none restored")
        return []
    return value


def _keepable(kind: str, item: Any) -> bool:
    """Only items whose structure is sound go back into the file: anything else would make the
    whole file unloadable at the next start."""
    if configmod.item_problems(kind, item, "item"):
        return False
    if kind == "subsystem":
        return not any(configmod.item_problems("namespace", ns, "ns") for ns in item.get("namespaces") or [])
    return True


def _nsid_order(entry: dict[str, Any]) -> tuple[int, int]:
    nsid = entry.get("nsid")
    return (0, nsid) if isinstance(nsid, int) else (1, 0)


def _subsystem_entry(sub: Subsystem, *, redact: bool = False) -> dict[str, Any]:
    # A host with DH-HMAC-CHAP settings is an object {"nqn", "dhchap_key", ...}; the others stay strings.
    hosts: list[Any] = [
        hostauth.config_entry(h, sub.host_auth[h], redact=redact) if h in sub.host_auth else h
        for h in sorted(sub.hosts)
    ]
    entry: dict[str, Any] = {
        "nqn": sub.nqn,
        "serial": sub.serial,
        "model": sub.model,
        "allow_any_host": sub.allow_any_host,
        "hosts": hosts,
        "max_namespaces": sub.max_namespaces,
    }
    if sub.dhchap_hash is not None:
        entry["dhchap_hash"] = hostauth.hash_names(sub.dhchap_hash)
    if sub.dhchap_dhgroup is not None:
        entry["dhchap_dhgroup"] = hostauth.dhgroup_names(sub.dhchap_dhgroup)
    entry["namespaces"] = [_namespace_entry(sub.namespaces[nsid]) for nsid in sorted(sub.namespaces)]
    return entry


def _namespace_entry(ns: Namespace) -> dict[str, Any]:
    entry: dict[str, Any] = {"nsid": ns.nsid, "backend": ns.spec.get("backend", ns.backend.kind)}
    if "path" in ns.spec:
        entry["path"] = ns.spec["path"]
    if "size" in ns.spec:
        entry["size"] = ns.spec["size"]
    entry.update(spec_of(ns.spec).options)
    entry.update(
        {
            "block_size": ns.block_size,
            "uuid": str(ns.uuid),
            "nguid": ns.nguid.hex(),
            "eui64": ns.eui64.hex(),
            "read_only": ns.read_only,
            "enabled": ns.enabled,
            "anagrpid": ns.anagrpid,
        }
    )
    if not ns.auto_visible:   # written only when masked: the file of an unmasked namespace is unchanged
        entry.update({"auto_visible": False, "hosts": sorted(ns.hosts)})
    if ns.qos is not None:
        entry["qos"] = ns.qos.config()
    return entry


