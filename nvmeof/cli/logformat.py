"""Log output of the `nvmeof` command line: plain text (default) or one JSON object per line.

`--log-format json` is for log collectors (journald's JSON export, Loki, Fluent Bit, Vector): every
line is ``{"ts", "level", "logger", "message"}`` plus the structured fields the target attaches to
connection events (``extra={...}`` in target/fabrics.py, controller.py, auth.py, transports/tcp.py):
``event`` (connect, disconnect, refused, failure), ``host``, ``subnqn``, ``qid``, ``cntlid``,
``peer``, ``reason``. Those log calls name hosts by NQN only; no secret is ever a field.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

LOG_FORMATS = ["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The fields a record may carry beyond the standard ones, in the order they are written.
FIELDS = ("event", "host", "subnqn", "qid", "cntlid", "peer", "reason", "status", "kato", "count")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None and value != "":
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class _OurHandler(logging.StreamHandler):
    """The stderr handler configure() installs, told apart from anyone else's."""


def configure(level: str, fmt: str = "text") -> None:
    """Log to stderr (journald under systemd, `docker logs` in a container) at ``level``. Like
    logging.basicConfig, nothing changes when someone else (pytest, an embedding program) already
    set up the root logger; a handler of ours from an earlier call is replaced."""
    root = logging.getLogger()
    if any(not isinstance(h, _OurHandler) for h in root.handlers):
        return
    handler = _OurHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
