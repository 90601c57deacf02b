"""/ana: Asymmetric Namespace Access at a glance: which namespaces each ANA group holds, and each
listener's state per group (what hosts with native multipath choose their paths by)."""

from __future__ import annotations

from fastapi import APIRouter

from api import schemas
from api.deps import JsonRoute, Service
from api.errors import ERRORS

router = APIRouter(prefix="/ana", tags=["ana"], responses=ERRORS, route_class=JsonRoute)


@router.get("", response_model=schemas.AnaOut)
async def ana(service: Service) -> schemas.AnaOut:
    groups = [schemas.AnaGroupOut(anagrpid=g, namespaces=[{"subnqn": nqn, "nsid": nsid} for nqn, nsid in members])
              for g, members in service.ana_groups().items()]
    return schemas.AnaOut(groups=groups, listeners=[schemas.AnaListenerOut(**entry) for entry in service.ana_report()])
