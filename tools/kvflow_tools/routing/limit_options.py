"""The router's command-line options for its client limits (`kvflow_tools.routing.http_limits`).

Why apart: the limits module is the connections' and bodies' bookkeeping; how each limit is named
and checked on the command line is the router's interface, read separately.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvflow_tools.routing.http_limits import (
    FDS_PER_CONNECTION,
    PER_CLIENT_DIVISOR,
    RESERVED_FDS,
    Limits,
    default_max_connections,
)

__all__ = ("add_arguments", "limits_from", "positive")


def positive(kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """An argparse type: `kind` of the option's value, refused unless it is above 0."""

    def parse(value: str) -> Any:
        try:
            number = kind(value)
        except ValueError:
            number = 0
        if not number > 0:
            raise argparse.ArgumentTypeError(f"{value!r} is not a positive {what}")
        return number

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The limits' options (see `Limits`)."""
    seconds, count = positive(float, "number of seconds"), positive(int, "whole number")
    parser.add_argument("--max-body", type=count, default=64 << 20, help="largest request body in bytes")
    parser.add_argument(
        "--header-timeout",
        type=seconds,
        default=10.0,
        help="seconds a connection has for a request's head, from its start or from the head's first byte (default 10)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=seconds,
        default=75.0,
        help="seconds a kept-alive connection may wait for its next request after an answer; keep it above "
        "the clients' own keep-alive (default 75)",
    )
    parser.add_argument(
        "--body-timeout", type=seconds, default=30.0, help="seconds a request has for its whole body (default 30)"
    )
    parser.add_argument(
        "--body-budget",
        type=count,
        default=256 << 20,
        help="request-body bytes in flight over all requests; beyond it 503 (default 256 MiB, at least --max-body)",
    )
    parser.add_argument(
        "--max-connections",
        type=count,
        default=None,
        help="client connections at once; more are closed at once (default: RLIMIT_NOFILE less "
        f"{RESERVED_FDS}, over {FDS_PER_CONNECTION}: {default_max_connections()} here)",
    )
    parser.add_argument(
        "--max-connections-per-client",
        type=count,
        default=None,
        help="client connections one client address may hold; at it, its longest idle one is closed for a new "
        f"one, or the new one refused (default a {PER_CLIENT_DIVISOR}th of --max-connections; behind a proxy "
        "give it --max-connections)",
    )


def limits_from(args: argparse.Namespace) -> Limits:
    """:raises ConfigError: see `Limits`."""
    return Limits(
        args.header_timeout,
        args.body_timeout,
        args.body_budget,
        args.max_body,
        args.max_connections,
        args.idle_timeout,
        args.max_connections_per_client,
    )
