"""Per-host namespace visibility (masking): the checks a visibility setting passes and what a change of it
tells connected hosts. TargetService applies them; the data path reads ``Namespace.visible_to``.

As SPDK (nvmf_subsystem_add_ns --no-auto-visible, nvmf_ns_add_host / nvmf_ns_remove_host: ``nvmf_ns_visible``)
and the Ceph gateway (namespace add --no-auto-visible, namespace add_host / del_host): a namespace is visible to
every host the subsystem admits (auto_visible, the default) or only to the host NQNs it lists. A namespace a
host does not see is an inactive NSID for that host's controllers: not in Identify CNS 02h nor log 0Ch, CNS 00h
reads zeros, CNS 03h and every I/O command answer Invalid Namespace or Format.

Rules (ours where SPDK has none):
- Listing hosts needs auto_visible off (SPDK: EPERM on an always-visible namespace); turning auto_visible on
  drops the list (every admitted host sees it).
- A listed host must be one the subsystem admits: named in its hosts, or any valid NQN while it allows any
  host (SPDK does not check; a listed host that may not connect would be a silent no-op).
- Denying a host on the subsystem (or turning allow_any_host off) drops it from its namespaces' lists; its
  controllers are disconnected by the same call, so no connected view changes. A reloaded file must be
  consistent instead: a namespace naming a host its subsystem no longer admits refuses the reload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from target.model import view_changed
from target.nqn import NqnError, validate_nqn

if TYPE_CHECKING:
    from target.model import Namespace, Subsystem


class MaskingError(Exception):
    """A visibility setting that is refused; ``status`` as ServiceError's (400 bad input, 409 conflict)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_host(sub: Subsystem, nsid: int, hostnqn: object) -> str:
    """``hostnqn`` as a host namespace ``nsid`` of ``sub`` may list; MaskingError naming why not."""
    try:
        nqn = validate_nqn(hostnqn, what="host NQN")
    except NqnError as exc:
        raise MaskingError(400, str(exc)) from None
    if not sub.host_allowed(nqn):
        raise MaskingError(400, f"host {nqn} is not allowed on subsystem {sub.nqn}, so namespace {nsid} cannot "
                                f"be made visible to it; allow the host on the subsystem first")
    return nqn


def check_visibility(sub: Subsystem, nsid: int, auto_visible: object,
                     hosts: Iterable[object] | None) -> tuple[bool, set[str]]:
    """(auto_visible, host NQNs) as given for a namespace, checked."""
    if not isinstance(auto_visible, bool):
        raise MaskingError(400, f"auto_visible must be true or false, got {auto_visible!r}")
    listed = list(hosts or ())
    if auto_visible and listed:
        raise MaskingError(400, f"namespace {nsid} is visible to every host (auto_visible); a host list needs "
                                "auto_visible false (nvmeof ns add --no-auto-visible)")
    return auto_visible, {check_host(sub, nsid, h) for h in listed}


def unadmitted(sub: Subsystem) -> list[str]:
    """Each namespace host list entry ``sub`` no longer admits, as 'namespace N: host H'."""
    return [f"namespace {ns.nsid} names host {h}" for _, ns in sorted(sub.namespaces.items())
            for h in sorted(ns.hosts) if not sub.host_allowed(h)]


def drop_unadmitted(sub: Subsystem) -> list[tuple[Namespace, str]]:
    """Remove from every namespace list of ``sub`` the hosts it no longer admits; returns (namespace, host)
    pairs removed (to put back on undo)."""
    dropped = [(ns, h) for ns in sub.namespaces.values() for h in ns.hosts if not sub.host_allowed(h)]
    for ns, h in dropped:
        ns.hosts.discard(h)
    return dropped


def seen_by(ns: Namespace) -> Callable[[str], bool] | None:
    """The hosts that see ``ns`` now (None: every host), kept past its removal."""
    return None if ns.auto_visible else frozenset(ns.hosts).__contains__


def concerns(before: frozenset[str] | None, after: frozenset[str] | None) -> Callable[[str], bool]:
    """The hosts whose view of a namespace differs between two ``Namespace.visibility()`` values: exactly
    their controllers get Namespace Attribute Changed (SPDK nvmf_ns_visible)."""
    return lambda hostnqn: view_changed(before, after, hostnqn)
