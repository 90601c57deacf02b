"""Route dependencies: the TargetService the app was created with; the route class of every router
that takes a JSON body."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute

from target.service import TargetService

JSON_IN_THREAD = 64 << 10  # bodies from this size are parsed off the event loop


class _JsonInThreadRequest(Request):
    async def json(self) -> Any:
        # json.loads of a 1 MiB body of small objects takes 30-120 ms: long enough to stall the NVMe
        # I/O that this event loop also serves, so a large body is parsed in a thread.
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(json.loads, body) if len(body) >= JSON_IN_THREAD else json.loads(body)
        return self._json


class JsonRoute(APIRoute):
    """An APIRoute whose request body is parsed off the event loop when it is large."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_JsonInThreadRequest(request.scope, request.receive))

        return route


def get_service(request: Request) -> TargetService:
    return request.app.state.service


Service = Annotated[TargetService, Depends(get_service)]
