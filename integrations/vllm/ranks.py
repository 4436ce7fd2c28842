"""Which tensor-parallel ranks of P feed which ranks of D, and the transfer id of each pair.

Why its own module: P and D may run different tensor parallelism.  Both sides must agree,
without talking, on which (P rank, D rank) pairs move bytes and what each pair's transfer is
called; this is that agreement, as pure functions of the two TP sizes and the model's KV head
count (no vLLM import, no I/O).

vLLM's rule for heads: rank ``r`` of ``tp`` holds ``max(1, H // tp)`` of the model's ``H`` KV
heads starting at ``r * H // tp``; with more ranks than heads each head is replicated on
``tp // H`` consecutive ranks, and MLA's latent cache (``H`` = 1) is on every rank.  D rank
``d`` receives each head it holds from one P rank holding it; where several do (replicas), D
ranks are spread over them (``d`` modulo the replicas), so that no P rank sends everything when
several could.  With equal TP this is rank ``r`` to rank ``r``, under the request's own transfer
id; otherwise each pair's transfer id is derived from it.

How a rank finds the other side's ranks: the router names the peer engine's rank 0 and, in the
request's kvflow params, each side's ``tp_size``; every rank announces in its handshake layout
its engine's rank table (engine id and control address of every rank), so D (push) or P (pull)
connects to the named rank 0, reads the table, and reaches the ranks it pairs with.  The TP
sizes travel with the request because P must know, when its prefill ends and before any D rank
has spoken to it, which pairs it feeds (a P rank that feeds none frees its blocks at once); the
handshake then confirms them (a peer announcing another rank count is refused, by name).

Pure functions, except `reach_rank`, which runs on a rank's engine thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvflow.errors import BlockSizeMismatch, ConfigError
from kvflow.layout import KVLayout
from kvflow.layout.groups import KVGroup
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Role

if TYPE_CHECKING:
    from kvflow.integrations.vllm.params import PeerRef, TransferParams
    from kvflow.runtime.engine import Engine

__all__ = (
    "group_transfer_id",
    "heads_of",
    "pair_keys",
    "pair_transfer_id",
    "rank_name",
    "ranked_layout",
    "reach_rank",
    "sources",
    "state_sources",
    "targets",
    "tp_sizes",
    "transfer_parts",
)


def heads_of(total_heads: int, tp: int, rank: int) -> range:
    """The model's KV heads rank `rank` of `tp` holds, as vLLM shards (and replicates) them.

    :raises ConfigError: a rank outside ``0..tp-1``, or heads that do not split over `tp` ranks.
    """
    if total_heads <= 0 or tp <= 0 or not 0 <= rank < tp:
        raise ConfigError(f"rank {rank} of {tp} ranks with {total_heads} KV heads does not exist")
    if total_heads % tp and tp % total_heads:
        raise ConfigError(f"{total_heads} KV heads do not split over {tp} tensor-parallel ranks")
    first = rank * total_heads // tp
    return range(first, first + max(1, total_heads // tp))


def sources(total_heads: int, p_tp: int, d_tp: int, d_rank: int) -> list[int]:
    """The P ranks that send D rank `d_rank` its heads, ascending.

    :raises ConfigError: see `heads_of`.
    """
    chosen = set()
    for head in heads_of(total_heads, d_tp, d_rank):
        replicas = [p for p in range(p_tp) if head in heads_of(total_heads, p_tp, p)]
        chosen.add(replicas[d_rank % len(replicas)])
    return sorted(chosen)


def state_sources(p_tp: int, d_tp: int, d_rank: int) -> list[int]:
    """The P ranks whose shard of a Mamba state overlaps D rank `d_rank`'s, ascending.

    :raises ConfigError: a rank outside ``0..d_tp-1``, or a tensor parallelism below 1.
    """
    if p_tp <= 0 or d_tp <= 0 or not 0 <= d_rank < d_tp:
        raise ConfigError(f"rank {d_rank} of {d_tp} ranks (P has {p_tp}) does not exist")
    return [p for p in range(p_tp) if p * d_tp < (d_rank + 1) * p_tp and d_rank * p_tp < (p + 1) * d_tp]


def targets(total_heads: int, p_tp: int, d_tp: int, p_rank: int) -> list[int]:
    """The D ranks P rank `p_rank` sends to, ascending (none: it frees its blocks at once).

    :raises ConfigError: see `heads_of`.
    """
    return [d for d in range(d_tp) if p_rank in sources(total_heads, p_tp, d_tp, d)]


def pair_transfer_id(transfer_id: str, p_tp: int, d_tp: int, p_rank: int, d_rank: int) -> str:
    """The transfer id of the (P rank, D rank) pair: the request's own with equal TP (rank r to
    rank r), else derived from it, the same on both sides."""
    if p_tp == d_tp and p_rank == d_rank:
        return transfer_id
    return f"{transfer_id}@p{p_rank}d{d_rank}"


def ranked_layout(
    layout: KVLayout, engine: str, rank: int, tp_size: int, total_heads: int, addresses: Sequence[str]
) -> KVLayout:
    """`layout` naming this rank's KV heads and its engine's ranks (``<engine>-tp<r>`` at
    ``addresses[r]``; none: not announced, which a peer accepts for one rank only), for the
    handshake.

    :raises ConfigError: this rank's heads are not what vLLM's sharding gives it.
    """
    spec = layout.spec
    heads = heads_of(total_heads, tp_size, rank)
    if len(heads) != spec.num_kv_heads:
        raise ConfigError(
            f"rank {rank} of {tp_size} holds {spec.num_kv_heads} KV heads, vLLM's sharding of {total_heads} "
            f"gives it {len(heads)}"
        )
    ranks = tuple((rank_name(engine, r), address) for r, address in enumerate(addresses))
    spec = dataclasses.replace(spec, head_start=heads.start, total_kv_heads=total_heads, tp_rank=rank, tp_size=tp_size)
    return dataclasses.replace(layout, spec=spec, rank=rank, ranks=ranks)


def tp_sizes(params: TransferParams, role: Role, tp_size: int) -> tuple[int, int]:
    """(P's, D's) tensor parallelism for a request, on an engine of `tp_size` ranks playing
    `role`: as its params say, this engine's where they say nothing (the peer's is then checked
    against its handshake).

    :raises ConfigError: the params give this engine another tensor parallelism, or P
        assigned the transfer itself and has another tensor parallelism than this engine.
    """
    mine = params.decode if role is Role.DECODE else params.prefill
    if mine is not None and mine.tp_size and mine.tp_size != tp_size:
        raise ConfigError(
            f"the request's kv_transfer_params give engine {mine.engine!r} {mine.tp_size} tensor-parallel ranks; "
            f"it has {tp_size}"
        )
    prefill = params.prefill.tp_size or tp_size
    if params.decode is None:  # a sequential router's pull: P made one transfer per rank, for equal ranks
        if prefill != tp_size:
            raise ConfigError(
                f"a transfer P assigned itself (a sequential router's) needs equal tensor parallelism: "
                f"engine {params.prefill.engine!r} has {prefill} ranks, this one {tp_size}"
            )
        return prefill, tp_size
    return prefill, params.decode.tp_size or tp_size


def rank_name(engine: str, rank: int) -> str:
    """The kvflow engine id of rank `rank` of vLLM engine `engine`: each rank is a peer of its own."""
    return f"{engine}-tp{rank}"


def pair_keys(
    params: TransferParams, role: Role, rank: int, tp_size: int, total_heads: int, state: bool = False
) -> list[tuple[int, TransferKey]]:
    """(the other side's rank, the pair's transfer key) of every pair rank `rank` is part of,
    for attention groups (pairs that share KV heads) or, with `state`, for Mamba state groups
    (pairs whose state shards overlap).

    :raises ConfigError: see `tp_sizes` and `heads_of`.
    """
    p_tp, d_tp = tp_sizes(params, role, tp_size)
    if role is Role.DECODE:
        feeding = state_sources(p_tp, d_tp, rank) if state else sources(total_heads, p_tp, d_tp, rank)
        ranks = [(p, p, rank) for p in feeding]
    else:
        fed = (
            [d for d in range(d_tp) if rank in state_sources(p_tp, d_tp, d)]
            if state
            else targets(total_heads, p_tp, d_tp, rank)
        )
        ranks = [(d, rank, d) for d in fed]
    return [
        (other, TransferKey(pair_transfer_id(params.transfer_id, p_tp, d_tp, p, d), params.epoch))
        for other, p, d in ranks
    ]


def group_transfer_id(transfer_id: str, group: int, groups: int) -> str:
    """The transfer id of KV cache group `group` of a pair's transfer: the pair's own for a
    model with one group, else derived from it, the same on both sides."""
    return transfer_id if groups == 1 else f"{transfer_id}#g{group}"


def transfer_parts(
    params: TransferParams,
    role: Role,
    rank: int,
    tp_size: int,
    total_heads: int,
    groups: int | Sequence[KVGroup] = 1,
) -> list[tuple[int, int, TransferKey]]:
    """(the other side's rank, the KV cache group, the part's transfer key) of every transfer
    rank `rank` takes part in for a request: one per rank pair (`pair_keys`: attention groups
    between the ranks sharing heads, state groups between those sharing state shards) and KV
    cache group (each group moves its layers with its own blocks), ordered by the other rank,
    then the group.

    :raises ConfigError: see `pair_keys`.
    """
    kinds = [False] * groups if isinstance(groups, int) else [group.state for group in groups]
    pairs = {state: pair_keys(params, role, rank, tp_size, total_heads, state) for state in set(kinds)}
    parts = [
        (other, index, TransferKey(group_transfer_id(key.transfer_id, index, len(kinds)), key.epoch))
        for index, state in enumerate(kinds)
        for other, key in pairs[state]
    ]
    return sorted(parts, key=lambda part: (part[0], part[1]))


async def reach_rank(engine: Engine, peer: PeerRef, tp_size: int, rank: int, role: Role) -> str:
    """Associate `engine` with rank `rank` of `peer`, found in the rank table `peer`'s rank 0
    (at the address the router gave) announces in its handshake; its engine id.

    :raises ConfigError: the peer announces another number of ranks than `tp_size`.
    :raises BlockSizeMismatch: D's block size is not a multiple of P's.
    :raises KVFlowError: a handshake failed (see `Engine.connect`).
    """
    first = f"{peer.engine}-tp0"
    if first not in engine.peers():
        await engine.connect(first, peer.address)
    layout = engine.peer_layout(first)
    table = layout.ranks if layout is not None and layout.ranks else ((first, peer.address),)
    if len(table) != tp_size:
        raise ConfigError(
            f"engine {peer.engine!r} announces {len(table)} tensor-parallel ranks in its handshake; the request's "
            f"kv_transfer_params (kvflow tp_size) say {tp_size}"
        )
    name, address = table[rank]
    if name not in engine.peers():
        await engine.connect(name, address)
    remote = engine.peer_layout(name)
    if remote is not None:
        prefill, decode = (remote, engine.layout) if role is Role.DECODE else (engine.layout, remote)
        if decode.spec.block_size % prefill.spec.block_size:
            raise BlockSizeMismatch(
                f"D's block size ({decode.spec.block_size} tokens) must be a multiple of P's "
                f"({prefill.spec.block_size}): P's blocks land in D's at token offsets (vLLM --block-size)",
                name,
            )
    return name
