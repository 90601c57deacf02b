"""Managing DH-HMAC-CHAP keys (issue 13): TargetService, the config file (0600), the nvmetcli
conversion, the REST API (which never returns a secret) and the CLI (which never prints one); logs
are searched for the key text too."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest

from nvmeof.auth import generate_secret
from target import config as configmod
from target.core import Target
from target.service import ServiceError, TargetService
from tests.api_client import route_cli_to

NQN = "nqn.2024-01.com.example:authdisk"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:0f2d2f36-8a4e-4a3b-9a52-3b1f1f2f7c11"
HOST2 = "nqn.2014-08.org.nvmexpress:uuid:0f2d2f36-8a4e-4a3b-9a52-3b1f1f2f7c12"
KEY = generate_secret(key_len=32)
CTRL_KEY = generate_secret(hmac_id=2, nqn=NQN)
NEW_KEY = generate_secret(key_len=64)
SUBS = "/api/v1/subsystems"


def secret_parts() -> list[str]:
    """The texts that must never show: every whole secret and its base64 body."""
    return [part for key in (KEY, CTRL_KEY, NEW_KEY) for part in (key, key.split(":")[2])]


def assert_no_secret(text: str) -> None:
    for part in secret_parts():
        assert part not in text, "a DH-HMAC-CHAP secret leaked"


# ------------------------------------------------------------------------- service and config file


async def test_keys_are_stored_persisted_0600_and_restored(service, config_path):
    await service.add_subsystem(NQN, allow_any_host=False, hosts=[HOSTNQN, HOST2])
    await service.set_subsystem_dhchap(NQN, {"dhchap_dhgroup": ["ffdhe4096", "ffdhe2048"]})
    config_path.chmod(0o644)   # whatever the file had, the next save writes it 0600
    await service.set_host_auth(NQN, HOSTNQN, {"dhchap_key": KEY, "dhchap_ctrl_key": CTRL_KEY,
                                               "dhchap_hash": ["hmac(sha512)", "sha384"]})
    assert stat.S_IMODE(os.stat(config_path).st_mode) == 0o600
    saved = json.loads(config_path.read_text())
    sub = saved["subsystems"][0]
    assert sub["dhchap_dhgroup"] == ["ffdhe4096", "ffdhe2048"]
    assert sub["hosts"] == [{"nqn": HOSTNQN, "dhchap_key": KEY, "dhchap_ctrl_key": CTRL_KEY,
                             "dhchap_hash": ["sha512", "sha384"]}, HOST2]
    assert configmod.load_config(config_path) == saved
    # a daemon starting from this file gets the same keys
    again = TargetService(Target())
    assert await again.restore(saved) == []
    entry = again.get_subsystem(NQN).host_auth[HOSTNQN]
    assert entry.dhchap_key.format() == KEY and entry.dhchap_ctrl_key.format() == CTRL_KEY
    assert entry.dhchap_hash == (3, 2) and again.get_subsystem(NQN).dhchap_dhgroup == (3, 1)
    assert_no_secret(repr(entry))
    # deny drops the keys with the host
    await service.deny_host(NQN, HOSTNQN)
    assert HOSTNQN not in service.get_subsystem(NQN).host_auth
    assert_no_secret(config_path.read_text())


@pytest.mark.parametrize("settings,words", [
    ({"dhchap_key": "DHHC-1:00:notbase64!!:"}, "dhchap_key of host"),
    ({"dhchap_key": KEY[:-6] + "AAAA:"}, "dhchap_key of host"),                 # CRC no longer matches
    ({"dhchap_ctrl_key": CTRL_KEY}, "needs a host key"),
    ({"dhchap_key": KEY, "dhchap_hash": ["md5"]}, "unknown hash 'md5'"),
    ({"dhchap_key": KEY, "dhchap_dhgroup": ["ffdhe1024"]}, "unknown DH group 'ffdhe1024'"),
    ({"dhchap_key": True}, "presence flag"),
])
async def test_bad_settings_are_refused_without_echoing_the_secret(service, settings, words, caplog):
    caplog.set_level(logging.DEBUG)
    await service.add_subsystem(NQN, allow_any_host=False, hosts=[HOSTNQN])
    with pytest.raises(ServiceError) as info:
        await service.set_host_auth(NQN, HOSTNQN, settings)
    assert info.value.status == 400 and words in info.value.message
    for value in settings.values():
        if isinstance(value, str) and value.startswith("DHHC-1"):
            assert value not in info.value.message and value.split(":")[2] not in info.value.message
    assert HOSTNQN not in service.get_subsystem(NQN).host_auth   # nothing changed
    assert_no_secret(caplog.text)


async def test_keys_need_an_allowed_host(service):
    await service.add_subsystem(NQN, allow_any_host=False, hosts=[HOSTNQN])
    with pytest.raises(ServiceError) as info:
        await service.set_host_auth(NQN, HOST2, {"dhchap_key": KEY})
    assert info.value.status == 404
    with pytest.raises(ServiceError):
        await service.add_subsystem("nqn.2024-01.com.example:other", allow_any_host=False, hosts=[HOSTNQN],
                                    host_auth={HOST2: {"dhchap_key": KEY}})


def test_config_structure_checks_host_objects():
    bad = {"version": 1, "subsystems": [{"nqn": NQN, "hosts": [{"nqn": HOSTNQN, "dhchap_key": True,
                                                               "dhchap_keys": KEY}]}]}
    with pytest.raises(configmod.ConfigError) as info:
        configmod.validate_config(bad)
    text = str(info.value)
    assert "hosts[0].dhchap_key" in text and "boolean" in text and "unknown key 'dhchap_keys'" in text
    assert_no_secret(text)


def test_nvmetcli_round_trip_carries_the_dhchap_attributes():
    ours = {"version": 1, "subsystems": [{
        "nqn": NQN, "allow_any_host": False,
        "hosts": [{"nqn": HOSTNQN, "dhchap_key": KEY, "dhchap_ctrl_key": CTRL_KEY, "dhchap_hash": ["sha384"],
                   "dhchap_dhgroup": ["ffdhe3072"]}, HOST2],
        "namespaces": []}], "listeners": [], "referrals": []}
    dump = configmod.export_nvmetcli(ours)
    # nvmetcli dumps configfs hosts/<nqn>/dhchap_* as the host's "dhchap" attribute group
    assert dump["hosts"] == [
        {"nqn": HOSTNQN, "dhchap": {"key": KEY, "ctrl_key": CTRL_KEY, "hash": "hmac(sha384)", "dhgroup": "ffdhe3072"}},
        {"nqn": HOST2}]
    back = configmod.import_nvmetcli(dict(dump))
    assert back["subsystems"][0]["hosts"] == [
        {"nqn": HOSTNQN, "dhchap_key": KEY, "dhchap_ctrl_key": CTRL_KEY, "dhchap_hash": ["hmac(sha384)"],
         "dhchap_dhgroup": ["ffdhe3072"]}, HOST2]


def test_nvmetcli_import_of_kernel_defaults_and_file_names():
    dump = {"hosts": [
        # what configfs shows for a host with a key and untouched hash/group: our defaults (all)
        {"nqn": HOSTNQN, "dhchap": {"key": KEY, "ctrl_key": "", "hash": "hmac(sha256)", "dhgroup": "null"}},
        # a hand-made dump spelling the attributes as the configfs files are named
        {"nqn": HOST2, "dhchap_key": NEW_KEY, "dhchap_hash": "hmac(sha512)"}],
        "subsystems": [{"nqn": NQN, "attr": {"allow_any_host": "0"}, "allowed_hosts": [HOSTNQN, HOST2]}],
        "ports": []}
    out = configmod.import_nvmetcli(dump)
    assert out["subsystems"][0]["hosts"] == [{"nqn": HOSTNQN, "dhchap_key": KEY},
                                             {"nqn": HOST2, "dhchap_key": NEW_KEY, "dhchap_hash": ["hmac(sha512)"]}]
    with pytest.raises(configmod.ConfigError):
        configmod.import_nvmetcli({"hosts": [{"nqn": HOSTNQN, "dhchap": {"key": 5}}]})


# ------------------------------------------------------------------------------------------- REST


def _everything(client) -> str:
    """Every answer that could show a host: subsystems, hosts, config, nvmetcli export, unrestored."""
    hosts = f"{SUBS}/{NQN}/hosts"
    return "\n".join(client.get(url).text for url in (
        SUBS, f"{SUBS}/{NQN}", hosts, f"{hosts}/{HOSTNQN}", "/api/v1/config", "/api/v1/config/nvmetcli",
        "/api/v1/config/unrestored"))


def test_rest_set_rotate_remove_keys_and_never_return_them(client, service, config_path, caplog):
    caplog.set_level(logging.DEBUG)
    assert client.post(SUBS, json={"nqn": NQN, "allow_any_host": False,
                                   "dhchap_hash": ["sha512"]}).status_code == 201
    hosts = f"{SUBS}/{NQN}/hosts"
    r = client.post(hosts, json={"hostnqn": HOSTNQN, "dhchap_key": KEY, "dhchap_ctrl_key": CTRL_KEY})
    assert r.status_code == 201, r.text
    assert r.json()["entries"] == [{"hostnqn": HOSTNQN, "dhchap_key": True, "dhchap_ctrl_key": True,
                                    "dhchap_hash": None, "dhchap_dhgroup": None, "tls_key": False,
                                    "tls_compat": False}]
    assert_no_secret(r.text)
    text = _everything(client)
    assert_no_secret(text)
    exported = client.get("/api/v1/config").json()
    assert exported["subsystems"][0]["hosts"] == [{"nqn": HOSTNQN, "dhchap_key": True, "dhchap_ctrl_key": True}]
    nvmetcli = client.get("/api/v1/config/nvmetcli").json()
    assert "key" not in nvmetcli["nvmetcli"]["hosts"][0].get("dhchap", {})
    assert any("not exported through the API" in w for w in nvmetcli["warnings"])
    # the file has them (it is the daemon's own, 0600)
    assert KEY in config_path.read_text() and stat.S_IMODE(config_path.stat().st_mode) == 0o600
    # rotate the host key only: the controller key stays
    r = client.patch(f"{hosts}/{HOSTNQN}", json={"dhchap_key": NEW_KEY})
    assert r.status_code == 200 and r.json()["dhchap_ctrl_key"] is True
    assert service.get_subsystem(NQN).host_auth[HOSTNQN].dhchap_key.format() == NEW_KEY
    # null removes one field
    r = client.patch(f"{hosts}/{HOSTNQN}", json={"dhchap_ctrl_key": None, "dhchap_dhgroup": ["null"]})
    assert r.json() == {"hostnqn": HOSTNQN, "dhchap_key": True, "dhchap_ctrl_key": False, "dhchap_hash": None,
                        "dhchap_dhgroup": ["null"], "tls_key": False, "tls_compat": False}
    r = client.patch(f"{SUBS}/{NQN}/dhchap", json={"dhchap_hash": None})
    assert r.status_code == 200 and r.json()["dhchap_hash"] is None
    # remove everything: the host stays allowed
    r = client.delete(f"{hosts}/{HOSTNQN}/dhchap")
    assert r.status_code == 200 and r.json()["dhchap_key"] is False
    assert service.get_subsystem(NQN).host_allowed(HOSTNQN)
    assert NEW_KEY not in config_path.read_text()
    assert_no_secret(caplog.text)


def test_rest_refusals_do_not_echo_secrets(client, caplog):
    caplog.set_level(logging.DEBUG)
    client.post(SUBS, json={"nqn": NQN, "allow_any_host": False})
    hosts = f"{SUBS}/{NQN}/hosts"
    answers = [
        client.post(hosts, json={"hostnqn": HOSTNQN, "dhchap_keys": KEY}),           # typo: 422
        client.post(hosts, json={"hostnqn": HOSTNQN, "dhchap_key": KEY, "dhchap_hash": "sha256"}),  # not a list
        client.post(hosts, json={"hostnqn": HOSTNQN, "dhchap_key": KEY[:-4] + "x:"}),  # bad secret: 400
        client.post(hosts, json={"hostnqn": HOSTNQN, "dhchap_ctrl_key": CTRL_KEY}),   # no host key: 400
        client.patch(f"{hosts}/{HOST2}", json={"dhchap_key": KEY}),                   # not allowed: 404
        client.post("/api/v1/config", json={"version": 1, "subsystems": [
            {"nqn": NQN + "x", "hosts": [{"nqn": HOSTNQN, "dhchap_key": 5, "dhchap_ctrl_keyy": CTRL_KEY}]}]}),
    ]
    assert [r.status_code for r in answers] == [422, 422, 400, 400, 404, 400]
    for r in answers:
        assert_no_secret(r.text)
    assert "dhchap_keys" in answers[0].text
    assert_no_secret(caplog.text)


def test_rest_import_with_presence_flags_is_refused_by_name(client):
    client.post(SUBS, json={"nqn": NQN, "allow_any_host": False})
    client.post(f"{SUBS}/{NQN}/hosts", json={"hostnqn": HOSTNQN, "dhchap_key": KEY})
    exported = client.get("/api/v1/config").json()
    exported["subsystems"][0]["nqn"] = NQN + "2"
    r = client.post("/api/v1/config", json=exported)
    assert r.status_code == 400 and "hosts[0].dhchap_key" in r.text and "boolean" in r.text


# -------------------------------------------------------------------------------------------- CLI


def test_cli_host_key_commands(client, service, monkeypatch):
    from click.testing import CliRunner

    from nvmeof.cli import cli

    route_cli_to(client, monkeypatch)
    runner = CliRunner()

    def run(*args: str, code: int = 0):
        result = runner.invoke(cli, list(args), catch_exceptions=False)
        assert result.exit_code == code, (args, result.output)
        assert_no_secret(result.output)
        return result

    run("subsystem", "add", NQN, "--no-allow-any-host", "--dhchap-dhgroup", "ffdhe2048,ffdhe3072")
    out = run("host", "allow", NQN, HOSTNQN, "--dhchap-key", KEY, "--dhchap-ctrl-key", CTRL_KEY,
              "--dhchap-hash", "sha512").output
    assert "after DH-HMAC-CHAP authentication" in out
    rows = run("host", "list", NQN).output.splitlines()
    assert rows[0].split() == ["HOSTNQN", "DHCHAP_KEY", "CTRL_KEY", "HASH", "DHGROUP", "TLS_KEY"]
    assert rows[2].split() == [HOSTNQN, "yes", "yes", "sha512", "default", "no"]
    run("host", "set-key", NQN, HOSTNQN, "--dhchap-key", NEW_KEY, "--no-dhchap-ctrl-key")
    entry = service.get_subsystem(NQN).host_auth[HOSTNQN]
    assert entry.dhchap_key.format() == NEW_KEY and entry.dhchap_ctrl_key is None
    bad = run("host", "set-key", NQN, HOSTNQN, "--dhchap-key", KEY[:-4] + "x:", code=1)
    assert "dhchap_key of host" in bad.output
    run("host", "set-key", NQN, HOSTNQN, code=2)
    run("host", "list", NQN, "--json")
    run("subsystem", "set-dhchap", NQN, "--all-dhgroups")
    assert service.get_subsystem(NQN).dhchap_dhgroup is None
    run("host", "remove-key", NQN, HOSTNQN)
    assert HOSTNQN not in service.get_subsystem(NQN).host_auth
