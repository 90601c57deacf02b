"""`nvmeof serve --workers N` with ANA: I/O queues served by worker processes check the ANA state of
their controller's listener too, and follow state and group changes (and `--cntlid-range`)."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator

import pytest

import initiator
from initiator import commands as c
from nvmeof import defaults
from nvmeof.cli.daemon import Daemon, DaemonOptions
from nvmeof.spec.logs import AnaState
from nvmeof.status import NvmeError, Status
from nvmeof.uri import TransportAddress
from tests.ports import free_ports

NQN = defaults.DEFAULT_SUBSYSTEM_NQN
HOST = "nqn.2014-08.org.nvmexpress:uuid:77777777-0000-4000-8000-0000000000a1"
READ = 0x02

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create") or sys.platform != "linux",
                                reason="worker processes need Linux memfd and SCM_RIGHTS")


@pytest.fixture
async def daemon(tmp_path) -> AsyncIterator[tuple[Daemon, list[int]]]:
    ports = free_ports(3)
    d = Daemon(DaemonOptions(listen=[TransportAddress("tcp", "127.0.0.1", p) for p in ports[:2]],
                             discovery=[TransportAddress("tcp", "127.0.0.1", ports[2])], api=None,
                             ramdisk_size=1 << 20, workers=1, backing_dirs=[tmp_path], cntlid_range=(100, 199)))
    try:
        await d.start()
        yield d, ports
    finally:
        await d.stop()


async def _read(ctrl, nsid: int) -> None:
    q = ctrl.io_queues[0]
    await q.submit(c.rw(READ, nsid, 0, 1), data_in=bytearray(512))


async def test_worker_queues_check_the_listeners_ana_state(daemon):
    d, ports = daemon
    svc = d.service
    lid_b = f"tcp:127.0.0.1:{ports[1]}"
    async with initiator.connect("127.0.0.1", ports[0], NQN, hostnqn=HOST, timeout=10, nr_io_queues=1) as a, \
            initiator.connect("127.0.0.1", ports[1], NQN, hostnqn=HOST, timeout=10, nr_io_queues=1) as b:
        assert 100 <= a.cntlid <= 199 and 100 <= b.cntlid <= 199 and a.cntlid != b.cntlid
        assert all(q["worker_pid"] for info in d.target.controllers_info() for q in info["queues"] if q["qid"])
        await _read(b, 1)
        await svc.set_ana_state(lid_b, 1, AnaState.INACCESSIBLE)
        with pytest.raises(NvmeError) as err:
            await _read(b, 1)
        assert err.value.status == Status.ANA_INACCESSIBLE and not err.value.dnr
        await _read(a, 1)
        # the namespace moves to a group that is optimized on B: the worker sees the new group
        await svc.set_namespace_anagrpid(NQN, 1, 2)
        await _read(b, 1)
        await svc.set_ana_states({2: AnaState.CHANGE}, listener_ids=[lid_b])
        with pytest.raises(NvmeError) as err:
            await _read(b, 1)
        assert err.value.status == Status.ANA_TRANSITION
        await svc.set_ana_states({2: AnaState.OPTIMIZED})
        await _read(b, 1)
