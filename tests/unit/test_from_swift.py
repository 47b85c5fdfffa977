"""`megagrpo from-swift` (issue 12.2) on ms-swift's own example scripts and the seed team's
command: every flag reported, the silent default differences named, the config valid."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from megagrpo.cli import main
from megagrpo.config import load_config
from megagrpo.errors import ConfigError
from megagrpo.swift.fidelity import blocking
from megagrpo.swift.flags import DIFFERS, HARMLESS, OPTIM_DEFAULTS, SWIFT_DEFAULTS
from megagrpo.swift.translate import (
    command_from_script,
    parse_tokens,
    read_swift_args,
    report_lines,
    to_config,
    translate,
)
from megagrpo.trainer.config import RunConfig

# modelscope/ms-swift@3602360 examples/megatron/grpo/moe_colocate_lora.sh (verbatim)
MEGATRON_MOE_LORA = r"""CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \
NPROC_PER_NODE=8 \
PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' \
megatron rlhf \
    --rlhf_type grpo \
    --model Qwen/Qwen3-30B-A3B-Instruct-2507 \
    --save_safetensors true \
    --merge_lora false \
    --context_parallel_size 2 \
    --tensor_model_parallel_size 2 \
    --expert_model_parallel_size 4 \
    --pipeline_model_parallel_size 2 \
    --dataset open-r1/DAPO-Math-17k-Processed \
    --num_train_epochs 1 \
    --global_batch_size 64 \
    --micro_batch_size 2 \
    --steps_per_generation 2 \
    --num_generations 8 \
    --reward_funcs accuracy format \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.3 \
    --vllm_tensor_parallel_size 4 \
    --vllm_max_model_len 16384 \
    --max_length 8192 \
    --max_completion_length 8192 \
    --tuner_type lora \
    --lr 5e-5 \
    --bf16 true \
    --beta 0.00 \
    --importance_sampling_level sequence \
    --epsilon 3e-4 \
    --epsilon_high 4e-4 \
    --dynamic_sample false \
    --overlong_filter true \
    --loss_type grpo \
    --sleep_level 2 \
    --offload_model true \
    --offload_bridge false \
    --offload_optimizer true \
    --logging_steps 1 \
    --recompute_granularity selective \
    --finetune \
    --dataloader_num_workers 8 \
    --dataset_num_proc 8 \
    --no_save_optim \
    --no_save_rng \
    --attention_backend flash \
    --temperature 1.0 \
    --padding_free true \
    --sequence_parallel true \
    --log_completions true \
    --report_to wandb
"""

# modelscope/ms-swift@3602360 examples/train/grpo/internal/moe_lora.sh (verbatim)
SWIFT_MOE_LORA = r"""# 8*80G

CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \
NPROC_PER_NODE=8 \
swift rlhf \
    --rlhf_type grpo \
    --model Qwen/Qwen3-30B-A3B-Instruct-2507 \
    --reward_funcs accuracy \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.4 \
    --vllm_tensor_parallel_size 2 \
    --vllm_max_model_len 16384 \
    --tuner_type lora \
    --torch_dtype bfloat16 \
    --dataset AI-MO/NuminaMath-TIR#1000 \
    --max_length 12000 \
    --max_completion_length 8192 \
    --overlong_filter true \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-6 \
    --gradient_accumulation_steps 4 \
    --save_strategy 'steps' \
    --eval_strategy 'steps' \
    --eval_steps 1000 \
    --save_steps 1000 \
    --save_total_limit 10 \
    --logging_steps 1 \
    --warmup_ratio 0.01 \
    --dataloader_num_workers 4 \
    --num_generations 16 \
    --temperature 1.0 \
    --deepspeed zero3 \
    --log_completions true \
    --sleep_level 1 \
    --offload_model true \
    --offload_optimizer true \
    --report_to tensorboard swanlab \
    --num_iterations 1 \
    --beta 0.001 \
    --move_model_batches 10
"""

# modelscope/ms-swift@3602360 examples/train/grpo/plugin/gsm8k/gsm8k.sh (verbatim)
SWIFT_GSM8K = r'''SYSTEM_PROMPT="""You are a helpful math assistant. Solve the problem step by step and put your final answer within \\boxed{}."""

CUDA_VISIBLE_DEVICES=0,1,2,3 \
NPROC_PER_NODE=4 \
swift rlhf \
    --rlhf_type grpo \
    --model Qwen/Qwen3.5-2B \
    --external_plugins examples/train/grpo/plugin/gsm8k/gsm8k_plugin.py \
    --reward_funcs gsm8k_accuracy gsm8k_format \
    --columns '{"answer": "solution"}' \
    --enable_thinking false \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.4 \
    --vllm_tensor_parallel_size 1 \
    --vllm_max_model_len 10240 \
    --sleep_level 1 \
    --tuner_type full \
    --torch_dtype bfloat16 \
    --dataset 'modelscope/gsm8k' \
    --load_from_cache_file true \
    --max_length 2048 \
    --max_completion_length 8192 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 4 \
    --gradient_accumulation_steps 4 \
    --learning_rate 1e-6 \
    --lr_scheduler_type cosine \
    --save_steps 10 \
    --save_total_limit 100 \
    --logging_steps 1 \
    --warmup_ratio 0.0 \
    --dataloader_num_workers 4 \
    --num_generations 8 \
    --temperature 1.0 \
    --system "$SYSTEM_PROMPT" \
    --deepspeed zero2 \
    --log_completions true \
    --report_to tensorboard swanlab \
    --max_grad_norm 1.0 \
    --epsilon 0.2 \
    --epsilon_high 0.28 \
    --scale_rewards none
'''

# The seed team's run (issue 12 / reviews/ms-swift-users.md section 2), as they launched it.
SEED_TEAM = [
    "megatron", "rlhf", "--rlhf_type", "grpo", "--tuner_type", "lora",
    "--num_generations", "8", "--dynamic_sample", "true", "--max_resample_times", "3",
    "--reward_funcs", "accuracy", "soft_overlong", "--reward_weights", "1", "0.2",
    "--soft_max_length", "4096", "--soft_cache_length", "2048",
    "--max_completion_length", "4096", "--max_length", "2048",
    "--global_batch_size", "256", "--micro_batch_size", "1", "--lr", "1e-5",
    "--target_modules", "all-linear", "--use_vllm", "true", "--vllm_mode", "colocate",
    "--tensor_model_parallel_size", "4", "--expert_model_parallel_size", "8",
    "--sequence_parallel", "true", "--train_iters", "300", "--save_steps", "50",
    "--bf16", "true", "--log_completions", "true", "--report_to", "wandb",
]  # fmt: skip


def _run(tokens: list[str], **kw):
    flags, flavor, env = parse_tokens(tokens)
    world = int(env.get("NPROC_PER_NODE", 1)) * int(env.get("NNODES", 1))
    t = translate(flags, flavor or "swift", world, **kw)
    return flags, t, to_config(t), "\n".join(report_lines(t))


def _reported(t, flags) -> None:
    """Every flag the user gave has at least one report line, none twice with one status."""
    seen = {e.flag for e in t.entries if e.given}
    assert set(flags) <= seen, sorted(set(flags) - seen)


def test_megatron_example_moe_colocate_lora():
    flags, t, cfg, report = _run(command_from_script(MEGATRON_MOE_LORA))
    assert t.flavor == "megatron" and len(flags) == 49
    _reported(t, flags)
    # steps_per_generation 2: a generated batch of 2 x 64 completions, two optimizer steps
    assert cfg.trainer.batch_groups == 2 * 64 // 8 and cfg.trainer.mini_batches == 2
    assert cfg.trainer.micro_batch_size == 2
    assert cfg.loss.variant == "gspo" and cfg.loss.kl_coef == 0.0
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (3e-4, 4e-4)
    assert cfg.dynamic.enabled is False and cfg.rollout.temperature == 1.0
    assert cfg.rollout.max_model_len == 16384 and cfg.data.max_prompt_tokens == 8192
    assert cfg.parallel.tp == 2 and cfg.parallel.ep == 4
    assert cfg.model.lora.alpha == 32.0 and cfg.model.lora.dropout == 0.0
    assert cfg.trainer.adam_betas == [0.9, 0.95] and cfg.trainer.weight_decay == 0.1
    assert [f.name for f in cfg.rewards.functions] == ["mcq_accuracy", "orms:format"]
    assert cfg.parallel.pp == 2 and cfg.rollout.sleep_level == 2
    harmless = {e.flag for e in t.entries if e.status == HARMLESS}
    assert "context_parallel_size" in harmless  # a performance knob: reported, not blocking
    # a hub dataset (download it first), hence no step count either
    assert {e.flag for e in blocking(t)} == {"dataset", "num_train_epochs"}
    assert cfg.loss.overlong_filter is True and cfg.trainer.offload_during_rollout is True
    assert "math_verify" in report and "hub datasets" in report


def test_swift_example_internal_moe_lora_counts_completions_over_processes():
    flags, t, cfg, report = _run(command_from_script(SWIFT_MOE_LORA))
    assert t.flavor == "swift" and t.world_size == 8
    _reported(t, flags)
    # 1 per device x 8 processes x 4 accumulation = 32 completions = 2 problems x 16
    assert cfg.trainer.batch_groups == 2 and cfg.rollout.group_size == 16
    assert cfg.trainer.lr == 1e-6 and cfg.loss.kl_coef == 0.001
    assert cfg.metrics.tensorboard is True and cfg.metrics.log_completions is True
    assert cfg.trainer.warmup_ratio == 0.01 and cfg.trainer.lr_schedule == "cosine"
    assert "swanlab" in report


def test_swift_example_gsm8k_plugin_thinking_columns_and_system():
    _, full, _, _ = _run(command_from_script(SWIFT_GSM8K))
    assert any(e.flag == "tuner_type" and "full fine-tuning" in e.note for e in blocking(full))
    lora = SWIFT_GSM8K.replace("--tuner_type full", "--tuner_type lora")
    flags, t, cfg, report = _run(command_from_script(lora))
    _reported(t, flags)
    assert cfg.data.columns == ["answer=solution"]
    assert cfg.data.prompt.enable_thinking is False
    assert cfg.data.prompt.system.startswith("You are a helpful math assistant.")
    assert cfg.rewards.external_plugins == ["examples/train/grpo/plugin/gsm8k/gsm8k_plugin.py"]
    assert [f.name for f in cfg.rewards.functions] == ["orms:gsm8k_accuracy", "orms:gsm8k_format"]
    assert cfg.loss.advantage_scale == "none" and cfg.loss.eps_high == 0.28
    assert cfg.trainer.batch_groups == 4 * 4 * 4 // 8 and cfg.trainer.warmup_steps == 0
    assert cfg.trainer.lr_schedule == "cosine"


def test_seed_team_command_reports_every_silent_default_difference(tmp_path, capsys):
    out = tmp_path / "seed.yaml"
    assert main(["from-swift", "--out", str(out), "--", *SEED_TEAM]) == 0
    err = capsys.readouterr().err
    flags, t, cfg, report = _run(SEED_TEAM)
    _reported(t, flags)
    assert load_config(RunConfig, [out]) == cfg  # the written file loads as the same config
    for needle in (
        "model.lora.alpha=32.0",  # 32 vs 16
        "model.lora.dropout=0.0",  # 0.05 not carried over (said why)
        "loss.eps_high=0.2",  # epsilon_high = epsilon vs 0.28
        "loss.kl_coef=0.04",  # beta 0.04 vs 0
        "rollout.temperature=0.9",  # 0.9 vs 1.0
        "dynamic.policy=original",  # ms-swift's dynamic sampling
        "ms-swift's default cosine applied (megagrpo's default is constant)",  # LR schedule
        "megatron rlhf's all-linear: attention qkv/o",  # target_modules alias
        "256 x 1 / 8 generations = 32",  # completions vs problems
        "scores 0.0 on every multiple-choice letter",  # accuracy is math_verify
    ):
        assert needle in err, needle
    assert cfg.rewards.functions[1].kwargs == {"max_len": 4096, "cache_len": 2048}
    assert cfg.rewards.functions[1].weight == 0.2
    without = translate(parse_tokens([*SEED_TEAM[:8], "--dynamic_sample", "false"])[0])
    dyn = next(e for e in without.entries if e.flag == "dynamic_sample")
    assert "megagrpo's default is true" in dyn.note


def test_yaml_config_file_and_stdout(tmp_path, capsys):
    flags, _, _ = parse_tokens(SEED_TEAM)
    yaml_file = tmp_path / "grpo.yaml"
    import yaml

    yaml_file.write_text(yaml.safe_dump(flags))
    from_yaml, flavor, _ = read_swift_args([str(yaml_file)])
    assert from_yaml == flags and flavor is None
    assert main(["from-swift", "--flavor", "megatron", "--", str(yaml_file)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# megagrpo from-swift (megatron rlhf)")
    (tmp_path / "c.yaml").write_text(text)
    assert load_config(RunConfig, [tmp_path / "c.yaml"]).trainer.batch_groups == 32


def test_router_replay_and_sleep_levels_map_to_their_keys():
    _, t, cfg, _ = _run(["megatron", "rlhf", "--router_replay_mode", "R3", "--sleep_level", "0"])
    assert cfg.model.routing_replay == "r3" and cfg.rollout.return_routing is True
    assert {e.flag: e.status for e in t.entries}["sleep_level"] == DIFFERS
    _, _, cfg, _ = _run(["megatron", "rlhf", "--router_replay_mode", "R2"])
    assert cfg.model.routing_replay == "r2" and cfg.trainer.old_logprobs == "recompute"


def test_bad_commands_are_named():
    with pytest.raises(ConfigError, match="given twice"):
        parse_tokens(["--lr", "1", "--lr", "2"])
    with pytest.raises(ConfigError, match="not a multiple of num_generations=8"):
        translate(parse_tokens(["megatron", "rlhf", "--global_batch_size", "20"])[0], "megatron")
    with pytest.raises(ConfigError, match="soft_cache_length"):
        translate(parse_tokens(["--reward_funcs", "soft_overlong"])[0])
    with pytest.raises(ConfigError, match="GRPO only"):
        translate(parse_tokens(["--rlhf_type", "dpo"])[0])


def _swift_source(rel: str) -> Path:
    spec = importlib.util.find_spec("swift")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ms-swift not installed (the swift extra)")
    return Path(list(spec.submodule_search_locations)[0]) / rel


def _dataclass_defaults(path: Path) -> dict[str, object]:
    """Literal defaults of every dataclass field in ``path`` (read with ast, not imported:
    importing Megatron-SWIFT needs mcore_bridge)."""
    out: dict[str, object] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            try:
                out.setdefault(node.target.id, ast.literal_eval(node.value))
            except ValueError:
                continue
    return out


def test_defaults_table_matches_installed_ms_swift():
    """The ms-swift defaults the translator applies are the installed ms-swift's own."""
    mega = _dataclass_defaults(_swift_source("megatron/arguments/megatron_args.py"))
    for key in ("temperature", "lora_alpha", "lora_dropout", "epsilon", "epsilon_high",
                "dynamic_sample", "max_resample_times", "num_generations",
                "max_completion_length", "lora_rank"):  # fmt: skip
        assert mega[key] == SWIFT_DEFAULTS[key], key
    assert mega["lr_decay_style"] == SWIFT_DEFAULTS["lr_schedule"]
    assert mega["target_modules"] if "target_modules" in mega else True
    for key in ("weight_decay", "adam_beta1", "adam_beta2", "seed"):
        assert mega[key] == OPTIM_DEFAULTS[key], key
    trainer = _dataclass_defaults(_swift_source("trainers/arguments.py"))
    assert trainer["lr_scheduler_type"] == SWIFT_DEFAULTS["lr_schedule"]
    assert (trainer["weight_decay"], trainer["adam_beta2"]) == (0.1, 0.95)
    rlhf = _swift_source("arguments/rlhf_args.py").read_text(encoding="utf-8")
    assert "self.beta = 0.04" in rlhf and "self.truncation_strategy = 'left'" in rlhf
    tuner = _dataclass_defaults(_swift_source("arguments/tuner_args.py"))
    assert (tuner["lora_alpha"], tuner["lora_dropout"]) == (32.0, 0.05)
