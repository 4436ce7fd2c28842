"""The wheels the GPU check carries (`kvflow_tools.gpu.wheels`): stripped, RECORD kept true, pip-installable.

Real zip archives and the real pip: a wheel shaped like NIXL's (its module, the unused
expert-parallel package, a RECORD with every file's sha256) is stripped, checked and installed
for the GPU machine's target (CPython 3.12, manylinux x86-64) without the network.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvflow_tools.errors import GpuCheckError
from kvflow_tools.gpu.wheels import check_record, prepare, strip_package, travelling_bytes

NIXL = "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl"
ZMQ = "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl"


def _line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(path: Path, files: dict[str, bytes], tag: str = "cp312-cp312-manylinux_2_28_x86_64") -> Path:
    dist, version = path.name.split("-")[:2]
    info = f"{dist}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n".encode(),
    }
    record = "".join(_line(name, data) + "\n" for name, data in files.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", record)
    return path


def nixl_like(folder: Path) -> Path:
    files = {"nixl_cu13/__init__.py": b"", "nixl_cu13/_api.py": b"API = 1\n"}
    files |= {f"nixl_ep_cu13/part{i}.so": bytes([i]) * 4096 for i in range(3)}
    return make_wheel(folder / NIXL, files)


def test_a_stripped_wheel_drops_the_package_and_its_record_lines_and_stays_true(tmp_path: Path) -> None:
    wheel = nixl_like(tmp_path)
    out = tmp_path / "out.whl"
    assert strip_package(wheel, out) == 3
    assert check_record(out) is None
    with zipfile.ZipFile(out) as archive:
        names = archive.namelist()
        record = archive.read(next(n for n in names if n.endswith("RECORD"))).decode()
    assert not [n for n in names if n.startswith("nixl_ep_cu13/")] and "nixl_ep_cu13" not in record
    assert "nixl_cu13/_api.py" in names
    assert strip_package(out, tmp_path / "again.whl") == 0 and not (tmp_path / "again.whl").exists()


def test_a_record_that_lies_is_caught(tmp_path: Path) -> None:
    wheel = nixl_like(tmp_path)
    tampered = tmp_path / "tampered.whl"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(tampered, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            target.writestr(info, b"API = 2\n" if info.filename == "nixl_cu13/_api.py" else data)
    assert "nixl_cu13/_api.py" in (check_record(tampered) or "")
    with zipfile.ZipFile(tmp_path / "extra.whl", "w") as target, zipfile.ZipFile(wheel) as source:
        for info in source.infolist():
            target.writestr(info, source.read(info))
        target.writestr("stray.txt", b"x")
    assert "stray.txt" in (check_record(tmp_path / "extra.whl") or "")


def test_what_is_not_a_wheel_is_refused_by_name(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.whl"
    bogus.write_bytes(b"not a zip")
    with pytest.raises(GpuCheckError, match="bogus.whl"):
        check_record(bogus)
    with pytest.raises(GpuCheckError, match="folder ending in '/'"):
        strip_package(nixl_like(tmp_path), tmp_path / "o.whl", package="nixl_ep_cu13")


def test_prepare_keeps_the_wheels_there_and_installs_the_stripped_one_for_the_gpu_target(tmp_path: Path) -> None:
    """No network: the wheels are there already, as after a first prepare; pip must install the
    stripped NIXL wheel for CPython 3.12 on manylinux x86-64, and install both to a site."""
    nixl = nixl_like(tmp_path)
    make_wheel(tmp_path / ZMQ, {"zmq/__init__.py": b""}, tag="cp312-abi3-manylinux_2_28_x86_64")
    before = nixl.stat().st_size
    wheels = prepare(tmp_path)
    assert [w.name for w in wheels] == [NIXL, ZMQ]
    assert nixl.stat().st_size < before and check_record(nixl) is None
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
        + ["--python-version", "3.12", "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64"]
        + [str(w) for w in wheels],
        check=True,
        timeout=300,
    )
    assert (site / "nixl_cu13" / "_api.py").read_text() == "API = 1\n" and not (site / "nixl_ep_cu13").exists()


def test_two_wheels_of_one_distribution_are_refused(tmp_path: Path) -> None:
    nixl_like(tmp_path)
    make_wheel(tmp_path / "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_17_x86_64.whl", {"nixl_cu13/_api.py": b""})
    with pytest.raises(GpuCheckError, match="keep one"):
        prepare(tmp_path)


def test_what_travels_counts_tracked_and_untracked_files_and_the_carried_folders(tmp_path: Path) -> None:
    plain, tmp_path = tmp_path, tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/.whl/\n")
    (tmp_path / "a.txt").write_bytes(b"x" * 100)
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "w.whl").write_bytes(b"y" * 1000)
    assert travelling_bytes(tmp_path, []) == 100 + len("/.whl/\n")
    assert travelling_bytes(tmp_path, [tmp_path / ".whl"]) == 1100 + len("/.whl/\n")
    with pytest.raises(GpuCheckError, match="not a git checkout"):
        travelling_bytes(plain, [])
