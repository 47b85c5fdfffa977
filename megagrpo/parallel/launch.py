"""Launch N local ranks (torch.multiprocessing spawn, torchrun-style env) and collect results.

Used by ``megagrpo verify-model`` and the gloo tests. Each rank runs ``fn(rank, *args)``
with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set; its return value is
saved with ``torch.save`` and handed back in rank order. A failing rank's traceback is
re-raised in the parent as ``RuntimeError``.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(local_rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    out = Path(out_dir) / f"rank{local_rank}.pt"
    try:
        result = {"ok": fn(local_rank, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        result = {"error": traceback.format_exc()}
    torch.save(result, out)
    if "error" in result:
        raise SystemExit(1)


def launch(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned processes; return their results.

    ``fn`` must be importable (module level). Results must be picklable by ``torch.save``.
    With ``world_size == 1`` and no torch.distributed yet, ``fn`` runs in this process.
    """
    import torch.distributed as dist

    if world_size == 1 and not dist.is_initialized() and "RANK" not in os.environ:
        return [fn(0, *args)]
    with tempfile.TemporaryDirectory(prefix="megagrpo-launch-") as tmp:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, _free_port(), tmp, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            while not ctx.join():
                pass
        except mp.ProcessRaisedException as exc:  # pragma: no cover - spawn reports it
            raise RuntimeError(str(exc)) from None
        except mp.ProcessExitedException:
            pass
        found = {}
        for r in range(world_size):
            path = Path(tmp) / f"rank{r}.pt"
            if path.is_file():
                found[r] = torch.load(path, weights_only=False)
        for r, res in sorted(found.items()):
            if "error" in res:
                raise RuntimeError(f"rank {r} failed:\n{res['error']}")
        missing = [r for r in range(world_size) if r not in found]
        if missing:
            raise RuntimeError(f"rank(s) {missing} died without a result")
        return [found[r]["ok"] for r in range(world_size)]
