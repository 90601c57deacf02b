"""The target side of DH-HMAC-CHAP (issue 13): the Connect AUTHREQ bit, the gate, the transaction over
Authentication Send/Receive, failures, stalls, re-authentication and key rotation.

The host is raw: nvmeof.auth.HostTransaction for the messages, tests/target_host.py's TinyHost for the
commands (over the loop transport, and once over TCP), so the target's handling of every byte is what
is tested, not the initiator's.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from raw_pdu import serve, wait_until
from target_host import HOSTNQN, TinyHost, open_loop, open_tcp

from nvmeof.auth import AuthFailure, DhchapSecret, HostTransaction, generate_secret
from nvmeof.spec.auth import CONNECT_AUTHREQ_ATR, AuthId, AuthType, FailureReason
from nvmeof.spec.nvme import AdminOpcode, Command, FabricsType, IoOpcode
from nvmeof.status import Status
from target.core import Target
from target.service import TargetService

SUBNQN = "nqn.2026-01.com.example:auth"
OTHER_HOST = "nqn.2014-08.org.nvmexpress:uuid:99999999-2222-3333-4444-555555555555"
KEY = generate_secret(hmac_id=1, nqn=HOSTNQN)
CTRL_KEY = generate_secret(key_len=48)
AUTH_CDW10 = (0xE9 << 24) | (0x01 << 16) | (0x01 << 8)   # SECP DH-HMAC-CHAP, SPSP1, SPSP0
AL = 4096   # the allocation length the Linux host uses (CHAP_BUF_SIZE)


def auth_send(tl: int, cdw10: int = AUTH_CDW10) -> Command:
    return Command(AdminOpcode.FABRICS, nsid=FabricsType.AUTH_SEND, cdw10=cdw10, cdw11=tl)


def auth_receive(al: int = AL, cdw10: int = AUTH_CDW10) -> Command:
    return Command(AdminOpcode.FABRICS, nsid=FabricsType.AUTH_RECEIVE, cdw10=cdw10, cdw11=al)


async def send_msg(host: TinyHost, data: bytes) -> int:
    return (await host.cmd(auth_send(len(data)), data)).status


async def receive_msg(host: TinyHost, al: int = AL) -> bytes:
    res = await host.cmd(auth_receive(al), read_len=al)
    assert res.status == 0, res
    assert res.data is not None and len(res.data) == al
    return res.data


def host_txn(qid: int, *, key: str = KEY, ctrl_key: str | None = None, t_id: int = 1, seqnum: int = 7,
             **kwargs) -> HostTransaction:
    return HostTransaction(hostnqn=HOSTNQN, subnqn=SUBNQN, qid=qid, host_secret=DhchapSecret.parse(key),
                           ctrl_secret=DhchapSecret.parse(ctrl_key) if ctrl_key else None, seqnum=seqnum,
                           t_id=t_id, **kwargs)


async def authenticate(host: TinyHost, txn: HostTransaction) -> None:
    """Run the host's side to the end; AuthFailure when the controller refuses (or is refused)."""
    for _ in range(8):
        out = txn.next_send()
        if out is not None:
            assert await send_msg(host, out) == 0
            if txn.authenticated:
                return
            continue
        txn.receive(await receive_msg(host))
        if txn.authenticated and txn.next_send() is None:
            return
    raise AssertionError(f"the transaction did not finish: {txn.state}")


async def make(**host_settings) -> tuple[Target, TargetService]:
    tgt = Target()
    service = TargetService(tgt)
    auth = {HOSTNQN: {"dhchap_key": KEY, **host_settings}}
    await service.add_subsystem(SUBNQN, serial="AUTH01", allow_any_host=False, hosts=[HOSTNQN, OTHER_HOST],
                                host_auth=auth)
    await service.add_namespace(SUBNQN, backend="ram", size=1 << 20, nsid=1)
    return tgt, service


@pytest.fixture
async def target():
    tgt, _ = await make()
    yield tgt
    await tgt.close()


async def connect(target: Target, *, qid: int = 0, cntlid: int = 0xFFFF, hostnqn: str = HOSTNQN):
    host = await open_loop(target)
    res = await host.connect(SUBNQN, qid=qid, cntlid=cntlid, hostnqn=hostnqn, sqsize=31 if qid == 0 else 127)
    assert res.status == 0, res
    return host, res.cqe.dw0


async def read_block(host: TinyHost) -> int:
    return (await host.cmd(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=0), read_len=512)).status


def identify_ctrl() -> Command:
    return Command(AdminOpcode.IDENTIFY, cdw10=1)


# ------------------------------------------------------------------------------------ success


async def test_connect_asks_for_authentication_and_nothing_else_passes_before_it(target):
    host, dw0 = await connect(target)
    assert dw0 & CONNECT_AUTHREQ_ATR, f"Connect DW0 {dw0:#x} lacks AUTHREQ.ATR"
    cntlid = dw0 & 0xFFFF
    # nvmet_check_auth_status: AUTH_REQUIRED (with DNR) for anything but the auth commands
    res = await host.prop_get(0x00, size8=True)
    assert res.status == Status.AUTH_REQUIRED and res.cqe.dnr
    assert (await host.cmd(identify_ctrl(), read_len=4096)).status == Status.AUTH_REQUIRED
    await authenticate(host, host_txn(0))
    await host.enable()
    assert (await host.cmd(identify_ctrl(), read_len=4096)).status == 0
    # an I/O queue of the authenticated controller authenticates too, with its own transaction
    io, io_dw0 = await connect(target, qid=1, cntlid=cntlid)
    assert io_dw0 & CONNECT_AUTHREQ_ATR and io_dw0 & 0xFFFF == cntlid
    assert await read_block(io) == Status.AUTH_REQUIRED
    await authenticate(io, host_txn(1, t_id=2))
    assert await read_block(io) == 0
    assert target.controllers[cntlid].queues[1].auth.authenticated


async def test_host_without_a_key_is_not_asked(target):
    host, dw0 = await connect(target, hostnqn=OTHER_HOST)
    assert not dw0 & CONNECT_AUTHREQ_ATR
    await host.enable()
    # nor can it start a transaction: no key is configured for it
    res = await host.cmd(auth_send(8), bytes(8))
    assert res.status == Status.CMD_SEQ_ERROR


@pytest.mark.parametrize("hash_id,dhgroup", [(1, 0), (2, 1), (3, 3)])
async def test_bidirectional_for_each_hash(hash_id, dhgroup):
    tgt, _ = await make(dhchap_ctrl_key=CTRL_KEY)
    try:
        host, dw0 = await connect(tgt)
        txn = host_txn(0, ctrl_key=CTRL_KEY, hashes=(hash_id,), dhgroups=(dhgroup,))
        await authenticate(host, txn)
        assert txn.authenticated and txn.hash_id == hash_id and txn.dhgroup_id == dhgroup
        await host.enable()
        assert tgt.controllers[dw0 & 0xFFFF].queues[0].auth.txn.bidirectional
    finally:
        await tgt.close()


async def test_disconnect_is_allowed_before_authentication(target):
    host, dw0 = await connect(target)
    cntlid = dw0 & 0xFFFF
    await authenticate(host, host_txn(0))
    await host.enable()
    io, _ = await connect(target, qid=1, cntlid=cntlid)
    res = await io.cmd(Command(AdminOpcode.FABRICS, nsid=FabricsType.DISCONNECT))
    assert res.status == 0


# ------------------------------------------------------------------------------------ refusals


def _refusals(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "target.auth" and "authentication refused" in r.getMessage()]


async def test_wrong_key_gets_failure1_and_the_controller_goes(target, caplog):
    caplog.set_level(logging.INFO)
    host, dw0 = await connect(target)
    cntlid = dw0 & 0xFFFF
    wrong = generate_secret()
    with pytest.raises(AuthFailure) as info:
        await authenticate(host, host_txn(0, key=wrong))
    assert info.value.reason_code == FailureReason.FAILED
    await wait_until(lambda: cntlid not in target.controllers, what="the controller to be torn down")
    await asyncio.wait_for(host.lost, 5)
    refusals = _refusals(caplog)
    assert len(refusals) == 1, [r.getMessage() for r in refusals]
    line = refusals[0].getMessage()
    assert HOSTNQN in line and SUBNQN in line and "qid 0" in line and f"cntlid {cntlid}" in line
    text = caplog.text
    for secret in (KEY, wrong, KEY.split(":")[2], wrong.split(":")[2]):
        assert secret not in text


async def test_other_hosts_keep_working_while_one_is_refused(target):
    good, _ = await connect(target, hostnqn=OTHER_HOST)
    await good.enable()
    bad, dw0 = await connect(target)
    with pytest.raises(AuthFailure):
        await authenticate(bad, host_txn(0, key=generate_secret()))
    await wait_until(lambda: (dw0 & 0xFFFF) not in target.controllers, what="the refused controller to go")
    assert (await good.cmd(identify_ctrl(), read_len=4096)).status == 0


@pytest.mark.parametrize("settings,offer,reason", [
    ({"dhchap_hash": ["sha512"]}, {"hashes": (1,)}, FailureReason.HASH_UNUSABLE),
    ({"dhchap_dhgroup": ["ffdhe4096"]}, {"dhgroups": (0, 1)}, FailureReason.DHGROUP_UNUSABLE),
])
async def test_unusable_hash_or_group_is_refused_with_its_reason(settings, offer, reason, caplog):
    tgt, _ = await make(**settings)
    try:
        host, dw0 = await connect(tgt)
        with pytest.raises(AuthFailure) as info:
            await authenticate(host, host_txn(0, **offer))
        assert info.value.reason_code == reason
        await wait_until(lambda: (dw0 & 0xFFFF) not in tgt.controllers, what="teardown")
        assert len(_refusals(caplog)) == 1
    finally:
        await tgt.close()


async def test_subsystem_wide_hash_list_applies_to_hosts_without_their_own():
    tgt, service = await make()
    try:
        await service.set_subsystem_dhchap(SUBNQN, {"dhchap_hash": ["sha384"]})
        host, _ = await connect(tgt)
        txn = host_txn(0)   # offers all three
        await authenticate(host, txn)
        assert txn.hash_id == 2
    finally:
        await tgt.close()


async def _to_reply(host: TinyHost, txn: HostTransaction) -> bytes:
    assert await send_msg(host, txn.next_send()) == 0    # Negotiate
    txn.receive(await receive_msg(host))                  # Challenge
    return txn.next_send()                                # Reply, not sent yet


async def test_truncated_reply_is_refused(target):
    host, dw0 = await connect(target)
    reply = await _to_reply(host, host_txn(0))
    assert await send_msg(host, reply[:20]) == 0      # the command succeeds; the transaction fails
    failure = await receive_msg(host)
    assert failure[0] == AuthType.COMMON and failure[1] == AuthId.FAILURE1
    assert failure[7] == FailureReason.INCORRECT_PAYLOAD
    await wait_until(lambda: (dw0 & 0xFFFF) not in target.controllers, what="teardown")


async def test_replayed_reply_of_an_earlier_transaction_is_refused(target):
    host, dw0 = await connect(target)
    first = host_txn(0, t_id=5)
    reply = await _to_reply(host, first)
    assert await send_msg(host, reply) == 0
    first.receive(await receive_msg(host))
    assert first.authenticated
    # re-authentication: a new challenge, and the old Reply (same t_id) played back to it
    again = host_txn(0, t_id=5)
    await _to_reply(host, again)
    assert await send_msg(host, reply) == 0
    failure = await receive_msg(host)
    assert failure[1] == AuthId.FAILURE1 and failure[7] == FailureReason.FAILED
    await wait_until(lambda: (dw0 & 0xFFFF) not in target.controllers, what="teardown")


async def test_message_out_of_order_tears_down(target, caplog):
    host, dw0 = await connect(target)
    txn = host_txn(0)
    txn.next_send()
    # a Success2 before any Negotiate reached the controller: the kernel's done_failure1 path
    success2 = bytes([AuthType.DHCHAP, AuthId.SUCCESS2, 0, 0, 1, 0, 0, 0]) + bytes(8)
    assert await send_msg(host, success2) == 0
    await wait_until(lambda: (dw0 & 0xFFFF) not in target.controllers, what="teardown")
    assert len(_refusals(caplog)) == 1


async def test_bad_security_protocol_and_empty_transfer_are_invalid_fields(target):
    host, dw0 = await connect(target)
    negotiate = host_txn(0).next_send()
    res = await host.cmd(auth_send(len(negotiate), cdw10=(0xEA << 24) | (1 << 16) | (1 << 8)), negotiate)
    assert res.status == Status.INVALID_FIELD and res.cqe.dnr
    res = await host.cmd(auth_send(len(negotiate), cdw10=(0xE9 << 24) | (2 << 16) | (1 << 8)), negotiate)
    assert res.status == Status.INVALID_FIELD
    res = await host.cmd(auth_receive(0), read_len=0)
    assert res.status == Status.INVALID_FIELD
    # the queue still authenticates afterwards
    await authenticate(host, host_txn(0))
    assert (dw0 & 0xFFFF) in target.controllers


async def test_a_stalled_transaction_times_out(caplog):
    tgt, _ = await make()
    tgt.auth_timeout = 0.2
    try:
        host, dw0 = await connect(tgt)
        txn = host_txn(0)
        assert await send_msg(host, txn.next_send()) == 0     # Negotiate, then the host goes quiet
        await wait_until(lambda: (dw0 & 0xFFFF) not in tgt.controllers, timeout=10, what="the stall timeout")
        line = _refusals(caplog)[0].getMessage()
        assert "stalled" in line and "Challenge" in line and "qid 0" in line
        # a queue that never even started is reaped the same way
        _, dw0 = await connect(tgt)
        await wait_until(lambda: (dw0 & 0xFFFF) not in tgt.controllers, timeout=10, what="the stall timeout")
    finally:
        await tgt.close()


# ------------------------------------------------------------------------- re-authentication, rotation


async def test_host_initiated_reauthentication(target):
    host, dw0 = await connect(target)
    await authenticate(host, host_txn(0, t_id=1))
    await host.enable()
    io, _ = await connect(target, qid=1, cntlid=dw0 & 0xFFFF)
    await authenticate(io, host_txn(1, t_id=2))
    again = host_txn(1, t_id=3)
    assert await send_msg(io, again.next_send()) == 0
    assert await read_block(io) == 0    # the queue keeps serving while it re-authenticates
    again.receive(await receive_msg(io))
    assert await send_msg(io, again.next_send()) == 0
    again.receive(await receive_msg(io))
    assert again.authenticated
    assert await read_block(io) == 0


async def test_key_rotation_keeps_the_controller_and_applies_to_the_next_authentication():
    tgt, service = await make()
    try:
        host, dw0 = await connect(tgt)
        cntlid = dw0 & 0xFFFF
        await authenticate(host, host_txn(0))
        await host.enable()
        io, _ = await connect(tgt, qid=1, cntlid=cntlid)
        await authenticate(io, host_txn(1, t_id=2))
        new_key = generate_secret(key_len=64)
        await service.set_host_auth(SUBNQN, HOSTNQN, {"dhchap_key": new_key})
        assert cntlid in tgt.controllers and await read_block(io) == 0
        # a new queue authenticates with the new key
        io2, _ = await connect(tgt, qid=2, cntlid=cntlid)
        await authenticate(io2, host_txn(2, key=new_key, t_id=3))
        assert await read_block(io2) == 0
        # re-authentication of the admin queue with the new key
        await authenticate(host, host_txn(0, key=new_key, t_id=4))
        assert (await host.cmd(identify_ctrl(), read_len=4096)).status == 0
        # removing the keys: new queues no longer authenticate, live ones keep running
        await service.clear_host_auth(SUBNQN, HOSTNQN)
        io3, dw0_3 = await connect(tgt, qid=3, cntlid=cntlid)
        assert not dw0_3 & CONNECT_AUTHREQ_ATR and await read_block(io3) == 0
        assert await read_block(io) == 0
    finally:
        await tgt.close()


async def test_authentication_over_tcp():
    served = await serve(allow_any_host=False, hosts=(HOSTNQN,))
    try:
        await served.service.set_host_auth(served.service.list_subsystems()[0].nqn, HOSTNQN,
                                           {"dhchap_key": KEY, "dhchap_ctrl_key": CTRL_KEY})
        subnqn = served.service.list_subsystems()[0].nqn
        host = await open_tcp(served.port)
        res = await host.connect(subnqn)
        assert res.status == 0 and res.cqe.dw0 & CONNECT_AUTHREQ_ATR
        txn = HostTransaction(hostnqn=HOSTNQN, subnqn=subnqn, qid=0, host_secret=DhchapSecret.parse(KEY),
                              ctrl_secret=DhchapSecret.parse(CTRL_KEY), seqnum=11, t_id=1, dhgroups=(1,))
        await authenticate(host, txn)
        await host.enable()
        host.close()
    finally:
        await served.target.close()
