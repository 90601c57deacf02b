"""`nvmeof gateway list`: the gateway group of the target the API belongs to (GET /api/v1/gateway)."""

from __future__ import annotations

import click

from .common import echo_json, table
from .manage import Api, api_command


@click.group()
def gateway() -> None:
    """The gateway group (nvmeof serve --gateway-group): members, ANA group owners and states."""


@api_command(gateway, "list")
def gateway_list(api: Api, as_json: bool) -> None:
    """Show the group's members (index, alive, listeners, controller IDs) and, per ANA group, its owner,
    preferred owner and state on each live member."""
    report = api.call("GET", "/api/v1/gateway")
    if as_json:
        echo_json(report)
        return
    click.echo(f"group {report['group']} (store {report['store']}{'' if report['store_reachable'] else ', UNREACHABLE'}"
               f", lease {report['lease']:g} s, failback {report['failback']}, standby {report['standby']}); "
               f"this gateway: {report['name']}")
    if report.get("not_taking_part"):
        click.echo(f"this gateway takes no part: {report['not_taking_part']}")
    rows = []
    for m in report["members"]:
        listeners = ", ".join(f"{lst['traddr']}:{lst['trsvcid']}" for lst in m["listeners"]) or "-"
        lo, hi = m["cntlid_range"]
        rows.append((m["name"], m["index"], "yes" if m["alive"] else "no", "yes" if m["ready"] else "no",
                     f"{lo}-{hi}", ",".join(str(g) for g in m["owns"]) or "-", listeners))
    click.echo(table(("NAME", "INDEX", "ALIVE", "READY", "CNTLIDS", "OWNS", "LISTENERS"), rows))
    for m in report["members"]:
        if m.get("not_taking_part") and m["name"] != report["name"]:
            click.echo(f"{m['name']} takes no part: {m['not_taking_part']}")
    click.echo("")
    names = [m["name"] for m in report["members"] if m["alive"]]
    rows = [(g["anagrpid"], g["owner"] or "none", g["preferred"] or "-", _fenced(g.get("fenced")),
             *[g["states"].get(name) or "-" for name in names]) for g in report["ana_groups"]]
    click.echo(table(("ANAGRPID", "OWNER", "PREFERRED", "FENCED", *[n.upper() for n in names]), rows))


def _fenced(value: bool | None) -> str:
    """The last takeover here from a dead member: yes (its Ceph clients blocklisted), NO (that failed), -: none."""
    return "-" if value is None else "yes" if value else "NO"


@api_command(gateway, "remove")
@click.argument("name")
def gateway_remove(api: Api, as_json: bool, name: str) -> None:
    """Remove member NAME, gone for good, from the group: it no longer counts among the members that ANA groups
    are spread over, and its index and controller IDs go to the next new member. Refused while it is alive."""
    api.call("DELETE", f"/api/v1/gateway/members/{name}")
    if as_json:
        echo_json({"removed": name})
    else:
        click.echo(f"gateway {name} removed from the group")


def register(cli_group: click.Group) -> None:
    cli_group.add_command(gateway)
