"""NVMe Qualified Name checks (NVMe Base Specification 2.0, section 4.5).

Two forms exist: ``nqn.yyyy-mm.<reverse domain>:<user string>`` and the UUID form
``nqn.2014-08.org.nvmexpress:uuid:<uuid>``. The discovery NQN is reserved for the discovery
subsystem, so neither a subsystem we create nor a host may use it.
"""

from __future__ import annotations

import re
import uuid

from nvmeof import defaults

NQN_MAX_BYTES = 223  # NVMF_NQN_SIZE - 1: the 256-byte field keeps room for the NUL
UUID_NQN_PREFIX = "nqn.2014-08.org.nvmexpress:uuid:"

_DATE_DOMAIN = re.compile(
    r"^nqn\.(?P<year>\d{4})-(?P<month>\d{2})\."
    r"(?P<domain>[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*)"
    r":(?P<user>.+)$",
    re.DOTALL,
)
_EXAMPLE = "nqn.2026-01.com.example:storage1"


class NqnError(ValueError):
    """An NQN that breaks the specification's format rules; the message says which rule."""


def validate_nqn(nqn: object, *, what: str = "NQN") -> str:
    """Return ``nqn`` unchanged if it is a well-formed NQN, else raise NqnError naming the problem."""
    if not isinstance(nqn, str):
        raise NqnError(f"{what} must be a string, got {type(nqn).__name__}")
    if not nqn:
        raise NqnError(f"{what} is empty; give one like {_EXAMPLE!r}")
    size = len(nqn.encode("utf-8"))
    if size > NQN_MAX_BYTES:
        raise NqnError(f"{what} {nqn[:40]!r}... is {size} bytes of UTF-8; the limit is {NQN_MAX_BYTES}")
    if nqn == defaults.DISCOVERY_NQN:
        raise NqnError(f"{what} {nqn!r} is the reserved discovery NQN; choose another name")
    if nqn.startswith(UUID_NQN_PREFIX):
        tail = nqn[len(UUID_NQN_PREFIX) :]
        try:
            parsed = uuid.UUID(tail)
        except ValueError:
            raise NqnError(
                f"{what} {nqn!r} uses the UUID form but {tail!r} is not a UUID "
                "(expected 8-4-4-4-12 hexadecimal digits)"
            ) from None
        if str(parsed) != tail.lower() or len(tail) != 36:
            raise NqnError(f"{what} {nqn!r}: the UUID must be written 8-4-4-4-12, like {uuid.uuid4()}")
        return nqn
    match = _DATE_DOMAIN.match(nqn)
    if match is None:
        raise NqnError(
            f"{what} {nqn!r} is not of the form 'nqn.yyyy-mm.reverse.domain:name' "
            f"(for example {_EXAMPLE!r}) nor {UUID_NQN_PREFIX}<uuid>"
        )
    month = int(match["month"])
    if not 1 <= month <= 12:
        raise NqnError(f"{what} {nqn!r}: month {match['month']} in the date is not 01..12")
    if int(match["year"]) < 1970:
        raise NqnError(f"{what} {nqn!r}: the year {match['year']} is before any domain could be owned")
    for ch in match["user"]:
        # Spaces and control characters break sysfs/configfs names and log lines; '/' breaks REST paths.
        if ch.isspace() or not ch.isprintable() or ch == "/":
            raise NqnError(
                f"{what} {nqn!r} contains {ch!r} after the domain; use no spaces, control characters or '/'"
            )
    return nqn


def generate_nqn() -> str:
    """A fresh UUID-form NQN, unique without any naming authority."""
    return f"{UUID_NQN_PREFIX}{uuid.uuid4()}"
