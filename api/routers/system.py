"""Health, version and metrics: the operational endpoints, at the root and (health, version)
under /api/v1 as well. Only the root /health is open without the token, and it says nothing but
"ok"; /api/v1/health (counts of subsystems and controllers) needs the token like everything else."""

from __future__ import annotations

from fastapi import APIRouter, Response

from api import metrics, schemas
from api.deps import Service
from nvmeof import __version__, defaults

router = APIRouter(tags=["system"])


def _health(service: Service) -> schemas.Health:
    return schemas.Health(status="ok", subsystems=len(service.list_subsystems()),
                          controllers=len(service.controllers()))


def _version() -> schemas.Version:
    return schemas.Version(version=__version__, api="v1",
                           nvme_version=".".join(str(part) for part in defaults.NVME_VERSION))


@router.get("/health", response_model=schemas.Liveness, summary="Liveness (never needs the token; no details)")
async def health() -> schemas.Liveness:
    return schemas.Liveness(status="ok")


@router.get("/version", response_model=schemas.Version)
async def version() -> schemas.Version:
    return _version()


@router.get("/metrics", response_class=Response, summary="Prometheus metrics",
            responses={200: {"content": {metrics.CONTENT_TYPE: {}}}})
async def prometheus(service: Service) -> Response:
    text = metrics.render(service.list_subsystems(), service.controllers())
    return Response(content=text, media_type=metrics.CONTENT_TYPE)


v1 = APIRouter(tags=["system"])


@v1.get("/health", response_model=schemas.Health, summary="Health with counts (needs the token)")
async def health_v1(service: Service) -> schemas.Health:
    return _health(service)


@v1.get("/version", response_model=schemas.Version)
async def version_v1() -> schemas.Version:
    return _version()
