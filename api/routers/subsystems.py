"""/subsystems and their allowed hosts."""

from __future__ import annotations

from fastapi import APIRouter, Query, status

from api import render, schemas
from api.deps import JsonRoute, Service
from api.errors import ERRORS

router = APIRouter(prefix="/subsystems", tags=["subsystems"], responses=ERRORS, route_class=JsonRoute)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=schemas.SubsystemOut)
async def create_subsystem(body: schemas.SubsystemCreate, service: Service) -> schemas.SubsystemOut:
    sub = await service.add_subsystem(
        body.nqn, serial=body.serial, model=body.model, allow_any_host=body.allow_any_host,
        hosts=tuple(body.hosts), max_namespaces=body.max_namespaces,
    )
    return render.subsystem(sub)


@router.get("", response_model=list[schemas.SubsystemOut])
async def list_subsystems(service: Service) -> list[schemas.SubsystemOut]:
    return [render.subsystem(sub) for sub in service.list_subsystems()]


@router.get("/{nqn}", response_model=schemas.SubsystemOut)
async def get_subsystem(nqn: str, service: Service) -> schemas.SubsystemOut:
    return render.subsystem(service.get_subsystem(nqn))


@router.delete("/{nqn}", response_model=schemas.DisconnectedOut)
async def delete_subsystem(
    nqn: str, service: Service,
    force: bool = Query(False, description="Also remove its namespaces and disconnect its controllers"),
) -> schemas.DisconnectedOut:
    """Remove the subsystem; its connected controllers are disconnected (the count is returned)."""
    return schemas.DisconnectedOut(disconnected=await service.remove_subsystem(nqn, force=force))


@router.get("/{nqn}/hosts", response_model=schemas.HostsOut)
async def list_hosts(nqn: str, service: Service) -> schemas.HostsOut:
    sub = service.get_subsystem(nqn)
    return schemas.HostsOut(allow_any_host=sub.allow_any_host, hosts=sorted(sub.hosts))


@router.post("/{nqn}/hosts", status_code=status.HTTP_201_CREATED, response_model=schemas.HostsOut)
async def allow_host(nqn: str, body: schemas.HostAdd, service: Service) -> schemas.HostsOut:
    sub = await service.allow_host(nqn, body.hostnqn)
    return schemas.HostsOut(allow_any_host=sub.allow_any_host, hosts=sorted(sub.hosts))


@router.delete("/{nqn}/hosts/{hostnqn}", response_model=schemas.DisconnectedOut)
async def deny_host(nqn: str, hostnqn: str, service: Service) -> schemas.DisconnectedOut:
    """Remove the host from the allowed hosts; its controllers on this subsystem are disconnected."""
    return schemas.DisconnectedOut(disconnected=await service.deny_host(nqn, hostnqn))
