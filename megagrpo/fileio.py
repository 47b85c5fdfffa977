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
is refused naming it (:class:`~megagrpo.errors.ConfigError`, nothing is touched), and so is a
file with several hard links where megagrpo would truncate it (:func:`open_fd`). A directory
is built under a temporary name and renamed into place only while the destination is still
what was checked (absent, empty, or the same entries: :func:`replace_dir`); what appeared
there meanwhile is never deleted. Libraries that take a file name (safetensors,
``save_pretrained``) write only inside a directory megagrpo has just created
(:func:`fresh_tmp_dir`). ``tests/unit/test_fileio_links.py`` keeps every other writer out of
the package, ``tools/`` and ``scripts/``.
"""

from __future__ import annotations

import errno as errno_codes
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from megagrpo.errors import ConfigError, DataError

log = logging.getLogger(__name__)
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


def open_fd(
    path: str | os.PathLike, flags: int, mode: int = 0o644, *, sole: bool | None = None
) -> int:
    """``os.open(path, flags)`` that never follows a symbolic link and opens only a regular
    file (ConfigError naming ``path`` otherwise; a FIFO does not block). ``sole`` (default:
    when ``flags`` truncate): also refuse a file with more than one hard link, whose other
    names would see the truncation (the check runs before anything is truncated). The one way
    megagrpo opens a file it writes (see module docstring)."""
    path = Path(path)
    truncate = bool(flags & os.O_TRUNC)
    sole = truncate if sole is None else sole
    nofollow = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | nofollow, mode)
    except OSError as exc:
        if exc.errno in (errno_codes.ELOOP, errno_codes.EISDIR, errno_codes.ENXIO) or (
            exc.errno == errno_codes.EMLINK and os.path.islink(path)  # FreeBSD's ELOOP
        ):
            raise not_writable_here(path, _kind(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_writable_here(path, _kind(path))
        if sole and st.st_nlink > 1:
            raise not_writable_here(path, f"a file with {st.st_nlink} hard links")
        os.set_blocking(fd, True)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_file(path: str | os.PathLike, wait: bool = True) -> int | None:
    """An exclusive ``flock`` on ``path`` (created; opened by :func:`open_fd`: no link, no
    FIFO, one hard link): its descriptor, or None when ``wait`` is False and another process
    holds it. Retried while the file is replaced under us (:func:`unlock_file` removes it: a
    lock on the old inode would lock nothing)."""
    while True:
        fd = open_fd(path, os.O_RDWR | os.O_CREAT, sole=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:
            if exc.errno not in (errno_codes.ENOLCK, errno_codes.EOPNOTSUPP, errno_codes.ENOSYS):
                os.close(fd)
                raise
            log.warning("%s: no flock on this file system (%s): not locked", path, exc)
            return fd
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def unlock_file(path: str | os.PathLike, fd: int) -> None:
    """Release :func:`lock_file`'s lock: the file is removed (while still ours), then closed."""
    try:
        if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    except OSError:
        pass
    os.close(fd)


def open_append(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for appending (created if missing; binary, unbuffered): :func:`open_fd`."""
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


def _open_named(open_file: Callable[[], BinaryIO], path: Path) -> BinaryIO:
    """``open_file()``; an OSError names ``path`` (the file the user asked for)."""
    try:
        return open_file()
    except OSError as exc:
        raise _named(exc, path) from exc


def _durable(fh: BinaryIO, body: Callable[[BinaryIO], object]) -> None:
    """``body(fh)``, then flushed and fsynced before ``fh`` closes."""
    with fh:
        body(fh)
        fh.flush()
        os.fsync(fh.fileno())


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (tmp + fsync + rename + fsync of the parent).
    An OSError (disk full) names ``path``; the previous content is kept. A link at ``path`` is
    replaced, never written through; a directory there is refused."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():
        raise not_writable_here(path, "a directory")
    tmp = tmp_sibling(path, unique=True)
    fh = _open_named(lambda: _open_tmp(tmp), path)
    try:
        _durable(fh, lambda f: f.write(data))
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
    fh = _open_named(lambda: open_new(path), path)
    stream = HashingWriter(fh)
    try:
        _durable(fh, lambda _: write(stream))
    except BaseException as exc:
        path.unlink(missing_ok=True)
        cause = exc if isinstance(exc, OSError) else stream.error
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


class OutputChanged(ConfigError):
    """:func:`replace_dir` found its destination changed since it was checked: nothing there
    was replaced or deleted; the finished output stays in its temporary directory."""


DirState = tuple[tuple[str, int, int, int, int], ...]
"""What :func:`dir_state` records: ``(relative path, mode, inode, size, mtime ns)`` of a
directory and of everything under it (links not followed)."""


def dir_state(path: str | os.PathLike) -> DirState | None:
    """``path`` and everything under it, as :func:`replace_dir` compares it (None when
    ``path`` does not exist). Never follows a link."""
    root = Path(path)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return None
    entries = [(".", st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns)]
    if stat.S_ISDIR(st.st_mode):
        for dirpath, dirnames, filenames in os.walk(root):  # never follows links
            for name in dirnames + filenames:
                f = Path(dirpath) / name
                s = os.lstat(f)
                rel = f.relative_to(root).as_posix()
                entries.append((rel, s.st_mode, s.st_ino, s.st_size, s.st_mtime_ns))
    return tuple(sorted(entries))


def files_in(state: DirState | None) -> list[str]:
    """The relative paths of the non-directories in ``state``."""
    return [e[0] for e in state or () if e[0] != "." and not stat.S_ISDIR(e[1])]


def check_rewrite_dir(
    out: Path, default: bool, ours: Collection[str], what: str
) -> DirState | None:
    """What a writer may replace at ``out``: an ``--out`` named by the user must be new or
    empty; the writer's ``default`` directory may hold an earlier output of the same files
    (only ``ours``, relative paths), which the new one replaces. ConfigError naming what is in
    the way (``what``: "this evaluation", "the report"); returns the state to compare at the
    rename (:func:`replace_dir`), None for a user's ``--out``."""
    if not default:
        check_out_dir(out, {}, "--out")
        return None
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"{out} exists and is not a directory: pass --out DIR")
    state = dir_state(out)
    foreign = [f for f in files_in(state) if f not in ours]
    if foreign:
        raise ConfigError(
            f"{out} holds files {what} does not write ({', '.join(foreign[:5])}): it would "
            "replace them; move them, or pass --out DIR"
        )
    return state


def _is_empty(state: DirState | None) -> bool:
    return state is None or (len(state) == 1 and stat.S_ISDIR(state[0][1]))


def _fsync_tree(tmp: Path) -> None:
    for f in tmp.rglob("*"):
        if f.is_file() and not f.is_symlink():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(tmp)


def replace_dir(
    tmp: str | os.PathLike, out: str | os.PathLike, expected: DirState | None = None
) -> Path:
    """Move the finished directory ``tmp`` to ``out`` (fsynced), only while ``out`` is still
    what the caller checked: absent or an empty directory (``expected`` None or empty: one
    ``rename``, which the kernel refuses over anything else), or exactly ``expected``
    (:func:`dir_state` taken when it was checked; then it is moved aside, compared, and
    removed once ``tmp`` is in place). Anything else there (a file that appeared, a link, a
    changed file) raises :class:`OutputChanged` naming it: nothing there is replaced or
    deleted and ``tmp`` is kept."""
    tmp, out = Path(tmp), Path(out)
    _fsync_tree(tmp)

    def changed(now: str) -> OutputChanged:
        return OutputChanged(
            f"{out} changed while this command wrote it ({now}): nothing there was replaced "
            f"or deleted; the finished output is in {tmp} (move it where you want it)"
        )

    def put_back(aside: Path) -> None:
        try:
            os.rename(aside, out)
        except OSError:
            raise OutputChanged(
                f"{out} changed while this command wrote it: what was there is now in "
                f"{aside}, the finished output in {tmp}; nothing was deleted"
            ) from None

    aside = None
    if not _is_empty(expected):
        aside = out.with_name(f".{out.name}.old-{os.getpid()}")
        try:
            os.rename(out, aside)  # out is a directory: rename never follows a link inside
        except FileNotFoundError:
            aside = None  # removed meanwhile: nothing left to replace
        if aside is not None and dir_state(aside) != expected:
            put_back(aside)
            raise changed("its content is not what was checked before writing")
    try:
        os.rename(tmp, out)
    except OSError as exc:
        if aside is not None:
            put_back(aside)
        if exc.errno in (errno_codes.ENOTEMPTY, errno_codes.EEXIST, errno_codes.ENOTDIR):
            shown = ", ".join(files_in(dir_state(out))[:5]) or _kind(out)
            raise changed(f"now holds {shown}") from None
        raise
    fsync_dir(out.parent)
    if aside is not None and (aside.is_symlink() or not aside.is_dir()):
        aside.unlink()  # a link: the name, never its target
    elif aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
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
def atomic_dir(
    out: str | os.PathLike, unique: bool = False, expected: DirState | None | bool = None
) -> Iterator[Path]:
    """Build a directory atomically::

        with atomic_dir(out) as tmp:
            write files into tmp
        # now out holds them; on an exception out is untouched and tmp removed

    ``out`` must still be absent or empty when the work is done, unless ``expected`` is the
    :func:`dir_state` the caller checked (True: ``out`` as it is now, for a directory this
    process owns, e.g. under its run lock); see :func:`replace_dir`. ``unique``: a
    per-process temporary name, for writers that may race for ``out``.
    """
    if expected is True:
        expected = dir_state(out)
    tmp = fresh_tmp_dir(out, unique)
    try:
        yield tmp
        replace_dir(tmp, out, expected or None)
    except OutputChanged:
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def library_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """``write(str(path))``: a library that takes a file name (safetensors' ``save_file``,
    ``savefig``) writing inside a directory megagrpo has just created. A failed write comes
    back as an OSError naming ``path`` (:func:`describe_os_error`), also when the library
    raised its own type (safetensors: ``SafetensorError: ... No space left on device (os
    error 28)``)."""
    path = Path(path)
    try:
        write(str(path))
    except OSError as exc:  # named by the file written (shutil names its source)
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    except Exception as exc:
        m = re.search(r"os error (\d+)", str(exc))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc
    return path
