"""The blocking wrapper: a target served from the wrapper's own background loop, used from plain code."""

from __future__ import annotations

import pytest
from test_initiator_controller import NQN, free_port, make_target

from initiator import sync
from nvmeof.spec.nvme import FeatureId
from nvmeof.status import NvmeError, Status
from target.core import Target


def test_sync_connect_write_read_discover() -> None:
    port = free_port()

    async def start() -> Target:
        target, service = await make_target()
        await service.add_listener("tcp", "127.0.0.1", port)
        return target

    target = sync.run(start())
    try:
        with sync.connect("127.0.0.1", port, NQN, nr_io_queues=2) as ctrl:
            data = bytes(range(256)) * 16
            ctrl.write(1, 8, data)
            assert ctrl.read(1, 8, 8) == data
            buf = bytearray(4096)
            ctrl.read(1, 8, 8, buf=buf)
            assert buf == data
            assert ctrl.identify_controller().subnqn == NQN
            assert ctrl.namespaces() == [1, 2]
            assert ctrl.get_features(FeatureId.KATO) == 5000
            ctrl.flush(1)
            with pytest.raises(NvmeError) as info:
                ctrl.read(1, 1 << 40, 1)
            assert info.value.status == Status.LBA_RANGE
            with pytest.raises(TimeoutError):
                ctrl.next_event(timeout=0.1)
            cntlid = ctrl.cntlid
            assert cntlid in target.controllers
        assert cntlid not in target.controllers
        entries = sync.discover("127.0.0.1", port)
        assert any(e.subnqn == NQN for e in entries)
    finally:
        sync.run(target.close())
