"""/config: the whole configuration as JSON, ours (version 1) or the Linux nvmetcli dump.

An import replays the configuration through TargetService.restore, the path the daemon's start-up
uses, so an item is accepted or refused exactly as a live request would be. A file whose structure
is wrong is refused as a whole before anything is applied.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Body

from api import schemas
from api.deps import Service
from api.errors import ERRORS
from target import config as configmod
from target.service import ServiceError, TargetService

router = APIRouter(prefix="/config", tags=["config"], responses=ERRORS)

ConfigBody = Body(description="A configuration object", examples=[{"version": 1, "subsystems": []}])


async def _import(service: TargetService, config: dict[str, Any], warnings: list[str]) -> schemas.ImportResult:
    errors = await service.restore(config)
    # restore() leaves the file alone (at start-up it is the file being read); an import is a live
    # change, so the file must now describe what is running.
    if service.config_path is not None:
        try:
            await asyncio.to_thread(configmod.save_config, service.config_path, service.snapshot())
        except configmod.ConfigError as exc:
            raise ServiceError(500, f"the import was applied but not saved: {exc}") from exc
    return schemas.ImportResult(errors=errors, warnings=warnings)


@router.get("", response_model=dict[str, Any])
async def export_config(service: Service) -> dict[str, Any]:
    return service.snapshot()


@router.post("", response_model=schemas.ImportResult)
async def import_config(service: Service, body: dict[str, Any] = ConfigBody) -> schemas.ImportResult:
    try:
        config = configmod.validate_config(body, source="request body")
    except configmod.ConfigError as exc:
        raise ServiceError(400, str(exc)) from None
    return await _import(service, config, [])


@router.get("/nvmetcli", response_model=schemas.NvmetcliExport)
async def export_nvmetcli(service: Service) -> schemas.NvmetcliExport:
    converted = configmod.export_nvmetcli(service.snapshot())
    return schemas.NvmetcliExport(nvmetcli=dict(converted), warnings=converted.warnings)


@router.post("/nvmetcli", response_model=schemas.ImportResult)
async def import_nvmetcli(service: Service, body: dict[str, Any] = ConfigBody) -> schemas.ImportResult:
    try:
        converted = configmod.import_nvmetcli(body)
        config = configmod.validate_config(dict(converted), source="converted nvmetcli configuration")
    except configmod.ConfigError as exc:
        raise ServiceError(400, str(exc)) from None
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        # The converter expects nvmetcli's shapes; a value of another type is the file's fault.
        raise ServiceError(400, f"malformed nvmetcli configuration: {type(exc).__name__}: {exc}") from None
    return await _import(service, config, converted.warnings)
