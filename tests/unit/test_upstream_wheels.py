"""tools/upstream_wheels.py: the upstream wheel cache as a supply chain (red team 4, N1, N9).

The unpacked tree is code the contract tier executes. These tests drive the tool on a cache
of small wheels built here (the real 336 MB wheel is checked against the pin where this
machine has it): only the pinned file name is looked at, its SHA-256 is checked before
unpacking and on every reuse, a corrupt or foreign wheel or a tampered tree is named and
replaced, never unpacked or executed, a planted ``.lock`` (link, FIFO, hard link) is refused
with its target intact, and the temporary trees of a killed call are removed. ``pip
download`` (the network) is replaced by a copy of the wheel it would fetch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megagrpo.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
WHEEL = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"


@pytest.fixture
def tool(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "upstream_wheels", REPO / "tools/upstream_wheels.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "upstream_wheels", module)  # its dataclass needs it
    spec.loader.exec_module(module)
    return module


def _wheel(path: Path, files: dict[str, str]) -> str:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr("vllm-0.33.0.dist-info/METADATA", "Name: vllm\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch, tool):
    """``(cache root, pyproject, good wheel)``: a pyproject pinning a small good wheel, an
    empty cache, and ``pip download`` fetching that wheel."""
    good = tmp_path / "registry" / WHEEL
    good.parent.mkdir()
    sha = _wheel(good, {"vllm/__init__.py": "VERSION = '0.33.0'\n", "vllm/lora/x.py": "A = 1\n"})
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\n[project.optional-dependencies]\ngpu = ["vllm==0.33.0"]\n'
        f'[tool.megagrpo.upstream.vllm]\nwheel = "{WHEEL}"\nsha256 = "{sha}"\n'
    )
    root = tmp_path / "cache"
    monkeypatch.setenv("MEGAGRPO_UPSTREAM_CACHE", str(root))
    calls = []

    def pip_download(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        shutil.copy(pip_download.serves, dest / pip_download.serves.name)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    pip_download.serves = good
    monkeypatch.setattr(tool.subprocess, "run", pip_download)
    return root, pyproject, good, calls, pip_download


def _tree(out: Path) -> set[str]:
    return {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}


def test_first_call_downloads_verifies_and_unpacks_only_python(tool, cache):
    root, pyproject, _, calls, _ = cache
    out = tool.ensure("vllm", pyproject=pyproject)
    assert _tree(out) == {".complete", "vllm/__init__.py", "vllm/lora/x.py"}
    assert len(calls) == 1 and (root / "wheels" / WHEEL).is_file()
    assert tool.ensure("vllm", pyproject=pyproject) == out and len(calls) == 1  # reused


def test_a_planted_wheel_of_another_name_is_never_unpacked(tool, cache):
    """N9: ``vllm-0.33.0-zz-py3-none-any.whl`` sorted last and was unpacked and executed."""
    root, pyproject, good, _, _ = cache
    (root / "wheels").mkdir(parents=True)
    shutil.copy(good, root / "wheels" / WHEEL)
    _wheel(root / "wheels" / "vllm-0.33.0-zz-py3-none-any.whl", {"vllm/evil.py": "BOOM\n"})
    out = tool.ensure("vllm", pyproject=pyproject)
    assert "vllm/evil.py" not in _tree(out)


def test_a_corrupt_wheel_is_named_and_replaced(tool, cache, capsys):
    """N9: a truncated wheel raised a raw BadZipFile on this and every later call."""
    root, pyproject, _, calls, _ = cache
    (root / "wheels").mkdir(parents=True)
    (root / "wheels" / WHEEL).write_bytes(b"PK\x03\x04truncated")
    out = tool.ensure("vllm", pyproject=pyproject)
    err = capsys.readouterr().err
    assert f"{WHEEL} has SHA-256" in err and "corrupt or foreign" in err
    assert len(calls) == 1 and "vllm/__init__.py" in _tree(out)
    assert zipfile.is_zipfile(root / "wheels" / WHEEL)


def test_a_foreign_wheel_under_the_pinned_name_is_replaced_on_reuse(tool, cache, capsys):
    """A valid wheel with other code under the pinned name, after a first good unpack: the
    reuse checks the digest, downloads the pinned one again and unpacks nothing foreign."""
    root, pyproject, _, calls, _ = cache
    out = tool.ensure("vllm", pyproject=pyproject)
    _wheel(root / "wheels" / WHEEL, {"vllm/__init__.py": "import os; os.system('x')\n"})
    assert tool.ensure("vllm", pyproject=pyproject) == out
    assert "corrupt or foreign" in capsys.readouterr().err and len(calls) == 2
    assert (out / "vllm/__init__.py").read_text() == "VERSION = '0.33.0'\n"


def test_a_tampered_tree_is_named_and_unpacked_again(tool, cache, capsys):
    root, pyproject, _, calls, _ = cache
    out = tool.ensure("vllm", pyproject=pyproject)
    (out / "vllm/evil.py").write_text("BOOM\n")
    (out / "vllm/lora/x.py").write_text("A = 2\n")
    assert tool.ensure("vllm", pyproject=pyproject) == out
    err = capsys.readouterr().err
    assert "vllm/evil.py is not in the wheel" in err and "never executed" in err
    assert _tree(out) == {".complete", "vllm/__init__.py", "vllm/lora/x.py"}
    assert (out / "vllm/lora/x.py").read_text() == "A = 1\n" and len(calls) == 1


def test_a_download_of_another_digest_is_refused(tool, cache):
    root, pyproject, _, _, pip_download = cache
    other = root.parent / "mirror" / WHEEL
    other.parent.mkdir()
    _wheel(other, {"vllm/__init__.py": "EVIL = 1\n"})
    pip_download.serves = other
    with pytest.raises(RuntimeError, match="pyproject pins .*not kept, not unpacked"):
        tool.ensure("vllm", pyproject=pyproject)
    assert not (root / "wheels" / WHEEL).exists() and not list((root / "site").glob("*"))
    assert tool.main([]) == 1  # the command line: named, exit 1 (pyproject: the repo's pin)


def test_a_linked_tree_is_replaced_never_followed(tool, cache, tmp_path):
    """A symlinked site tree (no stamp) was a raw ``Cannot call rmtree on a symbolic link``."""
    root, pyproject, _, _, _ = cache
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "vllm").mkdir(parents=True)
    (elsewhere / "vllm" / "keep.py").write_text("mine\n")
    pin = tool.wheel_pin("vllm", pyproject)
    site = tool.site_dir(pin)
    site.parent.mkdir(parents=True)
    site.symlink_to(elsewhere, target_is_directory=True)
    out = tool.ensure("vllm", pyproject=pyproject)
    assert not out.is_symlink() and "vllm/__init__.py" in _tree(out)
    assert (elsewhere / "vllm" / "keep.py").read_text() == "mine\n"


def test_temporary_trees_of_a_killed_call_are_removed(tool, cache):
    root, pyproject, _, _, _ = cache
    for stale in (
        root / "site" / ".tmp-abc",
        root / "site" / ".vllm-0.33.0-x9",
        root / "wheels" / ".tmp-d",
    ):
        (stale / "vllm").mkdir(parents=True)
        (stale / "vllm" / "half.py").write_text("x")
    tool.ensure("vllm", pyproject=pyproject)
    assert sorted(p.name for p in (root / "site").iterdir()) == [
        tool.site_dir(tool.wheel_pin("vllm", pyproject)).name
    ]
    assert [p.name for p in (root / "wheels").iterdir()] == [WHEEL]


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_a_planted_lock_is_refused_and_its_target_kept(tool, cache, tmp_path, kind):
    """N1: ``.lock -> victim`` was truncated (``open("w")``); a FIFO blocked forever."""
    root, pyproject, _, _, _ = cache
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    lock = root / ".lock"
    {"symlink": lambda: lock.symlink_to(victim), "hardlink": lambda: os.link(victim, lock),
     "fifo": lambda: os.mkfifo(lock)}[kind]()  # fmt: skip
    what = {"symlink": "symbolic link", "hardlink": "2 hard links", "fifo": "a FIFO"}[kind]
    with pytest.raises(ConfigError, match=rf"\.lock is .*{what}"):
        tool.ensure("vllm", pyproject=pyproject)
    assert victim.read_text() == "precious\n"


def test_the_repository_pin_is_the_gpu_extra_and_the_cached_wheel(tool):
    """pyproject's [tool.megagrpo.upstream.vllm] names a wheel of the gpu extra's version; a
    wheel this machine already fetched (CI fetches the file PyPI publishes) has the pinned
    SHA-256."""
    pin = tool.wheel_pin("vllm")
    assert pin.version == tool.gpu_pins()["vllm"] and pin.wheel.startswith(f"vllm-{pin.version}-")
    cached = tool.cache_root() / "wheels" / pin.wheel
    if cached.is_file() and not cached.is_symlink():
        assert tool._sha256(cached) == pin.sha256


def test_the_command_line_names_a_broken_pin(tmp_path, monkeypatch):
    """A pyproject without the pin table: exit 1 naming the key (no traceback)."""
    bad = tmp_path / "tools"
    bad.mkdir()
    shutil.copy(REPO / "tools/upstream_wheels.py", bad / "upstream_wheels.py")
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n[project.optional-dependencies]\ngpu = ["vllm==0.33.0"]\n'
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), MEGAGRPO_UPSTREAM_CACHE=str(tmp_path / "c"))
    proc = subprocess.run(
        [sys.executable, str(bad / "upstream_wheels.py"), "--check"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1 and "[tool.megagrpo.upstream.vllm]" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
