"""Helpers for D with prefix caching on: prompts that share prefixes, and what each side did.

Why a module: the compatibility matrix's prefix rows and the detailed tests of D's prefix
cache run the same moves on vLLM's real Scheduler (the stand-in), with pages keyed by their
tokens, so that KV D holds in its prefix cache checks against what P computes.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import RequestStatus

from kvflow.protocol.machine import Machine
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Outcome, Role, State
from kvflow_tools.standin import StandInEngine
from tests.vllm_pairs import BLOCK_SIZE, kvflow_engine, make_pair, params, run, settle


def prompt(blocks: int, extra: int = 0, *, seed: int = 0, shared: list[int] | None = None) -> list[int]:
    """`shared` followed by tokens of `seed` up to `blocks` whole blocks plus `extra` tokens."""
    tokens = list(shared or [])
    length = blocks * BLOCK_SIZE + extra
    tokens += [3 + (seed * 131 + i * 7) % 900 for i in range(len(tokens), length)]
    return tokens


def send(p: StandInEngine, d: StandInEngine, tid: str, tokens: list[int]) -> tuple[Any, Any]:
    """The router's two legs for one prompt, D's first; (P request, D request)."""
    d_req = send_decode(p, d, tid, tokens)
    return send_prefill(p, d, tid, tokens), d_req


def send_decode(p: StandInEngine, d: StandInEngine, tid: str, tokens: list[int]) -> Any:
    kv = params(p, d, tid)
    return d.add(f"d-{tid}", len(tokens), 4, {"do_remote_prefill": True, "kvflow": kv}, tag=tid, prompt=tokens)


def send_prefill(p: StandInEngine, d: StandInEngine, tid: str, tokens: list[int]) -> Any:
    kv = params(p, d, tid)
    return p.add(f"p-{tid}", len(tokens), 1, {"do_remote_decode": True, "kvflow": kv}, tag=tid, prompt=tokens)


def move(p: StandInEngine, d: StandInEngine, tid: str, tokens: list[int], limit: float = 20.0) -> Any:
    """One prompt through P and D, D's pages checked (its prefix cache's and the loaded ones)."""
    p_req, d_req = send(p, d, tid, tokens)
    settle((p, d), [p_req, d_req], limit)
    assert_read_right(d, d_req)
    return d_req


def assert_read_right(d: StandInEngine, d_req: Any) -> None:
    assert d.checked.get(d_req.request_id) == 0, f"D read pages that do not hold P's KV: {d.checked}"
    assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(d_req.output_token_ids) == 4


def decode_side(d: StandInEngine, tid: str) -> Machine:
    """D's transfer `tid`: its registered blocks and first position (once the engine has it)."""
    key = TransferKey(tid, 1)
    run((d,), lambda: kvflow_engine(d).core.store.get(key, Role.DECODE) is not None)
    m: Machine = kvflow_engine(d).core.machine(key, Role.DECODE)
    return m


def prefill_side(p: StandInEngine, tid: str) -> Machine:
    m: Machine = kvflow_engine(p).core.machine(TransferKey(tid, 1), Role.PREFILL)
    return m


def written_blocks(p: StandInEngine, tid: str) -> float:
    """How many of its blocks (all layers) P wrote for transfer `tid`."""
    m = prefill_side(p, tid)
    spans = [(b, span) for b in m.batches if (span := m.wanted(b)) is not None]
    covered = sum((stop - start) * (b.layers[1] - b.layers[0]) for b, (start, stop) in spans)
    layers: int = kvflow_engine(p).core.num_layers
    return covered / layers


def pair(**options: Any) -> tuple[StandInEngine, StandInEngine]:
    """P, and D with prefix caching on (vLLM's default)."""
    d_options = {"prefix_caching": True, **options.pop("d_options", {})}
    return make_pair(d_options=d_options, **options)


# ---------------------------------------------------------------- scenarios (P, D made by `pair`)


def partial_hit(p: StandInEngine, d: StandInEngine) -> None:
    """D's prefix cache holds the first two blocks of a prompt: D registers the two after them
    (from block position 2), P writes only those, and D's pages all hold P's KV."""
    warm = prompt(3, 7, seed=1)
    move(p, d, "warm", warm)
    assert (decode_side(d, "warm").first_position, written_blocks(p, "warm")) == (0, 4)
    move(p, d, "hit", prompt(3, 7, seed=2, shared=warm[: 2 * BLOCK_SIZE]))
    m = decode_side(d, "hit")
    assert (m.first_position, len(m.block_ids), prefill_side(p, "hit").remote_first) == (2, 2, 2)
    assert written_blocks(p, "hit") == 2


def full_hit(p: StandInEngine, d: StandInEngine) -> None:
    """D holds every block but the one with only the prompt's last token (which vLLM
    recomputes): D's request runs at once, without waiting for a load; P hears that D needs
    nothing and frees its blocks with no WRITE, long before any deadline (60 s); both succeed."""
    warm = prompt(3, 7, seed=3)
    move(p, d, "warm", warm)
    p_req, d_req = send(p, d, "full", warm[: 2 * BLOCK_SIZE + 1])
    d.step()
    assert d_req.status == RequestStatus.RUNNING  # vLLM schedules it with its 64-token hit
    settle((p, d), [p_req, d_req])
    assert_read_right(d, d_req)
    m, pm = decode_side(d, "full"), prefill_side(p, "full")
    assert (m.block_ids, m.outcome) == ((), Outcome.SUCCEEDED)
    assert (pm.remote_blocks, pm.state, pm.outcome) == ((), State.DONE, Outcome.SUCCEEDED)
    assert written_blocks(p, "full") == 0 and p.free_blocks() == p.options.num_blocks - 1


def shared_in_flight(p: StandInEngine, d: StandInEngine) -> None:
    """Two requests for the same prompt reach D while the first one's KV is still coming: vLLM
    must not let the second read the first's blocks as cached before that KV landed.  Each
    registers its own blocks after the one block D's cache really holds, and both read P's KV."""
    warm = prompt(1, seed=4)
    move(p, d, "warm", warm)
    tokens = prompt(3, 7, seed=5, shared=warm)
    first = send_decode(p, d, "first", tokens)
    run((d,), lambda: first.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
    second = send_decode(p, d, "second", tokens)
    run((d,), lambda: second.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
    a, b = decode_side(d, "first"), decode_side(d, "second")
    assert (a.first_position, b.first_position) == (1, 1), "the second request hit blocks still in flight"
    assert not set(a.block_ids) & set(b.block_ids)
    requests = [first, second, send_prefill(p, d, "first", tokens), send_prefill(p, d, "second", tokens)]
    settle((p, d), requests)
    assert_read_right(d, first)
    assert_read_right(d, second)


def failed_load(p: StandInEngine, d: StandInEngine) -> None:
    """A load that fails (P never computes the prompt: D's transfer expires) leaves no block of
    it cached: the same prompt later hits only what D's cache held before, and reads P's KV."""
    warm = prompt(1, seed=6)
    move(p, d, "warm", warm)
    tokens = prompt(3, 7, seed=7, shared=warm)
    lost = send_decode(p, d, "lost", tokens)
    settle((p, d), [lost], limit=30.0)
    assert lost.status == RequestStatus.FINISHED_ERROR
    move(p, d, "again", tokens)
    assert decode_side(d, "again").first_position == 1, "a block of the failed load was a cache hit"
