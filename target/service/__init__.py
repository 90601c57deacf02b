"""TargetService: every management change, validated, serialized, persisted, then applied live.

Daemon start-up, config restore, the REST API and the CLI all come through here, the one door. Each
mutation:
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

The service by resource, each module a mixin on ServiceBase (base.py: the state, the reads, ``_commit``,
``_save`` and ``_steps``, the unrestored items); checks.py (ServiceError and the checks every part
shares beside target/schema.py's, which they call directly) imports nothing of the service:

    subsystems.py          subsystems, allow_any_host, their DH-HMAC-CHAP lists
    hosts.py               a subsystem's allowed hosts and each host's DH-HMAC-CHAP settings
    namespaces.py          namespaces: add (identity, storage, backend) and remove
    namespace_settings.py  resize, enabled, QoS, masking, reservations report of a namespace that stays
    ana.py                 ANA groups and states
    listeners.py           listeners, referrals, controllers
    replay.py              snapshot(), restore/import/retry: a configuration replayed as one transaction
    reload.py              reload(): the re-read file applied all or nothing (planned by target/reload.py)
"""

from __future__ import annotations

from target import config as configmod
from target.service.ana import AnaMixin
from target.service.base import GatewayMember, ServiceBase, TargetHooks, Unrestored
from target.service.checks import ServiceError, _endpoint_key
from target.service.hosts import HostsMixin
from target.service.listeners import ListenersMixin
from target.service.namespace_settings import NamespaceSettingsMixin
from target.service.namespaces import NamespacesMixin
from target.service.reload import ReloadMixin
from target.service.replay import ReplayMixin
from target.service.subsystems import SubsystemsMixin

# configmod: tests replace configmod.save_config through this module to make a save fail
__all__ = ["GatewayMember", "ServiceError", "TargetHooks", "TargetService", "Unrestored", "_endpoint_key", "configmod"]


class TargetService(
    SubsystemsMixin,
    HostsMixin,
    NamespacesMixin,
    NamespaceSettingsMixin,
    AnaMixin,
    ListenersMixin,
    ReplayMixin,
    ReloadMixin,
    ServiceBase,
):
    """The management service of one Target; ServiceBase.__init__ says what it takes. Each public method
    is one transaction under the lock (a replay and a reload: one of many steps)."""
