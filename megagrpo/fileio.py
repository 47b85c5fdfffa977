"""Atomic file and directory writes: the one way megagrpo writes what a crash must not corrupt.

A file is written to a temporary sibling, flushed and fsynced, then renamed over the target,
and the parent directory is fsynced, so a reader sees the old content or the new one, never a
mix. A directory is built under a temporary sibling and renamed into place the same way.
Temporary siblings are named ``.NAME.tmp`` (``.NAME.tmp-PID`` when several processes may race
for the same target); :func:`is_tmp` recognises both for clean-up.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_TMP = re.compile(r"^\..+\.tmp(-\d+)?$")


def tmp_sibling(path: str | os.PathLike, unique: bool = False) -> Path:
    """The temporary sibling of ``path``: ``.NAME.tmp`` (``unique``: ``.NAME.tmp-PID``)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp" + (f"-{os.getpid()}" if unique else ""))


def is_tmp(path: str | os.PathLike) -> bool:
    """True for a name made by :func:`tmp_sibling` (left behind by an interrupted write)."""
    return bool(_TMP.match(Path(path).name))


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename inside it) to disk; best effort where the
    platform cannot open directories."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (tmp + fsync + rename + fsync of the parent)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_sibling(path, unique=True)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`write_bytes`)."""
    return write_bytes(path, text.encode(encoding))


def replace_dir(tmp: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Move the finished directory ``tmp`` to ``out`` (an existing ``out`` is removed first)
    and fsync the parent. Between the removal and the rename a crash leaves ``tmp`` complete."""
    tmp, out = Path(tmp), Path(out)
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return out


def fresh_tmp_dir(out: str | os.PathLike, unique: bool = False) -> Path:
    """An empty temporary sibling directory of ``out`` (a stale one is removed first)."""
    tmp = tmp_sibling(out, unique)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


@contextmanager
def atomic_dir(out: str | os.PathLike, unique: bool = False) -> Iterator[Path]:
    """Build a directory atomically::

        with atomic_dir(out) as tmp:
            write files into tmp
        # now out holds them (replacing an old out); on an exception out is untouched

    ``unique``: a per-process temporary name, for writers that may race for ``out``.
    """
    tmp = fresh_tmp_dir(out, unique)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out)
