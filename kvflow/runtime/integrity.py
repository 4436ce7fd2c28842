"""End-to-end KV integrity (opt-in): P seals each WRITE with digests of its KV, D checks what landed.

Why: the costliest P/D failure is silent: the wrong blocks, or a torn WRITE, and D decodes from
them with no error anywhere.  With `EngineConfig.integrity` on, P hashes, for each position of a
WRITE, its own block of each layer the WRITE moves, read by the layout's arithmetic and not
through the descriptors the planner made, and sends in the WRITE's notification one XXH3-64
digest per layer and one per D block (`kvflow.protocol.messages.Seal`).  D hashes the blocks it
registered for those positions the same way before the batch counts: a byte that landed wrong,
or a planner that sent a block where another belonged, fails the transfer with the layers, the
blocks and the two engines named.  One wrong byte changes one layer's digest and one block's.
D with the check on refuses a WRITE that comes unsealed.

`EngineConfig.integrity_sample` N checks one transfer in N, picked by a digest of its id so that
P and D pick the same ones.  Hashing is the `xxhash` package (C, about 15 GiB/s on one core here)
over the memory in place; host memory only (a VRAM region is refused when the engine is made),
and P and D with the same KV spec (heterogeneous tensor parallelism and block sizes: refused,
with why).  P hashes on the thread that plans and posts the WRITE; D, on its event loop as the
notification arrives.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable, Sequence

from kvflow.errors import ConfigError, InvalidBatch, PeerProtocolError
from kvflow.layout import KVLayout
from kvflow.layout.spec import MemoryType, Region
from kvflow.protocol.actions import SubmitOp
from kvflow.protocol.messages import Seal, TransferKey, decode_notification, encode_notification

__all__ = ("Integrity", "sampled")

Digests = tuple[tuple[int, int], ...]  # (layer or D block, digest), in order
MAX_EVERY = 1 << 20


def _hasher() -> Callable[[bytes | memoryview], int]:
    """XXH3-64 of a buffer.  :raises ConfigError: the `xxhash` package is not installed."""
    try:
        import xxhash
    except ImportError:
        raise ConfigError("the integrity check needs the xxhash package: pip install xxhash") from None
    hasher: Callable[[bytes | memoryview], int] = xxhash.xxh3_64_intdigest
    return hasher


class Integrity:
    """Seals (P) and checks (D) the WRITEs of one engine, whose KV cache is `layout`."""

    def __init__(self, engine_id: str, layout: KVLayout, every: int = 1) -> None:
        """Checks one transfer in `every` (1: each), the same ones on both sides (`sampled`).

        :raises ConfigError: a region of `layout` is not host memory, `every` is not a positive
            integer, or xxhash is missing.
        """
        if type(every) is not int or not 0 < every <= MAX_EVERY:
            raise ConfigError(f"integrity_sample must be an integer in 1..{MAX_EVERY}, not {every!r}")
        self.every = every
        device = [i for i, region in enumerate(layout.regions) if region.memory is not MemoryType.DRAM]
        if device:
            raise ConfigError(f"the integrity check reads host memory; regions {device} are device memory")
        self.engine_id = engine_id
        self.layout = layout
        self.hash = _hasher()
        self.memory = [_view(region) for region in layout.regions]

    def seal(self, op: SubmitOp, remote: KVLayout) -> bytes:
        """`op`'s notification with the digests of the blocks it reads here (P, a WRITE to a peer
        whose KV cache is `remote`).

        :raises InvalidBatch: a transfer checked (`sampled`) goes to a peer whose KV spec differs
            from this side's (not supported yet), or its digests do not fit in a notification.
        """
        key, batch, last, _ = decode_notification(op.notification)
        if not sampled(key, self.every):
            return op.notification
        if remote.spec != self.layout.spec or op.fine_start or len(op.local_blocks) != len(op.remote_blocks):
            raise InvalidBatch(
                f"{op.key}: the integrity check needs P and D with the same KV spec (heterogeneous tensor "
                f"parallelism and block sizes are not checked yet): {self.layout.spec} and {remote.spec}"
            )
        layers, blocks = self._digests(op.local_blocks, op.remote_blocks, op.layers)
        seal = Seal(op.remote_blocks, op.layers, layers, blocks)
        return encode_notification(key, batch, last, seal)

    def check(
        self, peer: str, payload: bytes, remote: KVLayout, registered: Callable[[TransferKey], Sequence[int]]
    ) -> str | None:
        """Why the WRITE `payload` announces (from `peer`, whose KV cache is `remote`) did not put
        here what P holds, or None when it did (D).  A payload that does not parse is the inbox's
        business (None); `registered(key)` are the blocks this side registered for `key`.
        Never raises."""
        try:
            key, _, _, seal = decode_notification(payload)
        except PeerProtocolError:
            return None
        where, mine = f"{peer} -> {self.engine_id}", registered(key)
        if not mine or (seal is None and not sampled(key, self.every)):
            return None  # no such transfer here (the inbox counts it), or one not checked
        if seal is None:
            why = "P's integrity check is off, or samples with another integrity_sample"
            return f"integrity: {where}: P's WRITE came without digests ({why})"
        strangers = sorted(set(seal.blocks) - set(mine))
        if strangers:
            return f"integrity: {where}: P's WRITE names blocks {strangers[:8]} D did not register for {key}"
        spans = seal.layers or (0, self.layout.spec.num_layers)
        if remote.spec != self.layout.spec or spans[1] > self.layout.spec.num_layers:
            return f"integrity: {where}: P's KV spec is not D's, or its layers {spans} are not D's"
        layers, blocks = self._digests(seal.blocks, seal.blocks, seal.layers)
        return _compare(where, (layers, seal.layer_digests, "layer"), (blocks, seal.block_digests, "block"))

    def _digests(
        self, here: Sequence[int], names: Sequence[int], layers: tuple[int, int] | None
    ) -> tuple[Digests, Digests]:
        """Per layer and per block (named by `names`, D's ids), the digest of their units' digests;
        a unit is block `here[i]` of one layer, its arrays' bytes one after the other."""
        first, stop = layers or (0, self.layout.spec.num_layers)
        block_len = self.layout.block_len
        by_layer: dict[int, list[int]] = {layer: [] for layer in range(first, stop)}
        by_block: dict[int, list[int]] = {name: [] for name in names}
        for block, name in zip(here, names, strict=True):
            for layer in range(first, stop):
                chunks = [
                    self.memory[a.region][a.offset + block * a.stride : a.offset + block * a.stride + block_len]
                    for a in self.layout.layer_arrays(layer)
                ]
                unit = self.hash(chunks[0] if len(chunks) == 1 else b"".join(chunks))
                by_layer[layer].append(unit)
                by_block[name].append(unit)
        return self._folded(by_layer), self._folded(by_block)

    def _folded(self, groups: dict[int, list[int]]) -> Digests:
        return tuple(
            (key, self.hash(b"".join(d.to_bytes(8, "little") for d in units))) for key, units in groups.items()
        )


def sampled(key: TransferKey, every: int) -> bool:
    """Whether the transfer `key` is one of the one in `every` checked: by a digest of its id, so
    that P and D, told the same `every`, pick the same transfers.  Never raises."""
    tag = hashlib.blake2b(key.transfer_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return every <= 1 or int.from_bytes(tag, "little") % every == 0


def _view(region: Region) -> memoryview:
    """The region's bytes, in place (the engine keeps them registered while it runs)."""
    return memoryview((ctypes.c_char * region.length).from_address(region.base)).cast("B")


def _compare(where: str, *sides: tuple[Digests, Digests, str]) -> str | None:
    """Which layers and blocks differ between what landed and what P read, or None."""
    wrong: list[str] = []
    for landed, sent, what in sides:
        mine, theirs = dict(landed), dict(sent)
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if differ:
            wrong.append(f"{what}{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ[:8]))}")
    if not wrong:
        return None
    return f"integrity: {where}: the bytes that landed in {' and '.join(wrong)} differ from what P holds"
