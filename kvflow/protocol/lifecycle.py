"""An engine's own life, as a table: new, starting, running, closing, closed.

Why a table: what an engine does with a call or a callback depends on where it is in its life
(a transfer asked for while it closes is refused, a message that arrives after it closed is
dropped, a start that fails closes what it opened, a second `aclose` is a no-op).  Written as
rows and per-state sets, the rules are checked for totality by the tests and drawn by `kvflow
diagrams`, and the engine reads them instead of comparing strings.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from kvflow.protocol.tables import complete, pairs

__all__ = ("ACCEPTS_CALLS", "DRIVES_INPUTS", "START", "TABLE", "Do", "Event", "Life", "Lifecycle")


class Life(Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class Event(Enum):
    START = "start"  # `start()` was called
    STARTED = "started"  # memory registered, channel and transport hooked up
    START_FAILED = "start-failed"
    CLOSE = "close"  # `aclose()` was called
    WOUND_DOWN = "wound-down"  # transfers drained or aborted, peers told, everything closed


class Do(Enum):
    REFUSE = "refuse"  # the call is refused (UsageError) and nothing changes
    OPEN = "open"  # register memory, hook the transport and the channel up
    CLOSE_OWNED = "close-owned"  # stop threads, close transport and channel (nothing ran)
    WIND_DOWN = "wind-down"  # let transfers finish, abort the rest, say goodbye, close


Row = tuple[Life, tuple[Do, ...]]

START = Life.NEW

_ROWS: dict[tuple[Life, Event], Row] = {
    (Life.NEW, Event.START): (Life.STARTING, (Do.OPEN,)),
    (Life.NEW, Event.CLOSE): (Life.CLOSED, (Do.CLOSE_OWNED,)),
    (Life.STARTING, Event.STARTED): (Life.RUNNING, ()),
    (Life.STARTING, Event.START_FAILED): (Life.CLOSED, (Do.CLOSE_OWNED,)),
    (Life.RUNNING, Event.CLOSE): (Life.CLOSING, (Do.WIND_DOWN,)),
    (Life.CLOSING, Event.WOUND_DOWN): (Life.CLOSED, ()),
    # closing twice does nothing
    (Life.CLOSING, Event.CLOSE): (Life.CLOSING, ()),
    (Life.CLOSED, Event.CLOSE): (Life.CLOSED, ()),
}

# Refused, changing nothing: a second start, a close while it starts (the start ends first),
# and (a bug if it came) an event of the engine's own out of order.
_REFUSED = {
    *pairs([Life.NEW], [Event.STARTED, Event.START_FAILED, Event.WOUND_DOWN]),
    *pairs([Life.STARTING], [Event.START, Event.CLOSE, Event.WOUND_DOWN]),
    *pairs([Life.RUNNING], [Event.START, Event.STARTED, Event.START_FAILED, Event.WOUND_DOWN]),
    *pairs([Life.CLOSING], [Event.START, Event.STARTED, Event.START_FAILED]),
    *pairs([Life.CLOSED], [Event.START, Event.STARTED, Event.START_FAILED, Event.WOUND_DOWN]),
}

TABLE: Mapping[tuple[Life, Event], Row] = complete(
    "lifecycle", Life, Event, _ROWS, _REFUSED, lambda life: (life, (Do.REFUSE,))
)

ACCEPTS_CALLS = frozenset({Life.RUNNING})  # transfers, connects, memory changes
DRIVES_INPUTS = frozenset({Life.RUNNING, Life.CLOSING})  # control messages and links feed the pure layer


class Lifecycle:
    """Where one engine is in its life."""

    def __init__(self) -> None:
        self.state = START

    def feed(self, event: Event) -> tuple[Do, ...]:
        """Move along the row for `event` and return what it asks for.  Never raises."""
        target, dos = TABLE[(self.state, event)]
        self.state = target
        return dos

    @property
    def accepts_calls(self) -> bool:
        return self.state in ACCEPTS_CALLS

    @property
    def drives_inputs(self) -> bool:
        return self.state in DRIVES_INPUTS

    @property
    def closed(self) -> bool:
        return self.state is Life.CLOSED
