"""scripts/blktests_target_control.py run as blktests' common/nvme and tests/nvme/rc run it, against a real
`nvmeof serve`; the target's state is read back over its REST API (docs/blktests.md)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid as uuid_mod
from pathlib import Path
from typing import Any

import pytest

import initiator
from nvmeof.auth.secret import generate_secret
from nvmeof.status import NvmeError, Status

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tests.interop.ourtarget import OurTarget, serve_target  # noqa: E402

CONTROL = _REPO / "scripts" / "blktests_target_control.py"
SUBSYSNQN = "nqn.2026-11.io.nvmeof-toolkit:blktests-subsystem-1"
SUBSYS_UUID = "91fdba0d-f87b-4c25-b80f-db7be1418b9e"
HOSTID = "0f01fb42-9f7f-4856-b0b3-51e60b8de349"
HOSTNQN = f"nqn.2014-08.org.nvmexpress:uuid:{HOSTID}"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    with serve_target(tmp_path_factory.mktemp("serve"), size="16M") as t:
        yield t
        t.assert_no_errors()


def _settings(tmp_path: Path, target: OurTarget, **extra: Any) -> dict[str, str]:
    """The environment blktests' `check` would run the program in, with a settings file naming the API."""
    token = target.client.headers["Authorization"].split()[1]
    (tmp_path / "api-token").write_text(token + "\n")
    body = {"api": target.api_url.removesuffix("/api/v1"), "token_file": str(tmp_path / "api-token"),
            "hostnqn": HOSTNQN, "hostid": HOSTID,
            "namespace": {"backend": "ram", "size": 8 << 20, "block_size": 512}, **extra}
    (tmp_path / "settings.json").write_text(json.dumps(body))
    env = dict(os.environ, NVMEOF_BLKTESTS_CONFIG=str(tmp_path / "settings.json"))
    env.pop("NVMEOF_API", None)
    env.pop("NVMEOF_API_TOKEN", None)
    return env


def control(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    # blktests runs "${nvme_target_control}" directly: the shebang picks the interpreter
    return subprocess.run([str(CONTROL), *args], env=env, capture_output=True, text=True, timeout=60, check=False)


def show(env: dict[str, str], what: str) -> str:
    proc = control(env, "config", f"--show-{what}")
    assert proc.returncode == 0, (what, proc.stderr)
    assert proc.stdout.endswith("\n") and proc.stdout.count("\n") == 1, proc.stdout
    return proc.stdout[:-1]


async def _namespace_uuid(target: OurTarget, hostkey: str | None, ctrlkey: str | None) -> str:
    ctrl = initiator.HostController(target.traddr, target.io_port, SUBSYSNQN, hostnqn=HOSTNQN, hostid=HOSTID,
                                    nr_io_queues=1, timeout=10, dhchap_secret=hostkey, dhchap_ctrl_secret=ctrlkey)
    await ctrl.open()
    try:
        uuid = (await ctrl.namespace_descriptors(1))["uuid"]  # what the kernel shows as /sys/block/*/uuid
        return str(uuid_mod.UUID(bytes=bytes(uuid)))
    finally:
        await ctrl.disconnect()


def test_config_prints_what_the_host_connects_with(tmp_path, target):
    env = _settings(tmp_path, target)
    shown = {what: show(env, what) for what in ("blkdev-type", "trtype", "hostnqn", "hostid", "host-traddr",
                                                 "traddr", "trsvid", "subsys-uuid", "subsysnqn")}
    assert shown == {"blkdev-type": "file", "trtype": "tcp", "hostnqn": HOSTNQN, "hostid": HOSTID,
                     "host-traddr": "", "traddr": "127.0.0.1",
                     # the target's own I/O listener, read from the API (not its discovery listener)
                     "trsvid": str(target.io_port), "subsys-uuid": SUBSYS_UUID, "subsysnqn": SUBSYSNQN}


def test_config_settings_override_what_the_api_says(tmp_path, target):
    # a host behind QEMU's user network reaches the target's 127.0.0.1 at 10.0.2.2
    env = _settings(tmp_path, target, traddr="10.0.2.2", trsvcid=4420, subsysnqn="nqn.2026-01.com.example:b",
                    subsys_uuid="00000000-0000-4000-8000-000000000001", blkdev_type="device")
    assert [show(env, w) for w in ("traddr", "trsvid", "subsysnqn", "subsys-uuid", "blkdev-type")] == [
        "10.0.2.2", "4420", "nqn.2026-01.com.example:b", "00000000-0000-4000-8000-000000000001", "device"]


def test_config_without_settings_uses_the_daemons_state_dir(tmp_path, target):
    env = {k: v for k, v in os.environ.items() if k not in ("NVMEOF_API", "NVMEOF_API_TOKEN")}
    env.update(NVMEOF_BLKTESTS_CONFIG="", HOME=str(tmp_path),
               NVMEOF_STATE_DIR=str(target.log_path.parent / "nvmeof-state"))
    assert show(env, "trsvid") == str(target.io_port)


def test_config_refuses_unknown_settings_and_options(tmp_path, target):
    env = _settings(tmp_path, target, trsvid=4420)  # the option's spelling, not the setting's
    proc = control(env, "config", "--show-trtype")
    assert proc.returncode == 2 and "unknown setting(s) trsvid" in proc.stderr
    proc = control(_settings(tmp_path, target), "config", "--show-trtype", "--show-traddr")
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


def test_setup_and_cleanup_as_common_nvme_calls_them(tmp_path, target):
    env = _settings(tmp_path, target)
    hostkey = generate_secret(hmac_id=1, nqn=HOSTNQN)
    ctrlkey = generate_secret(hmac_id=2, nqn=SUBSYSNQN)
    # _nvmet_target_setup's exact arguments; it spells the controller key option --ctrkey
    proc = control(env, "setup", "--subsysnqn", SUBSYSNQN, "--subsys-uuid", SUBSYS_UUID, "--hostnqn", HOSTNQN,
                   "--hostkey", hostkey, "--ctrkey", ctrlkey)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == proc.stderr == ""
    sub = target.api("GET", f"/subsystems/{SUBSYSNQN}")
    assert sub["allow_any_host"] is False and sub["hosts"] == [HOSTNQN]
    assert [(ns["nsid"], ns["uuid"], ns["size"]) for ns in sub["namespaces"]] == [(1, SUBSYS_UUID, 8 << 20)]
    host = target.api("GET", f"/subsystems/{SUBSYSNQN}/hosts/{HOSTNQN}")
    assert host["dhchap_key"] is True and host["dhchap_ctrl_key"] is True
    assert hostkey not in target.log_text() and ctrlkey not in target.log_text()
    # the keys are the ones the host must prove: bidirectional authentication with them works, none is refused
    assert asyncio.run(_namespace_uuid(target, hostkey, ctrlkey)) == SUBSYS_UUID
    with pytest.raises(NvmeError) as refused:
        asyncio.run(_namespace_uuid(target, None, None))
    assert refused.value.status == Status.AUTH_REQUIRED

    proc = control(env, "cleanup", "--subsysnqn", SUBSYSNQN)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    assert SUBSYSNQN not in [s["nqn"] for s in target.api("GET", "/subsystems")]

    # set up again (nvme/061 does while the host reconnects): the same identifiers, so the host keeps its disk
    first = sub["namespaces"][0]
    assert control(env, "setup", "--subsysnqn", SUBSYSNQN, "--subsys-uuid", SUBSYS_UUID,
                   "--hostnqn", HOSTNQN).returncode == 0
    again = target.api("GET", f"/subsystems/{SUBSYSNQN}/namespaces/1")
    assert (again["uuid"], again["nguid"], again["eui64"]) == (first["uuid"], first["nguid"], first["eui64"])
    assert first["nguid"] == SUBSYS_UUID.replace("-", "")
    assert control(env, "cleanup", "--subsysnqn", SUBSYSNQN).returncode == 0


def test_setup_without_keys_and_with_the_documented_ctrlkey_spelling(tmp_path, target):
    env = _settings(tmp_path, target, namespace={"backend": "null", "size": 1 << 20})
    nqn = "nqn.2026-11.io.nvmeof-toolkit:blktests-subsystem-2"
    assert control(env, "setup", "--subsysnqn", nqn, "--subsys-uuid", SUBSYS_UUID, "--hostnqn", HOSTNQN).returncode == 0
    try:
        host = target.api("GET", f"/subsystems/{nqn}/hosts/{HOSTNQN}")
        assert host["dhchap_key"] is False and host["dhchap_ctrl_key"] is False
        assert target.api("GET", f"/subsystems/{nqn}/namespaces/1")["backend"] == "null"
        # a second setup of the same NQN is refused and leaves the first one alone
        again = control(env, "setup", "--subsysnqn", nqn, "--subsys-uuid", SUBSYS_UUID, "--hostnqn", HOSTNQN)
        assert again.returncode == 1 and "already exists" in again.stderr
        assert target.api("GET", f"/subsystems/{nqn}")["hosts"] == [HOSTNQN]
    finally:
        assert control(env, "cleanup", "--subsysnqn", nqn).returncode == 0
    proc = control(env, "setup", "--subsysnqn", nqn, "--subsys-uuid", SUBSYS_UUID, "--hostnqn", HOSTNQN,
                   "--hostkey", generate_secret(nqn=HOSTNQN), "--ctrlkey", generate_secret(nqn=nqn))
    assert proc.returncode == 0, proc.stderr
    assert target.api("GET", f"/subsystems/{nqn}/hosts/{HOSTNQN}")["dhchap_ctrl_key"] is True
    assert control(env, "cleanup", "--subsysnqn", nqn).returncode == 0


def test_failed_setup_leaves_nothing_and_prints_no_secret(tmp_path, target):
    env = _settings(tmp_path, target)
    bad = "DHHC-1:00:" + "A" * 40 + ":"  # the right shape, a wrong CRC-32
    proc = control(env, "setup", "--subsysnqn", SUBSYSNQN, "--subsys-uuid", SUBSYS_UUID, "--hostnqn", HOSTNQN,
                   "--hostkey", bad)
    assert proc.returncode == 1
    assert "/hosts: the API answered 400" in proc.stderr and bad not in proc.stderr + proc.stdout
    assert SUBSYSNQN not in [s["nqn"] for s in target.api("GET", "/subsystems")]
    proc = control(env, "setup", "--subsysnqn", SUBSYSNQN, "--subsys-uuid", "not-a-uuid", "--hostnqn", HOSTNQN)
    assert proc.returncode == 2 and "--subsys-uuid 'not-a-uuid' is not a UUID" in proc.stderr
    proc = control(env, "cleanup", "--subsysnqn", SUBSYSNQN)
    assert proc.returncode == 1 and "answered 404" in proc.stderr


def test_unreachable_api_is_named(tmp_path, target):
    env = _settings(tmp_path, target, api="http://127.0.0.1:9")  # discard port: nothing listens
    proc = control(env, "cleanup", "--subsysnqn", SUBSYSNQN)
    assert proc.returncode == 1 and "cannot reach the target's REST API at http://127.0.0.1:9" in proc.stderr
