"""The REST app under FastAPI's TestClient, with the bearer token the suite's API tests use."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app

TOKEN = "t0ken-for-the-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def open_client(service: Any, *, authorized: bool = True, **app_kw: Any) -> TestClient:
    """A started TestClient of the app over ``service`` (token TOKEN); ``authorized`` sends the token with every
    request. The caller leaves it with ``client.__exit__(None, None, None)``."""
    client = TestClient(create_app(service, token=TOKEN, **app_kw), headers=AUTH if authorized else None)
    client.__enter__()
    return client


def route_cli_to(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the `nvmeof` management CLI (nvmeof/cli/commands/manage.py) at ``client``'s in-process app, with
    the suite's token, for the rest of the test."""
    from nvmeof.cli.commands import manage

    monkeypatch.setattr(manage, "make_http_client",
                        lambda base_url, headers: httpx.Client(transport=client._transport, base_url="http://testserver",
                                                               headers=headers))
    monkeypatch.setenv("NVMEOF_API_TOKEN", TOKEN)
    monkeypatch.setenv("NVMEOF_API", "http://testserver")
