"""A command forked from the tests' preloaded server (tests/forkrun.py) is what a fresh
``python -m megagrpo.cli`` is: same output, exit status, directory, environment, torch thread
count, random generators and ``multiprocessing`` identity. The slow end-to-end tests fork
their commands on this promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from forkrun import ForkedCli, run_cli, start_cli  # tests/forkrun.py

from megagrpo.parallel import forkserver

PROBE = """
import json, multiprocessing as mp, os, sys, torch
print(json.dumps({
    "threads": torch.get_num_threads(),
    "initial_seed": torch.initial_seed(),
    "rand": torch.rand(4).tolist(),
    "process": mp.current_process().name,
    "no_parent": mp.parent_process() is None,
    "start_method": mp.get_start_method(),
    "cwd": os.getcwd(),
    "probe_var": os.environ.get("FORKRUN_PROBE"),
    "omp": os.environ.get("OMP_NUM_THREADS"),
}))
"""


def _forked_probe(setup: forkserver.ChildSetup) -> None:
    setup.enter()
    import numpy

    exec(PROBE, {})  # noqa: S102 - the same code the fresh interpreter runs
    print(json.dumps({"numpy": float(numpy.random.random())}))
    forkserver.finish(0)


def _run_forked_probe(env: dict[str, str], cwd: str) -> list[dict]:
    with tempfile.TemporaryFile() as out:
        stdio = {1: forkserver.InheritedFd(out.fileno())}
        setup = forkserver.ChildSetup.here(env, cwd, stdio=stdio)
        proc = forkserver.context().Process(target=_forked_probe, args=(setup,))
        proc.start()
        proc.join(300)
        assert proc.exitcode == 0
        out.seek(0)
        return [json.loads(line) for line in out.read().decode().splitlines()]


def test_a_forked_child_has_a_fresh_interpreters_state(tmp_path):
    forkserver.context()  # (the server: started here unless an earlier test started it)
    # the server's environment (another test may have changed os.environ since it started)
    env = dict(forkserver.server_env(), OMP_NUM_THREADS="1", FORKRUN_PROBE="from the caller")
    assert forkserver.unlike_server(env) is None  # else the tests would not fork at all
    fresh = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    want = json.loads(fresh.stdout)
    first, numpy_first = _run_forked_probe(env, str(tmp_path))
    second, numpy_second = _run_forked_probe(env, str(tmp_path))
    # torch and numpy seed their global generators from the OS in each fresh interpreter:
    # two children must not share the server's stream
    random = ("initial_seed", "rand")
    assert first["initial_seed"] != second["initial_seed"] and first["rand"] != second["rand"]
    assert numpy_first != numpy_second
    for got in (first, second):
        assert {k: v for k, v in got.items() if k not in random} == {
            k: v for k, v in want.items() if k not in random
        }
    assert want["threads"] == 1 and want["process"] == "MainProcess"


def test_a_forked_command_prints_and_exits_as_a_fresh_one(tmp_path):
    args = ["no-such-command"]
    forkserver.context()
    env = dict(forkserver.server_env(), OMP_NUM_THREADS="1")
    fresh = subprocess.run(
        [sys.executable, "-m", "megagrpo.cli", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    proc = start_cli(args, env=env, cwd=tmp_path)
    assert isinstance(proc, ForkedCli)  # forked, not the fallback
    proc.communicate(timeout=300)
    forked = run_cli(args, env=env, cwd=tmp_path, timeout=300)
    assert fresh.returncode == 2
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )


def test_a_variable_read_at_import_runs_a_fresh_process(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0" if os.environ.get("TRITON_INTERPRET") else "1")
    assert "TRITON_INTERPRET" in (forkserver.unlike_server(env) or "")
    proc = start_cli(["no-such-command"], env=env, cwd=tmp_path)
    assert isinstance(proc, subprocess.Popen)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "no-such-command" in err


def _registers_a_c_exit_handler(setup: forkserver.ChildSetup, marker: str) -> None:
    import ctypes

    setup.enter()
    libc = ctypes.PyDLL(None)
    handler = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p)
    wrote = handler(lambda status, arg: open(marker, "w").close())  # noqa: SIM115
    globals()["_keep"] = wrote  # alive until exit
    libc.on_exit(wrote, None)  # glibc's atexit with the status (atexit is not exported)
    forkserver.finish(0)


def test_a_forked_child_runs_the_c_level_exit_handlers(tmp_path):
    """C++ destructors and C atexit handlers run at a child's exit as at an interpreter's
    (vLLM's CPU all-reduce unlinks its /dev/shm segments there; multiprocessing's
    ``os._exit`` skipped them and the next 2-rank engine on the machine failed, EEXIST)."""
    marker = tmp_path / "exited"
    setup = forkserver.ChildSetup.here(cwd=str(tmp_path))
    proc = forkserver.context().Process(
        target=_registers_a_c_exit_handler, args=(setup, str(marker))
    )
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0
    assert marker.exists()
