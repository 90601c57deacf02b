"""/ui: the dashboard. A static page (api/static/) that calls the REST API with the login cookie, and
/ui/stats, the I/O counters /metrics exports, as JSON; the page computes rates and percentiles itself (why:
ARCHITECTURE.md, "Dashboard").
"""

from __future__ import annotations

import time
from functools import cache
from importlib import resources

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from api import metrics
from api.deps import Service

router = APIRouter(prefix="/ui", tags=["dashboard"], include_in_schema=False)

# Only this origin's script, style and API: nothing is fetched from the network, no inline script
# runs (a host NQN is host-chosen text; the page writes it with textContent only), and no other
# site can frame the page's buttons.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
_TYPES = {"index.html": "text/html; charset=utf-8", "ui.js": "text/javascript; charset=utf-8",
          "ui.css": "text/css; charset=utf-8"}


@cache
def _asset(name: str) -> bytes:
    return resources.files("api").joinpath("static", name).read_bytes()


def _serve(name: str) -> Response:
    return Response(_asset(name), media_type=_TYPES[name], headers={
        "content-security-policy": _CSP, "x-content-type-options": "nosniff", "cache-control": "no-cache",
        "referrer-policy": "no-referrer",
    })


@router.get("")
async def page() -> Response:
    return _serve("index.html")


@router.get("/ui.js")
async def script() -> Response:
    return _serve("ui.js")


@router.get("/ui.css")
async def style() -> Response:
    return _serve("ui.css")


@router.get("/stats")
async def stats(service: Service) -> JSONResponse:
    """Cumulative I/O counters per namespace and per host (needs the token or the login cookie)."""
    return JSONResponse(metrics.snapshot(service.list_subsystems(), time.time()),
                        headers={"cache-control": "no-store"})
