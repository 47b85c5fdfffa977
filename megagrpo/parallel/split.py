"""One launch, two worlds (``rollout.placement: separate``): the trainer ranks and the engine ranks.

torchrun starts ``WORLD_SIZE`` processes; the last ``engine_ranks`` serve the rollout engines
and the others train. The trainers' default process group holds the trainers alone (Megatron's
parallel state then sees a world of ``WORLD_SIZE - engine_ranks`` and any layout of it). A
bridge group over every process links them: gloo for control messages, plus NCCL for the
weight buckets on GPU, so any trainer rank can feed any engine rank directly. All of it
rendezvous on torchrun's store (``MASTER_ADDR:MASTER_PORT``) under distinct prefixes.

The engine ranks form replicas of ``tensor_parallel_size`` consecutive ranks. Each replica is a
private world of its own for vLLM (``external_launcher``): ``RANK`` = the rank in the replica,
``WORLD_SIZE`` = its size, ``MASTER_PORT`` = a free port its first rank publishes in the store,
``MASTER_ADDR=127.0.0.1``: a replica lives inside one node (checked: its ranks report the same
host), so its rendezvous never dials another node; ``TORCHELASTIC_USE_AGENT_STORE=False``:
torchrun's agent hosts only the launch's store, the replica's first rank hosts the replica's
(else every rank of the private world waits for a server nobody starts). ``LOCAL_RANK`` stays
torchrun's: the engine takes the GPU of its own process.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass, field
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
    """The gloo group of every process of the launch (ranks = global ranks)."""
    rank: int
    """This process's global rank."""
    engines: list[int] = field(default_factory=list)
    """Global ranks of the engine processes (the last ones)."""
    replica_size: int = 1
    """Engine ranks per replica (``rollout.tensor_parallel_size``)."""
    data: Any = None
    """The weight buckets' group over every process: NCCL on GPU, else None (``bridge``
    carries them)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the buckets travel (``data``'s device)."""

    @property
    def replicas(self) -> list[list[int]]:
        """Global ranks of each engine replica."""
        n = self.replica_size
        return [self.engines[i : i + n] for i in range(0, len(self.engines), n)]

    @property
    def replica(self) -> int:
        """This engine rank's replica (engine ranks only)."""
        return self.engines.index(self.rank) // self.replica_size

    @property
    def leader(self) -> bool:
        """This engine rank is its replica's first rank."""
        return self.engines.index(self.rank) % self.replica_size == 0


def engine_ranks(world: int, num_engines: int) -> list[int]:
    """Global ranks of the engines: the last ``num_engines`` processes."""
    return list(range(world - num_engines, world))


def _check(world: int, num_engines: int, replica_size: int) -> None:
    if "RANK" not in os.environ or world < 2:
        raise ConfigError(
            "config key 'rollout.placement': separate needs at least 2 processes (the last "
            "ones serve the engines): launch with torchrun --nproc-per-node 2 or more"
        )
    if not 1 <= num_engines < world:
        raise ConfigError(
            f"config key 'rollout.engine_ranks': {num_engines} engine processes leave no "
            f"trainer in a launch of {world}"
        )
    if num_engines % replica_size:
        raise ConfigError(
            f"config key 'rollout.engine_ranks': {num_engines} is not a multiple of "
            f"rollout.tensor_parallel_size={replica_size}"
        )
    if dist.is_initialized():
        raise RuntimeError("split_world must run before torch.distributed is initialised")


def split_world(
    timeout_minutes: int = 30, num_engines: int = 1, replica_size: int = 1
) -> WorldSplit:
    """Under a launcher (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``): the
    trainers' default group on trainer ranks, the bridge on every rank, and on engine ranks
    the replica's private world in the environment (module doc). ConfigError naming the key
    for a split the launch cannot make."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _check(world, num_engines, replica_size)
    rank = int(os.environ["RANK"])
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
    engines = engine_ranks(world, num_engines)
    is_engine = rank in engines
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not is_engine:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=PrefixStore("megagrpo/trainers/", store),
            rank=rank,
            world_size=world - num_engines,
            timeout=timeout,
        )
    bridge = dist.ProcessGroupGloo(PrefixStore("megagrpo/bridge/", store), rank, world, timeout)
    split = WorldSplit(is_engine, bridge, rank, engines, replica_size)
    if cuda:
        nccl_store = PrefixStore("megagrpo/bridge-nccl/", store)
        split.data = dist.ProcessGroupNCCL(nccl_store, rank, world, dist.ProcessGroupNCCL.Options())
        split.device = torch.device("cuda", torch.cuda.current_device())
    if is_engine:
        os.environ.update(replica_env(split, PrefixStore("megagrpo/replicas/", store)))
    log.info(
        "world split: rank %d of %d is %s", rank, world, "an engine" if is_engine else "a trainer"
    )
    return split


def replica_env(split: WorldSplit, store: Any) -> dict[str, str]:
    """The environment of this engine rank's replica world (module doc): its first rank picks
    the port; every rank publishes its host, and a replica over several hosts is refused (its
    loopback rendezvous would not reach them)."""
    j, index = split.replica, split.engines.index(split.rank) % split.replica_size
    host = socket.gethostname()
    store.set(f"host/{split.rank}", host)
    if split.leader:
        store.set(f"port/{j}", str(free_port()))
    hosts = {store.get(f"host/{r}").decode() for r in split.replicas[j]}
    if len(hosts) > 1:
        raise ConfigError(
            f"config key 'rollout.tensor_parallel_size': engine replica {j} spans hosts "
            f"{sorted(hosts)}; with rollout.placement=separate a replica must sit inside one "
            "node (rollout.engine_ranks whole nodes, tensor_parallel_size <= GPUs per node)"
        )
    return {
        "RANK": str(index),
        "WORLD_SIZE": str(split.replica_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": store.get(f"port/{j}").decode(),
        # torchrun's agent hosts the launch's store; the replica's first rank hosts this one
        # (with torchrun's flag every rank of the private world would wait for an agent)
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
