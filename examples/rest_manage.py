"""Manage a running target over its REST API: create a subsystem with a RAM namespace, allow a
host, look at it, and clean up.

    python3 examples/rest_manage.py

Run it as the user that started `nvmeof serve` (or root): like the `nvmeof` CLI it finds the API
and its token in the files the daemon wrote to its state directory (``api-endpoint``, and
``api-token`` with mode 0600). NVMEOF_API and NVMEOF_API_TOKEN override them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx

from nvmeof import defaults

STATE = Path(defaults.state_dir())  # $NVMEOF_STATE_DIR, /var/lib/nvmeof for root, ~/.local/share/nvmeof
NQN = "nqn.2026-11.io.nvmeof-toolkit:rest-example"
HOST = "nqn.2014-08.org.nvmexpress:uuid:2b7d7a06-3f4b-4a33-9f3e-3f1f5b1f0a11"


def check(resp: httpx.Response) -> dict | list:
    if resp.is_error:
        sys.exit(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: {resp.text}")
    return resp.json() if resp.content else {}


def state_file(name: str, env: str) -> str:
    if os.environ.get(env):
        return os.environ[env]
    try:
        return (STATE / name).read_text().strip()
    except OSError as exc:
        sys.exit(f"cannot read {STATE / name} ({exc.strerror}): is `nvmeof serve` running as this user? "
                 f"Or set {env}.")


def client() -> httpx.Client:
    api = state_file(defaults.API_ENDPOINT_FILE, "NVMEOF_API")
    headers = {"Authorization": f"Bearer {state_file(defaults.API_TOKEN_FILE, 'NVMEOF_API_TOKEN')}"}
    if api.startswith("unix:"):  # nvmeof serve --api unix:PATH
        return httpx.Client(base_url="http://localhost/api/v1", headers=headers, timeout=30,
                            transport=httpx.HTTPTransport(uds=api[5:]))
    return httpx.Client(base_url=f"{api}/api/v1", headers=headers, timeout=30)


def main() -> None:
    with client() as api:
        check(api.post("/subsystems", json={"nqn": NQN, "allow_any_host": False}))
        ns = check(api.post(f"/subsystems/{NQN}/namespaces", json={"backend": "ram", "size": 32 << 20}))
        print(f"created {NQN} with namespace {ns['nsid']} ({ns['size'] >> 20} MiB RAM disk)")
        check(api.post(f"/subsystems/{NQN}/hosts", json={"hostnqn": HOST}))
        sub = check(api.get(f"/subsystems/{NQN}"))
        print(f"allowed hosts: {sub['hosts']}")
        check(api.post(f"/subsystems/{NQN}/namespaces/{ns['nsid']}/resize", json={"size": 64 << 20}))
        ns = check(api.get(f"/subsystems/{NQN}/namespaces/{ns['nsid']}"))
        print(f"resized namespace {ns['nsid']} to {ns['size'] >> 20} MiB")
        names = [s["nqn"] for s in check(api.get("/subsystems"))]
        print(f"subsystems now: {names}")
        check(api.delete(f"/subsystems/{NQN}", params={"force": "true"}))
        print(f"deleted {NQN}")


if __name__ == "__main__":
    main()
