"""Manage a running target over its REST API: create a subsystem with a RAM namespace, allow a
host, look at it, and clean up.

    NVMEOF_API=http://127.0.0.1:8080 python3 examples/rest_manage.py
"""

from __future__ import annotations

import os
import sys

import httpx

API = os.environ.get("NVMEOF_API", "http://127.0.0.1:8080")
TOKEN = os.environ.get("NVMEOF_API_TOKEN")
NQN = "nqn.2026-11.io.nvmeof-toolkit:rest-example"
HOST = "nqn.2014-08.org.nvmexpress:uuid:2b7d7a06-3f4b-4a33-9f3e-3f1f5b1f0a11"


def check(resp: httpx.Response) -> dict | list:
    if resp.is_error:
        sys.exit(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: {resp.text}")
    return resp.json() if resp.content else {}


def main() -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"} if TOKEN else {}
    with httpx.Client(base_url=f"{API}/api/v1", headers=headers, timeout=30) as api:
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
