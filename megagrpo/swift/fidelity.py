"""What makes a translated ms-swift run train like the original (used by `megagrpo from-swift`):
the rules whose absence would let a config train something else without saying so.

* old log-probs: ms-swift's are the training model's (recomputed; an on-policy step has a
  ratio of exactly 1) and it applies no rollout importance sampling unless asked;
* dtype: without ``--bf16``/``--fp16``/``--torch_dtype`` ms-swift loads the model in its
  config.json ``torch_dtype``;
* steps: ``--train_iters`` / ``--max_steps``, else epochs x dataset rows / problems per step;
* the curriculum: ms-swift samples every row, every epoch; megagrpo's retirement is off in a
  translated config and its correctness signal is a named reward;
* values the shell computes (``$(nproc)``) are never mapped;
* everything ms-swift trains that megagrpo cannot (other losses and estimators, server
  mode, asynchronous generation, full fine-tuning, multimodal or unsupported architectures,
  multi-turn and gym rollouts, reward models, teachers, QLoRA) is *blocking*: `from-swift`
  writes no config for it unless ``--allow-partial``.

Flags that only change where, how fast or with what bookkeeping ms-swift runs are reported
as harmless and never block; flags from-swift does not know block with their own reason
(:mod:`megagrpo.swift.catalog`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from megagrpo.errors import ConfigError
from megagrpo.swift.batching import Layout, loss_normaliser
from megagrpo.swift.catalog import UNSUPPORTED
from megagrpo.swift.flags import DIFFERS, EXACT, MISSING, UNKNOWN, Entry, Translation, _bool
from megagrpo.swift.shell import Unexpanded

TEXT_FAMILIES = re.compile(
    r"^(qwen3-|qwen2(\.5)?-|(meta-)?llama|mistral|qwq)", re.IGNORECASE
)  # text families megagrpo trains (model/arch.py SUPPORTED), read off a hub id
MULTIMODAL = re.compile(r"(vl|omni|audio|vision|qwen3\.5|qwen3_5|llava|pixtral)", re.IGNORECASE)


SWIFT_LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "sapo")
"""Loss types megagrpo trains (normalisers: :func:`swift_batching.loss_normaliser`)."""
UNSUPPORTED_LOSSES = {
    "cispo": "CISPO's clipped-weight REINFORCE",
    "real": "REAL's group ranking loss",
    "fipo": "FIPO's future-KL influence weights",
}


def translate_loss_type(t: Translation, lay: Layout) -> None:
    """loss_type x importance_sampling_level: the clip (token ratio, or GSPO's sequence ratio
    broadcast to its tokens) and ms-swift's normaliser of that loss_type under this launcher
    and batch layout (:func:`~megagrpo.swift.batching.loss_normaliser`)."""
    loss = str(t.get("loss_type", "grpo"))
    level = str(t.get("importance_sampling_level", "token"))
    _sapo_taus(t, loss)
    if loss not in SWIFT_LOSS_TYPES:
        why = UNSUPPORTED_LOSSES.get(loss, "unknown to megagrpo")
        t.add("loss_type", MISSING, {}, f"not supported: loss_type '{loss}' ({why})")
        t.done.add("importance_sampling_level")
        return
    if loss == "sapo" and level != "token":
        why = f"not supported with loss_type sapo: '{level}' (megagrpo's SAPO gates token ratios)"
    elif level not in ("token", "sequence"):
        why = f"not supported: '{level}' (megagrpo: token, or sequence = GSPO)"
    else:
        why = ""
    if why:
        t.add("loss_type", EXACT, {}, value=loss)
        t.add("importance_sampling_level", MISSING, {}, why)
        return
    variant = (
        "gspo"
        if level == "sequence"
        else {"dapo": "dapo", "dr_grpo": "dr_grpo", "sapo": "sapo"}.get(loss, "grpo")
    )
    status, agg, why = loss_normaliser(t, loss, lay)
    keys = {"loss.variant": variant, "loss.loss_agg": agg}
    t.add("loss_type", status, keys, f"{agg}: {why}", value=loss)
    if "importance_sampling_level" in t.flags:
        t.add(
            "importance_sampling_level",
            EXACT,
            {"loss.variant": variant},
            "GSPO: the length-normalised sequence ratio, clipped, on every token"
            if level == "sequence"
            else "",
        )


def _sapo_taus(t: Translation, loss: str) -> None:
    """``--tau_pos`` / ``--tau_neg``: SAPO's gate temperatures (ms-swift's defaults 1.0 / 1.05
    are megagrpo's); no effect with another loss_type."""
    for flag, key in (("tau_pos", "loss.sapo_tau_pos"), ("tau_neg", "loss.sapo_tau_neg")):
        if flag not in t.flags:
            continue
        if loss == "sapo":
            t.add(flag, EXACT, {key: float(t.get(flag))})
        else:
            t.add(flag, EXACT, {}, f"no effect: loss_type is {loss}, not sapo")


def blocking(t: Translation) -> list[Entry]:
    """The report's entries that make the written config train something else than ms-swift
    would: not supported, or a value the shell computes (``--allow-partial`` writes it
    anyway)."""
    return [e for e in t.entries if e.status == MISSING]


def unknown(t: Translation) -> list[Entry]:
    """The flags from-swift does not know (``--allow-unknown`` writes the config without
    them)."""
    return [e for e in t.entries if e.status == UNKNOWN]


def translate_unexpanded(t: Translation, env: dict[str, str]) -> None:
    """Flags and environment values only the shell could compute: reported, never mapped
    (their flags are taken out of ``t.flags`` before any other rule reads them)."""
    for flag, value in list(t.flags.items()):
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, Unexpanded) for v in values):
            t.add(
                flag,
                MISSING,
                {},
                f"{value!r} is computed by the shell when the script runs: not evaluated "
                "here; give the value itself",
            )
            del t.flags[flag]
    if isinstance(env.get("TORCHRUN"), Unexpanded):
        t.add(
            "[torchrun options]",
            MISSING,
            {},
            f"torchrun's options {env['TORCHRUN']} are computed by the shell: the number of "
            "processes (swift rlhf's batch size counts them; megatron rlhf's data-parallel "
            "size) is not known here; pass --world-size",
            given=False,
            value=env["TORCHRUN"],
        )
    for key in ("NPROC_PER_NODE", "NNODES"):
        if isinstance(env.get(key), Unexpanded) and t.flavor == "swift":
            t.add(
                key,
                MISSING,
                {},
                f"{key}={env[key]} is computed by the shell: the batch size counts processes; "
                "pass --world-size",
                given=False,
                value=env[key],
            )
    if env.get("MAX_PIXELS") is not None:
        t.add("max_pixels", MISSING, {}, UNSUPPORTED["max_pixels"], given=False, value="env")


def translate_unsupported(t: Translation) -> None:
    """Every given flag of :data:`UNSUPPORTED` (and the values of others that megagrpo cannot
    train) as a blocking entry."""
    for flag, why in UNSUPPORTED.items():
        if flag not in t.flags or flag in t.done:
            continue
        if flag == "async_generate" and not _bool(t.get(flag)):
            t.add(flag, EXACT, {})
        else:
            t.add(flag, MISSING, {}, f"not supported: {why}")
    if "moe_expert_capacity_factor" in t.flags:
        t.add(
            "moe_expert_capacity_factor",
            DIFFERS,
            {},
            "megagrpo's MoE is dropless: every token reaches its experts (ms-swift drops the "
            "tokens beyond this capacity factor, in training only)",
        )
    if str(t.get("vllm_mode", "colocate")) == "server":
        t.done.discard("vllm_mode")
        t.entries = [e for e in t.entries if e.flag != "vllm_mode"]
        t.add("vllm_mode", MISSING, {}, "not supported: an external vLLM server")


def translate_old_logprobs(t: Translation) -> None:
    """ms-swift's ratio is against the training model's own log-probs (recomputed), and it
    corrects the rollout/training mismatch only when rollout_importance_sampling_mode is set."""
    mode = t.get("rollout_importance_sampling_mode")
    keys: dict[str, Any] = {"trainer.old_logprobs": "recompute"}
    if mode is None:
        keys["loss.tis_auto"] = False
        t.add(
            "rollout_importance_sampling_mode",
            DIFFERS,
            keys,
            "not given: no rollout importance sampling, as ms-swift (megagrpo's bf16 default "
            "turns TIS on); old log-probs recomputed by the training model, as ms-swift "
            "(ratio exactly 1 on an on-policy step)",
            given=False,
            value=None,
        )
    else:
        t.overrides.update(keys)


def translate_dtype(t: Translation) -> None:
    """No --bf16 / --fp16 / --torch_dtype: ms-swift loads the model in its config.json dtype
    (``HfConfigFactory.get_torch_dtype``: torch_dtype, else params_dtype)."""
    if any(f in t.flags for f in ("bf16", "fp16", "torch_dtype")):
        if "fp16" in t.flags and _bool(t.get("fp16")):
            t.add("fp16", EXACT, {"model.dtype": "float16", "rollout.dtype": "float16"})
        elif "fp16" in t.flags:
            t.add("fp16", EXACT, {})
        return
    path = Path(str(t.get("model", ""))).expanduser()
    dtype = None
    if (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
        raw = cfg.get("torch_dtype") or cfg.get("params_dtype") or cfg.get("dtype")
        dtype = str(raw).replace("torch.", "") if raw else None
    if dtype in ("bfloat16", "float16", "float32"):
        t.add(
            "torch_dtype",
            DIFFERS,
            {"model.dtype": dtype, "rollout.dtype": dtype},
            f"not given: the model's config.json torch_dtype {dtype}, as ms-swift loads it "
            "(megagrpo's default is float32)",
            given=False,
            value=dtype,
        )
    else:
        t.add(
            "torch_dtype",
            DIFFERS,
            {},
            "not given: ms-swift loads the model in its config.json torch_dtype, which is not "
            "readable here (a hub id, or no torch_dtype): set model.dtype / rollout.dtype to "
            "it (megagrpo's default is float32)",
            given=False,
            value=None,
        )


def translate_architecture(t: Translation) -> None:
    """A model megagrpo cannot train (multimodal, or a family it has no provider for) blocks;
    a local directory is judged by its config.json model_type, a hub id by its name."""
    if "model" not in t.flags:
        return
    name = str(t.get("model"))
    path = Path(name).expanduser()
    if looks_local(name) and not path.exists():
        t.entries = [e for e in t.entries if e.flag != "model"]
        base = name.rstrip("/").split("/")[-1]
        multimodal = bool(MULTIMODAL.search(base))
        t.add(
            "model",
            MISSING if multimodal else DIFFERS,
            {"model.hf_path": name},
            f"{name}: not found here (not mounted on this machine?): written as given; the "
            "architecture and dtype are checked when `megagrpo train` loads it"
            + (f"; not supported: {base} names a multimodal model" if multimodal else ""),
        )
        return
    if (path / "config.json").is_file():
        from megagrpo.model.arch import SUPPORTED

        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
        ok = cfg.get("model_type") in SUPPORTED
        why = f"model_type {cfg.get('model_type')!r} (megagrpo: {', '.join(SUPPORTED)})"
    else:
        base = name.rstrip("/").split("/")[-1]
        ok = bool(TEXT_FAMILIES.match(base)) and not MULTIMODAL.search(base)
        why = (
            f"{base}: a multimodal (vision-language) model; megagrpo trains text models"
            if MULTIMODAL.search(base)
            else f"{base}: a family megagrpo has no provider for (it trains Qwen3(-MoE), "
            "Qwen2, Llama, Mistral text models)"
        )
    if not ok:
        t.entries = [e for e in t.entries if e.flag != "model"]
        t.add("model", MISSING, {"model.hf_path": name}, f"not supported: {why}")


def looks_local(name: str) -> bool:
    """A filesystem path rather than a hub id (``org/name``): absolute, ``./``, ``../``,
    ``~`` or more than one ``/``."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


def translate_tuner(t: Translation) -> None:
    """``megatron rlhf`` fine-tunes all weights unless --tuner_type lora (ms-swift 4.6's
    default tuner_type is 'full' there, 'lora' in ``swift rlhf``)."""
    default = "full" if t.flavor == "megatron" else "lora"
    for flag in ("tuner_type", "train_type"):
        if flag in t.flags:
            tuner = str(t.get(flag))
            if tuner == "lora":
                t.add(flag, EXACT, {}, "LoRA is megagrpo's only mode")
            else:
                t.add(flag, MISSING, {}, f"not supported: {tuner} fine-tuning (LoRA only)")
            return
    if default == "full":
        t.add(
            "tuner_type",
            MISSING,
            {},
            "not given: megatron rlhf fine-tunes every weight by default (tuner_type full); "
            "megagrpo trains LoRA only: add --tuner_type lora",
            given=False,
            value="full",
        )
    t.done.add("tuner_type")


def translate_curriculum(t: Translation) -> None:
    """ms-swift trains every row of every epoch: retirement off; the correctness signal (the
    collapse metrics and the online pass rates read it) is the accuracy-like reward."""
    labels = [
        str(f.get("label") or f.get("name")) for f in t.overrides.get("rewards.functions", [])
    ]
    signal = next((x for x in labels if "acc" in x.lower()), labels[0] if labels else "")
    keys: dict[str, Any] = {"curriculum.retire_streak": 0}
    if signal:
        keys["curriculum.signal_reward"] = signal
    t.add(
        "[curriculum]",
        DIFFERS,
        keys,
        "ms-swift samples every row: megagrpo's retirement of all-correct/all-wrong problems is "
        f"off; collapse metrics judge correctness on '{signal or 'the reward'}'",
        given=False,
        value="-",
    )


INT_FLAGS = frozenset(
    """num_generations max_completion_length max_length vllm_max_model_len lora_rank
    global_batch_size micro_batch_size per_device_train_batch_size gradient_accumulation_steps
    train_iters max_steps lr_warmup_iters save_steps save_total_limit eval_steps seed
    max_resample_times num_iterations sleep_level soft_max_length soft_cache_length top_k
    generation_batch_size steps_per_generation tensor_model_parallel_size
    expert_model_parallel_size expert_tensor_parallel_size pipeline_model_parallel_size
    vllm_tensor_parallel_size vllm_max_lora_rank recompute_num_layers""".split()
)
COUNT_FLAGS = frozenset(
    """num_generations global_batch_size micro_batch_size per_device_train_batch_size
    gradient_accumulation_steps generation_batch_size steps_per_generation num_iterations
    tensor_model_parallel_size expert_model_parallel_size expert_tensor_parallel_size
    pipeline_model_parallel_size vllm_tensor_parallel_size lora_rank""".split()
)
"""Integer flags that count something: 0 or less divides by zero downstream."""
FLOAT_FLAGS = frozenset(
    """beta temperature top_p epsilon epsilon_high lora_alpha lora_dropout lr learning_rate
    min_lr weight_decay adam_beta1 adam_beta2 clip_grad max_grad_norm warmup_ratio
    lr_warmup_fraction rollout_importance_sampling_threshold vllm_gpu_memory_utilization
    num_train_epochs tau_pos tau_neg""".split()
)
BOOL_WORDS = frozenset({"true", "false", "1", "0", "yes", "no", "on", "off"})
BOOL_FLAGS = frozenset(
    """dynamic_sample use_vllm bf16 fp16 sequence_parallel overlong_filter enable_thinking
    log_completions vllm_enable_lora vllm_enable_expert_parallel async_generate""".split()
)


def check_values(flags: dict[str, Any]) -> None:
    """ConfigError naming the flag whose value is not of the type ms-swift parses it as
    (``--lr abc``, ``--num_generations 8.5``, ``--bf16 maybe``); Unexpanded values are left
    to :func:`translate_unexpanded`."""
    for flag, value in flags.items():
        if isinstance(value, Unexpanded) or (
            isinstance(value, list) and any(isinstance(v, Unexpanded) for v in value)
        ):
            continue
        if isinstance(value, list):
            if flag in INT_FLAGS | FLOAT_FLAGS | BOOL_FLAGS:
                raise ConfigError(f"--{flag}: one value expected, got {value!r}")
            continue
        if flag in INT_FLAGS and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"--{flag} {value!r}: expected an integer")
        if flag in COUNT_FLAGS and value < 1:
            raise ConfigError(f"--{flag} {value!r}: must be at least 1")
        if flag in FLOAT_FLAGS and (
            isinstance(value, bool) or not isinstance(value, int | float) or value != value
        ):
            raise ConfigError(f"--{flag} {value!r}: expected a number")
        if flag in BOOL_FLAGS and not isinstance(value, bool):
            if str(value).lower() not in BOOL_WORDS:
                raise ConfigError(f"--{flag} {value!r}: expected true or false")
