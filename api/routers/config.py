"""/config: the whole configuration as JSON, ours (version 1) or the Linux nvmetcli dump.

An import replays the configuration through TargetService.restore, the path the daemon's start-up
uses, so an item is accepted or refused exactly as a live request would be; the service saves the
result under its lock. A file whose structure is wrong is refused as a whole before anything is
applied.

Checking and converting a body is pure CPU work on up to --api-max-body bytes, so it runs in a
thread (asyncio.to_thread): the event loop that serves NVMe I/O keeps running meanwhile, and the
service's restore yields to it between items.

/config/unrestored lists what the daemon's start-up could not restore (a file on a disk not
mounted yet, a port still in use): those items stay in the config file until they are retried
successfully or discarded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Body, Response, status

from api import schemas
from api.deps import JsonRoute, Service
from api.errors import ERRORS
from target import config as configmod
from target.service import ServiceError

router = APIRouter(prefix="/config", tags=["config"], responses=ERRORS, route_class=JsonRoute)

ConfigBody = Body(description="A configuration object", examples=[{"version": 1, "subsystems": []}])


@router.get("", response_model=dict[str, Any])
async def export_config(service: Service) -> dict[str, Any]:
    """The running configuration; host secrets appear only as ``"dhchap_key": true`` (the API never returns
    a secret: the daemon's config file holds them)."""
    return service.snapshot(redact=True)


@router.post("", response_model=schemas.ImportResult)
async def import_config(service: Service, body: dict[str, Any] = ConfigBody) -> schemas.ImportResult:
    try:
        config = await asyncio.to_thread(configmod.validate_config, body, source="request body")
    except configmod.ConfigError as exc:
        raise ServiceError(400, str(exc)) from None
    return schemas.ImportResult(errors=await service.restore(config, persist=True), warnings=[])


@router.get("/nvmetcli", response_model=schemas.NvmetcliExport)
async def export_nvmetcli(service: Service) -> schemas.NvmetcliExport:
    converted = configmod.export_nvmetcli(service.snapshot())
    data = dict(converted)
    warnings = list(converted.warnings)
    withheld = configmod.strip_nvmetcli_secrets(data)
    if withheld:
        warnings.append(f"the DH-HMAC-CHAP secrets of {', '.join(withheld)} are not exported through the API; "
                        "write them to configfs (hosts/<nqn>/dhchap_key, dhchap_ctrl_key) yourself")
    return schemas.NvmetcliExport(nvmetcli=data, warnings=warnings)


@router.post("/nvmetcli", response_model=schemas.ImportResult)
async def import_nvmetcli(service: Service, body: dict[str, Any] = ConfigBody) -> schemas.ImportResult:
    try:
        converted, config = await asyncio.to_thread(_convert_nvmetcli, body)
    except configmod.ConfigError as exc:
        raise ServiceError(400, str(exc)) from None
    errors = await service.restore(config, persist=True)
    return schemas.ImportResult(errors=errors, warnings=converted.warnings)


def _convert_nvmetcli(body: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    converted = configmod.import_nvmetcli(body)
    return converted, configmod.validate_config(dict(converted), source="converted nvmetcli configuration")


@router.get("/unrestored", response_model=list[schemas.UnrestoredOut],
            summary="Configuration items the start-up could not restore (kept in the file)")
async def list_unrestored(service: Service) -> list[schemas.UnrestoredOut]:
    return [schemas.UnrestoredOut(**entry) for entry in service.unrestored()]


@router.post("/unrestored/retry", response_model=schemas.ImportResult,
             summary="Try to restore them again; what still fails stays listed")
async def retry_unrestored(service: Service) -> schemas.ImportResult:
    return schemas.ImportResult(errors=await service.retry_unrestored(), warnings=[])


@router.delete("/unrestored", status_code=status.HTTP_204_NO_CONTENT,
               summary="Forget them: they are removed from the config file")
async def discard_unrestored(service: Service) -> Response:
    await service.discard_unrestored()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
