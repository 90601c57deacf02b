"""In-band authentication of one host queue: drive a HostTransaction over Authentication Send/Receive.

Mirrors drivers/nvme/host/auth.c nvme_queue_auth_work: every Receive uses a 4096-byte buffer (the kernel's
CHAP_BUF_SIZE, enough for ffdhe8192); a failure the host detects is reported to the controller with
Failure2 before the error is raised. Secrets never reach a log line or an exception text.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, TypeVar

from initiator import commands as c
from nvmeof.auth import AuthFailure, DhchapSecret, HostTransaction, dhgroup_name, hash_name, next_seqnum
from nvmeof.status import NvmeError
from nvmeof.tls.psk import TlsKey

log = logging.getLogger(__name__)

AUTH_BUFFER_SIZE = 4096    # CHAP_BUF_SIZE


_Key = TypeVar("_Key", DhchapSecret, TlsKey)


def parse_key(option: str, value: str | _Key | None, kind: type[_Key]) -> _Key | None:
    """A key the caller gave as text (DHHC-1 secret, NVMeTLSkey-1 PSK) or already as ``kind``; a bad one is a
    ValueError that names ``option`` and never repeats the value."""
    if value is None or isinstance(value, kind):
        return value
    try:
        return kind.parse(value)
    except ValueError as err:
        raise ValueError(f"{option}: {err}") from None


def parse_secret(option: str, text: str | DhchapSecret | None) -> DhchapSecret | None:
    """A DHHC-1 string (or DhchapSecret) from the caller; ValueError names the option, never the value."""
    return parse_key(option, text, DhchapSecret)


async def authenticate_queue(queue: Any, *, hostnqn: str, subnqn: str, host_secret: DhchapSecret,
                             ctrl_secret: DhchapSecret | None, t_id: int, name: str) -> HostTransaction:
    """Run one DH-HMAC-CHAP transaction on ``queue``; raise AuthFailure (reason named) when it fails."""
    tx = HostTransaction(hostnqn=hostnqn, subnqn=subnqn, qid=queue.qid, host_secret=host_secret,
                         ctrl_secret=ctrl_secret, seqnum=next_seqnum(), t_id=t_id)
    try:
        while True:
            out = tx.next_send()
            if out is not None:
                await queue.submit(c.auth_send(len(out)), data_out=out)
                continue
            if tx.state == "done":
                break
            buf = bytearray(AUTH_BUFFER_SIZE)
            await queue.submit(c.auth_receive(len(buf)), data_in=buf)
            try:
                tx.receive(bytes(buf))
            except AuthFailure as err:
                failure2 = tx.next_send()
                if failure2 is not None:
                    # nvme_queue_auth_work fail2: tell the controller; its answer does not change the outcome
                    with contextlib.suppress(NvmeError, OSError, TimeoutError):
                        await queue.submit(c.auth_send(len(failure2)), data_out=failure2)
                raise AuthFailure(err.reason_code, f"{name}: DH-HMAC-CHAP authentication failed: {err.message}") \
                    from None
    except NvmeError as err:
        raise NvmeError(err.status, f"{name}: DH-HMAC-CHAP authentication failed, the controller answered "
                        f"an Authentication Send/Receive (step {tx.state}) with {err}", dnr=err.dnr, more=err.more,
                        result=err.result) from None
    if queue.qid == 0:
        log.info("%s: authenticated with hash %s, DH group %s%s", name, hash_name(tx.hash_id or 0),
                 dhgroup_name(tx.dhgroup_id or 0), ", controller authenticated" if ctrl_secret else "")
    return tx
