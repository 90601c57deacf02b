"""Error answers: ServiceError keeps its status; every error body is {"detail": ...}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from api.schemas import ErrorOut
from target.service import ServiceError

log = logging.getLogger("nvmeof.api")

# Documented on every resource route so /docs and the schema say what a refusal looks like.
ERRORS: dict[int | str, dict] = {
    400: {"model": ErrorOut, "description": "Invalid value (the detail names it)"},
    404: {"model": ErrorOut, "description": "No such object"},
    409: {"model": ErrorOut, "description": "Conflicts with the current state"},
}


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default answer echoes each bad value ("input"); a request may carry a DH-HMAC-CHAP
        # secret (a typo'd field name, a wrong type next to it), which must never come back or be logged.
        detail = [{k: v for k, v in error.items() if k not in ("input", "ctx", "url")} for error in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": jsonable_encoder(detail)})

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        status = exc.status if 400 <= exc.status <= 599 else 500
        if status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, exc.message)
        return JSONResponse(status_code=status, content={"detail": exc.message})
