"""ms-swift GRPO flags -> megagrpo config keys, flag by flag (used by `megagrpo from-swift`).

Each ms-swift flag the user gave is translated by one rule and reported with a status:
``exact`` (the megagrpo key means the same thing), ``differs`` (mapped, but the meaning or a
default differs: the note says how), ``missing`` (not supported: out of scope by design, or a
value the shell computes), ``harmless`` (changes how ms-swift runs or logs, not what it trains)
or ``unknown`` (not known to from-swift). The flags no rule takes get their status from
:mod:`megagrpo.swift.catalog` (:mod:`megagrpo.swift.status`).

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
from megagrpo.swift.catalog import (  # noqa: F401 - re-exported: the tables' old home
    MEGATRON_DEFAULTS,
    OPTIM_DEFAULTS,
    SWIFT_DEFAULTS,
    SWIFT_RLHF_DEFAULTS,
)

EXACT, DIFFERS, MISSING = "exact", "differs", "missing"
HARMLESS, UNKNOWN = "harmless", "unknown"
"""Statuses: ``=`` exact, ``~`` differs, ``x`` not supported (blocks), ``-`` harmless (never
blocks), ``?`` not known to from-swift (blocks unless --allow-unknown)."""

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
        self.renamed: dict[str, str] = {}
        self.world_known = world_size > 1
        self.world_from_shell = False
        """NPROC_PER_NODE / NNODES / torchrun's options are computed by the shell."""
        """The world size was given (--world-size, NPROC_PER_NODE), not assumed to be 1."""
        """ms-swift 3.x flags read as their 4.6 name (new -> old)."""

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
    elif "rollout_importance_sampling_threshold" in t.flags:
        t.add(
            "rollout_importance_sampling_threshold",
            HARMLESS,
            {},
            "no effect without --rollout_importance_sampling_mode",
        )
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
    if max_tokens >= model_len:
        _no_room(t, prompt, model_len, max_tokens)
        return
    if prompt is None or int(prompt) + max_tokens <= model_len:
        return
    budget = model_len - max_tokens
    t.entries = [e for e in t.entries if e.flag != "max_length"]
    t.add(
        "max_length",
        DIFFERS,
        {"data.max_prompt_tokens": budget},
        f"max_length {prompt} + max_completion_length {max_tokens} > vllm_max_model_len "
        f"{model_len}: ms-swift lets a long prompt shorten its completions; megagrpo budgets "
        f"prompts to {budget} tokens (truncation applies beyond)",
    )


def _no_room(t: Translation, prompt: Any, model_len: int, max_tokens: int) -> None:
    """max_completion_length >= vllm_max_model_len: ms-swift shortens every completion to
    max_model_len - its prompt's length, with a warning (``InferEngine.set_default_max_tokens``,
    ``swift/infer_engine/infer_engine.py``); megagrpo budgets lengths up front, so the engine
    context grows by the prompt budget and completions keep max_completion_length."""
    budget = int(prompt) if prompt is not None else 2048
    grown = budget + max_tokens
    t.entries = [e for e in t.entries if e.flag != "vllm_max_model_len"]
    t.add(
        "vllm_max_model_len",
        DIFFERS,
        {"rollout.max_model_len": grown, "model.max_seq_len": grown},
        f"leaves no room for a prompt beside max_completion_length {max_tokens}: ms-swift "
        f"shortens each completion to {model_len} - its prompt's length (with a warning); "
        f"megagrpo cannot cap per prompt: the context is {budget} prompt tokens "
        f"({'max_length' if prompt is not None else 'the default budget'}) + {max_tokens}, so "
        "completions may run up to a prompt's length longer than ms-swift's",
    )
    if prompt is None:
        t.overrides["data.max_prompt_tokens"] = budget


def translate_rollout(t: Translation) -> None:
    """vLLM engine settings."""
    default = (MEGATRON_DEFAULTS if t.flavor == "megatron" else SWIFT_RLHF_DEFAULTS)["use_vllm"]
    on = _bool(t.get("use_vllm")) if "use_vllm" in t.flags else default
    if "use_vllm" in t.flags:
        t.add(
            "use_vllm",
            EXACT if on else DIFFERS,
            {"rollout.engine": "vllm" if on else "hf"},
            "" if on else "the HF engine is exact but slow",
        )
    elif not on:
        t.add(
            "use_vllm",
            DIFFERS,
            {"rollout.engine": "vllm"},
            "not given: swift rlhf's default is its PyTorch engine (PtEngine, use_vllm false); "
            "megagrpo generates with vLLM: the same sampling distribution, faster "
            "(rollout.engine=hf is transformers' generate, as PtEngine)",
            given=False,
            value=False,
        )
    mode = t.get("vllm_mode")
    if on and mode is None:
        t.add(
            "vllm_mode",
            DIFFERS,
            {"rollout.colocate": True},
            "not given: ms-swift 4.6 refuses use_vllm true without vllm_mode (swift rlhf: "
            "'vllm_mode is required when use_vllm is true', arguments/rlhf_args.py; megatron "
            "rlhf, where use_vllm defaults to true: 'Invalid vllm_mode: None', "
            "megatron/trainers/rollout_mixin.py): the command does not run there as given; "
            "translated as colocate (add --vllm_mode colocate)",
            given=False,
            value=None,
        )
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
