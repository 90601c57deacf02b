"""The persisted target configuration (JSON, version 1) and the Linux nvmetcli format.

Our format::

    {"version": 1,
     "backing_dirs": [...], "allow_block_devices": [...],   (optional: where file namespaces may live)
     "ceph_confs": [...], "ceph_keyrings": [...],           (optional: Ceph files RBD namespaces may name)
     "subsystems": [{"nqn", "serial", "model", "allow_any_host", "hosts": [...], "max_namespaces",
                     "dhchap_hash": [...], "dhchap_dhgroup": [...],   (optional; default all)
                     "namespaces": [{"nsid", "backend", "path" | "size", "block_size", "uuid",
                                     "nguid", "eui64", "read_only", "enabled", "anagrpid",
                                     "auto_visible", "hosts" (masking: false + the host NQNs that see it),
                                     "pool", "image", "rbd_namespace", "ceph_conf", "ceph_id", "ceph_keyring"
                                     (rbd), "qos": {"rw_ios_per_second", "rw_mbytes_per_second",
                                     "r_mbytes_per_second", "w_mbytes_per_second",
                                     "hosts": {"<hostnqn>": {the same}}} (only when limited)}]}],
     "listeners": [{"trtype", "adrfam", "traddr", "trsvcid", "portid", "discovery",
                    "ana_states": {"<anagrpid>": "optimized" | "non-optimized" | "inaccessible" | ...}}],
     "referrals": [{"trtype", "adrfam", "traddr", "trsvcid", "subnqn", "portid"}]}

A host is its NQN, or an object ``{"nqn", "dhchap_key", "dhchap_ctrl_key", "dhchap_hash",
"dhchap_dhgroup", "tls_key", "tls_compat"}`` when it authenticates (DH-HMAC-CHAP; target/hostauth.py) or has a
TLS PSK.

Saving is atomic (temp file in the same folder, fsync, rename, fsync the folder), so a crash
leaves either the old or the new file. The file holds host secrets, so it is always written 0600.
Loading checks structure and names every problem;
TargetService checks meaning (valid NQNs, free NSIDs, readable files) when it replays the file.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

from nvmeof import defaults
from nvmeof.spec.logs import ANA_STATE_NAMES, AnaState, parse_ana_state
from target import schema
from target.backends import option_fields
from target.qos import QosError
from target.qos import parse_config as parse_qos

CONFIG_VERSION = 1
CONFIG_FILE_MODE = 0o600

TOP_KEYS = ("version", "subsystems", "listeners", "referrals", "backing_dirs", "allow_block_devices", "ceph_confs",
            "ceph_keyrings")
# Where file namespaces may live and which Ceph client files RBD namespaces may name, added to the
# `nvmeof serve` option (first) when the daemon starts from this file; an import through the API cannot
# add to them (TargetService). Each key maps to that option and to BackingPolicy's argument.
POLICY_KEYS: dict[str, tuple[str, str]] = {
    "backing_dirs": ("--backing-dir", "backing_dirs"),
    "allow_block_devices": ("--allow-block-device", "block_devices"),
    "ceph_confs": ("--ceph-conf", "ceph_confs"),
    "ceph_keyrings": ("--ceph-keyring", "ceph_keyrings"),
}


def policy_path_ok(entry: Any) -> bool:
    """An entry of a POLICY_KEYS list: an absolute path (a NUL cannot be part of one)."""
    return isinstance(entry, str) and os.path.isabs(entry) and "\0" not in entry


# a listener's tls as nvmet's port addr_treq (with addr_tsas "tls1.3" for the two TLS modes)
_NVMET_TREQ = {"none": "not specified", "optional": "not required", "required": "required"}


class ConfigError(Exception):
    """A configuration file that cannot be read, parsed or written; the message names the place."""


def _fields(kind: str) -> dict[str, schema.Field]:
    """The fields a ``kind`` item keeps in the file; a namespace's include every registered backend's
    settings as the kind declares them (the service checks which kind takes which), as registered when the
    item is read."""
    fields = {key: field for key, field in schema.ITEMS[kind].items() if field.in_file}
    if kind == "namespace":
        fields.update(option_fields())
    return fields


def _field_problems(kind: str, item: dict[str, Any], where: str) -> list[str]:
    """What the declarations of a ``kind`` item (target/schema.py) refuse in it: unknown keys, values of
    another JSON type, lists of strings with an element that is none, missing required keys. A secret is
    never echoed."""
    fields = _fields(kind)
    problems = []
    for key, value in item.items():
        field = fields.get(key)
        if field is None:
            problems.append(f"{where}: unknown key {key!r} (a {kind} takes {', '.join(fields)})")
        elif value is None or schema.is_json(field.kind, value):
            continue
        elif field.secret and isinstance(value, bool):
            # never echo the value: it is a secret, or here the presence flag of an API export
            problems.append(f"{where}.{key}: expected a DHHC-1 secret string, got a boolean (an API export shows "
                            "only whether a secret is set; put the secret itself here)")
        else:
            shown = "a secret" if field.secret else repr(value)
            problems.append(f"{where}.{key}: expected {schema.JSON_TYPES[field.kind]}, got {type(value).__name__} "
                            f"{shown}")
    for key, field in fields.items():
        if field.required_in_file and item.get(key) is None:
            problems.append(f"{where}: missing required key {key!r}" + (" (the host NQN)" if kind == "host" else ""))
    for key, field in fields.items():
        value = item.get(key)
        if field.each is not None and isinstance(value, list) and any(not isinstance(v, str) for v in value):
            problems.append(f"{where}.{key}: expected a list of {field.each}")
    return problems


def item_problems(kind: str, item: Any, where: str) -> list[str]:
    """Structural problems of one config item (``kind`` in schema.ITEMS): unknown keys, wrong types,
    missing required keys. Nested namespaces are not checked here."""
    if not isinstance(item, dict):
        return [f"{where}: expected an object, got {type(item).__name__}"]
    problems = _field_problems(kind, item, where)
    if kind == "subsystem":
        # a host is its NQN, or an object with its settings
        for i, host in enumerate(item.get("hosts") or []):
            if isinstance(host, dict):
                problems.extend(_field_problems("host", host, f"{where}.hosts[{i}]"))
            elif not isinstance(host, str):
                problems.append(f"{where}.hosts[{i}]: expected a host NQN string or object, got {host!r}")
    if kind == "namespace" and isinstance(item.get("qos"), dict):
        try:
            parse_qos(item["qos"], f"{where}.qos")
        except QosError as exc:
            problems.append(str(exc))
    if kind == "listener" and isinstance(item.get("ana_states"), dict):
        problems.extend(ana_states_problems(item["ana_states"], f"{where}.ana_states"))
    return problems


_ANAGRPIDS = f"{schema.ANAGRPID.low}..{schema.ANAGRPID.high}"


def _anagrpid_ok(grpid: Any) -> bool:
    """An ANA group id as a JSON key or an nvmetcli dump gives it (digits only, the int's text)."""
    return str(grpid).isdigit() and schema.ANAGRPID.accepts(int(grpid))


def ana_states_problems(states: dict[Any, Any], where: str) -> list[str]:
    """A listener's ``ana_states``: keys are ANA group ids (strings in JSON), values state words."""
    problems = []
    for key, value in states.items():
        if not _anagrpid_ok(key):
            problems.append(f"{where}: key {key!r} is not an ANA group id {_ANAGRPIDS}")
        try:
            schema.check_ana_state(value)
        except schema.SchemaError as exc:
            problems.append(f"{where}[{key!r}]: {exc}")
    return problems


def validate_config(data: Any, source: str = "config") -> dict[str, Any]:
    """Check the structure of a version-1 config; return it with absent lists filled in.

    Raises ConfigError listing every problem, each with its place (``subsystems[0].namespaces[1]``).
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object, got {type(data).__name__}")
    problems: list[str] = []
    if "ports" in data or "hosts" in data:
        problems.append(
            f"{source}: keys 'ports'/'hosts' belong to the Linux nvmetcli format; "
            "convert it with import-nvmetcli instead of loading it directly"
        )
    for key in data:
        if key not in TOP_KEYS and key not in ("ports", "hosts"):
            problems.append(f"{source}: unknown top-level key {key!r} (known: {', '.join(TOP_KEYS)})")
    version = data.get("version")
    if version is None:
        problems.append(f'{source}: missing "version"; add "version": {CONFIG_VERSION}')
    elif version != CONFIG_VERSION:
        problems.append(
            f"{source}: version {version!r} is not supported; this program reads version {CONFIG_VERSION}"
        )
    for key in POLICY_KEYS:
        value = data.get(key, [])
        if not isinstance(value, list):
            problems.append(f"{source}: {key!r} must be a list of absolute paths, got {type(value).__name__}")
            continue
        for i, entry in enumerate(value):
            if not policy_path_ok(entry):
                problems.append(f"{source}: {key}[{i}]: expected an absolute path, got {entry!r}")
    for key in ("subsystems", "listeners", "referrals"):
        value = data.get(key, [])
        if not isinstance(value, list):
            problems.append(f"{source}: {key!r} must be a list, got {type(value).__name__}")
            continue
        kind = key[:-1]
        for i, item in enumerate(value):
            where = f"{key}[{i}]"
            problems.extend(item_problems(kind, item, where))
            if kind == "subsystem" and isinstance(item, dict):
                namespaces = item.get("namespaces") or []
                if isinstance(namespaces, list):
                    for j, ns in enumerate(namespaces):
                        problems.extend(item_problems("namespace", ns, f"{where}.namespaces[{j}]"))
    if problems:
        raise ConfigError("\n".join(problems))
    out = dict(data)
    for key in ("subsystems", "listeners", "referrals"):
        out.setdefault(key, [])
    return out


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such file; check the path or save a configuration there first"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory; give the JSON file inside it") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied; make it readable by this user") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); is this the right file?") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    return validate_config(data, source=path)


def save_config(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically; ConfigError (with the OS reason) if it cannot."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    text = json.dumps(data, indent=2) + "\n"
    # Always 0600, whatever the file had: it carries the hosts' DH-HMAC-CHAP secrets (mkstemp creates
    # the temporary file 0600 too, so the secrets are never readable by others, not even briefly).
    mode = CONFIG_FILE_MODE
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        where = exc.filename or folder
        raise ConfigError(f"cannot save the configuration to {path}: {where}: {exc.strerror or exc}") from exc
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


# --- Linux nvmetcli (configfs dump) format ---------------------------------------------------------


class Converted(dict):
    """A converted configuration (a plain dict to serialise) plus ``warnings``: what did not carry over."""

    def __init__(self, data: dict[str, Any], warnings: list[str]) -> None:
        super().__init__(data)
        self.warnings = warnings


def _kernel_id(raw: bytes) -> str:
    """nvmet configfs prints uuid and nguid with %pUb: 16 bytes as 8-4-4-4-12 hex."""
    return str(uuid.UUID(bytes=raw))


def _parse_kernel_id(text: str, where: str) -> bytes:
    digits = text.replace("-", "").replace(":", "").strip()
    if len(digits) != 32:
        raise ValueError(f"{where}: {text!r} is not 16 bytes of hexadecimal")
    return bytes.fromhex(digits)


def _default_block_size(path: str, warnings: list[str], where: str) -> int:
    """The block size the kernel target presented for ``path``, so the host sees the same LBA size.

    nvmet uses the device's logical block size for a block device and the file system block
    size (at most 4096) for a file.
    """
    try:
        st = os.stat(path)
    except OSError:
        warnings.append(f"{where}: {path} is not present here; assuming 512-byte blocks")
        return 512
    if stat.S_ISBLK(st.st_mode):
        sysfs = f"/sys/dev/block/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}/queue/logical_block_size"
        try:
            with open(sysfs) as f:
                size = int(f.read().strip())
        except (OSError, ValueError):
            return 512
        return 4096 if size >= 4096 else 512
    return 4096 if st.st_blksize >= 4096 else 512


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip() not in ("", "0")
    return bool(value)


# The shape of an nvmetcli dump (nvmet/nvme.py ``dump()``): configfs attribute groups are objects
# of strings; "enable" is an integer; lists hold objects, NQNs are strings. A key that is absent is
# the converter's business (skipped with a warning); a key of the wrong type is an error.
_TEXT = (str,)
_NUMBER = (int, str)  # nvmetcli writes portid/nsid as integers; hand-made files use strings too


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class _Shape:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def expect(self, value: Any, types: tuple[type, ...], where: str, what: str) -> bool:
        if isinstance(value, bool) and bool not in types:
            ok = False
        else:
            ok = isinstance(value, types)
        if not ok:
            self.problems.append(f"{where}: expected {what}, got {_type_name(value)} {value!r}"[:300])
        return ok

    def obj(self, parent: dict[str, Any], key: str, where: str) -> dict[str, Any]:
        """``parent[key]`` when it is an object; {} when absent; a problem otherwise."""
        if key not in parent:
            return {}
        value = parent[key]
        return value if self.expect(value, (dict,), f"{where}.{key}", "an object") else {}

    def objects(self, parent: dict[str, Any], key: str, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """(place, item) for each object of the list ``parent[key]``; problems for anything else,
        in document order as the caller walks on."""
        if key not in parent:
            return
        value = parent[key]
        if not self.expect(value, (list,), f"{where}.{key}" if where else key, "a list"):
            return
        for i, item in enumerate(value):
            place = f"{where}.{key}[{i}]" if where else f"{key}[{i}]"
            if self.expect(item, (dict,), place, "an object"):
                yield place, item

    def strings(self, parent: dict[str, Any], key: str, where: str, what: str) -> None:
        if key not in parent:
            return
        value = parent[key]
        if self.expect(value, (list,), f"{where}.{key}", f"a list of {what}"):
            for i, item in enumerate(value):
                self.expect(item, _TEXT, f"{where}.{key}[{i}]", what)

    def attrs(self, parent: dict[str, Any], key: str, where: str, text: tuple[str, ...] = ()) -> None:
        """A configfs attribute group: an object of strings (numbers pass too); ``text`` names the
        attributes that must be strings."""
        for name, value in self.obj(parent, key, where).items():
            if name in text:
                self.expect(value, _TEXT, f"{where}.{key}.{name}", "a string")
            else:
                self.expect(value, _NUMBER, f"{where}.{key}.{name}", "a string")

    def fields(self, parent: dict[str, Any], where: str, spec: dict[str, tuple[tuple[type, ...], str]]) -> None:
        for key, (types, what) in spec.items():
            if key in parent:
                self.expect(parent[key], types, f"{where}.{key}", what)


_ADDR_TEXT = ("trtype", "adrfam", "traddr", "treq", "tsas")


def _nvmetcli_problems(data: dict[str, Any]) -> list[str]:
    shape = _Shape()
    shape.obj(data, "discovery", "nvmetcli config")
    for where, host in shape.objects(data, "hosts", ""):
        shape.fields(host, where, {"nqn": (_TEXT, "a host NQN string")})
        shape.attrs(host, "dhchap", where, text=("key", "ctrl_key", "hash", "dhgroup"))
        shape.fields(host, where, {f"dhchap_{name}": (_TEXT, "a string") for name in ("key", "ctrl_key", "hash",
                                                                                        "dhgroup")})
    for where, sub in shape.objects(data, "subsystems", ""):
        shape.fields(sub, where, {"nqn": (_TEXT, "an NQN string")})
        shape.attrs(sub, "attr", where)
        shape.strings(sub, "allowed_hosts", where, "host NQN strings")
        for ptwhere, passthru in shape.objects(sub, "passthru", where):
            shape.attrs(passthru, "device", ptwhere, text=("path",))
        for nswhere, ns in shape.objects(sub, "namespaces", where):
            shape.fields(ns, nswhere, {"nsid": ((int,), "an integer"), "enable": (_NUMBER, "0 or 1"),
                                       "ana_grpid": (_NUMBER, "an integer")})
            shape.attrs(ns, "device", nswhere, text=("path", "uuid", "nguid"))
            shape.attrs(ns, "ana", nswhere)
            shape.attrs(ns, "resv", nswhere)
    for where, port in shape.objects(data, "ports", ""):
        shape.fields(port, where, {"portid": (_NUMBER, "a port number")})
        shape.attrs(port, "addr", where, text=_ADDR_TEXT)
        shape.attrs(port, "param", where)
        shape.strings(port, "subsystems", where, "subsystem NQN strings")
        for refwhere, ref in shape.objects(port, "referrals", where):
            shape.fields(ref, refwhere, {"name": (_TEXT, "a string"), "enable": (_NUMBER, "0 or 1")})
            shape.attrs(ref, "addr", refwhere, text=_ADDR_TEXT)
        for anawhere, group in shape.objects(port, "ana_groups", where):
            shape.fields(group, anawhere, {"grpid": (_NUMBER, "an integer")})
            shape.attrs(group, "ana", anawhere)
    return shape.problems


def import_nvmetcli(data: Any) -> Converted:
    """Convert an nvmetcli ``saveconfig`` dump into our version-1 config.

    Each nvmetcli port becomes a listener (a port linked to no subsystem becomes a discovery
    listener); namespaces become file backends on their device path; referrals are collected
    from every port. ``.warnings`` lists what has no equivalent here. A value of the wrong type
    (``"allowed_hosts": 5``) raises ConfigError naming every such place.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"nvmetcli config: the top level must be an object, got {type(data).__name__}")
    problems = _nvmetcli_problems(data)
    if problems:
        raise ConfigError("malformed nvmetcli configuration:\n" + "\n".join(problems))
    warnings: list[str] = []
    host_settings = _import_host_auth(data, warnings)
    subsystems: list[dict[str, Any]] = []
    all_nqns: list[str] = []
    for i, sub in enumerate(data.get("subsystems") or []):
        where = f"subsystems[{i}]"
        if not isinstance(sub, dict) or not isinstance(sub.get("nqn"), str):
            warnings.append(f"{where}: no 'nqn', skipped")
            continue
        attr = sub.get("attr") or {}
        out: dict[str, Any] = {"nqn": sub["nqn"]}
        hosts = [h for h in sub.get("allowed_hosts") or [] if isinstance(h, str)]
        out["allow_any_host"] = _flag(attr.get("allow_any_host", "0" if hosts else "1"))
        out["hosts"] = [dict(host_settings[h], nqn=h) if h in host_settings else h for h in hosts]
        # configfs pads the serial with spaces; nvmetcli strips them, a hand-made dump may not
        if str(attr.get("serial", "")).strip():
            out["serial"] = str(attr["serial"]).strip()
        if str(attr.get("model", "")).strip():
            out["model"] = str(attr["model"]).strip()
        # A kernel built with passthru support gives every subsystem a passthru node, and nvmetcli
        # dumps it; only one with a device behind it is a passthru controller. An unset device_path
        # reads "(null)" (nvmet_passthru_device_path_show prints a NULL string; Debian's 6.12 does).
        if any(str((pt.get("device") or {}).get("path") or "").strip() not in ("", "(null)")
               for pt in sub.get("passthru") or []):
            warnings.append(f"{where} ({sub['nqn']}): passthru controllers are not supported, dropped")
        namespaces = []
        for j, ns in enumerate(sub.get("namespaces") or []):
            nswhere = f"{where}.namespaces[{j}]"
            converted = _import_namespace(ns, nswhere, warnings)
            if converted is not None:
                namespaces.append(converted)
        out["namespaces"] = namespaces
        subsystems.append(out)
        all_nqns.append(sub["nqn"])

    listeners: list[dict[str, Any]] = []
    referrals: list[dict[str, Any]] = []
    seen_referrals: set[tuple[Any, ...]] = set()
    for i, port in enumerate(data.get("ports") or []):
        where = f"ports[{i}]"
        if not isinstance(port, dict):
            warnings.append(f"{where}: not an object, skipped")
            continue
        addr = port.get("addr") or {}
        trtype = addr.get("trtype")
        if trtype not in ("tcp", "rdma"):
            warnings.append(f"{where}: transport {trtype!r} is not served here (tcp and rdma are), skipped")
            continue
        try:
            listener = {
                "trtype": trtype,
                "adrfam": addr.get("adrfam") or "ipv4",
                "traddr": str(addr["traddr"]),
                "trsvcid": int(addr["trsvcid"]),
                "portid": int(port["portid"]),
                "discovery": not port.get("subsystems"),
            }
            # nvmet's addr_tsas "tls1.3" (TLS, required unless addr_treq says "not required")
            if trtype == "tcp" and addr.get("tsas") == "tls1.3":
                listener["tls"] = "optional" if addr.get("treq") == "not required" else "required"
        except (KeyError, TypeError, ValueError) as exc:
            warnings.append(f"{where}: incomplete address ({exc}), skipped")
            continue
        ana_states = _import_ana_groups(port, where, warnings)
        if ana_states:
            listener["ana_states"] = ana_states
        inline = _import_inline_data_size(port, trtype, where, warnings)
        if inline is not None and inline != defaults.IO_INCAPSULE_SIZE:   # ours, as a saved file leaves it out
            listener["inline_data_size"] = inline
        linked = set(port.get("subsystems") or [])
        if linked and linked != set(all_nqns):
            warnings.append(
                f"{where} ({trtype} {listener['traddr']}:{listener['trsvcid']}) exported only "
                f"{', '.join(sorted(linked))}; listeners here serve every subsystem"
            )
        listeners.append(listener)
        for k, ref in enumerate(port.get("referrals") or []):
            refwhere = f"{where}.referrals[{k}]"
            raddr = (ref or {}).get("addr") or {}
            if not _flag(ref.get("enable", 1)):
                warnings.append(f"{refwhere}: disabled referral, skipped")
                continue
            try:
                referral = {
                    "trtype": raddr["trtype"],
                    "adrfam": raddr.get("adrfam") or "ipv4",
                    "traddr": str(raddr["traddr"]),
                    "trsvcid": int(raddr["trsvcid"]),
                    "subnqn": defaults.DISCOVERY_NQN,
                    "portid": int(raddr.get("portid") or 0),
                }
            except (KeyError, TypeError, ValueError) as exc:
                warnings.append(f"{refwhere}: incomplete address ({exc}), skipped")
                continue
            key = (referral["trtype"], referral["traddr"], referral["trsvcid"])
            if key not in seen_referrals:
                seen_referrals.add(key)
                referrals.append(referral)
    return Converted(
        {"version": CONFIG_VERSION, "subsystems": subsystems, "listeners": listeners, "referrals": referrals},
        warnings,
    )


# nvmet configfs hosts/<nqn>/dhchap_{key,ctrl_key,hash,dhgroup}; nvmetcli dumps a configfs attribute
# group by the file names' prefix, so its host object carries {"dhchap": {"key", "ctrl_key", "hash",
# "dhgroup"}}. A hand-made dump may spell them as the files are named ("dhchap_key": ...): read both.
NVMET_DHCHAP_ATTRS = ("key", "ctrl_key", "hash", "dhgroup")
NVMET_DEFAULT_HASH = "hmac(sha256)"   # what configfs shows for a host nobody set a hash for
NVMET_DEFAULT_DHGROUP = "null"


def _import_host_auth(data: dict[str, Any], warnings: list[str]) -> dict[str, dict[str, Any]]:
    """Host NQN -> our host settings, for hosts of the dump that have a DH-HMAC-CHAP key.

    nvmet's dhchap_hash/dhchap_dhgroup name one hash and one group, the controller's preference
    (nvmet_auth_negotiate falls back to what the host offers). The configfs defaults (hmac(sha256),
    null) become our default, every hash and group; a host set to anything else is limited to it."""
    from nvmeof.auth import parse_dhgroup, parse_hash

    out: dict[str, dict[str, Any]] = {}
    for i, host in enumerate(data.get("hosts") or []):
        if not isinstance(host, dict) or not isinstance(host.get("nqn"), str):
            continue
        group = host.get("dhchap") or {}
        attrs = {name: str(group.get(name) or host.get(f"dhchap_{name}") or "").strip() for name in NVMET_DHCHAP_ATTRS}
        if not attrs["key"]:
            if attrs["ctrl_key"]:
                warnings.append(f"hosts[{i}] ({host['nqn']}): a controller key without a host key does nothing in "
                                "nvmet; dropped")
            continue
        settings: dict[str, Any] = {"dhchap_key": attrs["key"]}
        if attrs["ctrl_key"]:
            settings["dhchap_ctrl_key"] = attrs["ctrl_key"]
        for name, default, parse, key in (("hash", NVMET_DEFAULT_HASH, parse_hash, "dhchap_hash"),
                                          ("dhgroup", NVMET_DEFAULT_DHGROUP, parse_dhgroup, "dhchap_dhgroup")):
            value = attrs[name]
            if not value or value == default:
                continue
            try:
                parse(value)
            except ValueError:
                warnings.append(f"hosts[{i}] ({host['nqn']}): dhchap_{name} {value!r} is not known here; "
                                "every one is allowed instead")
                continue
            settings[key] = [value]
        out[host["nqn"]] = settings
    return out


def _export_host_auth(host: dict[str, Any], warnings: list[str]) -> dict[str, str]:
    """Our host object as nvmet's dhchap attribute group (one hash, one group: the first of ours)."""
    from nvmeof.auth import DHGROUP_IDS, HASH_IDS, parse_dhgroup, parse_hash

    hash_names = {v: k for k, v in HASH_IDS.items()}
    group_names = {v: k for k, v in DHGROUP_IDS.items()}
    attrs = {"key": host.get("dhchap_key") or "", "ctrl_key": host.get("dhchap_ctrl_key") or "",
             "hash": NVMET_DEFAULT_HASH, "dhgroup": NVMET_DEFAULT_DHGROUP}
    hashes = host.get("dhchap_hash")
    if hashes:
        attrs["hash"] = f"hmac({hash_names[parse_hash(hashes[0])]})"
    groups = host.get("dhchap_dhgroup")
    if groups:
        attrs["dhgroup"] = group_names[parse_dhgroup(groups[0])]
    if (hashes and len(hashes) > 1) or (groups and len(groups) > 1):
        warnings.append(f"host {host['nqn']}: nvmet takes one dhchap_hash and one dhchap_dhgroup (its preference, "
                        f"it falls back to what the host offers); exported {attrs['hash']} and {attrs['dhgroup']}")
    return attrs


def _import_ana_groups(port: dict[str, Any], where: str, warnings: list[str]) -> dict[str, str]:
    """ports/<n>/ana_groups/<grpid>/ana_state as a listener's ana_states (optimized groups left out: the
    default here). nvmetcli's state words are ours."""
    out: dict[str, str] = {}
    for k, group in enumerate(port.get("ana_groups") or []):
        grpid = group.get("grpid")
        word = (group.get("ana") or {}).get("state", "optimized")
        if not _anagrpid_ok(grpid):
            warnings.append(f"{where}.ana_groups[{k}]: ANA group {grpid!r} is outside {_ANAGRPIDS}, skipped")
            continue
        try:
            state = parse_ana_state(word)
        except ValueError as exc:
            warnings.append(f"{where}.ana_groups[{k}]: {exc}; the group stays optimized")
            continue
        if state != AnaState.OPTIMIZED:
            out[str(int(grpid))] = ANA_STATE_NAMES[state]
    return out


def _import_namespace(ns: Any, where: str, warnings: list[str]) -> dict[str, Any] | None:
    if not isinstance(ns, dict) or not isinstance(ns.get("nsid"), int):
        warnings.append(f"{where}: no 'nsid', skipped")
        return None
    device = ns.get("device") or {}
    path = device.get("path")
    if not path:
        warnings.append(f"{where} (nsid {ns['nsid']}): no device path, skipped")
        return None
    out: dict[str, Any] = {
        "nsid": ns["nsid"],
        "backend": "file",
        "path": path,
        "block_size": _default_block_size(path, warnings, where),
        "enabled": _flag(ns.get("enable", 1)),
    }
    # namespaces/<nsid>/ana_grpid; the default group (1) is left implicit
    grpid = ns.get("ana_grpid")
    if grpid is not None and str(grpid) != str(defaults.DEFAULT_ANAGRPID):
        if _anagrpid_ok(grpid):
            out["anagrpid"] = int(grpid)
        else:
            warnings.append(f"{where} (nsid {ns['nsid']}): ANA group {grpid!r} is outside {_ANAGRPIDS}; "
                            f"it joins group {defaults.DEFAULT_ANAGRPID}")
    for key in ("uuid", "nguid"):
        text = device.get(key)
        if not text:
            continue
        try:
            raw = _parse_kernel_id(str(text), f"{where}.device.{key}")
        except ValueError as exc:
            warnings.append(f"{exc}; a new one will be generated")
            continue
        if raw == bytes(16):
            continue  # all zeros is how configfs shows "not set"
        out[key] = str(uuid.UUID(bytes=raw)) if key == "uuid" else raw.hex()
    return out


def export_nvmetcli(config: dict[str, Any]) -> Converted:
    """Convert our version-1 config into an nvmetcli dump the kernel target can restore.

    ``.warnings`` names what the kernel target cannot express: RAM and null namespaces, EUI-64
    values, read-only namespaces, referrals to anything but a discovery subsystem.
    """
    config = validate_config(config)
    warnings: list[str] = []
    hosts: set[str] = set()
    host_auth: dict[str, dict[str, str]] = {}
    subsystems = []
    nvm_nqns = []
    eui64_dropped = False
    ana_groups: set[int] = set()
    for sub in config["subsystems"]:
        nqn = sub["nqn"]
        entries = sub.get("hosts") or []
        allowed = sorted(h["nqn"] if isinstance(h, dict) else h for h in entries)
        hosts.update(allowed)
        for host in entries:
            if not isinstance(host, dict) or not host.get("dhchap_key"):
                continue
            attrs = _export_host_auth(host, warnings)
            if host["nqn"] in host_auth and host_auth[host["nqn"]] != attrs:
                # nvmet keeps hosts (and their keys) once, outside the subsystems
                warnings.append(f"host {host['nqn']} has different DH-HMAC-CHAP settings on {nqn}; nvmet keeps one "
                                "set per host, the first subsystem's is exported")
                continue
            host_auth[host["nqn"]] = attrs
        if sub.get("dhchap_hash") or sub.get("dhchap_dhgroup"):
            warnings.append(f"subsystem {nqn}: nvmet has no per-subsystem hashes or DH groups; hosts without their "
                            "own keep the kernel's defaults")
        attr = {
            "allow_any_host": "1" if sub.get("allow_any_host", not allowed) else "0",
            "model": sub.get("model") or defaults.MODEL,
            "version": ".".join(str(part) for part in defaults.NVME_VERSION[:2]),
        }
        if sub.get("serial"):
            attr["serial"] = sub["serial"]
        namespaces = []
        for ns in sub.get("namespaces") or []:
            label = f"namespace {ns.get('nsid')} of {nqn}"
            if not ns.get("path"):   # nvmet serves a file or block device by its path, nothing else
                warnings.append(f"{label}: {ns['backend']} backend has no nvmetcli equivalent, left out")
                continue
            if ns.get("auto_visible") is False:
                # nvmet has no per-host visibility: exported, the namespace would show to every allowed host
                warnings.append(f"{label}: visible only to hosts {', '.join(ns.get('hosts') or []) or '(none)'}; "
                                "the kernel target has no per-host namespace visibility, so it is left out rather "
                                "than shown to every allowed host")
                continue
            device = {"path": ns["path"]}
            if ns.get("uuid"):
                device["uuid"] = str(uuid.UUID(ns["uuid"]))
            if ns.get("nguid"):
                device["nguid"] = _kernel_id(_parse_kernel_id(ns["nguid"], f"{label}.nguid"))
            if ns.get("eui64"):
                eui64_dropped = True
            if ns.get("read_only"):
                warnings.append(
                    f"{label}: the kernel target has no read-only namespaces; it is exported writable"
                )
            block_size = ns.get("block_size", defaults.DEFAULT_BLOCK_SIZE)
            if block_size != _default_block_size(ns["path"], [], label):
                warnings.append(
                    f"{label}: block size {block_size} is not carried; the kernel target uses the "
                    "device's logical block size (the file system's block size for a file)"
                )
            if ns.get("qos"):
                warnings.append(f"{label}: the kernel target has no QoS limits; they are left out")
            grpid = ns.get("anagrpid", defaults.DEFAULT_ANAGRPID)
            ana_groups.add(grpid)
            namespaces.append(
                {"device": device, "enable": 1 if ns.get("enabled", True) else 0, "nsid": ns["nsid"],
                 "ana_grpid": grpid}
            )
        subsystems.append({"allowed_hosts": allowed, "attr": attr, "namespaces": namespaces, "nqn": nqn})
        nvm_nqns.append(nqn)
    if eui64_dropped:
        warnings.append(
            "EUI-64 values are not part of the nvmetcli format; the kernel target will not report them"
        )

    ref_entries = []
    for k, ref in enumerate(config["referrals"]):
        if ref.get("subnqn", defaults.DISCOVERY_NQN) != defaults.DISCOVERY_NQN:
            warnings.append(
                f"referral to {ref['traddr']}:{ref['trsvcid']}: the kernel target only refers to discovery "
                f"subsystems; the subsystem {ref['subnqn']} is dropped"
            )
        ref_entries.append(
            {
                "addr": {
                    "adrfam": ref.get("adrfam") or _adrfam(ref["traddr"]),
                    "portid": str(ref.get("portid", 0)),
                    "traddr": ref["traddr"],
                    "treq": "not specified",
                    "trsvcid": str(ref["trsvcid"]),
                    "trtype": ref.get("trtype", "tcp"),
                },
                "enable": 1,
                "name": f"referral{k + 1}",
            }
        )
    ports = []
    used_portids = {lst["portid"] for lst in config["listeners"] if lst.get("portid")}
    next_portid = 1
    for lst in config["listeners"]:
        portid = lst.get("portid")
        if not portid:
            while next_portid in used_portids:
                next_portid += 1
            portid = next_portid
            used_portids.add(portid)
        ports.append(
            {
                "addr": {
                    "adrfam": lst.get("adrfam") or _adrfam(lst["traddr"]),
                    "traddr": lst["traddr"],
                    "treq": _NVMET_TREQ.get(lst.get("tls") or "none", "not specified"),
                    "trsvcid": str(lst["trsvcid"]),
                    "trtype": lst.get("trtype", "tcp"),
                    **({"tsas": "tls1.3"} if lst.get("tls") in ("optional", "required") else {}),
                },
                "portid": portid,
                # nvmet makes a port's groups other than 1 inaccessible until ana_groups/<g> exists:
                # list every group in use, in its state on this listener
                "ana_groups": _export_ana_groups(ana_groups, lst.get("ana_states") or {}),
                "param": {"inline_data_size": str(lst.get("inline_data_size", defaults.IO_INCAPSULE_SIZE))},
                "referrals": [dict(r, addr=dict(r["addr"])) for r in ref_entries],
                # The kernel serves discovery on every port; a port linked to nothing is a discovery port.
                "subsystems": [] if lst.get("discovery") else list(nvm_nqns),
            }
        )
    if ref_entries and not ports:
        warnings.append("referrals need a port to live on in nvmetcli; with no listener they are left out")
    return Converted(
        {"hosts": [dict({"nqn": h}, **({"dhchap": host_auth[h]} if h in host_auth else {})) for h in sorted(hosts)],
         "ports": ports, "subsystems": subsystems},
        warnings,
    )


def _import_inline_data_size(port: dict[str, Any], trtype: str, where: str, warnings: list[str]) -> int | None:
    """A port's param_inline_data_size as a listener's inline_data_size: None for nvmet's -1 (the transport's
    default) or none given; above NVMET_RDMA_MAX_INLINE_DATA_SIZE on rdma it is reduced, as
    nvmet_rdma_add_port does, and off the 16-byte unit rounded down to what IOCCSZ would advertise."""
    text = (port.get("param") or {}).get("inline_data_size")
    try:
        size = int(text) if text is not None else -1
    except (TypeError, ValueError):
        warnings.append(f"{where}: param inline_data_size {text!r} is not a number, left at the default")
        return None
    if size < 0:
        return None
    limit = defaults.RDMA_INLINE_DATA_SIZE_MAX if trtype == "rdma" else defaults.INLINE_DATA_SIZE_MAX
    unit = defaults.INLINE_DATA_SIZE_UNIT
    taken = min(size, limit) // unit * unit
    if taken != size:
        warnings.append(f"{where}: param inline_data_size {size} taken as {taken} (a multiple of {unit}, "
                        f"at most {limit} on {trtype})")
    return taken


def _export_ana_groups(used: set[int], states: dict[str, str]) -> list[dict[str, Any]]:
    groups = used | {int(g) for g in states} | {defaults.DEFAULT_ANAGRPID}
    return [{"ana": {"state": ANA_STATE_NAMES[parse_ana_state(states.get(str(g), "optimized"))]}, "grpid": g}
            for g in sorted(groups)]


def strip_nvmetcli_secrets(dump: dict[str, Any]) -> list[str]:
    """Take the DH-HMAC-CHAP secrets out of an nvmetcli dump (in place, for the API); returns the host
    NQNs that had one."""
    withheld = []
    for host in dump.get("hosts") or []:
        group = host.get("dhchap")
        if isinstance(group, dict) and (group.pop("key", None) or group.pop("ctrl_key", None)):
            withheld.append(host["nqn"])
        if isinstance(group, dict):
            group.pop("ctrl_key", None)
    return withheld


def _adrfam(traddr: str) -> str:
    return "ipv6" if ":" in traddr else "ipv4"
