"""Containerfile: Debian-based, the state directory a volume, the NVMe/TCP and API ports exposed, and
its ENTRYPOINT (+ CMD) a command line `nvmeof serve` accepts. No container engine runs here, so the
command line is parsed by the real click command (make_context: every option converted and checked,
nothing run) and by serve's own address parsers."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click

from nvmeof.cli import cli
from nvmeof.cli.commands.serve import _addresses, _api

REPO = Path(__file__).resolve().parents[1]
CONTAINERFILE = REPO / "Containerfile"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and backslash continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def argv(value: str) -> list[str]:
    """Exec form (a JSON array) or shell form."""
    return json.loads(value) if value.startswith("[") else shlex.split(value)


def test_containerfile_runs_a_valid_nvmeof_serve_command_line() -> None:
    steps = instructions(CONTAINERFILE)
    first = dict(steps)
    assert re.match(r"(python:3\.11-slim-bookworm|debian:bookworm)", first["FROM"]), first["FROM"]
    entry = argv(first.get("ENTRYPOINT", "[]")) + argv(first.get("CMD", "[]"))
    assert entry[:2] == ["nvmeof", "serve"], entry
    # Everything it COPYs exists (the build would fail otherwise).
    for kind, args in steps:
        if kind == "COPY":
            for source in args.split()[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: no such file in the repository"
    ctx = cli.make_context("nvmeof", entry[1:])
    command = cli.get_command(ctx, "serve")
    serve_ctx = command.make_context("serve", entry[2:], parent=ctx)  # raises click.UsageError if it does not parse
    kw = serve_ctx.params
    api = _api(kw["api"])
    assert api == ("0.0.0.0", 8080), "the API must be reachable through a published port"
    listen = _addresses(kw["listen"], 4420, "--listen")
    discovery = _addresses(kw["discovery"], 8009, "--discovery")
    exposed = {int(p.split("/")[0]) for p in first["EXPOSE"].split()}
    assert {a.trsvcid for a in listen + discovery} | {api[1]} <= exposed, (listen, discovery, exposed)
    volumes = argv(first["VOLUME"])
    assert str(kw["state_dir"]) in volumes, "the state directory must be the volume"
    assert kw["config_path"] is not None and str(kw["config_path"]).startswith(str(kw["state_dir"])), \
        "the configuration must live in the volume (the daemon saves it back)"
    assert kw["api_token"] is None or kw["api_token"] == "", "no token baked into the image"
    assert "USER" in first and first["USER"] not in ("root", "0")


def test_a_broken_command_line_would_be_caught() -> None:
    ctx = cli.make_context("nvmeof", ["serve", "--api-max-body"])
    try:
        cli.get_command(ctx, "serve").make_context("serve", ["--listen", "tcp://0.0.0.0:99999", "--api-max-body"],
                                                   parent=ctx)
    except click.UsageError:
        return
    raise AssertionError("make_context accepted an option without its value")
