"""The initiator's DH-HMAC-CHAP (issue 13): connect(dhchap_secret=, dhchap_ctrl_secret=) against our target
(loop transport, and once over TCP), refusals, re-authentication, the kernel option string, the CLI,
and that no secret reaches a log line, an exception or the command line's output.
"""

from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner
from raw_pdu import serve

import initiator
from initiator import kernel
from initiator.auth import authenticate_queue
from initiator.controller import HostController
from nvmeof.auth import AuthFailure, ControllerTransaction, DhchapSecret, generate_secret
from nvmeof.cli import cli
from nvmeof.spec.auth import FailureReason
from nvmeof.spec.nvme import Completion, FabricsType
from nvmeof.status import NvmeError, Status
from target.core import Target
from target.service import TargetService

SUBNQN = "nqn.2026-01.com.example:initiator-auth"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:7b0d1c52-1111-4222-8333-944455556666"
KEY = generate_secret(hmac_id=1, nqn=HOSTNQN)
CTRL_KEY = generate_secret(key_len=64, hmac_id=3, nqn=SUBNQN)
WRONG = generate_secret()


async def make_target(**host_auth) -> tuple[Target, TargetService]:
    tgt = Target()
    service = TargetService(tgt)
    auth = {HOSTNQN: {"dhchap_key": KEY, **host_auth}} if host_auth.get("dhchap_key", True) else {}
    await service.add_subsystem(SUBNQN, serial="IAUTH1", allow_any_host=False, hosts=[HOSTNQN], host_auth=auth)
    await service.add_namespace(SUBNQN, backend="ram", size=1 << 20, nsid=1)
    return tgt, service


def loop_connect(tgt: Target, **kwargs):
    return initiator.connect("loop", 0, SUBNQN, hostnqn=HOSTNQN, transport="loop", target=tgt, nr_io_queues=2,
                             **kwargs)


def _no_secret_in(text: str) -> None:
    for secret in (KEY, CTRL_KEY, WRONG):
        body = secret[10:-1]
        assert body not in text and DhchapSecret.parse(secret).key.hex() not in text


# ---- against our target ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bidi"])
async def test_connect_authenticates_every_queue(bidirectional, caplog):
    caplog.set_level(logging.DEBUG)
    tgt, _ = await make_target(**({"dhchap_ctrl_key": CTRL_KEY} if bidirectional else {}))
    try:
        ctrl = await loop_connect(tgt, dhchap_secret=KEY,
                                  dhchap_ctrl_secret=CTRL_KEY if bidirectional else None)
        try:
            assert ctrl.authenticated and len(ctrl.io_queues) == 2
            await ctrl.write(1, 0, b"\xa5" * 512)
            assert bytes(await ctrl.read(1, 0, 1)) == b"\xa5" * 512
        finally:
            await ctrl.disconnect()
    finally:
        await tgt.close()
    assert "authenticated with hash" in caplog.text
    _no_secret_in(caplog.text)


@pytest.mark.parametrize(("dhchap_hash", "dhchap_dhgroup"), [(["sha256"], ["null"]), (["sha384"], ["ffdhe2048"]),
                                                           (["sha512"], ["ffdhe3072"])])
async def test_each_hash_and_group_the_target_allows(dhchap_hash, dhchap_dhgroup):
    tgt, _ = await make_target(dhchap_ctrl_key=CTRL_KEY, dhchap_hash=dhchap_hash, dhchap_dhgroup=dhchap_dhgroup)
    try:
        async with loop_connect(tgt, dhchap_secret=KEY, dhchap_ctrl_secret=CTRL_KEY) as ctrl:
            assert ctrl.authenticated
            assert len(await ctrl.read(1, 0, 1)) == 512
    finally:
        await tgt.close()


async def test_target_requires_authentication_and_no_secret_given():
    tgt, _ = await make_target()
    try:
        with pytest.raises(NvmeError) as info:
            await loop_connect(tgt)
        assert info.value.status == Status.AUTH_REQUIRED
        assert "--dhchap-secret" in str(info.value) and "qid 0" in str(info.value)
    finally:
        await tgt.close()


async def test_wrong_host_key_is_refused(caplog):
    tgt, _ = await make_target()
    try:
        with pytest.raises(AuthFailure) as info:
            await loop_connect(tgt, dhchap_secret=WRONG)
        assert info.value.reason_code == FailureReason.FAILED
        assert "qid 0" in str(info.value) and "Failure1" in str(info.value)
        _no_secret_in(str(info.value) + caplog.text)
        assert not tgt.controllers    # the queue is gone
    finally:
        await tgt.close()


async def test_wrong_controller_key_is_refused_by_the_host(caplog):
    tgt, _ = await make_target(dhchap_ctrl_key=CTRL_KEY)
    try:
        with pytest.raises(AuthFailure, match="controller's response does not match") as info:
            await loop_connect(tgt, dhchap_secret=KEY, dhchap_ctrl_secret=WRONG)
        _no_secret_in(str(info.value) + caplog.text)
    finally:
        await tgt.close()


async def test_bidirectional_against_a_target_without_controller_key():
    tgt, _ = await make_target()
    try:
        with pytest.raises(AuthFailure, match="Failure1"):
            await loop_connect(tgt, dhchap_secret=KEY, dhchap_ctrl_secret=CTRL_KEY)
    finally:
        await tgt.close()


async def test_secret_unused_when_the_target_does_not_ask():
    tgt, service = await make_target()
    await service.clear_host_auth(SUBNQN, HOSTNQN)
    try:
        async with loop_connect(tgt, dhchap_secret=KEY) as ctrl:
            assert not ctrl.authenticated
            assert len(await ctrl.read(1, 0, 1)) == 512
    finally:
        await tgt.close()


async def test_reauthenticate_with_rotated_key():
    tgt, service = await make_target(dhchap_ctrl_key=CTRL_KEY)
    try:
        ctrl = await loop_connect(tgt, dhchap_secret=KEY, dhchap_ctrl_secret=CTRL_KEY)
        try:
            await ctrl.reauthenticate()
            new_key = generate_secret(key_len=48)
            await service.set_host_auth(SUBNQN, HOSTNQN, {"dhchap_key": new_key, "dhchap_ctrl_key": CTRL_KEY})
            await ctrl.reauthenticate(dhchap_secret=new_key)
            assert len(await ctrl.read(1, 0, 1)) == 512
            with pytest.raises(AuthFailure):
                await ctrl.reauthenticate(dhchap_secret=WRONG)
            assert ctrl._closed
        finally:
            await ctrl.disconnect()
    finally:
        await tgt.close()


async def test_sync_and_reconnecting_wrappers_pass_secrets():
    tgt, _ = await make_target()
    try:
        rc = await loop_connect(tgt, dhchap_secret=KEY, reconnect=True)
        try:
            assert rc.controller.authenticated
            await rc.reauthenticate()
        finally:
            await rc.disconnect()
    finally:
        await tgt.close()


async def test_authentication_over_tcp():
    served = await serve(allow_any_host=False, hosts=(HOSTNQN,))
    try:
        subnqn = served.service.list_subsystems()[0].nqn
        await served.service.set_host_auth(subnqn, HOSTNQN, {"dhchap_key": KEY, "dhchap_ctrl_key": CTRL_KEY})
        async with initiator.connect("127.0.0.1", served.port, subnqn, hostnqn=HOSTNQN, nr_io_queues=2,
                                     dhchap_secret=KEY, dhchap_ctrl_secret=CTRL_KEY) as ctrl:
            assert ctrl.authenticated
            assert len(await ctrl.read(1, 0, 1)) == 512
        with pytest.raises(AuthFailure):
            await initiator.connect("127.0.0.1", served.port, subnqn, hostnqn=HOSTNQN, dhchap_secret=WRONG)
    finally:
        await served.target.close()


# ---- the queue driver against ControllerTransaction directly --------------------------------------------

class FakeQueue:
    """Routes Authentication Send/Receive to a ControllerTransaction and records the SQEs."""

    def __init__(self, ctrl: ControllerTransaction, qid: int = 0) -> None:
        self.ctrl = ctrl
        self.qid = qid
        self.sqes: list[bytes] = []

    async def submit(self, cmd, *, data_out=None, data_in=None, timeout=None):
        raw = cmd.to_bytes()
        self.sqes.append(raw)
        assert raw[0] == 0x7F and raw[41:44] == b"\x01\x01\xe9"
        length = int.from_bytes(raw[44:48], "little")
        if raw[4] == FabricsType.AUTH_SEND:
            assert data_out is not None and len(data_out) == length
            self.ctrl.send(bytes(data_out))
        else:
            assert raw[4] == FabricsType.AUTH_RECEIVE and data_in is not None and len(data_in) == length == 4096
            data_in[:] = self.ctrl.receive(length)
        return Completion(0)


def _controller(host_key: str = KEY, ctrl_key: str | None = None) -> ControllerTransaction:
    return ControllerTransaction(subnqn=SUBNQN, hostnqn=HOSTNQN, qid=0, host_secret=DhchapSecret.parse(host_key),
                                 ctrl_secret=DhchapSecret.parse(ctrl_key) if ctrl_key else None,
                                 hashes=(3, 2, 1), dhgroups=(1, 0), seqnum=5)


async def test_queue_driver_sends_failure2_when_the_controller_fails_to_prove_itself():
    q = FakeQueue(_controller(ctrl_key=WRONG))
    with pytest.raises(AuthFailure, match="qname: DH-HMAC-CHAP authentication failed"):
        await authenticate_queue(q, hostnqn=HOSTNQN, subnqn=SUBNQN, host_secret=DhchapSecret.parse(KEY),
                                 ctrl_secret=DhchapSecret.parse(CTRL_KEY), t_id=3, name="qname")
    # Negotiate, Receive, Reply, Receive, Failure2
    assert [raw[4] for raw in q.sqes] == [5, 6, 5, 6, 5]
    assert q.ctrl.state == "failed" and "Failure2" in q.ctrl.failure.message


async def test_queue_driver_reports_an_nvme_status():
    class Refusing(FakeQueue):
        async def submit(self, cmd, **kwargs):
            raise NvmeError(Status.INVALID_FIELD, "Invalid Field in Command")
    with pytest.raises(NvmeError, match="Authentication Send/Receive"):
        await authenticate_queue(Refusing(_controller()), hostnqn=HOSTNQN, subnqn=SUBNQN,
                                 host_secret=DhchapSecret.parse(KEY), ctrl_secret=None, t_id=0, name="q")


# ---- options, kernel string, CLI ------------------------------------------------------------------------

def test_bad_secrets_are_refused_by_option_name():
    with pytest.raises(ValueError, match="dhchap_secret") as info:
        HostController("x", 1, SUBNQN, dhchap_secret=KEY[:-6] + "AAAA:")
    assert KEY[10:-6] not in str(info.value)
    with pytest.raises(ValueError, match="needs dhchap_secret"):
        HostController("x", 1, SUBNQN, dhchap_ctrl_secret=CTRL_KEY)
    with pytest.raises(ValueError, match="dhchap_ctrl_secret"):
        initiator.connect("x", 1, SUBNQN, dhchap_secret=KEY, dhchap_ctrl_secret="DHHC-1:00:xyz:")


def test_kernel_options_carry_secrets_like_nvme_cli():
    opts = kernel.build_options(subnqn=SUBNQN, transport="tcp", traddr="10.0.0.1", trsvcid=4420,
                                hostnqn=HOSTNQN, hostid="7b0d1c52-1111-4222-8333-944455556666",
                                dhchap_secret=KEY, dhchap_ctrl_secret=CTRL_KEY, nr_io_queues=2)
    parts = opts.split(",")
    assert parts.index(f"dhchap_secret={KEY}") == parts.index("hostid=7b0d1c52-1111-4222-8333-944455556666") + 1
    assert parts[parts.index(f"dhchap_secret={KEY}") + 1] == f"dhchap_ctrl_secret={CTRL_KEY}"
    with pytest.raises(kernel.KernelAttachError, match="dhchap_secret") as info:
        kernel.build_options(subnqn=SUBNQN, transport="tcp", traddr="a", trsvcid=1, hostnqn=HOSTNQN, hostid="h",
                             dhchap_secret="DHHC-1:01:" + KEY[10:-5] + ":")
    assert KEY[10:-5] not in str(info.value)
    with pytest.raises(kernel.KernelAttachError, match="needs dhchap_secret"):
        kernel.build_options(subnqn=SUBNQN, transport="tcp", traddr="a", trsvcid=1, hostnqn=HOSTNQN, hostid="h",
                             dhchap_ctrl_secret=CTRL_KEY)


def test_cli_gen_dhchap_key_matches_nvme_cli():
    runner = CliRunner()
    secret = bytes((i * 7 + 1) & 0xFF for i in range(32)).hex()
    res = runner.invoke(cli, ["gen-dhchap-key", "--secret", secret, "--hmac", "1", "--nqn",
                              "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001"])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == "DHHC-1:01:o5h8NUfudrYnLb+UkjLiM53j6rXAyUVJe/Txwxx06rFZU/5k:"
    res = runner.invoke(cli, ["gen-dhchap-key", "-l", "48"])
    assert res.exit_code == 0 and len(DhchapSecret.parse(res.output).key) == 48
    for args, needle in ((["-m", "4"], "HMAC identifier"), (["-m", "1", "-l", "64", "-n", "nqn.x"], "key length"),
                         (["-s", "abc"], "hexadecimal"), (["-s", "00" * 31], "--secret is 31 bytes")):
        res = runner.invoke(cli, ["gen-dhchap-key", *args])
        assert res.exit_code == 2 and needle in res.output, res.output


def test_cli_refuses_a_bad_secret_without_echoing_it():
    bad = KEY[:-8] + "AAAAAAA:"
    res = CliRunner().invoke(cli, ["identify", "-a", "127.0.0.1", "-s", "1", "-n", SUBNQN, "--dhchap-secret", bad])
    assert res.exit_code == 2 and "dhchap-secret" in res.output
    assert bad not in res.output and bad[10:-1] not in res.output


def test_cli_connect_passes_secrets_to_the_kernel(monkeypatch):
    seen = {}

    def fake_connect(traddr, trsvcid, **kwargs):
        seen.update(kwargs)
        return kernel.KernelController("nvme9", 9, 1, SUBNQN, "tcp", traddr, trsvcid, [])
    monkeypatch.setattr(kernel, "connect", fake_connect)
    res = CliRunner().invoke(cli, ["connect", "-n", SUBNQN, "-S", KEY, "-C", CTRL_KEY])
    assert res.exit_code == 0, res.output
    assert seen["dhchap_secret"] == KEY and seen["dhchap_ctrl_secret"] == CTRL_KEY
    _no_secret_in(res.output)
