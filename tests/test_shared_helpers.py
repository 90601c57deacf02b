"""Helpers that now serve several callers: the Namespace List parser and NSID check (Identify CNS 02h
and the Changed Namespace List log), pyverbs teardown, the CLI's event-loop runner, and the fio
error code / reported results of a benchmark report (JSON and text output alike)."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import types

import pytest

from initiator.bench.jobspec import ConnectSpec, JobSpec
from initiator.bench.results import EILSEQ, EIO, BenchReport, JobResult
from initiator.bench.verify import VerifyError, VerifyResult
from nvmeof import verbs as rv
from nvmeof.cli.commands.common import run_async
from nvmeof.spec.identify import build_active_ns_list, check_nsid, parse_active_ns_list, parse_ns_list
from nvmeof.spec.logs import CHANGED_NS_LIST_OVERFLOW, build_changed_ns_list, parse_changed_ns_list


def _dwords(*values: int) -> bytes:
    return b"".join(v.to_bytes(4, "little") for v in values)


# ---- Namespace List --------------------------------------------------------------------------------

def test_ns_list_stops_at_the_first_zero_and_accepts_short_reads() -> None:
    raw = _dwords(3, 7, 0, 9)
    assert parse_ns_list(raw) == [3, 7]
    assert parse_active_ns_list(memoryview(raw)) == [3, 7]
    assert parse_changed_ns_list(bytearray(raw)) == [3, 7]
    assert parse_ns_list(b"") == []


@pytest.mark.parametrize("size", [5, 4100])
def test_ns_list_errors_name_the_list(size: int) -> None:
    with pytest.raises(ValueError, match=rf"^namespace list must be a multiple of 4 bytes up to 4096, got {size}$"):
        parse_active_ns_list(bytes(size))
    with pytest.raises(ValueError, match=rf"^changed namespace list must be .* got {size}$"):
        parse_changed_ns_list(bytes(size))


def test_builders_round_trip_through_the_shared_parser() -> None:
    assert parse_ns_list(build_active_ns_list([9, 2, 5], start_after=2)) == [5, 9]
    assert parse_ns_list(build_changed_ns_list([9, 2, 9])) == [2, 9]
    assert parse_ns_list(build_changed_ns_list(range(1, 1026))) == [CHANGED_NS_LIST_OVERFLOW]


@pytest.mark.parametrize("bad", [0, 0xFFFFFFFF, -1, "1", 1.0])
def test_nsid_check_is_the_same_for_both_builders(bad: object) -> None:
    msg = rf"^NSID {re.escape(repr(bad))} is outside 1\.\.0xFFFFFFFE$"
    with pytest.raises(ValueError, match=msg):
        check_nsid(bad)
    with pytest.raises(ValueError, match=msg):
        build_active_ns_list([bad], start_after=0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=msg):
        build_changed_ns_list([bad])  # type: ignore[list-item]
    assert check_nsid(1) == 1 and check_nsid(0xFFFFFFFE) == 0xFFFFFFFE


# ---- pyverbs teardown ------------------------------------------------------------------------------

class _Closable:
    def __init__(self, log: list[str], name: str, fail: bool = False) -> None:
        self.log, self.name, self.fail = log, name, fail

    def close(self) -> None:
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} refused")


def test_close_quietly_skips_none_and_goes_on_after_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    closed: list[str] = []
    with caplog.at_level(logging.DEBUG, logger=rv.log.name):
        rv.close_quietly(_Closable(closed, "qp", fail=True), None, _Closable(closed, "channel"))
    assert closed == ["qp", "channel"]
    assert "closing _Closable failed: qp refused" in caplog.text


# ---- CLI event loop --------------------------------------------------------------------------------

async def _answer() -> tuple[int, str]:
    await asyncio.sleep(0)
    return 42, type(asyncio.get_running_loop()).__module__


def test_run_async_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)   # import uvloop -> ImportError
    value, loop_module = run_async(_answer())
    assert value == 42 and loop_module.startswith("asyncio")


def test_run_async_prefers_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    def fake_run(coro: object) -> object:
        calls.append(coro)
        return asyncio.run(coro)  # type: ignore[arg-type]

    monkeypatch.setitem(sys.modules, "uvloop", types.SimpleNamespace(run=fake_run))
    assert run_async(_answer())[0] == 42 and len(calls) == 1


# ---- benchmark report ------------------------------------------------------------------------------

def test_fio_error_codes() -> None:
    clean = JobResult("a")
    failed = JobResult("b", error="connection lost")
    bad = JobResult("c", verify=VerifyResult())
    bad.verify.add(VerifyError(0, 0, 0, "crc32c", "0x0", "0x1"))  # type: ignore[union-attr]
    checked = JobResult("d", verify=VerifyResult(blocks=4))
    assert (clean.fio_error, failed.fio_error, bad.fio_error, checked.fio_error) == (0, EIO, EILSEQ, 0)
    assert (EIO, EILSEQ) == (5, 84)


@pytest.mark.parametrize("group", [False, True])
def test_reported_results_follow_group_reporting(group: bool) -> None:
    results = [JobResult("j", error="x"), JobResult("j")]
    report = BenchReport(JobSpec(numjobs=2, group_reporting=group), ConnectSpec(), results, started=0.0)
    shown = report.reported()
    if group:
        assert len(shown) == 1 and shown[0].jobs == 2 and shown[0].fio_error == EIO
    else:
        assert shown is results
    assert report.failed
    assert not BenchReport(JobSpec(), ConnectSpec(), [JobResult("j")], started=0.0).failed
