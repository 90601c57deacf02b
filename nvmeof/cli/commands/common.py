"""Helpers shared by the command-line modules: sizes, output tables, JSON, running the event loop."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import click

T = TypeVar("T")

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_size(text: str | int) -> int:
    """'4096', '4k', '1G', '512MiB' -> bytes (binary units, as fio and nvme-cli use)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size: use a number with an optional K, M, G or T suffix")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def format_size(n: int) -> str:
    for unit, div in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    rows = [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(out)


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=_json_default))


def _json_default(o: object):
    if isinstance(o, bytes | bytearray | memoryview):
        return bytes(o).hex()
    if hasattr(o, "isoformat"):
        return o.isoformat()
    return str(o)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on uvloop when it is installed (faster), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
