"""End-to-end KV integrity (opt-in): P seals each WRITE with digests of its KV, D checks what landed.

Why: the costliest P/D failure is silent: the wrong blocks, a wrong head slice or a torn WRITE,
and D decodes from them with no error anywhere.  With `EngineConfig.integrity` on, P hashes, for
each position of a WRITE and each layer it moves, what that position carries, read from its
memory by the layout's arithmetic and not through the descriptors the planner made, and sends
in the WRITE's notification one XXH3-64 digest per layer and one per D block
(`kvflow.protocol.messages.Seal`).  D hashes what it should have received the same way, from
its own blocks, before the batch counts: a byte that landed wrong, or a planner that sent a
block or a head where another belonged, fails the transfer with the layers, the blocks and the
two engines named.  One wrong byte changes one layer's digest and one block's.  D with the
check on refuses a WRITE that comes unsealed.

What a position carries: a whole block of each of the layer's arrays between ranks that hold
the same heads in blocks of one size; otherwise the KV heads both ranks hold, for the tokens of
one block of the smaller block size, at their token offset in the other side's block
(`kvflow.layout.heads`); between ranks of different tensor parallelism, the shards of a Mamba /
linear-attention state page both hold (`kvflow.layout.states`).  Each side reads these in the
same order (head, then array), so that the digests compare whatever the two layouts' strides.

P seals every WRITE; `EngineConfig.integrity_sample` N has D check one transfer in N, picked
by a digest of the transfer (id and epoch) keyed with a secret D draws when it starts and never
sends: neither P nor whoever names the requests can tell which transfers D checks.  (Picking by
the id alone, as this did before, let the one who names the requests choose unchecked ones.  A
P that means harm can still seal the wrong bytes it writes: the check is for faults and bugs.)
D refuses an unsealed WRITE whether or not it picked the transfer, and checks on every WRITE
that the blocks P names are the transfer's.
Hashing is the `xxhash` package (C, about 16 GiB/s on one core here)
over host memory in place; GPU memory is copied to the host unit by unit first (the driver's
``cuMemcpyDtoH``, `cuda_ipc.CudaDriver`, on the thread that hashes), so both sides compute the
same digests whatever memory each holds.  That copy is the check's cost on a GPU (not yet
measured on one); a kernel hashing on the device would spare it.
P hashes on the thread that plans and posts the WRITE; D on that thread too (the engine's
writer; a small check on the loop), before the notification reaches the core
(`kvflow.runtime.dataplane`).  xxhash releases the GIL while it hashes a large buffer.
"""

from __future__ import annotations

import ctypes
import hashlib
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial

from kvflow.errors import ConfigError, InvalidBatch, LayoutMismatch, PeerProtocolError
from kvflow.layout import KVLayout
from kvflow.layout.groups import group_of
from kvflow.layout.heads import head_runs, shared_heads
from kvflow.layout.spec import MemoryType, Region
from kvflow.layout.states import parse_split, state_runs
from kvflow.protocol.actions import SubmitOp
from kvflow.protocol.messages import Seal, TransferKey, decode_notification, encode_notification
from kvflow.runtime.cuda_ipc import CudaDriver

__all__ = ("Integrity", "PendingCheck", "picked")

Digests = tuple[tuple[int, int], ...]  # (layer or D block, digest), in order
MAX_EVERY = 1 << 20


Hash = Callable[[Sequence[bytes | memoryview]], int]
DeviceCopy = Callable[[int, int, int], bytes]  # (GPU, address, length) -> those bytes, on the host


def _hasher() -> Hash:
    """XXH3-64 of buffers one after the other, as of their concatenation, without copying them.

    :raises ConfigError: the `xxhash` package is not installed.
    """
    try:
        import xxhash
    except ImportError:
        raise ConfigError("the integrity check needs the xxhash package: pip install xxhash") from None

    def digest(chunks: Sequence[bytes | memoryview]) -> int:
        if len(chunks) == 1:
            one: int = xxhash.xxh3_64_intdigest(chunks[0])
            return one
        state = xxhash.xxh3_64()
        for chunk in chunks:
            state.update(chunk)
        many: int = state.intdigest()
        return many

    return digest


@dataclass(frozen=True, slots=True)
class PendingCheck:
    """D's check of one WRITE, ready to `run` on any thread (it reads the KV memory and the
    seal, nothing of the engine's state): why the bytes are not P's, or None.  `size`: about
    how many bytes it hashes."""

    key: TransferKey
    size: int
    run: Callable[[], str | None]

    @classmethod
    def found(cls, key: TransferKey, problem: str) -> PendingCheck:
        """A check whose answer is already known."""
        return cls(key, 0, lambda: problem)


class Integrity:
    """Seals (P) and checks (D) the WRITEs of one engine, whose KV cache is `layout`."""

    def __init__(
        self,
        engine_id: str,
        layout: KVLayout,
        every: int = 1,
        device_copy: DeviceCopy | None = None,
        secret: bytes | None = None,
    ) -> None:
        """Seals every WRITE (P); checks one transfer in `every` (D; 1: each), picked with
        `secret` (None: 32 random bytes drawn here; `picked`).  GPU regions are read through
        `device_copy` (device, address, length) -> bytes; None: the CUDA driver's, made when
        the layout has a GPU region.

        :raises ConfigError: a region of `layout` is neither host nor GPU memory, `every` is not
            a positive integer, or xxhash is missing.
        :raises TransportUnavailable: GPU regions and no CUDA driver.
        """
        if type(every) is not int or not 0 < every <= MAX_EVERY:
            raise ConfigError(f"integrity_sample must be an integer in 1..{MAX_EVERY}, not {every!r}")
        self.every = every
        self._secret = secrets.token_bytes(32) if secret is None else secret
        other = [i for i, r in enumerate(layout.regions) if r.memory not in (MemoryType.DRAM, MemoryType.VRAM)]
        if other:
            raise ConfigError(f"the integrity check reads host and GPU memory; regions {other} are neither")
        if device_copy is None and any(r.memory is MemoryType.VRAM for r in layout.regions):
            device_copy = CudaDriver().copy_to_host
        self.engine_id = engine_id
        self.layout = layout
        self.hash = _hasher()
        self.memory: list[memoryview | _DeviceBytes] = [
            _view(r) if r.memory is MemoryType.DRAM else _DeviceBytes(r, device_copy) for r in layout.regions
        ]

    def seal(self, op: SubmitOp, remote: KVLayout) -> bytes:
        """`op`'s notification with the digests of what it reads here (P, a WRITE to a peer whose
        KV cache is `remote`).

        :raises InvalidBatch: the WRITE's blocks, layers or heads do not map onto the peer's (the
            planner refuses the same batch), or its digests do not fit in a notification.
        """
        key, batch, last, _ = decode_notification(op.notification)
        moved = Seal(op.remote_blocks, op.layers, op.fine_start, len(op.local_blocks), (), ())
        try:
            layers, blocks = self._digests(moved, self.layout, remote, op.local_blocks, is_p=True)
        except (ConfigError, InvalidBatch, LayoutMismatch) as exc:
            raise InvalidBatch(f"{op.key}: the integrity check cannot read this WRITE: {exc}") from exc
        return encode_notification(key, batch, last, replace(moved, layer_digests=layers, block_digests=blocks))

    def check(
        self, peer: str, payload: bytes, remote: KVLayout, registered: Callable[[TransferKey], Sequence[int]]
    ) -> str | None:
        """Why the WRITE `payload` announces (from `peer`, whose KV cache is `remote`) did not put
        here what P holds, or None when it did (D): `prepare` and run it here.  Never raises."""
        pending = self.prepare(peer, payload, remote, registered)
        return None if pending is None else pending.run()

    def prepare(
        self, peer: str, payload: bytes, remote: KVLayout, registered: Callable[[TransferKey], Sequence[int]]
    ) -> PendingCheck | None:
        """The check of the WRITE `payload` announces, to run on any thread (D; on the thread
        that owns `registered`, the blocks this side registered for each transfer): None when
        there is nothing to check (a payload that does not parse, or names no transfer here, is
        the inbox's business; a sealed WRITE naming only the transfer's blocks, of a transfer
        not `picked`).  Never raises."""
        try:
            key, _, _, seal = decode_notification(payload)
        except PeerProtocolError:
            return None
        where, mine = f"{peer} -> {self.engine_id}", tuple(registered(key))
        if not mine:
            return None
        if seal is None:
            why = "P's integrity check is off"
            return PendingCheck.found(key, f"integrity: {where}: P's WRITE came without digests ({why})")
        strangers = sorted(set(seal.blocks) - set(mine))
        if strangers:
            problem = f"integrity: {where}: P's WRITE names blocks {strangers[:8]} D did not register for {key}"
            return PendingCheck.found(key, problem)
        if not picked(key, self.every, self._secret):
            return None
        size = self.layout.bytes_of(len(seal.blocks), seal.layers)
        return PendingCheck(key, size, partial(self._verify, where, seal, remote))

    def _verify(self, where: str, seal: Seal, remote: KVLayout) -> str | None:
        try:
            layers, blocks = self._digests(seal, remote, self.layout, seal.blocks, is_p=False)
        except (ConfigError, InvalidBatch, LayoutMismatch) as exc:  # a hostile seal or layout included
            return f"integrity: {where}: P's seal does not map onto D's KV cache: {exc}"
        return _compare(where, (layers, seal.layer_digests, "layer"), (blocks, seal.block_digests, "block"))

    def _digests(
        self, moved: Seal, p: KVLayout, d: KVLayout, own: Sequence[int], *, is_p: bool
    ) -> tuple[Digests, Digests]:
        """Per layer and per D block of `moved`, the digest of its units' digests.  A unit is
        what one position of the WRITE carries in one layer, read from this side's memory
        (`own`: this side's block ids, P's when `is_p`, else D's); `p` and `d` are the two
        sides' layouts.

        :raises InvalidBatch: the layers, positions or heads do not map between `p` and `d`.
        :raises LayoutMismatch: a layout cannot be read head by head where it must be.
        :raises ConfigError: P's state split does not parse.
        """
        first, stop = moved.layers or (0, self.layout.spec.num_layers)
        if not 0 <= first < stop <= min(p.spec.num_layers, d.spec.num_layers):
            raise InvalidBatch(f"layers {first}..{stop} outside the model's {self.layout.spec.num_layers} layers")
        by_layer: dict[int, list[int]] = {layer: [] for layer in range(first, stop)}
        by_block: dict[int, list[int]] = {name: [] for name in moved.blocks}
        for layer, name, chunks in _Reader(self, moved, (p, d), own, is_p).units((first, stop)):
            unit = self.hash(chunks)
            by_layer[layer].append(unit)
            by_block[name].append(unit)
        return self._folded(by_layer), self._folded(by_block)

    def _folded(self, groups: dict[int, list[int]]) -> Digests:
        return tuple(
            (key, self.hash([b"".join(d.to_bytes(8, "little") for d in units)])) for key, units in groups.items()
        )


Units = Iterator[tuple[int, int, list[memoryview | bytes]]]  # (layer, D block, the unit's chunks of memory)


class _Reader:
    """The bytes of each unit of one WRITE on one side, read by the layout's arithmetic alone:
    whole blocks between equal ranks and block sizes, the heads both ranks hold at their token
    offsets otherwise (`kvflow.layout.heads`), the shards both hold of a state page between
    ranks of different tensor parallelism (`kvflow.layout.states`), in the same order on both
    sides."""

    def __init__(
        self, integrity: Integrity, moved: Seal, sides: tuple[KVLayout, KVLayout], own: Sequence[int], is_p: bool
    ) -> None:
        self.memory, self.here, self.is_p = integrity.memory, integrity.layout, is_p
        self.moved, (self.p, self.d), self.own = moved, sides, own

    def units(self, layers: tuple[int, int]) -> Units:
        """Each unit, position by position and layer by layer.

        :raises InvalidBatch: positions that do not fill the blocks, or ranks with no head in common.
        :raises LayoutMismatch: a layout that cannot be read head by head.
        :raises ConfigError: P's state split does not parse.
        """
        ps, ds = self.p.spec, self.d.spec
        group = group_of(ps.groups, layers)
        if group is not None and group.state and ps.tp_size != ds.tp_size:
            return self._state(layers)
        if ps.heads != ds.heads or ps.block_size != ds.block_size:
            return self._sliced(layers)
        if self.moved.start or self.moved.count != len(self.moved.blocks) or len(self.own) != self.moved.count:
            raise InvalidBatch(f"{self.moved.count} P blocks from position {self.moved.start} in equal-sized blocks")
        if self.p.block_len != self.d.block_len or ps.arrays_per_layer != ds.arrays_per_layer:
            raise InvalidBatch(f"blocks of {self.p.block_len} and {self.d.block_len} bytes, or other arrays")
        return self._whole(layers)

    def _whole(self, layers: tuple[int, int]) -> Units:
        block_len = self.here.block_len
        for block, name in zip(self.own, self.moved.blocks, strict=True):
            for layer in range(*layers):
                arrays = self.here.layer_arrays(layer)
                yield layer, name, [self._at(a.region, a.offset + block * a.stride, block_len) for a in arrays]

    def _state(self, layers: tuple[int, int]) -> Units:
        ps, ds = self.p.spec, self.d.spec
        split = parse_split(ps.state_split)
        if split is None or ps.state_split != ds.state_split or len(self.own) != len(self.moved.blocks):
            raise InvalidBatch(f"state pages split as {ps.state_split!r} and {ds.state_split!r}, or unpaired")
        runs = state_runs(split, (ps.tp_rank, ps.tp_size), (ds.tp_rank, ds.tp_size))  # P's side first, on both
        offsets = [(run.local if self.is_p else run.remote, run.length) for run in runs]
        for block, name in zip(self.own, self.moved.blocks, strict=True):
            for layer in range(*layers):
                a = self.here.layer_arrays(layer)[0]
                page = a.offset + block * a.stride
                yield layer, name, [self._at(a.region, page + offset, length) for offset, length in offsets]

    def _sliced(self, layers: tuple[int, int]) -> Units:
        ps, ds, moved = self.p.spec, self.d.spec, self.moved
        heads = shared_heads(ps, ds)
        if not heads:
            raise InvalidBatch(f"the ranks share no KV head (P's {ps.heads}, D's {ds.heads})")
        fine, coarse = sorted((ps.block_size, ds.block_size))
        ratio = coarse // fine
        p_fine, d_fine = ps.block_size == fine, ds.block_size == fine
        n = moved.count if p_fine else len(moved.blocks)  # positions: the fine side's blocks
        coarse_count = moved.count if d_fine else len(moved.blocks)
        if coarse % fine or not 0 <= moved.start < ratio or -(-(moved.start + n) // ratio) != coarse_count:
            raise InvalidBatch(
                f"{n} blocks of {fine} tokens from position {moved.start} do not fill blocks of {coarse}"
            )
        own_fine = p_fine if self.is_p else d_fine
        if len(self.own) != (n if own_fine else coarse_count):
            raise InvalidBatch(f"{len(self.own)} blocks here for {n} positions")
        runs = head_runs(self.here, layers, heads, ps.heads == ds.heads)
        per_layer = runs.base.size // (layers[1] - layers[0])
        span = fine * runs.token_bytes
        for i in range(n):
            at = moved.start + i
            block, inner = (self.own[i], 0) if own_fine else (self.own[at // ratio], (at % ratio) * span)
            name = moved.blocks[i] if d_fine else moved.blocks[at // ratio]
            for k, layer in enumerate(range(*layers)):
                rows = range(k * per_layer, (k + 1) * per_layer)
                yield (
                    layer,
                    name,
                    [
                        self._at(int(runs.region[r]), int(runs.base[r] + runs.stride[r] * block) + inner, span)
                        for r in rows
                    ],
                )

    def _at(self, region: int, offset: int, length: int) -> memoryview | bytes:
        return self.memory[region][offset : offset + length]


def picked(key: TransferKey, every: int, secret: bytes) -> bool:
    """Whether D checks the transfer `key`, one in `every`: by a digest of its id and epoch keyed
    with `secret` (D's, never sent), so that no one without the secret can tell which transfers
    are checked, and every WRITE of one transfer is checked alike.  Never raises."""
    if every <= 1:
        return True
    name = key.transfer_id.encode("utf-8", "surrogatepass") + b"\0" + str(key.epoch).encode()
    tag = hashlib.blake2b(name, digest_size=8, key=secret[:64]).digest()
    return int.from_bytes(tag, "little") % every == 0


class _DeviceBytes:
    """A GPU region's bytes, sliced as a memoryview is: each slice is copied to the host."""

    def __init__(self, region: Region, copy: DeviceCopy | None) -> None:
        assert copy is not None  # made for every layout with a GPU region (see Integrity)
        self.region, self.copy = region, copy

    def __getitem__(self, span: slice) -> bytes:
        """:raises TransportError: the device refused the copy."""
        start, stop, _ = span.indices(self.region.length)
        return self.copy(self.region.device_id, self.region.base + start, max(0, stop - start))


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
