"""/subsystems/{nqn}/namespaces: add, list, show, resize, enable/disable, ANA group, visibility, QoS, statistics,
remove."""

from __future__ import annotations

from fastapi import APIRouter, Path, Response, status

from api import render, schemas
from api.deps import JsonRoute, Service
from api.errors import ERRORS
from target import schema
from target.backends import OPTION_KEYS

router = APIRouter(prefix="/subsystems/{nqn}/namespaces", tags=["namespaces"], responses=ERRORS,
                   route_class=JsonRoute)

Nsid = Path(**schema.NSID.bounds(), description="Namespace ID")


@router.post("", status_code=status.HTTP_201_CREATED, response_model=schemas.NamespaceOut)
async def add_namespace(nqn: str, body: schemas.NamespaceCreate, service: Service) -> schemas.NamespaceOut:
    ns = await service.add_namespace(
        nqn, backend=body.backend, path=body.path, size=body.size, block_size=body.block_size,
        nsid=body.nsid, uuid=body.uuid, nguid=body.nguid, eui64=body.eui64, read_only=body.read_only,
        enabled=body.enabled, create=body.create, anagrpid=body.anagrpid, auto_visible=body.auto_visible,
        hosts=body.hosts,
        options={key: getattr(body, key) for key in OPTION_KEYS if getattr(body, key) is not None},
    )
    return render.namespace(ns)


@router.get("", response_model=list[schemas.NamespaceOut])
async def list_namespaces(nqn: str, service: Service) -> list[schemas.NamespaceOut]:
    return [render.namespace(ns) for ns in service.list_namespaces(nqn)]


@router.get("/{nsid}", response_model=schemas.NamespaceOut)
async def get_namespace(nqn: str, service: Service, nsid: int = Nsid) -> schemas.NamespaceOut:
    return render.namespace(service.get_namespace(nqn, nsid))


@router.delete("/{nsid}", status_code=status.HTTP_204_NO_CONTENT)
async def remove_namespace(nqn: str, service: Service, nsid: int = Nsid) -> Response:
    await service.remove_namespace(nqn, nsid)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/{nsid}/resize", response_model=schemas.NamespaceOut)
async def resize_namespace(
    nqn: str, body: schemas.NamespaceResize, service: Service, nsid: int = Nsid,
) -> schemas.NamespaceOut:
    return render.namespace(await service.resize_namespace(nqn, nsid, body.size, allow_shrink=body.allow_shrink))


@router.post("/{nsid}/enable", response_model=schemas.NamespaceOut)
async def enable_namespace(nqn: str, service: Service, nsid: int = Nsid) -> schemas.NamespaceOut:
    return render.namespace(await service.set_namespace_enabled(nqn, nsid, True))


@router.post("/{nsid}/disable", response_model=schemas.NamespaceOut)
async def disable_namespace(nqn: str, service: Service, nsid: int = Nsid) -> schemas.NamespaceOut:
    return render.namespace(await service.set_namespace_enabled(nqn, nsid, False))


@router.put("/{nsid}/anagrpid", response_model=schemas.NamespaceOut)
async def set_namespace_anagrpid(
    nqn: str, body: schemas.NamespaceAnaGroup, service: Service, nsid: int = Nsid,
) -> schemas.NamespaceOut:
    """Move the namespace to another ANA group; connected hosts get an ANA change event and re-read the ANA log."""
    return render.namespace(await service.set_namespace_anagrpid(nqn, nsid, body.anagrpid))


@router.put("/{nsid}/auto_visible", response_model=schemas.NamespaceOut)
async def set_namespace_auto_visible(
    nqn: str, body: schemas.NamespaceAutoVisible, service: Service, nsid: int = Nsid,
) -> schemas.NamespaceOut:
    """Visible to every allowed host, or only to the hosts listed; the hosts whose view changes are told (AEN)."""
    return render.namespace(await service.set_namespace_auto_visible(nqn, nsid, body.auto_visible))


@router.post("/{nsid}/hosts", status_code=status.HTTP_201_CREATED, response_model=schemas.NamespaceOut)
async def add_namespace_host(
    nqn: str, body: schemas.NamespaceHostAdd, service: Service, nsid: int = Nsid,
) -> schemas.NamespaceOut:
    """Make the namespace visible to one more host (it needs auto_visible false)."""
    return render.namespace(await service.add_namespace_host(nqn, nsid, body.hostnqn))


@router.delete("/{nsid}/hosts/{hostnqn}", response_model=schemas.NamespaceOut)
async def remove_namespace_host(nqn: str, hostnqn: str, service: Service, nsid: int = Nsid) -> schemas.NamespaceOut:
    """Hide the namespace from that host again; its controllers see the NSID go inactive."""
    return render.namespace(await service.remove_namespace_host(nqn, nsid, hostnqn))


@router.put("/{nsid}/qos", response_model=schemas.NamespaceOut)
async def set_namespace_qos(
    nqn: str, body: schemas.NamespaceQosSet, service: Service, nsid: int = Nsid,
) -> schemas.NamespaceOut:
    """Set QoS limits of the namespace, or of one host on it (``host``): commands past a limit wait, none
    fails. Limits not in the body stay; 0 removes one. Applies at once to commands waiting."""
    limits = body.model_dump(exclude={"host"}, exclude_none=True)
    return render.namespace(await service.set_namespace_qos(nqn, nsid, limits, host=body.host))


@router.get("/{nsid}/stats", response_model=schemas.NamespaceStatsOut)
async def namespace_stats(nqn: str, service: Service, nsid: int = Nsid) -> schemas.NamespaceStatsOut:
    return render.stats(service.get_namespace(nqn, nsid))


@router.get("/{nsid}/reservations", response_model=schemas.ReservationOut)
async def namespace_reservations(nqn: str, service: Service, nsid: int = Nsid) -> dict:
    """The namespace's persistent reservation: holder, type, registrants (keys redacted), generation."""
    return service.namespace_reservations(nqn, nsid)
