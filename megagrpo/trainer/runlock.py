"""One process per run directory: ``RUN_DIR/.lock``, held by rank 0 for the run's life.

Two ``megagrpo train`` on one ``trainer.name`` would interleave everything: one's metrics,
the other's checkpoints, each pruning (or, as stale temporaries, deleting) what the other
writes. Rank 0 therefore takes the lock before it looks at the directory and keeps it until
the run ends; a second process finds it held and stops with a ConfigError (exit status 2)
naming the holder's pid and host.

The lock is an ``fcntl.flock`` on ``.lock`` (released by the kernel when its holder dies,
also on SIGKILL), and the file records ``{"pid", "host", "started"}`` for the message. A
record whose lock nobody holds (a killed run, a requeued job) is taken over with a warning.
Across hosts this relies on ``flock`` being coherent on the shared file system (local disks,
NFSv4, Lustre mounted with ``flock``, GPFS); where ``flock`` is not supported at all the
record decides: a pid that no longer runs on this host is stale, a record of another host is
refused (its liveness cannot be checked from here: remove ``.lock`` once that run is gone).

``.lock`` is opened without following a symbolic link and must be a regular file
(:func:`megagrpo.fileio.open_fd`): a link planted there (a shared runs directory) is refused
naming it and left as it is, and so is a file with several hard links (``ln ~/victim
RUN_DIR/.lock``), so the lock can never truncate someone else's file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from megagrpo import fileio
from megagrpo.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


def _alive(pid: int) -> bool:
    """True when process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _record(fd: int) -> dict[str, Any]:
    """The holder record in the lock file (``{}`` when empty or unreadable)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 4096).decode("utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _held_by(path: Path, holder: dict[str, Any]) -> ConfigError:
    pid, host = holder.get("pid", "?"), holder.get("host", "?")
    since = holder.get("started", "?")
    return ConfigError(
        f"{path.parent} is in use by another megagrpo run (pid {pid} on host {host}, since "
        f"{since}; lock {path}): wait for it to finish or stop it, or choose another "
        "trainer.name / trainer.output_dir"
    )


class RunLock:
    """An acquired run-directory lock (see module docstring); :meth:`release` at the end."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Remove the record and drop the lock (idempotent)."""
        if self._fd < 0:
            return
        try:
            ours = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self._fd).st_ino
            if ours and _record(self._fd).get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = -1


def _flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: flock does not work here."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        return None  # ENOLCK / EOPNOTSUPP: a file system without flock
    return True


def _open_locked(path: Path) -> tuple[int, bool | None]:
    """``(fd, flock outcome)`` of ``path``, retried while the file is replaced under us (a
    holder removes it on release: a lock on the old inode would lock nothing)."""
    while True:
        fd = fileio.open_fd(path, os.O_RDWR | os.O_CREAT, sole=True)  # truncated below
        locked = _flock(fd)
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same or locked is not True:
            return fd, locked
        os.close(fd)


def acquire(run_dir: str | os.PathLike) -> RunLock:
    """Take ``run_dir/.lock`` (creating ``run_dir``); ConfigError naming the holder when
    another live process has it; a dead holder's lock is taken over with a warning."""
    path = Path(run_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, locked = _open_locked(path)
    try:
        holder = _record(fd)
        host = socket.gethostname()
        pid = holder.get("pid")
        if locked is False:
            raise _held_by(path, holder)
        if holder and pid != os.getpid():
            dead_here = holder.get("host") == host and isinstance(pid, int) and not _alive(pid)
            if not (locked or dead_here):  # no flock here: only a dead local pid is stale
                raise _held_by(path, holder)
            log.warning(
                "%s: taking over the lock of pid %s on host %s (that process is gone)",
                path,
                pid,
                holder.get("host"),
            )
        record = {
            "pid": os.getpid(),
            "host": host,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return RunLock(path, fd)
