"""The management service: ``create_app(service, token=...)`` builds the FastAPI application.

Resources live under /api/v1; /health (liveness, no details), /version and /metrics sit at the
root for probes and scrapers; the OpenAPI UI is at /docs, the dashboard at /ui. Every route except /health requires the
token, loopback included: ``Authorization: Bearer <token>``, or the session cookie a browser gets
from the login link ``/login?token=...`` that `nvmeof serve` prints. :class:`api.auth.ApiGuard`
also refuses foreign Host and Origin headers, non-JSON state-changing requests and bodies over
``max_body`` (see its docstring). There is no unauthenticated mode: anyone who can manage the
target can export any allowed file as a namespace.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI

from api import errors
from api.auth import LOGIN_PATH, OPEN_PATHS, ApiGuard, HostPolicy
from api.routers import ana, config, controllers, fabric, namespaces, subsystems, system, ui
from api.routers import gateway as gateway_router
from nvmeof import __version__, defaults
from target.service import TargetService

API_PREFIX = "/api/v1"


DESCRIPTION = (
    "Manage the NVMe-oF target: subsystems, namespaces, hosts, listeners, referrals, controllers and the "
    "persisted configuration. Changes apply to connected hosts at once.\n\n"
    "Every call needs the token that `nvmeof serve` generated (or was given): it is in the `api-token` file "
    "of the daemon's state directory. In this page, open the login link `nvmeof serve` printed "
    f"(`{LOGIN_PATH}?token=...`), or click **Authorize** and paste the token."
)


def create_app(service: TargetService, *, token: str, hosts: HostPolicy | None = None,
               max_body: int = defaults.API_MAX_BODY, token_hint: str | None = None) -> FastAPI:
    """``hosts``: the Host headers to accept (None skips the check: a Unix socket or an in-process
    client). ``token_hint``: where the token can be found, named in 401 answers."""
    if not token:
        raise ValueError("create_app needs a non-empty token: the API has no unauthenticated mode")
    app = FastAPI(
        title="nvmeof management API",
        version=__version__,
        description=DESCRIPTION,
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
    v1.include_router(ana.router)
    v1.include_router(config.router)
    v1.include_router(gateway_router.router)
    v1.include_router(system.v1)
    app.include_router(v1)
    app.include_router(system.router)
    app.include_router(ui.router)

    app.add_middleware(ApiGuard, token=token, hosts=hosts, max_body=max_body, token_hint=token_hint)
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
