#!/usr/bin/env python3
"""blktests' NVME_TARGET_CONTROL program for a running `nvmeof serve` (docs/blktests.md).

blktests (tests/nvme/rc, common/nvme) calls it instead of writing nvmet's configfs:

    config --show-blkdev-type | --show-trtype | --show-hostnqn | --show-hostid | --show-host-traddr |
           --show-traddr | --show-trsvid | --show-subsys-uuid | --show-subsysnqn
    setup --subsysnqn NQN --subsys-uuid UUID --hostnqn NQN [--hostkey KEY] [--ctrlkey KEY]
    cleanup --subsysnqn NQN

`setup` creates the subsystem (only the given host allowed, with its DH-HMAC-CHAP secrets), and namespace 1
with the given UUID, over the target's REST API; `cleanup` removes the subsystem with its namespaces and
controllers. Nothing but the REST API is used, so the target may run on another machine.

Settings come from a JSON file, $NVMEOF_BLKTESTS_CONFIG (default ~/.config/blktests/nvmeof-target.json, optional);
every key is optional:

    api           the REST API's URL (else $NVMEOF_API, else the api-endpoint file in the state directory)
    token_file    a file holding the API's bearer token (else $NVMEOF_API_TOKEN, else <state dir>/api-token,
                  sent only to the endpoint recorded next to it, as the nvmeof CLI does)
    traddr        the address the host connects to (else the target listener's own address)
    trsvcid       its port (else the target's first TCP I/O listener's)
    trtype        default "tcp"; host_traddr default ""
    hostnqn, hostid   default /etc/nvme/hostnqn and /etc/nvme/hostid (what nvme-cli sends)
    subsysnqn, subsys_uuid   what blktests' tests set up by default
    blkdev_type   what blktests loops over in NVMET_BLKDEV_TYPES (default "file"; the target's namespace is
                  "namespace" below whatever this says, it only names the test condition)
    namespace     the body of the namespace POST (default a RAM disk of 1 GiB, 512-byte blocks); "{subsysnqn}"
                  in a "path" is replaced, so every subsystem gets a file of its own

Secrets given to `setup` are sent to the API only, never printed; error messages have them removed.
Exit status: 0 done, 1 the API refused or could not be reached, 2 bad arguments or settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nvmeof import defaults  # (the repository root is put on the path first)

CONFIG_ENV = "NVMEOF_BLKTESTS_CONFIG"
DEFAULT_CONFIG = "~/.config/blktests/nvmeof-target.json"
API_PREFIX = "/api/v1"
TIMEOUT = 60.0  # creating a large namespace can take a while
NSID = 1  # blktests' def_nsid
# Names under the project's own domain: the target only accepts NQNs of the specification's forms, and
# blktests' own default (blktests-subsystem-1) is not one.
DEFAULTS: dict[str, Any] = {
    "trtype": "tcp",
    "host_traddr": "",
    "subsysnqn": "nqn.2026-11.io.nvmeof-toolkit:blktests-subsystem-1",
    "subsys_uuid": "91fdba0d-f87b-4c25-b80f-db7be1418b9e",  # blktests' def_subsys_uuid
    "blkdev_type": "file",
    "namespace": {"backend": "ram", "size": 1 << 30, "block_size": 512},
}
KNOWN_KEYS = {"api", "token_file", "traddr", "trsvcid", "hostnqn", "hostid", *DEFAULTS}
SHOW = ("blkdev-type", "trtype", "hostnqn", "hostid", "host-traddr", "traddr", "trsvid", "subsys-uuid", "subsysnqn")


class ControlError(Exception):
    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def load_config() -> dict[str, Any]:
    path = Path(os.path.expanduser(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG))
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if os.environ.get(CONFIG_ENV):
            raise ControlError(f"{CONFIG_ENV} names {path}, which does not exist", 2) from None
        loaded = {}
    except (OSError, ValueError) as exc:
        raise ControlError(f"cannot read the settings file {path}: {exc}", 2) from None
    if not isinstance(loaded, dict):
        raise ControlError(f"{path} must hold a JSON object, not {type(loaded).__name__}", 2)
    unknown = sorted(set(loaded) - KNOWN_KEYS)
    if unknown:
        raise ControlError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_KEYS))}",
                           2)
    return {**DEFAULTS, **loaded}


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


class Api:
    """The target's REST API (urllib: this program needs nothing but Python on the blktests machine)."""

    def __init__(self, config: dict[str, Any], secrets: tuple[str, ...] = ()) -> None:
        state = Path(defaults.state_dir())
        recorded = _read(state / defaults.API_ENDPOINT_FILE)
        self.url = (config.get("api") or os.environ.get("NVMEOF_API") or recorded
                    or f"http://{defaults.LISTEN_ADDRESS}:{defaults.API_PORT}").rstrip("/")
        if self.url.startswith("unix:"):
            raise ControlError(f"the API is a Unix socket ({self.url}); give this program its TCP address", 2)
        self.token = None
        if config.get("token_file"):
            self.token = _read(Path(os.path.expanduser(config["token_file"])))
            if self.token is None:
                raise ControlError(f"token_file {config['token_file']} cannot be read or is empty", 2)
        elif os.environ.get("NVMEOF_API_TOKEN"):
            self.token = os.environ["NVMEOF_API_TOKEN"]
        elif recorded is not None and recorded.rstrip("/").lower() == self.url.lower():
            # the state directory's token goes only to the endpoint written next to it
            self.token = _read(state / defaults.API_TOKEN_FILE)
        self.secrets = tuple(s for s in secrets if s)

    def _redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "<secret>")
        return text

    def call(self, method: str, path: str, body: Any = None, *, missing_ok: bool = False) -> Any:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + API_PREFIX + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
                content = response.read()
        except urllib.error.HTTPError as exc:
            if missing_ok and exc.code == 404:
                return None
            raise ControlError(f"{method} {path}: the API answered {exc.code}: "
                               f"{self._redact(_detail(exc.read()))}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ControlError(f"cannot reach the target's REST API at {self.url}: {reason}") from None
        return json.loads(content) if content else None


def _detail(content: bytes) -> str:
    try:
        body = json.loads(content)
    except ValueError:
        return content.decode(errors="replace").strip()
    detail = body.get("detail") if isinstance(body, dict) else body
    if isinstance(detail, list):  # request validation: which field, and why (never its input value)
        return "; ".join(f"{'.'.join(str(p) for p in item.get('loc', ()) if p != 'body')}: {item.get('msg')}"
                         for item in detail if isinstance(item, dict))
    return detail if isinstance(detail, str) else json.dumps(detail)


def _nqn_path(nqn: str) -> str:
    return urllib.parse.quote(nqn, safe="")


def _io_listener(config: dict[str, Any]) -> dict[str, Any]:
    listeners = Api(config).call("GET", "/listeners")
    wanted = [lst for lst in listeners if lst["trtype"] == config["trtype"]]
    # an I/O listener first: a discovery-only port would refuse the subsystem's Connect
    wanted.sort(key=lambda lst: lst["discovery"])
    if not wanted:
        raise ControlError(f"the target has no {config['trtype']} listener; add one or set traddr and trsvcid")
    return wanted[0]


def _host_identity(config: dict[str, Any], key: str) -> str:
    if config.get(key):
        return str(config[key])
    value = _read(Path("/etc/nvme") / key)
    if value is None and key == "hostid":
        hostnqn = _host_identity(config, "hostnqn")
        tail = hostnqn.rpartition(":uuid:")[2]
        try:
            return str(uuid.UUID(tail))
        except ValueError:
            pass
    if value is None:
        raise ControlError(f"no {key}: set it in the settings file or write /etc/nvme/{key}", 2)
    return value


def show(config: dict[str, Any], what: str) -> str:
    if what in ("hostnqn", "hostid"):
        return _host_identity(config, what)
    if what == "traddr":
        if config.get("traddr"):
            return str(config["traddr"])
        traddr = _io_listener(config)["traddr"]
        if traddr in ("0.0.0.0", "::"):
            raise ControlError(f"the target listens on {traddr}; set traddr to an address the host can reach", 2)
        return traddr
    if what == "trsvid":
        return str(config["trsvcid"]) if config.get("trsvcid") else str(_io_listener(config)["trsvcid"])
    return str(config[what.replace("-", "_")])


def namespace_body(config: dict[str, Any], subsysnqn: str, subsys_uuid: str) -> dict[str, Any]:
    body = dict(config["namespace"])
    if isinstance(body.get("path"), str):
        body["path"] = body["path"].replace("{subsysnqn}", subsysnqn)
    # nvmet's setup gives namespace 1 the subsystem UUID as device_uuid; blktests finds the disk by it
    body.update(nsid=NSID, uuid=subsys_uuid)
    # nvmet leaves NGUID and EUI-64 zero, so a cleanup and a new setup (nvme/061) bring back a namespace the
    # reconnecting host recognises; ours would generate new ones ("identifiers changed for nsid 1"), so derive
    # them from the UUID instead
    raw = uuid.UUID(subsys_uuid).bytes
    body.setdefault("nguid", raw.hex())
    body.setdefault("eui64", (defaults.IEEE_OUI + hashlib.sha256(raw).digest()[:5]).hex())
    return body


def setup(config: dict[str, Any], args: argparse.Namespace) -> None:
    try:
        subsys_uuid = str(uuid.UUID(args.subsys_uuid))
    except ValueError:
        raise ControlError(f"--subsys-uuid {args.subsys_uuid!r} is not a UUID", 2) from None
    api = Api(config, secrets=(args.hostkey, args.ctrlkey))
    api.call("POST", "/subsystems", {"nqn": args.subsysnqn, "allow_any_host": False})
    try:
        api.call("POST", f"/subsystems/{_nqn_path(args.subsysnqn)}/namespaces",
                 namespace_body(config, args.subsysnqn, subsys_uuid))
        api.call("POST", f"/subsystems/{_nqn_path(args.subsysnqn)}/hosts",
                 {"hostnqn": args.hostnqn, "dhchap_key": args.hostkey or None,
                  "dhchap_ctrl_key": args.ctrlkey or None})
    except ControlError:
        # all or nothing: a half-made subsystem would make the next setup of this NQN fail too
        api.call("DELETE", f"/subsystems/{_nqn_path(args.subsysnqn)}?force=true", missing_ok=True)
        raise


def cleanup(config: dict[str, Any], args: argparse.Namespace) -> None:
    Api(config).call("DELETE", f"/subsystems/{_nqn_path(args.subsysnqn)}?force=true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blktests_target_control.py", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    cfg = sub.add_parser("config", help="print one setting a host needs", allow_abbrev=False)
    group = cfg.add_mutually_exclusive_group(required=True)
    for name in SHOW:
        group.add_argument(f"--show-{name}", dest="show", action="store_const", const=name)
    st = sub.add_parser("setup", help="create a subsystem for one host", allow_abbrev=False)
    st.add_argument("--subsysnqn", required=True)
    st.add_argument("--subsys-uuid", required=True)
    st.add_argument("--hostnqn", required=True)
    # common/nvme's _nvmet_target_setup spells it --ctrkey when it calls us: both spellings are taken
    st.add_argument("--ctrlkey", "--ctrkey", dest="ctrlkey", default="", metavar="KEY")
    st.add_argument("--hostkey", default="", metavar="KEY")
    cl = sub.add_parser("cleanup", help="remove a subsystem", allow_abbrev=False)
    cl.add_argument("--subsysnqn", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config()
        if args.command == "config":
            print(show(config, args.show))
        elif args.command == "setup":
            setup(config, args)
        else:
            cleanup(config, args)
    except ControlError as exc:
        print(f"{Path(sys.argv[0]).name} {args.command}: {exc}", file=sys.stderr)
        return exc.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
