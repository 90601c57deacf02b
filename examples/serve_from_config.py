"""Run a target from a configuration file, embedded in your own Python program.

    python3 examples/serve_from_config.py [examples/target.json] [--api 127.0.0.1:8080]

The same as `nvmeof serve --config FILE`, but shows the daemon as a library. The file is copied to
a temporary folder first, so changes made over the REST API do not rewrite the example.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from pathlib import Path

from nvmeof.cli.daemon import DaemonOptions, serve


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=str(Path(__file__).with_name("target.json")))
    parser.add_argument("--api", default="127.0.0.1:8080", help="REST API HOST:PORT, or 'none'")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="nvmeof-example-"))
    config = work / "target.json"
    shutil.copyfile(args.config, config)
    api = None
    if args.api != "none":
        host, port = args.api.rsplit(":", 1)
        api = (host, int(port))

    def ready(daemon) -> None:
        print(daemon.banner(), flush=True)

    try:
        return asyncio.run(serve(DaemonOptions(config_path=config, api=api), ready=ready))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
