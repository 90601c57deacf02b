"""`nvmeof resv-register|resv-acquire|resv-release|resv-report`: NVMe reservations through the Python initiator.

nvme-cli's option names (nvme.c resv_*): --namespace-id, --crkey, --nrkey, --prkey, --rtype, --racqa,
--rrega, --rrela, --iekey, --cptpl, --numd, --eds, --raw-binary, with its short letters where they do not
clash with the connection options. Exit codes as the other host commands (1: the target answered with an
NVMe status such as Reservation Conflict).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Mapping

import click

from nvmeof import defaults
from nvmeof.spec.identify import CTRATT_HOST_ID_128, NSID_MAX
from nvmeof.spec.reservations import (
    ACTION_MASK,
    EXT_HEADER_SIZE,
    HEADER_SIZE,
    RTYPE_NAMES,
    AcquireAction,
    Cptpl,
    RegisterAction,
    ReleaseAction,
    ReservationType,
    parse_report,
)

from .. import render
from .common import echo_json
from .host import _open, connection_options, run_guarded

# Where our letters differ from nvme-cli's (its -n, -t and -a are our -n/--nqn, -t/--transport, -a/--traddr)
NOT_NVME_CLI = ("nvme-cli's -n/--namespace-id is --namespace-id (or --nsid) here; -n is the subsystem NQN, as "
                "-t and -a are the transport and address")


class Key(click.ParamType):
    """A 64-bit reservation key, decimal or 0x hexadecimal as nvme-cli takes it."""

    name = "key"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            number = value
        else:
            try:
                number = int(str(value).strip(), 0)
            except ValueError:
                self.fail(f"{value!r} is not a number (decimal, or hexadecimal with 0x)", param, ctx)
        if not 0 <= number < 1 << 64:
            self.fail(f"{value!r} does not fit 64 bits (0..0xffffffffffffffff)", param, ctx)
        return number


class Code(click.ParamType):
    """A command field given as its number (as nvme-cli takes it) or by name."""

    def __init__(self, field: str, names: Mapping[str, int], top: int) -> None:
        self.name = field
        self.names = dict(names)
        self.top = top

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            number = value
        else:
            text = str(value).strip().lower()
            if text in self.names:
                return self.names[text]
            try:
                number = int(text, 0)
            except ValueError:
                self.fail(f"{value!r} is neither a number nor one of: {', '.join(self.names)}", param, ctx)
        if not 0 <= number <= self.top:
            self.fail(f"{number} is out of range: {self.name} is 0..{self.top}", param, ctx)
        return number

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list:
        from click.shell_completion import CompletionItem

        return [CompletionItem(n) for n in self.names if n.startswith(incomplete)]


def _names(cls: type[enum.IntEnum]) -> dict[str, int]:
    return {m.name.lower().replace("_", "-"): int(m) for m in cls}


RTYPE = Code("rtype", {**{RTYPE_NAMES[t]: int(t) for t in ReservationType}, **_names(ReservationType)}, 0xFF)
RREGA = Code("rrega", _names(RegisterAction), ACTION_MASK)
RACQA = Code("racqa", _names(AcquireAction), ACTION_MASK)
RRELA = Code("rrela", _names(ReleaseAction), ACTION_MASK)
CPTPL = Code("cptpl", _names(Cptpl), 3)
RTYPE_HELP = ("1 write-exclusive, 2 exclusive-access, 3 write-exclusive-registrants-only, 4 "
              "exclusive-access-registrants-only, 5 write-exclusive-all-registrants, 6 "
              "exclusive-access-all-registrants (number or name).")


def _nsid_option(f: Callable) -> Callable:
    return click.option("--namespace-id", "--nsid", "nsid", type=click.IntRange(1, NSID_MAX), default=1,
                        show_default=True, help="Namespace ID (nvme-cli's -n; -n is the subsystem NQN here).")(f)


def _crkey_option(f: Callable) -> Callable:
    return click.option("-c", "--crkey", type=Key(), default=0, show_default=True,
                        help="Current reservation key.")(f)


def _iekey_option(f: Callable) -> Callable:
    return click.option("-i", "--iekey", is_flag=True, help="Ignore the existing reservation key.")(f)


def _done(conn: dict, what: str, nsid: int, fields: dict[str, int]) -> None:
    if conn["as_json"]:
        echo_json({"nsid": nsid, **fields, "result": "success"})
    else:
        click.echo(f"NVME Reservation {what} success")   # nvme-cli's words


async def _call(conn: dict, method: str, nsid: int, **kwargs: object) -> None:
    async with await _open(conn) as ctrl:
        await getattr(ctrl, method)(nsid, **kwargs)


@click.command("resv-register", epilog=NOT_NVME_CLI)
@connection_options(defaults.TCP_IO_PORT)
@_nsid_option
@_crkey_option
@click.option("-k", "--nrkey", type=Key(), default=0, show_default=True, help="New reservation key.")
@click.option("-r", "--rrega", type=RREGA, default="register", show_default=True,
              help="Registration action: 0 register, 1 unregister, 2 replace (number or name).")
@_iekey_option
@click.option("-p", "--cptpl", type=CPTPL, default="no-change", show_default=True,
              help="Change Persist Through Power Loss: 0 no change, 2 clear, 3 set (number or name).")
def resv_register(conn, nsid, crkey, nrkey, rrega, iekey, cptpl) -> None:
    """Register a reservation key on a namespace, unregister it, or replace it (like `nvme resv-register`)."""
    run_guarded(_call(conn, "resv_register", nsid, crkey=crkey, nrkey=nrkey, rrega=rrega, iekey=iekey, cptpl=cptpl))
    _done(conn, "Register", nsid, {"rrega": rrega, "cptpl": cptpl})


@click.command("resv-acquire", epilog=NOT_NVME_CLI + "; --rtype and --racqa have no short form (nvme-cli -t, -a).")
@connection_options(defaults.TCP_IO_PORT)
@_nsid_option
@_crkey_option
@click.option("-p", "--prkey", type=Key(), default=0, show_default=True,
              help="Preempt reservation key: the registrant(s) to preempt.")
@click.option("--rtype", type=RTYPE, required=True, help="Reservation type: " + RTYPE_HELP)
@click.option("--racqa", type=RACQA, default="acquire", show_default=True,
              help="Acquire action: 0 acquire, 1 preempt, 2 preempt-and-abort (number or name).")
@_iekey_option
def resv_acquire(conn, nsid, crkey, prkey, rtype, racqa, iekey) -> None:
    """Acquire or preempt a reservation on a namespace (like `nvme resv-acquire`); another host's
    reservation makes the target answer Reservation Conflict (exit code 1)."""
    run_guarded(_call(conn, "resv_acquire", nsid, crkey=crkey, prkey=prkey, rtype=rtype, racqa=racqa, iekey=iekey))
    _done(conn, "Acquire", nsid, {"rtype": rtype, "racqa": racqa})


@click.command("resv-release", epilog=NOT_NVME_CLI + "; --rtype and --rrela have no short form (nvme-cli -t, -a).")
@connection_options(defaults.TCP_IO_PORT)
@_nsid_option
@_crkey_option
@click.option("--rtype", type=RTYPE, default="0", show_default=True,
              help="The type held (Release must name it; Clear ignores it): " + RTYPE_HELP)
@click.option("--rrela", type=RRELA, default="release", show_default=True,
              help="Release action: 0 release, 1 clear (every registration goes too) (number or name).")
@_iekey_option
def resv_release(conn, nsid, crkey, rtype, rrela, iekey) -> None:
    """Release a reservation, or clear every registration on a namespace (like `nvme resv-release`)."""
    run_guarded(_call(conn, "resv_release", nsid, crkey=crkey, rtype=rtype, rrela=rrela, iekey=iekey))
    _done(conn, "Release", nsid, {"rtype": rtype, "rrela": rrela})


async def _report(conn: dict, nsid: int, numd: int | None, eds: bool) -> tuple[bytes, bool]:
    async with await _open(conn) as ctrl:
        ident = ctrl.identity
        # nvme-cli resv_report: a controller with 128-bit host IDs gets the extended structure
        eds = eds or bool(ident is not None and ident.ctratt & CTRATT_HOST_ID_128)
        size = None if numd is None else (numd + 1) * 4
        return await ctrl.resv_report_raw(nsid, eds=eds, size=size), eds


@click.command("resv-report", epilog=NOT_NVME_CLI + ".")
@connection_options(defaults.TCP_IO_PORT)
@_nsid_option
@click.option("-d", "--numd", type=click.IntRange(0, 0xFFFFFFFF), default=None,
              help="Dwords to transfer, 0's based (default: the header first, then room for every registrant).")
@click.option("-e", "--eds", is_flag=True, help="Extended data structure: 128-bit host IDs (chosen anyway "
              "when Identify Controller CTRATT says the controller uses them, as nvme-cli does).")
@click.option("-b", "--raw-binary", "raw_out", is_flag=True, help="Write the raw data structure to stdout.")
def resv_report(conn, nsid, numd, eds, raw_out) -> None:
    """Show a namespace's reservation status: generation, type, registrants (like `nvme resv-report`).

    -o json prints nvme-cli's fields: gen, rtype, regctl, ptpls and "regctls" (or "regctlext" with the
    extended structure) of cntlid, rcsts, hostid, rkey."""
    data, eds = run_guarded(_report(conn, nsid, numd, eds))
    if raw_out:
        sys.stdout.buffer.write(data)
        return
    try:
        report = parse_report(data, eds=eds)
    except ValueError as e:
        least = (EXT_HEADER_SIZE if eds else HEADER_SIZE) // 4 - 1
        raise click.BadParameter(f"{e}; ask for --numd {least} or more, or use -b", param_hint="--numd") from None
    if conn["as_json"]:
        echo_json(render.resv_report_json(report, eds))
    else:
        click.echo(render.resv_report_text(report, eds), nl=False)


def register(cli: click.Group) -> None:
    for cmd in (resv_register, resv_acquire, resv_release, resv_report):
        cli.add_command(cmd)
