"""The structure the code promises, checked on its syntax trees (no imports are executed).

* No module reads another object's underscore names: a class that needs something of another
  class asks through a public method, so no class is a hidden friend of another.  Third-party
  private names kvflow must use are listed, with the reason, in `THIRD_PARTY_PRIVATE`.
* No import cycles between kvflow modules (module-level, TYPE_CHECKING and function-level
  imports all count: a cycle hidden in a function is still a cycle in the design).
* Layers: the sans-IO protocol and the layout know nothing of I/O or of the layers above them;
  the control plane does not know the runtime.
* One door to an engine's pure state: above the protocol, nothing feeds the transfer core, the
  associations or the teardowns an input; everything goes through the `Endpoint`, which is
  where the machines' decisions are coordinated.
* Two distributions: the library (`kvflow`, with the vLLM connector) imports nothing of
  `kvflow_tools` (the command, benchmarks, stand-in, router, test kit); `kvflow.integrations`
  holds the connector and nothing else; the router and the stand-in import nothing else of the
  tools but their exceptions.
* No child process runs Python between fork and exec (`preexec_fn`, or asyncio's subprocesses,
  which on uvloop run Python's after-fork handlers in the child): the parent has threads (the
  engine's, the peer thread, pytest-xdist's), and the child can block for good on a lock one of
  them held when it forked, or corrupt its heap.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source trees, each with the module prefix its files import as: kvflow/transports and
# kvflow/integrations are symlinks to the top-level folders, which are read once, from there.
TREES = {
    "kvflow": "kvflow",
    "transports": "kvflow.transports",
    "integrations": "kvflow.integrations",
    "examples": "examples",
    "tools/kvflow_tools": "kvflow_tools",
}

# (file, name) -> why: the only underscore names read on objects other than self/cls (numpy,
# zmq, torch and NIXL are used through their public APIs only; the connector keeps vLLM's KV
# cache manager from the public `bind_kv_cache_manager`, not from its base class's private).
THIRD_PARTY_PRIVATE: dict[tuple[str, str], str] = {
    # vLLM's Request keeps its prompt twice (prompt_token_ids and _all_token_ids) and has no
    # method that shortens it; P leaves a Mamba model's last prompt token for D as vLLM's own
    # NIXL connector does (`_truncate_request_for_prefill`), shortening both
    ("integrations/vllm/releases.py", "_all_token_ids"): "vLLM's Request has no API to shorten a prompt",
    # the GPU check's gating trial needs a kernel of a known length ahead of a copy on one
    # stream, and its CPU-wait measurement one to wait on; torch has only `torch.cuda._sleep`
    ("tools/kvflow_tools/gpu/engine_child.py", "_sleep"): "torch has no public kernel that runs for a set time",
}

PURE_LAYERS = ("kvflow.protocol", "kvflow.layout")
ABOVE_PURE = (
    "kvflow.runtime",
    "kvflow.control",
    "kvflow_tools",
    "kvflow.transports",
    "kvflow.integrations",
)
IO_MODULES = (
    "asyncio",
    "concurrent",
    "logging",
    "selectors",
    "socket",
    "subprocess",
    "threading",
    "time",
    "uvloop",
    "zmq",
)


@dataclass(frozen=True, slots=True)
class Source:
    path: str  # relative to the repository root, through the real folders
    module: str
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.endswith("__init__.py")


def sources() -> list[Source]:
    found = []
    for top, prefix in TREES.items():
        for folder, dirs, files in os.walk(ROOT / top):  # does not descend into symlinked folders
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = Path(folder, name)
                relative = path.relative_to(ROOT / top).with_suffix("").parts
                parts = [*prefix.split("."), *relative]
                if parts[-1] == "__init__":
                    parts.pop()
                source = Source(str(path.relative_to(ROOT)), ".".join(parts), ast.parse(path.read_text(), str(path)))
                found.append(source)
    return found


SOURCES = sources()
MODULES = {s.module for s in SOURCES}


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# ---------------------------------------------------------------------- private names


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`: the object's own names."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_reads(source: Source) -> Iterator[tuple[int, str, str]]:
    """(line, name, what) for every read of another object's underscore name."""
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and not own(node.value):
            yield node.lineno, node.attr, ast.unparse(node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
            and not own(node.args[0])
        ):
            yield node.lineno, node.args[1].value, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom):
            target = resolve(source, node)
            if within(target, "kvflow"):
                for alias in node.names:
                    if private(alias.name):
                        yield node.lineno, alias.name, f"from {target} import {alias.name}"


def test_no_module_reads_another_objects_private_names() -> None:
    found = [
        f"{s.path}:{line}: {what}"
        for s in SOURCES
        for line, name, what in private_reads(s)
        if (s.path, name) not in THIRD_PARTY_PRIVATE
    ]
    assert not found, "private names read from outside their object:\n" + "\n".join(found)


def test_every_allowed_private_name_is_still_used() -> None:
    used = {(s.path, name) for s in SOURCES for _, name, _ in private_reads(s)}
    assert not set(THIRD_PARTY_PRIVATE) - used, "allowlist entries no code needs any more"


# ---------------------------------------------------------------------- imports


def resolve(source: Source, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom reads from."""
    if not node.level:
        return node.module or ""
    base = source.module.split(".")
    if not source.is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports(source: Source) -> Iterator[tuple[int, str]]:
    """(line, module) for every module this one imports, at any depth of the file."""
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            target = resolve(source, node)
            yield node.lineno, target
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:  # `from package import module`
                    yield node.lineno, f"{target}.{alias.name}"


def kvflow_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for source in SOURCES:
        if within(source.module, "kvflow") or within(source.module, "kvflow_tools"):
            graph[source.module] = {m for _, m in imports(source) if m in MODULES and m != source.module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_kvflow_modules_import_no_cycle() -> None:
    assert not cycles(kvflow_graph())


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def layering_violations(source: Source) -> Iterator[str]:
    module = source.module
    for line, imported in imports(source):
        where = f"{source.path}:{line}: {module} imports {imported}"
        if any(within(module, pure) for pure in PURE_LAYERS):
            if any(within(imported, above) for above in ABOVE_PURE):
                yield f"{where} (the sans-IO layers import nothing above them)"
            if any(within(imported, io) for io in IO_MODULES):
                yield f"{where} (the sans-IO layers do no I/O and read no clock)"
        if within(module, "kvflow.layout") and within(imported, "kvflow.protocol"):
            yield f"{where} (the layout is below the protocol)"
        if within(module, "kvflow.control") and within(imported, "kvflow.runtime"):
            yield f"{where} (the control plane does not know the engine)"
        for alone in ("kvflow_tools.routing", "kvflow_tools.standin"):
            shared = within(imported, alone) or within(imported, "kvflow_tools.errors")  # the tools' exceptions
            if within(module, alone) and within(imported, "kvflow_tools") and not shared:
                yield f"{where} ({alone} imports nothing else of the tools but their exceptions)"


def test_layers_import_only_downwards() -> None:
    found = [v for s in SOURCES for v in layering_violations(s)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("kvflow_tools.routing.router", "from kvflow_tools.bench import soak"),
        ("kvflow_tools.standin.engine", "from kvflow_tools.testing.pair import EnginePair"),
        ("kvflow.protocol.core", "import kvflow.runtime.engine"),
    ],
)
def test_a_planted_layering_violation_is_found(module: str, line: str) -> None:
    planted = Source(module.replace(".", "/") + ".py", module, ast.parse(line))
    assert list(layering_violations(planted)), line


# ---------------------------------------------------------------------- one door to the pure state

# The inputs of the machines the `Endpoint` owns: above the protocol only it may call them.
MACHINE_INPUTS = frozenset(
    {
        *("expect", "kv_ready", "abort", "abort_all", "delivered", "unsent", "promise", "renew", "feed"),
        *("peer_connected", "peer_lost", "peer_fenced", "op_submitted", "op_finished", "notification"),
        *("receive", "timer", "connect", "tear_down", "goodbye_all", "tick", "link_changed"),
        *("route_added", "pending_refused", "transport_peer_added", "hello_sent", "hello_unsent"),
        *("torn_down", "removed", "removal_failed", "heard_again", "nothing_held", "closing"),
    }
)
MACHINES = frozenset({"core", "assoc", "associations", "teardowns"})  # how the drivers name them
ABOVE_THE_ENDPOINT = ("kvflow.runtime", "kvflow.control", "kvflow.integrations")


def side_doors(source: Source) -> Iterator[str]:
    """Calls of a machine's input, and writes to a machine's attributes, made past the endpoint."""
    if not any(within(source.module, above) for above in ABOVE_THE_ENDPOINT):
        return
    for node in ast.walk(source.tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in [node.func] if isinstance(node, ast.Call) else targets:
            if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute)):
                continue
            machine, name = target.value.attr, target.attr
            if machine in MACHINES and (name in MACHINE_INPUTS or not isinstance(node, ast.Call)):
                yield f"{source.path}:{target.lineno}: .{machine}.{name} (goes through the Endpoint)"


def test_above_the_protocol_every_input_goes_through_the_endpoint() -> None:
    found = [v for s in SOURCES for v in side_doors(s)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("kvflow.runtime.engine", "self.core.receive(peer, message, now)"),
        ("kvflow.runtime.peering", "actions = self.assoc.teardowns.removed(number, now)"),
        ("kvflow.runtime.sleep", "self.engine.assoc.refusing = reason"),
        ("kvflow.integrations.vllm.rank_agent", "engine.core.abort_all(now, 'asleep')"),
    ],
)
def test_a_planted_side_door_is_found(module: str, line: str) -> None:
    planted = Source(module.replace(".", "/") + ".py", module, ast.parse(line))
    assert list(side_doors(planted)), line
    allowed = Source(module.replace(".", "/") + ".py", module, ast.parse("self.endpoint.receive(p, m, now)"))
    assert not list(side_doors(allowed))


# ---------------------------------------------------------------------- what vLLM loads

# The library: what an embedding engine imports.  It knows nothing of vLLM, the tools or the
# test kit; transports know nothing of the engine or its control plane.
LIBRARY = ("kvflow.errors", "kvflow.protocol", "kvflow.layout", "kvflow.runtime", "kvflow.control", "kvflow.transports")
NOT_LIBRARY = ("kvflow.integrations", "kvflow_tools")
# What vLLM loads with `kv_connector_module_path=kvflow.integrations.vllm.connector`, beside the
# library: the scheduler side, the worker side and the metrics, nothing else (no stand-in, router,
# benchmark or fuzzer).  A module joining this set is a deliberate change to the connector.
CONNECTOR = "kvflow.integrations.vllm.connector"
CONNECTOR_MODULES = frozenset(
    f"kvflow.integrations.vllm.{name}"
    for name in (
        "connector",  # the class vLLM instantiates, both roles
        "releases",  # what differs between the vLLM releases it runs on
        "mapping",  # scheduler side: vLLM requests to transfers
        "stages",  # its requests' table
        "intake",  # which requests' params it serves, and its refusals
        "params",
        "producer",
        "settings",
        "idle_sleep",  # the engine core asleep while its requests wait for KV
        "worker",  # worker side: KV caches, engines, their links
        "kv_caches",
        "device",
        "gpu_export",  # how GPU KV reaches an engine process
        "links",
        "supervision",  # an engine process started, and started again after it died
        "notices",
        "rank_agent",
        "ranks",
        "request_book",  # each request's record on a rank (a table)
        "stats",  # metrics
        "first_token",  # P's first token on its way to D's sampler
        "logits",  # D's sampler held to it: vLLM loads it by ``--logits-processors``
        "logits_v1",  # ... on vLLM 0.32 and 0.33
        "logits_v2",  # ... on vLLM 0.34
    )
) | {"kvflow.integrations", "kvflow.integrations.vllm"}
PROCESSOR_MODULE = "kvflow.integrations.vllm.logits"  # what vLLM loads besides the connector


def loaded_by(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module importing `start` imports, its packages' `__init__` included."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen or module not in graph:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [*graph[module], *(".".join(parts[:i]) for i in range(1, len(parts)))]
    return seen


def in_library(module: str) -> bool:
    return module == "kvflow" or any(within(module, lib) for lib in LIBRARY)  # (the package's __init__)


def boundary_violations(graph: dict[str, set[str]]) -> Iterator[str]:
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            if in_library(module) and any(within(target, no) for no in NOT_LIBRARY):
                yield f"{module} imports {target} (the library imports no integration, tool or test kit)"
            elif within(module, "kvflow") and within(target, "kvflow_tools"):
                yield f"{module} imports {target} (the kvflow distribution imports nothing of kvflow-tools)"
            if within(module, "kvflow.transports") and any(
                within(target, p) for p in ("kvflow.runtime", "kvflow.control")
            ):
                yield f"{module} imports {target} (transports know neither the engine nor its control plane)"
    for start in (CONNECTOR, PROCESSOR_MODULE):
        for module in sorted(loaded_by(graph, start)):
            if not in_library(module) and module not in CONNECTOR_MODULES:
                yield f"vLLM loading {start} loads {module} (not the library, not the connector)"


def strangers(modules: set[str]) -> list[str]:
    """Modules in `kvflow.integrations` that vLLM does not load: it holds the connector only."""
    return sorted(m for m in modules if within(m, "kvflow.integrations") and m not in CONNECTOR_MODULES)


def test_the_integrations_folder_holds_the_connector_and_nothing_else() -> None:
    assert strangers(MODULES) == []
    assert strangers(MODULES | {"kvflow.integrations.vllm.router"}) == ["kvflow.integrations.vllm.router"]


def test_the_library_and_what_vllm_loads_import_nothing_else() -> None:
    found = list(boundary_violations(kvflow_graph()))
    assert not found, "\n".join(found)
    loaded = loaded_by(kvflow_graph(), CONNECTOR) | loaded_by(kvflow_graph(), PROCESSOR_MODULE)
    assert loaded >= CONNECTOR_MODULES  # the list names no stale module


@pytest.mark.parametrize(
    ("importer", "imported", "why"),
    [
        ("kvflow.runtime.engine", "kvflow.integrations.vllm.worker", "the library imports no integration"),
        ("kvflow.protocol.core", "kvflow_tools.bench.soak", "the library imports no integration"),
        ("kvflow.integrations.vllm.stats", "kvflow_tools.children", "imports nothing of kvflow-tools"),
        ("kvflow.transports.nixl", "kvflow.runtime.engine", "transports know neither"),
        ("kvflow.transports.shm", "kvflow.control.channel", "transports know neither"),
        ("kvflow.integrations.vllm.mapping", "kvflow_tools.standin.engine", "not the connector"),
        ("kvflow.integrations.vllm.stats", "kvflow_tools.bench.bench_vllm", "not the connector"),
        ("kvflow.integrations.vllm.worker", "kvflow_tools.testing.pair", "not the connector"),
        ("kvflow.integrations.vllm.logits", "kvflow_tools.standin.engine", "not the connector"),
    ],
)
def test_a_planted_boundary_violation_is_found(importer: str, imported: str, why: str) -> None:
    graph = {module: set(targets) for module, targets in kvflow_graph().items()}
    graph[importer].add(imported)
    found = list(boundary_violations(graph))
    assert any(why in line and imported in line for line in found), found


def test_every_tree_is_read_once_through_its_real_folder() -> None:
    paths = [s.path for s in SOURCES]
    assert len(paths) == len(set(paths)) and len(MODULES) == len(SOURCES)
    for module in (
        "kvflow.protocol.core",
        "kvflow.transports.loopback",
        "kvflow.integrations.vllm",
        "examples.embed_loopback",
    ):
        assert module in MODULES
    assert not [p for p in paths if p.startswith(("kvflow/transports/", "kvflow/integrations/"))]


# ---------------------------------------------------------------------- fork, then exec


ASYNC_SPAWNS = ("create_subprocess_exec", "create_subprocess_shell", "subprocess_exec", "subprocess_shell")


def python_after_fork(tree: ast.Module) -> list[int]:
    """Lines that have a child process run Python between fork and exec: a `preexec_fn`, or
    asyncio's subprocesses (on uvloop they run Python's after-fork handlers in the child;
    `kvflow_tools.children.spawn` is the way)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.keyword) and node.arg == "preexec_fn")
        or (isinstance(node, ast.Attribute) and node.attr in ASYNC_SPAWNS)
    ]


def test_no_child_process_runs_python_between_fork_and_exec() -> None:
    tests = [
        (str(p.relative_to(ROOT)), ast.parse(p.read_text(), str(p))) for p in sorted((ROOT / "tests").glob("*.py"))
    ]
    found = [
        (path, line)
        for path, tree in [*((s.path, s.tree) for s in SOURCES), *tests]
        for line in python_after_fork(tree)
    ]
    assert found == [], "spawn with kvflow_tools.children; set limits in the child itself"
    planted = "subprocess.Popen(argv, preexec_fn=lambda: None)\nawait asyncio.create_subprocess_exec(*argv)"
    assert python_after_fork(ast.parse(planted)) == [1, 2]
