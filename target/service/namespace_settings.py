"""What changes on a namespace that stays: size, enabled, QoS limits, masking, and its reservations.

Each change is a ``*_step`` that applies it in memory and returns its undo (None: nothing to change),
unsaved and unannounced, so the live calls here and a reload (target/service/reload.py) share it; the
live call then commits and tells the hosts concerned. Masking (target/masking.py, SPDK nvmf_ns_add_host /
nvmf_ns_remove_host) tells exactly the controllers whose view flipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from nvmeof import defaults
from target import masking, pr, schema
from target import qos as qosmod
from target.backends import BackendError
from target.model import Namespace, Subsystem
from target.service.base import ServiceBase
from target.service.checks import ServiceError, _bad, _masking, _nqn, _restore_hosts
from target.transaction import Undo

log = logging.getLogger(__name__)


class NamespaceSettingsMixin(ServiceBase):
    async def resize_namespace(self, subnqn: str, nsid: int, size: int, *, allow_shrink: bool = False) -> Namespace:
        """Change a namespace's capacity. A file namespace grows its file when asked past its end;
        shrinking it needs ``allow_shrink`` (FileBackend.resize says what happens to the file).
        RAM and null namespaces are no user files: they resize either way."""
        async with self._lock:
            ns = self.get_namespace(subnqn, nsid)
            undo = await self._resize_step(ns, size, allow_shrink=schema.check_bool(allow_shrink, "allow_shrink"))
            if undo is None:
                return ns
            await self._commit(True, undo)
            self.target.namespace_changed(subnqn, nsid)
            await self._settle()
            return ns

    async def _resize_step(self, ns: Namespace, size: int, *, allow_shrink: bool) -> Undo | None:
        """The resize itself, unsaved and unannounced (resize_namespace and reload); None: no change."""
        size = schema.SIZE.check(size)
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
        enabled = schema.check_bool(enabled, "enabled")
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

    def _drop_unadmitted(self, sub: Subsystem) -> Undo:
        """What hosts ``sub`` no longer admits go without: their namespace visibility
        (masking.drop_unadmitted) and their per-host QoS limits, so a host allowed again later starts
        unlisted and unlimited, and the saved configuration names no host the subsystem refuses. Their
        commands waiting are let go (the host's connections are being disconnected). Returns the undo."""
        dropped = masking.drop_unadmitted(sub)
        qos_undo = self._drop_unadmitted_qos(sub)

        async def undo() -> None:
            _restore_hosts(dropped)
            for step in qos_undo:
                await step()

        return undo

    def _drop_unadmitted_qos(self, sub: Subsystem) -> list[Undo]:
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
            auto_visible = schema.check_bool(auto_visible, "auto_visible")
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


def _current_qos(ns: Namespace) -> tuple[qosmod.QosLimits, dict[str, qosmod.QosLimits]]:
    if ns.qos is None:
        return qosmod.UNLIMITED, {}
    return ns.qos.limits, dict(ns.qos.host_limits)


def _qos_words(limits: qosmod.QosLimits) -> str:
    return ", ".join(f"{k} {v}" for k, v in limits.as_dict().items() if v) or "unlimited"
