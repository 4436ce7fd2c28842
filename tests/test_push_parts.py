"""A hook's push parts given to the rank's engine as one order (`RankAgent.post_groups`).

The parts of one layer take their places in their transfers' chains in the order given; a
chunk's blocks travel with its first part only, and a later part naming none reuses them; a
part that is not one is refused alone, by its index.  The engine is a recorder of what the
agent asks of it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvflow.integrations.vllm.rank_agent import RankAgent
from kvflow.runtime.frames import error_from_record


class Recorder:
    engine_id = "prefill-tp0"

    def __init__(self) -> None:
        self.posted: list[tuple[str, tuple[int, ...], tuple[int, int], bool]] = []
        self.aborted: list[str] = []

    async def kv_ready(self, transfer_id: str, epoch: int, **kwargs: Any) -> None:
        await asyncio.sleep(0)
        self.posted.append((transfer_id, tuple(kwargs["block_ids"]), kwargs["layers"], kwargs["final"]))

    async def abort(self, transfer_id: str, *args: Any) -> None:
        self.aborted.append(transfer_id)


def part(tid: str, blocks: list[int] | None, unit: int, final: bool, first: bool) -> list[Any]:
    return [tid, 1, blocks, unit, [unit * 2, unit * 2 + 2], final, 0, first, "decode-tp0"]


def test_parts_go_in_order_and_a_chunks_blocks_travel_once() -> None:
    async def run() -> tuple[list[list[Any]], list[list[Any]], Recorder]:
        engine = Recorder()
        agent = RankAgent(engine)  # type: ignore[arg-type]
        first = await agent.post_groups(None, [part("a", [3, 4], 0, False, True), part("b", [9], 0, False, True)])
        later = await agent.post_groups(None, [part("a", None, 1, True, False), part("b", None, 1, True, False)])
        return first, later, engine

    first, later, engine = asyncio.run(run())
    assert first == [] and later == []
    assert engine.posted == [
        ("a", (3, 4), (0, 2), False),
        ("b", (9,), (0, 2), False),
        ("a", (3, 4), (2, 4), True),
        ("b", (9,), (2, 4), True),
    ]


def test_a_part_that_is_not_one_is_refused_alone_by_its_index() -> None:
    async def run() -> tuple[list[list[Any]], Recorder]:
        engine = Recorder()
        agent = RankAgent(engine)  # type: ignore[arg-type]
        failures = await agent.post_groups(
            None,
            [
                part("a", [1], 0, True, True),
                ["too", "short"],
                part("c", None, 0, True, True),  # names no blocks, and nothing before it did
                "not a list",  # type: ignore[list-item]
            ],
        )
        return failures, engine

    failures, engine = asyncio.run(run())
    assert [index for index, _ in failures] == [1, 2, 3]
    assert all(type(error_from_record(record)).__name__ == "UsageError" for _, record in failures)
    assert engine.posted == [("a", (1,), (0, 2), True)]


def test_an_answer_that_is_not_a_list_of_failures_fails_every_first_part_instead_of_leaving_it_open() -> None:
    """Each transfer's first part has a future the worker waits on to learn whether kvflow
    holds the blocks; an unreadable answer must settle them all, as failures."""
    import concurrent.futures

    from kvflow.errors import KVFlowError
    from kvflow.integrations.vllm.producer import _settle_parts

    settled = {0: concurrent.futures.Future[Any](), 2: concurrent.futures.Future[Any]()}
    answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
    answer.set_result([["one", "two", "three"]])  # not [index, error]
    _settle_parts(settled, answer)
    assert all(isinstance(f.exception(), KVFlowError) for f in settled.values())
    good: concurrent.futures.Future[Any] = concurrent.futures.Future()
    good.set_result([[2, ["UsageError", "refused"]]])
    settled = {0: concurrent.futures.Future[Any](), 2: concurrent.futures.Future[Any]()}
    _settle_parts(settled, good)
    assert settled[0].result() is None and type(settled[2].exception()).__name__ == "UsageError"
