"""torch.distributed + Megatron parallel state: the only module touching ``parallel_state``.

``init_parallel`` starts torch.distributed (from torchrun-style env vars, or a private
single-process group when there is none), applies the CPU/gloo shims when CUDA is absent,
initialises Megatron's parallel state and returns :class:`ParallelGroups`, which every other
module receives explicitly (process groups are passed in, never read from globals).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megagrpo.errors import ConfigError, require
from megagrpo.parallel.config import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

log = logging.getLogger(__name__)


@dataclass
class ParallelGroups:
    """Process groups and this rank's coordinates in them.

    Groups: ``tp`` (tensor), ``pp`` (pipeline), ``dp`` (data, non-expert params), ``ep``
    (expert), ``etp`` (expert tensor), ``expert_dp`` (data for expert params), ``mp``
    (tp x pp: holds one full copy of the non-expert weights), ``expert_mp`` (etp x ep x pp:
    one full copy of the expert weights). ``pg_collection`` is Megatron's
    ``ProcessGroupCollection`` for model constructors.
    """

    world_size: int
    rank: int
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    ep: dist.ProcessGroup
    etp: dist.ProcessGroup
    expert_dp: dist.ProcessGroup
    mp: dist.ProcessGroup
    expert_mp: dist.ProcessGroup
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    ep_size: int
    ep_rank: int
    etp_size: int
    etp_rank: int
    expert_dp_size: int
    expert_dp_rank: int
    sequence_parallel: bool
    device: torch.device
    pg_collection: ProcessGroupCollection | None = None
    fake: bool = False
    """True for a meta-device layout built on torch's fake backend (no real collectives)."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _hf(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def validate_layout(parallel_cfg: ParallelConfig, hf_config: Any, world_size: int) -> None:
    """Check that ``parallel_cfg`` divides ``world_size`` and the model (HF config dict or
    object). Raises ConfigError naming the offending key; returns None when valid."""
    p = parallel_cfg
    p.validate("parallel")

    require(
        world_size % (p.tp * p.pp) == 0,
        "parallel.tp",
        f"world size {world_size} is not divisible by tp*pp = {p.tp}*{p.pp}",
    )
    require(
        world_size % (p.ep * p.etp * p.pp) == 0,
        "parallel.ep",
        f"world size {world_size} is not divisible by ep*etp*pp = {p.ep}*{p.etp}*{p.pp}",
    )
    heads = _hf(hf_config, "num_attention_heads")
    groups = _hf(hf_config, "num_key_value_heads", heads)
    require(
        heads % p.tp == 0,
        "parallel.tp",
        f"num_attention_heads={heads} is not divisible by tp={p.tp}",
    )
    require(
        groups % p.tp == 0,
        "parallel.tp",
        f"num_key_value_heads (query groups)={groups} is not divisible by tp={p.tp}",
    )
    vocab = _hf(hf_config, "vocab_size")
    require(vocab % p.tp == 0, "parallel.tp", f"vocab_size={vocab} is not divisible by tp={p.tp}")
    layers = _hf(hf_config, "num_hidden_layers")
    require(
        layers % p.pp == 0,
        "parallel.pp",
        f"num_hidden_layers={layers} is not divisible by pp={p.pp}",
    )
    experts = _hf(hf_config, "num_experts", None) or _hf(hf_config, "num_local_experts", 0) or 0
    if experts:
        require(
            experts % p.ep == 0,
            "parallel.ep",
            f"num_experts={experts} is not divisible by ep={p.ep}",
        )
        moe_ffn = _hf(hf_config, "moe_intermediate_size")
        require(
            moe_ffn % p.etp == 0,
            "parallel.etp",
            f"moe_intermediate_size={moe_ffn} is not divisible by etp={p.etp}",
        )
        require(
            p.tp == 1 or p.sequence_parallel,
            "parallel.sequence_parallel",
            f"MoE models with tp={p.tp} > 1 require sequence_parallel=true (Megatron)",
        )
    else:
        require(p.ep == 1 and p.etp == 1, "parallel.ep", "ep/etp > 1 needs a MoE model")
    ffn = _hf(hf_config, "intermediate_size", 0) or 0
    require(
        ffn % p.tp == 0, "parallel.tp", f"intermediate_size={ffn} is not divisible by tp={p.tp}"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_torch_distributed(backend: str | None, timeout_minutes: int) -> None:
    if dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timeout)
    else:  # single process, no launcher: a private one-rank group
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=timeout,
        )
    log.info(
        "torch.distributed up: backend=%s rank=%d world=%d",
        backend,
        dist.get_rank(),
        dist.get_world_size(),
    )


def init_parallel(
    cfg: ParallelConfig, backend: str | None = None, hf_config: Any = None
) -> ParallelGroups:
    """Initialise torch.distributed (if needed) and Megatron parallel state; return groups.

    Env: torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT(/LOCAL_RANK); without them a
    single-process world is created. Backend: nccl with CUDA, gloo otherwise (or ``backend``).
    ``backend="fake"`` builds the layout for one rank in a single process on torch's fake
    process group (meta-device sizing only; set RANK/WORLD_SIZE in ``cfg``-sized env first,
    see :func:`init_fake_parallel`). When ``hf_config`` is given the layout is validated
    against it (:func:`validate_layout`); otherwise only the world size is checked.
    """
    from megatron.core import parallel_state as ps

    from megagrpo.parallel.cpu_shims import apply_cpu_shims

    cfg.validate("parallel")
    _init_torch_distributed(backend, cfg.timeout_minutes)
    world = dist.get_world_size()
    if hf_config is not None:
        validate_layout(cfg, hf_config, world)
    elif world % (cfg.tp * cfg.pp) or world % (cfg.ep * cfg.etp * cfg.pp):
        raise ConfigError(
            f"config key 'parallel': world size {world} is not divisible by "
            f"tp*pp={cfg.tp * cfg.pp} and ep*etp*pp={cfg.ep * cfg.etp * cfg.pp}"
        )
    fake = dist.get_backend() == "fake"
    if fake or not torch.cuda.is_available():
        apply_cpu_shims(force=True)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.etp,
        distributed_timeout_minutes=cfg.timeout_minutes,
        create_gloo_process_groups=not fake,
    )
    if not fake:
        from megatron.core.tensor_parallel import random as mrandom

        mrandom.model_parallel_cuda_manual_seed(cfg.seed)
    return _collect_groups(cfg, fake)


def init_fake_parallel(cfg: ParallelConfig, world_size: int, rank: int = 0) -> ParallelGroups:
    """One rank of a ``world_size`` layout in this process on torch's "fake" backend.

    Collectives are no-ops; use it only to build models on the meta device (sizing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("init_fake_parallel needs a process without torch.distributed")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return init_parallel(cfg, backend="fake")


def _group(group: object, name: str) -> dist.ProcessGroup:
    """A Megatron getter's result as a process group (they are typed loosely upstream)."""
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"megatron-core returned no {name} process group: {group!r}")
    return group


def _collect_groups(cfg: ParallelConfig, fake: bool) -> ParallelGroups:
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    tp, pp = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    dp = ps.get_data_parallel_group()
    ep, etp = ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    edp = ps.get_expert_data_parallel_group()
    try:
        pgc = ProcessGroupCollection.use_mpu_process_groups()
    except Exception:  # noqa: BLE001 - older/newer mcore: constructors fall back to globals
        pgc = None
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if (torch.cuda.is_available() and not fake)
        else torch.device("cpu")
    )
    return ParallelGroups(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp=_group(tp, "tp"),
        pp=_group(pp, "pp"),
        dp=_group(dp, "dp"),
        ep=_group(ep, "ep"),
        etp=_group(etp, "etp"),
        expert_dp=_group(edp, "expert_dp"),
        mp=_group(ps.get_model_parallel_group(), "mp"),
        expert_mp=_group(ps.get_expert_tensor_model_pipeline_parallel_group(), "expert_mp"),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_size=int(ps.get_expert_tensor_parallel_world_size() or 1),
        etp_rank=int(ps.get_expert_tensor_parallel_rank() or 0),
        expert_dp_size=ps.get_expert_data_parallel_world_size(),
        expert_dp_rank=ps.get_expert_data_parallel_rank(),
        sequence_parallel=bool(cfg.sequence_parallel and cfg.tp > 1),
        device=device,
        pg_collection=pgc,
        fake=fake,
    )


def destroy_parallel(keep_process_group: bool = False) -> None:
    """Tear down Megatron parallel state and (unless ``keep_process_group``, e.g. to switch
    layouts in the same processes) torch.distributed. Safe to call twice."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized() and not keep_process_group:
        dist.destroy_process_group()
