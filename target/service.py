"""TargetService: every management change, validated, serialized, persisted, then applied live.

Daemon start-up, config restore, the REST API and the CLI all come through here. Each mutation:
1. takes the one asyncio.Lock, so changes never interleave;
2. validates everything before touching anything, so a refused request changes nothing;
3. applies the change in memory and saves the whole configuration atomically (when a config path
   is set); if the save fails the change is undone and the caller gets a 500;
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
import dataclasses
import errno
import ipaddress
import logging
import os
import secrets
import uuid as uuidlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nvmeof import defaults
from nvmeof.spec.fabrics import PORTID_MAX
from nvmeof.spec.identify import NSID_MAX
from nvmeof.spec.logs import ANA_STATE_NAMES, AnaState, parse_ana_state
from target import config as configmod
from target import hostauth, masking, pr
from target import qos as qosmod
from target.backends import (
    BackendError,
    BackendSpec,
    StoragePolicy,
    backend_class,
    kinds,
    open_backend,
    spec_of,
    storage_key,
    validate_spec,
)
from target.backends.base import close_backends
from target.model import (
    ADRFAMS,
    BLOCK_SIZES,
    TRTYPES,
    Listener,
    Namespace,
    Referral,
    Subsystem,
    endpoint_id,
)
from target.nqn import NqnError, generate_nqn, validate_nqn

if TYPE_CHECKING:
    from target.controller import Controller
    from target.pr import PrStore

SERIAL_MAX = 20  # Identify Controller SN, bytes
MODEL_MAX = 40  # Identify Controller MN, bytes

Undo = Callable[[], Awaitable[None]]


def _sync(fn: Callable[[], object]) -> Undo:
    """A plain call as an entry of an undo or notice log (whose entries are awaited)."""
    async def run() -> None:
        fn()
    return run

log = logging.getLogger(__name__)

# (where, item) pairs for subsystems/listeners/referrals; (subnqn, where, item) for namespaces.
Placed = list[tuple[str, Any]]
PlacedNs = list[tuple[str, str, Any]]


@dataclasses.dataclass
class Unrestored:
    """A configuration item a replay could not apply; kept so that it is not lost from the file."""

    kind: str  # "subsystem" | "namespace" | "listener" | "referral"
    where: str  # its place in the configuration it came from, e.g. "subsystems[1].namespaces[0]"
    error: str
    item: dict[str, Any]  # the entry exactly as given; snapshot() writes it back
    subnqn: str | None = None  # the subsystem a namespace belongs to

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "where": self.where,
            "subsystem": self.subnqn,
            "error": self.error,
            "item": copy.deepcopy(self.item),
        }


class TargetHooks(Protocol):
    """What TargetService needs from target.core.Target."""

    subsystems: dict[str, Subsystem]
    listeners: dict[str, Listener]
    referrals: list[Referral]
    controllers: dict[int, Controller]
    # reservations (target/pr.py): where states are kept (None: RAM only) and whether they are served
    pr_store: PrStore | None
    reservations_supported: bool

    def namespace_changed(self, subnqn: str, nsid: int, concerns: Callable[[str], bool] | None = None) -> None: ...
    def discovery_changed(self) -> None: ...
    async def settle(self) -> None: ...
    async def start_workers(self) -> None: ...
    async def start_listener(self, listener: Listener) -> None: ...
    async def stop_listener(self, listener: Listener) -> None: ...
    def disconnect_subsystem(self, subnqn: str) -> int: ...
    def disconnect_disallowed(self, subnqn: str) -> int: ...
    def disconnect_listener(self, listener: Listener) -> int: ...
    def controllers_info(self) -> list[dict[str, Any]]: ...
    def disconnect_controller(self, cntlid: int) -> bool: ...
    # for a gateway group member (target/gateway/group.py), which drives the target through its service
    def listening_port(self, listener: Listener) -> int: ...
    def set_pr_store(self, store: PrStore | None) -> None: ...
    def set_cntlid_range(self, lo: int, hi: int) -> None: ...
    def set_ana_default(self, state: AnaState) -> None: ...
    def set_peer_listeners(self, peers: list[Listener]) -> None: ...
    # ANA states (on listeners) or a group's namespaces (in subnqn) changed: bump the ANA change counts
    # and send the ANA change AEN to the controllers concerned (target.core.Target.ana_changed).
    def ana_changed(self, *, subnqn: str | None = None, listeners: Iterable[Listener] | None = None,
                    groups: Iterable[int] = (), concerns: Callable[[str], bool] | None = None) -> int: ...


class GatewayMember(Protocol):
    """What TargetService asks of the gateway group member it belongs to (target/gateway/group.py)."""

    @property
    def group_name(self) -> str: ...
    # The group's store took a change that was then undone here: apply the store's version again.
    def store_ahead(self) -> None: ...
    async def report(self) -> dict[str, Any]: ...   # what GET /api/v1/gateway returns
    # A member gone for good leaves the group (refused while it is alive): DELETE /api/v1/gateway/members/NAME
    async def remove_member(self, name: str) -> None: ...


class ServiceError(Exception):
    """A refused or failed management request. ``status`` follows HTTP: 400 bad input, 404 no such
    object, 409 conflicts with the current state, 500 the change could not be applied or saved."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _bad(message: str) -> ServiceError:
    return ServiceError(400, message)


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise _bad(f"{name} {value} is out of range; use {low}..{high}")
    return value


def _anagrpid(value: Any) -> int:
    return _int(value, "anagrpid", 1, defaults.ANAGRPMAX)


def _ana_state(value: Any) -> AnaState:
    try:
        return parse_ana_state(value)
    except ValueError as exc:
        raise _bad(str(exc)) from None


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(f"{name} must be true or false, got {value!r}")
    return value


def _ascii_field(value: Any, name: str, limit: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(f"{name} must be a non-empty string, got {value!r}")
    if any(not (0x20 <= ord(ch) <= 0x7E) for ch in value):
        raise _bad(f"{name} {value!r} must be printable ASCII (it goes into a fixed ASCII field)")
    if len(value) > limit:
        raise _bad(f"{name} {value!r} is {len(value)} characters; the limit is {limit}")
    return value


def _hex_id(value: Any, name: str, length: int) -> bytes:
    """Parse an NGUID/EUI-64 given as bytes or hex text (with optional '-' or ':' separators)."""
    if isinstance(value, bytes | bytearray):
        raw = bytes(value)
    elif isinstance(value, str):
        digits = value.replace("-", "").replace(":", "").strip()
        try:
            raw = bytes.fromhex(digits)
        except ValueError:
            raise _bad(f"{name} {value!r} is not hexadecimal") from None
    else:
        raise _bad(f"{name} must be hex text, got {value!r}")
    if len(raw) != length:
        raise _bad(f"{name} {value!r} is {len(raw)} bytes; it must be {length} ({2 * length} hex digits)")
    if raw == bytes(length):
        raise _bad(f"{name} is all zeros, which tells the host there is none; leave it out to generate one")
    return raw


def _uuid(value: Any) -> uuidlib.UUID:
    if isinstance(value, uuidlib.UUID):
        parsed = value
    else:
        try:
            parsed = uuidlib.UUID(str(value))
        except ValueError:
            raise _bad(f"uuid {value!r} is not a UUID (8-4-4-4-12 hex digits)") from None
    if parsed.int == 0:
        raise _bad("uuid is all zeros, which tells the host there is none; leave it out to generate one")
    return parsed


def _nqn(value: Any, what: str) -> str:
    try:
        return validate_nqn(value, what=what)
    except NqnError as exc:
        raise _bad(str(exc)) from None


def _address(trtype: Any, traddr: Any, trsvcid: Any, adrfam: Any) -> tuple[str, str, str, int]:
    if trtype not in TRTYPES:
        raise _bad(f"transport type {trtype!r} is not supported; use one of {', '.join(TRTYPES)}")
    try:
        ip = ipaddress.ip_address(str(traddr).strip("[]"))
    except ValueError:
        raise _bad(f"address {traddr!r} is not an IPv4 or IPv6 address") from None
    family = "ipv6" if ip.version == 6 else "ipv4"
    if adrfam is not None and adrfam != family:
        if adrfam not in ADRFAMS:
            raise _bad(f"address family {adrfam!r} is not supported; use one of {', '.join(ADRFAMS)}")
        raise _bad(f"address {traddr} is {family}, but the address family given is {adrfam}")
    return trtype, family, str(ip), _int(trsvcid, "port (trsvcid)", 1, 65535)


def _masking(check: Callable[[], Any]) -> Any:
    try:
        return check()
    except masking.MaskingError as exc:
        raise ServiceError(exc.status, exc.message) from None


def _visibility(sub: Subsystem, nsid: int, auto_visible: Any, hosts: Any) -> tuple[bool, set[str]]:
    return _masking(lambda: masking.check_visibility(sub, nsid, auto_visible, hosts))


def _restore_hosts(dropped: list[tuple[Namespace, str]]) -> None:
    """Undo masking.drop_unadmitted."""
    for ns, hostnqn in dropped:
        ns.hosts.add(hostnqn)


async def _nothing() -> None:
    return None


class TargetService:
    def __init__(
        self,
        target: TargetHooks,
        *,
        config_path: str | os.PathLike[str] | None = None,
        **policy_settings: Any,
    ) -> None:
        """``policy_settings`` are the operator's fences for the backends that have one (StoragePolicy:
        ``backing_dirs``, default the state directory's disks/, and ``block_devices`` where file
        namespaces may live; ``ceph_confs``... for RBD; `nvmeof serve --backing-dir`, ...), for every
        caller alike. A configuration file replayed at start-up may add its own (it is the operator's
        file too); nothing that comes through the API can widen them. BackingError (a BackendError)
        if one of them is unusable, TypeError for a setting no backend takes."""
        self.target = target
        self.config_path = os.fspath(config_path) if config_path is not None else None
        self.backing = StoragePolicy.from_settings(**policy_settings)
        self._flag_backing = self.backing
        # the configuration file's own policy keys, written back by snapshot() as they were read
        self._config_backing: dict[str, list[str]] = {}
        self._lock = asyncio.Lock()
        self._unrestored: list[Unrestored] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        # ANA states per listener as configured (persisted); Listener.ana_states is what is served,
        # which a gateway group also sets at run time (set_ana_states(persist=False)), unsaved.
        self._ana_saved: dict[str, dict[int, AnaState]] = {}
        # The gateway group this target is a member of (join_gateway), and its hook that every persisted
        # change calls before it is saved (set_change_hook).
        self._gateway: GatewayMember | None = None
        self._on_change: Callable[[], Awaitable[None]] | None = None

    # --- the gateway group ------------------------------------------------------------------------

    @property
    def gateway(self) -> GatewayMember | None:
        """The gateway group member this target belongs to (it decides the ANA states), or None."""
        return self._gateway

    def join_gateway(self, member: GatewayMember) -> None:
        self._gateway = member

    def set_change_hook(self, hook: Callable[[], Awaitable[None]] | None) -> None:
        """``hook`` is awaited by every persisted change before it is saved; a ServiceError from it undoes the
        change (a gateway group writes the shared configuration to its store there). None: no hook."""
        self._on_change = hook

    # --- reads ---------------------------------------------------------------------------------

    def list_subsystems(self) -> list[Subsystem]:
        return [s for s in self.target.subsystems.values() if s.subtype == "nvm"]

    def get_subsystem(self, nqn: str) -> Subsystem:
        sub = self.target.subsystems.get(nqn)
        if sub is None or sub.subtype != "nvm":
            raise ServiceError(404, f"no subsystem {nqn!r}; list them to see the NQNs")
        return sub

    def list_namespaces(self, subnqn: str) -> list[Namespace]:
        sub = self.get_subsystem(subnqn)
        return [sub.namespaces[nsid] for nsid in sorted(sub.namespaces)]

    def get_namespace(self, subnqn: str, nsid: int) -> Namespace:
        sub = self.get_subsystem(subnqn)
        ns = sub.namespaces.get(nsid)
        if ns is None:
            have = ", ".join(str(n) for n in sorted(sub.namespaces)) or "none"
            raise ServiceError(404, f"subsystem {subnqn} has no namespace {nsid} (it has: {have})")
        return ns

    def list_listeners(self) -> list[Listener]:
        return list(self.target.listeners.values())

    def get_listener(self, listener_id: str) -> Listener:
        listener = self.target.listeners.get(listener_id)
        if listener is None:
            have = ", ".join(self.target.listeners) or "none"
            raise ServiceError(404, f"no listener {listener_id!r} (listeners: {have})")
        return listener

    def list_referrals(self) -> list[Referral]:
        return list(self.target.referrals)

    def controllers(self) -> list[dict[str, Any]]:
        return self.target.controllers_info()

    # --- commit machinery ----------------------------------------------------------------------

    async def _commit(self, persist: bool, undo: Undo) -> None:
        if persist and self._on_change is not None:
            # A gateway group writes the shared configuration to its store first (target/gateway/group.py):
            # refused there (another gateway changed it at the same moment, the store is out of reach),
            # the change is undone here too.
            try:
                await self._on_change()
            except ServiceError:
                await undo()
                raise
        if not persist or self.config_path is None:
            return
        try:
            await asyncio.to_thread(configmod.save_config, self.config_path, self.snapshot())
        except configmod.ConfigError as exc:
            await undo()
            self._store_ahead()
            raise ServiceError(500, f"{exc}; the change was undone") from exc

    def _store_ahead(self) -> None:
        """A gateway group's store took a change that was then undone here (the local save failed): the
        member applies the store's version again, so it does not stay behind the group for good."""
        if self._on_change is not None and self._gateway is not None:
            self._gateway.store_ahead()

    async def _settle(self) -> None:
        """With worker processes (`serve --workers`), wait until they have applied a namespace change,
        so I/O the host sends after this call returns sees it."""
        await self.target.settle()

    async def save(self) -> None:
        """Write the running configuration to the config file now (under the lock, like a mutation)."""
        async with self._lock:
            await self._commit(True, _nothing)

    # --- what a replay could not restore -------------------------------------------------------

    def unrestored(self) -> list[dict[str, Any]]:
        """Configuration items kept from a replay that failed, with the reason, oldest first; host
        secrets show as presence flags (this goes to the API)."""
        out = [u.as_dict() for u in self._unrestored]
        for entry in out:
            entry["item"] = hostauth.redact_item(entry["item"])
        return out

    def _pending(self, kind: str) -> list[Unrestored]:
        return [u for u in self._unrestored if u.kind == kind]

    def _pending_conflict(self, what: str, entry: Unrestored) -> ServiceError:
        return ServiceError(
            409,
            f"{what} is in the configuration but was not restored ({entry.where}: {entry.error}); "
            "retry it (POST /api/v1/config/unrestored/retry) or discard it "
            "(DELETE /api/v1/config/unrestored) first",
        )

    def _pending_nsids(self, subnqn: str) -> set[int]:
        return {
            u.item["nsid"]
            for u in self._pending("namespace")
            if u.subnqn == subnqn and isinstance(u.item.get("nsid"), int)
        }

    def _drop_pending_endpoint(self, kind: str, eid: str) -> None:
        """A live add of the same listener/referral supersedes the one that failed to restore."""
        for u in self._pending(kind):
            if _endpoint_key(u.item) == eid:
                log.info("%s %s is live now; dropping the copy from %s that was not restored", kind, eid, u.where)
                self._unrestored.remove(u)

    async def retry_unrestored(self) -> list[str]:
        """Replay the unrestored items again (say, once the missing disk is mounted) and save.

        Returns the errors of the items that still fail; those stay remembered."""
        async with self._lock:
            pending, self._unrestored = self._unrestored, []
            before = self._inventory()
            errors: list[str] = []
            await self._replay(
                [(u.where, u.item) for u in pending if u.kind == "subsystem"],
                [(u.subnqn or "", u.where, u.item) for u in pending if u.kind == "namespace"],
                [(u.where, u.item) for u in pending if u.kind == "listener"],
                [(u.where, u.item) for u in pending if u.kind == "referral"],
                errors,
                keep=True,
            )
            await self._save_or_roll_back(before, pending, "the retry")
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

    async def add_subsystem(
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
        async with self._lock:
            return await self._add_subsystem(nqn, serial, model, allow_any_host, hosts, max_namespaces, persist=True,
                                             host_auth=host_auth, dhchap_hash=dhchap_hash,
                                             dhchap_dhgroup=dhchap_dhgroup)

    async def _add_subsystem(
        self,
        nqn: str | None,
        serial: str | None,
        model: str,
        allow_any_host: bool | None,
        hosts: Iterable[str],
        max_namespaces: int,
        *,
        persist: bool,
        host_auth: dict[str, dict[str, Any]] | None = None,
        dhchap_hash: Any = None,
        dhchap_dhgroup: Any = None,
    ) -> Subsystem:
        nqn = generate_nqn() if nqn is None else _nqn(nqn, "subsystem NQN")
        if nqn in self.target.subsystems:
            raise ServiceError(409, f"subsystem {nqn} already exists")
        for u in self._pending("subsystem"):
            if u.item.get("nqn") == nqn:
                raise self._pending_conflict(f"subsystem {nqn}", u)
        serial = secrets.token_hex(SERIAL_MAX // 2) if serial is None else _ascii_field(serial, "serial", SERIAL_MAX)
        model = _ascii_field(model, "model", MODEL_MAX)
        if isinstance(hosts, str):
            raise _bad("hosts must be a list of host NQNs, not a single string")
        host_set = {_nqn(h, "host NQN") for h in hosts}
        if allow_any_host is None:
            allow_any_host = not host_set
        elif _bool(allow_any_host, "allow_any_host") and host_set:
            raise _bad(
                "give either allow_any_host or a list of hosts, not both: "
                "with allow_any_host every host may connect and the list would mean nothing"
            )
        max_namespaces = _int(max_namespaces, "max_namespaces", 1, NSID_MAX)
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

        await self._commit(persist, undo)
        self.target.discovery_changed()
        return sub

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
            allow = _bool(allow, "allow_any_host")
            if allow and sub.hosts:
                raise ServiceError(
                    409,
                    f"subsystem {nqn} lists allowed hosts {sorted(sub.hosts)}; deny them first, then allow any host",
                )
            old = sub.allow_any_host
            sub.allow_any_host = allow
            dropped = masking.drop_unadmitted(sub)
            qos_undo = self._drop_unadmitted_qos(sub)

            async def undo() -> None:
                sub.allow_any_host = old
                _restore_hosts(dropped)
                for step in qos_undo:
                    await step()

            await self._commit(True, undo)
            disconnected = await self._revoke(nqn)
            self.target.discovery_changed()
            return disconnected

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
            dropped = masking.drop_unadmitted(sub)
            qos_undo = self._drop_unadmitted_qos(sub)

            async def undo() -> None:
                sub.hosts.add(hostnqn)
                if auth is not None:
                    sub.host_auth[hostnqn] = auth
                _restore_hosts(dropped)
                for step in qos_undo:
                    await step()

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
        return await self.set_host_auth(subnqn, hostnqn, {field: None for field in hostauth.FIELDS})

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

    async def _revoke(self, subnqn: str) -> int:
        """After the allow-list of ``subnqn`` shrank: the hosts it no longer admits lose their controllers,
        in worker processes too (``_settle``), before the management call returns."""
        disconnected = self.target.disconnect_disallowed(subnqn)
        if disconnected:
            await self._settle()
        return disconnected

    # --- namespaces ----------------------------------------------------------------------------

    def _all_namespaces(self) -> Iterable[tuple[Subsystem, Namespace]]:
        for sub in self.target.subsystems.values():
            for ns in sub.namespaces.values():
                yield sub, ns

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

    def _drop_unadmitted_qos(self, sub: Subsystem) -> list[Undo]:
        """The per-host QoS limits of hosts ``sub`` no longer admits go with them (as their namespace
        visibility does, masking.drop_unadmitted): a host allowed again later starts unlimited, and the saved
        configuration names no host the subsystem refuses. Their commands waiting are let go (the host's
        connections are being disconnected). Returns the undo steps."""
        undo = []
        for ns in sub.namespaces.values():
            if ns.qos is None or not ns.qos.host_limits:
                continue
            limits, hosts = _current_qos(ns)
            kept = {h: lim for h, lim in hosts.items() if sub.host_allowed(h)}
            if len(kept) != len(hosts):
                log.info("namespace %d of %s: QoS limits of host(s) %s dropped (no longer allowed)", ns.nsid,
                         sub.nqn, ", ".join(sorted(set(hosts) - set(kept))))
                undo.append(self._qos_step(ns, limits, kept))
        return undo

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

    def _ana_changed(self, *, subnqn: str | None = None, listeners: Iterable[Listener] | None = None,
                     groups: Iterable[int] = (), concerns: Callable[[str], bool] | None = None) -> None:
        self.target.ana_changed(subnqn=subnqn, listeners=listeners, groups=groups, concerns=concerns)

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

    async def add_listener(
        self,
        trtype: str,
        traddr: str,
        trsvcid: int | str,
        adrfam: str | None = None,
        discovery: bool = False,
        portid: int | None = None,
    ) -> Listener:
        async with self._lock:
            return await self._add_listener(trtype, traddr, trsvcid, adrfam, discovery, portid, persist=True)

    async def _add_listener(
        self,
        trtype: str,
        traddr: str,
        trsvcid: int | str,
        adrfam: str | None,
        discovery: bool,
        portid: int | None,
        *,
        persist: bool,
    ) -> Listener:
        trtype, adrfam, traddr, port = _address(trtype, traddr, trsvcid, adrfam)
        discovery = _bool(discovery, "discovery")
        lid = endpoint_id(trtype, traddr, port)
        if lid in self.target.listeners:
            raise ServiceError(409, f"listener {lid} already exists")
        used = {lst.portid for lst in self.target.listeners.values()}
        if portid is None:
            portid = next((p for p in range(1, PORTID_MAX + 1) if p not in used), None)
            if portid is None:
                raise ServiceError(409, f"every port id 1..{PORTID_MAX} is used by a listener")
        else:
            portid = _int(portid, "portid", 1, PORTID_MAX)
            if portid in used:
                raise ServiceError(
                    409,
                    f"port id {portid} is already used by another listener; leave it out to get a free one",
                )
        listener = Listener(
            trtype=trtype, adrfam=adrfam, traddr=traddr, trsvcid=port, portid=portid, discovery=discovery
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

        await self._commit(persist, undo)
        self.target.discovery_changed()
        return listener

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

    async def add_referral(
        self,
        traddr: str,
        trsvcid: int | str = defaults.TCP_DISCOVERY_PORT,
        trtype: str = "tcp",
        adrfam: str | None = None,
        subnqn: str = defaults.DISCOVERY_NQN,
        portid: int = 0,
    ) -> Referral:
        async with self._lock:
            return await self._add_referral(traddr, trsvcid, trtype, adrfam, subnqn, portid, persist=True)

    async def _add_referral(
        self,
        traddr: str,
        trsvcid: int | str,
        trtype: str,
        adrfam: str | None,
        subnqn: str,
        portid: int,
        *,
        persist: bool,
    ) -> Referral:
        trtype, adrfam, traddr, port = _address(trtype, traddr, trsvcid, adrfam)
        if subnqn != defaults.DISCOVERY_NQN:
            subnqn = _nqn(subnqn, "referral subsystem NQN")
        portid = _int(portid, "portid", 0, PORTID_MAX)
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

        await self._commit(persist, undo)
        self.target.discovery_changed()
        return referral

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

    # --- controllers ---------------------------------------------------------------------------

    async def disconnect_controller(self, cntlid: int) -> None:
        cntlid = _int(cntlid, "cntlid", 0, 0xFFFF)
        if not self.target.disconnect_controller(cntlid):
            raise ServiceError(404, f"no connected controller with cntlid {cntlid}")
        await self._settle()  # with worker processes: its I/O queues there are closed before this returns

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
        async with self._lock:
            self._config_policy(config, errors, start_up=not persist)
            before = self._inventory()
            kept = list(self._unrestored)
            await self._replay(placed[0], [], placed[1], placed[2], errors, keep=not persist)
            if persist:
                await self._save_or_roll_back(before, kept, "the import")
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

    def _inventory(self) -> tuple[set[str], set[tuple[str, int]], set[str], list[Referral]]:
        return (
            set(self.target.subsystems),
            {(sub.nqn, ns.nsid) for sub, ns in self._all_namespaces()},
            set(self.target.listeners),
            list(self.target.referrals),
        )

    async def _save_or_roll_back(
        self,
        before: tuple[set[str], set[tuple[str, int]], set[str], list[Referral]],
        unrestored: list[Unrestored],
        what: str,
    ) -> None:
        """Save after a multi-item change; if saving fails, take out everything added since
        ``before`` (and put the unrestored list back), so memory matches the file again."""
        if self._on_change is not None:  # a gateway group's store first, as in _commit
            try:
                await self._on_change()
            except ServiceError:
                await self._take_out(before, unrestored)
                raise
        if self.config_path is None:
            return
        try:
            await asyncio.to_thread(configmod.save_config, self.config_path, self.snapshot())
        except configmod.ConfigError as exc:
            await self._take_out(before, unrestored)
            self._store_ahead()
            raise ServiceError(500, f"{exc}; {what} was undone") from exc

    async def _take_out(
        self, before: tuple[set[str], set[tuple[str, int]], set[str], list[Referral]], unrestored: list[Unrestored]
    ) -> None:
        """Remove everything added since ``before`` and put the unrestored list back."""
        subsystems, namespaces, listeners, referrals = before
        for sub, ns in list(self._all_namespaces()):
            if sub.nqn in subsystems and (sub.nqn, ns.nsid) not in namespaces:
                del sub.namespaces[ns.nsid]
                self.target.namespace_changed(sub.nqn, ns.nsid)
                ns.backend.close()
        for nqn in set(self.target.subsystems) - subsystems:
            sub = self.target.subsystems.pop(nqn)
            self.target.disconnect_subsystem(nqn)
            for ns in sub.namespaces.values():
                ns.backend.close()
        for lid in set(self.target.listeners) - listeners:
            await self.target.stop_listener(self.target.listeners.pop(lid))
        self.target.referrals[:] = referrals
        self._unrestored = unrestored
        self.target.discovery_changed()

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
        nsids and identifiers it left out). Every step runs under the lock into one undo log and the
        result is saved once (a gateway group's store first, through the change hook): a step, the store or
        the save refusing undoes them all, which is what a gateway group applying the store's version
        relies on. Items still waiting from a failed restore that the file keeps as they were stay
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
            saved = (self.backing, self._config_backing, list(self._unrestored))
            before = self._inventory()
            undo: list[Undo] = []   # one log for every step: any failure, the save's included, undoes them all
            later: list[Undo] = []  # what hosts are told, once the whole reload is saved

            async def roll_back() -> None:
                for step in reversed(undo):
                    await step()
                await self._take_out(before, saved[2])
                self.backing, self._config_backing = saved[0], saved[1]

            self._unrestored = []
            self._config_policy(config, errors, start_up=True)
            try:
                if not errors:
                    self._reload_take_away(plan, undo, later)
                    for item in plan.access:   # before new namespaces, whose host lists it admits
                        self._reload_access(item, undo)
                    nss = [(nqn, f"namespace of {nqn}", item) for nqn, item in plan.new_namespaces]
                    await self._replay([("subsystem", item) for item in plan.new_subsystems], nss,
                                       [("listener", item) for item in plan.new_listeners],
                                       [("referral", item) for item in plan.new_referrals], errors, keep=False)
                if not errors:
                    await self._reload_live(plan, undo, later)
            except (ServiceError, configmod.ConfigError) as exc:
                errors.append(exc.message if isinstance(exc, ServiceError) else str(exc))
            except BaseException:  # a bug or a cancellation leaves nothing half applied either
                await roll_back()
                raise
            if errors:
                await roll_back()
                return errors
            self._unrestored = pending
            try:
                await self._commit(True, roll_back)  # the group's store, then the file: once, for all steps
            except ServiceError as exc:
                return [exc.message]
            await self._reload_side_effects(plan, later, saved[2])
        log.info("configuration %s reloaded: %s", self.config_path, plan.summary())
        return []

    async def _reload_live(self, plan: Any, undo: list[Undo], later: list[Undo]) -> None:
        """The changes to namespaces and listeners that stay: sizes (_resize_problems checked them), enabled,
        ANA groups and ANA states, each undoable, unsaved; their notices wait in ``later``."""
        for nqn, nsid, size in plan.resized:
            step = await self._resize_step(self.get_namespace(nqn, nsid), size, allow_shrink=True)
            if step is not None:
                undo.append(step)
                later.append(_sync(lambda nqn=nqn, nsid=nsid: self.target.namespace_changed(nqn, nsid)))
        for nqn, nsid, enabled in plan.enabled:
            ns = self.get_namespace(nqn, nsid)
            step = self._enabled_step(ns, enabled)
            if step is not None:
                undo.append(step)
                later.append(_sync(lambda nqn=nqn, ns=ns: (self.target.namespace_changed(nqn, ns.nsid),
                                                           self._ana_changed(subnqn=nqn, groups=(ns.anagrpid,)))))
        for nqn, nsid, anagrpid in plan.anagrpid:
            ns = self.get_namespace(nqn, nsid)
            old = ns.anagrpid
            step = self._anagrpid_step(ns, anagrpid)
            if step is not None:
                undo.append(step)
                later.append(_sync(lambda nqn=nqn, groups=(old, ns.anagrpid): self._ana_changed(subnqn=nqn,
                                                                                                groups=groups)))
        for nqn, nsid, auto_visible, hosts in plan.visibility:
            ns = self.get_namespace(nqn, nsid)
            auto_visible, hosts = _visibility(self.target.subsystems[nqn], nsid, auto_visible, hosts)
            change = self._visibility_step(ns, auto_visible, hosts)
            if change is not None:
                undo.append(change[0])
                later.append(_sync(lambda nqn=nqn, ns=ns, c=change[1]: self._visibility_notice(nqn, ns, c)))
        for item in plan.access:   # the file narrowed a subsystem's hosts: its namespaces must follow
            stale = masking.unadmitted(self.target.subsystems[item["nqn"]])
            if stale:
                raise _bad(f"subsystem {item['nqn']}: {'; '.join(stale)}, a host the subsystem no longer admits; "
                           "remove it from the namespace's hosts in the file too")
        self._reload_qos(plan, undo, later)
        for lid, states in plan.ana_states:
            done = self._reload_ana(lid, states)
            if done is not None:
                undo.append(done[0])
                changed, groups = done[1], done[2]
                if changed:
                    later.append(_sync(lambda changed=changed, groups=groups: self._ana_changed(listeners=changed,
                                                                                                groups=groups)))

    def _reload_qos(self, plan: Any, undo: list[Undo], later: list[Undo]) -> None:
        for nqn, nsid, item in plan.qos:
            limits, hosts = qosmod.parse_config(item)   # config.item_problems checked it
            undo.append(self._qos_step(self.get_namespace(nqn, nsid), limits, hosts))
            later.append(_sync(lambda nqn=nqn, nsid=nsid: self.target.namespace_changed(nqn, nsid)))

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

    def _reload_take_away(self, plan: Any, undo: list[Undo], later: list[Undo]) -> None:
        """The removals, in memory only (undoable); ``later`` disconnects and closes once saved,
        as remove_namespace/remove_subsystem/remove_listener do."""
        for nqn, nsid in plan.removed_namespaces:
            sub = self.target.subsystems[nqn]
            ns = sub.namespaces.pop(nsid)
            undo.append(_sync(lambda sub=sub, ns=ns: sub.namespaces.__setitem__(ns.nsid, ns)))
            later.append(lambda nqn=nqn, ns=ns: self._dropped_namespace(nqn, ns))
        for nqn in plan.removed_subsystems:
            sub = self.target.subsystems.pop(nqn)
            undo.append(_sync(lambda sub=sub: self.target.subsystems.__setitem__(sub.nqn, sub)))
            later.append(lambda sub=sub: self._dropped_subsystem(sub))
        for lid in plan.removed_listeners:
            lst = self.target.listeners.pop(lid)
            undo.append(_sync(lambda lid=lid, lst=lst: self.target.listeners.__setitem__(lid, lst)))
            later.append(lambda lst=lst: self._dropped_listener(lst))
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

    def _reload_access(self, item: dict[str, Any], undo: list[Undo]) -> None:
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

        undo.append(back)
        sub.hosts, sub.host_auth, sub.allow_any_host, sub.dhchap_hash, sub.dhchap_dhgroup = (
            hosts, auth, allow, hashes, groups)

    async def _reload_side_effects(self, plan: Any, later: list[Undo], unrestored_before: list[Unrestored]) -> None:
        """After the reload is saved: what removals and narrower host lists do to connected hosts."""
        for step in later:
            await step()
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


def _endpoint_key(item: dict[str, Any]) -> str | None:
    """The listener/referral id an item would get, or None if its address does not parse."""
    try:
        trtype, _, traddr, port = _address(_given(item, "trtype", "tcp"), item.get("traddr"),
                                           item.get("trsvcid"), item.get("adrfam"))
    except ServiceError:
        return None
    return endpoint_id(trtype, traddr, port)


def _nsid_order(entry: dict[str, Any]) -> tuple[int, int]:
    nsid = entry.get("nsid")
    return (0, nsid) if isinstance(nsid, int) else (1, 0)


def _given(item: dict[str, Any], key: str, default: Any) -> Any:
    """The item's value for ``key``, or ``default`` when absent or null (a 0 or "" stays, to be refused)."""
    value = item.get(key)
    return default if value is None else value


def _open_store(backend: str, **kw: Any) -> tuple[Any, dict[str, str] | None]:
    """Open the backend and read the identity it keeps (both may block: run in a thread)."""
    store = open_backend(backend, **kw)
    try:
        return store, store.stored_identity()
    except BackendError:
        TargetService._discard_backend(store)
        raise


def _show(value: Any) -> str:
    return value.hex() if isinstance(value, bytes) else str(value)


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


def _host_auth(hostnqn: str, settings: dict[str, Any], base: Any = None) -> Any:
    """hostauth.build with its refusal as a 400 (the message names the field, never the secret)."""
    if not isinstance(settings, dict):
        raise _bad(f"DH-HMAC-CHAP settings of host {hostnqn} must be an object, got {type(settings).__name__}")
    try:
        return hostauth.build(hostnqn, settings, base)
    except hostauth.AuthSettingError as exc:
        raise _bad(str(exc)) from None


def _split_hosts(hosts: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    """A config ``hosts`` list (NQN strings, or objects {"nqn", "dhchap_key", ...}) as the NQNs and
    the settings per NQN."""
    if not isinstance(hosts, list | tuple):
        return hosts, {}
    nqns: list[Any] = []
    settings: dict[str, dict[str, Any]] = {}
    for host in hosts:
        if isinstance(host, dict):
            nqns.append(host.get("nqn"))
            settings[host.get("nqn")] = {k: v for k, v in host.items() if k != "nqn"}
        else:
            nqns.append(host)
    return nqns, settings


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

