"""DH-HMAC-CHAP settings of allowed hosts as management sees them: checked on input, written to the
config file, shown by the API without their secrets.

The names follow Linux nvmet configfs (``hosts/<nqn>/dhchap_key``, ``dhchap_ctrl_key``,
``dhchap_hash``, ``dhchap_dhgroup``): secrets in the ``DHHC-1:NN:base64:`` form `nvme gen-dhchap-key`
writes, hashes as ``sha256`` or configfs' ``hmac(sha256)``, DH groups as ``null``/``ffdhe2048``.
A secret never appears in a message, a log line or an API answer: only whether it is set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from nvmeof.auth import DHGROUP_IDS, HASH_IDS, DhchapSecret, parse_dhgroup, parse_hash
from nvmeof.tls.psk import TlsKey
from target import schema
from target.model import HostAuth, Subsystem

SECRET_FIELDS = ("dhchap_key", "dhchap_ctrl_key")
LIST_FIELDS = ("dhchap_hash", "dhchap_dhgroup")
DHCHAP_FIELDS = SECRET_FIELDS + LIST_FIELDS
# NVMe/TCP TLS: the host's configured PSK (NVMeTLSkey-1:NN:...:), kept with the host like its DH-HMAC-CHAP keys
TLS_KEY = "tls_key"
# derive the host's TLS PSK for digest-less (NVMe0R) identities as libnvme's *_compat functions do: not a secret
TLS_COMPAT = "tls_compat"
FIELDS = tuple(name for name in schema.HOST if name != "nqn")   # a host's settings, declared there
REDACTED = schema.HOST_SECRET_FIELDS   # shown as presence flags only
# The defaults, in the controller's order of preference (the first the host offers is used): every hash,
# SHA-256 first (nvmet's default dhchap_hash); every DH group, ffdhe2048 first and null last, which is what
# nvmet with its default dhchap_dhgroup ends up choosing for a Linux host (nvmet_auth_negotiate).
ALL_HASHES: tuple[int, ...] = (1, 2, 3)
ALL_DHGROUPS: tuple[int, ...] = (1, 2, 3, 4, 5, 0)
HASH_NAMES = {v: k for k, v in HASH_IDS.items()}
DHGROUP_NAMES = {v: k for k, v in DHGROUP_IDS.items()}


class AuthSettingError(ValueError):
    """A refused DH-HMAC-CHAP setting; the message names the field and never the secret."""


def _scrub(message: str, secret: str) -> str:
    # DhchapSecret.parse names what is wrong without the key; keep it that way even if it did not
    return message.replace(secret, "<secret>") if secret and secret in message else message


_K = TypeVar("_K")


def parse_secret(value: Any, field: str, hostnqn: str) -> DhchapSecret:
    if isinstance(value, DhchapSecret):
        return value
    return _parse_key(value, field, hostnqn, DhchapSecret.parse, form="DHHC-1 secret", string="a DHHC-1 secret",
                      plural="secrets", what="secret", generate="`nvme gen-dhchap-key` or `nvmeof gen-dhchap-key`")


def parse_tls_key(value: Any, hostnqn: str) -> TlsKey:
    if isinstance(value, TlsKey):
        return value
    return _parse_key(value, "tls_key", hostnqn, TlsKey.parse, form="NVMeTLSkey-1 key", string="an NVMeTLSkey-1",
                      plural="keys", what="TLS PSK", generate="`nvme gen-tls-key` or `nvmeof gen-tls-key`")


def _parse_key(value: Any, field: str, hostnqn: str, parse: Callable[[str], _K], *, form: str, string: str,
               plural: str, what: str, generate: str) -> _K:
    """A host's key from config/REST input: refuses the presence flag an export shows in its place and
    names what is wrong without echoing the key (the parser's message is scrubbed too)."""
    if isinstance(value, bool):
        raise AuthSettingError(
            f"{field} of host {hostnqn} is {str(value).lower()}: that is the presence flag an API export shows "
            f"(it never carries {plural}); give the {form} itself or leave the field out")
    if not isinstance(value, str):
        raise AuthSettingError(f"{field} of host {hostnqn} must be {string} string, got {type(value).__name__}")
    try:
        return parse(value.strip())
    except ValueError as exc:
        raise AuthSettingError(
            f"{field} of host {hostnqn} is not a usable {what}: {_scrub(str(exc), value.strip())}; "
            f"generate one with {generate}") from None


def _names(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return [v.strip() for v in value]
    raise AuthSettingError(f"{field} must be a list of names, got {value!r}")


def parse_hashes(value: Any, field: str = "dhchap_hash") -> tuple[int, ...] | None:
    """Hash names (``sha256``, ``hmac(sha384)``, ...) to ids, in the order given; None stays None."""
    return _parse_ids(value, field, parse_hash, "hash", HASH_IDS)


def parse_dhgroups(value: Any, field: str = "dhchap_dhgroup") -> tuple[int, ...] | None:
    """DH group names (``null``, ``ffdhe2048`` ... ``ffdhe8192``) to ids, in the order given."""
    return _parse_ids(value, field, parse_dhgroup, "DH group", DHGROUP_IDS)


def _parse_ids(value: Any, field: str, parse: Callable[[str], int], what: str,
               known: Iterable[str]) -> tuple[int, ...] | None:
    """Names to ids with ``parse``, in the order given, each once; None stays None."""
    if value is None:
        return None
    ids: list[int] = []
    for name in _names(value, field):
        try:
            ident = parse(name)
        except ValueError:
            raise AuthSettingError(f"{field}: unknown {what} {name!r}; use {', '.join(known)}") from None
        if ident not in ids:
            ids.append(ident)
    if not ids:
        raise AuthSettingError(f"{field} is empty; name at least one of {', '.join(known)} or leave it out for all")
    return tuple(ids)


def hash_names(ids: Iterable[int] | None) -> list[str] | None:
    return None if ids is None else [HASH_NAMES[i] for i in ids]


def dhgroup_names(ids: Iterable[int] | None) -> list[str] | None:
    return None if ids is None else [DHGROUP_NAMES[i] for i in ids]


def build(hostnqn: str, settings: dict[str, Any], base: HostAuth | None = None) -> HostAuth:
    """A new HostAuth: ``base`` with the fields in ``settings`` replaced (a None value removes one).
    AuthSettingError names the first bad field."""
    unknown = sorted(set(settings) - set(FIELDS))
    if unknown:
        raise AuthSettingError(f"unknown host setting(s) {', '.join(unknown)}; use {', '.join(FIELDS)}")
    entry = HostAuth() if base is None else HostAuth(base.dhchap_key, base.dhchap_ctrl_key, base.dhchap_hash,
                                                     base.dhchap_dhgroup, base.tls_key, base.tls_compat)
    if TLS_KEY in settings:
        value = settings[TLS_KEY]
        entry.tls_key = None if value is None or value == "" else parse_tls_key(value, hostnqn)
    if TLS_COMPAT in settings:
        value = settings[TLS_COMPAT]
        if value is not None and not isinstance(value, bool):
            raise AuthSettingError(f"{TLS_COMPAT} of host {hostnqn} must be true or false, got "
                                   f"{type(value).__name__} {value!r}")
        entry.tls_compat = bool(value)
    for field in SECRET_FIELDS:
        if field in settings:
            value = settings[field]
            setattr(entry, field, None if value is None or value == "" else parse_secret(value, field, hostnqn))
    if "dhchap_hash" in settings:
        entry.dhchap_hash = parse_hashes(settings["dhchap_hash"])
    if "dhchap_dhgroup" in settings:
        entry.dhchap_dhgroup = parse_dhgroups(settings["dhchap_dhgroup"])
    if entry.dhchap_ctrl_key is not None and entry.dhchap_key is None:
        raise AuthSettingError(
            f"host {hostnqn}: a controller key (dhchap_ctrl_key) needs a host key (dhchap_key) too; bidirectional "
            "authentication runs inside the host's own authentication")
    return entry


def effective(sub: Subsystem, entry: HostAuth) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The hashes and DH groups a transaction of this host may use: the host's, else the subsystem's,
    else all (nvmet's defaults allow every hash and group, null included)."""
    hashes = entry.dhchap_hash or sub.dhchap_hash or ALL_HASHES
    groups = entry.dhchap_dhgroup if entry.dhchap_dhgroup is not None else sub.dhchap_dhgroup
    return hashes, groups if groups is not None else ALL_DHGROUPS


def config_entry(hostnqn: str, entry: HostAuth, *, redact: bool = False) -> dict[str, Any]:
    """The host's object in the config file's ``hosts`` list; with ``redact`` the secrets become
    presence flags (what the API shows)."""
    out: dict[str, Any] = {"nqn": hostnqn}
    for field in SECRET_FIELDS:
        secret = getattr(entry, field)
        if redact:
            out[field] = secret is not None
        elif secret is not None:
            out[field] = secret.format()
    if entry.dhchap_hash is not None:
        out["dhchap_hash"] = hash_names(entry.dhchap_hash)
    if entry.dhchap_dhgroup is not None:
        out["dhchap_dhgroup"] = dhgroup_names(entry.dhchap_dhgroup)
    if entry.tls_key is not None:   # only when set: a host without a TLS key keeps its entry as it was
        out[TLS_KEY] = True if redact else entry.tls_key.format()
    if entry.tls_compat:   # only when on, like tls_key; not a secret, shown as it is
        out[TLS_COMPAT] = True
    return out


def redact_item(item: Any) -> Any:
    """A copy of a subsystem config item with every host secret replaced by its presence flag."""
    if not isinstance(item, dict) or not isinstance(item.get("hosts"), list):
        return item
    hosts = []
    for host in item["hosts"]:
        if isinstance(host, dict):
            host = {k: (bool(v) if k in REDACTED else v) for k, v in host.items()}
        hosts.append(host)
    return {**item, "hosts": hosts}
