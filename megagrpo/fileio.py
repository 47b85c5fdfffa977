"""Atomic file and directory writes: the one way megagrpo writes what a crash must not corrupt.

A file is written to a temporary sibling, flushed and fsynced, then renamed over the target,
and the parent directory is fsynced, so a reader sees the old content or the new one, never a
mix. A directory is built under a temporary sibling and renamed into place the same way.
Temporary siblings are named ``.NAME.tmp`` (``.NAME.tmp-PID`` when several processes may race
for the same target); :func:`is_tmp` recognises both for clean-up (:func:`remove_stale_tmp`).

Large files that must be verified later (checkpoint shards) are written in one pass through
:func:`write_hashed`, which returns their size and SHA-256 (:func:`file_digest` recomputes
them). A write that fails for lack of space names the file (:func:`describe_os_error`).

No write follows a symbolic link. Whoever can write into a shared runs directory could plant
``RUN_DIR/.lock -> ~/.bashrc``; a writer that opened the name would truncate the link's target.
Every file megagrpo writes is therefore opened by :func:`open_fd` (``O_NOFOLLOW``, and only a
regular file: a FIFO would block, a device would be written) or replaced by a rename, which
replaces a link itself and never its target; a link or special file met where megagrpo writes
is refused naming it (:class:`~megagrpo.errors.ConfigError`, nothing is touched). Libraries
that take a file name (safetensors, ``save_pretrained``) write only inside a directory
megagrpo has just created (:func:`fresh_tmp_dir`). ``tests/unit/test_fileio_links.py`` keeps
every other writer out of the package.
"""

from __future__ import annotations

import errno as errno_codes
import hashlib
import json
import os
import re
import shutil
import stat
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from megagrpo.errors import ConfigError, DataError

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


def describe_os_error(exc: OSError, path: str | os.PathLike) -> str:
    """``writing PATH: No space left on device (errno 28, ENOSPC); 1.2 MB free on DIR``: what a
    failed write needs to say (``exc`` raised by ``write`` carries neither path nor space)."""
    code = exc.errno
    name = errno_codes.errorcode.get(code, "?") if code is not None else "?"
    msg = f"writing {path}: {exc.strerror or exc} (errno {code}, {name})"
    try:
        free = shutil.disk_usage(Path(path).parent).free
        msg += f"; {free / 1e6:.1f} MB free on {Path(path).parent}"
    except OSError:
        pass
    return msg


def _named(exc: OSError, path: Path) -> OSError:
    """``exc`` with ``path`` as its filename (``write`` errors carry none)."""
    if exc.filename is not None or exc.errno is None:
        return exc
    out = type(exc)(exc.errno, exc.strerror, str(path))
    out.__cause__ = exc
    return out


def not_writable_here(path: str | os.PathLike, what: str) -> Exception:
    """The ConfigError for a link or special file where megagrpo would write a file."""
    if what == "a directory":
        return ConfigError(f"{path} is a directory: megagrpo writes a file there; name a file")
    return ConfigError(
        f"{path} is {what}: megagrpo writes only regular files of its own there and never "
        "through a link (someone else's file would be overwritten); remove it, or choose "
        "another directory"
    )


def _kind(path: Path) -> str:
    """What ``path`` is, for :func:`not_writable_here`."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "not a regular file"
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "not a regular file"


def open_fd(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` that never follows a symbolic link and opens only a regular
    file (ConfigError naming ``path`` otherwise; a FIFO does not block). The one way megagrpo
    opens a file it writes (see module docstring)."""
    path = Path(path)
    nofollow = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | nofollow, mode)
    except OSError as exc:
        if exc.errno in (errno_codes.ELOOP, errno_codes.EISDIR, errno_codes.ENXIO) or (
            exc.errno == errno_codes.EMLINK and os.path.islink(path)  # FreeBSD's ELOOP
        ):
            raise not_writable_here(path, _kind(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_writable_here(path, _kind(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for appending (created if missing) through :func:`open_fd`, binary and
    unbuffered."""
    return os.fdopen(open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab", buffering=0)


def open_append_text(path: str | os.PathLike) -> TextIO:
    """:func:`open_append` in text mode (UTF-8)."""
    return os.fdopen(open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a", encoding="utf-8")


def open_new(path: str | os.PathLike) -> BinaryIO:
    """``path`` created (or truncated) for binary writing through :func:`open_fd`."""
    return os.fdopen(open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb")


def _open_tmp(tmp: Path) -> BinaryIO:
    """A new temporary sibling, exclusive: a stale one (or a link planted under its name) is
    removed first, never written through."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        return os.fdopen(open_fd(tmp, flags), "wb")
    except FileExistsError:
        if tmp.is_dir() and not tmp.is_symlink():
            raise not_writable_here(tmp, "a directory") from None
        tmp.unlink()  # a file or link: the name goes, never its target
        return os.fdopen(open_fd(tmp, flags), "wb")


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (tmp + fsync + rename + fsync of the parent).
    An OSError (disk full) names ``path``; the previous content is kept. A link at ``path`` is
    replaced, never written through; a directory there is refused."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():
        raise not_writable_here(path, "a directory")
    tmp = tmp_sibling(path, unique=True)
    try:
        fh = _open_tmp(tmp)
    except OSError as exc:
        raise _named(exc, path) from exc
    try:
        with fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _named(exc, path) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`write_bytes`)."""
    return write_bytes(path, text.encode(encoding))


@dataclass(frozen=True)
class FileDigest:
    """Size in bytes and SHA-256 (hex) of a file's content."""

    size: int
    sha256: str


class HashingWriter:
    """A write-only binary stream over ``fh`` that counts and hashes what passes through
    (``torch.save`` accepts it), so a file's digest costs no second read."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self._hash = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None
        """The first write error (a writer such as ``torch.save`` may replace it with its
        own error on the way out)."""

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        try:
            written = self._fh.write(view)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self._hash.update(view)
        self.size += view.nbytes
        return written if written is not None else view.nbytes

    def flush(self) -> None:
        self._fh.flush()

    def digest(self) -> FileDigest:
        return FileDigest(self.size, self._hash.hexdigest())


def write_hashed(path: str | os.PathLike, write: Callable[[HashingWriter], object]) -> FileDigest:
    """Create ``path`` with what ``write(stream)`` writes, flushed and fsynced; returns its
    :class:`FileDigest`. Not atomic by itself: meant for files inside a temporary directory
    that is renamed into place afterwards (:func:`replace_dir`). On an OSError (disk full)
    the partial file is removed and the error names ``path``."""
    path = Path(path)
    stream: HashingWriter | None = None
    try:
        fh = open_new(path)
    except OSError as exc:
        raise _named(exc, path) from exc
    try:
        with fh:
            stream = HashingWriter(fh)
            write(stream)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException as exc:
        path.unlink(missing_ok=True)
        cause = exc if isinstance(exc, OSError) else stream.error if stream else None
        if cause is not None:  # torch.save turns ENOSPC into "unexpected pos 64 vs 0"
            raise _named(cause, path) from exc
        raise
    return stream.digest()


class MalformedJson(DataError):
    """:func:`parse_json` of text that is not JSON (a torn last line is one)."""


def parse_json(text: str | bytes, where: str) -> Any:
    """``json.loads(text)``; DataError naming ``where`` (``file:line``) for anything it cannot
    read: malformed JSON, nesting deeper than the parser's recursion limit (``[[[...]]]``), an
    integer over Python's 4,300 digits, text that is not UTF-8. The one parser of files a user
    or another program wrote (data, predictions, metrics rows, checkpoints' JSON)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedJson(f"{where}: malformed JSON ({exc.msg}, column {exc.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to read") from None
    except UnicodeDecodeError:
        raise DataError(f"{where}: not UTF-8") from None
    except ValueError as exc:  # int_max_str_digits
        first = str(exc).split(";")[0]
        raise DataError(f"{where}: unreadable JSON value ({first})") from None


def file_digest(path: str | os.PathLike, chunk_bytes: int = 8 << 20) -> FileDigest:
    """:class:`FileDigest` of an existing file (read once, in chunks)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            h.update(block)
            size += len(block)
    return FileDigest(size, h.hexdigest())


def tree_size(path: str | os.PathLike) -> int:
    """Bytes of the files under ``path`` (a file: its size); 0 when it is gone."""
    path = Path(path)
    try:
        if not path.is_dir():
            return path.stat().st_size
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return 0


def remove_stale_tmp(directory: str | os.PathLike) -> list[tuple[Path, int]]:
    """Remove every temporary sibling (:func:`is_tmp`) directly under ``directory``: what
    interrupted writes left behind. Only for directories with one writer at a time. Returns
    ``(path, bytes)`` of each removed entry."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in sorted(directory.iterdir()):
        if not is_tmp(entry):
            continue
        size = tree_size(entry)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append((entry, size))
    return removed


def check_out_dir(
    out: str | os.PathLike, protected: Mapping[str, str | os.PathLike], flag: str = "--out"
) -> Path:
    """Refuse an output directory a writer would have to delete or could damage: one that
    exists and is not empty, or that is, contains or lies inside one of ``protected``
    (``{"run directory": path, ...}``: what the command reads). ConfigError naming both."""
    out = Path(out)
    where = out.resolve()
    for what, path in protected.items():
        p = Path(path).resolve()
        if where == p or p.is_relative_to(where) or where.is_relative_to(p):
            rel = "is" if where == p else "contains" if p.is_relative_to(where) else "is inside"
            raise ConfigError(
                f"{flag} {out} {rel} the {what} {path}: choose a directory of its own"
            )
    if out.is_symlink() or out.is_file():
        raise ConfigError(f"{flag} {out} exists and is not a directory: choose a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(
            f"{flag} {out} exists and is not empty: choose a new directory or remove it first"
        )
    return out


def replace_dir(tmp: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Move the finished directory ``tmp`` to ``out`` (an existing ``out`` is removed first;
    a symlink ``out`` is replaced, never its target) and fsync the parent. Between the removal
    and the rename a crash leaves ``tmp`` complete. Callers that write where a user pointed
    check the target with :func:`check_out_dir` first."""
    tmp, out = Path(tmp), Path(out)
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(tmp)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        out.unlink()
    elif out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return out


def fresh_tmp_dir(out: str | os.PathLike, unique: bool = False) -> Path:
    """An empty temporary sibling directory of ``out`` (a stale one is removed first)."""
    tmp = tmp_sibling(out, unique)
    if tmp.is_symlink() or tmp.is_file():
        tmp.unlink()  # the name, never a link's target
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
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def stdout_to_stderr(active: bool = True) -> Iterator[None]:
    """While active, file descriptor 1 is stderr: whatever the engine prints (vLLM's logger
    writes to stdout, its worker processes inherit the descriptor) stays off stdout, which
    then holds only what the command prints afterwards (``--json``)."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
