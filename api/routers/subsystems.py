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
        dhchap_hash=body.dhchap_hash, dhchap_dhgroup=body.dhchap_dhgroup,
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


@router.patch("/{nqn}/dhchap", response_model=schemas.SubsystemOut,
              summary="Set the subsystem's allowed DH-HMAC-CHAP hashes / DH groups")
async def set_subsystem_dhchap(nqn: str, body: schemas.SubsystemDhchapSet, service: Service) -> schemas.SubsystemOut:
    """Fields given replace the current lists (null: all); absent fields stay. Hosts with their own lists keep them."""
    settings = {field: getattr(body, field) for field in body.model_fields_set}
    return render.subsystem(await service.set_subsystem_dhchap(nqn, settings))


@router.get("/{nqn}/hosts", response_model=schemas.HostsOut)
async def list_hosts(nqn: str, service: Service) -> schemas.HostsOut:
    return render.hosts(service.get_subsystem(nqn))


@router.post("/{nqn}/hosts", status_code=status.HTTP_201_CREATED, response_model=schemas.HostsOut)
async def allow_host(nqn: str, body: schemas.HostAdd, service: Service) -> schemas.HostsOut:
    """Allow the host; with ``dhchap_key`` it must authenticate (DH-HMAC-CHAP) on every queue."""
    sub = await service.allow_host(nqn, body.hostnqn, dhchap_key=body.dhchap_key,
                                   dhchap_ctrl_key=body.dhchap_ctrl_key, dhchap_hash=body.dhchap_hash,
                                   dhchap_dhgroup=body.dhchap_dhgroup, tls_key=body.tls_key,
                                   tls_compat=body.tls_compat)
    return render.hosts(sub)


@router.get("/{nqn}/hosts/{hostnqn}", response_model=schemas.HostOut)
async def get_host(nqn: str, hostnqn: str, service: Service) -> schemas.HostOut:
    _, entry = service.get_host(nqn, hostnqn)
    return render.host(hostnqn, entry)


@router.patch("/{nqn}/hosts/{hostnqn}", response_model=schemas.HostOut,
              summary="Set, rotate or remove the host's DH-HMAC-CHAP keys and lists")
async def set_host_auth(nqn: str, hostnqn: str, body: schemas.HostAuthSet, service: Service) -> schemas.HostOut:
    """A field given replaces the current value, null removes it, absent fields stay. Connected controllers
    keep running; the next authentication (a new queue, or the host re-authenticating) uses the new keys."""
    settings = {field: getattr(body, field) for field in body.model_fields_set}
    sub = await service.set_host_auth(nqn, hostnqn, settings)
    return render.host(hostnqn, sub.host_auth.get(hostnqn))


@router.delete("/{nqn}/hosts/{hostnqn}/dhchap", response_model=schemas.HostOut,
               summary="Remove every DH-HMAC-CHAP setting of the host")
async def clear_host_auth(nqn: str, hostnqn: str, service: Service) -> schemas.HostOut:
    """The host stays allowed; its new queues no longer authenticate."""
    sub = await service.clear_host_auth(nqn, hostnqn)
    return render.host(hostnqn, sub.host_auth.get(hostnqn))


@router.delete("/{nqn}/hosts/{hostnqn}", response_model=schemas.DisconnectedOut)
async def deny_host(nqn: str, hostnqn: str, service: Service) -> schemas.DisconnectedOut:
    """Remove the host from the allowed hosts; its controllers on this subsystem are disconnected."""
    return schemas.DisconnectedOut(disconnected=await service.deny_host(nqn, hostnqn))
