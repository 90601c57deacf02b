"""nvmeof.verbs.CmEventChannel, the one RDMA CM event loop of both roles (the target's RdmaListener and
the host's RdmaQueue), driven by a fake pyverbs: the real one runs in the VM (tests/interop/test_rdma_transport.py).

The fake channel's fd is one end of a socketpair with a byte per queued event, so the event loop wakes
the reader exactly as the kernel's rdma_cm fd does; reading an event consumes its byte.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import types
from collections.abc import Iterator
from typing import Any

import pytest

from nvmeof import verbs as rv


class _PyverbsError(Exception):
    pass


class _Channel:
    def __init__(self) -> None:
        self.ours, self.fd_end = socket.socketpair()
        self.fd_end.setblocking(False)
        self.queued: collections.deque[int] = collections.deque()
        self.closed = False

    def push(self, *kinds: int) -> None:
        self.queued.extend(kinds)
        self.ours.send(b"e" * len(kinds))

    def close(self) -> None:
        self.closed = True


class _Event:
    acks: list[int] = []

    def __init__(self, channel: _Channel) -> None:
        if not channel.queued:
            raise _PyverbsError("rdma_get_cm_event: EAGAIN")
        channel.fd_end.recv(1)
        self.event_type = channel.queued.popleft()
        self.acked = False

    def event_str(self) -> str:
        return "" if self.acked else f"EVENT_{self.event_type}"

    def ack_cm_event(self) -> None:
        assert not self.acked, "acked twice"
        self.acked = True
        _Event.acks.append(self.event_type)

    def close(self) -> None:   # pyverbs: acks unless already acked
        if not self.acked:
            self.ack_cm_event()


@pytest.fixture
def pv(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    channels: list[_Channel] = []

    def make_channel() -> _Channel:
        channels.append(_Channel())
        return channels[-1]

    monkeypatch.setattr(rv, "cm_channel_fd", lambda channel: channel.fd_end.fileno())
    _Event.acks = []
    yield types.SimpleNamespace(CMEventChannel=make_channel, CMEvent=_Event, PyverbsError=_PyverbsError)
    for ch in channels:
        ch.ours.close()
        ch.fd_end.close()


async def _until(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0)


async def test_events_reach_the_handler_in_order_and_are_acked_once(pv: types.SimpleNamespace,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    seen: list[int] = []

    def on_event(ev: _Event) -> None:
        seen.append(ev.event_type)
        if ev.event_type == 2:
            ev.ack_cm_event()         # a handler that acks first (before destroying the CM id)
        if ev.event_type == 3:
            raise RuntimeError("handler bug")

    cm = rv.CmEventChannel(pv, "listener L1")
    cm.start(on_event)
    with caplog.at_level(logging.ERROR, logger=rv.log.name):
        cm.channel.push(1, 2, 3, 4)
        await asyncio.wait_for(_until(lambda: len(seen) == 4), 5)
    assert seen == [1, 2, 3, 4]       # the failing handler did not stop the loop
    assert _Event.acks == [1, 2, 3, 4]
    assert "listener L1: handling RDMA CM event EVENT_3 failed" in caplog.text
    channel = cm.channel
    cm.close()
    assert channel.closed and cm.channel is None
    cm.close()                        # idempotent


async def test_closing_from_the_handler_stops_reading(pv: types.SimpleNamespace) -> None:
    seen: list[int] = []
    cm = rv.CmEventChannel(pv, "host queue")
    channel = cm.channel

    def on_event(ev: _Event) -> None:
        seen.append(ev.event_type)
        ev.ack_cm_event()
        cm.close()                    # RdmaQueue._break on DISCONNECTED destroys the id and the channel

    cm.start(on_event)
    channel.push(7, 8)
    await asyncio.wait_for(_until(lambda: seen), 5)
    for _ in range(3):
        await asyncio.sleep(0)
    assert seen == [7] and list(channel.queued) == [8] and channel.closed
    assert not asyncio.get_running_loop().remove_reader(channel.fd_end.fileno())   # no reader left behind


async def test_stop_keeps_the_channel_for_close(pv: types.SimpleNamespace) -> None:
    cm = rv.CmEventChannel(pv, "listener")
    cm.start(lambda ev: None)
    cm.stop()
    cm.channel.push(1)
    for _ in range(3):
        await asyncio.sleep(0)
    assert list(cm.channel.queued) == [1] and not cm.channel.closed
    cm.close()


def test_a_channel_whose_fd_cannot_be_found_is_closed(pv: types.SimpleNamespace,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[_Channel] = []
    make = pv.CMEventChannel
    pv.CMEventChannel = lambda: made.append(make()) or made[-1]

    def no_fd(channel: object) -> int:
        raise rv.RdmaUnavailable("cannot find the RDMA CM event channel file descriptor")

    monkeypatch.setattr(rv, "cm_channel_fd", no_fd)
    with pytest.raises(rv.RdmaUnavailable, match="file descriptor"):
        rv.CmEventChannel(pv, "listener")
    assert made[0].closed
