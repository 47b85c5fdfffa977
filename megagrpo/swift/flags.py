"""ms-swift GRPO flags -> megagrpo config keys, flag by flag (used by `megagrpo from-swift`).

Each ms-swift flag the user gave is translated by one rule and reported with a status:
``exact`` (the megagrpo key means the same thing), ``differs`` (mapped, but the meaning or a
default differs: the note says how) or ``missing`` (no equivalent: not yet, or out of scope).

Flags the user did *not* give matter too: where ms-swift's default differs from megagrpo's
(``beta`` 0.04 vs 0, ``temperature`` 0.9 vs 1.0, ``lora_alpha`` 32 vs 16, ...), the
ms-swift default is written into the config, so the translated run behaves like the
ms-swift one, and reported as such. Defaults are ms-swift 4.6's
(``swift/megatron/arguments/megatron_args.py`` for ``megatron rlhf``,
``swift/arguments/rlhf_args.py`` + ``swift/rlhf_trainers/args_mixin.py`` +
``swift/trainers/arguments.py`` for ``swift rlhf``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagrpo.errors import ConfigError

EXACT, DIFFERS, MISSING = "exact", "differs", "missing"

# ms-swift 4.6 defaults that matter for GRPO (both front ends unless flavor-specific)
SWIFT_DEFAULTS: dict[str, Any] = {
    "beta": 0.04,
    "temperature": 0.9,
    "lora_alpha": 32.0,
    "lora_dropout": 0.05,
    "lora_rank": 8,
    "epsilon": 0.2,
    "epsilon_high": None,
    "dynamic_sample": False,
    "max_resample_times": 3,
    "num_generations": 8,
    "max_completion_length": 512,
    "lr_schedule": "cosine",
    "target_modules": ["all-linear"],
    "truncation_strategy": "left",
}
# both front ends: weight_decay 0.1, adam_beta2 0.95, seed 42 (megagrpo: 0.0, 0.999, 0)
OPTIM_DEFAULTS = {"weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "seed": 42}
MEGATRON_DEFAULTS = {"global_batch_size": 16}
SWIFT_RLHF_DEFAULTS = {"per_device_train_batch_size": 1}

MATH_VERIFY_NOTE = (
    "ms-swift's 'accuracy' is MathAccuracy (math_verify): it scores 0.0 on every "
    "multiple-choice letter (measured), so an MCQ run with it trained on a constant reward; "
    "mapped to mcq_accuracy (exact-set letters/numbers). Use --keep-swift-accuracy for "
    "'orms:accuracy' (ms-swift's own, needs math_verify)"
)
HF_TARGETS = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
ALL_LINEAR = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]

# flags with no megagrpo equivalent, and why (GPU performance knobs, launcher details ...)
NO_EQUIVALENT: dict[str, str] = {
    "offload_bridge": "performance knob: the HF<->Megatron bridge's buffers (megagrpo streams "
    "weights in buckets: trainer.sync_transport)",
    "optimizer_cpu_offload": "performance knob: Megatron's optimizer CPU offload (the LoRA "
    "optimizer state is small; trainer.offload_during_rollout moves it during generation)",
    "use_precision_aware_optimizer": "performance knob: Megatron's precision-aware optimizer "
    "(megagrpo keeps fp32 LoRA moments)",
    "optimizer_offload_fraction": "performance knob: Megatron's optimizer CPU offload",
    "gradient_accumulation_fusion": "performance knob (fused weight-gradient accumulation)",
    "moe_shared_expert_overlap": "performance knob (overlapped shared-expert compute)",
    "overlap_grad_reduce": "performance knob (DDP overlap)",
    "overlap_param_gather": "performance knob (DDP overlap)",
    "use_distributed_optimizer": "performance knob (sharded optimizer state)",
    "cross_entropy_loss_fusion": "performance knob (megagrpo fuses its own loss)",
    "masked_softmax_fusion": "performance knob",
    "apply_rope_fusion": "performance knob",
    "bias_dropout_fusion": "performance knob",
    "use_liger_kernel": "performance knob (megagrpo fuses its own loss)",
    "vllm_enforce_eager": "performance knob (CUDA graphs of the engine)",
    "vllm_disable_cascade_attn": "performance knob",
    "torch_empty_cache_steps": "memory knob",
    "sequence_parallel_size": "performance knob: Ulysses sequence parallelism of swift rlhf "
    "(megagrpo: parallel.sequence_parallel with TP)",
    "context_parallel_size": "no context parallelism (performance / memory, not what is trained)",
    "num_train_epochs": "megagrpo counts optimizer steps (trainer.max_steps)",
    "swanlab_project": "no SwanLab backend",
    "vllm_max_num_seqs": "not configurable",
    "vllm_engine_kwargs": "not configurable",
    "vllm_enable_prefix_caching": "not configurable",
    "move_model_batches": "no offload",
    "async_generate": "no asynchronous generation",
    "dataset_num_proc": "local JSONL only; no preprocessing workers",
    "dataloader_num_workers": "no data loader workers",
    "dataloader_drop_last": "megagrpo's curriculum sampler always draws full batches",
    "padding_free": "GPU performance knob",
    "attention_backend": "GPU performance knob (model.spec te/local)",
    "moe_permute_fusion": "GPU performance knob",
    "moe_grouped_gemm": "model.moe_grouped_gemm (TE spec only)",
    "deepspeed": "Megatron parallelism instead (parallel.*)",
    "finetune": "always fine-tuning from model.hf_path",
    "no_save_optim": "checkpoints always hold the optimizer (needed for --resume)",
    "no_save_rng": "checkpoints always hold the RNG states (bit-exact --resume)",
    "merge_lora": "tools/convert_ckpt.py export --merge-lora",
    "save_safetensors": "the final adapter is PEFT safetensors; checkpoints are not",
    "load_from_cache_file": "no dataset cache",
    "save_strategy": "trainer.save_every",
    "eval_strategy": "trainer.eval_every",
    "torch_dtype": "model.dtype / rollout.dtype",
    "max_pixels": "text only",
    "log_entropy": "entropy is always logged (loss/entropy)",
    "vllm_server_host": "no vLLM server mode",
    "vllm_server_port": "no vLLM server mode",
    "vllm_server_base_url": "no vLLM server mode",
    "multi_turn_scheduler": "single-turn MCQ only",
    "reward_model": "no reward models, only reward functions",
    "output_dir": "trainer.output_dir/trainer.name (runs/<name>)",
    "add_version": "runs/<trainer.name>",
}


@dataclass
class Entry:
    """One report line: the ms-swift flag, its value, the status, the keys set, a note."""

    flag: str
    value: Any
    status: str
    keys: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    given: bool = True


class Translation:
    """Accumulates config overrides and report entries."""

    def __init__(
        self, flags: dict[str, Any], flavor: str, world_size: int, transformers_major: int = 5
    ) -> None:
        self.flags = flags
        self.flavor = flavor
        self.world_size = world_size
        self.transformers_major = transformers_major
        """transformers major version of the ms-swift run (swift rlhf's all-linear on MoE)."""
        self.entries: list[Entry] = []
        self.overrides: dict[str, Any] = {}
        self.done: set[str] = set()

    def get(self, flag: str, default: Any = None) -> Any:
        return self.flags.get(flag, default)

    def add(
        self,
        flag: str,
        status: str,
        keys: dict[str, Any] | None = None,
        note: str = "",
        *,
        given: bool | None = None,
        value: Any = None,
    ) -> None:
        keys = keys or {}
        self.overrides.update(keys)
        is_given = flag in self.flags if given is None else given
        shown = self.flags.get(flag) if value is None else value
        self.entries.append(Entry(flag, shown, status, keys, note, is_given))
        self.done.add(flag)

    def copy(
        self, flag: str, key: str, cast: Any = None, status: str = EXACT, note: str = ""
    ) -> None:
        """When ``flag`` is given: set ``key`` to its value (``cast(value)``), one report line."""
        if flag in self.flags:
            value = self.get(flag)
            self.add(flag, status, {key: value if cast is None else cast(value)}, note)


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    return str(v).strip().lower() in ("1", "true", "yes", "on")


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else [v]


def _default(
    t: Translation,
    flag: str,
    key: str,
    swift_value: Any,
    megagrpo_value: Any,
    note: str = "",
    cast: Any = None,
    semantic: bool = False,
) -> None:
    """``flag`` given: map it (``semantic``: the meaning differs, say how). Not given: apply
    ms-swift's default when it differs from megagrpo's, and report that."""
    if flag in t.flags:
        value = cast(t.get(flag)) if cast else t.get(flag)
        t.add(flag, DIFFERS if semantic else EXACT, {key: value}, note if semantic else "")
    elif swift_value != megagrpo_value:
        t.add(
            flag,
            DIFFERS,
            {key: swift_value},
            f"not given: ms-swift's default {swift_value!r} applied (megagrpo's default is "
            f"{megagrpo_value!r}){'; ' + note if note else ''}",
            given=False,
            value=swift_value,
        )


def translate_algorithm(t: Translation) -> None:
    """GRPO core: generations, loss, clipping, KL, dynamic sampling, sampling settings."""
    rlhf = t.get("rlhf_type", "grpo")
    if rlhf != "grpo":
        raise ConfigError(f"--rlhf_type {rlhf}: megagrpo trains GRPO only")
    t.add(
        "rlhf_type",
        EXACT,
        {},
        "megagrpo train CONFIG runs GRPO",
        value=rlhf,
    )
    g = int(t.get("num_generations", SWIFT_DEFAULTS["num_generations"]))
    t.add(
        "num_generations",
        EXACT if g >= 2 else MISSING,
        {"rollout.group_size": g} if g >= 2 else {},
        "" if g >= 2 else "not supported: groups of one answer (distillation); GRPO needs >= 2",
        value=g,
    )
    _default(t, "beta", "loss.kl_coef", SWIFT_DEFAULTS["beta"], 0.0, cast=float)
    _sampling(t)
    eps = float(t.get("epsilon", SWIFT_DEFAULTS["epsilon"]))
    t.add("epsilon", EXACT, {"loss.eps_low": eps}, value=eps)
    if t.get("epsilon_high") is not None:
        t.add("epsilon_high", EXACT, {"loss.eps_high": float(t.get("epsilon_high"))})
    else:
        t.add(
            "epsilon_high",
            DIFFERS,
            {"loss.eps_high": eps},
            f"not given: ms-swift clips symmetrically (epsilon_high = epsilon = {eps}); "
            "megagrpo's default is 0.28 (clip-higher)",
            given=False,
            value=eps,
        )
    dyn = _bool(t.get("dynamic_sample", False))
    resample = int(t.get("max_resample_times", SWIFT_DEFAULTS["max_resample_times"]))
    keys: dict[str, Any] = {"dynamic.enabled": dyn}
    if dyn:
        keys.update({"dynamic.policy": "original", "dynamic.max_resample": resample})
    t.add(
        "dynamic_sample",
        DIFFERS,
        keys,
        (
            "policy 'original' reproduces ms-swift (checks R of 1+R rounds, trains the first "
            "batch when short); megagrpo's default 'carry' keeps surplus valid groups"
        )
        if dyn
        else "not given or false: megagrpo's default is true (dynamic sampling on)",
        value=dyn,
    )
    if "max_resample_times" in t.flags:
        t.add(
            "max_resample_times",
            DIFFERS if dyn else MISSING,
            {"dynamic.max_resample": resample} if dyn else {},
            "ms-swift generates 1+R rounds and checks R; megagrpo 'original' does the same"
            if dyn
            else "no effect without --dynamic_sample true",
        )
    mode = t.get("rollout_importance_sampling_mode")
    if mode is not None:
        cap = float(t.get("rollout_importance_sampling_threshold", 2.0))
        ok = mode == "token_truncate"
        t.add(
            "rollout_importance_sampling_mode",
            EXACT if ok else MISSING,
            {"loss.tis_cap": cap} if ok else {},
            "" if ok else f"'{mode}' is not implemented",
        )
        t.done.add("rollout_importance_sampling_threshold")
    if "overlong_filter" in t.flags:
        on = _bool(t.get("overlong_filter"))
        t.add(
            "overlong_filter",
            EXACT,
            {"loss.overlong_filter": on},
            "truncated completions carry no loss (still in the normalisers and the collapse "
            "metrics), as ms-swift masks them"
            if on
            else "",
        )


def _sampling(t: Translation) -> None:
    """temperature (ms-swift trains on logits / temperature: rollout.logprobs sampling) and
    top_p / top_k / min_p / repetition_penalty, applied in vLLM's order by both engines."""
    given = "temperature" in t.flags
    temp = float(t.get("temperature", SWIFT_DEFAULTS["temperature"]))
    note = "training log-probs of logits / temperature, as in ms-swift"
    if not given:
        note = f"not given: ms-swift's default {temp!r} applied (megagrpo's 1.0); " + note
    t.add(
        "temperature",
        EXACT if given else DIFFERS,
        {"rollout.temperature": temp, "rollout.logprobs": "sampling"},
        note,
        given=given,
        value=temp,
    )
    for flag, cast in (
        ("top_p", float),
        ("top_k", int),
        ("min_p", float),
        ("repetition_penalty", float),
    ):
        if flag in t.flags:
            value = cast(t.get(flag))
            value = max(value, 0) if flag == "top_k" else value  # ms-swift's -1: off
            t.add(
                flag,
                EXACT,
                {f"rollout.{flag}": value},
                "vLLM's sampler order on both engines; the engines' log-probs are of the "
                "processed distribution (vLLM's processed_logprobs, as ms-swift requests)",
            )


def translate_model(t: Translation) -> None:
    """Model path, LoRA, dtype, parallel layout."""
    if "model" in t.flags:
        path = str(t.get("model"))
        local = Path(path).expanduser().is_dir()
        t.add(
            "model",
            EXACT if local else DIFFERS,
            {"model.hf_path": path},
            ""
            if local
            else "a hub id: megagrpo loads a local HF directory; download it first and set "
            "model.hf_path",
        )
    _default(t, "lora_rank", "model.lora.rank", 8, 8, cast=int)
    _default(
        t,
        "lora_alpha",
        "model.lora.alpha",
        SWIFT_DEFAULTS["lora_alpha"],
        16.0,
        "scale alpha/r: 4 with ms-swift's defaults, 2 with megagrpo's",
        cast=float,
    )
    dropout = float(t.get("lora_dropout", SWIFT_DEFAULTS["lora_dropout"]))
    t.add(
        "lora_dropout",
        DIFFERS,
        {"model.lora.dropout": 0.0},
        f"{dropout} not carried over: megagrpo trains without LoRA dropout (dropout > 0 "
        "breaks the weight-sync probe at step 1 until the trainer's no-grad forwards run in "
        "eval mode; the fused expert PEFT export has no dropout)",
        value=dropout,
    )
    _targets(t)
    for flag in ("bf16", "torch_dtype"):
        if flag in t.flags:
            v = t.get(flag)
            bf = _bool(v) if flag == "bf16" else str(v) == "bfloat16"
            if bf:
                t.add(flag, EXACT, {"model.dtype": "bfloat16", "rollout.dtype": "bfloat16"})
            else:
                t.add(flag, DIFFERS, {}, "megagrpo's default model.dtype is float32")
    for flag, key in (
        ("tensor_model_parallel_size", "parallel.tp"),
        ("expert_model_parallel_size", "parallel.ep"),
        ("expert_tensor_parallel_size", "parallel.etp"),
        ("pipeline_model_parallel_size", "parallel.pp"),
    ):
        t.copy(flag, key, int)
    t.copy("sequence_parallel", "parallel.sequence_parallel", _bool)
    if "recompute_granularity" in t.flags:
        gran = str(t.get("recompute_granularity"))
        t.add("recompute_granularity", EXACT, {"model.recompute": gran if gran else "none"})
    for flag in ("recompute_method", "recompute_num_layers"):
        if flag in t.flags:
            value = t.get(flag)
            t.add(flag, EXACT, {f"model.{flag}": int(value) if flag.endswith("layers") else value})
    t.copy("recompute_modules", "model.recompute_modules", _list)


MOE_NAME = re.compile(r"(-A\d+(\.\d+)?B|moe)", re.IGNORECASE)
"""A hub id or directory name of a MoE model (Qwen3-30B-A3B, Qwen3-235B-A22B, ...MoE...)."""


def is_moe(t: Translation) -> bool:
    """The model is a mixture of experts: its config.json says so, else its name."""
    name = str(t.get("model", ""))
    cfg = Path(name).expanduser() / "config.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text(encoding="utf-8"))
        return bool(data.get("num_experts") or data.get("num_local_experts"))
    return bool(MOE_NAME.search(name.rstrip("/").split("/")[-1]))


def _targets(t: Translation) -> None:
    raw = [str(x) for x in _list(t.get("target_modules", SWIFT_DEFAULTS["target_modules"]))]
    given = "target_modules" in t.flags
    if raw == ["all-linear"]:
        keys, note = _all_linear(t)
        t.add("target_modules", DIFFERS, {"model.lora.targets": keys}, note, given=given, value=raw)
        return
    mapped = sorted({HF_TARGETS[x] for x in raw if x in HF_TARGETS})
    unknown = [x for x in raw if x not in HF_TARGETS]
    if unknown or not mapped:
        t.add(
            "target_modules",
            MISSING,
            {"model.lora.targets": mapped or ALL_LINEAR},
            f"{unknown} have no megagrpo target (all-router, all-embedding, ...)",
        )
    else:
        t.add(
            "target_modules",
            DIFFERS,
            {"model.lora.targets": mapped},
            "megagrpo adapts fused Megatron linears: q/k/v share linear_qkv, gate/up share "
            "linear_fc1",
        )


def _all_linear(t: Translation) -> tuple[list[str], str]:
    """ms-swift's all-linear per launcher and transformers version (``--transformers``):
    megatron rlhf adapts every Megatron linear but the output layer (the experts' grouped
    linears included, the TopKRouter is no linear: ``swift/megatron/utils/utils.py``
    ``find_all_linears``); swift rlhf every module whose class name holds "linear"
    (``swift/utils/transformers_utils.py``): on a transformers-5 Qwen3-MoE the attention
    only (the experts are 3-D parameters of Qwen3MoeExperts, the router a
    Qwen3MoeTopKRouter), on transformers 4 also every expert's nn.Linear and the router
    ``mlp.gate``."""
    fused = "q/k/v share linear_qkv's A, gate/up linear_fc1's (Megatron's fused linears)"
    if t.flavor == "megatron":
        return ALL_LINEAR, (
            "megatron rlhf's all-linear: attention qkv/o + MLP fc1/fc2, dense and experts, "
            "router and output layer excluded, as ms-swift's find_all_linears on Megatron"
        )
    if not is_moe(t):
        return ALL_LINEAR, f"all-linear = q/k/v/o + gate/up/down; {fused}"
    if t.transformers_major >= 5:
        return ["linear_qkv", "linear_proj"], (
            "swift rlhf's all-linear on a MoE model with transformers 5 (ms-swift 4.6's "
            "default; --transformers 4 for the other): attention only (q/k/v/o): the experts "
            "are 3-D parameters (ms-swift needs --target_parameters for them) and the router "
            f"is no nn.Linear; {fused}"
        )
    return ALL_LINEAR, (
        "swift rlhf's all-linear on a MoE model with transformers 4: attention + every "
        "expert's gate/up/down (mapped) and the router mlp.gate, which megagrpo does not "
        f"adapt (its LoRA on the router is left out); {fused}"
    )


def translate_lengths(t: Translation) -> None:
    """Completion and prompt lengths, truncation, engine context."""
    max_tokens = int(t.get("max_completion_length", SWIFT_DEFAULTS["max_completion_length"]))
    t.add(
        "max_completion_length",
        EXACT,
        {"rollout.max_tokens": max_tokens},
        value=max_tokens,
    )
    prompt = t.get("max_length")
    if prompt is not None:
        t.add(
            "max_length",
            EXACT,
            {"data.max_prompt_tokens": int(prompt)},
            "in GRPO ms-swift's max_length is the longest prompt",
        )
    trunc = t.get("truncation_strategy", SWIFT_DEFAULTS["truncation_strategy"])
    if trunc not in ("left", "delete"):
        raise ConfigError(f"--truncation_strategy {trunc}: GRPO takes left or delete")
    t.add(
        "truncation_strategy",
        EXACT if "truncation_strategy" in t.flags else DIFFERS,
        {"data.truncation": trunc},
        ""
        if "truncation_strategy" in t.flags
        else "not given: ms-swift's GRPO default 'left' applied (megagrpo's default is 'delete')",
        value=trunc,
    )
    model_len = t.get("vllm_max_model_len")
    if model_len is None:
        model_len = (int(prompt) if prompt else 2048) + max_tokens
        t.add(
            "vllm_max_model_len",
            DIFFERS,
            {"rollout.max_model_len": model_len, "model.max_seq_len": model_len},
            f"not given: prompt budget ({prompt or 2048}) + max_completion_length",
            given=False,
            value=model_len,
        )
    else:
        t.add(
            "vllm_max_model_len",
            EXACT,
            {"rollout.max_model_len": int(model_len), "model.max_seq_len": int(model_len)},
        )
        _prompt_within_context(t, prompt, int(model_len), max_tokens)


def _prompt_within_context(t: Translation, prompt: Any, model_len: int, max_tokens: int) -> None:
    """ms-swift accepts max_length + max_completion_length > vllm_max_model_len (a long
    prompt then leaves less room to generate); megagrpo budgets both up front, so the prompt
    budget becomes model_len - max_completion_length (longer prompts are cut, not answered
    shorter)."""
    if prompt is None or int(prompt) + max_tokens <= model_len:
        return
    budget = model_len - max_tokens
    if budget < 1:
        raise ConfigError(
            f"--max_completion_length {max_tokens} leaves no room for a prompt within "
            f"--vllm_max_model_len {model_len}"
        )
    t.entries = [e for e in t.entries if e.flag != "max_length"]
    t.add(
        "max_length",
        DIFFERS,
        {"data.max_prompt_tokens": budget},
        f"max_length {prompt} + max_completion_length {max_tokens} > vllm_max_model_len "
        f"{model_len}: ms-swift lets a long prompt shorten its completions; megagrpo budgets "
        f"prompts to {budget} tokens (truncation applies beyond)",
    )


def translate_rollout(t: Translation) -> None:
    """vLLM engine settings."""
    if "use_vllm" in t.flags:
        on = _bool(t.get("use_vllm"))
        t.add(
            "use_vllm",
            EXACT if on else DIFFERS,
            {"rollout.engine": "vllm" if on else "hf"},
            "" if on else "the HF engine is exact but slow",
        )
    mode = t.get("vllm_mode")
    if mode is not None:
        t.add(
            "vllm_mode",
            EXACT if mode == "colocate" else MISSING,
            {"rollout.colocate": True} if mode == "colocate" else {},
            "" if mode == "colocate" else "no external vLLM server mode",
        )
    for flag, key, cast in (
        ("vllm_tensor_parallel_size", "rollout.tensor_parallel_size", int),
        ("vllm_gpu_memory_utilization", "rollout.gpu_memory_utilization", float),
        ("vllm_max_lora_rank", "rollout.max_lora_rank", int),
        ("vllm_enable_expert_parallel", "rollout.enable_expert_parallel", _bool),
    ):
        t.copy(flag, key, cast)
    if "sleep_level" in t.flags:
        level = int(t.get("sleep_level"))
        if level in (1, 2):
            t.add("sleep_level", EXACT, {"rollout.sleep_level": level})
        else:  # ms-swift 0: never sleep; megagrpo's colocated vLLM always sleeps on a GPU
            t.add(
                "sleep_level",
                DIFFERS,
                {},
                "ms-swift 0 keeps vLLM awake; megagrpo's colocated vLLM always sleeps while "
                "Megatron trains (rollout.sleep_level=0 = auto: 1 with enable_lora, else 2)",
            )
    if "router_replay_mode" in t.flags:
        mode = str(t.get("router_replay_mode")).lower()
        keys = {"disabled": "off", "none": "off", "r2": "r2", "r3": "r3"}
        if mode not in keys:
            t.add("router_replay_mode", MISSING, {}, f"unknown mode {mode!r}")
        else:
            out: dict[str, Any] = {"model.routing_replay": keys[mode]}
            if mode == "r3":
                out["rollout.return_routing"] = True
            if mode == "r2":
                out["trainer.old_logprobs"] = "recompute"
            t.add("router_replay_mode", EXACT, out)
    if "vllm_enable_lora" in t.flags:
        on = _bool(t.get("vllm_enable_lora"))
        keys: dict[str, Any] = {"rollout.enable_lora": on}
        if on:
            keys["trainer.weight_sync"] = "adapter"
        t.add("vllm_enable_lora", EXACT, keys, "adapter-only weight sync" if on else "")
