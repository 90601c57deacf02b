"""NVMe/TCP TLS management: listener tls modes and host TLS PSKs through TargetService, the config file,
the REST API and the CLI (keys persisted, never shown), and the discovery log's TREQ/SECTYPE."""

from __future__ import annotations

import json
import logging

import pytest
from ports import free_port, free_ports

import initiator
from nvmeof import defaults
from nvmeof.spec.fabrics import (
    TCP_SECTYPE_NONE,
    TCP_SECTYPE_TLS13,
    TREQ_DISABLE_SQFLOW,
    TREQ_NOT_REQUIRED,
    TREQ_NOT_SPECIFIED,
    TREQ_REQUIRED,
    SubType,
)
from nvmeof.tls.psk import generate_key
from target.core import Target
from target.service import ServiceError, TargetService
from tests.api_client import route_cli_to

NQN = "nqn.2024-01.com.example:tlsdisk"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:0f2d2f36-8a4e-4a3b-9a52-3b1f1f2f7c21"
KEY = generate_key()
KEY2 = generate_key(hmac_id=2)
SUBS = "/api/v1/subsystems"


def assert_no_key(text: str) -> None:
    for key in (KEY, KEY2):
        assert key not in text and key.split(":")[2] not in text, "a TLS PSK leaked"


async def test_service_persists_and_restores_tls(service, config_path, caplog):
    caplog.set_level(logging.DEBUG)
    await service.add_subsystem(NQN, allow_any_host=False)
    await service.allow_host(NQN, HOSTNQN, tls_key=KEY)
    lst = await service.add_listener("tcp", "127.0.0.1", free_port(), tls="required")
    assert lst.tls == "required"
    saved = json.loads(config_path.read_text())
    assert saved["subsystems"][0]["hosts"] == [{"nqn": HOSTNQN, "tls_key": KEY}]
    assert [x.get("tls") for x in saved["listeners"]] == ["required"]
    again = TargetService(Target())
    saved["listeners"][0]["trsvcid"] = free_port()   # the first service still listens on its port
    try:
        assert await again.restore(saved) == []
        assert again.get_subsystem(NQN).host_auth[HOSTNQN].tls_key.format() == KEY
        assert [x.tls for x in again.list_listeners()] == ["required"]
    finally:
        await again.target.close()
    # rotate, then remove; clearing DH-HMAC-CHAP leaves the TLS key alone
    await service.set_host_auth(NQN, HOSTNQN, {"tls_key": KEY2})
    await service.clear_host_auth(NQN, HOSTNQN)
    assert service.get_subsystem(NQN).host_auth[HOSTNQN].tls_key.format() == KEY2
    await service.set_host_auth(NQN, HOSTNQN, {"tls_key": None})
    assert HOSTNQN not in service.get_subsystem(NQN).host_auth
    assert_no_key(caplog.text)
    await service.target.close()


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"tls": "maybe"}, "tls 'maybe'"),
])
async def test_bad_listener_tls_is_refused(service, kwargs, words):
    with pytest.raises(ServiceError, match=words):
        await service.add_listener("tcp", "127.0.0.1", free_port(), **kwargs)
    with pytest.raises(ServiceError, match="NVMe/TCP secure channel"):
        await service.add_listener("rdma", "127.0.0.1", free_port(), tls="required")
    await service.target.close()


async def test_bad_tls_key_is_refused_without_echo(service, caplog):
    await service.add_subsystem(NQN, allow_any_host=False)
    bad = KEY[:-6] + "AAAA:"
    with pytest.raises(ServiceError) as info:
        await service.allow_host(NQN, HOSTNQN, tls_key=bad)
    assert "tls_key of host" in info.value.message and bad.split(":")[2] not in info.value.message
    with pytest.raises(ServiceError, match="presence flag"):
        await service.allow_host(NQN, HOSTNQN, tls_key=True)
    await service.target.close()


def test_rest_round_trip_redacts_key(client, service):
    assert client.post(SUBS, json={"nqn": NQN, "allow_any_host": False}).status_code == 201
    r = client.post(f"{SUBS}/{NQN}/hosts", json={"hostnqn": HOSTNQN, "tls_key": KEY})
    assert r.status_code == 201, r.text
    assert r.json()["entries"][0]["tls_key"] is True
    r = client.post("/api/v1/listeners", json={"traddr": "127.0.0.1", "trsvcid": free_port(), "tls": "optional"})
    assert r.status_code == 201, r.text
    assert r.json()["tls"] == "optional"
    assert client.post("/api/v1/listeners", json={"traddr": "127.0.0.1", "trsvcid": 1,
                                                  "tls": "sometimes"}).status_code == 422
    texts = [client.get(u).text for u in (SUBS, f"{SUBS}/{NQN}/hosts", f"{SUBS}/{NQN}/hosts/{HOSTNQN}",
                                          "/api/v1/config", "/api/v1/listeners")]
    for text in texts:
        assert_no_key(text)
    exported = client.get("/api/v1/config").json()
    assert exported["subsystems"][0]["hosts"] == [{"nqn": HOSTNQN, "dhchap_key": False, "dhchap_ctrl_key": False,
                                                   "tls_key": True}]
    assert [x.get("tls") for x in exported["listeners"]] == ["optional"]
    r = client.patch(f"{SUBS}/{NQN}/hosts/{HOSTNQN}", json={"tls_key": KEY2})
    assert r.status_code == 200 and r.json()["tls_key"] is True
    assert service.get_subsystem(NQN).host_auth[HOSTNQN].tls_key.format() == KEY2
    assert_no_key(r.text)


async def _discovery_page(service, mode: str):  # type: ignore[no-untyped-def]
    await service.add_subsystem(NQN, allow_any_host=False)
    await service.allow_host(NQN, HOSTNQN, tls_key=KEY)
    await service.add_namespace(NQN, backend="null", size=1 << 20)
    io_port, port = free_ports(2)
    io = await service.add_listener("tcp", "127.0.0.1", io_port, tls=mode)
    await service.add_listener("tcp", "127.0.0.1", port, discovery=True, tls=mode)
    kwargs = {"tls_key": KEY} if mode != "none" else {}
    entries = await initiator.discover("127.0.0.1", port, hostnqn=HOSTNQN, timeout=10, **kwargs)
    return io, entries


@pytest.mark.parametrize(("mode", "treq", "sectype"), [
    ("required", TREQ_REQUIRED, TCP_SECTYPE_TLS13),
    ("optional", TREQ_NOT_REQUIRED, TCP_SECTYPE_TLS13),
    ("none", TREQ_NOT_SPECIFIED, TCP_SECTYPE_NONE),
])
async def test_discovery_log_treq_sectype(service, mode, treq, sectype):
    """Discovery over TLS (the identity names the discovery NQN; the host's subsystem key answers it); each
    entry carries TREQ and TSAS.SECTYPE as nvmet sets them for addr_tsas tls1.3 / addr_treq."""
    try:
        _io, entries = await _discovery_page(service, mode)
    finally:
        await service.target.close()
    nvm = [e for e in entries if e.subtype == SubType.NVME]
    assert len(nvm) == 1 and nvm[0].subnqn == NQN
    for e in (nvm[0], next(e for e in entries if e.subtype == SubType.CURRENT)):
        assert e.treq == treq | TREQ_DISABLE_SQFLOW
        assert e.tsas[0] == sectype
    assert defaults.DISCOVERY_NQN in {e.subnqn for e in entries}


def test_cli_gen_tls_key_and_tls_options():
    from click.testing import CliRunner

    from nvmeof.cli import cli
    from nvmeof.tls.psk import TlsKey

    res = CliRunner().invoke(cli, ["gen-tls-key"])
    assert res.exit_code == 0 and TlsKey.parse(res.output.strip()).hmac_id == 1
    res = CliRunner().invoke(cli, ["gen-tls-key", "--hmac", "2"])
    assert res.exit_code == 0 and len(TlsKey.parse(res.output.strip()).key) == 48
    secret = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
    res = CliRunner().invoke(cli, ["gen-tls-key", "--secret", secret, "-q", "nqn.h", "-n", "nqn.s"])
    assert res.exit_code == 0
    assert res.stdout.strip() == TlsKey(bytes.fromhex(secret), 1).format()
    assert "NVMe1R01 nqn.h nqn.s " in res.stderr
    # --tls without a key, and a bad key, are refused before connecting (the key is not echoed)
    res = CliRunner().invoke(cli, ["discover", "-a", "127.0.0.1", "-s", "1", "--tls"])
    assert res.exit_code == 2 and "--tls needs --tls-key" in res.output
    bad = KEY[:-6] + "AAAA:"
    res = CliRunner().invoke(cli, ["identify", "-a", "127.0.0.1", "-s", "1", "-n", NQN, "--tls-key", bad])
    assert res.exit_code == 2 and "TLS PSK" in res.output and bad.split(":")[2] not in res.output
    res = CliRunner().invoke(cli, ["bench", "-a", "127.0.0.1", "-s", "1", "-n", NQN, "--tls"])
    assert res.exit_code == 2 and "--tls needs --tls-key" in res.output


def test_cli_tls_sha256_binder(monkeypatch):
    """--tls-sha256-binder reaches connect() as tls_sha256_binder=True, needs a key, and is the Python host's only
    (`nvmeof connect`, the kernel host, has no such option)."""
    from click.testing import CliRunner

    import initiator
    from nvmeof.cli import cli

    seen = {}

    async def fake_connect(*args, **kwargs):
        seen.update(kwargs)
        raise ConnectionRefusedError("not connecting in this test")
    monkeypatch.setattr(initiator, "connect", fake_connect)
    key384 = generate_key(hmac_id=2)
    res = CliRunner().invoke(cli, ["identify", "-a", "127.0.0.1", "-s", "1", "-n", NQN, "--tls-key", key384,
                                   "--tls-sha256-binder"])
    assert res.exit_code != 0 and seen["tls_sha256_binder"] is True and seen["tls_key"].hmac_id == 2
    assert key384.split(":")[2] not in res.output
    seen.clear()
    CliRunner().invoke(cli, ["identify", "-a", "127.0.0.1", "-s", "1", "-n", NQN, "--tls-key", key384])
    assert seen["tls_key"].hmac_id == 2 and not seen.get("tls_sha256_binder")
    for cmd in (["discover", "-a", "127.0.0.1", "-s", "1"], ["bench", "-a", "127.0.0.1", "-s", "1", "-n", NQN]):
        res = CliRunner().invoke(cli, [*cmd, "--tls-sha256-binder"])
        assert res.exit_code == 2 and "--tls-sha256-binder needs --tls-key" in res.output
    res = CliRunner().invoke(cli, ["connect", "-a", "127.0.0.1", "-n", NQN, "--tls-sha256-binder"])
    assert res.exit_code == 2 and "No such option" in res.output
    from initiator.bench.jobspec import ConnectSpec  # bench's connections
    from nvmeof.tls.psk import TlsKey
    spec = ConnectSpec(traddr="127.0.0.1", trsvcid=1, subnqn=NQN, tls_key=TlsKey.parse(key384))
    assert "tls_sha256_binder" not in spec.kwargs()
    spec.tls_sha256_binder = True
    assert spec.kwargs()["tls_sha256_binder"] is True


def test_nvmetcli_round_trip_keeps_listener_tls():
    from target import config as configmod

    cfg = {"version": 1, "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": []}],
           "listeners": [{"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": 4420, "portid": 1, "tls": "required"},
                         {"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": 4421, "portid": 2, "tls": "optional"},
                         {"trtype": "tcp", "traddr": "127.0.0.1", "trsvcid": 4422, "portid": 3}]}
    exported = configmod.export_nvmetcli(cfg)
    addrs = [p["addr"] for p in exported["ports"]]
    assert [(a.get("tsas"), a["treq"]) for a in addrs] == [("tls1.3", "required"), ("tls1.3", "not required"),
                                                           (None, "not specified")]
    back = configmod.import_nvmetcli(exported)
    assert [lst.get("tls") for lst in back["listeners"]] == ["required", "optional", None]


def test_kernel_attach_tls_options(tmp_path):
    from initiator import kernel

    base = dict(subnqn=NQN, transport="tcp", traddr="10.0.0.1", trsvcid=4420, hostnqn=HOSTNQN, hostid="h")
    assert kernel.build_options(**base, tls=True).endswith(",tls")
    assert kernel.build_options(**base, tls_key_id=305419896).endswith(",tls,tls_key=305419896")
    with pytest.raises(kernel.KernelAttachError, match="transport tcp"):
        kernel.build_options(**{**base, "transport": "rdma"}, tls=True)
    keys = tmp_path / "keys"
    keys.write_text("0a1b2c3d I--Q---     1 perm 3f010000     0     0 keyring   _ses: 1\n"
                    "1f2e3d4c I------     1 perm 3f0b0000     0     0 keyring   .nvme: 2\n")
    assert kernel.nvme_keyring_id(str(keys)) == 0x1F2E3D4C
    keys.write_text("0a1b2c3d I--Q---     1 perm 3f010000     0     0 keyring   _ses: 1\n")
    with pytest.raises(kernel.KernelAttachError, match=r"no \.nvme keyring"):
        kernel.nvme_keyring_id(str(keys))
    with pytest.raises(kernel.KernelAttachError, match="invalid --tls-key") as info:
        kernel.insert_tls_key(KEY[:-6] + "AAAA:", HOSTNQN, NQN)
    assert KEY.split(":")[2][:20] not in str(info.value)


async def test_tls_compat_persists_and_is_shown(service, config_path, caplog):
    """tls_compat: off by default, saved in the config file only when on, restored, refused when not a bool,
    kept when the key rotates; the key stays redacted."""
    caplog.set_level(logging.DEBUG)
    await service.add_subsystem(NQN, allow_any_host=False)
    await service.allow_host(NQN, HOSTNQN, tls_key=KEY)
    assert service.get_subsystem(NQN).host_auth[HOSTNQN].tls_compat is False
    await service.set_host_auth(NQN, HOSTNQN, {"tls_compat": True})
    saved = json.loads(config_path.read_text())
    assert saved["subsystems"][0]["hosts"] == [{"nqn": HOSTNQN, "tls_key": KEY, "tls_compat": True}]
    again = TargetService(Target())
    try:
        assert await again.restore(saved) == []
        assert again.get_subsystem(NQN).host_auth[HOSTNQN].tls_compat is True
    finally:
        await again.target.close()
    await service.set_host_auth(NQN, HOSTNQN, {"tls_key": KEY2})
    assert service.get_subsystem(NQN).host_auth[HOSTNQN].tls_compat is True
    with pytest.raises(ServiceError, match=r"tls_compat of host .* must be true or false"):
        await service.set_host_auth(NQN, HOSTNQN, {"tls_compat": "yes"})
    await service.set_host_auth(NQN, HOSTNQN, {"tls_compat": False})
    assert "tls_compat" not in json.loads(config_path.read_text())["subsystems"][0]["hosts"][0]
    assert_no_key(caplog.text)
    await service.target.close()


def test_tls_compat_over_rest_and_cli(client, service, monkeypatch):
    from click.testing import CliRunner

    from nvmeof.cli import cli

    assert client.post(SUBS, json={"nqn": NQN, "allow_any_host": False}).status_code == 201
    r = client.post(f"{SUBS}/{NQN}/hosts", json={"hostnqn": HOSTNQN, "tls_key": KEY, "tls_compat": True})
    assert r.status_code == 201, r.text
    assert r.json()["entries"][0]["tls_compat"] is True and r.json()["entries"][0]["tls_key"] is True
    assert service.get_subsystem(NQN).host_auth[HOSTNQN].tls_compat is True
    r = client.patch(f"{SUBS}/{NQN}/hosts/{HOSTNQN}", json={"tls_compat": False})
    assert r.status_code == 200 and r.json()["tls_compat"] is False
    assert client.patch(f"{SUBS}/{NQN}/hosts/{HOSTNQN}", json={"tls_compat": "maybe"}).status_code == 422
    route_cli_to(client, monkeypatch)
    runner = CliRunner()
    result = runner.invoke(cli, ["host", "set", NQN, HOSTNQN, "--tls-compat"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert service.get_subsystem(NQN).host_auth[HOSTNQN].tls_compat is True
    rows = runner.invoke(cli, ["host", "list", NQN], catch_exceptions=False).output.splitlines()
    assert rows[2].split()[-2:] == ["yes", "(compat)"]
    other = HOSTNQN[:-2] + "99"
    result = runner.invoke(cli, ["host", "add", NQN, other, "--tls-key", KEY2, "--tls-compat"],
                           catch_exceptions=False)
    assert result.exit_code == 0 and "compat derivation" in result.output, result.output
    assert service.get_subsystem(NQN).host_auth[other].tls_compat is True
    result = runner.invoke(cli, ["host", "set-key", NQN, other, "--no-tls-compat"], catch_exceptions=False)
    assert result.exit_code == 0 and service.get_subsystem(NQN).host_auth[other].tls_compat is False
    for text in (result.output, client.get(f"{SUBS}/{NQN}/hosts").text, client.get("/api/v1/config").text):
        assert_no_key(text)
