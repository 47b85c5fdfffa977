"""Run ``megagrpo`` commands in tests without starting a Python: forked from the preloaded fork
server (:mod:`megagrpo.parallel.forkserver`), with the caller's environment, directory,
stdout/stderr, exit status, pid and signals, as ``subprocess`` would give them.

    proc = run_cli(["train", str(config)], env=env, timeout=600)  # a CompletedProcess
    proc = start_cli(["train", str(config)], env=env)             # Popen-like: pid, signals
    proc = torchrun_cli(2, ["train", str(config)], env=env)        # torchrun --nproc-per-node 2
    spawn(worker, args=(...,), nprocs=2)                           # torch.multiprocessing.spawn

A fresh ``python -m megagrpo.cli`` costs 5-20 s of CPU importing torch, megatron-core,
transformers and vLLM on 2 cores; a fork costs milliseconds. What a fork cannot give is
listed in forkserver's docstring: where ``env`` differs in a variable read at start-up or
import (``PYTHONPATH``, ``PYTHONHASHSEED``...), these helpers run the real command instead.
The real console script, ``python -m megagrpo.cli`` and ``torchrun`` keep their own tests
(tests/unit/test_cli.py, tests/integration/test_trainer_e2e.py, tests/integration/
test_preflight.py): use these helpers where the test is about what the command does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from megagrpo.parallel import forkserver

CLI_PRELOAD = (
    "torch",
    "megatron.core",
    "transformers",
    "vllm",
    "megagrpo.commands.train",
    "megagrpo.trainer.loop",
    "megagrpo.rollout.vllm_engine",
)
"""What the tests' fork server imports (tests/conftest.py sets it before the server starts)."""

_CLI = str(Path(__file__).resolve().parents[1] / "megagrpo" / "cli.py")


def _cli_child(setup: forkserver.ChildSetup, args: list[str]) -> None:
    """The child: ``python -m megagrpo.cli ARGS`` as far as the command can tell."""
    setup.enter()
    sys.argv = [_CLI, *args]
    code: Any = 0
    try:
        from megagrpo.cli import main

        code = main(args)
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        traceback.print_exc()
        forkserver.wind_down()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as the interpreter exits on ^C
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - printed and exit status 1, as the interpreter does
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):  # SystemExit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    forkserver.finish(code)


class ForkedCli:
    """A ``megagrpo`` command in a forked child: the parts of ``subprocess.Popen`` tests use."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        new_session: bool = False,
        stdout: int | None = subprocess.PIPE,
        stderr: int | None = subprocess.PIPE,
    ) -> None:
        self.args = ["megagrpo", *args]
        self.returncode: Any = None  # as typed on subprocess.Popen
        self._files: dict[int, Any] = {}
        stdio: dict[int, Any] = {}
        opened = []
        for fd, how in ((1, stdout), (2, stderr)):
            if how == subprocess.PIPE:
                self._files[fd] = tempfile.TemporaryFile(prefix="megagrpo-forkrun-")
                how = self._files[fd].fileno()
            elif how == subprocess.DEVNULL:
                opened.append(open(os.devnull, "wb"))  # noqa: SIM115 - closed once sent
                how = opened[-1].fileno()
            stdio[fd] = forkserver.InheritedFd(fd if how is None else how)
        setup = forkserver.ChildSetup.here(
            env, None if cwd is None else str(cwd), stdio=stdio, new_session=new_session,
            fresh_path=True,
        )  # fmt: skip
        self._proc = forkserver.context().Process(target=_cli_child, args=(setup, list(args)))
        self._proc.start()
        for f in opened:
            f.close()
        self.pid: int = self._proc.pid  # type: ignore[assignment]

    def poll(self) -> int | None:
        if self.returncode is None and self._proc.exitcode is not None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def _read(self, fd: int) -> str | None:
        f = self._files.get(fd)
        if f is None:
            return None
        f.seek(0)
        return f.read().decode("utf-8", errors="replace")

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        self.wait(timeout)
        out, err = self._read(1), self._read(2)
        for f in self._files.values():
            f.close()
        self._files.clear()
        return out, err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def killpg(self, sig: int = signal.SIGKILL) -> None:
        """The child's session (``new_session=True``): it and whatever it started."""
        if self.poll() is None:
            os.killpg(self.pid, sig)


def _fresh_cmd(args: list[str], nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "megagrpo.cli", *args]
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    return [*launcher, "-m", "megagrpo.cli", *args]


def start_cli(
    args: list[str], env: dict[str, str] | None = None, cwd: Any = None, **kw: Any
) -> ForkedCli | subprocess.Popen:
    """``subprocess.Popen([python, -m, megagrpo.cli, *args], text=True, stdout=PIPE,
    stderr=PIPE, ...)``, forked when ``env`` allows it (see the module docstring)."""
    full = dict(os.environ if env is None else env)
    if forkserver.unlike_server(full):
        popen_kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kw}
        popen_kw["start_new_session"] = popen_kw.pop("new_session", False)
        return subprocess.Popen(_fresh_cmd(args), env=full, cwd=cwd, text=True, **popen_kw)
    return ForkedCli(args, full, cwd, **kw)


def run_cli(
    args: list[str], env: dict[str, str] | None = None, cwd: Any = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, megagrpo.cli, *args], capture_output=True, text=True)``
    forked when it can be; on a timeout the command is killed and TimeoutExpired raised."""
    proc = start_cli(args, env, cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode or 0, out, err)


def torchrun_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What ``torchrun --nproc-per-node NPROC`` (standalone, its agent hosting the store on
    ``port``) sets for local rank ``rank``."""
    from megagrpo.parallel.launch import rank_env

    return {
        **rank_env(rank, nproc, port),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": f"forkrun-{os.getpid()}-{port}",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def torchrun_cli(
    nproc: int, args: list[str], env: dict[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC -m megagrpo.cli ARGS`` with the ranks forked: this
    process hosts the rendezvous store as torchrun's agent does; when a rank fails the others
    are stopped (SIGTERM, SIGKILL after 30 s) and the exit status is 1, as torchrun's.
    stdout/stderr: every rank's, rank 0 first."""
    full = dict(os.environ if env is None else env)
    if forkserver.unlike_server(full):
        proc = subprocess.run(
            _fresh_cmd(args, nproc), env=full, capture_output=True, text=True, timeout=timeout
        )
        return proc
    from megagrpo.parallel.launch import host_store

    full.setdefault("OMP_NUM_THREADS", "1")
    store = host_store(nproc)
    ranks = [
        ForkedCli(args, {**full, **torchrun_env(r, nproc, store.port)}, new_session=True)
        for r in range(nproc)
    ]
    deadline = time.monotonic() + timeout
    code = _watch(ranks, deadline)
    outs = [r.communicate() for r in ranks]
    del store
    if code is None:
        raise subprocess.TimeoutExpired(["torchrun", *args], timeout)
    out = "".join(o or "" for o, _ in outs)
    err = "".join(e or "" for _, e in outs)
    return subprocess.CompletedProcess(["torchrun", *args], code, out, err)


def _watch(ranks: list[ForkedCli], deadline: float) -> int | None:
    """Wait for every rank; stop the others when one fails (torchrun's rule). The exit
    status: 0, 1 when a rank failed, None on the deadline (every rank killed)."""
    failed = False
    while any(r.poll() is None for r in ranks):
        if time.monotonic() > deadline:
            for r in ranks:
                r.killpg()
            for r in ranks:
                r.wait()
            return None
        if not failed and any(r.poll() not in (None, 0) for r in ranks):
            failed = True
            for r in ranks:
                r.send_signal(signal.SIGTERM)
            deadline = min(deadline, time.monotonic() + 30.0)
        time.sleep(0.2)
    return 1 if failed or any(r.returncode for r in ranks) else 0


def _spawned(rank: int, setup: forkserver.ChildSetup, fn: Any, args: tuple) -> None:
    setup.enter()
    fn(rank, *args)
    forkserver.finish(0)


def spawn(fn: Any, args: tuple = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)`` with the processes forked
    from the preloaded server (a real ``spawn`` where the environment asks for one): each
    runs ``fn(rank, *args)`` with this process's environment, directory and stdout/stderr;
    an exception in one is raised here, as ``spawn`` raises it."""
    from torch.multiprocessing.spawn import spawn as torch_spawn
    from torch.multiprocessing.spawn import start_processes

    if forkserver.unlike_server(dict(os.environ)):
        torch_spawn(fn, args=args, nprocs=nprocs, join=True)
        return
    forkserver.context()  # the server, preloaded, before the first child
    setup = forkserver.ChildSetup.here()
    start_processes(
        _spawned, args=(setup, fn, args), nprocs=nprocs, join=True, start_method="forkserver"
    )
