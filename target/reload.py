"""What a re-read configuration file changes (SIGHUP, `systemctl reload`), as a plan of steps.

Pure: it compares two configurations in config-file form (the running one from
TargetService.live_config(), the file as it reads now) and lists what to add, remove or change,
plus the changes that cannot be made while hosts stay connected. TargetService.reload() applies
the plan. Like SPDK's nvmf RPCs (nvmf_subsystem_add_ns, nvmf_subsystem_add_host, ...) each step is
one live change; nothing is rebuilt, so a host whose subsystem, namespace and listener stay keeps
its controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nvmeof import defaults
from target.qos import parse_config

# Namespace keys a running namespace can take on live; any other difference needs a new nsid.
LIVE_NAMESPACE_KEYS = ("size", "enabled", "anagrpid", "auto_visible", "hosts", "qos")
# Subsystem keys that the Identify data or the controllers already carry: fixed while it exists.
FIXED_SUBSYSTEM_KEYS = ("serial", "model", "max_namespaces")
ACCESS_KEYS = ("allow_any_host", "hosts", "dhchap_hash", "dhchap_dhgroup")
ID_KEYS = ("uuid", "nguid", "eui64")


@dataclass
class ReloadPlan:
    new_subsystems: list[dict[str, Any]] = field(default_factory=list)
    removed_subsystems: list[str] = field(default_factory=list)
    access: list[dict[str, Any]] = field(default_factory=list)  # subsystem items whose hosts/auth changed
    new_namespaces: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    removed_namespaces: list[tuple[str, int]] = field(default_factory=list)
    resized: list[tuple[str, int, int]] = field(default_factory=list)
    enabled: list[tuple[str, int, bool]] = field(default_factory=list)
    anagrpid: list[tuple[str, int, int]] = field(default_factory=list)  # (subnqn, nsid, new ANA group)
    # (subnqn, nsid, auto_visible, hosts): masking as the file has it (target/masking.py)
    visibility: list[tuple[str, int, bool, list[Any]]] = field(default_factory=list)
    qos: list[tuple[str, int, Any]] = field(default_factory=list)  # (subnqn, nsid, the whole new qos entry)
    new_listeners: list[dict[str, Any]] = field(default_factory=list)
    removed_listeners: list[str] = field(default_factory=list)
    ana_states: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (listener id, its whole ana_states)
    new_referrals: list[dict[str, Any]] = field(default_factory=list)
    removed_referrals: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # changes refused: the file is not applied at all

    def empty(self) -> bool:
        return not any(getattr(self, name) for name in self.__dataclass_fields__ if name != "problems")

    def summary(self) -> str:
        counts = [(len(getattr(self, name)), name.replace("_", " ")) for name in self.__dataclass_fields__
                  if name != "problems"]
        return ", ".join(f"{n} {what}" for n, what in counts if n) or "no changes"


def _same(key: str, a: Any, b: Any) -> bool:
    if key in ID_KEYS and isinstance(a, str) and isinstance(b, str):
        return a.replace("-", "").lower() == b.replace("-", "").lower()
    return a == b


def _ana_states(item: dict[str, Any]) -> dict[int, str]:
    """A listener item's ana_states, compared by group id and state word (optimized ones dropped: the
    default); config.item_problems checked them."""
    out = {}
    for grp, state in (item.get("ana_states") or {}).items():
        word = str(state).strip().lower().replace("_", "-")
        if word != "optimized":
            out[int(grp)] = word
    return out


def _inline(item: dict[str, Any]) -> Any:
    """A listener item's inline_data_size (absent or null: the default, which a saved file leaves out)."""
    size = item.get("inline_data_size")
    return defaults.IO_INCAPSULE_SIZE if size is None else size


def _hosts(item: dict[str, Any]) -> dict[str, Any]:
    return {h.get("nqn") if isinstance(h, dict) else h: h for h in item.get("hosts") or []}


def plan_reload(live: dict[str, Any], new: dict[str, Any], endpoint_key: Any) -> ReloadPlan:
    """``endpoint_key(item)``: the listener/referral id an item names (service._endpoint_key)."""
    plan = ReloadPlan()
    old_subs = {s["nqn"]: s for s in live.get("subsystems", [])}
    new_subs = {s["nqn"]: s for s in new.get("subsystems", [])}
    plan.removed_subsystems = [nqn for nqn in old_subs if nqn not in new_subs]
    for nqn, item in new_subs.items():
        old = old_subs.get(nqn)
        if old is None:
            plan.new_subsystems.append(item)
            continue
        for key in FIXED_SUBSYSTEM_KEYS:
            if item.get(key) is not None and item[key] != old.get(key):
                plan.problems.append(f"subsystem {nqn}: {key} cannot change while it exists ({old.get(key)!r} -> "
                                     f"{item[key]!r}); remove the subsystem in one reload and add it in the next")
        wanted_access = {key: item.get(key) for key in ACCESS_KEYS}
        wanted_access["hosts"] = _hosts(item)
        had_access = {key: old.get(key) for key in ACCESS_KEYS}
        had_access["hosts"] = _hosts(old)
        if item.get("allow_any_host") is None:  # absent: what add_subsystem would pick
            wanted_access["allow_any_host"] = not wanted_access["hosts"]
        if wanted_access != had_access:
            plan.access.append(item)
        _plan_namespaces(plan, nqn, old.get("namespaces") or [], item.get("namespaces") or [])
    old_lst = {endpoint_key(item): item for item in live.get("listeners", [])}
    new_lst = {endpoint_key(item): item for item in new.get("listeners", [])}
    plan.removed_listeners = [lid for lid in old_lst if lid not in new_lst]
    for lid, item in new_lst.items():
        old = old_lst.get(lid)
        if old is None:
            plan.new_listeners.append(item)
        elif any(item.get(key) is not None and item[key] != old.get(key) for key in ("discovery", "portid", "tls")):
            plan.problems.append(f"listener {lid}: discovery/portid/tls cannot change on a running listener; remove "
                                 "it in one reload and add it in the next")
        elif _inline(item) != _inline(old):
            # nvmet_param_inline_data_size_store refuses an enabled port's too (nvmet_is_port_enabled)
            plan.problems.append(f"listener {lid}: inline_data_size cannot change on a running listener "
                                 f"({_inline(old)} to {_inline(item)}); remove it in one reload and add it in the next")
        elif _ana_states(item) != _ana_states(old):
            plan.ana_states.append((lid, item.get("ana_states") or {}))
    old_ref = {endpoint_key(item): item for item in live.get("referrals", [])}
    new_ref = {endpoint_key(item): item for item in new.get("referrals", [])}
    for rid, item in old_ref.items():
        if new_ref.get(rid) != item:
            plan.removed_referrals.append(rid)
    plan.new_referrals = [item for rid, item in new_ref.items() if old_ref.get(rid) != item]
    return plan


def _plan_namespaces(plan: ReloadPlan, nqn: str, old: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    had = {ns["nsid"]: ns for ns in old}
    wanted = {ns["nsid"]: ns for ns in new if ns.get("nsid") is not None}
    plan.removed_namespaces += [(nqn, nsid) for nsid in had if nsid not in wanted]
    plan.new_namespaces += [(nqn, ns) for ns in new if ns.get("nsid") is None or ns["nsid"] not in had]
    for nsid, ns in wanted.items():
        cur = had.get(nsid)
        if cur is None:
            continue
        fixed = [key for key, value in ns.items()
                 if key not in LIVE_NAMESPACE_KEYS and value is not None and not _same(key, value, cur.get(key))]
        if fixed:
            plan.problems.append(f"subsystem {nqn} namespace {nsid}: {', '.join(fixed)} cannot change on a live "
                                 "namespace; give the new one another nsid (or remove it in one reload and add it "
                                 "in the next)")
        if ns.get("size") is not None and ns["size"] != cur.get("size"):
            plan.resized.append((nqn, nsid, ns["size"]))
        if ns.get("enabled") is not None and ns["enabled"] != cur.get("enabled", True):
            plan.enabled.append((nqn, nsid, ns["enabled"]))
        if ns.get("anagrpid") is not None and ns["anagrpid"] != cur.get("anagrpid", 1):
            plan.anagrpid.append((nqn, nsid, ns["anagrpid"]))
        if ns.get("auto_visible") is not None or ns.get("hosts") is not None:   # absent: unchanged, as above
            wanted = (ns.get("auto_visible", True), sorted(ns.get("hosts") or []))
            if wanted != (cur.get("auto_visible", True), sorted(cur.get("hosts") or [])):
                plan.visibility.append((nqn, nsid, *wanted))
        # Unlike the keys above, a missing qos is no limit (the running config writes it only when set).
        if parse_config(ns.get("qos")) != parse_config(cur.get("qos")):
            plan.qos.append((nqn, nsid, ns.get("qos")))
