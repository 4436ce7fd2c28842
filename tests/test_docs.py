"""The documentation says only what runs: its example, its links and the commands it names.

Why: a README snippet that cannot run, a link to a moved file or a command renamed in a
reorganisation misleads exactly the reader who knows the code least.  The README's code block is
`examples/quickstart.py`, which is run here; every relative link in the Markdown files must
resolve (anchors included); every `python -m kvflow...` module and `kvflow` subcommand they name
must exist; the module map (docs/design.md) names every module.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from examples import quickstart
from kvflow_tools.cli import main as kvflow_cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "vllm_1p1d" / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(text: str) -> str:
    """The text without its fenced code blocks."""
    return FENCE.sub("", text)


def code(text: str) -> list[str]:
    """Fenced code blocks and inline code spans."""
    return [m.group(2) for m in FENCE.finditer(text)] + CODE_SPAN.findall(prose(text))


def anchors(path: Path) -> set[str]:
    """GitHub's ids for the headings of a Markdown file."""
    ids = set()
    for line in prose(path.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            ids.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return ids


def test_readme_code_block_is_the_quickstart_file() -> None:
    blocks = [body for lang, body in FENCE.findall((ROOT / "README.md").read_text()) if lang == "python"]
    assert blocks == [Path(quickstart.__file__).read_text()]


def test_quickstart_runs_and_moves_the_bytes_it_reports() -> None:
    result = subprocess.run(
        [sys.executable, "examples/quickstart.py"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no warning either: the engines' goodbyes cross as they close
    per_block = 2 * quickstart.SPEC.block_len * quickstart.SPEC.num_layers  # K and V of every layer
    expected = len(quickstart.D_BLOCKS) * per_block
    assert result.stdout == (
        f"succeeded: decode-0 blocks {quickstart.D_BLOCKS} hold {expected} bytes, equal to prefill-0's: True\n"
    )


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_named_python_modules_exist(doc: Path) -> None:
    modules = {m for snippet in code(doc.read_text()) for m in re.findall(r"python3? -m (kvflow(?:\.\w+)*)", snippet)}
    assert [m for m in sorted(modules) if importlib.util.find_spec(m) is None] == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_named_kvflow_commands_exist(doc: Path) -> None:
    commands = {
        tuple(words.split())
        for snippet in code(doc.read_text())
        for words in re.findall(r"^(?:\S*/)?kvflow((?: [a-z][\w-]*){1,3})(?= -|$)", snippet, re.MULTILINE)
    }
    for words in sorted(commands):
        with pytest.raises(SystemExit) as exit_info:
            kvflow_cli([*words, "--help"])
        assert exit_info.value.code == 0, f"`kvflow {' '.join(words)}` is not a kvflow command"


MAPPED_PACKAGES = (
    "kvflow/protocol",
    "kvflow/layout",
    "kvflow/runtime",
    "kvflow/control",
    "transports",
    "integrations/vllm",
    "tools/kvflow_tools",
    "tools/kvflow_tools/routing",
    "tools/kvflow_tools/bench",
    "tools/kvflow_tools/testing",
    "tools/kvflow_tools/gpu",
)


def test_the_module_map_names_every_module_and_no_other() -> None:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    named = {span for span in CODE_SPAN.findall(section) if span.endswith(".py")}
    modules = {p.name for package in MAPPED_PACKAGES for p in (ROOT / package).glob("*.py") if p.name != "__init__.py"}
    assert sorted(modules - named) == [], "modules the map in docs/design.md leaves out"
    assert sorted(named - modules - {"kvflow/errors.py"}) == [], "modules the map names that do not exist"


def test_testing_guide_describes_every_test_file_and_helper() -> None:
    guide = (ROOT / "docs" / "testing.md").read_text()
    missing = [p.name for p in sorted((ROOT / "tests").glob("*.py")) if f"`tests/{p.name}`" not in guide]
    assert missing == ["__init__.py"], "test files and helpers docs/testing.md does not describe"


DOCUMENTED_PACKAGES = (
    "kvflow/protocol",
    "kvflow/layout",
    "kvflow/runtime",
    "kvflow/control",
    "transports",
    "tools/kvflow_tools",
    "tools/kvflow_tools/routing",
    "tools/kvflow_tools/bench",
    "tools/kvflow_tools/testing",
)


@pytest.mark.parametrize("package", DOCUMENTED_PACKAGES)
def test_a_packages_docstring_names_each_of_its_modules(package: str) -> None:
    folder = ROOT / package
    docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
    named = set(re.findall(r"`(\w+)`|\((\w+)\)", docstring))
    words = {w for pair in named for w in pair if w}
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    assert sorted(modules - words) == [], f"{package}/__init__.py's docstring leaves these modules out"


def module_sources() -> list[Path]:
    """Every module of the library, the integrations and the transports, each read once."""
    found = []
    for top in ("kvflow", "transports", "integrations", "tools/kvflow_tools"):
        for path in sorted((ROOT / top).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if not relative.startswith(("kvflow/transports/", "kvflow/integrations/")):  # the symlinks
                found.append(path)
    return found


def test_every_module_docstring_opens_with_a_one_line_summary() -> None:
    long = []
    for path in module_sources():
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        lines = docstring.splitlines()
        if not lines or not lines[0].rstrip().endswith((".", ":", "?")) or (len(lines) > 1 and lines[1].strip()):
            long.append(f"{path.relative_to(ROOT)}: {lines[0] if lines else '(no docstring)'}")
    assert long == [], "module docstrings whose summary is not one line followed by a blank one:\n" + "\n".join(long)
