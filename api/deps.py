"""Route dependencies: the TargetService the app was created with."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from target.service import TargetService


def get_service(request: Request) -> TargetService:
    return request.app.state.service


Service = Annotated[TargetService, Depends(get_service)]
