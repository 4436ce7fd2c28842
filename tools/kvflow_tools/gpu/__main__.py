"""The GPU check's command line: ``python -m kvflow_tools.gpu --device {cuda,cpu} --out DIR``.

Why one entry point for the parent and its children: a child is this same module run with
``--role p|d|env`` by the same Python, so it needs no path to a script and loads the `kvflow`
and `kvflow_tools` the parent loaded (the parent puts their folders on ``PYTHONPATH``).  A child
role imports only what it needs, late, so that it can report a failed import as a JSON line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvflow_tools.gpu.plan import BLOCKS_B, DEFAULT_SIZES_MIB, PHASE_ORDER

__all__ = ("build_parser", "main", "parse_args", "phase_letters", "sizes_mib")


def phase_letters(text: str) -> str:
    """``--phases``: letters of ABECDF, each at most once, run in the order given.

    :raises argparse.ArgumentTypeError: an unknown or repeated letter, or none.
    """
    if not text:
        raise argparse.ArgumentTypeError(f"no phase named: give letters of {PHASE_ORDER}")
    for i, letter in enumerate(text):
        if letter not in PHASE_ORDER:
            raise argparse.ArgumentTypeError(f"unknown phase {letter!r}: the phases are {', '.join(PHASE_ORDER)}")
        if letter in text[:i]:
            raise argparse.ArgumentTypeError(f"phase {letter!r} named twice")
    return text


def sizes_mib(text: str) -> list[int]:
    """``--sizes``: phase D's sizes in MiB, positive integers separated by commas.

    :raises argparse.ArgumentTypeError: anything else.
    """
    sizes = []
    for part in text.split(","):
        try:
            size = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"size {part.strip()!r} is not a whole number of MiB") from None
        if size <= 0:
            raise argparse.ArgumentTypeError(f"size {size} MiB: sizes are positive")
        sizes.append(size)
    return sizes


def positive_seconds(text: str) -> float:
    """:raises argparse.ArgumentTypeError: not a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The parser, the children's options hidden.  Never raises."""
    ap = argparse.ArgumentParser(
        prog="python -m kvflow_tools.gpu",
        description=(__package__ and sys.modules[__package__].__doc__) or "",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--out", help="output folder (required)")
    ap.add_argument(
        "--phases", type=phase_letters, default=PHASE_ORDER, help=f"which phases, in this order (default {PHASE_ORDER})"
    )
    default_sizes = ",".join(map(str, DEFAULT_SIZES_MIB))
    ap.add_argument(
        "--sizes", type=sizes_mib, default=list(DEFAULT_SIZES_MIB), help=f"phase D's sizes in MiB ({default_sizes})"
    )
    ap.add_argument("--budget", type=positive_seconds, default=320.0, help="seconds for the whole run (default 320)")
    ap.add_argument("--limit-scale", type=positive_seconds, default=1.0, help="multiply every phase's time limit")
    ap.add_argument("--role", choices=["parent", "p", "d", "env"], default="parent", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--geometry", choices=["b", "bw"], default="b", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=BLOCKS_B, help=argparse.SUPPRESS)
    ap.add_argument("--unbound", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--exported", action="store_true", help=argparse.SUPPRESS)  # P's caches: driver-mapped chunks
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options; the parent's ``--out`` is required.

    :raises SystemExit: bad options (status 2, the message on stderr), or ``--help`` (status 0).
    """
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.role == "parent" and not args.out:
        ap.error("--out is required")
    return args


def run_parent(args: argparse.Namespace) -> int:
    """The phases into ``args.out``; the exit status (`run_phases`').

    :raises OSError: the output folder cannot be written.
    """
    from kvflow_tools.gpu.phases import plan_phases, run_phases
    from kvflow_tools.gpu.run import Run, interrupt_on_signals

    run = Run(Path(args.out), args.device, args.budget)
    interrupt_on_signals(run)
    try:
        sizes = ",".join(map(str, args.sizes))
        run.log(f"kvflow GPU check: device={args.device} out={args.out} phases={args.phases} budget={args.budget}s")
        run.log(f"phase D's sizes: {sizes} MiB")
        return run_phases(run, plan_phases(run, args.phases, args.sizes), args.limit_scale)
    except KeyboardInterrupt as exc:  # between phases
        run.log(f"interrupted ({exc})")
        return 2
    finally:
        run.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options and run the role they name; the exit status.

    :raises SystemExit: bad options.
    :raises OSError: the parent's output folder cannot be written.
    """
    args = parse_args(argv)
    if args.role == "env":
        from kvflow_tools.gpu.child import env_entry

        return env_entry(args)
    if args.role in ("p", "d"):
        from kvflow_tools.gpu.child import child_entry

        return child_entry(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
