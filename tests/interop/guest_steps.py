"""STEP lines of guest programs that run as several processes: one file per process, read by the test.

`rdma_guest_script.py` proves its steps from two processes (a controller and a host). Printed to one
shared console their lines could tear: under PYTHONUNBUFFERED `print()` issues two write() calls (the
text, then "\\n"), so the other process's line could land between them and `^STEP cm-accept OK` no
longer matched (issue 10, item 10). Here each process appends its lines to a file of its own on a 9p
share (`<role>.steps`), the test reads the files once the guest has exited, and the collector refuses
anything that is not a whole STEP line. With one writer per file there is nothing to interleave with.

Stdlib only: the guest gets this file next to its script (rootfs.run_python_guest's ``files``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable
from pathlib import Path

STEP_DIR_ENV = "NVMEOF_STEP_DIR"  # where the guest process writes <role>.steps; unset: console only
SUFFIX = ".steps"
_NAME = r"[a-z0-9][a-z0-9-]*"
_ROLE_RE = re.compile(_NAME)
_LINE_RE = re.compile(rf"STEP (?P<name>{_NAME}) OK(?: (?P<detail>.+))?")


class StepFormatError(ValueError):
    """A steps file holds something other than whole STEP lines, or a process left none."""


@dataclasses.dataclass(frozen=True)
class Step:
    role: str
    name: str
    detail: str


def format_step(name: str, detail: str = "") -> bytes:
    """One whole line, `STEP <name> OK <detail>\\n`; refuses what the collector could not read back."""
    if not re.fullmatch(_NAME, name):
        raise ValueError(f"step name {name!r} must be lower-case letters, digits and '-'")
    detail = detail.strip()
    if "\n" in detail or "\r" in detail or "STEP " in detail:
        raise ValueError(f"step {name} detail {detail!r} must be one line without 'STEP '")
    return f"STEP {name} OK {detail}".rstrip().encode() + b"\n"


class StepLog:
    """One process's steps: appended to `<directory>/<role>.steps` and copied to the console.

    Each line goes out in one write() call: to the file (the only writer of that file) and to stdout,
    tagged with the role, where a tty keeps one write() whole against other processes' writes.
    """

    def __init__(self, directory: str | os.PathLike[str] | None, role: str) -> None:
        if not _ROLE_RE.fullmatch(role):
            raise ValueError(f"role {role!r} must be lower-case letters, digits and '-'")
        self.role = role
        self._fd: int | None = None
        if directory is not None:
            # created now, so a process that dies before its first step still leaves an (empty) file
            path = Path(directory) / f"{role}{SUFFIX}"
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)

    def step(self, name: str, detail: str = "") -> None:
        line = format_step(name, detail)
        if self._fd is not None:
            if os.write(self._fd, line) != len(line):
                raise OSError(f"short write of a step line to {self.role}{SUFFIX}")
            os.fsync(self._fd)
        os.write(1, f"[{self.role}] ".encode() + line)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def parse_steps(text: str, role: str) -> list[Step]:
    """The steps of one process's file; a torn, mixed or foreign line is an error, never skipped."""
    if text and not text.endswith("\n"):
        raise StepFormatError(f"{role}{SUFFIX}: the last line has no newline (a torn write): {text[-200:]!r}")
    steps = []
    for lineno, line in enumerate(text.split("\n")[:-1], 1):
        match = _LINE_RE.fullmatch(line)
        if match is None or "STEP " in (match.group("detail") or ""):
            raise StepFormatError(f"{role}{SUFFIX} line {lineno} is not one whole STEP line: {line!r}")
        steps.append(Step(role, match.group("name"), match.group("detail") or ""))
    return steps


def collect(directory: str | os.PathLike[str], roles: Iterable[str]) -> dict[str, list[Step]]:
    """Every expected role's steps from `directory`; a missing or unexpected file is an error."""
    folder = Path(directory)
    wanted = list(roles)
    found = {p.name.removesuffix(SUFFIX) for p in folder.glob(f"*{SUFFIX}")}
    unexpected = found - set(wanted)
    if unexpected:
        raise StepFormatError(f"steps files of unexpected processes in {folder}: {sorted(unexpected)}")
    missing = [r for r in wanted if r not in found]
    if missing:
        raise StepFormatError(f"no steps file from {missing} in {folder}: the process never started")
    return {r: parse_steps((folder / f"{r}{SUFFIX}").read_text(errors="replace"), r) for r in wanted}
