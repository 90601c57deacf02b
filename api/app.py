"""The management service: ``create_app(service, token=...)`` builds the FastAPI application.

Resources live under /api/v1; /health, /version and /metrics sit at the root for probes and
scrapers; the OpenAPI UI is at /docs. With a token every route except /health requires
``Authorization: Bearer <token>``. ``nvmeof serve`` refuses to start the API on an address
beyond loopback without one (--api-token or NVMEOF_API_TOKEN), because anyone who reaches the
API can export any file of the machine as a namespace.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI

from api import errors
from api.auth import OPEN_PATHS, BearerAuthMiddleware
from api.routers import config, controllers, fabric, namespaces, subsystems, system
from nvmeof import __version__
from target.service import TargetService

API_PREFIX = "/api/v1"


def create_app(service: TargetService, *, token: str | None = None) -> FastAPI:
    app = FastAPI(
        title="nvmeof management API",
        version=__version__,
        description="Manage the NVMe-oF target: subsystems, namespaces, hosts, listeners, referrals, "
                    "controllers and the persisted configuration. Changes apply to connected hosts at once.",
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.service = service
    errors.install(app)

    v1 = APIRouter(prefix=API_PREFIX)
    v1.include_router(subsystems.router)
    v1.include_router(namespaces.router)
    v1.include_router(fabric.listeners)
    v1.include_router(fabric.referrals)
    v1.include_router(controllers.router)
    v1.include_router(config.router)
    v1.include_router(system.v1)
    app.include_router(v1)
    app.include_router(system.router)

    if token is not None:
        app.add_middleware(BearerAuthMiddleware, token=token)
        _document_bearer(app)
    return app


def _document_bearer(app: FastAPI) -> None:
    """Put the bearer scheme into the OpenAPI document, so /docs offers 'Authorize' and clients
    generated from the schema send the header."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schema.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
        }
        for path, operations in schema.get("paths", {}).items():
            if path in OPEN_PATHS:
                continue
            for operation in operations.values():
                operation["security"] = [{"bearer": []}]
                operation.setdefault("responses", {})["401"] = {
                    "description": "Missing or wrong bearer token",
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}},
                }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
