"""/gateway: this target's gateway group (nvmeof serve --gateway-group): members, their listeners and
CNTLID ranges, and per ANA group its owner, preferred owner and state on each live member."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, status
from pydantic import BaseModel, Field

from api.deps import Service
from api.errors import ERRORS
from target.service import ServiceError

router = APIRouter(prefix="/gateway", tags=["gateway"], responses=ERRORS)


class GatewayListenerOut(BaseModel):
    trtype: str
    adrfam: str
    traddr: str
    trsvcid: int
    portid: int


class GatewayClientOut(BaseModel):
    entity: str = Field(description="Ceph entity of one librados client the member uses, e.g. client.4127")
    addrs: list[str] = Field(description="Its addresses: what a takeover puts on the OSD blocklist")
    worker: int | None = Field(None, description="The --workers process using it; null: the main process")


class GatewayMemberOut(BaseModel):
    name: str
    index: int = Field(description="Stable member index, kept in the store from its first join")
    alive: bool
    ready: bool = Field(description="Alive, configured and with an I/O listener: it may own ANA groups")
    listeners: list[GatewayListenerOut]
    cntlid_range: list[int] = Field(description="[first, last] controller ID this member hands out")
    owns: list[int] = Field(description="ANA groups it owns (optimized there)")
    clients: list[GatewayClientOut] = Field(default_factory=list, description="Its Ceph clients (fencing)")
    not_taking_part: str | None = Field(None, description="Why this live member may own no ANA group (fenced, "
                                        "removed), as it published it; null: it may")


class AnaGroupOwnerOut(BaseModel):
    anagrpid: int
    owner: str | None = Field(description="The member holding the group's lock now; null: nobody")
    preferred: str | None = Field(description="Member (g - 1) % n by index: where the group goes back to")
    states: dict[str, str | None] = Field(description="ANA state of the group on each live member")
    fenced: bool | None = Field(None, description="Last takeover here from a dead member: true when its Ceph "
                                "clients were blocklisted and its RBD locks broken, false when that failed; "
                                "null: no dead member to fence")


class GatewayOut(BaseModel):
    group: str
    name: str = Field(description="This member")
    index: int | None
    store: str = Field(description="dir:PATH or rados:POOL")
    store_reachable: bool
    lease: float
    failback: str
    standby: str
    config_version: int = Field(description="Version of the shared configuration applied here")
    not_taking_part: str | None = Field(None, description="Why this gateway may own no ANA group now (its Ceph "
                                        "client is blocklisted, it was removed from the group); null: it may")
    members: list[GatewayMemberOut]
    ana_groups: list[AnaGroupOwnerOut]


def _group(service: Any) -> Any:
    group = service.gateway
    if group is None:
        raise ServiceError(404, "this target is not a member of a gateway group; start nvmeof serve with "
                                "--gateway-group NAME --group-store dir:PATH|rados:POOL")
    return group


@router.get("", response_model=GatewayOut, summary="The gateway group this target belongs to")
async def gateway(service: Service) -> Any:
    return await _group(service).report()


@router.delete("/members/{name}", status_code=status.HTTP_204_NO_CONTENT,
               summary="Remove a member that is gone for good from the group")
async def remove_member(name: str, service: Service) -> None:
    """Its record goes: it no longer counts in n (ANA group g prefers member (g-1) % n by index) and its index and
    controller ID range are free for the next new member. 409 while it is alive (dir store: its process holds its
    member flock; RADOS: its membership lease has not expired), 404 when no member has that name."""
    await _group(service).remove_member(name)
