"""RadosStore: a gateway group's store in a RADOS pool (gateways on several machines, RBD namespaces).

Objects in POOL (ceph-nvmeof keeps its gateway state in an omap the same way):
  nvmeof.GROUP.config      omap "version" (decimal), "config" (JSON), "member.NAME" ({"index", "info"});
                           every member watches it, and notifies it after each change
  nvmeof.GROUP.member.NAME cls_lock "alive" held by the running member with a lease, renewed every heartbeat:
                           alive = the lock has a locker (cls_lock drops an expired one)
  nvmeof.GROUP.ana.G       cls_lock "owner" (exclusive, duration = the lease, description = the member name):
                           the ownership of ANA group G

Compare-and-swap of the configuration is one write op guarded by omap_cmp on "version"; an index is
assigned under a short cls_lock "join" on the config object. Renewal uses LOCK_FLAG_MUST_RENEW, so
an expired lock is never silently re-taken by a renew. Fencing: lease_deadline() is the time the
last successful (re)acquire was *sent* plus the lease minus a margin; the OSD started that lease no
earlier, so a member that steps down by then never overlaps with the next owner.

Every call is bounded by rados_osd_op_timeout / rados_mon_op_timeout (defaults.GATEWAY_STORE_TIMEOUT).
"""

from __future__ import annotations

import json
import logging
import math
import struct
import threading
import time
from typing import Any

from nvmeof import defaults
from target.gateway.store import (
    ConfigConflict,
    GroupStore,
    MemberAlive,
    MemberRecord,
    MemberRemoved,
    MemberUnknown,
    StoreError,
    check_name,
    fence_deadline,
    free_index,
    now,
)

log = logging.getLogger(__name__)

LOCK_FLAG_MUST_RENEW = 0x2  # librados.h LIBRADOS_LOCK_FLAG_MUST_RENEW: renew only, fail if not held
CMPXATTR_OP_EQ = 1          # librados.h LIBRADOS_CMPXATTR_OP_EQ
CMPXATTR_OP_GT = 3          # librados.h LIBRADOS_CMPXATTR_OP_GT (an absent omap key compares as ""; the OSD's
                            # omap_cmp knows EQ, LT and GT only: PrimaryLogPG::do_osd_ops, CEPH_OSD_OP_OMAP_CMP)
ECANCELED = 125             # an omap_cmp that does not hold cancels the write op
JOIN_LOCK_SECONDS = 10
NOTIFY_TIMEOUT_MS = 1000    # how long a notify's completion waits for acks (sent asynchronously: see _notify)
OMAP_MAX = 10_000


def _encode_lock_get_info(name: str) -> bytes:
    """cls_lock_get_info_op (src/cls/lock/cls_lock_ops.h): ENCODE_START(1, 1) { string name }."""
    raw = name.encode()
    payload = struct.pack("<I", len(raw)) + raw
    return struct.pack("<BBI", 1, 1, len(payload)) + payload


def _decode_first_locker(out: bytes) -> tuple[int, str | None]:
    """cls_lock_get_info_reply: ENCODE_START header, then map<locker_id_t, locker_info_t>; each key is
    ENCODE_START header, entity_name_t (u8 type, s64 num), string cookie. Returns (lockers, first cookie)."""
    _, _, _, count = struct.unpack_from("<BBII", out, 0)
    if count == 0:
        return 0, None
    off = 10 + 6 + 9
    (length,) = struct.unpack_from("<I", out, off)
    return count, out[off + 4:off + 4 + length].decode(errors="replace")


class RadosStore(GroupStore):
    kind = "rados"

    def __init__(self, pool: str, group: str, lease: float = defaults.GATEWAY_LEASE, *,
                 ceph_conf: str | None = None, keyring: str | None = None,
                 timeout: float = defaults.GATEWAY_STORE_TIMEOUT) -> None:
        super().__init__(group, lease)
        from target.backends import BackendError
        from target.backends.rbd import load_rbd

        try:
            self._rados, _ = load_rbd()
        except BackendError as exc:
            raise StoreError(f"--group-store rados:{pool}: {exc}") from exc
        self.pool = pool
        self.timeout = timeout
        self.duration = max(1, math.ceil(lease))
        self.config_obj = f"nvmeof.{group}.config"
        self.ceph_conf = ceph_conf or defaults.CEPH_CONF
        self.keyring = keyring
        self.cluster, self.ioctx = self._connect()
        self._watch: Any = None
        self._broken_watch: Any = None  # a watch librados reported broken, closed at the next heartbeat
        self._notifies: set[Any] = set()  # aio_notify completions in flight (close() waits for them)
        self._notifies_done = threading.Condition()

    def _connect(self) -> tuple[Any, Any]:
        """A new librados client (a new entity client.N and address) and its ioctx on the pool."""
        cluster = None
        try:
            cluster = self._rados.Rados(conffile=self.ceph_conf)
            if self.keyring:
                cluster.conf_set("keyring", self.keyring)
            for key in ("rados_osd_op_timeout", "rados_mon_op_timeout", "client_mount_timeout"):
                cluster.conf_set(key, str(max(1, math.ceil(self.timeout))))
            cluster.connect(timeout=max(1, int(self.timeout)))
            return cluster, cluster.open_ioctx(self.pool)
        except self._rados.Error as exc:
            if cluster is not None:
                cluster.shutdown()
            raise StoreError(f"--group-store rados:{self.pool}: cannot reach the cluster of {self.ceph_conf}: "
                             f"{exc}") from exc

    has_client = True

    def reconnect(self) -> None:
        """Go on through a new client: this one was blocklisted (fenced by another member), and a client that
        was blocklisted lost its watch and its locks; the new one takes this member's membership lock again
        (once the old one's lease ran out) and watches anew. The old client is shut down."""
        cluster, ioctx = self._connect()
        old = (self.cluster, self.ioctx, self._watch, self._broken_watch)
        self.cluster, self.ioctx = cluster, ioctx
        self._watch = self._broken_watch = None

        def shut_old() -> None:
            for watch in old[2:]:
                if watch is not None:
                    try:
                        watch.close()
                    except self._rados.Error:
                        pass  # the OSD dropped the blocklisted client's watch already
            try:
                old[1].close()
                old[0].shutdown()
            except self._rados.Error:
                pass

        # later: a call of another thread that read the old ioctx before the swap ends within the op timeout,
        # and so do notifies in flight on it
        closer = threading.Timer(self.timeout + NOTIFY_TIMEOUT_MS / 1000 + 2, shut_old)
        closer.daemon = True
        closer.start()
        if self.name is not None:
            self._wait_alive(self.name)
            self._start_watch()
            self._notify()

    def _wait_alive(self, name: str) -> None:
        """Take member ``name``'s membership lock, waiting out a previous holder's lease."""
        deadline = now() + self.lease + 5
        while not self._take_alive():
            if now() > deadline:
                raise StoreError(f"gateway {name} is already running in group {self.group} ({self.where}); "
                                 "give this one another --gateway-name")
            time.sleep(0.25)

    @property
    def where(self) -> str:
        return f"rados:{self.pool}"

    @property
    def config_location(self) -> str:
        return f"the omap of {self.config_obj}"

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._rados.Error as exc:
            raise StoreError(f"group store {self.where}: {what} failed: {exc}") from exc

    # omap ------------------------------------------------------------------------------------------
    def _omap(self) -> dict[str, bytes]:
        def read() -> dict[str, bytes]:
            with self._rados.ReadOpCtx() as op:
                items, _ = self.ioctx.get_omap_vals(op, "", "", OMAP_MAX)
                self.ioctx.operate_read_op(op, self.config_obj)
                return {key: value for key, value in items}

        try:
            return read()
        except self._rados.ObjectNotFound:
            return {}
        except self._rados.Error as exc:
            raise StoreError(f"group store {self.where}: reading {self.config_obj} failed: {exc}") from exc

    def _set(self, values: dict[str, bytes]) -> None:
        def write() -> None:
            with self._rados.WriteOpCtx() as op:
                self.ioctx.set_omap(op, tuple(values), tuple(values.values()))
                self.ioctx.operate_write_op(op, self.config_obj)

        self._call(f"writing {self.config_obj}", write)

    def _notify(self) -> None:
        """Tell every watcher the object changed, without waiting for their acks: the OSD delivers a notify to
        the live watchers at once, but completes it only when all have acked or the timeout passed, and a
        member killed with -9 keeps its watch until osd_client_watch_timeout (30 s). A synchronous notify made
        every change wait NOTIFY_TIMEOUT_MS for that dead watcher for 30 s (scripts/gateway_kill9_mgmt_latency.py)."""

        def done(completion: Any, *_: Any) -> None:
            rc = completion.get_return_value()
            if rc < 0:  # a dead watcher not dropped yet: the live ones got it anyway
                log.debug("notify on %s: error %d", self.config_obj, rc)
            with self._notifies_done:
                self._notifies.discard(completion)
                self._notifies_done.notify_all()

        try:
            with self._notifies_done:
                self._notifies.add(self.ioctx.aio_notify(self.config_obj, done, "changed", NOTIFY_TIMEOUT_MS))
        except self._rados.Error as exc:
            log.debug("notify on %s: %s", self.config_obj, exc)

    # membership ------------------------------------------------------------------------------------
    def join(self, name: str, info: dict[str, Any]) -> int:
        check_name(name, "gateway name", "--gateway-name")
        self.name = name
        self._wait_alive(name)
        self._call("taking the join lock", self._lock_join)
        try:
            records = self._records()
            mine = records.get(name)
            index = mine.index if mine else free_index({r.index for r in records.values()}, name)
            self._set({f"member.{name}": json.dumps({"index": index, "info": info}).encode()})
        finally:
            try:
                self.ioctx.unlock(self.config_obj, "join", name)
            except self._rados.Error:
                pass  # it expires by itself
        self.index = index
        self._start_watch()
        self._notify()
        return index

    def _lock_join(self) -> None:
        end = now() + JOIN_LOCK_SECONDS + 5
        while True:
            try:
                self.ioctx.lock_exclusive(self.config_obj, "join", self.name or "?", desc="index assignment",
                                          duration=JOIN_LOCK_SECONDS)
                return
            except self._rados.ObjectBusy:
                if now() > end:
                    raise
                time.sleep(0.1)

    def _member_obj(self, name: str) -> str:
        return f"nvmeof.{self.group}.member.{name}"

    def _take_alive(self) -> bool:
        try:
            self.ioctx.lock_exclusive(self._member_obj(self.name or "?"), "alive", self.name or "?",
                                      desc=self.name or "?", duration=self.duration)
            return True
        except self._rados.ObjectExists:
            return True
        except self._rados.ObjectBusy:
            return False
        except self._rados.Error as exc:
            raise StoreError(f"group store {self.where}: cannot register gateway {self.name}: {exc}") from exc

    def _start_watch(self) -> None:
        def changed(*_: Any) -> None:
            try:
                self._fire()
            except Exception:  # never into librados' thread
                log.exception("group store %s: change callback failed", self.where)

        def broken(*args: Any) -> None:  # the 16.2 binding calls it (watch id, error), not (error) as documented
            log.warning("group store %s: the watch on %s broke (error %s); re-watching at the next heartbeat",
                        self.where, self.config_obj, args[-1] if args else "?")
            self._broken_watch, self._watch = self._watch, None

        try:
            self._watch = self.ioctx.watch(self.config_obj, changed, broken)
        except self._rados.Error as exc:
            log.warning("group store %s: cannot watch %s (%s); changes are seen at the next heartbeat",
                        self.where, self.config_obj, exc)
            self._watch = None

    def _records(self) -> dict[str, MemberRecord]:
        out = {}
        for key, value in self._omap().items():
            if not key.startswith("member."):
                continue
            try:
                data = json.loads(value)
                out[key[7:]] = MemberRecord(key[7:], int(data["index"]), False, data.get("info") or {})
            except (ValueError, KeyError, TypeError):
                log.warning("group store %s: member record %s is unreadable; ignored", self.where, key)
        return out

    def publish(self, info: dict[str, Any]) -> None:
        assert self.name is not None and self.index is not None, "join() first"
        key = f"member.{self.name}"

        def write() -> None:
            # only over our own record: one removed while we were cut off is never written back
            with self._rados.WriteOpCtx() as op:
                op.omap_cmp(key, "", CMPXATTR_OP_GT)  # present: any record is > ""
                self.ioctx.set_omap(op, (key,), (json.dumps({"index": self.index, "info": info}).encode(),))
                self.ioctx.operate_write_op(op, self.config_obj)

        try:
            write()
        except self._rados.Error as exc:
            if getattr(exc, "errno", None) == ECANCELED or "125" in str(exc):
                raise MemberRemoved(f"gateway {self.name} is no longer recorded in {self.where}") from None
            raise StoreError(f"group store {self.where}: writing {self.config_obj} failed: {exc}") from exc
        self._notify()

    def remove_member(self, name: str) -> None:
        check_name(name, "gateway name", "NAME")
        self._call("taking the join lock", self._lock_join)  # join() assigns indexes under it too
        try:
            if name not in self._records():
                raise MemberUnknown(f"no gateway {name} is recorded in group {self.group} ({self.where})")
            obj = self._member_obj(name)
            try:  # held until the object is removed: a process starting as ``name`` meanwhile waits
                self.ioctx.lock_exclusive(obj, "alive", f"removing-by-{self.name}", desc="removing",
                                          duration=JOIN_LOCK_SECONDS)
            except self._rados.ObjectBusy:
                raise MemberAlive(f"gateway {name} is alive (it holds the membership lease, cls_lock \"alive\" on "
                                  f"{obj}, renewed every heartbeat); stop it, or wait --gateway-lease seconds after "
                                  "it died, before removing it from the group") from None
            except self._rados.ObjectExists:
                pass  # ours from a removal that failed half-way

            def forget() -> None:
                with self._rados.WriteOpCtx() as op:
                    self.ioctx.remove_omap_keys(op, (f"member.{name}", f"resvack.{name}"))
                    self.ioctx.operate_write_op(op, self.config_obj)

            self._call(f"removing member {name}", forget)
            try:
                self.ioctx.remove_object(obj)
            except self._rados.ObjectNotFound:
                pass
            except self._rados.Error as exc:  # the record is gone already; its lock expires by itself
                log.warning("group store %s: removing %s failed: %s", self.where, obj, exc)
        finally:
            try:
                self.ioctx.unlock(self.config_obj, "join", self.name or "?")
            except self._rados.Error:
                pass  # it expires by itself
        self._notify()

    def _lockers(self, obj: str, lock: str) -> tuple[int, str | None]:
        try:
            _, out = self.ioctx.execute(obj, "lock", "get_info", _encode_lock_get_info(lock))
        except self._rados.ObjectNotFound:
            return 0, None
        except self._rados.Error as exc:
            raise StoreError(f"group store {self.where}: reading the lock of {obj} failed: {exc}") from exc
        return _decode_first_locker(out)

    def members(self) -> list[MemberRecord]:
        out = []
        for name, rec in self._records().items():
            alive = name == self.name or self._lockers(self._member_obj(name), "alive")[0] > 0
            out.append(MemberRecord(name, rec.index, alive, rec.info))
        return sorted(out, key=lambda m: m.index)

    def heartbeat(self) -> None:
        try:
            self.ioctx.lock_exclusive(self._member_obj(self.name or "?"), "alive", self.name or "?",
                                      desc=self.name or "?", duration=self.duration, flags=LOCK_FLAG_MUST_RENEW)
        except self._rados.ObjectNotFound:  # expired (we were cut off): take it again
            if not self._take_alive():  # meanwhile another process took our name (so our index, our CNTLIDs)
                raise StoreError(f"group store {self.where}: another process runs as gateway {self.name} now (its "
                                 "membership expired while this one was cut off); stop one of them") from None
        except self._rados.Error as exc:
            raise StoreError(f"group store {self.where}: heartbeat failed: {exc}") from exc
        broken, self._broken_watch = self._broken_watch, None
        if broken is not None:  # closed here, not in librados' callback thread
            try:
                broken.close()
            except self._rados.Error as exc:
                log.debug("closing the broken watch on %s: %s", self.config_obj, exc)
        if self._watch is None:
            self._start_watch()

    def leave(self) -> None:
        for anagrpid in self.held():
            self.release(anagrpid)
        if self.name is not None:
            try:
                self.ioctx.unlock(self._member_obj(self.name), "alive", self.name)
            except self._rados.Error:
                pass
            self._notify()

    def close(self) -> None:
        try:
            self.leave()
        except StoreError:
            pass
        for watch in (self._watch, self._broken_watch):
            if watch is not None:
                try:
                    watch.close()
                except self._rados.Error:
                    pass
        self._watch = self._broken_watch = None
        with self._notifies_done:  # librados calls back into them: never close the ioctx under one
            self._notifies_done.wait_for(lambda: not self._notifies, NOTIFY_TIMEOUT_MS / 1000 + 2)
        try:
            self.ioctx.close()
            self.cluster.shutdown()
        except self._rados.Error:
            pass

    # shared configuration ------------------------------------------------------------------------
    def get_config(self) -> tuple[int, dict[str, Any] | None]:
        omap = self._omap()
        version = int(omap.get("version", b"0") or b"0")
        raw = omap.get("config")
        return version, json.loads(raw) if raw else None

    def put_config(self, config: dict[str, Any], expected: int) -> int:
        new = expected + 1

        def write() -> None:
            with self._rados.WriteOpCtx() as op:
                op.omap_cmp("version", str(expected) if expected else "", CMPXATTR_OP_EQ)
                self.ioctx.set_omap(op, ("version", "config"), (str(new).encode(), json.dumps(config).encode()))
                self.ioctx.operate_write_op(op, self.config_obj)

        try:
            write()
        except self._rados.Error as exc:
            if getattr(exc, "errno", None) == ECANCELED or "125" in str(exc):
                raise ConfigConflict(self.get_config()[0]) from None
            raise StoreError(f"group store {self.where}: writing the configuration failed: {exc}") from exc
        self._notify()
        return new

    # reservations: omap keys of the config object: "resv.KEY" (the record with its version), "resvv.KEY" (the
    # version alone, what omap_cmp compares) and "resvack.NAME" (what member NAME applied)
    def get_reservation(self, key: str) -> tuple[int, dict[str, Any] | None]:
        raw = self._omap().get(f"resv.{key}")
        if not raw:
            return 0, None
        data = json.loads(raw)
        return int(data.get("version", 0)), data.get("record")

    def put_reservation(self, key: str, record: dict[str, Any], expected: int) -> int:
        new = expected + 1

        def write() -> None:
            with self._rados.WriteOpCtx() as op:
                op.omap_cmp(f"resvv.{key}", str(expected) if expected else "", CMPXATTR_OP_EQ)
                self.ioctx.set_omap(op, (f"resvv.{key}", f"resv.{key}"),
                                    (str(new).encode(), json.dumps({"version": new, "record": record}).encode()))
                self.ioctx.operate_write_op(op, self.config_obj)

        try:
            write()
        except self._rados.Error as exc:
            if getattr(exc, "errno", None) == ECANCELED or "125" in str(exc):
                raise ConfigConflict(self.get_reservation(key)[0]) from None
            raise StoreError(f"group store {self.where}: writing reservation {key} failed: {exc}") from exc
        self._notify()
        return new

    def delete_reservation(self, key: str) -> None:
        def remove() -> None:
            with self._rados.WriteOpCtx() as op:
                self.ioctx.remove_omap_keys(op, (f"resvv.{key}", f"resv.{key}"))
                self.ioctx.operate_write_op(op, self.config_obj)

        self._call(f"removing reservation {key}", remove)

    def reservation_versions(self) -> dict[str, int]:
        return {k[len("resvv."):]: int(v or b"0") for k, v in self._omap().items() if k.startswith("resvv.")}

    def ack_reservations(self, applied: dict[str, int]) -> None:
        if self.name is None:
            raise StoreError("ack_reservations before join")
        self._set({f"resvack.{self.name}": json.dumps(applied).encode()})

    def reservation_acks(self) -> dict[str, dict[str, int]]:
        return {k[len("resvack."):]: {str(a): int(b) for a, b in json.loads(v).items()}
                for k, v in self._omap().items() if k.startswith("resvack.") and v}

    # ANA group ownership -------------------------------------------------------------------------
    def _ana_obj(self, anagrpid: int) -> str:
        return f"nvmeof.{self.group}.ana.{anagrpid}"

    def _lock_ana(self, anagrpid: int, flags: int) -> None:
        self.ioctx.lock_exclusive(self._ana_obj(anagrpid), "owner", self.name or "?", desc=self.name or "?",
                                  duration=self.duration, flags=flags)

    def try_acquire(self, anagrpid: int) -> bool:
        if anagrpid in self.held():
            return self.renew(anagrpid)
        sent = now()
        try:
            self._lock_ana(anagrpid, 0)
        except self._rados.ObjectBusy:
            return False
        except self._rados.ObjectExists:  # ours already (this client took it): renew instead
            return self.renew(anagrpid)
        except self._rados.Error as exc:
            raise StoreError(f"group store {self.where}: taking ANA group {anagrpid}'s lock failed: {exc}") from exc
        self._held_until(anagrpid, fence_deadline(sent, self.lease))
        return True

    def renew(self, anagrpid: int) -> bool:
        sent = now()
        try:
            self._lock_ana(anagrpid, LOCK_FLAG_MUST_RENEW)
        except (self._rados.ObjectBusy, self._rados.ObjectNotFound):
            self._forget(anagrpid)  # expired, maybe taken by another member
            return False
        except self._rados.Error as exc:
            raise StoreError(f"group store {self.where}: renewing ANA group {anagrpid}'s lock failed: {exc}") from exc
        self._held_until(anagrpid, fence_deadline(sent, self.lease))
        return True

    def release(self, anagrpid: int) -> None:
        self._forget(anagrpid)
        try:
            self.ioctx.unlock(self._ana_obj(anagrpid), "owner", self.name or "?")
        except self._rados.ObjectNotFound:
            pass
        except self._rados.Error as exc:
            raise StoreError(f"group store {self.where}: releasing ANA group {anagrpid} failed: {exc}") from exc
        self._notify()

    def owner(self, anagrpid: int) -> str | None:
        return self._lockers(self._ana_obj(anagrpid), "owner")[1]
