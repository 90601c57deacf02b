"""/controllers: the hosts connected right now; DELETE tears one down (its host may reconnect)."""

from __future__ import annotations

from fastapi import APIRouter, Path, Response, status

from api import render, schemas
from api.deps import Service
from api.errors import ERRORS
from target import schema

router = APIRouter(prefix="/controllers", tags=["controllers"], responses=ERRORS)


@router.get("", response_model=list[schemas.ControllerOut])
async def list_controllers(service: Service) -> list[schemas.ControllerOut]:
    return [render.controller(info) for info in service.controllers()]


@router.delete("/{cntlid}", status_code=status.HTTP_204_NO_CONTENT)
async def disconnect_controller(service: Service, cntlid: int = Path(**schema.CNTLID.bounds())) -> Response:
    await service.disconnect_controller(cntlid)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
