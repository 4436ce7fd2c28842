"""The `kvflow` command: `kvflow doctor`, `kvflow bench nixl`.

Why one entry point: operators ask "does NIXL work here, with which backends and memory?" and
"how fast is it here?" before anything else; both answers are one command away.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ("main",)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow KV-cache transfer engine")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("doctor", help="which NIXL backends and memory types work on this machine")
    bench = commands.add_parser("bench", help="benchmarks")
    targets = bench.add_subparsers(dest="target", required=True)
    nixl = targets.add_parser("nixl", help="NIXL WRITE bandwidth and latency: raw agent, kvflow, memcpy")
    nixl.add_argument("--quick", action="store_true", help="stop at 16 MiB")
    nixl.add_argument("--repeats", type=int, default=None, help="samples per cell (default: by size)")
    nixl.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    if args.command == "doctor":
        from kvflow.doctor import diagnose, render

        sys.stdout.write(render(diagnose()) + "\n")
        return 0
    from kvflow.bench_nixl import main as bench_main

    bench_main(quick=args.quick, json_path=args.json, repeats=args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
