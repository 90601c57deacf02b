"""PORTID and NSID bounds: one rule each (nvmeof/spec), the same at the REST API, the service and the CLI.

PORTID is the 16-bit Discovery Log Page Entry field, no value reserved; nvmet takes any u16 for a port
(nvmet_ports_make) and for a referral's addr_portid (nvmet_addr_portid_store). A listener's 0 means
"pick a free one" here (as in the configuration file), so listeners take 1..FFFFh, referrals 0..FFFFh.
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from construct import FormatFieldError
from fastapi.testclient import TestClient

from api.app import create_app
from nvmeof.cli.commands import manage
from nvmeof.spec.fabrics import PORTID_MAX, DiscoveryLogEntry
from nvmeof.spec.identify import NSID_MAX
from target.core import Target
from target.service import ServiceError, TargetService
from tests.ports import free_ports

REPO = Path(__file__).resolve().parent.parent
TOKEN = "portid-t0ken"


def test_portid_max_is_the_whole_discovery_log_field() -> None:
    entry = {"trtype": 3, "adrfam": 1, "subtype": 2, "treq": 0, "portid": PORTID_MAX, "cntlid": 0xFFFF,
             "asqsz": 32, "eflags": 0, "trsvcid": "4420", "subnqn": "nqn.x", "traddr": "127.0.0.1", "tsas": bytes(256)}
    assert PORTID_MAX == 0xFFFF
    assert DiscoveryLogEntry.parse(DiscoveryLogEntry.build(entry)).portid == PORTID_MAX
    with pytest.raises(FormatFieldError):
        DiscoveryLogEntry.build({**entry, "portid": PORTID_MAX + 1})


async def test_the_service_takes_every_16_bit_portid_and_names_one_past() -> None:
    svc = TargetService(Target())
    one, two = free_ports(2)
    try:
        assert (await svc.add_listener("tcp", "127.0.0.1", one, portid=PORTID_MAX)).portid == PORTID_MAX
        with pytest.raises(ServiceError) as err:
            await svc.add_listener("tcp", "127.0.0.1", two, portid=PORTID_MAX + 1)
        assert err.value.status == 400 and "portid" in err.value.message and str(PORTID_MAX) in err.value.message
        assert (await svc.add_referral("192.0.2.1", portid=PORTID_MAX)).portid == PORTID_MAX
        assert (await svc.add_referral("192.0.2.2", portid=0)).portid == 0
        with pytest.raises(ServiceError) as err:
            await svc.add_referral("192.0.2.3", portid=PORTID_MAX + 1)
        assert err.value.status == 400 and "portid" in err.value.message
    finally:
        await svc.target.close()


def test_the_api_takes_the_same_portids(tmp_path: Path) -> None:
    svc = TargetService(Target(), config_path=tmp_path / "config.json")
    port = free_ports(1)[0]
    with TestClient(create_app(svc, token=TOKEN), headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        try:
            for portid in (0, PORTID_MAX):
                r = client.post("/api/v1/referrals", json={"traddr": f"192.0.2.{1 + portid % 7}", "portid": portid})
                assert r.status_code == 201 and r.json()["portid"] == portid, r.text
            assert client.post("/api/v1/referrals", json={"traddr": "192.0.2.9", "portid": PORTID_MAX + 1}
                               ).status_code == 422
            r = client.post("/api/v1/listeners", json={"traddr": "127.0.0.1", "trsvcid": port, "portid": PORTID_MAX})
            assert r.status_code == 201 and r.json()["portid"] == PORTID_MAX, r.text
            assert client.post("/api/v1/listeners", json={"traddr": "127.0.0.1", "trsvcid": port + 1,
                                                          "portid": PORTID_MAX + 1}).status_code == 422
        finally:
            client.portal.call(svc.target.close)


def _option(command: click.Command, name: str) -> click.IntRange:
    param = next(p for p in command.params if p.name == name)
    assert isinstance(param.type, click.IntRange)
    return param.type


def test_the_cli_takes_the_same_ranges() -> None:
    listener, referral = _option(manage.listener_add, "portid"), _option(manage.referral_add, "portid")
    assert (listener.min, listener.max) == (1, PORTID_MAX)
    assert (referral.min, referral.max) == (0, PORTID_MAX)
    assert _option(manage.subsystem_add, "max_namespaces").max == NSID_MAX


def test_the_nsid_bound_is_written_once() -> None:
    """0xFFFFFFFE as a literal only where NSID_MAX is defined (tests excepted: they check the value)."""
    places = [str(p.relative_to(REPO)) for p in REPO.rglob("*.py")
              if "tests" not in p.relative_to(REPO).parts and "0xfffffffe" in p.read_text().lower()]
    assert places == ["nvmeof/spec/identify.py"], places
