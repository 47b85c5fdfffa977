"""The compatibility gate's rules against their upstream functions (vLLM 0.33.0's Python).

Runs inside tests/contract/upstream_session.py's subprocess (the pinned wheel first on
``sys.path``); returns upstream's answers over grids of layouts, and the tests compare them
with ``megagrpo.gate.compat``'s verdicts, computed in the test process. Upstream code
called (nothing restated here):

* ``ParallelConfig.use_sequence_parallel_moe``; ``fused_moe/layer.py make_parallel_config``
  -> ``FusedMoEParallelConfig.make`` (``flatten_tp_across_dp_and_pcp``);
  ``FusedMoEWithLoRA._ep_check`` / ``_verify_ep_fs`` run on that parallel config;
* ``expert_map_manager.determine_expert_map`` (uneven splits) against the expert block the
  LoRA loader keeps (``lora_model._is_remote_expert_key`` with the layer's
  ``MoEEPLoadSpec``);
* ``LoRAConfig`` (``max_lora_rank``, ``max_cpu_loras``), ``PEFTHelper.validate_legal``;
* ``ModelConfig.verify_with_parallel_config`` (attention heads over TP);
* ``EngineArgs(**kwargs)`` and ``create_engine_config`` for the keywords megagrpo passes with
  each shipped config;
* the FP8 MoE backend choice with LoRA: ``Fp8PerTensorOnlineMoEMethod`` (what
  ``quantization=fp8`` builds for MoE layers) -> ``oracle/fp8.py select_fp8_moe_backend`` ->
  each kernel's ``is_supported_config``, in a forked process whose ``current_platform`` is
  a CUDA platform reporting an H100 (SM 9.0): the one stand-in, for the device query.

Where the process groups' ranks are read (``get_dp_group``, ``get_tensor_model_parallel_rank``)
they are those of rank 0 of the layout (the rules do not depend on the rank).
"""

from __future__ import annotations

import os
import traceback
import types
from contextlib import contextmanager
from typing import Any

BACKENDS = (
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "flashinfer_nvlink_one_sided",
    "nixl_ep",
)
LAYOUTS = [(tp, dp) for tp in (1, 2, 4, 8) for dp in (1, 2, 4, 16)]
CUDA_FP8_BACKENDS = (
    "FLASHINFER_TRTLLM",
    "FLASHINFER_CUTLASS",
    "DEEPGEMM",
    "BATCHED_DEEPGEMM",
    "VLLM_CUTLASS",
    "BATCHED_VLLM_CUTLASS",
    "TRITON",
    "BATCHED_TRITON",
    "MARLIN",
)
"""The FP8 MoE backends of an NVIDIA GPU (``Fp8MoeBackend`` values)."""
SPLITS = [(n, size) for n in (4, 6, 8, 12, 128) for size in (1, 2, 3, 4, 5, 8, 16, 128)]


@contextmanager
def _rank0_groups():
    """``get_dp_group`` / ``get_tensor_model_parallel_rank`` as rank 0 of a layout sees them
    (``FusedMoEParallelConfig.make`` reads them; no process group of that size exists)."""
    from vllm.model_executor.layers.fused_moe import config as moe_config

    saved = moe_config.get_dp_group, moe_config.get_tensor_model_parallel_rank
    moe_config.get_dp_group = lambda: types.SimpleNamespace(rank_in_group=0)
    moe_config.get_tensor_model_parallel_rank = lambda: 0
    try:
        yield
    finally:
        moe_config.get_dp_group, moe_config.get_tensor_model_parallel_rank = saved


def _parallel(tp: int, dp: int, ep: bool, backend: str):
    from vllm.config import ParallelConfig

    return ParallelConfig(
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        enable_expert_parallel=ep,
        all2all_backend=backend,  # pyright: ignore[reportArgumentType]
    )


def moe_lora_layouts() -> list[dict[str, Any]]:
    """Per (TP, DP, EP, backend, fully sharded): upstream's MoE parallel config and whether
    ``FusedMoEWithLoRA``'s start-up asserts pass."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers.fused_moe import FusedMoEWithLoRA
    from vllm.model_executor.layers.fused_moe.layer import make_parallel_config

    rows = []
    with _rank0_groups():
        for tp, dp in LAYOUTS:
            for ep in (False, True):
                for backend in BACKENDS:
                    pc = _parallel(tp, dp, ep, backend)
                    sp = pc.use_sequence_parallel_moe
                    mpc = make_parallel_config(tp, dp, 1, sp, pc)
                    layer = types.SimpleNamespace(
                        use_ep=mpc.use_ep,
                        moe_config=types.SimpleNamespace(moe_parallel_config=mpc),
                    )
                    row = dict(tp=tp, dp=dp, ep=ep, backend=backend, sequence_parallel=sp)
                    row.update(use_ep=mpc.use_ep, ep_size=mpc.ep_size, moe_tp=mpc.tp_size)
                    for fully_sharded in (False, True):
                        key = "lora_ok_fully_sharded" if fully_sharded else "lora_ok"
                        try:
                            FusedMoEWithLoRA._ep_check(layer)  # pyright: ignore
                            lora = LoRAConfig(max_lora_rank=8, fully_sharded_loras=fully_sharded)
                            FusedMoEWithLoRA._verify_ep_fs(layer, lora)  # pyright: ignore
                            row[key] = True
                        except AssertionError:
                            row[key] = False
                    rows.append(row)
    return rows


def expert_splits() -> list[dict[str, Any]]:
    """Per (experts, EP size): the experts ``determine_expert_map`` places on each rank and
    the experts the LoRA loader keeps there (``_is_remote_expert_key`` with the layer's
    local count); ``lora_matches``: the two agree on every rank."""
    from vllm.lora.lora_model import MoEEPLoadSpec, _is_remote_expert_key
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    rows = []
    for n, size in SPLITS:
        if size > n:
            continue
        placed, kept = [], []
        for rank in range(size):
            local, emap, _ = determine_expert_map(size, rank, n)
            here = list(range(n)) if emap is None else [e for e in range(n) if emap[e] >= 0]
            spec = MoEEPLoadSpec(ep_rank=rank, local_num_experts=local, global_num_experts=n)
            lora = [
                e
                for e in range(n)
                if size == 1 or not _is_remote_expert_key(f"m.experts.{e}.up_proj", spec)
            ]
            placed.append(here)
            kept.append(lora)
        rows.append(dict(n=n, size=size, placed=placed, kept=kept, lora_matches=placed == kept))
    return rows


def lora_limits() -> dict[str, Any]:
    """``LoRAConfig``'s accepted ``max_lora_rank`` values (1..1024) and ``max_cpu_loras``
    floor; ``PEFTHelper.validate_legal`` for adapter rank vs the engine's maximum."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    ranks = []
    for r in range(1, 1025):
        try:
            LoRAConfig(max_lora_rank=r)  # pyright: ignore[reportArgumentType]
            ranks.append(r)
        except Exception:  # noqa: BLE001 - pydantic's ValidationError
            pass
    cpu = {}
    for max_loras, max_cpu in ((1, 1), (1, 2), (2, 1), (1, None)):
        try:
            c = LoRAConfig(max_lora_rank=8, max_loras=max_loras, max_cpu_loras=max_cpu)
            cpu[(max_loras, max_cpu)] = c.max_cpu_loras
        except Exception as exc:  # noqa: BLE001
            cpu[(max_loras, max_cpu)] = f"{type(exc).__name__}"
    legal = {}
    for adapter in (4, 8, 16, 32, 64):
        for engine in (8, 16, 32):
            helper = PEFTHelper.from_dict(
                {"r": adapter, "lora_alpha": 2 * adapter, "target_modules": ["q_proj"]}
            )
            try:
                helper.validate_legal(LoRAConfig(max_lora_rank=engine))  # pyright: ignore
                legal[(adapter, engine)] = True
            except ValueError:
                legal[(adapter, engine)] = False
    return {"ranks": ranks, "max_cpu_loras": cpu, "validate_legal": legal}


def attention_heads(model: str) -> dict[int, bool]:
    """``ModelConfig.verify_with_parallel_config`` of the tiny model (4 heads) per TP."""
    from vllm.config import ModelConfig, ParallelConfig

    mc = ModelConfig(model=model, dtype="float32", max_model_len=256)
    out = {}
    for tp in (1, 2, 3, 4, 8):
        try:
            mc.verify_with_parallel_config(ParallelConfig(tensor_parallel_size=tp))
            out[tp] = True
        except ValueError:
            out[tp] = False
    return out


def engine_args(model: str, configs: list[str], hf235: str | None) -> dict[str, Any]:
    """Per shipped config: the ``vllm.LLM`` keywords megagrpo passes on its GPU cluster
    (``engine_kwargs``: colocated, over ``cluster``'s GPUs) accepted by ``EngineArgs``, and
    ``create_engine_config`` of them on Qwen3-235B-A22B's own ``config.json`` (no weights:
    the config is all ``create_engine_config`` reads) with the tiny model's tokenizer (rank
    0 of the layout; sleep mode dropped: the CPU platform has none)."""
    import shutil
    import tempfile

    from vllm.engine.arg_utils import EngineArgs

    from megagrpo.config.loader import load_config
    from megagrpo.rollout import vllm_support
    from megagrpo.rollout.config import serves_adapters
    from megagrpo.trainer.config import RunConfig

    out = {}
    saved = vllm_support.external_dp_size
    target = model
    if hf235:  # the 235B config.json beside the tiny model's tokenizer files
        target = tempfile.mkdtemp(prefix="megagrpo-235b-config-")
        for f in os.listdir(model):
            if not f.endswith(".safetensors") and f != "config.json":
                shutil.copy(os.path.join(model, f), target)
        shutil.copy(hf235, os.path.join(target, "config.json"))
    try:
        for path in configs:
            cfg = load_config(RunConfig, [path])
            ro, world = cfg.rollout, cfg.cluster.num_gpus
            vllm_support.external_dp_size = lambda tp, world=world: (world // tp, 0)
            import torch

            kwargs = vllm_support.engine_kwargs(
                ro,
                cfg.model.hf_path,
                torch.bfloat16,
                0,
                on_gpu=True,
                is_moe=True,
                sleep_mode=ro.colocate,
                lora_enabled=serves_adapters("vllm", ro.enable_lora, True, True),
                returns_routing=bool(ro.return_routing),
            )
            row: dict[str, Any] = {"kwargs": dict(kwargs)}
            try:
                EngineArgs(**kwargs)
                row["accepted"] = True
            except Exception:  # noqa: BLE001
                row["accepted"] = traceback.format_exc()
            probe = dict(kwargs, model=target, tokenizer=target)
            probe.pop("enable_sleep_mode", None)
            probe.pop("sleep_mode_offload_cudagraph", None)
            os.environ["RANK"] = "0"
            try:
                vc = EngineArgs(**probe).create_engine_config()
                lc = vc.lora_config
                row["config"] = {
                    "data_parallel_size": vc.parallel_config.data_parallel_size,
                    "enable_expert_parallel": vc.parallel_config.enable_expert_parallel,
                    "max_loras": None if lc is None else lc.max_loras,
                    "max_cpu_loras": None if lc is None else lc.max_cpu_loras,
                    "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
                }
            except Exception:  # noqa: BLE001
                row["config"] = traceback.format_exc()
            out[os.path.basename(path)] = row
    finally:
        vllm_support.external_dp_size = saved
        if target != model:
            shutil.rmtree(target, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- FP8
def _hopper() -> Any:
    """vLLM's CUDA platform reporting an H100 (compute capability 9.0)."""
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class Hopper(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3"

    return Hopper()


def _moe_config(lora: bool, ep: int):
    import torch
    from vllm.config import ParallelConfig
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    pc = ParallelConfig(enable_expert_parallel=ep > 1)
    with _rank0_groups():
        mpc = FusedMoEParallelConfig.make(1, 1, ep, 1, pc)
    return FusedMoEConfig(
        num_experts=128,
        experts_per_token=8,
        hidden_dim=4096,
        intermediate_size=1536,
        num_local_experts=128 // ep,
        num_logical_experts=128,
        activation=MoEActivation.SILU,
        device="cuda",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=mpc,
        in_dtype=torch.bfloat16,
        is_lora_enabled=lora,
    )


def _fp8_choice() -> dict[str, Any]:
    """In a forked process: switch every module's ``current_platform`` to :func:`_hopper`,
    then build ``Fp8PerTensorOnlineMoEMethod`` (Qwen3-235B's MoE shape, EP 1 and 16) with
    LoRA off and on; also each candidate kernel's ``is_supported_config`` verdict."""
    import sys

    # the CUDA build's op library, imported by vllm/platforms/cuda.py for op registration
    # only: absent here, and no op of it runs in a backend choice
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    from vllm import platforms
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as oracle
    from vllm.model_executor.layers.quantization.online.fp8 import (
        Fp8PerTensorOnlineMoEMethod,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8DynamicTensorSym,
        kFp8StaticTensorSym,
    )

    # imported on the CPU platform (as the session's other probes left them), then every
    # vllm module's `current_platform` becomes the H100 one

    hopper, old = _hopper(), platforms.current_platform
    platforms._current_platform = hopper  # pyright: ignore[reportAttributeAccessIssue]
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and vars(module).get("current_platform") is old:
            module.current_platform = hopper  # pyright: ignore[reportAttributeAccessIssue]
    out: dict[str, Any] = {"platform": type(platforms.current_platform).__name__}
    classes = {}
    for backend in oracle.Fp8MoeBackend:
        try:
            classes[backend.value] = oracle.backend_to_kernel_cls(backend)
        except Exception:  # noqa: BLE001 - backends without a kernel class here
            continue
    keys = (kFp8StaticTensorSym, kFp8DynamicTensorSym, mk.FusedMoEActivationFormat.Standard)
    with set_current_vllm_config(VllmConfig()):
        for mode in ("probed", "libraries_present"):
            if mode == "libraries_present":
                # every kernel's library importable, as in the GPU image (flashinfer,
                # DeepGEMM, CUTLASS ops): only their device probe is replaced
                for backend in CUDA_FP8_BACKENDS:
                    for k in classes.get(backend, ()):
                        k._supports_current_device = staticmethod(lambda: True)
            for ep in (1, 16):
                for lora in (False, True):
                    cfg = _moe_config(lora, ep)
                    try:
                        method = Fp8PerTensorOnlineMoEMethod(moe=cfg)
                        cls = method.experts_cls
                        chosen = (method.fp8_backend.value, cls.__name__ if cls else None)
                        supports = bool(cls is not None and cls.supports_lora())
                    except Exception as exc:  # noqa: BLE001
                        chosen, supports = f"{type(exc).__name__}: {exc}", False
                    kernels = {
                        f"{b}:{k.__name__}": (
                            *k.is_supported_config(k, cfg, *keys),
                            k.supports_lora(),
                        )
                        for b, group in classes.items()
                        for k in group
                    }
                    out[(mode, ep, lora)] = {
                        "chosen": chosen,
                        "supports_lora": supports,
                        "kernels": kernels,
                    }
    return out


def probes(model: str, configs: list[str], hf235: str | None) -> dict[str, Any]:
    from upstream_session import in_fork, outcome

    return {
        "moe_lora_layouts": outcome(moe_lora_layouts),
        "expert_splits": outcome(expert_splits),
        "lora_limits": outcome(lora_limits),
        "attention_heads": outcome(attention_heads, model),
        "engine_args": outcome(engine_args, model, configs, hf235),
        "fp8_backend": in_fork(_fp8_choice),  # its platform switch stays in that process
    }
