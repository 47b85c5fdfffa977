"""A preloaded fork server for local child processes: the gloo ranks of :func:`launch` and,
in the tests, whole ``megagrpo`` commands (tests/forkrun.py).

``spawn`` starts each child as a fresh interpreter that imports torch, megatron-core and
transformers (and vLLM) again: 5-20 s of CPU per child on 2 cores, most of a small test's
time. Python's ``forkserver`` start method starts ONE server per parent process that imports
:func:`preload_modules` once and forks every later child from it. The server has run no
OpenMP team, no CUDA context and no thread of its own, so forking it is safe.

A fork is not a fresh interpreter; :class:`ChildSetup` (applied first thing in the child)
takes care of what would otherwise leak from the server into it:

- environment: the child inherits the server's, frozen when the server started; the
  caller's ``os.environ`` is applied instead, plus what the preloaded imports themselves set
  (vLLM sets ``TORCHINDUCTOR_*`` at import: a fresh process that imports it has them too);
- working directory and stdout/stderr: the caller's, passed as file descriptors (the
  server's are those of whichever test started it);
- exit: the child runs ``atexit`` handlers and joins its threads like an interpreter does;
- torch's thread count (read from ``OMP_NUM_THREADS`` when torch is imported, in the
  server) and the random generators the preloaded imports seeded: set as a fresh
  interpreter has them (:func:`_fresh_numerics`);
- ``multiprocessing``'s view: ``MainProcess``, no parent, the default start method.

Each child forks from the server, which has only imported modules, never from a test: no
cache, handler or generator state passes from one child to the next.

What a fork cannot reset is state computed at import time by the preloaded modules: an
environment variable read at import (``PYTHONPATH``, ``PYTHONHASHSEED``, ``TRITON_INTERPRET``:
:data:`IMPORT_TIME_VARS`) must be the same for the caller and the server, which
:func:`unlike_server` checks (callers fall back to a fresh process when it differs).
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import multiprocessing
import os
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing import reduction
from typing import Any, NoReturn

DEFAULT_PRELOAD = ("torch", "torch.distributed", "megatron.core", "transformers")
"""What the server imports unless :func:`set_preload` names other modules."""
IMPORT_TIME_VARS = (
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONUNBUFFERED",
    "PYTHONIOENCODING",
    "PYTHONWARNINGS",
    "PYTHONOPTIMIZE",
    "TRITON_INTERPRET",
    "CUDA_VISIBLE_DEVICES",
    "VLLM_LOGGING_LEVEL",
    "VLLM_CONFIGURE_LOGGING",
)
"""Variables read when the interpreter starts or a preloaded module is imported."""

_server_env: dict[str, str] | None = None
"""``os.environ`` as the server got it (set when this process first uses the server)."""
_IMPORT_SYS_PATH = list(sys.path)
"""In the server: its own ``sys.path`` (a fresh interpreter's, for :meth:`ChildSetup.enter`)."""


_preload: tuple[str, ...] = DEFAULT_PRELOAD


def set_preload(modules: tuple[str, ...] | list[str]) -> None:
    """The modules this process's server imports (before it starts: tests/conftest.py adds
    vLLM and megagrpo's trainer, which every test's command imports)."""
    global _preload
    if _server_env is not None:
        raise RuntimeError("the fork server already runs: set_preload must come first")
    _preload = tuple(modules)


def preload_modules() -> list[str]:
    return [__name__, *_preload]


def context() -> Any:
    """The forkserver multiprocessing context, its server started (and preloaded) on the
    first call in this process, with ``PYTHONHASHSEED=0`` unless the caller set a seed
    (children of one server share its hash seed; a fixed one is what the tests ask for)."""
    global _server_env
    ctx = multiprocessing.get_context("forkserver")
    if _server_env is None:  # the preload list only counts before the server starts
        ctx.set_forkserver_preload(preload_modules())
        env = dict(os.environ)
        env.setdefault("PYTHONHASHSEED", "0")
        saved = os.environ.get("PYTHONHASHSEED")
        os.environ["PYTHONHASHSEED"] = env["PYTHONHASHSEED"]
        try:
            from multiprocessing import forkserver as mp_forkserver

            mp_forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONHASHSEED"]
        _server_env = env
    return ctx


def server_env() -> dict[str, str]:
    """The environment the server started with (this process's, when it has not yet)."""
    return dict(os.environ) if _server_env is None else dict(_server_env)


def unlike_server(env: dict[str, str]) -> str | None:
    """Why a child forked from the server would not be what a fresh interpreter with
    ``env`` is (a variable of :data:`IMPORT_TIME_VARS` differs), or None."""
    base = server_env()
    for var in IMPORT_TIME_VARS:
        if var == "PYTHONHASHSEED" and var not in env:
            continue  # any seed is what an unset variable asks for
        if env.get(var) != base.get(var):
            return f"{var}={env.get(var)!r} (the fork server has {base.get(var)!r})"
    if "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" in base:
        # torch's default thread count is the server's; a set one is applied in the child
        return f"OMP_NUM_THREADS unset (the fork server has {base['OMP_NUM_THREADS']!r})"
    return None


class InheritedFd:
    """A file descriptor of the caller that the child gets a copy of (sent over the
    server's socket while the child is started)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _rebuild_fd, (reduction.DupFd(self.fd),)


def _rebuild_fd(dup: Any) -> int:
    return dup.detach()


@dataclass
class ChildSetup:
    """What the child takes from its caller instead of from the server.

    ``stdio`` maps the child's fd (1, 2) to the caller's; ``fresh_path`` gives the child a
    fresh interpreter's ``sys.path`` (``python -m``: the working directory first) instead of
    the caller's; ``new_session`` makes it a session leader (``start_new_session``)."""

    env: dict[str, str]
    cwd: str
    stdio: dict[int, Any] = field(default_factory=dict)
    fresh_path: bool = False
    new_session: bool = False
    server_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def here(cls, env: dict[str, str] | None = None, cwd: str | None = None, **kw) -> ChildSetup:
        """The caller's environment and directory (or those given); stdout/stderr the
        caller's unless ``stdio`` says otherwise."""
        stdio = kw.pop("stdio", None)
        if stdio is None:
            stdio = {1: InheritedFd(1), 2: InheritedFd(2)}
        return cls(
            env=dict(os.environ if env is None else env),
            cwd=os.path.abspath(cwd or os.getcwd()),
            stdio=stdio,
            server_env=server_env(),
            **kw,
        )

    def enter(self) -> None:
        """In the child, before anything else runs."""
        global _server_env
        from multiprocessing import forkserver as mp_forkserver

        server = mp_forkserver._forkserver  # type: ignore[attr-defined]
        if getattr(server, "_forkserver_address", None) is not None:
            # forked by the server: a launch from here forks from it too (the server is
            # not this process's child, so multiprocessing would start another one)
            server.ensure_running = lambda: None
            _server_env = dict(self.server_env)
            _as_main_process()
        if self.new_session:
            os.setsid()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        # the received descriptors first move above 0-2: one may have landed on a slot that
        # another is about to be copied into (dup2 onto itself, then close, would close it)
        moved = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, 3) for target, fd in self.stdio.items()}
        for fd in self.stdio.values():
            if fd not in self.stdio:
                os.close(fd)
        for target, fd in moved.items():
            os.dup2(fd, target)
            os.close(fd)
        added = {k: v for k, v in os.environ.items() if self.server_env.get(k) != v}
        os.environ.clear()
        os.environ.update({**added, **self.env})
        os.chdir(self.cwd)
        if self.fresh_path:
            sys.path[:] = [self.cwd, *[p for p in _IMPORT_SYS_PATH if p not in ("", ".")]]
        _fresh_numerics(self.env)


def _as_main_process() -> None:
    """What ``multiprocessing`` tells code in a fresh interpreter: this is ``MainProcess``,
    it has no parent process, and the start method is the platform default again (a
    multiprocessing child has it forced to its own, ``forkserver``)."""
    import multiprocessing.context as mp_context
    from multiprocessing import process as mp_process

    mp_process.current_process().name = "MainProcess"
    mp_process._parent_process = None  # type: ignore[attr-defined]
    mp_context._default_context._actual_context = None  # type: ignore[attr-defined]


def _fresh_numerics(env: dict[str, str]) -> None:
    """Thread counts and random generators as a fresh interpreter with ``env`` has them.

    torch reads ``OMP_NUM_THREADS`` once, when it is imported (in the server): the child's is
    applied here (thread count changes reduction order, so results with it). The global
    generators the server seeded when it imported torch and numpy are seeded again from the
    OS, as each fresh interpreter seeds its own (children would otherwise share one stream;
    Python's ``random`` reseeds itself after a fork)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.strip().isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def finish(code: int) -> NoReturn:
    """End a child as the interpreter ends: join its threads, run the ``atexit`` handlers,
    flush, then leave through the C library's ``exit``, which runs the C-level exit handlers
    and C++ static destructors that multiprocessing's ``os._exit`` skips (vLLM's CPU
    all-reduce unlinks its /dev/shm segments there: skipped, they outlive the child and
    the next engine of that TP group on the machine fails with EEXIST)."""
    wind_down()
    ctypes.PyDLL(None).exit(code)  # holds the GIL: daemon threads stay stopped
    os._exit(code)  # not reached


def wind_down() -> None:
    """What the interpreter does before it exits: join the threads, run ``atexit``, flush."""
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
