"""Tenancy settings in a gateway group on the RADOS store (marker ``ceph``): a namespace's visibility and
its QoS limits set through one gateway are in force on the other, as the dir-store tests show them
(tests/test_masking_gateway.py, tests/test_qos_management.py), here with the shared configuration in a
RADOS omap and the change announced by watch/notify on the one-node test cluster."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from target.core import Target
from target.gateway.group import GatewayGroup
from target.service import TargetService
from tests.ports import free_port
from tests.test_gateway_group import LEASE, SUB, until

pytestmark = pytest.mark.ceph

HOST_A = "nqn.2014-08.org.nvmexpress:uuid:0f2d2f36-8a4e-4a3b-9a52-3b1f1f2f7c11"


class RadosMember:
    """tests/test_gateway_group.py's Member on a RadosStore of ``group``."""

    def __init__(self, cluster: Any, group: str, name: str) -> None:
        from target.gateway.radosstore import RadosStore

        self.target = Target()
        self.service = TargetService(self.target)
        self.store = RadosStore(cluster.pool, group, 3.0, ceph_conf=str(cluster.conf))
        self.group = GatewayGroup(self.service, self.store, name=name, tick=LEASE / 3)
        self.port = free_port()

    async def start(self, *, first: bool = False) -> RadosMember:
        await self.group.join()
        if first:
            await self.service.add_subsystem(SUB, allow_any_host=True)
            await self.service.add_namespace(SUB, backend="null", size=1 << 20, nsid=1, anagrpid=1)
        assert await self.group.adopt() == []
        await self.service.add_listener("tcp", "127.0.0.1", self.port)
        await self.group.start()
        return self

    async def stop(self) -> None:
        await self.group.stop()
        await self.target.close()
        self.store.close()


def test_visibility_and_qos_set_on_one_gateway_hold_on_the_other(ceph_cluster: Any) -> None:
    group = f"t{os.urandom(4).hex()}"

    async def go() -> None:
        a = await RadosMember(ceph_cluster, group, "gw-a").start(first=True)
        b = await RadosMember(ceph_cluster, group, "gw-b").start()
        try:
            ns_a = lambda: a.service.get_namespace(SUB, 1)  # noqa: E731
            await until(lambda: b.target.subsystems.get(SUB) is not None, "gw-b has the subsystem", 30)
            await b.service.set_namespace_auto_visible(SUB, 1, False)
            await b.service.add_namespace_host(SUB, 1, HOST_A)
            await until(lambda: ns_a().visibility() == frozenset({HOST_A}), "the host list reached gw-a", 30)
            await b.service.set_namespace_qos(SUB, 1, {"rw_ios_per_second": 500, "w_mbytes_per_second": 20})
            await b.service.set_namespace_qos(SUB, 1, {"r_mbytes_per_second": 7}, host=HOST_A)
            await until(lambda: ns_a().qos is not None and ns_a().qos.config() == b.service.get_namespace(SUB, 1)
                        .qos.config(), "the limits reached gw-a", 30)
            config = ns_a().qos.config()
            assert config["rw_ios_per_second"] == 500 and config["w_mbytes_per_second"] == 20
            assert config["hosts"][HOST_A]["r_mbytes_per_second"] == 7
        finally:
            await b.stop()
            await a.stop()

    asyncio.run(go())
