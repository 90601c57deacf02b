"""The whole configuration: snapshot() writes it in config-file form, a replay applies one.

A replay (daemon start-up, an import, retry_unrestored) runs every item through the same steps as the
live calls (``_add_subsystem``, ``_add_namespace``, ...), in reference order, as one transaction of many
steps (``_steps``). An item that fails is reported and skipped; at start-up it is kept with its error
(``Unrestored``) so snapshot() writes it back and the next start retries it. The configuration's own
storage fences (backing_dirs, ...) may widen the command line's at start-up, never through an import.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

from nvmeof import defaults
from target import config as configmod
from target import hostauth
from target import qos as qosmod
from target.backends import BackendError, spec_of
from target.model import Namespace, Subsystem
from target.service.base import Placed, PlacedNs, ServiceBase, Unrestored
from target.service.checks import ServiceError, _given, _split_hosts

log = logging.getLogger(__name__)


class ReplayMixin(ServiceBase):
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
                    **({"inline_data_size": lst.inline_data_size}
                       if lst.inline_data_size != defaults.IO_INCAPSULE_SIZE else {}),
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
            good = [e for e in entries if configmod.policy_path_ok(e)]
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
                    tls=item.get("tls"),
                    inline_data_size=_given(item, "inline_data_size", defaults.IO_INCAPSULE_SIZE),
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
