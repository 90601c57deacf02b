#!/usr/bin/env python3
"""What NVMe/TCP over TLS 1.3 costs per I/O: the same `nvmeof bench` rows over TLS and in the clear, one run.

`nvmeof serve --tls optional` (a RAM disk; the host NQN below allowed with a TLS PSK): TLS queues against
clear queues on the one NVMe/TCP engine of each end (batch, fast paths included; since issue 26 part 1 TLS
queues take them too, on the plaintext their TLS session decrypts, so the difference is the TLS session:
AES-GCM and the memory-BIO copies). Variants
alternate per round so each sees the same background. Figures: IOPS, MiB/s, mean latency, CPU µs per I/O on
both sides, the TLS/clear ratios (IOPS, and the extra CPU µs per I/O TLS costs on each side).

    python3 benchmarks/tls.py                    # 2 rounds, 3 s per row
    python3 benchmarks/tls.py --rounds 3 --runtime 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from harness import DEFAULT_NQN, Row, machine, run_bench, serving, set_tree

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:7a5e0000-0000-4000-8000-000000000001"
ROWS = (
    Row("4k-randread-qd32", "randread", 4096, 32),
    Row("4k-randwrite-qd32", "randwrite", 4096, 32),
    Row("128k-read-qd8", "read", 131072, 8),
    Row("128k-write-qd8", "write", 131072, 8),
)
VARIANTS = ("tls", "clear")


def new_key(hmac_id: int = 1) -> str:
    """A configured PSK made by the measured tree's nvmeof (harness.TREE must be set)."""
    if str(harness.TREE) not in sys.path:
        sys.path.insert(0, str(harness.TREE))
    from nvmeof.tls.psk import generate_key

    return generate_key(hmac_id=hmac_id)


def host_args(key: str | None) -> tuple[str, ...]:
    """`nvmeof bench` arguments of the allowed host: over TLS with ``key``, in the clear with None."""
    return ("--hostnqn", HOSTNQN, *(("--tls-key", key) if key is not None else ()))


def variant_args(variant: str, key: str) -> tuple[str, ...]:
    if variant == "tls":
        return host_args(key)
    return host_args(None)


@contextmanager
def tls_serving(ramdisk_size: str, key: str, *, extra_args: tuple[str, ...] = (),
                **kwargs: Any) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """harness.serving with `--tls optional` and a config file of its own (a fresh one: serve saves its state
    back into it) allowing HOSTNQN with the TLS PSK ``key`` on the RAM disk's subsystem."""
    with tempfile.TemporaryDirectory(prefix="nvmeof-tls-bench-") as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps({"version": 1, "subsystems": [{
            "nqn": DEFAULT_NQN, "allow_any_host": False, "hosts": [{"nqn": HOSTNQN, "tls_key": key}],
            "namespaces": [{"nsid": 1, "backend": "ram", "size": harness.parse_size(ramdisk_size)}]}]}))
        cfg.chmod(0o600)
        with serving(ramdisk_size, extra_args=("--config", str(cfg), "--tls", "optional", *extra_args),
                     **kwargs) as served:
            yield served


def run_round(args: argparse.Namespace, key: str, order: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """One target serves both variants (`--tls optional`: the first bytes of a connection decide)."""
    out: dict[str, dict[str, Any]] = {}
    with tls_serving(args.ramdisk_size, key) as (target, port):
        for row in ROWS:
            for variant in order:
                out[f"{row.name}/{variant}"] = run_bench(row, port, target.pid, runtime=args.runtime,
                                                         ramp=args.ramp, numjobs=1, nqn=DEFAULT_NQN,
                                                         extra_args=variant_args(variant, key))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runtime", "--seconds", type=float, default=3.0)
    parser.add_argument("--ramp", type=float, default=0.5)
    parser.add_argument("--ramdisk-size", default="256M")
    parser.add_argument("--hmac", type=int, choices=(1, 2), default=1, help="PSK hash: 1 AES-128-GCM, 2 AES-256-GCM")
    parser.add_argument("--tree", type=Path, help="measure this checkout's nvmeof (default: this one)")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args(argv)
    set_tree(args.tree)
    key = new_key(args.hmac)
    runs: list[dict[str, dict[str, Any]]] = []
    for rnd in range(args.rounds):
        order = VARIANTS if rnd % 2 == 0 else tuple(reversed(VARIANTS))
        print(f"round {rnd + 1}: {', '.join(order)}", file=sys.stderr, flush=True)
        runs.append(run_round(args, key, order))

    def med(name: str, field: str) -> float:
        vals = [r[name][field] for r in runs if r[name][field] is not None]
        return statistics.median(vals) if vals else float("nan")

    print(f"machine: {machine()}; tree {harness.TREE}; {args.rounds} round(s), {args.runtime:g} s + {args.ramp:g} s "
          f"ramp per row, 1 job, 1 I/O queue, PSK hash {args.hmac}; medians")
    print("| job | variant | IOPS | MiB/s | mean lat µs | target µs/IO | initiator µs/IO | TLS vs clear |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for row in ROWS:
        clear = f"{row.name}/clear"
        for variant in VARIANTS:
            name = f"{row.name}/{variant}"
            note = ""
            if variant == "tls":
                note = (f"IOPS x{med(name, 'iops') / med(clear, 'iops'):.2f}, CPU +"
                        f"{med(name, 'target_cpu_us_per_io') - med(clear, 'target_cpu_us_per_io'):.1f} µs target, +"
                        f"{med(name, 'initiator_cpu_us_per_io') - med(clear, 'initiator_cpu_us_per_io'):.1f} µs host")
            print(f"| {row.name} | {variant} | {med(name, 'iops'):.0f} | {med(name, 'bw_bytes') / 2**20:.1f} | "
                  f"{med(name, 'mean_lat_ns') / 1000:.1f} | {med(name, 'target_cpu_us_per_io'):.1f} | "
                  f"{med(name, 'initiator_cpu_us_per_io'):.1f} | {note} |")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
