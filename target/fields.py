"""Field declarations and the errors of their checks: the leaf module both target/schema.py (which
re-exports all of it) and the backend registry (target/backends, a kind's own settings) import, so a backend
kind declares its settings with the same ``Field`` as the configuration items without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ServiceError(Exception):
    """A refused or failed management request. ``status`` follows HTTP: 400 bad input, 404 no such
    object, 409 conflicts with the current state, 500 the change could not be applied or saved."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class SchemaError(ServiceError, ValueError):
    """A value a field refuses; the message names the field and the reason. It is the service's 400 as it
    stands (the service calls these checks directly; a config replay records the message per item)."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


# JSON's types as json.loads gives them, named as the configuration file's messages name them
JSON_TYPES: dict[type, str] = {int: "integer", str: "string", bool: "boolean", list: "list", dict: "object"}


def is_json(kind: type, value: Any) -> bool:
    """Whether ``value`` is of the JSON type ``kind`` (JSON_TYPES): a boolean is no integer."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


@dataclass(frozen=True)
class IntField:
    """An integer field and its inclusive range."""

    name: str
    low: int
    high: int

    def bounds(self) -> dict[str, int]:
        """The range as pydantic/FastAPI constraints (``Field(**f.bounds())``, ``Path(**f.bounds())``)."""
        return {"ge": self.low, "le": self.high}

    def check(self, value: Any, high: int | None = None) -> int:
        """The value as an int (decimal text accepted, as the CLI and the config may give it); ``high``
        narrows the range (an NSID within the subsystem's max_namespaces)."""
        high = self.high if high is None else high
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if not is_json(int, value):
            raise SchemaError(f"{self.name} must be an integer, got {value!r}")
        if not self.low <= value <= high:
            raise SchemaError(f"{self.name} {value} is out of range; use {self.low}..{high}")
        return value

    def accepts(self, value: Any) -> bool:
        """Whether ``check`` takes ``value`` (a JSON object's key, a dump's text)."""
        try:
            self.check(value)
        except SchemaError:
            return False
        return True


@dataclass(frozen=True)
class Field:
    """One field of a configuration item, which is also the REST body's field of that name: its JSON type in
    the file (``kind``), and for the body (api/schemas.py builds it from these) its Python type when narrower
    than ``kind`` (a Literal, list[str]), default (``REQUIRED_IN_BODY``: none; a list's is a new empty list),
    range, length bounds and description."""

    kind: type
    default: Any = None
    annotation: Any = None
    range: IntField | None = None
    min_length: int | None = None
    max_length: int | None = None
    description: str | None = None
    pattern: str | None = None
    strict: bool | None = None  # False: the body parses it from its JSON string (a UUID)
    in_body: bool = True  # False: kept in the file, set through a route of its own (a listener's ana_states)
    in_file: bool = True  # False: an action of the body, not kept (a namespace's "create")
    body_name: str | None = None  # the body's name where it differs (a host's "nqn" is the body's "hostnqn")
    required_in_file: bool = False  # the file's item must give it (the body may have a default or make one)
    each: str | None = None  # a list of strings in the file: what its elements are, as a message names them
    secret: bool = False  # never echoed in a message, never shown by the API (only whether it is set)

    def body_type(self) -> Any:
        """The body's type: ``annotation``, else ``kind`` (optional where the default is None)."""
        kind = self.kind if self.annotation is None else self.annotation
        return kind | None if self.default is None else kind

    def check(self, name: str, value: Any) -> Any:
        """``value`` as a service input of this field: of its JSON type, a string within the length bounds
        (in characters, as the REST body counts them) and without a NUL (a C string ends there). SchemaError
        names ``name``; a secret is never echoed. Ranges and vocabularies have their own checks (IntField,
        target/schema.py's check_*)."""
        shown = "a secret" if self.secret else repr(value)
        if not is_json(self.kind, value) or (self.kind is str and self.min_length and not value):
            what = "a non-empty string" if self.kind is str and self.min_length else f"a JSON {JSON_TYPES[self.kind]}"
            raise SchemaError(f"{name} must be {what}, got {shown}")
        if isinstance(value, str) and "\0" in value:
            raise SchemaError(f"{name} contains a NUL byte")
        if self.min_length is not None and len(value) < self.min_length:
            raise SchemaError(f"{name} is {len(value)} characters long; at least {self.min_length} needed")
        if self.max_length is not None and len(value) > self.max_length:
            raise SchemaError(f"{name} is {len(value)} characters long; at most {self.max_length} allowed")
        return value


REQUIRED_IN_BODY: Any = ...  # pydantic's marker of a field without a default
