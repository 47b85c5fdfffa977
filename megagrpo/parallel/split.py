"""One launch, two worlds (``rollout.placement: separate``): the trainer ranks and an engine rank.

torchrun starts ``WORLD_SIZE`` processes; the last one serves the rollout engine and the
others train. The trainers' default process group holds the trainers alone (Megatron's
parallel state then sees a world of ``WORLD_SIZE - 1`` and any layout of it), and a separate
two-rank group (the "bridge": trainer rank 0 = bridge rank 0, the engine = bridge rank 1)
links them, gloo for control messages, plus NCCL for the weight buckets on GPU. All of it
rendezvous on torchrun's store (``MASTER_ADDR:MASTER_PORT``) under distinct prefixes.

The engine process gets a private one-rank environment (``RANK=0``, ``WORLD_SIZE=1``, a free
``MASTER_PORT``) so that vLLM starts its own one-process world there.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from megagrpo.errors import ConfigError
from megagrpo.parallel.state import free_port

log = logging.getLogger(__name__)


@dataclass
class WorldSplit:
    """This process's side of the split."""

    is_engine: bool
    bridge: Any
    """The two-rank ``ProcessGroupGloo`` (trainer rank 0 and the engine); None on the other
    trainer ranks."""
    peer: int
    """The other end's rank in ``bridge``."""
    data: Any = None
    """The weight buckets' group: NCCL on GPU, else None (``bridge`` carries them)."""
    device: torch.device = torch.device("cpu")
    """Where the buckets travel (``data``'s device)."""


def engine_rank(world: int) -> int:
    """The global rank of the engine: the last process."""
    return world - 1


def split_world(timeout_minutes: int = 30) -> WorldSplit:
    """Under a launcher (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``): the
    trainers' default group (world ``WORLD_SIZE - 1``) on trainer ranks, and the bridge.
    ConfigError naming ``rollout.placement`` with fewer than two processes."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ConfigError(
            "config key 'rollout.placement': separate needs at least 2 processes (the last "
            "one serves the engine): launch with torchrun --nproc-per-node 2 or more"
        )
    if dist.is_initialized():
        raise RuntimeError("split_world must run before torch.distributed is initialised")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(minutes=timeout_minutes)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent,
        timeout=timeout,
        wait_for_workers=False,
    )
    cuda = torch.cuda.is_available()
    is_engine = rank == engine_rank(world)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not is_engine:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=PrefixStore("megagrpo/trainers/", store),
            rank=rank,
            world_size=world - 1,
            timeout=timeout,
        )
    if rank not in (0, engine_rank(world)):
        return WorldSplit(False, None, 0)
    bridge_rank = 1 if is_engine else 0
    prefix = PrefixStore("megagrpo/bridge/", store)
    bridge = dist.ProcessGroupGloo(prefix, bridge_rank, 2, timeout)
    split = WorldSplit(is_engine, bridge, 1 - bridge_rank)
    if cuda:
        nccl_store = PrefixStore("megagrpo/bridge-nccl/", store)
        split.data = dist.ProcessGroupNCCL(
            nccl_store, bridge_rank, 2, dist.ProcessGroupNCCL.Options()
        )
        split.device = torch.device("cuda", torch.cuda.current_device())
    if is_engine:  # vLLM starts its own one-process world here
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_PORT=str(free_port()))
    role = "engine" if is_engine else "trainer"
    log.info("world split: rank %d of %d is the %s", rank, world, role)
    return split
