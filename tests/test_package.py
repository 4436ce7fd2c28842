"""Packaging and hygiene: layout works installed, modules are small and documented, no pickle."""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = [ROOT / "kvflow", ROOT / "transports", ROOT / "integrations", ROOT / "tools" / "kvflow_tools"]


# what a wheel is not built from: environments, caches, earlier builds, the history
NOT_SOURCES = (".git", ".venv*", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "*results")


def sources() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS for p in d.rglob("*.py") if "__pycache__" not in p.parts)


def test_top_level_folders_are_kvflow_subpackages() -> None:
    assert (ROOT / "kvflow" / "transports").resolve() == ROOT / "transports"
    assert (ROOT / "kvflow" / "integrations").resolve() == ROOT / "integrations"
    importlib.import_module("kvflow.transports.loopback")
    importlib.import_module("kvflow.integrations.vllm")


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_small_documented_and_exports_a_tuple(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) < 600, "modules stay well under 600 lines"
    tree = ast.parse(text)
    doc = ast.get_docstring(tree)
    assert doc and len(doc) > 40, "each module opens with a header saying why it exists"
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            assert isinstance(node.value, ast.Tuple), "__all__ is a tuple"


def test_no_pickle_anywhere_in_the_package() -> None:
    pattern = re.compile(r"\b(pickle|cPickle|dill|recv_pyobj|send_pyobj|marshal\.loads)\b")
    offenders = [str(p.relative_to(ROOT)) for p in sources() if pattern.search(p.read_text())]
    assert offenders == []


def test_the_library_wheel_holds_the_library_and_the_tools_wheel_the_rest(tmp_path: Path) -> None:
    """Two distributions: `kvflow` (what an engine or vLLM loads, the linked folders' files in
    it) and `kvflow-tools` (the command, benchmarks, stand-in, router, test kit)."""
    pip = [sys.executable, "-m", "pip"]
    # built from a copy: setuptools reuses a checkout's build/ folder, and a file moved away since
    # the last build would still be in the wheel
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    for project in (source, source / "tools"):
        build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(project)]
        subprocess.run(build, check=True)
    (library,) = tmp_path.glob("kvflow-*.whl")
    (tools,) = tmp_path.glob("kvflow_tools-*.whl")
    names = zipfile.ZipFile(library).namelist()
    assert {name.split("/")[0] for name in names} == {"kvflow", "kvflow-0.1.0.dist-info"}
    assert "kvflow/transports/loopback.py" in names and "kvflow/integrations/vllm/connector.py" in names
    connector = {name for name in names if name.startswith("kvflow/integrations/vllm/") and name.endswith(".py")}
    assert connector == {f"kvflow/integrations/vllm/{p.name}" for p in (ROOT / "integrations" / "vllm").glob("*.py")}
    assert not [name for name in names if "/tools/" in name or "/testing/" in name or "standin" in name]
    tool_names = zipfile.ZipFile(tools).namelist()
    assert {name.split("/")[0] for name in tool_names} == {"kvflow_tools", "kvflow_tools-0.1.0.dist-info"}
    entry_points = zipfile.ZipFile(tools).read("kvflow_tools-0.1.0.dist-info/entry_points.txt").decode()
    assert "kvflow = kvflow_tools.cli:main" in entry_points
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "-q", "--target", str(target), str(library), str(tools)], check=True)
    probe = "import kvflow.transports.loopback as m, kvflow_tools.routing.router as r; print(m.__file__, r.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target)},
        check=True,
        capture_output=True,
        text=True,
    )
    assert all(path.startswith(str(target)) for path in out.stdout.split())


def _defined_exceptions(path: Path, known: set[str]) -> list[str]:
    """Classes in `path` whose bases name an exception: a builtin one or one of kvflow's."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            bases = {
                b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases
            }
            if any(b in known or b.endswith(("Error", "Exception")) for b in bases):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    return found


def test_every_exception_is_defined_in_kvflow_errors_under_one_root_and_exported() -> None:
    """The library's in `kvflow/errors.py`, exported by `kvflow`; the tools' in
    `kvflow_tools/errors.py`; all under `KVFlowError`, none anywhere else."""
    import kvflow
    import kvflow_tools.errors as tool_errors
    from kvflow import errors

    classes = {n: getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    tools = {n: getattr(tool_errors, n) for n in tool_errors.__all__}
    assert all(issubclass(cls, errors.KVFlowError) for cls in [*classes.values(), *tools.values()])
    homes = {ROOT / "kvflow" / "errors.py", ROOT / "tools" / "kvflow_tools" / "errors.py"}
    known = set(classes) | set(tools)
    elsewhere = [f for p in sources() if p not in homes for f in _defined_exceptions(p, known)]
    assert elsewhere == [], "every exception class lives in kvflow/errors.py or kvflow_tools/errors.py"
    assert set(classes) <= set(kvflow.__all__) and not set(tools) & set(kvflow.__all__)
    assert all(getattr(kvflow, n) is cls for n, cls in classes.items())
