"""Namespaces: add (checked whole before the backend opens, the last step that can fail) and remove.

Every namespace gets a UUID, NGUID and EUI-64 unique on this target; storage that keeps an identity
(rbd) gives it back, so every gateway and every restart serves one namespace under one identity. Two
namespaces never share storage (``storage_key``), nor collide with one waiting to be restored. A
Linux host with ANA attaches a new namespace only once the ANA log lists it (nvme-cli #832), so
adding one sends the ANA change AEN too (nvmet_ns_enable).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid as uuidlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nvmeof import defaults
from target import masking, pr, schema
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
from target.model import Namespace
from target.service.base import ServiceBase, locked
from target.service.checks import (
    ServiceError,
    _bad,
    _show,
    _visibility,
)

log = logging.getLogger(__name__)


class NamespacesMixin(ServiceBase):
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

    async def _add_namespace(
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
        anagrpid: int | None = defaults.DEFAULT_ANAGRPID,
        auto_visible: bool = True,
        hosts: Sequence[str] = (),
    ) -> Namespace:
        """``options``: the settings only ``backend`` takes (BACKEND_OPTIONS: an RBD namespace's
        ``pool``, ``image``, ...). ``anagrpid``: its ANA group, 1..ANAGRPMAX. ``auto_visible`` False:
        only the controllers of ``hosts`` see it (target/masking.py)."""
        sub = self.get_subsystem(subnqn)
        anagrpid = schema.ANAGRPID.check(defaults.DEFAULT_ANAGRPID if anagrpid is None else anagrpid)
        if backend not in kinds():
            raise _bad(f"backend {backend!r} is not one of {', '.join(kinds())}")
        if self.gateway is not None and not backend_class(backend).same_data_in_every_process:
            raise _bad(f"backend {backend!r} cannot be exported by gateway group {self.gateway.group_name}: every "
                       "gateway would serve its own copy under one NGUID/UUID, and a host switching paths would "
                       "read another gateway's data; use --backend file on storage every gateway reaches, or rbd")
        block_size = schema.check_block_size(block_size)
        read_only = schema.check_bool(read_only, "read_only")
        enabled = schema.check_bool(enabled, "enabled")
        create = schema.check_bool(create, "create")
        if size is not None:
            size = schema.SIZE.check(size)
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
            nsid = schema.NSID.check(nsid, sub.max_namespaces)
            if nsid in sub.namespaces:
                free = next((n for n in range(1, sub.max_namespaces + 1) if n not in taken), None)
                hint = f"; NSID {free} is free" if free else ""
                raise ServiceError(409, f"NSID {nsid} is already in use in {subnqn}{hint}")
            for u in self._pending("namespace"):
                if u.subnqn == subnqn and u.item.get("nsid") == nsid:
                    raise self._pending_conflict(f"NSID {nsid} of {subnqn}", u)
        auto_visible, visible_hosts = _visibility(sub, nsid, auto_visible, hosts)
        ns_uuid = self._unique_id("uuid", "UUID", None if uuid is None else schema.check_uuid(uuid), uuidlib.uuid4)
        ns_nguid = self._unique_id(
            "nguid",
            "NGUID",
            None if nguid is None else schema.check_hex_id(nguid, "nguid", schema.NGUID_LEN),
            lambda: secrets.token_bytes(16),
        )
        ns_eui64 = self._unique_id(
            "eui64",
            "EUI-64",
            None if eui64 is None else schema.check_hex_id(eui64, "eui64", schema.EUI64_LEN),
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

        await self._commit(True, undo)
        self.target.namespace_changed(subnqn, nsid)
        # The ANA log now lists the NSID in its group: a Linux host with ANA attaches no block device
        # for a new namespace until it has read it there (nvme-cli #832), so tell it (nvmet_ns_enable).
        self._ana_changed(subnqn=subnqn, groups=(anagrpid,), concerns=masking.seen_by(ns))
        store.watch_size(lambda new_size: self._storage_resized(subnqn, nsid, store, new_size))
        await self._settle()
        return ns

    add_namespace = locked(_add_namespace)

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
                schema.check_uuid(stored["uuid"]),
                schema.check_hex_id(stored["nguid"], "nguid", schema.NGUID_LEN),
                schema.check_hex_id(stored["eui64"], "eui64", schema.EUI64_LEN),
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


def _open_store(backend: str, **kw: Any) -> tuple[Any, dict[str, str] | None]:
    """Open the backend and read the identity it keeps (both may block: run in a thread)."""
    store = open_backend(backend, **kw)
    try:
        return store, store.stored_identity()
    except BackendError:
        NamespacesMixin._discard_backend(store)
        raise
