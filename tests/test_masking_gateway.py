"""Masking in a gateway group: a namespace's visibility lives in the shared configuration, so a change made
on gateway B holds on gateway A, and A's connected controllers whose view changed are told (log 04h + AEN).
Two in-process members on a dir store, as tests/test_gateway_group.py runs them."""

from __future__ import annotations

import asyncio
from pathlib import Path

from target_host import open_tcp
from test_masking_target import AEN_ANA, AEN_NS_ATTR, DEADLINE, HOST_A, HOST_B, QUIET, Ctrl, read

from nvmeof.status import Status
from tests.test_gateway_group import NONOPT, OPT, SUB, Member, until


async def _ctrl(port: int, hostnqn: str) -> Ctrl:
    host = await open_tcp(port)
    res = await host.connect(SUB, hostnqn=hostnqn)
    assert res.status == 0, res
    await host.enable()
    io = await open_tcp(port)
    assert (await io.connect(SUB, qid=1, cntlid=res.cqe.dw0 & 0xFFFF, hostnqn=hostnqn)).status == 0
    return Ctrl(host, io)


def test_visibility_changed_on_one_gateway_holds_on_the_other(tmp_path: Path) -> None:
    async def go() -> None:
        a = await Member(tmp_path, "gw-a").start(first=True)   # SUB allows any host; NSIDs 1 and 2
        b = await Member(tmp_path, "gw-b").start()
        try:
            # ownership settled first: its ANA change events are not what this test watches
            await until(lambda: a.states() == {1: OPT, 2: NONOPT} and b.states() == {1: NONOPT, 2: OPT},
                        "states follow ownership")
            ca, cb = await _ctrl(a.port, HOST_A), await _ctrl(a.port, HOST_B)
            assert await ca.active() == [1, 2] and await cb.active() == [1, 2]
            # on gateway B: NSID 2 for nobody; both hosts on gateway A lose it
            await b.service.set_namespace_auto_visible(SUB, 2, False)
            await until(lambda: a.service.get_namespace(SUB, 2).visibility() == frozenset(),
                        "the visibility reached gw-a")
            for ctrl in (ca, cb):
                told = sorted([(await asyncio.wait_for(f, DEADLINE)).cqe.dw0 for f in ctrl.aers()])
                assert told == sorted([AEN_NS_ATTR, AEN_ANA])
                assert await ctrl.changed() == [2] and await ctrl.active() == [1]
                await ctrl.ana_nsids()   # re-arms the ANA event
            # on gateway B: NSID 2 for HOST_B; on gateway A only HOST_B's controller is told
            aer_a, aer_b = ca.aers(), cb.aers()
            await b.service.add_namespace_host(SUB, 2, HOST_B)
            await until(lambda: a.service.get_namespace(SUB, 2).visibility() == frozenset({HOST_B}),
                        "the host list reached gw-a")
            got = sorted([(await asyncio.wait_for(f, DEADLINE)).cqe.dw0 for f in aer_b])
            assert got == sorted([AEN_NS_ATTR, AEN_ANA])
            await asyncio.sleep(QUIET)
            assert not any(f.done() for f in aer_a)
            assert await cb.changed() == [2] and await cb.active() == [1, 2]
            assert await ca.changed() == [] and await ca.active() == [1]
            assert (await ca.io.cmd(read(2), read_len=512)).status == Status.INVALID_NS
            assert (await cb.io.cmd(read(2), read_len=512)).status == 0
            # a member restarting from the store keeps it
            await b.stop()
            b = await Member(tmp_path, "gw-b").start()
            assert b.service.get_namespace(SUB, 2).visibility() == frozenset({HOST_B})
        finally:
            await b.stop()
            await a.stop()

    asyncio.run(go())

