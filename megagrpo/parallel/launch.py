"""Launch N local ranks (torchrun-style env) and collect results.

Used by ``megagrpo verify-model``, ``tools/convert_ckpt.py`` and the gloo tests. Each rank runs
``fn(rank, *args)`` with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set; its
return value is saved with ``torch.save`` (tensors and plain types: it is read back with
``weights_only=True``) and handed back in rank order.

The ranks are forked from a preloaded fork server (:mod:`megagrpo.parallel.forkserver`: torch
and megatron-core are imported once per calling process, not once per rank) with the caller's
environment, working directory and stdout/stderr. As under torchrun, the launcher hosts the
rendezvous store (``TORCHELASTIC_USE_AGENT_STORE=True``) on a port the OS picks when it binds
it: no port is chosen first and bound later, so launches running side by side cannot collide.

When ranks fail, every rank that wrote an error is reported, one line each, and the error
that caused the others is the one raised: a user error (:class:`~megagrpo.errors.MegagrpoError`,
e.g. a missing shard on rank 1) is preferred over the secondary errors it causes elsewhere
(rank 0's gloo "Connection closed by peer"), and is re-raised with its own type so callers
that map user errors to exit status 2 keep doing so. Other failures raise ``RuntimeError``
with the first failing rank's traceback.
"""

from __future__ import annotations

import io
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.spawn import (
    ProcessExitedException,
    ProcessRaisedException,
    start_processes,
)

from megagrpo import errors, fileio
from megagrpo.parallel import forkserver

# Seconds the other ranks get to notice a failed peer and write their own error before they
# are terminated (they usually fail within milliseconds in their next collective).
FAILURE_GRACE_S = 5.0


def _error_record(exc: BaseException) -> dict[str, Any]:
    """What the parent needs to report (and re-raise) ``exc``: plain types only."""
    return {
        "error": traceback.format_exc(),
        "type": type(exc).__name__,
        "message": str(exc),
        "user_error": isinstance(exc, errors.MegagrpoError),
        "time": time.time(),
    }


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's variables for local rank ``rank`` of ``world``, the launcher hosting the
    store on ``port``."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }


def host_store(world: int) -> Any:
    """The launch's rendezvous store (a TCPStore server on an OS-picked port, as torchrun's
    agent hosts it); its ``port`` goes to :func:`rank_env`."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)


def _entry(
    local_rank: int,
    world: int,
    port: int,
    out_dir: str,
    fn: Callable,
    args: tuple,
    setup: forkserver.ChildSetup,
) -> None:
    setup.enter()
    os.environ.update(rank_env(local_rank, world, port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    out = Path(out_dir) / f"rank{local_rank}.pt"
    try:
        result = {"ok": fn(local_rank, *args)}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent verbatim
        result = _error_record(exc)
    buf = io.BytesIO()
    torch.save(result, buf)
    fileio.write_bytes(out, buf.getvalue())  # the parent never reads a half-written result
    forkserver.finish(1 if "error" in result else 0)


def _summary(rank: int, res: dict[str, Any]) -> str:
    lines = str(res.get("message", "")).strip().splitlines()
    return f"rank {rank}: {res.get('type', 'Error')}: {lines[0] if lines else ''}"


def rank_failure(failed: dict[int, dict[str, Any]]) -> Exception:
    """The exception to raise for ``failed`` (rank -> error record written by the rank)."""
    user = {r: res for r, res in failed.items() if res.get("user_error")}
    pool = user or failed
    first = min(pool, key=lambda r: (pool[r].get("time", 0.0), r))
    res = failed[first]
    others = [_summary(r, failed[r]) for r in sorted(failed) if r != first]
    tail = ("\nother ranks failed after it:\n  " + "\n  ".join(others)) if others else ""
    if res.get("user_error"):
        cls = getattr(errors, str(res.get("type")), None)
        if not (isinstance(cls, type) and issubclass(cls, errors.MegagrpoError)):
            cls = errors.MegagrpoError  # a subclass defined elsewhere: keep the base type
        return cls(f"rank {first}: {res['message']}{tail}")
    return RuntimeError(f"rank {first} failed:\n{res['error']}{tail}")


def launch(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned processes; return their results.

    ``fn`` must be importable (module level). Results must be tensors or plain Python types
    (``torch.load(weights_only=True)``). With ``world_size == 1`` and no torch.distributed
    yet, ``fn`` runs in this process. Raises see module docstring.
    """
    import torch.distributed as dist

    if world_size == 1 and not dist.is_initialized() and "RANK" not in os.environ:
        return [fn(0, *args)]
    reason = forkserver.unlike_server(dict(os.environ))
    method = "spawn" if reason else "forkserver"
    if not reason:
        forkserver.context()  # the preload list, before the server starts
    store = host_store(world_size)
    with tempfile.TemporaryDirectory(prefix="megagrpo-launch-") as tmp:
        setup = forkserver.ChildSetup.here()
        ctx = start_processes(
            _entry,
            args=(world_size, store.port, tmp, fn, args, setup),
            nprocs=world_size,
            join=False,
            start_method=method,
        )
        assert ctx is not None  # join=False returns the context
        try:
            while not ctx.join(grace_period=FAILURE_GRACE_S):
                pass
        except ProcessRaisedException as exc:  # pragma: no cover - spawn reports it
            raise RuntimeError(str(exc)) from None
        except ProcessExitedException:
            pass
        found = {}
        for r in range(world_size):
            path = Path(tmp) / f"rank{r}.pt"
            if path.is_file():
                found[r] = torch.load(path, weights_only=True)
        failed = {r: res for r, res in found.items() if "error" in res}
        if failed:
            raise rank_failure(failed)
        missing = [r for r in range(world_size) if r not in found]
        if missing:
            raise RuntimeError(f"rank(s) {missing} died without a result")
        return [found[r]["ok"] for r in range(world_size)]
