"""Configuration file: atomic save, load errors, and the Linux nvmetcli format both ways."""

from __future__ import annotations

import json
import os
import stat

import pytest
from test_service import FakeTarget

from nvmeof import defaults
from target import config as configmod
from target.config import ConfigError, export_nvmetcli, import_nvmetcli, load_config, save_config, validate_config
from target.service import TargetService

SUB = "nqn.2026-01.com.example:sub1"
GOOD = {
    "version": 1,
    "subsystems": [
        {
            "nqn": SUB,
            "serial": "abc",
            "model": "m",
            "allow_any_host": True,
            "hosts": [],
            "max_namespaces": 32,
            "namespaces": [
                {"nsid": 1, "backend": "ram", "size": 1 << 20, "block_size": 512, "uuid": None},
                {"nsid": 2, "backend": "file", "path": "/srv/disk.img"},
            ],
        }
    ],
    "listeners": [{"trtype": "tcp", "adrfam": "ipv4", "traddr": "127.0.0.1", "trsvcid": 4420, "portid": 1}],
    "referrals": [],
}


# --- save ---------------------------------------------------------------------------------------


def test_save_is_atomic_and_syncs_file_and_folder(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    save_config(path, GOOD)
    assert json.loads(path.read_text()) == GOOD
    assert synced == [False, True]  # the temp file, then the folder after the rename
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["config.json"]
    path.chmod(0o644)
    save_config(path, {"version": 1})
    # always 0600 (issue 13): the file carries the hosts' DH-HMAC-CHAP secrets
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_failed_save_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    save_config(path, GOOD)
    before = path.read_bytes()

    def failing(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(ConfigError, match=r"cannot save the configuration to .*No space left on device"):
        save_config(path, {"version": 1, "subsystems": []})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["config.json"]
    with pytest.raises(ConfigError, match="cannot save"):
        save_config(tmp_path / "missing" / "config.json", GOOD)


# --- load ---------------------------------------------------------------------------------------


def test_load_roundtrip_and_defaults(tmp_path):
    path = tmp_path / "c.json"
    save_config(path, GOOD)
    assert load_config(path) == GOOD
    path.write_text('{"version": 1}')
    assert load_config(path) == {"version": 1, "subsystems": [], "listeners": [], "referrals": []}


def test_load_errors_name_file_and_place(tmp_path):
    path = tmp_path / "c.json"
    with pytest.raises(ConfigError, match=r"c\.json: no such file"):
        load_config(path)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    path.write_text('{\n  "version": 1,\n  "subsystems": [\n    {"nqn": "x",}\n  ]\n}\n')
    with pytest.raises(ConfigError, match=r"c\.json: line 4 column 17: Expecting property name"):
        load_config(path)
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)
    path.write_text("[]")
    with pytest.raises(ConfigError, match="top level must be a JSON object"):
        load_config(path)
    bad = json.loads(json.dumps(GOOD))
    bad["extra"] = 1
    bad["subsystems"][0]["namespaces"][1]["sise"] = 5
    bad["subsystems"][0]["max_namespaces"] = "many"
    bad["listeners"][0].pop("trsvcid")
    bad["referrals"] = [7]
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert any("unknown top-level key 'extra'" in line for line in lines)
    assert any("subsystems[0].namespaces[1]: unknown key 'sise'" in line for line in lines)
    assert any("subsystems[0].max_namespaces: expected integer, got str 'many'" in line for line in lines)
    assert any("listeners[0]: missing required key 'trsvcid'" in line for line in lines)
    assert any("referrals[0]: expected an object, got int" in line for line in lines)
    assert all(line.startswith(str(path)) or "[" in line for line in lines)


def test_backing_policy_keys(tmp_path):
    """``backing_dirs``/``allow_block_devices``: lists of absolute paths, each bad entry named."""
    path = tmp_path / "c.json"
    good = {"version": 1, "backing_dirs": ["/srv/disks"], "allow_block_devices": ["/dev/sdb"]}
    path.write_text(json.dumps(good))
    assert load_config(path)["backing_dirs"] == ["/srv/disks"]
    path.write_text(json.dumps({"version": 1, "backing_dirs": ["disks", 5, "/a\u0000b"], "allow_block_devices": "x"}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "backing_dirs[0]: expected an absolute path, got 'disks'" in text
    assert "backing_dirs[1]: expected an absolute path, got 5" in text and "backing_dirs[2]" in text
    assert "'allow_block_devices' must be a list of absolute paths, got str" in text


def test_load_version_and_nvmetcli_hint(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{}")
    with pytest.raises(ConfigError, match='missing "version"; add "version": 1'):
        load_config(path)
    path.write_text('{"version": 7}')
    with pytest.raises(ConfigError, match="version 7 is not supported"):
        load_config(path)
    path.write_text('{"hosts": [], "ports": [], "subsystems": []}')
    with pytest.raises(ConfigError, match="import-nvmetcli"):
        load_config(path)


# --- nvmetcli -----------------------------------------------------------------------------------


@pytest.fixture
def nvmetcli_sample(tmp_path):
    """A dump as `nvmetcli save` writes it from a kernel target: hosts, an I/O port, a discovery port
    with a referral, a loop port, one subsystem restricted to one host and one open subsystem."""
    disk1 = tmp_path / "disk1.img"
    disk2 = tmp_path / "disk2.img"
    for disk in (disk1, disk2):
        with open(disk, "wb") as fh:
            fh.truncate(8 << 20)
    host = "nqn.2014-08.org.nvmexpress:uuid:4b1b7e07-2a4c-4d3a-9c55-0d3f1b2c9a10"
    return {
        "hosts": [{"nqn": host}],
        "ports": [
            {
                "addr": {
                    "adrfam": "ipv4",
                    "traddr": "192.168.122.33",
                    "treq": "not specified",
                    "trsvcid": "4420",
                    "trtype": "tcp",
                    "tsas": "none",
                },
                "ana_groups": [{"ana": {"state": "optimized"}, "grpid": 1}],
                "param": {"inline_data_size": "16384", "pi_enable": "0"},
                "portid": 1,
                "referrals": [],
                "subsystems": ["nqn.2026-01.com.example:vol1", "nqn.2026-01.com.example:open"],
            },
            {
                "addr": {
                    "adrfam": "ipv4",
                    "traddr": "192.168.122.33",
                    "treq": "not specified",
                    "trsvcid": "8009",
                    "trtype": "tcp",
                },
                "ana_groups": [{"ana": {"state": "optimized"}, "grpid": 1}],
                "param": {"inline_data_size": "16384", "pi_enable": "0"},
                "portid": 2,
                "referrals": [
                    {
                        "addr": {
                            "adrfam": "ipv4",
                            "portid": "5",
                            "traddr": "192.168.122.40",
                            "treq": "not specified",
                            "trsvcid": "8009",
                            "trtype": "tcp",
                        },
                        "enable": 1,
                        "name": "peer",
                    },
                    {
                        "addr": {
                            "adrfam": "ipv4",
                            "portid": "6",
                            "traddr": "192.168.122.41",
                            "treq": "not specified",
                            "trsvcid": "8009",
                            "trtype": "tcp",
                        },
                        "enable": 0,
                        "name": "off",
                    },
                ],
                "subsystems": [],
            },
            {
                "addr": {"adrfam": "", "traddr": "", "treq": "not specified", "trsvcid": "", "trtype": "loop"},
                "portid": 3,
                "referrals": [],
                "subsystems": ["nqn.2026-01.com.example:vol1"],
            },
        ],
        "subsystems": [
            {
                "allowed_hosts": [host],
                "attr": {
                    "allow_any_host": "0",
                    "cntlid_max": "65519",
                    "cntlid_min": "1",
                    "firmware": "6.8.0",
                    "ieee_oui": "0x000000",
                    "model": "Linux",
                    "pi_enable": "0",
                    "qid_max": "128",
                    "serial": "9a5cbc4e0a1e5f3b",
                    "version": "1.3",
                },
                "namespaces": [
                    {
                        "ana_grpid": 1,
                        "device": {
                            "nguid": "3b2c1d4e-5f60-4718-8293-a4b5c6d7e8f9",
                            "path": str(disk1),
                            "uuid": "d592cdf3-5d1c-44e0-8412-3fcf7d99df27",
                        },
                        "enable": 1,
                        "nsid": 1,
                    },
                    {
                        "ana_grpid": 1,
                        "device": {
                            "nguid": "00000000-0000-0000-0000-000000000000",
                            "path": str(disk2),
                            "uuid": "0e5f3a1b-9c8d-4e7f-a6b5-c4d3e2f1a0b9",
                        },
                        "enable": 0,
                        "nsid": 4,
                    },
                ],
                "nqn": "nqn.2026-01.com.example:vol1",
            },
            {
                "allowed_hosts": [],
                "attr": {"allow_any_host": "1", "model": "Linux", "serial": "0123456789abcdef", "version": "1.3"},
                "namespaces": [],
                "nqn": "nqn.2026-01.com.example:open",
            },
        ],
    }


def test_import_nvmetcli(nvmetcli_sample, tmp_path):
    out = import_nvmetcli(nvmetcli_sample)
    validate_config(out)
    blk = 4096 if os.stat(tmp_path).st_blksize >= 4096 else 512
    assert out["subsystems"][0] == {
        "nqn": "nqn.2026-01.com.example:vol1",
        "allow_any_host": False,
        "hosts": ["nqn.2014-08.org.nvmexpress:uuid:4b1b7e07-2a4c-4d3a-9c55-0d3f1b2c9a10"],
        "serial": "9a5cbc4e0a1e5f3b",
        "model": "Linux",
        "namespaces": [
            {
                "nsid": 1,
                "backend": "file",
                "path": str(tmp_path / "disk1.img"),
                "block_size": blk,
                "enabled": True,
                "uuid": "d592cdf3-5d1c-44e0-8412-3fcf7d99df27",
                "nguid": "3b2c1d4e5f6047188293a4b5c6d7e8f9",
            },
            {
                "nsid": 4,
                "backend": "file",
                "path": str(tmp_path / "disk2.img"),
                "block_size": blk,
                "enabled": False,
                "uuid": "0e5f3a1b-9c8d-4e7f-a6b5-c4d3e2f1a0b9",
            },  # all-zero NGUID: generated on restore
        ],
    }
    assert out["subsystems"][1]["allow_any_host"] is True and out["subsystems"][1]["namespaces"] == []
    assert out["listeners"] == [
        {
            "trtype": "tcp",
            "adrfam": "ipv4",
            "traddr": "192.168.122.33",
            "trsvcid": 4420,
            "portid": 1,
            "discovery": False,
            "inline_data_size": 16384,   # the port's param_inline_data_size
        },
        {
            "trtype": "tcp",
            "adrfam": "ipv4",
            "traddr": "192.168.122.33",
            "trsvcid": 8009,
            "portid": 2,
            "discovery": True,
            "inline_data_size": 16384,
        },
    ]
    assert out["referrals"] == [
        {
            "trtype": "tcp",
            "adrfam": "ipv4",
            "traddr": "192.168.122.40",
            "trsvcid": 8009,
            "subnqn": defaults.DISCOVERY_NQN,
            "portid": 5,
        }
    ]
    text = "\n".join(out.warnings)
    assert "ports[2]: transport 'loop' is not served here" in text
    assert "ports[1].referrals[1]: disabled referral, skipped" in text
    assert json.loads(json.dumps(out)) == dict(out)  # a plain JSON-able dict


async def test_imported_config_restores(nvmetcli_sample, tmp_path):
    out = import_nvmetcli(nvmetcli_sample)
    out["listeners"] = []  # the sample's address is not on this machine
    target = FakeTarget()
    svc = TargetService(target, backing_dirs=[tmp_path])
    assert await svc.restore(out) == []
    vol = svc.get_subsystem("nqn.2026-01.com.example:vol1")
    assert sorted(vol.namespaces) == [1, 4] and vol.active_nsids() == [1]
    assert vol.namespaces[1].nguid.hex() == "3b2c1d4e5f6047188293a4b5c6d7e8f9"
    assert any(vol.namespaces[4].nguid)
    assert [r.traddr for r in target.referrals] == ["192.168.122.40"]


def test_nvmetcli_round_trip(nvmetcli_sample):
    ours = import_nvmetcli(nvmetcli_sample)
    back = export_nvmetcli(ours)
    assert back["hosts"] == nvmetcli_sample["hosts"]
    for got, want in zip(back["subsystems"], nvmetcli_sample["subsystems"], strict=True):
        assert got["nqn"] == want["nqn"] and got["allowed_hosts"] == want["allowed_hosts"]
        for key in ("allow_any_host", "serial", "model", "version"):
            assert got["attr"][key] == want["attr"][key]
        assert len(got["namespaces"]) == len(want["namespaces"])
        for gns, wns in zip(got["namespaces"], want["namespaces"], strict=True):
            assert gns["nsid"] == wns["nsid"] and gns["enable"] == wns["enable"]
            assert gns["device"]["path"] == wns["device"]["path"]
            assert gns["device"]["uuid"] == wns["device"]["uuid"]
            if any(c not in "0-" for c in wns["device"]["nguid"]):
                assert gns["device"]["nguid"] == wns["device"]["nguid"]
            else:
                assert "nguid" not in gns["device"]
    io_port, disc_port = back["ports"]
    assert io_port["addr"] == {
        "adrfam": "ipv4",
        "traddr": "192.168.122.33",
        "treq": "not specified",
        "trsvcid": "4420",
        "trtype": "tcp",
    }
    assert io_port["portid"] == 1 and disc_port["portid"] == 2
    assert io_port["param"] == {"inline_data_size": "16384"}
    assert sorted(io_port["subsystems"]) == sorted(nvmetcli_sample["ports"][0]["subsystems"])
    assert disc_port["subsystems"] == []
    assert disc_port["referrals"][0]["addr"] == nvmetcli_sample["ports"][1]["referrals"][0]["addr"]
    # and back again: the same configuration
    again = import_nvmetcli(json.loads(json.dumps(back)))
    assert dict(again) == dict(ours)


def test_nvmetcli_inline_data_size_is_taken_as_nvmet_takes_it(nvmetcli_sample):
    ports = nvmetcli_sample["ports"]
    ports[0]["param"]["inline_data_size"] = "-1"      # nvmet's "the transport's default"
    ports[1]["param"]["inline_data_size"] = "100004"  # not in 16-byte units: what IOCCSZ would advertise
    out = import_nvmetcli(nvmetcli_sample)
    assert "inline_data_size" not in out["listeners"][0]
    assert out["listeners"][1]["inline_data_size"] == 100000
    assert "param inline_data_size 100004 taken as 100000" in "\n".join(out.warnings)
    validate_config(out)


def test_export_warns_about_what_nvmetcli_cannot_hold(tmp_path):
    disk = tmp_path / "d.img"
    disk.write_bytes(bytes(8192))
    config = {
        "version": 1,
        "subsystems": [
            {
                "nqn": SUB,
                "serial": "s",
                "hosts": [],
                "allow_any_host": True,
                "namespaces": [
                    {"nsid": 1, "backend": "ram", "size": 1 << 20},
                    {
                        "nsid": 2,
                        "backend": "file",
                        "path": str(disk),
                        "eui64": "0011223344556677",
                        "read_only": True,
                        "block_size": 4096 if os.stat(disk).st_blksize >= 4096 else 512,
                    },
                    {"nsid": 3, "backend": "null", "size": 1 << 20},
                ],
            }
        ],
        "listeners": [],
        "referrals": [{"trtype": "tcp", "traddr": "10.0.0.9", "trsvcid": 4420, "subnqn": SUB}],
    }
    out = export_nvmetcli(config)
    assert [ns["nsid"] for ns in out["subsystems"][0]["namespaces"]] == [2]
    text = "\n".join(out.warnings)
    assert f"namespace 1 of {SUB}: ram backend has no nvmetcli equivalent" in text
    assert f"namespace 3 of {SUB}: null backend has no nvmetcli equivalent" in text
    assert "EUI-64 values are not part of the nvmetcli format" in text
    assert "no read-only namespaces" in text
    assert "only refers to discovery subsystems" in text
    assert "with no listener they are left out" in text
    assert "block size" not in text  # it matches what the kernel would pick
    with pytest.raises(ConfigError, match="unknown key"):
        export_nvmetcli({"version": 1, "subsystems": [{"nqn": SUB, "bogus": 1}]})


def test_import_rejects_non_object_and_skips_incomplete():
    with pytest.raises(ConfigError, match="top level must be an object"):
        import_nvmetcli([])
    out = import_nvmetcli(
        {
            "subsystems": [
                {"attr": {}},
                {
                    "nqn": SUB,
                    "passthru": [{"device": {"path": "/dev/nvme0"}}],
                    "namespaces": [{"device": {}, "nsid": 1}, {"device": {"path": "/x"}}],
                },
            ],
            "ports": [{"addr": {"trtype": "tcp", "traddr": "10.0.0.1"}, "portid": 1}],
        }
    )
    text = "\n".join(out.warnings)
    assert "subsystems[0]: no 'nqn', skipped" in text
    assert "passthru controllers are not supported" in text
    assert "namespaces[0] (nsid 1): no device path, skipped" in text
    assert "namespaces[1]: no 'nsid', skipped" in text
    assert "ports[0]: incomplete address" in text
    assert out["subsystems"][0]["namespaces"] == [] and out["listeners"] == []
    assert configmod.CONFIG_VERSION == out["version"] == 1
