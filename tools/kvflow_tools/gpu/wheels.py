"""The wheels the GPU check carries to a machine that cannot fetch them, made small enough to travel.

Why: the GPU machine has Python 3.12, torch and msgpack but no network, no NIXL and no pyzmq,
and what travels with the working tree is capped (64 MiB).  The NIXL wheel is 56 MiB, 26.6 of
them `nixl_ep_cu13/` (expert-parallel kernels kvflow never imports), so `prepare` fetches the
wheels for CPython 3.12 on manylinux x86-64, drops that package from the NIXL wheel keeping its
RECORD true file by file, and keeps the smaller wheel only if pip installs it for that target.
Run as ``python -m kvflow_tools.gpu.wheels [--dest .whl]`` (``scripts/gpu-check prepare`` does).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvflow_tools.errors import GpuCheckError

__all__ = ("WHEELS", "check_record", "fetch", "prepare", "strip_package", "travelling_bytes")

# distribution==version, the file name's glob once fetched
WHEELS = (
    ("nixl-cu13==1.5.1", "nixl_cu13-1.5.1-cp312-*.whl"),
    ("pyzmq==27.3.0", "pyzmq-27.3.0-*.whl"),
)
UNUSED_PACKAGE = "nixl_ep_cu13/"  # inside the NIXL wheel; kvflow never imports it
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
PLATFORMS = [  # pip matches each manylinux tag exactly
    f"manylinux_2_{n}_x86_64" for n in (28, 27, 26, 17)
] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
TRAVEL_LIMIT = 60 * 2**20  # what may travel with the tree (the device's limit is 64 MiB)


def _say(line: str, error: bool = False) -> None:
    (sys.stderr if error else sys.stdout).write(line + "\n")


def _record_name(archive: zipfile.ZipFile) -> str:
    for name in archive.namelist():
        if name.endswith(".dist-info/RECORD"):
            return name
    raise GpuCheckError(f"{archive.filename}: no .dist-info/RECORD: not a wheel")


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def check_record(wheel: Path) -> str | None:
    """What is wrong with `wheel`'s RECORD (None: every file but RECORD is listed with its
    sha256 and size, and nothing else is).

    :raises GpuCheckError: `wheel` is not a zip archive with a RECORD.
    """
    try:
        with zipfile.ZipFile(wheel) as archive:
            record = _record_name(archive)
            listed: dict[str, tuple[str, str]] = {}
            for line in archive.read(record).decode().splitlines():
                if line.strip():
                    path, digest, size = line.rsplit(",", 2)
                    listed[path] = (digest, size)
            files = {name for name in archive.namelist() if not name.endswith("/")}
            if files != set(listed):
                return f"RECORD and the archive differ: {sorted(files ^ set(listed))[:5]}"
            for name in sorted(files - {record}):
                data = archive.read(name)
                if listed[name] != (_digest(data), str(len(data))):
                    return f"RECORD's hash or size of {name} is wrong"
    except zipfile.BadZipFile as exc:
        raise GpuCheckError(f"{wheel}: not a wheel: {exc}") from exc
    return None


def strip_package(wheel: Path, out: Path, package: str = UNUSED_PACKAGE) -> int:
    """Write `wheel` without the files under `package` (a folder name ending in "/") to `out`,
    with RECORD rewritten to match; how many files were dropped (0: `out` is not written).

    :raises GpuCheckError: `wheel` is not a wheel, or the result's RECORD does not match it.
    """
    if not package.endswith("/"):
        raise GpuCheckError(f"the package to drop must be a folder ending in '/', not {package!r}")
    try:
        with zipfile.ZipFile(wheel) as source:
            record = _record_name(source)
            dropped = [info for info in source.infolist() if info.filename.startswith(package)]
            if not dropped:
                return 0
            lines = source.read(record).decode().splitlines()
            with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
                for info in source.infolist():
                    if info.filename.startswith(package):
                        continue
                    data = source.read(info)
                    if info.filename == record:
                        data = "".join(line + "\n" for line in lines if not line.startswith(package)).encode()
                    target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    except zipfile.BadZipFile as exc:
        raise GpuCheckError(f"{wheel}: not a wheel: {exc}") from exc
    problem = check_record(out)
    if problem is not None:
        raise GpuCheckError(f"{out}: the stripped wheel's {problem}")
    return len(dropped)


def _pip_installs(wheel: Path, expect: str, absent: str) -> str | None:
    """Why pip cannot install `wheel` for the GPU machine's target with `expect` there and
    `absent` not (None: it can)."""
    with tempfile.TemporaryDirectory(prefix="kvflow-wheel-") as work:
        site = Path(work) / "site"
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        command += ["--only-binary=:all:", *TARGET, "--platform", PLATFORMS[0], "--target", str(site), str(wheel)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            return "pip could not install it: " + (done.stderr or done.stdout).strip()[-500:]
        if not (site / expect).exists() or (site / absent).exists():
            return f"pip installed it without {expect} or with {absent}"
    return None


def fetch(dest: Path, requirement: str, pattern: str) -> Path:
    """The wheel of `requirement` in `dest` (fetched for CPython 3.12, manylinux x86-64, when
    none matching `pattern` is there yet).

    :raises GpuCheckError: pip could not fetch it, or `dest` holds more than one.
    """
    found = sorted(dest.glob(pattern))
    if not found:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *TARGET]
        for platform in PLATFORMS:
            command += ["--platform", platform]
        try:
            subprocess.run([*command, "-d", str(dest), requirement], check=True, timeout=600)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise GpuCheckError(f"pip could not fetch {requirement}: {exc}") from exc
        found = sorted(dest.glob(pattern))
    if len(found) != 1:
        raise GpuCheckError(f"{dest} holds {len(found)} wheels matching {pattern}: keep one (pip stops on two)")
    return found[0]


def travelling_bytes(root: Path, extra: list[Path]) -> int:
    """Bytes that travel with the tree at `root`: its tracked and untracked-not-ignored files,
    and every file under `extra` (the carried folders).

    :raises GpuCheckError: `root` is not a git checkout.
    """
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise GpuCheckError(f"{root} is not a git checkout: {exc}") from exc
    paths = {root / name for name in listed.decode().split("\0") if name}
    for folder in extra:
        paths |= {path for path in folder.rglob("*") if path.is_file()}
    return sum(path.lstat().st_size for path in paths if path.exists() or path.is_symlink())


def prepare(dest: Path) -> list[Path]:
    """Fetch the wheels into `dest`, the NIXL one without its unused package when pip still
    installs it so (else the original stays); the wheels.

    :raises GpuCheckError: see `fetch`; a wheel is not one.
    """
    dest.mkdir(parents=True, exist_ok=True)
    wheels = [fetch(dest, requirement, pattern) for requirement, pattern in WHEELS]
    nixl = wheels[0]
    with tempfile.TemporaryDirectory(prefix="kvflow-strip-") as work:
        stripped = Path(work) / nixl.name  # the same name: its tags must not change
        dropped = strip_package(nixl, stripped)
        if dropped:
            problem = _pip_installs(stripped, "nixl_cu13/_api.py", UNUSED_PACKAGE.rstrip("/"))
            if problem is None:
                before, after = nixl.stat().st_size, stripped.stat().st_size
                shutil.move(stripped, nixl)
                _say(f"{nixl.name}: {dropped} files of {UNUSED_PACKAGE} dropped, {before >> 20} -> {after >> 20} MiB")
            else:
                _say(f"{nixl.name}: kept whole: {problem}")
    return wheels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=Path(".whl"), help="where the wheels go (default .whl)")
    args = parser.parse_args(argv)
    try:
        wheels = prepare(args.dest)
        size = travelling_bytes(Path.cwd(), [args.dest])
    except GpuCheckError as exc:
        _say(f"gpu-check: {exc}", error=True)
        return 1
    for wheel in wheels:
        _say(f"  {wheel}  {wheel.stat().st_size / 2**20:.1f} MiB")
    _say(f"what travels: {size / 2**20:.1f} MiB (limit {TRAVEL_LIMIT >> 20} MiB)")
    if size > TRAVEL_LIMIT:
        _say("gpu-check: too much would travel: ignore or remove something first", error=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
