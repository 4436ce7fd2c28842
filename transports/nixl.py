"""NIXL transport: the RDMA data plane (UCX here; LIBFABRIC for AWS EFA; GPUDirect VRAM).

Threads: one thread, `kvflow-nixl-<name>`, owns the agent (`nixl_agent_thread` says why, and
how it runs): it creates the agent and makes every agent call but one.  It registers memory,
exchanges metadata, adds and removes peers, sends standalone notifications and tears down; it
polls `check_xfer_state` for every op in flight (which also drives UCX, so notifications leave
promptly: UCX sends a WRITE's notification only when the initiator makes progress), polls
`get_new_notifs`, and reports through the transport listener.  The exception is posting:
`submit` builds and posts a WRITE or READ on the caller's thread (the engine's writer thread,
never the event loop nor the host engine's thread), polls it briefly, and leaves it to the
agent thread if it is not done.  The agent runs in STRICT sync mode so that those posts may
come from another thread, and a lock orders them with `remove_peer`.  NIXL's own progress
thread is off: the Python wrapper runs it with a zero delay, which spins a whole core per agent.

Two ways to post an op (`mode`): ``direct`` (default), with descriptor lists built from the
plan for each op, and ``prepped``, with per-granule lists prepared once per region and per peer
and ops by index; `nixl_descriptors` builds both kinds of list.

Memory: DRAM (numpy arrays, CPU tensors) and VRAM (CUDA tensors, GPUDirect RDMA) as the loaded
backend reports.  Trainium: NIXL has no Neuron memory type; Neuron HBM is registered as VRAM
through the LIBFABRIC backend when the Neuron runtime is present (the plugin then adds VRAM
support and uses FI_HMEM_NEURON); UCX has no Neuron support.

Fencing: `remove_peer` cancels and releases this endpoint's handles to the peer and forgets it
(nothing more is posted to it); NIXL keeps the remote agent loaded (see `remove_peer`).  It
cannot stop the *peer's* one-sided ops into local memory: RDMA (and UCX over CMA) writes land
wherever the peer's registration allows.  `capabilities.fences_inbound` is therefore False, and
the engine keeps a torn-down peer's target blocks quarantined for a grace period before
releasing them.  Nor does a release stop this endpoint's own WRITEs already handed to UCX: over
TCP the kernel keeps retransmitting what it accepted, so a WRITE posted into a cut link lands
when the link returns (the engine holds the peer's blocks until then: `kvflow.runtime.peering`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvflow.errors import ConfigError, KVFlowError, TransportError, TransportUnavailable, map_exceptions
from kvflow.layout import DescriptorPlan, MemoryType, Region
from kvflow.protocol.actions import OpKind
from kvflow.transports.base import Completion, Notification, TransportCapabilities, drain
from kvflow.transports.nixl_agent_thread import AgentThread, AgentWork
from kvflow.transports.nixl_descriptors import MEM_NAMES, descriptor_rows, granule_indices, granule_rows
from kvflow.transports.nixl_setup import INSTALL_HINT, load_nixl, net_devices, nixl_failures, require

__all__ = ("INSTALL_HINT", "NixlTransport", "load_nixl", "nixl_failures", "require")

_SEG_TYPES = {"DRAM_SEG": MemoryType.DRAM, "VRAM_SEG": MemoryType.VRAM}
log = logging.getLogger(__name__)


@dataclass
class _Peer:
    name: str
    regions: list[Region]
    prepped: Any = None  # remote per-granule dlist handle
    starts: npt.NDArray[np.int64] | None = None  # first granule index of each region


@dataclass
class _InFlight:
    op_id: int
    peer: str
    handle: Any


class NixlTransport:
    """A NIXL agent named `name` with `backends` (UCX by default).

    `granule` (the KV block length in bytes) enables ``mode="prepped"``.  `idle_poll` is how
    often the agent thread looks for notifications while no op of its own is in flight and the
    engine has transfers under way (`expect_traffic`), `lazy_poll` how often while it has none
    (NIXL cannot wake a thread when a notification arrives: it is polled, and an idle engine
    polling every `idle_poll` cost 6 % of a core); `inline_poll` how long `submit` polls a
    posted op before leaving it to the agent thread.
    `thread_setup` runs first on the agent thread (a GPU host binds it to its device: UCX
    disables CUDA IPC on a thread with no CUDA device set).  `cuda` False: this endpoint moves
    host memory only (see `load_nixl`).

    `agent_thread` is the `AgentThread` that owns the agent: this transport hands it what to run
    there (`AgentWork`: `_start_agent`, `_progress`, `_busy`, `_die` and `_teardown`) and goes
    through it for every agent call but posting.

    NIXL's own exceptions (`nixl_failures`) become `TransportError` at every call into NIXL;
    anything else raised there is a bug and propagates as it is.  Raised on the agent thread
    (by NIXL, kvflow or the listener), it ends that thread: it is logged, every op in flight
    fails, and every later call raises `TransportError` naming it (see `_die`).

    :raises ConfigError: an unknown `mode`, or ``"prepped"`` without a `granule`.
    :raises TransportUnavailable: NIXL is not installed, or finds no backend plugin.
    :raises TransportError: NIXL could not create the agent or a backend, or the agent thread
        did not start within `call_timeout`.
    """

    def __init__(
        self,
        name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        backend_params: dict[str, dict[str, str]] | None = None,
        mode: str = "direct",
        granule: int | None = None,
        idle_poll: float = 0.0005,
        lazy_poll: float = 0.05,
        inline_poll: float = 0.0001,
        call_timeout: float = 30.0,
        thread_setup: Callable[[], None] | None = None,
        cuda: bool = True,
        loopback_only: bool = False,
    ) -> None:
        """`loopback_only`: the engine's control channel binds loopback, so its peers are on this
        host: UCX's network devices are kept to the loopback one (its TCP transport listens on
        every device it uses, the host's external interface included), unless the deployment
        chose devices itself (``UCX_NET_DEVICES``; see `nixl_setup.net_devices`).  UCX's
        shared-memory and CUDA transports are not network devices and stay.

        :raises ConfigError: `mode` is not one there is.
        :raises TransportUnavailable: NIXL cannot be loaded.
        """
        if mode not in ("direct", "prepped") or (mode == "prepped" and not granule):
            raise ConfigError("mode must be 'direct', or 'prepped' with a granule (the block length)")
        self.name = name
        work = AgentWork(
            start_agent=self._start_agent,
            progress=self._progress,
            busy=self._busy,
            die=self._die,
            teardown=self._teardown,
        )
        self.agent_thread = AgentThread(name, work, idle_poll=idle_poll, lazy_poll=lazy_poll, call_timeout=call_timeout)
        self.mode = mode
        self.granule = granule
        self._api = load_nixl(cuda)
        self._failures = nixl_failures(self._api)  # caught on the hot path without a context manager
        self._errors: dict[type[BaseException], type[KVFlowError]] = dict.fromkeys(self._failures, TransportError)
        self._backends = list(backends)
        self._backend_params = backend_params or {}
        self._loopback_only = loopback_only
        self.inline_poll = inline_poll  # how long `submit` polls an op it posted
        self._thread_setup = thread_setup
        self._completions: deque[Completion] = deque()
        self._notifications: deque[Notification] = deque()
        self._listener: Callable[[], None] | None = None
        self._inflight: dict[int, _InFlight] = {}
        self._regions: list[Region] = []
        self._reg_handles: list[Any] = []
        self._local_prepped: Any = None
        self._local_starts: npt.NDArray[np.int64] | None = None
        self._peers: dict[str, _Peer] = {}
        # remote agents NIXL has loaded, by name: their metadata (kept after `remove_peer`)
        self._loaded: dict[str, bytes] = {}
        self._peer_lock = threading.Lock()
        self._agent: Any = None
        self._mem_types: frozenset[MemoryType] = frozenset()
        self.agent_thread.start()

    # ------------------------------------------------------------------ run on the agent thread

    def _start_agent(self) -> None:
        if self._thread_setup is not None:
            self._thread_setup()
        strict = self._api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT  # writers post from their thread
        config = self._api.nixl_agent_config(enable_prog_thread=False, backends=[], sync_mode=strict)
        try:
            with self._nixl("creating the agent"):
                self._agent = self._api.nixl_agent(self.name, config)
        except RuntimeError as exc:  # the wrapper's own failure: NIXL found no backend plugin at all
            raise TransportUnavailable(f"NIXL on {self.name!r}: {exc}; reinstall it: {INSTALL_HINT}") from exc
        with self._nixl("creating the backends"), net_devices(self._loopback_only):
            for backend in self._backends:
                self._agent.create_backend(backend, self._backend_params.get(backend, {}))
            mems = {m for b in self._backends for m in self._agent.get_backend_mem_types(b)}
            self._mem_types = frozenset(_SEG_TYPES[m] for m in mems if m in _SEG_TYPES)

    def _die(self, exc: BaseException) -> None:
        """The agent thread's last act after `exc`: every op in flight fails (its handle released,
        which cancels it), every call waiting on the agent thread or to come and every later
        `submit` raises `TransportError` naming `exc`, and the agent's resources are released."""
        log.error("NIXL transport %r: the agent thread died; every op fails from now on", self.name, exc_info=exc)
        with self._peer_lock:  # a submit registers its op before this, or sees the failure
            self.agent_thread.fail(exc)
            inflight = list(self._inflight.values())
            self._inflight.clear()
        for op in inflight:
            self._guarded(f"releasing op {op.op_id}", self._release, op.handle)
            self._completions.append(Completion(op.op_id, self.agent_thread.dead_message()))
        self.agent_thread.bury()
        self._guarded("tearing down", self._teardown)
        self._guarded("signalling the listener", self._signal)

    def _guarded(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("NIXL transport %r: %s after the agent thread died", self.name, what)

    def _progress(self) -> None:
        """Drive every op in flight and collect notifications (this is also what sends them).
        An op leaves `_inflight` only once its completion is queued: whatever raises on the
        way leaves it there, for `_die` to fail."""
        done = False
        with self._peer_lock:
            for op in list(self._inflight.values()):
                try:
                    with self._nixl(f"op {op.op_id} to {op.peer!r}"):
                        state = self._agent.check_xfer_state(op.handle)
                except TransportError as exc:
                    state, error = "ERR", str(exc)
                else:
                    error = f"NIXL reported the op to {op.peer!r} failed"
                if state == "PROC":
                    continue
                self._release(op.handle)
                del self._inflight[op.op_id]
                self._completions.append(Completion(op.op_id, None if state == "DONE" else error))
                done = True
        try:
            with self._nixl("polling notifications"):
                notes = self._agent.get_new_notifs()
        except TransportError:
            notes = {}
        for peer, payloads in notes.items():
            self._notifications.extend(Notification(peer, payload) for payload in payloads)
        if done or notes:
            self._signal()

    def _nixl(self, what: str) -> Any:
        return map_exceptions(self._errors, f"NIXL {what} on {self.name!r}")

    # ------------------------------------------------------------------ the Transport protocol

    @property
    def capabilities(self) -> TransportCapabilities:
        return TransportCapabilities("nixl", self._mem_types, backends=tuple(self._backends), fences_inbound=False)

    def register_regions(self, regions: Sequence[Region]) -> None:
        def register() -> None:
            for region in regions:
                if region.memory not in self._mem_types:
                    raise TransportError(f"backends {self._backends} cannot move {region.memory.value} memory")
                with self._nixl("registering memory"):
                    entry = [(region.base, region.length, region.device_id, "")]
                    self._reg_handles.append(self._agent.register_memory(entry, MEM_NAMES[region.memory]))
            self._regions.extend(regions)
            if self.mode == "prepped":
                self._local_prepped, self._local_starts = self._prep("NIXL_INIT_AGENT", self._regions)

        self.agent_thread.call("memory registration", register)

    def deregister_regions(self) -> None:
        """The remote keys peers held die with the registrations: peers are added again with new metadata."""

        self.agent_thread.call("memory deregistration", self._deregister)

    def local_metadata(self) -> bytes:
        def metadata() -> bytes:
            with self._nixl("reading the agent metadata"):
                return bytes(self._agent.get_agent_metadata())

        return bytes(self.agent_thread.call("metadata", metadata))

    def add_peer(self, name: str, metadata: bytes, regions: Sequence[Region]) -> None:
        def add() -> None:
            if self._loaded.get(name) != metadata:  # else the same agent again: keep its connection
                if name in self._loaded:  # a new incarnation of the peer
                    self._unload(name)
                with self._nixl(f"adding peer {name!r}"):
                    loaded = self._agent.add_remote_agent(metadata)
                loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
                if loaded != name:
                    with self._nixl("removing a misnamed peer"):
                        self._agent.remove_remote_agent(loaded)
                    raise TransportError(f"metadata for {name!r} describes agent {loaded!r}")
                self._loaded[name] = metadata
            peer = _Peer(name, list(regions))
            if self.mode == "prepped":
                peer.prepped, peer.starts = self._prep(name, peer.regions)
            with self._peer_lock:
                old = self._peers.pop(name, None)
                self._peers[name] = peer
            if old is not None and old.prepped is not None:
                self._release(old.prepped)

        self.agent_thread.call(f"adding peer {name!r}", add)

    def remove_peer(self, name: str) -> None:
        def remove() -> None:
            with self._peer_lock:  # no op to the peer is being posted meanwhile, nor afterwards
                peer = self._peers.pop(name, None)
                for op in [op for op in self._inflight.values() if op.peer == name]:
                    del self._inflight[op.op_id]
                    self._release(op.handle)  # NIXL cancels an active transfer on release
                    self._completions.append(Completion(op.op_id, f"peer {name!r} removed"))
            if peer is not None and peer.prepped is not None:
                self._release(peer.prepped)
            # NIXL keeps the remote agent loaded: unloading it closes its UCX endpoint in flush
            # mode, which stops nothing already posted (see the module's header) and, over TCP,
            # leaves the endpoint's connection open on both sides for good: one more per
            # teardown.  Kept, the same agent associating again reuses the connection, where
            # TCP delivers anything still held from before ahead of every new WRITE.
            self._signal()

        if not self.agent_thread.closed:
            self.agent_thread.call(f"removing peer {name!r}", remove)

    def submit(self, op_id: int, kind: OpKind, peer: str, plan: DescriptorPlan, notification: bytes) -> None:
        self.agent_thread.check_alive()
        target = self._peers.get(peer)
        if self.agent_thread.closed or target is None:
            raise TransportError(f"op {op_id}: peer {peer!r} is not connected")
        local = descriptor_rows(self._regions, plan.local_region, plan.local_offset, plan.length, "local")
        remote = descriptor_rows(target.regions, plan.remote_region, plan.remote_offset, plan.length, f"peer {peer!r}")
        local_type = MEM_NAMES[self._regions[plan.local_region.item(0)].memory]
        remote_type = MEM_NAMES[target.regions[plan.remote_region.item(0)].memory]
        prepped = self.mode == "prepped"
        indices = granule_indices(plan, self.granule or 1, self._local_starts, target.starts) if prepped else None
        agent, failures = self._agent, self._failures
        # Posted here, on the caller's (writer) thread: NIXL runs in STRICT sync mode, and the
        # lock orders this with remove_peer, so nothing is posted to a peer once it is removed.
        with self._peer_lock:
            self.agent_thread.check_alive()  # else the op would be registered after `_die` and never finish
            if self._peers.get(peer) is not target:
                raise TransportError(f"op {op_id}: peer {peer!r} was removed")
            handle = None
            try:
                if indices is not None:
                    handle = agent.make_prepped_xfer(
                        kind.value, self._local_prepped, indices[0], target.prepped, indices[1], notification
                    )
                else:
                    local_descs = agent.get_xfer_descs(local, local_type)
                    remote_descs = agent.get_xfer_descs(remote, remote_type)
                    handle = agent.initialize_xfer(kind.value, local_descs, remote_descs, peer, notification)
                state = agent.transfer(handle)
                # Over shared memory (CMA) most ops are done by now, or within a poll or two (the
                # notification's send): finishing here saves two thread hops per op.
                if state == "PROC":
                    give_up = time.perf_counter() + self.inline_poll
                    while state == "PROC" and time.perf_counter() < give_up:
                        state = agent.check_xfer_state(handle)
            except failures as exc:
                if handle is not None:
                    self._release(handle)
                raise TransportError(f"NIXL posting op {op_id} to {peer!r} on {self.name!r}: {exc!r}") from exc
            if state == "PROC":
                self._inflight[op_id] = _InFlight(op_id, peer, handle)
            else:
                self._release(handle)
                error = None if state == "DONE" else f"NIXL refused or failed op {op_id} to {peer!r}"
                self._completions.append(Completion(op_id, error))
        if state == "PROC":
            self.agent_thread.wake()  # the agent thread drives the op to completion
        else:
            self._signal()

    def poll(self) -> tuple[list[Completion], list[Notification]]:
        return drain(self._completions), drain(self._notifications)

    def send_notification(self, peer: str, payload: bytes) -> None:
        def send() -> None:
            with self._nixl(f"notifying {peer!r}"):
                self._agent.send_notif(peer, payload)

        self.agent_thread.call(f"notifying {peer!r}", send)

    def set_listener(self, callback: Callable[[], None] | None) -> None:
        self._listener = callback

    def expect_traffic(self, active: bool) -> None:
        self.agent_thread.expect_traffic(active)

    def close(self) -> None:
        self.agent_thread.close()

    # ------------------------------------------------------------------ helpers

    def _teardown(self) -> None:
        """On the agent thread, last: every handle, list and registration released."""
        for op in list(self._inflight.values()):
            self._release(op.handle)
            self._completions.append(Completion(op.op_id, "transport closed"))
        self._inflight.clear()
        for peer in list(self._peers.values()):
            if peer.prepped is not None:
                self._release(peer.prepped)
        try:  # noqa: SIM105  (as `_release`: no context manager)
            self._deregister()
        except TransportError:
            pass  # closing: the agent goes with what is left
        self._peers.clear()
        self._agent = None

    def _deregister(self) -> None:
        """On the agent thread: the local list and the registrations released.  :raises TransportError: one refused."""
        if self._local_prepped is not None:
            self._release(self._local_prepped)
            self._local_prepped = self._local_starts = None
        handles, self._reg_handles, self._regions = self._reg_handles, [], []
        for handle in handles:
            with self._nixl("deregistering memory"):
                self._agent.deregister_memory(handle)

    def _unload(self, name: str) -> None:
        del self._loaded[name]
        try:
            with self._nixl(f"removing peer {name!r}"):
                self._agent.remove_remote_agent(name)
        except TransportError:
            pass  # already gone (for instance after a disconnect)

    def _release(self, handle: Any) -> None:
        # on every op's path: NIXL's own failures caught directly, no context manager per op
        try:  # noqa: SIM105
            handle.release()
        except self._failures:
            pass  # NIXL could not cancel it: nothing more to do from here

    def _prep(self, agent: str, regions: Sequence[Region]) -> tuple[Any, npt.NDArray[np.int64]]:
        rows, starts = granule_rows(regions, self.granule or 1)
        mem = MEM_NAMES[regions[0].memory]
        with self._nixl(f"preparing descriptors for {agent!r}"):
            handle = self._agent.prep_xfer_dlist(agent, rows, mem)
        return handle, starts

    def _busy(self) -> bool:
        return bool(self._inflight)

    def _signal(self) -> None:
        listener = self._listener
        if listener is not None:
            listener()
