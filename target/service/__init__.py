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
import secrets
import uuid as uuidlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nvmeof import defaults
from nvmeof.spec.logs import ANA_STATE_NAMES, AnaState, parse_ana_state
from target import config as configmod
from target import hostauth, masking, pr
from target import qos as qosmod
from target.backends import (
    BackendError,
    BackendSpec,
    backend_class,
    kinds,
    open_backend,
    spec_of,
    storage_key,
    validate_spec,
)
from target.backends.base import close_backends
from target.model import (
    BLOCK_SIZES,
    Listener,
    Namespace,
    Subsystem,
)
from target.service.base import GatewayMember, Placed, PlacedNs, ServiceBase, TargetHooks, Unrestored
from target.service.checks import (
    ServiceError,
    _ana_state,
    _anagrpid,
    _bad,
    _bool,
    _endpoint_key,
    _given,
    _hex_id,
    _host_auth,
    _int,
    _masking,
    _nqn,
    _show,
    _split_hosts,
    _uuid,
    _visibility,
)
from target.service.hosts import HostsMixin
from target.service.listeners import ListenersMixin
from target.service.subsystems import SubsystemsMixin
from target.transaction import Transaction, Undo

log = logging.getLogger(__name__)

__all__ = ["GatewayMember", "ServiceError", "TargetHooks", "TargetService", "Unrestored", "_endpoint_key", "configmod"]


class TargetService(HostsMixin, SubsystemsMixin, ListenersMixin, ServiceBase):
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

    def _id_owner(self, attr: str, value: Any) -> str | None:
        for sub, ns in self._all_namespaces():
            if getattr(ns, attr) == value:
                return f"namespace {ns.nsid} of {sub.nqn}"
        return None

    def _unique_id(self, attr: str, name: str, given: Any, make: Callable[[], Any]) -> Any:
        if given is not None:
            owner = self._id_owner(attr, given)
            if owner:
                raise ServiceError(
                    409,
                    f"{name} {_show(given)} is already used by {owner}; "
                    "the Linux host ignores duplicate identifiers, leave it out to generate one",
                )
            return given
        while True:
            value = make()
            if self._id_owner(attr, value) is None:
                return value

    async def add_namespace(
        self,
        subnqn: str,
        *,
        backend: str,
        path: str | None = None,
        size: int | None = None,
        block_size: int = defaults.DEFAULT_BLOCK_SIZE,
        nsid: int | None = None,
        uuid: uuidlib.UUID | str | None = None,
        nguid: bytes | str | None = None,
        eui64: bytes | str | None = None,
        read_only: bool = False,
        enabled: bool = True,
        create: bool = False,
        options: dict[str, Any] | None = None,
        anagrpid: int = defaults.DEFAULT_ANAGRPID,
        auto_visible: bool = True,
        hosts: Sequence[str] = (),
    ) -> Namespace:
        """``options``: the settings only ``backend`` takes (BACKEND_OPTIONS: an RBD namespace's
        ``pool``, ``image``, ...). ``anagrpid``: its ANA group, 1..ANAGRPMAX. ``auto_visible`` False:
        only the controllers of ``hosts`` see it (target/masking.py)."""
        async with self._lock:
            return await self._add_namespace(
                subnqn,
                backend=backend,
                path=path,
                size=size,
                block_size=block_size,
                nsid=nsid,
                uuid=uuid,
                nguid=nguid,
                eui64=eui64,
                read_only=read_only,
                enabled=enabled,
                create=create,
                options=options,
                persist=True,
                anagrpid=anagrpid,
                auto_visible=auto_visible,
                hosts=hosts,
            )

    async def _add_namespace(
        self,
        subnqn: str,
        *,
        backend: str,
        path: str | None,
        size: int | None,
        block_size: int,
        nsid: int | None,
        uuid: Any,
        nguid: Any,
        eui64: Any,
        read_only: bool,
        enabled: bool,
        create: bool,
        persist: bool,
        options: dict[str, Any] | None = None,
        anagrpid: int | None = defaults.DEFAULT_ANAGRPID,
        auto_visible: bool = True,
        hosts: Sequence[str] = (),
    ) -> Namespace:
        sub = self.get_subsystem(subnqn)
        anagrpid = _anagrpid(defaults.DEFAULT_ANAGRPID if anagrpid is None else anagrpid)
        if backend not in kinds():
            raise _bad(f"backend {backend!r} is not one of {', '.join(kinds())}")
        if self.gateway is not None and not backend_class(backend).same_data_in_every_process:
            raise _bad(f"backend {backend!r} cannot be exported by gateway group {self.gateway.group_name}: every "
                       "gateway would serve its own copy under one NGUID/UUID, and a host switching paths would "
                       "read another gateway's data; use --backend file on storage every gateway reaches, or rbd")
        if block_size not in BLOCK_SIZES:
            raise _bad(f"block size {block_size!r} is not supported; use 512 or 4096")
        read_only = _bool(read_only, "read_only")
        enabled = _bool(enabled, "enabled")
        create = _bool(create, "create")
        if size is not None:
            size = _int(size, "size", 1, defaults.MAX_FILE_SIZE)
            if size % block_size:
                raise _bad(
                    f"size {size} is not a multiple of the block size {block_size}; "
                    f"try {size // block_size * block_size or block_size}"
                )
        try:
            checked = validate_spec(backend, BackendSpec(path, size, read_only, create, dict(options or {})),
                                    self.backing)
        except BackendError as exc:
            raise _bad(str(exc)) from None
        shown = backend_class(backend).storage_name(checked)
        if create and size is None:   # the backend would make an existing one serve as it is
            raise _bad(f"creating {shown} needs a size")
        where = storage_key(backend, checked, self.backing)
        if where is not None:
            for other_sub, other in self._all_namespaces():
                if self._storage_key(other.spec) == where:
                    raise ServiceError(
                        409,
                        f"{shown} already backs namespace {other.nsid} of {other_sub.nqn}; "
                        "two namespaces on the same storage would corrupt each other",
                    )
            for u in self._pending("namespace"):
                if self._storage_key(u.item) == where:
                    raise self._pending_conflict(f"a namespace on {shown}", u)
        taken = sub.namespaces.keys() | self._pending_nsids(subnqn)
        if nsid is None:
            nsid = next((n for n in range(1, sub.max_namespaces + 1) if n not in taken), None)
            if nsid is None:
                raise ServiceError(
                    409, f"subsystem {subnqn} already has its maximum of {sub.max_namespaces} namespaces"
                )
        else:
            nsid = _int(nsid, "nsid", 1, sub.max_namespaces)
            if nsid in sub.namespaces:
                free = next((n for n in range(1, sub.max_namespaces + 1) if n not in taken), None)
                hint = f"; NSID {free} is free" if free else ""
                raise ServiceError(409, f"NSID {nsid} is already in use in {subnqn}{hint}")
            for u in self._pending("namespace"):
                if u.subnqn == subnqn and u.item.get("nsid") == nsid:
                    raise self._pending_conflict(f"NSID {nsid} of {subnqn}", u)
        auto_visible, visible_hosts = _visibility(sub, nsid, auto_visible, hosts)
        ns_uuid = self._unique_id("uuid", "UUID", None if uuid is None else _uuid(uuid), uuidlib.uuid4)
        ns_nguid = self._unique_id(
            "nguid",
            "NGUID",
            None if nguid is None else _hex_id(nguid, "nguid", 16),
            lambda: secrets.token_bytes(16),
        )
        ns_eui64 = self._unique_id(
            "eui64",
            "EUI-64",
            None if eui64 is None else _hex_id(eui64, "eui64", 8),
            lambda: defaults.IEEE_OUI + secrets.token_bytes(5),
        )

        # Everything else is checked; opening the backend is the last step that can fail.
        try:
            store, stored_ids = await asyncio.to_thread(
                _open_store, backend, path=checked.path, size=size, read_only=read_only, create=create,
                policy=self.backing, options=dict(checked.options),
            )
        except BackendError as exc:
            raise _bad(str(exc)) from None
        if store.size % block_size:
            self._discard_backend(store)
            raise _bad(
                f"{shown} is {store.size} bytes, not a multiple of the block size {block_size}; "
                f"give a size such as {store.size // block_size * block_size}"
            )
        if stored_ids is not None:
            try:
                ns_uuid, ns_nguid, ns_eui64 = self._stored_identity(
                    shown, stored_ids, (uuid, nguid, eui64), (ns_uuid, ns_nguid, ns_eui64)
                )
            except ServiceError:
                self._discard_backend(store)
                raise
        elif store.holds_user_data:
            # The first gateway to serve this storage gives it its identity; every later one (and
            # every restart) reads it back, so hosts see one namespace behind all of them (a backend
            # that cannot keep it, a file, ignores this).
            ids = {"uuid": str(ns_uuid), "nguid": ns_nguid.hex(), "eui64": ns_eui64.hex()}
            try:
                await asyncio.to_thread(store.store_identity, ids)
            except BackendError as exc:
                self._discard_backend(store)
                raise _bad(f"{shown}: cannot store the namespace identity with it: {exc}") from None
        # the configuration entry's backend part: what was given (a path resolved, options checked)
        given = {"backend": backend, "path": checked.path, "size": size, **checked.options}
        spec = {key: value for key, value in given.items() if value is not None}
        ns = Namespace(
            nsid=nsid,
            backend=store,
            block_size=block_size,
            uuid=ns_uuid,
            nguid=ns_nguid,
            eui64=ns_eui64,
            read_only=read_only or store.read_only,
            enabled=enabled,
            anagrpid=anagrpid,
            auto_visible=auto_visible,
            hosts=visible_hosts,
            spec=spec,
        )
        await pr.clear_on_start(self.target, ns)   # what its reservation store keeps (PTPL, the group)
        sub.namespaces[nsid] = ns

        async def undo() -> None:
            sub.namespaces.pop(nsid, None)
            self._discard_backend(store)
            # a replay told the hosts of it already (and one may have found it while the change was saved)
            self.target.namespace_changed(subnqn, nsid, masking.seen_by(ns))

        await self._commit(persist, undo)
        self.target.namespace_changed(subnqn, nsid)
        # The ANA log now lists the NSID in its group: a Linux host with ANA attaches no block device
        # for a new namespace until it has read it there (nvme-cli #832), so tell it (nvmet_ns_enable).
        self._ana_changed(subnqn=subnqn, groups=(anagrpid,), concerns=masking.seen_by(ns))
        store.watch_size(lambda new_size: self._storage_resized(subnqn, nsid, store, new_size))
        await self._settle()
        return ns

    def _storage_key(self, entry: Mapping[str, Any]) -> Any:
        """The storage a namespace's configuration entry names (None: its own, or unusable)."""
        return storage_key(entry.get("backend", ""), spec_of(entry), self.backing)

    def _stored_identity(
        self, shown: str, stored: dict[str, str], given: tuple[Any, Any, Any], made: tuple[Any, Any, Any]
    ) -> tuple[uuidlib.UUID, bytes, bytes]:
        """The identity kept with the storage wins over a fresh one; one the caller gave must agree
        with it (a config entry does, since it was written from it)."""
        try:
            ids = (
                _uuid(stored["uuid"]),
                _hex_id(stored["nguid"], "nguid", 16),
                _hex_id(stored["eui64"], "eui64", 8),
            )
        except (KeyError, TypeError, ServiceError) as exc:
            raise _bad(f"{shown} carries an unreadable namespace identity ({exc}); remove its metadata key "
                       f"{defaults.RBD_IDENTITY_KEY} to give it a new one") from None
        names = ("uuid", "nguid", "eui64")
        for name, asked, have, fresh in zip(names, given, ids, made, strict=True):
            if asked is not None and fresh != have:
                raise _bad(f"{shown} already carries {name} {_show(have)}, not {_show(fresh)}; omit {name} "
                           "to serve it with the identity it has")
            owner = self._id_owner(name, have)
            if owner:
                raise ServiceError(409, f"{shown} carries {name} {_show(have)}, already used by {owner}")
        return ids

    def _storage_resized(self, subnqn: str, nsid: int, store: Any, size: int) -> None:
        """The storage under a namespace changed size behind our back (`rbd resize`): tell the hosts
        (Namespace Attribute Changed) and keep the configuration's size in step."""
        sub = self.target.subsystems.get(subnqn)
        ns = sub.namespaces.get(nsid) if sub is not None else None
        if ns is None or ns.backend is not store:
            return
        log.info("namespace %d of %s: its storage was resized to %d bytes outside this target", nsid, subnqn, size)
        if "size" in ns.spec:
            ns.spec["size"] = size
        self.target.namespace_changed(subnqn, nsid)
        self._background(self.save(), "saving the configuration after an outside resize")

    def _background(self, work: Any, what: str) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed: %s", what, t.exception())

        task.add_done_callback(done)

    async def close_backends(self) -> list[str]:
        """At shutdown, once the target has closed its listeners and controllers: close every namespace's
        storage (the configuration keeps the namespaces) and wait until it is released. An RBD image must be
        closed and its librados client shut down before the process exits (target/backends/rbd.py says why).
        Returns the namespaces whose storage was not released within BACKEND_CLOSE_WAIT s."""
        owners = {id(ns.backend): f"namespace {ns.nsid} of {sub.nqn}" for sub, ns in self._all_namespaces()}
        left = await close_backends([ns.backend for _sub, ns in self._all_namespaces()], defaults.BACKEND_CLOSE_WAIT)
        return [owners[id(backend)] for backend in left]

    @staticmethod
    def _discard_backend(store: Any) -> None:
        if store.holds_user_data:
            store.close_unused()  # removes a file/image it created, cuts back one it grew
        else:
            store.close()

    async def resize_namespace(self, subnqn: str, nsid: int, size: int, *, allow_shrink: bool = False) -> Namespace:
        """Change a namespace's capacity. A file namespace grows its file when asked past its end;
        shrinking it needs ``allow_shrink`` (FileBackend.resize says what happens to the file).
        RAM and null namespaces are no user files: they resize either way."""
        async with self._lock:
            ns = self.get_namespace(subnqn, nsid)
            undo = await self._resize_step(ns, size, allow_shrink=_bool(allow_shrink, "allow_shrink"))
            if undo is None:
                return ns
            await self._commit(True, undo)
            self.target.namespace_changed(subnqn, nsid)
            await self._settle()
            return ns

    async def _resize_step(self, ns: Namespace, size: int, *, allow_shrink: bool) -> Undo | None:
        """The resize itself, unsaved and unannounced (resize_namespace and reload); None: no change."""
        size = _int(size, "size", 1, defaults.MAX_FILE_SIZE)
        if size % ns.block_size:
            raise _bad(f"size {size} is not a multiple of the block size {ns.block_size}")
        old_size = ns.backend.size
        if size == old_size:
            return None
        store = ns.backend
        old_length: int | None = None
        try:
            if store.holds_user_data:
                old_length = await store.resize(size, allow_shrink=allow_shrink)
            else:
                await store.resize(size)
        except BackendError as exc:
            raise _bad(str(exc)) from None
        old_spec_size = ns.spec.get("size")
        ns.spec["size"] = size

        async def undo() -> None:
            if old_spec_size is None:
                ns.spec.pop("size", None)
            else:
                ns.spec["size"] = old_spec_size
            try:
                if store.holds_user_data:
                    await store.revert_resize(old_size, old_length)
                else:
                    await store.resize(old_size)
            except BackendError:
                pass

        return undo

    async def set_namespace_enabled(self, subnqn: str, nsid: int, enabled: bool) -> Namespace:
        async with self._lock:
            ns = self.get_namespace(subnqn, nsid)
            undo = self._enabled_step(ns, enabled)
            if undo is None:
                return ns
            await self._commit(True, undo)
            self.target.namespace_changed(subnqn, nsid)
            # the group's NSID list changed, for the hosts that see it
            self._ana_changed(subnqn=subnqn, groups=(ns.anagrpid,), concerns=masking.seen_by(ns))
            await self._settle()
            return ns

    def _enabled_step(self, ns: Namespace, enabled: bool) -> Undo | None:
        enabled = _bool(enabled, "enabled")
        if ns.enabled == enabled:
            return None
        ns.enabled = enabled

        async def undo() -> None:
            ns.enabled = not enabled

        return undo

    async def set_namespace_qos(self, subnqn: str, nsid: int, limits: Mapping[str, Any], *,
                                host: str | None = None) -> Namespace:
        """QoS limits of a namespace, or of one host on it (target/qos.py; SPDK bdev_set_qos_limit, the Ceph
        gateway's namespace set_qos): the limits named in ``limits`` change, the others stay; 0 removes one.
        Live: commands waiting are re-timed at once; in a gateway group the limit is shared configuration."""
        async with self._lock:
            ns = self.get_namespace(subnqn, nsid)
            if not isinstance(limits, Mapping):
                raise _bad(f"QoS limits must be an object, got {type(limits).__name__}")
            ns_limits, hosts = _current_qos(ns)
            try:
                if host is None:
                    ns_limits = ns_limits.merged(limits)
                else:
                    host = _nqn(host, "host")
                    sub = self.target.subsystems[subnqn]
                    if not sub.host_allowed(host):
                        raise ServiceError(404, f"host {host} is not allowed on subsystem {subnqn}; allow it first "
                                                "(or set allow_any_host)")
                    hosts[host] = hosts.get(host, qosmod.UNLIMITED).merged(limits)
                    if len(hosts) > defaults.QOS_HOSTS_MAX:
                        raise _bad(f"namespace {nsid} has QoS limits for {defaults.QOS_HOSTS_MAX} hosts already")
            except qosmod.QosError as exc:
                raise _bad(str(exc)) from None
            undo = self._qos_step(ns, ns_limits, hosts)
            await self._commit(True, undo)
            self.target.namespace_changed(subnqn, nsid)
            log.info("namespace %d of %s: QoS %s%s", nsid, subnqn, f"for host {host} " if host else "",
                     _qos_words(hosts.get(host, qosmod.UNLIMITED) if host else ns_limits))
            await self._settle()
            return ns

    def _qos_step(self, ns: Namespace, limits: qosmod.QosLimits, hosts: Mapping[str, qosmod.QosLimits]) -> Undo:
        """Apply limits live (the throttles stay where a limit stays, so queued commands keep their place)."""
        old_limits, old_hosts = _current_qos(ns)

        def apply(limits: qosmod.QosLimits, hosts: Mapping[str, qosmod.QosLimits]) -> None:
            if ns.qos is None:
                ns.qos = qosmod.NamespaceQos(limits, hosts)
            else:
                ns.qos.update(limits, hosts)
            if not ns.qos.limited():
                ns.qos = None

        apply(limits, hosts)

        async def undo() -> None:
            apply(old_limits, old_hosts)

        return undo

    async def remove_namespace(self, subnqn: str, nsid: int) -> None:
        async with self._lock:
            ns = self.get_namespace(subnqn, nsid)
            sub = self.target.subsystems[subnqn]
            del sub.namespaces[nsid]

            async def undo() -> None:
                sub.namespaces[nsid] = ns

            await self._commit(True, undo)
            self.target.namespace_changed(subnqn, nsid, masking.seen_by(ns))
            self._ana_changed(subnqn=subnqn, groups=(ns.anagrpid,), concerns=masking.seen_by(ns))
            await self._settle()
            ns.backend.close()
            await pr.forget(self.target, ns)

    # --- masking: per-host visibility (target/masking.py) -----------------------------------------

    async def add_namespace_host(self, subnqn: str, nsid: int, hostnqn: str) -> Namespace:
        """Make namespace ``nsid`` visible to ``hostnqn`` (SPDK nvmf_ns_add_host); it needs auto_visible off."""
        async with self._lock:
            ns = self.get_namespace(subnqn, nsid)
            if ns.auto_visible:
                raise ServiceError(409, f"namespace {nsid} of {subnqn} is visible to every allowed host "
                                        "(auto_visible); turn auto_visible off to list the hosts that see it")
            hostnqn = _masking(lambda: masking.check_host(self.target.subsystems[subnqn], nsid, hostnqn))
            if hostnqn in ns.hosts:
                raise ServiceError(409, f"namespace {nsid} of {subnqn} is already visible to host {hostnqn}")
            return await self._apply_visibility(subnqn, ns, False, ns.hosts | {hostnqn})

    async def remove_namespace_host(self, subnqn: str, nsid: int, hostnqn: str) -> Namespace:
        """Hide namespace ``nsid`` from ``hostnqn`` again (SPDK nvmf_ns_remove_host)."""
        async with self._lock:
            ns = self.get_namespace(subnqn, nsid)
            if hostnqn not in ns.hosts:
                listed = ", ".join(sorted(ns.hosts)) or "none"
                raise ServiceError(404, f"namespace {nsid} of {subnqn} does not list host {hostnqn} (it lists: "
                                        f"{listed})")
            return await self._apply_visibility(subnqn, ns, False, ns.hosts - {hostnqn})

    async def set_namespace_auto_visible(self, subnqn: str, nsid: int, auto_visible: bool) -> Namespace:
        """auto_visible on: every allowed host sees the namespace (its host list is dropped); off: only the
        hosts then added with add_namespace_host."""
        async with self._lock:
            ns = self.get_namespace(subnqn, nsid)
            auto_visible = _bool(auto_visible, "auto_visible")
            return await self._apply_visibility(subnqn, ns, auto_visible, set() if auto_visible else ns.hosts)

    async def _apply_visibility(self, subnqn: str, ns: Namespace, auto_visible: bool, hosts: set[str]) -> Namespace:
        change = self._visibility_step(ns, auto_visible, hosts)
        if change is None:
            return ns
        undo, concerns = change
        await self._commit(True, undo)
        log.info("namespace %d of %s: visible to %s", ns.nsid, subnqn,
                 "every allowed host" if ns.auto_visible else ", ".join(sorted(ns.hosts)) or "no host")
        self._visibility_notice(subnqn, ns, concerns)
        await self._settle()
        return ns

    def _visibility_step(self, ns: Namespace, auto_visible: bool,
                         hosts: set[str]) -> tuple[Undo, Callable[[str], bool]] | None:
        """The change itself, unsaved and unannounced (the calls above and reload); None: no change."""
        old = (ns.auto_visible, ns.hosts)
        if (auto_visible, set(hosts)) == old:
            return None
        before = ns.visibility()
        ns.auto_visible, ns.hosts = auto_visible, set(hosts)

        async def undo() -> None:
            ns.auto_visible, ns.hosts = old

        return undo, masking.concerns(before, ns.visibility())

    def _visibility_notice(self, subnqn: str, ns: Namespace, concerns: Callable[[str], bool]) -> None:
        """Exactly the controllers whose view changed hear of it: log 04h + AEN, and log 0Ch (a Linux host
        with ANA attaches a namespace only once its group lists it there: see add_namespace)."""
        if ns.enabled:   # a disabled namespace is inactive for every host either way
            self.target.namespace_changed(subnqn, ns.nsid, concerns)
            self._ana_changed(subnqn=subnqn, groups=(ns.anagrpid,), concerns=concerns)

    def namespace_reservations(self, subnqn: str, nsid: int) -> dict[str, Any]:
        """The namespace's reservation holder, type, registrants (keys redacted) and generation; the host
        NQNs of the controllers connected now with each registrant's HOSTID."""
        ns = self.get_namespace(subnqn, nsid)
        hostnqns: dict[bytes, list[str]] = {}
        for ctrl in self.target.controllers.values():
            if ctrl.subsystem.nqn == subnqn and ctrl.hostnqn not in hostnqns.get(ctrl.hostid, ()):
                hostnqns.setdefault(ctrl.hostid, []).append(ctrl.hostnqn)
        return {"subnqn": subnqn, "nsid": nsid, "supported": self.target.reservations_supported,
                **pr.report(ns, hostnqns)}

    # --- Asymmetric Namespace Access -----------------------------------------------------------

    def _ana_entry(self, listener: Listener) -> dict[str, Any]:
        saved = self._ana_saved.get(listener.id)
        if not saved:
            return {}
        return {"ana_states": {str(g): ANA_STATE_NAMES[st] for g, st in sorted(saved.items())}}

    async def set_namespace_anagrpid(self, subnqn: str, nsid: int, anagrpid: int) -> Namespace:
        """Move a namespace to another ANA group (nvmet configfs namespaces/<nsid>/ana_grpid): the ANA
        log lists it there from now on and every controller of the subsystem gets the ANA change AEN."""
        async with self._lock:
            ns = self.get_namespace(subnqn, nsid)
            old = ns.anagrpid
            undo = self._anagrpid_step(ns, anagrpid)
            if undo is None:
                return ns
            await self._commit(True, undo)
            log.info("namespace %d of %s moved from ANA group %d to %d", nsid, subnqn, old, ns.anagrpid)
            self._ana_changed(subnqn=subnqn, groups=(old, ns.anagrpid))
            await self._settle()
            return ns

    def _anagrpid_step(self, ns: Namespace, anagrpid: int) -> Undo | None:
        anagrpid = _anagrpid(anagrpid)
        old = ns.anagrpid
        if old == anagrpid:
            return None
        ns.anagrpid = anagrpid

        async def undo() -> None:
            ns.anagrpid = old

        return undo

    async def set_ana_state(self, listener_id: str, anagrpid: int, state: AnaState | str, *,
                            persist: bool = True) -> Listener:
        """One group's ANA state on one listener (nvmet ports/<portid>/ana_groups/<grpid>/ana_state)."""
        if self.gateway is not None:
            raise ServiceError(409, f"this target is a member of gateway group {self.gateway.group_name}: the group "
                               "decides the ANA states by who holds each group's lock (see nvmeof gateway list); "
                               "move a namespace with set-anagrpid, or restart without --gateway-group to set "
                               "states by hand")
        async with self._lock:
            listener = self.get_listener(listener_id)
            grp = _anagrpid(anagrpid)
            st = _ana_state(state)
            await self._apply_ana({grp: st}, [listener], persist=persist)
            return listener

    async def set_ana_states(self, states: Mapping[int, AnaState | str], *,
                             listener_ids: Sequence[str] | None = None, persist: bool = False) -> None:
        """Several groups' states on several listeners at once (None: every I/O listener), one ANA
        change AEN per controller concerned. ``persist=False`` (a gateway group recomputing who owns
        what) changes only what is served; the configuration file keeps what the operator set."""
        async with self._lock:
            checked = {_anagrpid(g): _ana_state(st) for g, st in states.items()}
            if listener_ids is None:
                listeners = [lst for lst in self.target.listeners.values() if not lst.discovery]
            else:
                listeners = [self.get_listener(lid) for lid in listener_ids]
            await self._apply_ana(checked, listeners, persist=persist)

    def ana_states_now(self, states: Mapping[int, AnaState]) -> bool:
        """Runtime ANA states on every I/O listener at once, WITHOUT the service lock: a gateway group member
        stepping down at its fencing deadline must not wait for a mutation in progress (or its store call).
        One ANA change AEN per controller concerned; returns whether anything changed (then await
        target.settle() for worker processes). Nothing is persisted."""
        changed, groups = self._serve_ana(states, [x for x in self.target.listeners.values() if not x.discovery])
        if changed:
            self._ana_changed(listeners=changed, groups=groups)
        return bool(changed)

    @staticmethod
    def _serve_ana(states: Mapping[int, AnaState], listeners: list[Listener]) -> tuple[list[Listener], set[int]]:
        """Set what ``listeners`` serve; returns the listeners and groups that changed (for the AEN)."""
        changed: list[Listener] = []
        groups: set[int] = set()
        for lst in listeners:
            moved = [g for g, st in states.items() if lst.ana_state(g) != st]
            for g in moved:
                log.info("listener %s: ANA group %d %s -> %s", lst.id, g, ANA_STATE_NAMES[lst.ana_state(g)],
                         ANA_STATE_NAMES[states[g]])
                lst.set_ana_state(g, states[g])
            if moved:
                changed.append(lst)
                groups.update(moved)
        return changed, groups

    async def _apply_ana(self, states: dict[int, AnaState], listeners: list[Listener], *, persist: bool) -> None:
        saved_before = copy.deepcopy(self._ana_saved)
        undo, changed, groups = self._ana_step(states, listeners, persist=persist)
        if persist and self._ana_saved != saved_before:
            await self._commit(True, undo)
        if changed:
            self._ana_changed(listeners=changed, groups=groups)
            await self._settle()   # with worker processes: their I/O queues check the new states

    def _ana_step(self, states: dict[int, AnaState], listeners: list[Listener], *,
                  persist: bool) -> tuple[Undo, list[Listener], set[int]]:
        """Served (and with ``persist`` configured) states, unsaved and unannounced; the undo and what changed."""
        before = [(lst, dict(lst.ana_states)) for lst in listeners]
        saved_before = copy.deepcopy(self._ana_saved)
        changed, groups = self._serve_ana(states, listeners)
        if persist:
            for lst in listeners:
                saved = self._ana_saved.setdefault(lst.id, {})
                for g, st in states.items():
                    if st == AnaState.OPTIMIZED:
                        saved.pop(g, None)
                    else:
                        saved[g] = st
                if not saved:
                    del self._ana_saved[lst.id]

        async def undo() -> None:
            for lst, old in before:
                lst.set_ana_states(old)
            self._ana_saved.clear()
            self._ana_saved.update(saved_before)

        return undo, changed, groups

    def _reload_ana(self, listener_id: str, states: dict[str, Any]) -> tuple[Undo, list[Listener], set[int]] | None:
        """A reloaded file's ana_states of a listener that stays: exactly those (groups it no longer
        names are optimized again). None when a gateway group decides them."""
        if self.gateway is not None:
            log.warning("listener %s: its ana_states in the reloaded configuration are ignored: gateway group %s "
                        "decides the ANA states", listener_id, self.gateway.group_name)
            return None
        listener = self.get_listener(listener_id)
        wanted = {int(g): parse_ana_state(st) for g, st in states.items()}
        for grp in self._ana_saved.get(listener_id, {}):
            wanted.setdefault(grp, AnaState.OPTIMIZED)
        return self._ana_step(wanted, [listener], persist=True)

    def _restore_ana(self, listener: Listener, states: dict[str, Any] | None) -> None:
        """A configuration's ``ana_states`` of a listener it just added (config.item_problems checked them)."""
        if not states:
            return
        if self.gateway is not None:  # the gateway group decides (a saved "optimized" would be split brain)
            log.warning("listener %s: its ana_states in the configuration are ignored: gateway group %s decides "
                        "the ANA states", listener.id, self.gateway.group_name)
            return
        parsed = {int(g): parse_ana_state(st) for g, st in states.items()}
        listener.set_ana_states(parsed)
        saved = {g: st for g, st in parsed.items() if st != AnaState.OPTIMIZED}
        if saved:
            self._ana_saved[listener.id] = saved
        self._ana_changed(listeners=[listener], groups=parsed)

    def ana_groups(self) -> dict[int, list[tuple[str, int]]]:
        """{anagrpid: [(subnqn, nsid), ...]} over every namespace, enabled or not, by group id."""
        out: dict[int, list[tuple[str, int]]] = {}
        for sub, ns in self._all_namespaces():
            out.setdefault(ns.anagrpid, []).append((sub.nqn, ns.nsid))
        return {g: sorted(out[g]) for g in sorted(out)}

    def ana_report(self) -> list[dict[str, Any]]:
        """Per listener: its state in every ANA group that has a namespace or a state set on it."""
        used = set(self.ana_groups())
        report = []
        for lst in self.target.listeners.values():
            groups = sorted(used | set(lst.ana_states))
            report.append({
                "listener_id": lst.id,
                "trtype": lst.trtype,
                "traddr": lst.traddr,
                "trsvcid": lst.trsvcid,
                "portid": lst.portid,
                "discovery": lst.discovery,
                "states": {str(g): ANA_STATE_NAMES[lst.ana_state(g)] for g in groups},
                "saved": {str(g): ANA_STATE_NAMES[st] for g, st in sorted(self._ana_saved.get(lst.id, {}).items())},
            })
        return report

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


def _open_store(backend: str, **kw: Any) -> tuple[Any, dict[str, str] | None]:
    """Open the backend and read the identity it keeps (both may block: run in a thread)."""
    store = open_backend(backend, **kw)
    try:
        return store, store.stored_identity()
    except BackendError:
        TargetService._discard_backend(store)
        raise


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


def _current_qos(ns: Namespace) -> tuple[qosmod.QosLimits, dict[str, qosmod.QosLimits]]:
    if ns.qos is None:
        return qosmod.UNLIMITED, {}
    return ns.qos.limits, dict(ns.qos.host_limits)


def _qos_words(limits: qosmod.QosLimits) -> str:
    return ", ".join(f"{k} {v}" for k, v in limits.as_dict().items() if v) or "unlimited"

