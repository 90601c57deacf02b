"""/listeners and /referrals: where the target accepts connections and what discovery points to.

Both are addressed as ``/{trtype}/{traddr}/{trsvcid}``; an IPv6 traddr goes in unbracketed
(``/listeners/tcp/::1/4420``), its colons are legal in a path segment.
"""

from __future__ import annotations

import ipaddress

from fastapi import APIRouter, Path, Response, status

from api import render, schemas
from api.deps import JsonRoute, Service
from api.errors import ERRORS
from target import schema
from target.model import endpoint_id

listeners = APIRouter(prefix="/listeners", tags=["listeners"], responses=ERRORS, route_class=JsonRoute)
referrals = APIRouter(prefix="/referrals", tags=["referrals"], responses=ERRORS, route_class=JsonRoute)

Port = Path(**schema.TRSVCID.bounds(), description="Transport service ID (TCP port)")
AnaGroup = Path(**schema.ANAGRPID.bounds(), description="ANA group ID")


def _endpoint(trtype: str, traddr: str, trsvcid: int) -> str:
    """The model's identity string, with the address written the way the service stores it
    (``0:0::1`` and ``::1`` name the same listener)."""
    try:
        traddr = str(ipaddress.ip_address(traddr.strip("[]")))
    except ValueError:
        pass  # not an IP literal: the lookup fails and the 404 names what was asked for
    return endpoint_id(trtype, traddr, trsvcid)


@listeners.get("", response_model=list[schemas.ListenerOut])
async def list_listeners(service: Service) -> list[schemas.ListenerOut]:
    return [render.listener(lst) for lst in service.list_listeners()]


@listeners.post("", status_code=status.HTTP_201_CREATED, response_model=schemas.ListenerOut)
async def add_listener(body: schemas.ListenerCreate, service: Service) -> schemas.ListenerOut:
    lst = await service.add_listener(body.trtype, body.traddr, body.trsvcid, adrfam=body.adrfam,
                                     discovery=body.discovery, portid=body.portid, tls=body.tls,
                                     inline_data_size=body.inline_data_size)
    return render.listener(lst)


@listeners.delete("/{trtype}/{traddr}/{trsvcid}", response_model=schemas.DisconnectedOut)
async def remove_listener(trtype: schemas.TrType, traddr: str, service: Service,
                          trsvcid: int = Port) -> schemas.DisconnectedOut:
    """Stop listening; controllers with a queue that came through this listener are disconnected."""
    return schemas.DisconnectedOut(disconnected=await service.remove_listener(_endpoint(trtype, traddr, trsvcid)))


@listeners.put("/{trtype}/{traddr}/{trsvcid}/ana/{anagrpid}", response_model=schemas.ListenerOut)
async def set_listener_ana_state(trtype: schemas.TrType, traddr: str, body: schemas.AnaStateSet, service: Service,
                                 trsvcid: int = Port, anagrpid: int = AnaGroup) -> schemas.ListenerOut:
    """Set an ANA group's state on this listener (kept in the configuration); hosts connected through it get an
    ANA change event. I/O to a group that is inaccessible here fails with an ANA status so hosts use another path."""
    lst = await service.set_ana_state(_endpoint(trtype, traddr, trsvcid), anagrpid, body.state)
    return render.listener(lst)


@referrals.get("", response_model=list[schemas.ReferralOut])
async def list_referrals(service: Service) -> list[schemas.ReferralOut]:
    return [render.referral(ref) for ref in service.list_referrals()]


@referrals.post("", status_code=status.HTTP_201_CREATED, response_model=schemas.ReferralOut)
async def add_referral(body: schemas.ReferralCreate, service: Service) -> schemas.ReferralOut:
    ref = await service.add_referral(body.traddr, body.trsvcid, trtype=body.trtype, adrfam=body.adrfam,
                                     subnqn=body.subnqn, portid=body.portid)
    return render.referral(ref)


@referrals.delete("/{trtype}/{traddr}/{trsvcid}", status_code=status.HTTP_204_NO_CONTENT)
async def remove_referral(trtype: schemas.TrType, traddr: str, service: Service, trsvcid: int = Port) -> Response:
    await service.remove_referral(_endpoint(trtype, traddr, trsvcid))
    return Response(status_code=status.HTTP_204_NO_CONTENT)
