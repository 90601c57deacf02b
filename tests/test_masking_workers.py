"""`nvmeof serve --workers N` with masking: I/O queues served by worker processes answer Invalid Namespace
for a namespace their controller's host does not see, and follow visibility changes (the namespace state
the pool sends each worker carries auto_visible and the host list; the change is applied before the call
returns)."""

from __future__ import annotations

import os
import sys

import pytest

import initiator
from initiator import commands as c
from nvmeof import defaults
from nvmeof.status import NvmeError, Status
from tests.test_ana_workers import daemon  # noqa: F401  (fixture: `nvmeof serve --workers 1` in-process, two ports)

NQN = defaults.DEFAULT_SUBSYSTEM_NQN
HOST_A = "nqn.2014-08.org.nvmexpress:uuid:77777777-0000-4000-8000-0000000000a1"
HOST_B = "nqn.2014-08.org.nvmexpress:uuid:77777777-0000-4000-8000-0000000000b2"
READ = 0x02

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create") or sys.platform != "linux",
                                reason="worker processes need Linux memfd and SCM_RIGHTS")


async def _status(ctrl, nsid: int) -> int:
    try:
        await ctrl.io_queues[0].submit(c.rw(READ, nsid, 0, 1), data_in=bytearray(512))
    except NvmeError as err:
        return err.status
    return 0


async def test_worker_queues_enforce_visibility(daemon):  # noqa: F811
    d, ports = daemon
    port = ports[0]
    svc = d.service
    async with initiator.connect("127.0.0.1", port, NQN, hostnqn=HOST_A, timeout=10, nr_io_queues=1) as a, \
            initiator.connect("127.0.0.1", port, NQN, hostnqn=HOST_B, timeout=10, nr_io_queues=1) as b:
        assert all(q["worker_pid"] for info in d.target.controllers_info() for q in info["queues"] if q["qid"])
        assert await _status(a, 1) == 0 and await _status(b, 1) == 0
        await svc.set_namespace_auto_visible(NQN, 1, False)
        await svc.add_namespace_host(NQN, 1, HOST_A)
        assert await _status(a, 1) == 0
        assert await _status(b, 1) == Status.INVALID_NS
        await svc.remove_namespace_host(NQN, 1, HOST_A)
        await svc.add_namespace_host(NQN, 1, HOST_B)
        assert await _status(a, 1) == Status.INVALID_NS
        assert await _status(b, 1) == 0
        await svc.set_namespace_auto_visible(NQN, 1, True)
        assert await _status(a, 1) == 0 and await _status(b, 1) == 0
