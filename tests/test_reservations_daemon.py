"""PTPL against the real daemon: a reservation taken with CPTPL 11b survives `kill -9` of `nvmeof serve` and its
restart; once PTPL is cleared, the next restart starts with none (the spec's power loss)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from initiator import connect
from nvmeof.spec.reservations import Cptpl, ReservationType
from nvmeof.status import NvmeError, Status
from tests.interop.ourtarget import SUBNQN, start_serve, stop_serve

HOST_A = ("nqn.2014-08.org.nvmexpress:uuid:0a0a0a0a-0000-4000-8000-00000000000a",
          uuid.UUID("0a0a0a0a-0000-4000-8000-00000000000a"))
HOST_B = ("nqn.2014-08.org.nvmexpress:uuid:0b0b0b0b-0000-4000-8000-00000000000b",
          uuid.UUID("0b0b0b0b-0000-4000-8000-00000000000b"))
KEY = 0x5EC0DE


def _kill9(target) -> None:
    target.client.close()
    target.proc.kill()
    target.proc.wait(10)


@pytest.mark.slow
def test_ptpl_reservation_survives_kill_9_and_restart(tmp_path: Path) -> None:
    disks = tmp_path / "disks"
    disks.mkdir()
    extra = ("--config", str(tmp_path / "config.json"), "--backing-dir", str(disks))
    log = tmp_path / "serve.log"
    tgt = start_serve(log, size="8M", extra_args=extra)
    ports = (tgt.io_port, tgt.discovery_port, int(tgt.api_url.split(":")[2].split("/")[0]))
    tgt.api("POST", f"/subsystems/{SUBNQN}/namespaces",
            json={"backend": "file", "path": str(disks / "shared.img"), "size": 8 << 20, "create": True, "nsid": 2})

    async def as_host(host, fn):
        async with connect("127.0.0.1", ports[0], subnqn=SUBNQN, hostnqn=host[0], hostid=host[1]) as ctrl:
            return await fn(ctrl)

    async def take(ctrl):
        await ctrl.resv_register(2, nrkey=KEY, cptpl=Cptpl.SET)
        await ctrl.resv_acquire(2, crkey=KEY, rtype=ReservationType.EXCLUSIVE_ACCESS)
        await ctrl.write(2, 0, b"A" * 512)

    async def refused(ctrl):
        with pytest.raises(NvmeError) as err:
            await ctrl.read(2, 0, 1)
        return err.value.status

    async def holder_writes(ctrl):
        await ctrl.write(2, 1, b"a" * 512)
        return await ctrl.resv_report(2)

    async def ptpl_off(ctrl):
        await ctrl.resv_register(2, nrkey=KEY, cptpl=Cptpl.CLEAR)

    async def reads(ctrl):
        return bytes(await ctrl.read(2, 0, 1))

    try:
        asyncio.run(as_host(HOST_A, take))
        assert asyncio.run(as_host(HOST_B, refused)) == Status.RESERVATION_CONFLICT
        _kill9(tgt)
        tgt = start_serve(log, size="8M", extra_args=extra, ports=ports, append_log=True)
        assert asyncio.run(as_host(HOST_B, refused)) == Status.RESERVATION_CONFLICT
        report = asyncio.run(as_host(HOST_A, holder_writes))
        assert report.ptpls and report.rtype == ReservationType.EXCLUSIVE_ACCESS
        assert [(r.hostid, r.rkey, r.holds) for r in report.registrants] == [(HOST_A[1].bytes, KEY, True)]
        view = tgt.api("GET", f"/subsystems/{SUBNQN}/namespaces/2/reservations")
        assert view["holder"] == HOST_A[1].bytes.hex() and view["registrants"][0]["rkey"] == "<redacted>"
        asyncio.run(as_host(HOST_A, ptpl_off))
        _kill9(tgt)
        tgt = start_serve(log, size="8M", extra_args=extra, ports=ports, append_log=True)
        assert asyncio.run(as_host(HOST_B, reads)) == b"A" * 512     # no PTPL: the restart cleared it
        assert tgt.api("GET", f"/subsystems/{SUBNQN}/namespaces/2/reservations")["registrants"] == []
        assert hex(KEY) not in log.read_text() and str(KEY) not in log.read_text()
    finally:
        stop_serve(tgt)
