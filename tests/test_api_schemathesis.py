"""Property-based run of the management API against its own OpenAPI schema: no request, however
odd, may produce a server error (5xx).

The app is served by uvicorn on a loopback port in a thread with its own event loop, so listeners
the run creates live in one loop we control and close at the end. Two things are confined so the
run cannot touch the machine: namespace file paths are mapped into a temporary folder, and
listener addresses to loopback ports reserved for the run.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import itertools
import socket
import threading
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
uvicorn = pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from api.app import create_app  # noqa: E402
from nvmeof import defaults  # noqa: E402
from target.core import Target  # noqa: E402
from target.service import TargetService  # noqa: E402

SEED_NQN = defaults.DEFAULT_SUBSYSTEM_NQN
SERVICE = TargetService(Target())
TOKEN = "schemathesis-token"
APP = create_app(SERVICE, token=TOKEN)
schema = schemathesis.openapi.from_dict(APP.openapi())


class LiveServer:
    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self.sock])

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def run(self, coro_fn, *args):
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro_fn(*args), self.loop).result(30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def _reserve_ports(count: int) -> list[int]:
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = LiveServer(APP)
    server.start()
    server.files = tmp_path_factory.mktemp("schemathesis-files")
    server.ports = itertools.cycle(_reserve_ports(8))
    yield server
    server.run(SERVICE.target.close)
    server.stop()


async def _ensure_seed() -> None:
    """Keep subsystem SEED_NQN with namespace 1 in place: random requests may delete them."""
    if SEED_NQN not in SERVICE.target.subsystems:
        await SERVICE.add_subsystem(SEED_NQN)
    if 1 not in SERVICE.target.subsystems[SEED_NQN].namespaces:
        await SERVICE.add_namespace(SEED_NQN, backend="ram", size=1 << 20, nsid=1)


def _steer(case) -> None:
    """Random NQNs almost never name an existing subsystem, which would leave every route behind the
    404 untested: point about half the cases at the seed subsystem and namespace 1 instead."""
    params = case.path_parameters or {}
    pick = hashlib.sha1(repr(sorted(params.items())).encode()).digest()
    if "nqn" in params and pick[0] & 1:
        params["nqn"] = SEED_NQN
    if "nsid" in params and pick[1] & 1:
        params["nsid"] = 1


def _confine(case, live) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    if case.method.upper() == "POST" and case.path.endswith("/namespaces") and isinstance(body.get("path"), str):
        if body["path"]:
            body["path"] = str(live.files / hashlib.sha1(body["path"].encode("utf-8", "replace")).hexdigest())
    if case.method.upper() == "POST" and case.path == "/api/v1/listeners":
        try:
            family = ipaddress.ip_address(str(body.get("traddr"))).version
        except ValueError:
            return  # an invalid address is what the service must refuse: leave it
        body["traddr"] = "::1" if family == 6 else "127.0.0.1"
        if isinstance(body.get("trsvcid"), int) and 1 <= body["trsvcid"] <= 65535:
            body["trsvcid"] = next(live.ports)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_error(case, live):
    live.run(_ensure_seed)
    _steer(case)
    _confine(case, live)
    case.call_and_validate(base_url=live.url, headers={"Authorization": f"Bearer {TOKEN}"},
                           checks=[not_a_server_error])
