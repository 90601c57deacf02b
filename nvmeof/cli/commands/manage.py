"""Management subcommands: a client of the REST API that `nvmeof serve` runs.

One command per API call, grouped like the resources: ``nvmeof subsystem|ns|host|listener|referral|
controller|config ...``. Every command takes ``--api URL|unix:PATH`` (env NVMEOF_API), ``--token``
(env NVMEOF_API_TOKEN) and ``-o json`` (or ``--json``). Without them the endpoint and the token come from the files
`nvmeof serve` writes in its state directory (NVMEOF_STATE_DIR, else /var/lib/nvmeof for root, else
~/.local/share/nvmeof): ``api-endpoint`` and ``api-token`` (mode 0600, so only that user and root
can read it). The file's token is sent only to the endpoint recorded next to it, and never printed.
Exit codes: 0 success, 1 the API refused (its message is printed), 2 usage error, 3 the API could
not be reached.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import click

from nvmeof import defaults
from nvmeof.spec.logs import ANA_STATE_NAMES
from nvmeof.uri import parse_address
from target import schema
from target.backends import KINDS

from ..render import OUTPUT_FORMATS, wants_json
from .common import echo_json, format_size, parse_size, table

if TYPE_CHECKING:
    import httpx

DEFAULT_API = f"http://{defaults.LISTEN_ADDRESS}:{defaults.API_PORT}"
EXIT_API_ERROR = 1
EXIT_UNREACHABLE = 3
TIMEOUT = 60.0  # opening or creating a large file namespace takes a while


def _range(field: schema.IntField) -> click.IntRange:
    """A field's range (target/schema.py, the one the API and the service check) as a click type."""
    return click.IntRange(field.low, field.high)


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ApiUnreachable(Exception):
    def __init__(self, url: str, reason: str) -> None:
        super().__init__(reason)
        self.url = url
        self.reason = reason


def make_http_client(base_url: str, headers: dict[str, str]) -> httpx.Client:
    """The HTTP client every command uses; tests replace it to point at an in-process app.
    ``unix:PATH`` speaks HTTP over that Unix socket."""
    import httpx  # imported when a management command runs, so `nvmeof serve` and host commands don't need it

    if base_url.startswith("unix:"):
        return httpx.Client(base_url="http://localhost", headers=headers, timeout=TIMEOUT,
                            transport=httpx.HTTPTransport(uds=base_url[5:]))
    return httpx.Client(base_url=base_url, headers=headers, timeout=TIMEOUT)


def _read_state_file(path: Path) -> tuple[str | None, str | None]:
    """(content, None), or (None, why not) for a missing or unreadable file."""
    try:
        return path.read_text(encoding="utf-8").strip() or None, None
    except FileNotFoundError:
        return None, f"there is no {path}"
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror} (run as the user that started `nvmeof serve`, or root)"


def _same_endpoint(a: str, b: str) -> bool:
    return a.rstrip("/").lower() == b.rstrip("/").lower()


def resolve_endpoint(api_url: str | None, token: str | None) -> tuple[str, str | None, str]:
    """The API URL, the token and, for a 401, where the token came from (or why there is none).

    A token read from the state directory goes only to the endpoint recorded next to it: pointing
    --api at another machine must not hand it this machine's token."""
    state = Path(defaults.state_dir())
    token_file = state / defaults.API_TOKEN_FILE
    recorded, _ = _read_state_file(state / defaults.API_ENDPOINT_FILE)
    url = api_url or recorded or DEFAULT_API
    if token:
        return url, token, "the token given with --token or NVMEOF_API_TOKEN"
    if recorded is not None and not _same_endpoint(url, recorded):
        return url, None, (f"the token in {token_file} belongs to {recorded}, not {url}, so it was not sent; "
                           "pass --token or set NVMEOF_API_TOKEN")
    file_token, token_problem = _read_state_file(token_file)
    if file_token is None:
        return url, None, (f"no token: none given with --token or NVMEOF_API_TOKEN, and {token_problem}; "
                           "set NVMEOF_STATE_DIR "
                           "to the --state-dir of `nvmeof serve` if it uses another one")
    return url, file_token, f"the token read from {token_file}"


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):  # request validation: name each field and what is wrong with it
        parts = []
        for item in detail:
            loc = [str(p) for p in item.get("loc", ()) if p not in ("body", "path", "query")]
            parts.append(f"{'.'.join(loc) or 'request'}: {item.get('msg', item)}")
        return "; ".join(parts)
    return json.dumps(body)


class Api:
    def __init__(self, url: str, token: str | None, token_source: str = "") -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.token_source = token_source or "pass --token or set NVMEOF_API_TOKEN"

    def call(self, method: str, path: str, *, json_body: Any = None, params: dict[str, Any] | None = None) -> Any:
        import httpx

        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            # httpx logs every request at INFO, which is the command line's default level.
            logging.getLogger("httpx").setLevel(logging.WARNING)
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            with make_http_client(self.url, headers) as client:
                response = client.request(method, path, json=json_body, params=params)
        except httpx.TransportError as exc:
            raise ApiUnreachable(self.url, str(exc) or type(exc).__name__) from None
        if response.status_code >= 400:
            message = _detail(response)
            if response.status_code == 401:
                message += f" [client: {self.token_source}]"
            raise ApiError(response.status_code, message)
        if response.status_code == 204 or not response.content:
            return None
        return response.json()


def _disconnected(result: Any) -> int | None:
    """The controller count a revoking DELETE answers (None from a daemon that answers 204)."""
    return result.get("disconnected") if isinstance(result, dict) else None


def _disconnected_note(count: int | None) -> str:
    if count is None:
        return ""
    return f" ({count} controller{'' if count == 1 else 's'} disconnected)"


def _nqn(nqn: str) -> str:
    # NQNs carry ':' (legal in a path segment, but encoded so every proxy passes it unchanged).
    return quote(nqn, safe="")


def api_command(group: click.Group, name: str | None = None, **kwargs: Any) -> Callable:
    """Register a subcommand with the shared connection options and error-to-exit-code mapping.

    The wrapped function receives ``api`` (an :class:`Api`) and ``as_json`` first: true for ``-o json``
    (nvme-cli's -o/--output-format) or its older spelling ``--json``.
    """

    def decorate(func: Callable) -> click.Command:
        @click.option("--json", "as_json", is_flag=True, help="Same as -o json.")
        @click.option("-o", "--output-format", "output_format", type=click.Choice(OUTPUT_FORMATS), default="normal",
                      show_default=True, help="normal text, or json: the API's JSON answer.")
        @click.option("--token", envvar="NVMEOF_API_TOKEN", metavar="TOKEN", show_envvar=True,
                      help="Bearer token of the API. Default: the api-token file `nvmeof serve` wrote in its "
                           "state directory (NVMEOF_STATE_DIR).")
        @click.option("--api", "api_url", envvar="NVMEOF_API", show_envvar=True, metavar="URL|unix:PATH",
                      help="Where `nvmeof serve` runs its REST API. Default: the api-endpoint file in its state "
                           f"directory, else {DEFAULT_API}.")
        @functools.wraps(func)
        def command(api_url: str | None, token: str | None, output_format: str, as_json: bool,
                    **params: Any) -> None:
            api = Api(*resolve_endpoint(api_url, token))
            try:
                func(api, wants_json(output_format, as_json), **params)
            except ApiError as exc:
                click.echo(f"error: {exc.message}", err=True)
                sys.exit(EXIT_API_ERROR)
            except ApiUnreachable as exc:
                click.echo(
                    f"error: cannot reach the nvmeof API at {exc.url}: {exc.reason}\n"
                    "Start the target with `nvmeof serve`, or point --api (or NVMEOF_API) at where it runs.",
                    err=True,
                )
                sys.exit(EXIT_UNREACHABLE)

        return group.command(name, **kwargs)(command)

    return decorate


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


# -- subsystems -------------------------------------------------------------------------------------


@click.group()
def subsystem() -> None:
    """Create, list, show and delete NVM subsystems."""


@api_command(subsystem, "add")
@click.argument("nqn", required=False)
@click.option("--serial", help="Serial number (up to 20 ASCII characters); generated if omitted.")
@click.option("--model", default=defaults.MODEL, show_default=True, help="Model number (up to 40 characters).")
@click.option("--allow-any-host/--no-allow-any-host", default=None,
              help="Let any host connect (the default when no --host is given).")
@click.option("--host", "hosts", multiple=True, metavar="HOSTNQN", help="Allowed host NQN (repeatable).")
@click.option("--max-namespaces", type=_range(schema.MAX_NAMESPACES), default=defaults.MAX_NAMESPACES,
              show_default=True)
@click.option("--dhchap-hash", "dhchap_hash", multiple=True, metavar="HASH[,HASH]",
              help="DH-HMAC-CHAP hashes its hosts may use, in order of preference (default: all).")
@click.option("--dhchap-dhgroup", "dhchap_dhgroup", multiple=True, metavar="GROUP[,GROUP]",
              help="DH-HMAC-CHAP DH groups its hosts may use, in order of preference (default: all, null included).")
def subsystem_add(api: Api, as_json: bool, nqn, serial, model, allow_any_host, hosts, max_namespaces,
                  dhchap_hash, dhchap_dhgroup) -> None:
    """Create a subsystem; NQN is generated (UUID form) when omitted."""
    body = {"nqn": nqn, "serial": serial, "model": model, "allow_any_host": allow_any_host,
            "hosts": list(hosts), "max_namespaces": max_namespaces}
    if _names(dhchap_hash):
        body["dhchap_hash"] = _names(dhchap_hash)
    if _names(dhchap_dhgroup):
        body["dhchap_dhgroup"] = _names(dhchap_dhgroup)
    sub = api.call("POST", "/api/v1/subsystems", json_body=body)
    if as_json:
        echo_json(sub)
    else:
        click.echo(f"created subsystem {sub['nqn']} (serial {sub['serial']})")


def _hosts_column(sub: dict[str, Any]) -> str:
    return "any" if sub["allow_any_host"] else (", ".join(sub["hosts"]) or "none")


@api_command(subsystem, "list")
def subsystem_list(api: Api, as_json: bool) -> None:
    """List subsystems."""
    subs = api.call("GET", "/api/v1/subsystems")
    if as_json:
        echo_json(subs)
        return
    rows = [(s["nqn"], len(s["namespaces"]), _hosts_column(s), s["serial"], s["model"]) for s in subs]
    click.echo(table(("NQN", "NAMESPACES", "HOSTS", "SERIAL", "MODEL"), rows))


@api_command(subsystem, "show")
@click.argument("nqn")
def subsystem_show(api: Api, as_json: bool, nqn: str) -> None:
    """Show one subsystem with its namespaces and hosts."""
    sub = api.call("GET", f"/api/v1/subsystems/{_nqn(nqn)}")
    if as_json:
        echo_json(sub)
        return
    for key in ("nqn", "serial", "model", "max_namespaces"):
        click.echo(f"{key + ':':<16}{sub[key]}")
    click.echo(f"{'hosts:':<16}{_hosts_column(sub)}")
    click.echo(f"{'dhchap hash:':<16}{','.join(sub.get('dhchap_hash') or []) or 'all'}")
    click.echo(f"{'dhchap dhgroup:':<16}{','.join(sub.get('dhchap_dhgroup') or []) or 'all'}")
    click.echo()
    click.echo(_namespace_table(sub["namespaces"]))


@api_command(subsystem, "set-dhchap")
@click.argument("nqn")
@click.option("--dhchap-hash", "dhchap_hash", multiple=True, metavar="HASH[,HASH]",
              help="Allowed hashes in order of preference: sha256, sha384, sha512.")
@click.option("--dhchap-dhgroup", "dhchap_dhgroup", multiple=True, metavar="GROUP[,GROUP]",
              help="Allowed DH groups in order of preference: null, ffdhe2048 ... ffdhe8192.")
@click.option("--all-hashes", is_flag=True, help="Allow every hash again.")
@click.option("--all-dhgroups", is_flag=True, help="Allow every DH group again.")
def subsystem_set_dhchap(api: Api, as_json: bool, nqn: str, dhchap_hash, dhchap_dhgroup, all_hashes: bool,
                         all_dhgroups: bool) -> None:
    """Set the DH-HMAC-CHAP hashes and DH groups of NQN, for its hosts that name none of their own."""
    body: dict[str, Any] = {}
    if _names(dhchap_hash) or all_hashes:
        body["dhchap_hash"] = None if all_hashes else _names(dhchap_hash)
    if _names(dhchap_dhgroup) or all_dhgroups:
        body["dhchap_dhgroup"] = None if all_dhgroups else _names(dhchap_dhgroup)
    if not body:
        raise click.UsageError("nothing to change: give --dhchap-hash, --dhchap-dhgroup, --all-hashes or "
                               "--all-dhgroups")
    sub = api.call("PATCH", f"/api/v1/subsystems/{_nqn(nqn)}/dhchap", json_body=body)
    if as_json:
        echo_json(sub)
    else:
        click.echo(f"{nqn}: hashes {','.join(sub.get('dhchap_hash') or []) or 'all'}, "
                   f"DH groups {','.join(sub.get('dhchap_dhgroup') or []) or 'all'}")


@api_command(subsystem, "del")
@click.argument("nqn")
@click.option("--force", is_flag=True, help="Also remove its namespaces and disconnect its hosts.")
def subsystem_del(api: Api, as_json: bool, nqn: str, force: bool) -> None:
    """Delete a subsystem (refused while it has namespaces, unless --force); its hosts are disconnected."""
    result = api.call("DELETE", f"/api/v1/subsystems/{_nqn(nqn)}", params={"force": str(force).lower()})
    count = _disconnected(result)
    if as_json:
        echo_json({"deleted": nqn, "disconnected": count})
    else:
        click.echo(f"deleted subsystem {nqn}{_disconnected_note(count)}")


# -- namespaces -------------------------------------------------------------------------------------


@click.group()
def ns() -> None:
    """Add, list, resize, enable, disable and remove namespaces of a subsystem; choose which hosts see them."""


def _namespace_table(namespaces: list[dict[str, Any]]) -> str:
    rows = [
        (n["nsid"], n["backend"], n["path"] or "-", format_size(n["size"]), n["block_size"],
         _yes(n["enabled"]), _yes(n["read_only"]), _visible_to(n), _qos_words(n.get("qos")), n["uuid"])
        for n in namespaces
    ]
    return table(("NSID", "BACKEND", "PATH", "SIZE", "BLOCK", "ENABLED", "RO", "VISIBLE TO", "QOS", "UUID"), rows)


def _visible_to(n: dict[str, Any]) -> str:
    if n.get("auto_visible", True):
        return "all hosts"
    return ", ".join(n.get("hosts") or []) or "no host"


_QOS_UNITS = (("rw_ios_per_second", "IOPS"), ("rw_mbytes_per_second", "MiB/s"),
              ("r_mbytes_per_second", "MiB/s read"), ("w_mbytes_per_second", "MiB/s write"))


def _qos_words(qos: dict[str, Any] | None, unlimited: str = "-") -> str:
    """QoS limits in one cell: "200 IOPS, 10 MiB/s (+1 host)"; ``unlimited`` when there are none."""
    qos = qos or {}
    words = ", ".join(f"{qos[key]} {unit}" for key, unit in _QOS_UNITS if qos.get(key))
    hosts = len(qos.get("hosts") or {})
    per_host = f"{hosts} host{'s' if hosts > 1 else ''}"
    if not words:
        return f"limits for {per_host}" if hosts else unlimited
    return words + (f" (+{per_host})" if hosts else "")


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _ns_path(nqn: str, nsid: int | None = None, action: str = "") -> str:
    path = f"/api/v1/subsystems/{_nqn(nqn)}/namespaces"
    if nsid is not None:
        path += f"/{nsid}"
    return path + (f"/{action}" if action else "")


@api_command(ns, "add")
@click.argument("nqn")
@click.option("--backend", type=click.Choice(list(KINDS)),
              help="Storage: 'file' when --path is given, 'rbd' with --pool/--image, else 'ram'.")
@click.option("--path", help="Absolute path of a file under a backing directory of the daemon (nvmeof serve "
                             "--backing-dir), or of a block device it allows (file backend).")
@click.option("--size", callback=_size, metavar="SIZE", help="Bytes, or with K/M/G/T (ram, null, --create).")
@click.option("--block-size", type=click.Choice(["512", "4096"]), default="512", show_default=True)
@click.option("--nsid", type=_range(schema.NSID), help="Namespace ID; the lowest free one if omitted.")
@click.option("--uuid", "ns_uuid", help="Namespace UUID; generated if omitted.")
@click.option("--nguid", help="32 hexadecimal digits; generated if omitted.")
@click.option("--eui64", help="16 hexadecimal digits; generated if omitted.")
@click.option("--read-only", is_flag=True)
@click.option("--disabled", is_flag=True, help="Add it detached; enable it later.")
@click.option("--create", is_flag=True, help="Create the file (or RBD image) with --size if it does not exist, "
                                             "or grow a shorter one to it; without it the storage is never changed.")
@click.option("--anagrpid", type=_range(schema.ANAGRPID), default=defaults.DEFAULT_ANAGRPID,
              show_default=True, help="ANA group: hosts with native multipath choose paths by its state per listener.")
@click.option("--no-auto-visible", is_flag=True,
              help="Visible only to the hosts given with --host (and added later with `ns host add`), not to every "
                   "allowed host.")
@click.option("--host", "hosts", multiple=True, metavar="HOSTNQN",
              help="A host that sees the namespace (with --no-auto-visible; repeatable).")
@click.option("--pool", help="RBD pool (rbd backend).")
@click.option("--image", help="RBD image in --pool (rbd backend).")
@click.option("--rbd-namespace", help="RADOS namespace of the image (rbd backend).")
@click.option("--ceph-conf", help="Ceph configuration file, one the daemon allows (nvmeof serve --ceph-conf).")
@click.option("--ceph-id", help="Ceph client id, e.g. 'admin' for client.admin (rbd backend).")
@click.option("--ceph-keyring", help="Ceph keyring, one the daemon allows (nvmeof serve --ceph-keyring).")
def ns_add(api: Api, as_json: bool, nqn, backend, path, size, block_size, nsid, ns_uuid, nguid, eui64,
           read_only, disabled, create, anagrpid, no_auto_visible, hosts, **rbd) -> None:
    """Add a namespace to subsystem NQN."""
    if hosts and not no_auto_visible:
        raise click.UsageError("--host lists the hosts of a namespace made with --no-auto-visible")
    if backend is None:
        backend = "file" if path else "rbd" if rbd["pool"] or rbd["image"] else "ram"
    body = {
        "backend": backend, "path": path, "size": size,
        "block_size": int(block_size), "nsid": nsid, "uuid": ns_uuid, "nguid": nguid, "eui64": eui64,
        "read_only": read_only, "enabled": not disabled, "create": create, "anagrpid": anagrpid, **rbd,
    }
    if no_auto_visible:
        body.update({"auto_visible": False, "hosts": list(hosts)})
    created = api.call("POST", _ns_path(nqn), json_body={k: v for k, v in body.items() if v is not None})
    if as_json:
        echo_json(created)
    else:
        click.echo(f"added namespace {created['nsid']} to {nqn}: {created['backend']} "
                   f"{format_size(created['size'])}, uuid {created['uuid']}")


@api_command(ns, "list")
@click.argument("nqn")
def ns_list(api: Api, as_json: bool, nqn: str) -> None:
    """List the namespaces of subsystem NQN."""
    namespaces = api.call("GET", _ns_path(nqn))
    if as_json:
        echo_json(namespaces)
    else:
        click.echo(_namespace_table(namespaces))


@api_command(ns, "show")
@click.argument("nqn")
@click.argument("nsid", type=_range(schema.NSID))
def ns_show(api: Api, as_json: bool, nqn: str, nsid: int) -> None:
    """Show one namespace and its I/O statistics."""
    namespace = api.call("GET", _ns_path(nqn, nsid))
    stats = api.call("GET", _ns_path(nqn, nsid, "stats"))
    if as_json:
        echo_json({**namespace, "stats": stats})
        return
    for key, value in namespace.items():
        click.echo(f"{key + ':':<18}{'-' if value is None else value}")
    for key, value in stats.items():
        click.echo(f"{key + ':':<18}{value}")


@api_command(ns, "resize")
@click.argument("nqn")
@click.argument("nsid", type=_range(schema.NSID))
@click.argument("size", callback=_size)
@click.option("--allow-shrink", is_flag=True,
              help="Allow a smaller SIZE: hosts lose the namespace's tail (its file is cut if it covered it all).")
def ns_resize(api: Api, as_json: bool, nqn: str, nsid: int, size: int, allow_shrink: bool) -> None:
    """Change the capacity of a namespace to SIZE (connected hosts are told). A file namespace grows
    its file past its end; shrinking needs --allow-shrink."""
    body: dict[str, Any] = {"size": size}
    if allow_shrink:
        body["allow_shrink"] = True
    resized = api.call("POST", _ns_path(nqn, nsid, "resize"), json_body=body)
    if as_json:
        echo_json(resized)
    else:
        click.echo(f"namespace {nsid} of {nqn} is now {format_size(resized['size'])} "
                   f"({resized['blocks']} blocks of {resized['block_size']} bytes)")


def _ns_state(action: str) -> Callable:
    @api_command(ns, action)
    @click.argument("nqn")
    @click.argument("nsid", type=_range(schema.NSID))
    def change(api: Api, as_json: bool, nqn: str, nsid: int) -> None:
        result = api.call("POST", _ns_path(nqn, nsid, action))
        if as_json:
            echo_json(result)
        else:
            click.echo(f"namespace {nsid} of {nqn} {action}d")

    change.help = f"{action.capitalize()} a namespace (hosts see it {'appear' if action == 'enable' else 'go'})."
    return change


ns_enable = _ns_state("enable")
ns_disable = _ns_state("disable")


@api_command(ns, "set-anagrpid")
@click.argument("nqn")
@click.argument("nsid", type=_range(schema.NSID))
@click.argument("anagrpid", type=_range(schema.ANAGRPID))
def ns_set_anagrpid(api: Api, as_json: bool, nqn: str, nsid: int, anagrpid: int) -> None:
    """Move a namespace to ANA group ANAGRPID (connected hosts are told and re-read the ANA log)."""
    result = api.call("PUT", _ns_path(nqn, nsid, "anagrpid"), json_body={"anagrpid": anagrpid})
    if as_json:
        echo_json(result)
    else:
        click.echo(f"namespace {nsid} of {nqn} is in ANA group {result['anagrpid']}")


@api_command(ns, "set-auto-visible")
@click.argument("nqn")
@click.argument("nsid", type=_range(schema.NSID))
@click.argument("setting", type=click.Choice(["on", "off"]))
def ns_set_auto_visible(api: Api, as_json: bool, nqn: str, nsid: int, setting: str) -> None:
    """Show a namespace to every allowed host (on; its host list is dropped) or only to the hosts added with
    `ns host add` (off). Connected hosts whose view changes are told."""
    result = api.call("PUT", _ns_path(nqn, nsid, "auto_visible"), json_body={"auto_visible": setting == "on"})
    _echo_visibility(as_json, result, nqn, nsid)


def _echo_visibility(as_json: bool, result: dict[str, Any], nqn: str, nsid: int) -> None:
    if as_json:
        echo_json(result)
    else:
        click.echo(f"namespace {nsid} of {nqn} is visible to {_visible_to(result)}")


@ns.group("host")
def ns_host() -> None:
    """Which hosts see a namespace made with --no-auto-visible (masking)."""


@api_command(ns_host, "add")
@click.argument("nqn")
@click.argument("nsid", type=_range(schema.NSID))
@click.argument("hostnqn")
def ns_host_add(api: Api, as_json: bool, nqn: str, nsid: int, hostnqn: str) -> None:
    """Make namespace NSID of NQN visible to HOSTNQN (a host allowed on the subsystem)."""
    result = api.call("POST", _ns_path(nqn, nsid, "hosts"), json_body={"hostnqn": hostnqn})
    _echo_visibility(as_json, result, nqn, nsid)


@api_command(ns_host, "remove")
@click.argument("nqn")
@click.argument("nsid", type=_range(schema.NSID))
@click.argument("hostnqn")
def ns_host_remove(api: Api, as_json: bool, nqn: str, nsid: int, hostnqn: str) -> None:
    """Hide namespace NSID of NQN from HOSTNQN again."""
    result = api.call("DELETE", _ns_path(nqn, nsid, f"hosts/{_nqn(hostnqn)}"))
    _echo_visibility(as_json, result, nqn, nsid)


@api_command(ns, "set-qos")
@click.argument("nqn")
@click.argument("nsid", type=_range(schema.NSID))
@click.option("--rw-ios-per-second", type=_range(schema.QOS_IOS),
              help="Read and write commands per second (0: unlimited).")
@click.option("--rw-mbytes-per-second", type=_range(schema.QOS_MBYTES),
              help="Read plus written MiB per second (0: unlimited).")
@click.option("--r-mbytes-per-second", type=_range(schema.QOS_MBYTES),
              help="Read MiB per second (0: unlimited).")
@click.option("--w-mbytes-per-second", type=_range(schema.QOS_MBYTES),
              help="Written MiB per second (0: unlimited).")
@click.option("--host", "hostnqn", help="Limit this host (NQN) on the namespace instead of the whole namespace.")
def ns_set_qos(api: Api, as_json: bool, nqn: str, nsid: int, hostnqn: str | None, **limits: int | None) -> None:
    """Set QoS limits of a namespace (or of one host on it): commands past a limit wait, none fails.
    Limits not given stay as they are; 0 removes one."""
    body: dict[str, Any] = {key: value for key, value in limits.items() if value is not None}
    if not body:
        raise click.UsageError("give at least one limit (--rw-ios-per-second, --rw-mbytes-per-second, ...)")
    if hostnqn is not None:
        body["host"] = hostnqn
    result = api.call("PUT", _ns_path(nqn, nsid, "qos"), json_body=body)
    if as_json:
        echo_json(result)
        return
    qos = result.get("qos") or {}
    if hostnqn is not None:
        host_qos = (qos.get("hosts") or {}).get(hostnqn)
        click.echo(f"namespace {nsid} of {nqn}, host {hostnqn}: QoS {_qos_words(host_qos, 'unlimited')}")
    else:
        own = {k: v for k, v in qos.items() if k != "hosts"}
        click.echo(f"namespace {nsid} of {nqn}: QoS {_qos_words(own, 'unlimited')}")


@api_command(ns, "reservations")
@click.argument("nqn")
@click.argument("nsid", type=_range(schema.NSID))
def ns_reservations(api: Api, as_json: bool, nqn: str, nsid: int) -> None:
    """Show a namespace's persistent reservation: holder, type, registrants (keys redacted), generation."""
    resv = api.call("GET", _ns_path(nqn, nsid, "reservations"))
    if as_json:
        echo_json(resv)
        return
    if not resv["supported"]:
        click.echo("reservations: not served by this target (serve --workers)")
        return
    click.echo(f"{'generation:':<14}{resv['generation']}")
    click.echo(f"{'type:':<14}{resv['type']}" + (f" ({resv['rtype']})" if resv["rtype"] else ""))
    holder = "every registrant" if resv["all_registrants_hold"] else (resv["holder"] or "-")
    click.echo(f"{'holder:':<14}{holder}")
    click.echo(f"{'ptpl:':<14}{_yes(resv['ptpl'])}")
    if not resv["registrants"]:
        click.echo("registrants:  none")
        return
    rows = [(r["hostid"], _yes(r["holds"]), r["rkey"], ", ".join(r["hostnqns"]) or "-") for r in resv["registrants"]]
    click.echo(table(("HOSTID", "HOLDS", "KEY", "HOST NQN"), rows))


@api_command(ns, "del")
@click.argument("nqn")
@click.argument("nsid", type=_range(schema.NSID))
def ns_del(api: Api, as_json: bool, nqn: str, nsid: int) -> None:
    """Remove a namespace (its file is kept)."""
    api.call("DELETE", _ns_path(nqn, nsid))
    if as_json:
        echo_json({"deleted": {"subnqn": nqn, "nsid": nsid}})
    else:
        click.echo(f"removed namespace {nsid} from {nqn}")


# -- hosts ------------------------------------------------------------------------------------------


@click.group()
def host() -> None:
    """Allow or deny host NQNs on a subsystem, and set their DH-HMAC-CHAP keys."""


def _names(values: tuple[str, ...]) -> list[str] | None:
    """--dhchap-hash/--dhchap-dhgroup: repeatable, each may be a comma-separated list."""
    names = [part.strip() for value in values for part in value.split(",") if part.strip()]
    return names or None


def _dhchap_options(func: Callable) -> Callable:
    for decorator in reversed((
        click.option("--dhchap-key", metavar="DHHC-1:NN:...:",
                     help="The host's DH-HMAC-CHAP secret (`nvme gen-dhchap-key` / `nvmeof gen-dhchap-key`); the "
                          "host must then authenticate every queue. Never printed back."),
        click.option("--dhchap-ctrl-key", metavar="DHHC-1:NN:...:",
                     help="The controller's secret, for bidirectional authentication (needs --dhchap-key)."),
        click.option("--dhchap-hash", "dhchap_hash", multiple=True, metavar="HASH[,HASH]",
                     help="Allowed hashes in order of preference: sha256, sha384, sha512 (default: the subsystem's, "
                          "all unless set)."),
        click.option("--dhchap-dhgroup", "dhchap_dhgroup", multiple=True, metavar="GROUP[,GROUP]",
                     help="Allowed DH groups in order of preference: null, ffdhe2048 ... ffdhe8192 (default: the "
                          "subsystem's, all unless set)."),
    )):
        func = decorator(func)
    return func


def _auth_summary(entry: dict[str, Any]) -> tuple[str, str, str, str, str]:
    tls = _yes(entry.get("tls_key", False)) + (" (compat)" if entry.get("tls_compat") else "")
    return (_yes(entry.get("dhchap_key", False)), _yes(entry.get("dhchap_ctrl_key", False)),
            ",".join(entry.get("dhchap_hash") or []) or "default",
            ",".join(entry.get("dhchap_dhgroup") or []) or "default", tls)


_TLS_COMPAT_HELP = ("Derive the host's TLS PSK for identities without a digest (NVMe0R..) the way libnvme's compat "
                    "functions do: for a Linux host whose key nvme-cli 2.13 / libnvme 1.13 inserted (gen-tls-key or "
                    "check-tls-key --insert). Off by default (RFC 8446).")


def _tls_key_option(func: Callable) -> Callable:
    func = click.option("--tls-compat/--no-tls-compat", "tls_compat", default=None, help=_TLS_COMPAT_HELP)(func)
    return click.option("--tls-key", metavar="NVMeTLSkey-1:NN:...:",
                        help="The host's NVMe/TCP TLS PSK on this subsystem (`nvme gen-tls-key` / `nvmeof "
                             "gen-tls-key`), for listeners with --tls optional|required. Never printed back.")(func)


@api_command(host, "allow")
@click.argument("nqn")
@click.argument("hostnqn")
@_dhchap_options
@_tls_key_option
def host_allow(api: Api, as_json: bool, nqn: str, hostnqn: str, dhchap_key: str | None, dhchap_ctrl_key: str | None,
               dhchap_hash: tuple[str, ...], dhchap_dhgroup: tuple[str, ...], tls_key: str | None,
               tls_compat: bool | None) -> None:
    """Let HOSTNQN connect to subsystem NQN (the subsystem must not allow any host); with --dhchap-key it
    must authenticate (DH-HMAC-CHAP), with --tls-key it may connect over TLS."""
    body: dict[str, Any] = {"hostnqn": hostnqn}
    for key, value in (("dhchap_key", dhchap_key), ("dhchap_ctrl_key", dhchap_ctrl_key),
                       ("dhchap_hash", _names(dhchap_hash)), ("dhchap_dhgroup", _names(dhchap_dhgroup)),
                       ("tls_key", tls_key), ("tls_compat", tls_compat)):
        if value is not None:
            body[key] = value
    result = api.call("POST", f"/api/v1/subsystems/{_nqn(nqn)}/hosts", json_body=body)
    if as_json:
        echo_json(result)
    else:
        how = " after DH-HMAC-CHAP authentication" if dhchap_key else ""
        how += " (TLS PSK set{})".format(", compat derivation" if tls_compat else "") if tls_key else ""
        click.echo(f"host {hostnqn} may connect to {nqn}{how}")


host.add_command(host_allow, "add")   # `host add` as SPDK's nvmf_subsystem_add_host / the issue spell it


@api_command(host, "set-key")
@click.argument("nqn")
@click.argument("hostnqn")
@_dhchap_options
@click.option("--no-dhchap-ctrl-key", is_flag=True, help="Remove the controller key (back to unidirectional).")
@_tls_key_option
@click.option("--no-tls-key", is_flag=True, help="Remove the host's TLS PSK.")
def host_set_key(api: Api, as_json: bool, nqn: str, hostnqn: str, dhchap_key: str | None,
                 dhchap_ctrl_key: str | None, dhchap_hash: tuple[str, ...], dhchap_dhgroup: tuple[str, ...],
                 no_dhchap_ctrl_key: bool, tls_key: str | None, no_tls_key: bool, tls_compat: bool | None) -> None:
    """Set or rotate the DH-HMAC-CHAP keys (and lists) and the TLS PSK of allowed host HOSTNQN on NQN; options not
    given stay as they are. Connected controllers keep running; the next authentication uses the new keys."""
    body: dict[str, Any] = {}
    for key, value in (("dhchap_key", dhchap_key), ("dhchap_ctrl_key", dhchap_ctrl_key),
                       ("dhchap_hash", _names(dhchap_hash)), ("dhchap_dhgroup", _names(dhchap_dhgroup)),
                       ("tls_key", tls_key), ("tls_compat", tls_compat)):
        if value is not None:
            body[key] = value
    if no_tls_key:
        if tls_key:
            raise click.UsageError("give --tls-key or --no-tls-key, not both")
        body["tls_key"] = None
    if no_dhchap_ctrl_key:
        if dhchap_ctrl_key:
            raise click.UsageError("give --dhchap-ctrl-key or --no-dhchap-ctrl-key, not both")
        body["dhchap_ctrl_key"] = None
    if not body:
        raise click.UsageError("nothing to change: give --dhchap-key, --dhchap-ctrl-key, --no-dhchap-ctrl-key, "
                               "--dhchap-hash, --dhchap-dhgroup, --tls-key, --no-tls-key or --[no-]tls-compat")
    result = api.call("PATCH", f"/api/v1/subsystems/{_nqn(nqn)}/hosts/{_nqn(hostnqn)}", json_body=body)
    if as_json:
        echo_json(result)
    else:
        click.echo(f"settings of host {hostnqn} on {nqn} updated ({', '.join(sorted(body))}); "
                   "connected controllers keep running, new authentications use them")


host.add_command(host_set_key, "set")   # `host set`: the same command (the settings are more than keys)


@api_command(host, "remove-key")
@click.argument("nqn")
@click.argument("hostnqn")
def host_remove_key(api: Api, as_json: bool, nqn: str, hostnqn: str) -> None:
    """Remove every DH-HMAC-CHAP setting of HOSTNQN on NQN: it stays allowed, its new queues no longer
    authenticate."""
    result = api.call("DELETE", f"/api/v1/subsystems/{_nqn(nqn)}/hosts/{_nqn(hostnqn)}/dhchap")
    if as_json:
        echo_json(result)
    else:
        click.echo(f"host {hostnqn} on {nqn} no longer authenticates")


@api_command(host, "deny")
@click.argument("nqn")
@click.argument("hostnqn")
def host_deny(api: Api, as_json: bool, nqn: str, hostnqn: str) -> None:
    """Remove HOSTNQN from the allowed hosts of NQN and disconnect its controllers there."""
    result = api.call("DELETE", f"/api/v1/subsystems/{_nqn(nqn)}/hosts/{_nqn(hostnqn)}")
    count = _disconnected(result)
    if as_json:
        echo_json({"denied": hostnqn, "subnqn": nqn, "disconnected": count})
    else:
        click.echo(f"host {hostnqn} removed from {nqn}{_disconnected_note(count)}")


@api_command(host, "list")
@click.argument("nqn")
def host_list(api: Api, as_json: bool, nqn: str) -> None:
    """List the hosts allowed on NQN."""
    result = api.call("GET", f"/api/v1/subsystems/{_nqn(nqn)}/hosts")
    if as_json:
        echo_json(result)
    elif result["allow_any_host"]:
        click.echo(f"{nqn} allows any host")
    else:
        entries = {e["hostnqn"]: e for e in result.get("entries") or []}
        rows = [(h, *_auth_summary(entries.get(h, {}))) for h in result["hosts"]]
        click.echo(table(("HOSTNQN", "DHCHAP_KEY", "CTRL_KEY", "HASH", "DHGROUP", "TLS_KEY"), rows))


# -- listeners and referrals ------------------------------------------------------------------------


def _address(default_port: int) -> Callable:
    def convert(ctx: click.Context, param: click.Parameter, value: str):
        try:
            addr = parse_address(value, default_port)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        if addr.trtype not in ("tcp", "rdma"):
            raise click.BadParameter(f"transport {addr.trtype!r} cannot be served over the API; use tcp or rdma")
        return addr

    return convert


def _listener_address(ctx: click.Context, param: click.Parameter, value: str):
    """ADDRESS as `listener add` takes it, or a listener id as the API shows it (tcp:ADDR:PORT)."""
    for trtype in ("tcp", "rdma"):
        if value.startswith(f"{trtype}:") and not value.startswith(f"{trtype}://"):
            value = f"{trtype}://{value[len(trtype) + 1:]}"
    return _address(defaults.TCP_IO_PORT)(ctx, param, value)


def _endpoint_path(resource: str, addr) -> str:
    return f"/api/v1/{resource}/{addr.trtype}/{quote(addr.traddr, safe='')}/{addr.trsvcid}"


def _endpoint_table(items: list[dict[str, Any]], extra: tuple[str, ...]) -> str:
    headers = ("TRTYPE", "ADDRESS", "PORT", "PORTID", *(e.upper() for e in extra))
    rows = [
        (i["trtype"], i["traddr"], i["trsvcid"], i["portid"],
         *(_yes(i[e]) if isinstance(i[e], bool) else i[e] for e in extra))
        for i in items
    ]
    return table(headers, rows)


@click.group()
def listener() -> None:
    """Add, remove and list the addresses the target accepts hosts on."""


@api_command(listener, "add")
@click.argument("address", metavar="[tcp|rdma://]ADDR[:PORT]", callback=_address(defaults.TCP_IO_PORT))
@click.option("--discovery", is_flag=True, help="Serve the discovery subsystem here (usually port 8009).")
@click.option("--portid", type=_range(schema.LISTENER_PORTID), help="Port ID in the discovery log.")
@click.option("--tls", "tls", type=click.Choice(list(defaults.TLS_MODES)), default="none", show_default=True,
              help="NVMe/TCP over TLS 1.3 with PSKs (hosts' keys: host add --tls-key): required, optional "
                   "(TLS or clear) or none.")
@click.option("--inline-data-size", "inline_data_size", type=_range(schema.INLINE_DATA_SIZE),
              default=defaults.IO_INCAPSULE_SIZE, show_default=True,
              help="In-capsule data bytes per command on its I/O queues (nvmetcli's param_inline_data_size; "
                   "Identify IOCCSZ): a multiple of 16; larger writes go by R2T.")
def listener_add(api: Api, as_json: bool, address, discovery: bool, portid: int | None, tls: str,
                 inline_data_size: int) -> None:
    """Start listening on ADDRESS (default port 4420)."""
    body = {"trtype": address.trtype, "traddr": address.traddr, "trsvcid": address.trsvcid,
            "discovery": discovery, "portid": portid, "tls": tls, "inline_data_size": inline_data_size}
    created = api.call("POST", "/api/v1/listeners", json_body=body)
    if as_json:
        echo_json(created)
    else:
        click.echo(f"listening on {created['id']} (port id {created['portid']})")


@api_command(listener, "del")
@click.argument("address", metavar="[tcp|rdma://]ADDR[:PORT]", callback=_address(defaults.TCP_IO_PORT))
def listener_del(api: Api, as_json: bool, address) -> None:
    """Stop listening on ADDRESS; controllers with a queue that came through it are disconnected."""
    result = api.call("DELETE", _endpoint_path("listeners", address))
    count = _disconnected(result)
    if as_json:
        echo_json({"deleted": str(address), "disconnected": count})
    else:
        click.echo(f"stopped listening on {address}{_disconnected_note(count)}")


@api_command(listener, "list")
def listener_list(api: Api, as_json: bool) -> None:
    """List listeners."""
    items = api.call("GET", "/api/v1/listeners")
    if as_json:
        echo_json(items)
    else:
        click.echo(_endpoint_table(items, ("discovery", "tls", "inline_data_size")))


@api_command(listener, "set-ana")
@click.argument("address", metavar="LISTENER", callback=_listener_address)
@click.argument("anagrpid", type=_range(schema.ANAGRPID))
@click.argument("state", type=click.Choice(list(ANA_STATE_NAMES.values()), case_sensitive=False))
def listener_set_ana(api: Api, as_json: bool, address, anagrpid: int, state: str) -> None:
    """Set ANA group ANAGRPID's STATE on LISTENER ([tcp|rdma://]ADDR[:PORT] or its id tcp:ADDR:PORT); hosts
    connected through it are told. I/O to a group inaccessible here fails over to the host's other paths."""
    result = api.call("PUT", f"{_endpoint_path('listeners', address)}/ana/{anagrpid}",
                      json_body={"state": state.lower()})
    if as_json:
        echo_json(result)
    else:
        click.echo(f"ANA group {anagrpid} is {state.lower()} on {result['id']}")


@click.group()
def ana() -> None:
    """Asymmetric Namespace Access: ANA groups and each listener's state per group."""


@api_command(ana, "show")
def ana_show(api: Api, as_json: bool) -> None:
    """Show each ANA group's namespaces and its state on every listener."""
    report = api.call("GET", "/api/v1/ana")
    if as_json:
        echo_json(report)
        return
    groups = {g["anagrpid"]: g["namespaces"] for g in report["groups"]}
    click.echo(table(("ANAGRPID", "NAMESPACES"), [
        (g, ", ".join(f"{m['subnqn']}/{m['nsid']}" for m in members)) for g, members in sorted(groups.items())]))
    rows = [(lst["listener_id"], grp, state) for lst in report["listeners"] if not lst["discovery"]
            for grp, state in sorted(lst["states"].items(), key=lambda kv: int(kv[0]))]
    click.echo("")
    click.echo(table(("LISTENER", "ANAGRPID", "STATE"), rows))


@click.group()
def referral() -> None:
    """Point the discovery log at other discovery controllers."""


@api_command(referral, "add")
@click.argument("address", metavar="[tcp|rdma://]ADDR[:PORT]", callback=_address(defaults.TCP_DISCOVERY_PORT))
@click.option("--subnqn", default=defaults.DISCOVERY_NQN, show_default=True)
@click.option("--portid", type=_range(schema.REFERRAL_PORTID), default=0, show_default=True)
def referral_add(api: Api, as_json: bool, address, subnqn: str, portid: int) -> None:
    """Add a referral to ADDRESS (default port 8009)."""
    body = {"trtype": address.trtype, "traddr": address.traddr, "trsvcid": address.trsvcid,
            "subnqn": subnqn, "portid": portid}
    created = api.call("POST", "/api/v1/referrals", json_body=body)
    if as_json:
        echo_json(created)
    else:
        click.echo(f"referral to {created['id']} added")


@api_command(referral, "del")
@click.argument("address", metavar="[tcp|rdma://]ADDR[:PORT]", callback=_address(defaults.TCP_DISCOVERY_PORT))
def referral_del(api: Api, as_json: bool, address) -> None:
    """Remove the referral to ADDRESS."""
    api.call("DELETE", _endpoint_path("referrals", address))
    if as_json:
        echo_json({"deleted": str(address)})
    else:
        click.echo(f"referral to {address} removed")


@api_command(referral, "list")
def referral_list(api: Api, as_json: bool) -> None:
    """List referrals."""
    items = api.call("GET", "/api/v1/referrals")
    if as_json:
        echo_json(items)
    else:
        click.echo(_endpoint_table(items, ("subnqn",)))


# -- controllers ------------------------------------------------------------------------------------


@click.group()
def controller() -> None:
    """List connected hosts' controllers, or disconnect one."""


@api_command(controller, "list")
def controller_list(api: Api, as_json: bool) -> None:
    """List connected controllers."""
    import datetime

    items = api.call("GET", "/api/v1/controllers")
    if as_json:
        echo_json(items)
        return
    rows = [
        (c["cntlid"], c["subnqn"], c["hostnqn"] or "(empty)", c["peer"], c["transport"], len(c["queues"]), c["kato_ms"],
         datetime.datetime.fromtimestamp(c["connected_since"]).isoformat(sep=" ", timespec="seconds"))
        for c in items
    ]
    click.echo(table(("CNTLID", "SUBSYSTEM", "HOSTNQN", "ADDRESS", "TRANSPORT", "QUEUES", "KATO_MS", "SINCE"),
                     rows))


@api_command(controller, "disconnect")
@click.argument("cntlid", type=_range(schema.CNTLID))
def controller_disconnect(api: Api, as_json: bool, cntlid: int) -> None:
    """Tear down controller CNTLID and its queues (the host may reconnect)."""
    api.call("DELETE", f"/api/v1/controllers/{cntlid}")
    if as_json:
        echo_json({"disconnected": cntlid})
    else:
        click.echo(f"controller {cntlid} disconnected")


# -- configuration ----------------------------------------------------------------------------------


@click.group()
def config() -> None:
    """Save, load, import and export the whole target configuration."""


def _read_json(path: Path) -> Any:
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except OSError as exc:
        raise click.BadParameter(f"{path}: {exc.strerror}", param_hint="FILE") from None
    except UnicodeDecodeError:
        raise click.BadParameter(f"{path}: not UTF-8 text", param_hint="FILE") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{path}: line {exc.lineno} column {exc.colno}: {exc.msg}",
                                 param_hint="FILE") from None


def _write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2) + "\n"
    if str(path) == "-":
        click.echo(text, nl=False)
        return
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise click.FileError(str(path), exc.strerror) from None
    click.echo(f"wrote {path}", err=True)


def _report_import(result: dict[str, Any], as_json: bool, what: str) -> None:
    if as_json:
        echo_json(result)
    for warning in result.get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    for error in result["errors"]:
        click.echo(f"error: {error}", err=True)
    if result["errors"]:
        click.echo(f"{what}: {len(result['errors'])} item(s) not applied; the rest was", err=True)
        sys.exit(EXIT_API_ERROR)
    if not as_json:
        click.echo(f"{what}: applied")


FILE = click.Path(dir_okay=False, path_type=Path, allow_dash=True)


@api_command(config, "save")
@click.argument("file", type=FILE, default="-")
def config_save(api: Api, as_json: bool, file: Path) -> None:
    """Write the running configuration to FILE (stdout by default)."""
    _write_json(file, api.call("GET", "/api/v1/config"))


@api_command(config, "load")
@click.argument("file", type=FILE)
def config_load(api: Api, as_json: bool, file: Path) -> None:
    """Apply a configuration saved with `config save` (added to what runs; conflicts are reported)."""
    _report_import(api.call("POST", "/api/v1/config", json_body=_read_json(file)), as_json, f"load {file}")


@api_command(config, "import-nvmetcli")
@click.argument("file", type=FILE)
def config_import_nvmetcli(api: Api, as_json: bool, file: Path) -> None:
    """Apply a Linux kernel target configuration saved by `nvmetcli save`."""
    result = api.call("POST", "/api/v1/config/nvmetcli", json_body=_read_json(file))
    _report_import(result, as_json, f"import {file}")


@api_command(config, "export-nvmetcli")
@click.argument("file", type=FILE, default="-")
def config_export_nvmetcli(api: Api, as_json: bool, file: Path) -> None:
    """Write the running configuration as an `nvmetcli restore` file (stdout by default)."""
    result = api.call("GET", "/api/v1/config/nvmetcli")
    for warning in result["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    _write_json(file, result if as_json else result["nvmetcli"])


@api_command(config, "unrestored")
@click.option("--retry", is_flag=True, help="Try to restore them again (e.g. once a disk is mounted).")
@click.option("--discard", is_flag=True, help="Forget them: the next save drops them from the file.")
def config_unrestored(api: Api, as_json: bool, retry: bool, discard: bool) -> None:
    """List configuration items the daemon could not restore at start (kept in the file), or retry or
    discard them."""
    if retry and discard:
        raise click.UsageError("give at most one of --retry and --discard")
    if retry:
        _report_import(api.call("POST", "/api/v1/config/unrestored/retry"), as_json, "retry")
        return
    if discard:
        api.call("DELETE", "/api/v1/config/unrestored")
        click.echo("discarded the unrestored items", err=True)
        return
    items = api.call("GET", "/api/v1/config/unrestored")
    if as_json:
        echo_json(items)
    elif not items:
        click.echo("everything in the configuration was restored")
    else:
        click.echo(table(["kind", "where", "error"], [[i["kind"], i["where"], i["error"]] for i in items]))


GROUPS = (subsystem, ns, host, listener, referral, controller, config, ana)


def register(cli_group: click.Group) -> None:
    for group in GROUPS:
        if group.name in cli_group.commands:
            raise RuntimeError(f"`nvmeof {group.name}` is registered twice; rename one of them")
        cli_group.add_command(group)
