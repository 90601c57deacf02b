"""Asymmetric Namespace Access: a namespace's ANA group, each group's state on each listener.

Served states live on the Listener; the configured ones (``_ana_saved``) are what the file keeps, so a
gateway group can set what is served at run time (persist=False, or ana_states_now() without the lock
at its fencing deadline) without rewriting the operator's file. Each change ends with one ANA change
AEN per controller concerned (target.core.Target.ana_changed).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from nvmeof.spec.logs import ANA_STATE_NAMES, AnaState, parse_ana_state
from target import masking, schema
from target.model import Listener, Namespace
from target.service.base import ServiceBase
from target.service.checks import ServiceError
from target.transaction import Undo

log = logging.getLogger(__name__)


class AnaMixin(ServiceBase):
    def _ana_entry(self, listener: Listener) -> dict[str, Any]:
        saved = self._ana_saved.get(listener.id)
        if not saved:
            return {}
        return {"ana_states": {str(g): ANA_STATE_NAMES[st] for g, st in sorted(saved.items())}}

    async def set_namespace_anagrpid(self, subnqn: str, nsid: int, anagrpid: int) -> Namespace:
        """Move a namespace to another ANA group (nvmet configfs namespaces/<nsid>/ana_grpid): the ANA
        log lists it there from now on and every controller that sees it gets the ANA change AEN (a masked
        namespace is in no other host's log 0Ch, so the others are not told)."""
        async with self._lock:
            ns = self.get_namespace(subnqn, nsid)
            old = ns.anagrpid
            undo = self._anagrpid_step(ns, anagrpid)
            if undo is None:
                return ns
            await self._commit(True, undo)
            log.info("namespace %d of %s moved from ANA group %d to %d", nsid, subnqn, old, ns.anagrpid)
            self._ana_changed(subnqn=subnqn, groups=(old, ns.anagrpid), concerns=masking.seen_by(ns))
            await self._settle()
            return ns

    def _anagrpid_step(self, ns: Namespace, anagrpid: int) -> Undo | None:
        anagrpid = schema.ANAGRPID.check(anagrpid)
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
            grp = schema.ANAGRPID.check(anagrpid)
            st = schema.check_ana_state(state)
            await self._apply_ana({grp: st}, [listener], persist=persist)
            return listener

    async def set_ana_states(self, states: Mapping[int, AnaState | str], *,
                             listener_ids: Sequence[str] | None = None, persist: bool = False) -> None:
        """Several groups' states on several listeners at once (None: every I/O listener), one ANA
        change AEN per controller concerned. ``persist=False`` (a gateway group recomputing who owns
        what) changes only what is served; the configuration file keeps what the operator set."""
        async with self._lock:
            checked = {schema.ANAGRPID.check(g): schema.check_ana_state(st) for g, st in states.items()}
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
