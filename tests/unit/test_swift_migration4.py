"""A team's real ms-swift scripts translate (reviews/ms-swift-users-4.md, issue 41): a flag
from-swift does not know is "not known: check it", never "trains differently"; ms-swift 4.6's
harmless flags never block; the flags that train and can be mapped are mapped; the step count
of ``megatron rlhf --num_train_epochs`` is ms-swift's own; and the 17 published commands of
the review (tests/fixtures/ms_swift_users4/) are refused only for what megagrpo leaves out by
design or a value the shell computes.

References: ms-swift 4.6's own source, read where importing it would pull in torch, trl and
Megatron (its argument dataclasses through :mod:`megagrpo.swift.source`, checked here against
``dataclasses.fields`` only in the slow test), and its functions compiled alone and run
(``init_iters``, ``cyclic_iter``, ``get_num_iters_per_step``, ``MegatronPretrainingRandomSampler``,
``InferEngine.set_default_max_tokens``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from swift_source import swift_class, swift_function, swift_tree

from megagrpo.cli import main
from megagrpo.swift import catalog
from megagrpo.swift.fidelity import blocking, unknown
from megagrpo.swift.flags import DIFFERS, EXACT, HARMLESS, MISSING, UNKNOWN
from megagrpo.swift.source import argument_fields
from megagrpo.swift.status import classify
from megagrpo.swift.translate import parse_tokens, read_swift_args, to_config, translate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ms_swift_users4"
PUBLISHED = sorted(FIXTURES.glob("*.sh"))
LORA = ["--rlhf_type", "grpo", "--tuner_type", "lora"]
MEGATRON = ["megatron", "rlhf", *LORA, "--train_iters", "5", "--vllm_mode", "colocate"]
SWIFT = ["swift", "rlhf", *LORA, "--max_steps", "5", "--use_vllm", "true", "--vllm_mode",
         "colocate"]  # fmt: skip


def _t(tokens: list[str], world: int = 1, env: dict | None = None):
    flags, flavor, parsed = parse_tokens(tokens)
    return translate(flags, flavor or "swift", world, env=env or parsed)


def _entry(t, flag: str):
    return next(e for e in t.entries if e.flag == flag)


def _rows(path: Path, n: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"query": f"問題 {i}", "choices": ["a", "b"], "answer": ["a"]}) + "\n"
            for i in range(n)
        ),
        encoding="utf-8",
    )
    return path


# ----------------------------------------------------------------------------- F1: statuses


@pytest.mark.parametrize("flavor", ["swift", "megatron"])
def test_every_field_of_ms_swifts_rlhf_arguments_has_a_status(flavor):
    """Each field of ms-swift 4.6's ``RLHFArguments`` / ``MegatronRLHFArguments`` (read from
    its source) is mapped, harmless, or not supported by design, with a reason: none is
    "not known"."""
    fields = argument_fields(flavor)
    if not fields:
        pytest.skip("ms-swift is not installed")
    assert len(fields) == {"swift": 481, "megatron": 414}[flavor]  # ms-swift 4.6.0's classes
    for name in fields:
        if name in catalog.MAPPED:
            continue
        status, note = classify(name, "x")
        assert status in (HARMLESS, MISSING) and note, (name, status, note)
    assert not set(fields) - catalog.known_flags()


def test_the_catalog_names_only_ms_swift_4_6_fields():
    fields = set(argument_fields("swift")) | set(argument_fields("megatron"))
    if not fields:
        pytest.skip("ms-swift is not installed")
    listed = catalog.MAPPED | catalog.UNSUPPORTED.keys() | catalog.DEFAULT_ONLY.keys()
    listed |= catalog.HARMLESS.keys() | catalog.NO_EFFECT.keys()
    assert listed <= fields
    assert not (catalog.RENAMED_3X.keys() | catalog.OLD_3X.keys() | catalog.ARCHITECTURE_3X) & (
        fields
    )


MAPPED_SAMPLES = {
    "rlhf_type": "grpo", "num_generations": 8, "beta": 0.0, "temperature": 1.0, "top_p": 0.9,
    "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05, "epsilon": 0.2,
    "epsilon_high": 0.28, "dynamic_sample": True, "max_resample_times": 3,
    "overlong_filter": True, "rollout_importance_sampling_mode": "token_truncate",
    "rollout_importance_sampling_threshold": 2.0, "model": "Qwen/Qwen3-8B", "lora_rank": 16,
    "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear",
    "target_parameters": ["mlp.experts.gate_up_proj"], "target_regex": r".*\.(q_proj|v_proj)",
    "use_rslora": True, "bf16": True, "fp16": False, "torch_dtype": "bfloat16",
    "tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
    "expert_tensor_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "sequence_parallel": True, "recompute_granularity": "selective",
    "recompute_method": "uniform", "recompute_num_layers": 1, "recompute_modules": "core_attn",
    "max_completion_length": 256, "max_length": 512, "truncation_strategy": "left",
    "vllm_max_model_len": 1024, "use_vllm": True, "vllm_mode": "colocate",
    "vllm_tensor_parallel_size": 1, "vllm_gpu_memory_utilization": 0.5,
    "vllm_max_lora_rank": 16, "vllm_enable_expert_parallel": False, "sleep_level": 1,
    "router_replay_mode": "R3", "vllm_enable_lora": True, "micro_batch_size": 1,
    "per_device_train_batch_size": 1, "lr": 1e-6, "learning_rate": 1e-6,
    "lr_decay_style": "cosine", "lr_scheduler_type": "cosine", "min_lr": 1e-7,
    "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "clip_grad": 1.0,
    "max_grad_norm": 1.0, "seed": 1, "data_seed": 3, "dataset_shuffle": True,
    "train_dataloader_shuffle": True, "save_steps": 10, "save_total_limit": 2, "eval_steps": 10,
    "lr_warmup_iters": 2, "lr_warmup_fraction": 0.05, "warmup_ratio": 0.05, "warmup_steps": 2,
    "dataset": "AI-MO/NuminaMath-TIR", "val_dataset": "AI-MO/NuminaMath-TIR",
    "columns": '{"problem": "query"}', "system": "You are a doctor.", "template": "qwen3",
    "model_type": "qwen3", "enable_thinking": False, "external_plugins": "plugin.py",
    "reward_funcs": "cosine", "reward_weights": 1.0, "soft_cache_length": 64,
    "soft_max_length": 256, "cosine_min_len_value_wrong": -0.5,
    "cosine_max_len_value_wrong": 0.0, "cosine_min_len_value_correct": 1.0,
    "cosine_max_len_value_correct": 0.5, "cosine_max_len": 256, "repetition_n_grams": 3,
    "repetition_max_penalty": -1.0, "report_to": "wandb", "wandb_project": "p",
    "wandb_exp_name": "run1", "run_name": "run1", "logging_steps": 1, "log_completions": True,
    "global_batch_size": 16, "gradient_accumulation_steps": 8, "steps_per_generation": 2,
    "generation_batch_size": 32, "num_iterations": 1, "loss_type": "grpo",
    "importance_sampling_level": "token", "tau_pos": 1.0, "tau_neg": 1.05,
    "advantage_estimator": "grpo", "scale_rewards": "group", "kl_in_reward": False,
    "train_iters": 5, "max_steps": 5, "num_train_epochs": 1, "max_epochs": 1,
    "tuner_type": "lora", "offload_model": True, "offload_optimizer": True,
    "moe_expert_capacity_factor": 2.0, "async_generate": False,
}  # fmt: skip


def test_every_mapped_flag_is_taken_by_a_rule():
    """Each flag :data:`catalog.MAPPED` claims gets a report entry from a translator rule
    (never the catalog's fallback), given alone on a launcher that has it."""
    assert set(MAPPED_SAMPLES) == catalog.MAPPED
    for flag, value in MAPPED_SAMPLES.items():
        base = dict(rlhf_type="grpo", tuner_type="lora", max_steps=5, use_vllm=True)
        base["vllm_mode"] = "colocate"
        flags = {**base, flag: value}
        if flag == "generation_batch_size":
            flags.pop("max_steps")
            flags.update(train_iters=5, global_batch_size=16)
        flavor = "megatron" if flag in argument_fields("megatron") else "swift"
        if flag in ("train_iters", "micro_batch_size", "lr", "min_lr", "clip_grad"):
            flavor = "megatron"
        t = translate(flags, flavor)
        entry = _entry(t, flag)
        assert entry.status != UNKNOWN and entry.note != classify(flag, value)[1], flag


def test_harmless_ms_swift_flags_never_block():
    """F1: the flags the review appended one at a time to a01 / a02 (each made from-swift
    exit 2 with "would train differently" on cabf39c)."""
    for flag, value in (("wandb_exp_name", "qwen3_30b_dapo"), ("swanlab_exp_name", "x"),
                        ("tensorboard_dir", "tb"), ("use_hf", "true"), ("check_model", "false"),
                        ("ignore_args_error", "true"), ("eval_iters", "2"),
                        ("load_args", "false"), ("model_type", "qwen3_moe")):  # fmt: skip
        assert main(["from-swift", "--", *MEGATRON, f"--{flag}", value]) == 0, flag


def test_an_unknown_flag_is_not_known_not_training_differently(capsys):
    code = main(["from-swift", "--", *MEGATRON, "--my_new_flag", "3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "not known to from-swift" in err and "--allow-unknown" in err
    assert "train differently" not in err and "would train" not in err
    assert main(["from-swift", "--allow-unknown", "--", *MEGATRON, "--my_new_flag", "3"]) == 0
    assert "left out: my_new_flag" in capsys.readouterr().out


def test_a_new_flag_is_judged_by_where_ms_swift_declares_it(monkeypatch):
    """Without its table entry, a SwanLab field is harmless (declared in SwanlabArguments),
    a ``*_exp_name`` flag by its name, and a training field is unknown, naming the class and
    line that declare it."""
    if not argument_fields("swift"):
        pytest.skip("ms-swift is not installed")
    harmless = dict(catalog.HARMLESS)
    no_effect = dict(catalog.NO_EFFECT)
    for name in ("swanlab_workspace", "rlsd_lambda"):
        harmless.pop(name, None)
        no_effect.pop(name, None)
    monkeypatch.setattr(catalog, "HARMLESS", harmless)
    monkeypatch.setattr(catalog, "NO_EFFECT", no_effect)
    status, note = classify("swanlab_workspace", "me")
    assert status == HARMLESS and "SwanlabArguments" in note
    assert classify("mlflow_exp_name", "x")[0] == HARMLESS
    status, note = classify("rlsd_lambda", 0.3)
    field = argument_fields("swift")["rlsd_lambda"]
    assert status == UNKNOWN and f"{field.owner}" in note and f":{field.line}" in note


def test_no_effect_flags_are_not_read_by_ms_swifts_grpo():
    """The flags called "no effect on GRPO" are not read (``args.<flag>`` / ``self.<flag>``)
    by ms-swift 4.6's GRPO trainers, rollout or advantage code."""
    files = ["rlhf_trainers/grpo_trainer.py", "rlhf_trainers/rollout_mixin.py",
             "megatron/trainers/grpo_trainer.py", "megatron/trainers/rollout_mixin.py",
             "rl_core/advantage.py"]  # fmt: skip
    lines = [
        line
        for f in files
        for line in swift_tree(f)[0].read_text(encoding="utf-8").splitlines()
        if not re.search(r"rlhf_type\s*==\s*'(gkd|dpo|kto|ppo|rm)'", line)  # another type's
    ]
    source = "\n".join(lines)
    group = "no effect on GRPO (another rlhf_type's flag)"
    for flag in (f for f, why in catalog.NO_EFFECT.items() if why == group):
        assert not re.search(rf"\b(args|self)\.{flag}\b", source), flag


# ----------------------------------------------------------------------------- mapped now


def test_target_parameters_are_the_experts(tmp_path):
    """F2: from-swift's own note sends users to --target_parameters; megagrpo's export writes
    those names back. Experts -> expert_linear_fc1 / expert_linear_fc2, beside attention."""
    cmd = [*SWIFT, "--model", "Qwen/Qwen3-30B-A3B", "--target_parameters",
           "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # fmt: skip
    t = _t(cmd)
    assert _entry(t, "target_parameters").status == EXACT and not blocking(t)
    assert to_config(t).model.lora.targets == [
        "linear_qkv", "linear_proj", "expert_linear_fc1", "expert_linear_fc2"]  # fmt: skip
    bad = _t([*SWIFT, "--target_parameters", "mlp.gate.weight"])
    assert "target_parameters" in {e.flag for e in blocking(bad)}


def test_target_regex_matches_one_layers_linears():
    t = _t([*SWIFT, "--target_regex", r"^model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj$"])
    assert to_config(t).model.lora.targets == ["linear_proj", "linear_qkv"]
    per_layer = _t([*SWIFT, "--target_regex", r"model\.layers\.0\..*"])
    assert "target_regex" in {e.flag for e in blocking(per_layer)}


def test_use_rslora_scales_alpha_by_the_square_root_of_the_rank():
    t = _t([*SWIFT, "--use_rslora", "true", "--lora_rank", "16", "--lora_alpha", "32"])
    cfg = to_config(t)
    assert cfg.model.lora.scaling == pytest.approx(32 / math.sqrt(16))  # peft's rsLoRA scale


def test_max_epochs_stops_swift_rlhf_early(tmp_path):
    """swift rlhf: --max_epochs 1 with num_train_epochs 3 stops after one epoch
    (swift/trainers/patcher.py) on the schedule planned for three: mapped, both numbers."""
    data = _rows(tmp_path / "d.jsonl", 40)
    base = ["swift", "rlhf", *LORA, "--dataset", str(data), "--num_generations", "4",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]  # fmt: skip
    capped = _t([*base, "--max_epochs", "1"])
    assert to_config(capped).trainer.max_steps == 40 // 2
    note = _entry(capped, "max_epochs").note
    assert _entry(capped, "max_epochs").status == DIFFERS and "60" in note
    assert to_config(_t(base)).trainer.max_steps == 60


def test_template_model_type_and_data_order():
    t = _t([*SWIFT, "--model", "Qwen/Qwen3-8B", "--template", "qwen3", "--data_seed", "7",
            "--dataset_shuffle", "false"])  # fmt: skip
    assert _entry(t, "template").status == EXACT
    assert to_config(t).curriculum.seed == 7
    assert _entry(t, "dataset_shuffle").status == DIFFERS and not blocking(t)
    other = _t([*SWIFT, "--model", "Qwen/Qwen3-8B", "--template", "llama3"])
    assert "template" in {e.flag for e in blocking(other)}
    vl = _t([*SWIFT, "--model", "/m/x", "--model_type", "qwen2_5_vl"])
    assert "model_type" in {e.flag for e in blocking(vl)}


def test_ms_swift_3_names_are_read_as_their_4_6_flags():
    """m01/m02 (ms-swift v3.11/v3.12's own example): --max_epochs (megatron: the epochs),
    --log_interval, --num_workers, --load_safetensors; i01: --vllm_device."""
    t = _t(["megatron", "rlhf", *LORA, "--max_epochs", "1", "--log_interval", "1",
            "--num_workers", "8", "--load_safetensors", "true",
            "--vllm_mode", "colocate"])  # fmt: skip
    assert to_config(t).metrics.log_every == 1
    assert "ms-swift 3.x name of --logging_steps" in _entry(t, "log_interval").note
    assert _entry(t, "num_workers").status == HARMLESS
    assert _entry(t, "load_safetensors").status == HARMLESS
    assert "num_train_epochs" in _entry(t, "max_epochs").note  # the epochs, no dataset here
    assert _entry(_t([*SWIFT, "--vllm_device", "auto"]), "vllm_device").status == HARMLESS


# ----------------------------------------------------------------------------- F0: epochs


class _Mpu:
    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def _swift_megatron_run(rows: int, mbs: int, dp: int, g: int, epochs: int, gbs: int, spg: int):
    """ms-swift 4.6's own code on CPU: ``MegatronArguments.init_iters`` (the planned
    train_iters), then per data-parallel rank its ``MegatronPretrainingRandomSampler``
    (shuffled, unsharded: the default), ``BaseMegatronTrainer.cyclic_iter`` and
    ``MegatronGRPOTrainer.get_num_iters_per_step``, driven as its training loop drives them
    (a generation pulls its prompts every ``spg`` optimizer steps; ``train_iters`` is read
    before each step). Returns ``(train_iters, [steps each rank trains])``."""
    mpu = _Mpu(dp)
    init_iters = swift_function(
        "megatron/arguments/megatron_args.py", "init_iters", cls="MegatronArguments", mpu=mpu
    )
    args = SimpleNamespace(micro_batch_size=mbs, num_generations=g, rlhf_type="grpo",
                           save_strategy="steps", num_train_epochs=epochs, train_iters=None,
                           eval_iters=0, global_batch_size=gbs)  # fmt: skip
    init_iters(args, list(range(rows)), None)
    planned = args.train_iters
    sampler_cls = swift_class(
        "megatron/trainers/batch_sampler.py", "MegatronPretrainingRandomSampler"
    )
    cyclic = swift_function("megatron/trainers/base.py", "cyclic_iter", cls="BaseMegatronTrainer")
    pulls_of = swift_function(
        "megatron/trainers/grpo_trainer.py",
        "get_num_iters_per_step",
        cls="MegatronGRPOTrainer",
        mpu=mpu,
    )
    steps = []
    for rank in range(dp):
        run_args = SimpleNamespace(**vars(args))
        sampler = sampler_cls(None, rows, 0, mbs, rank, dp, False, shuffle=True, seed=42)
        state = SimpleNamespace(iteration=0)
        model = SimpleNamespace(training=True)
        trainer = SimpleNamespace(unwrapped_models=[model], args=run_args, state=state,
                                  generation_batch_size=gbs * spg, global_batch_size=gbs,
                                  num_generations=g, micro_batch_size=mbs)  # fmt: skip
        data = cyclic(trainer, sampler)
        pulls = pulls_of(trainer)
        while state.iteration < run_args.train_iters:
            if state.iteration % spg == 0:
                for _ in range(pulls):
                    next(data)
            state.iteration += 1
        steps.append(state.iteration)
    return planned, steps


@pytest.mark.parametrize(
    "rows,mbs,dp,world,tp,g,epochs,gbs,spg",
    [
        (286, 1, 8, 16, 2, 8, 1, 64, 4),  # the review's a01e: ms-swift plans 35 (megagrpo had 32)
        (286, 1, 8, 16, 2, 8, 3, 64, 4),  # a01f: 105 (megagrpo had 104)
        (150, 2, 2, 4, 2, 4, 2, 16, 3),  # rows, prompts per generation, mbs x DP all coprime
        (97, 1, 4, 4, 1, 8, 1, 32, 2),
    ],
)
def test_megatron_epochs_are_ms_swifts_init_iters(tmp_path, rows, mbs, dp, world, tp, g, epochs,
                                                   gbs, spg):  # fmt: skip
    """F0: ``megatron rlhf --num_train_epochs`` with several optimizer steps per generation,
    rows that the generated batch does not divide: trainer.max_steps is ms-swift's own
    init_iters (its LR schedule's length); when its ranks' data runs out sooner, the entry
    is ``~`` and names the step the first of them stops at, as its own loop does."""
    data = _rows(tmp_path / "d.jsonl", rows)
    cmd = ["megatron", "rlhf", *LORA, "--dataset", str(data), "--num_train_epochs", str(epochs),
           "--global_batch_size", str(gbs), "--micro_batch_size", str(mbs),
           "--steps_per_generation", str(spg), "--num_generations", str(g),
           "--tensor_model_parallel_size", str(tp), "--vllm_mode", "colocate"]  # fmt: skip
    t = _t(cmd, world=world)
    planned, steps = _swift_megatron_run(rows, mbs, dp, g, epochs, gbs, spg)
    assert to_config(t).trainer.max_steps == planned
    entry = _entry(t, "num_train_epochs")
    if min(steps) < planned:
        assert entry.status == DIFFERS and f"stop after {min(steps)}" in entry.note
    else:
        assert entry.status == EXACT


def test_megatron_epochs_without_the_world_size_say_so(tmp_path):
    data = _rows(tmp_path / "d.jsonl", 64)
    t = _t(["megatron", "rlhf", *LORA, "--dataset", str(data), "--num_train_epochs", "1",
            "--global_batch_size", "16", "--vllm_mode", "colocate"])  # fmt: skip
    entry = _entry(t, "num_train_epochs")
    assert entry.status == DIFFERS and "--world-size" in entry.note


# ----------------------------------------------------------------------------- F4-F6, F8


def test_a_local_dataset_not_mounted_is_not_a_hub_dataset():
    """F4 (i01): a local path that is not here is "not found here", never "hub"."""
    t = _t([*SWIFT, "--dataset", "/data/tcm/tcm_mcq_train.json"])
    note = _entry(t, "dataset").note
    assert "not found here" in note and "hub" not in note
    jsonl = _t([*SWIFT, "--dataset", "/data/tcm/train.jsonl"])
    assert (
        _entry(jsonl, "dataset").status == DIFFERS
        and "not found here" in _entry(jsonl, "dataset").note
    )


def test_ms_swifts_rollout_engine_defaults_are_reported():
    """F5: swift rlhf without --use_vllm samples with ms-swift's PtEngine: a line says
    megagrpo uses vLLM; --use_vllm true without --vllm_mode (ms-swift 4.6 refuses it) too."""
    pt = _t(["swift", "rlhf", *LORA, "--max_steps", "3"])
    assert "PtEngine" in _entry(pt, "use_vllm").note
    no_mode = _t(["swift", "rlhf", *LORA, "--max_steps", "3", "--use_vllm", "true"])
    entry = _entry(no_mode, "vllm_mode")
    assert entry.status == DIFFERS and "vllm_mode is required" in entry.note
    rlhf_args = swift_tree("arguments/rlhf_args.py")[0].read_text(encoding="utf-8")
    assert "'vllm_mode is required when use_vllm is true'" in rlhf_args  # what ms-swift says


def test_torchrun_with_shell_computed_options_is_reported(tmp_path, capsys):
    """F6 (i02): ``torchrun $DISTRIBUTED_ARGS ${SCRIPT_DIR}/swift/cli/rlhf.py``: the report,
    with the world size named as a value the shell computes (cabf39c: a parse error)."""
    script = FIXTURES / "i02__issue7125__qwen3_235b_torchrun.sh"
    assert main(["from-swift", "--", str(script)]) == 2
    err = capsys.readouterr().err
    assert "$DISTRIBUTED_ARGS" in err and "computed by the shell" in err
    assert "pass --world-size" in err and "unexpected word" not in err


def test_a_completion_as_long_as_the_context_is_clamped_as_ms_swift_does():
    """F6 (i03): max_completion_length == vllm_max_model_len: ms-swift 4.6 shortens each
    completion to max_model_len - its prompt (``InferEngine.set_default_max_tokens``, run
    here), with a warning; from-swift translates it with a ``~`` instead of an error."""
    clamp = swift_function("infer_engine/infer_engine.py", "set_default_max_tokens",
                           cls="InferEngine")  # fmt: skip
    engine = SimpleNamespace(max_model_len=2048, max_tokens_offset=0,
                             _get_num_tokens=lambda inputs: len(inputs["input_ids"]))  # fmt: skip
    request = SimpleNamespace(max_tokens=2048)
    clamp(engine, request, {"input_ids": [1] * 100})
    assert request.max_tokens == 2048 - 100
    t = _t([*SWIFT, "--vllm_max_model_len", "2048", "--max_completion_length", "2048"])
    entry = _entry(t, "vllm_max_model_len")
    assert entry.status == DIFFERS and "shortens each completion" in entry.note
    cfg = to_config(t)
    assert cfg.rollout.max_tokens == 2048 and cfg.rollout.max_model_len > 2048


def test_a_system_file_not_found_blocks():
    """F8: ``--system prompt.txt`` that is not here would train with the default prompt."""
    t = _t([*SWIFT, "--system", "examples/train/grpo/prompt.txt"])
    assert "system" in {e.flag for e in blocking(t)}
    assert "not found here" in _entry(t, "system").note


# ----------------------------------------------------------------------------- acceptance

BY_DESIGN = {
    "dataset": "hub datasets, path#N, files not here (download, convert, write the rows)",
    "num_train_epochs": "no step count without the local dataset",
    "max_epochs": "no step count without the local dataset (3.x megatron epochs)",
    "model": "multimodal models and families without a provider, or computed by the shell",
    "max_pixels": "multimodal", "tuner_type": "full fine-tuning", "train_type": "full",
    "vllm_mode": "server mode", "vllm_server_host": "server mode",
    "vllm_server_port": "server mode", "multi_turn_scheduler": "multi-turn",
    "max_turns": "multi-turn", "reward_model": "reward models",
    "reward_model_plugin": "reward models", "loss_type": "real / fipo losses",
    "delta": "two-sided clipping", "system": "a --system file not found here",
    "[torchrun options]": "computed by the shell", "[world size]": "computed by the shell",
    **{f"chord_{k}": "CHORD" for k in ("sft_dataset", "sft_per_device_train_batch_size",
       "enable_phi_function", "mu_warmup_steps", "mu_decay_steps", "mu_peak", "mu_valley")},
}  # fmt: skip
"""Each refusal over the published commands and what it names (docs/migrating-from-ms-swift.md
lists them as out of scope)."""


def test_published_commands_are_refused_only_by_design():
    """The review's 17 published commands: no flag is "not known", and no refusal names a
    harmless flag; every refusal is a scope decision or a value the shell computes."""
    assert len(PUBLISHED) == 17
    for script in PUBLISHED:
        flags, flavor, env = read_swift_args([str(script)])
        world = 1
        for key in ("NPROC_PER_NODE", "NNODES"):
            value = str(env.get(key, "1"))
            world *= int(value) if value.isdigit() else 1
        t = translate(flags, flavor or "swift", world, env=env)
        assert not unknown(t), (script.name, [(e.flag, e.note) for e in unknown(t)])
        for entry in blocking(t):
            assert entry.flag in BY_DESIGN, (script.name, entry.flag, entry.note)
            assert entry.flag not in catalog.HARMLESS, entry.flag


A01 = """NNODES=2 NPROC_PER_NODE=8 megatron rlhf --rlhf_type grpo \
  --model Qwen/Qwen3-30B-A3B-Instruct-2507 --tuner_type lora --lora_rank 32 --lora_alpha 64 \
  --target_modules all-linear --dataset {data} --global_batch_size 64 --micro_batch_size 1 \
  --steps_per_generation 4 --num_generations 8 --loss_type dapo --dynamic_sample true \
  --max_resample_times 3 --reward_funcs accuracy soft_overlong --reward_weights 1.0 0.2 \
  --soft_max_length 2048 --soft_cache_length 512 --max_completion_length 2048 \
  --top_p 0.95 --top_k 20 --overlong_filter true --offload_model true \
  --offload_optimizer true --use_vllm true --vllm_mode colocate --vllm_max_model_len 4096 \
  --tensor_model_parallel_size 2 --expert_model_parallel_size 4 --sequence_parallel true \
  --bf16 true --lr 1e-6 --lr_warmup_fraction 0.05 --min_lr 1e-7 --train_iters 100 \
  --report_to wandb --wandb_project igakuqa-grpo --wandb_exp_name qwen3_30b_dapo \
  --model_type qwen3_moe --log_completions true
"""


def test_a01_translates_with_wandb_exp_name_and_model_type(tmp_path, capsys):
    """The review's a01 (megatron, Qwen3-30B-A3B LoRA, IgakuQA-like local JSONL) with
    --wandb_exp_name and --model_type: written (cabf39c: exit 2 for both flags)."""
    data = _rows(tmp_path / "igakuqa.jsonl", 286)
    script = tmp_path / "a01.sh"
    script.write_text(A01.format(data=data), encoding="utf-8")
    out = tmp_path / "a01.yaml"
    assert main(["from-swift", "--out", str(out), "--", str(script)]) == 0
    err = capsys.readouterr().err
    assert "- --model_type qwen3_moe" in err
    from megagrpo.config import load_config
    from megagrpo.trainer.config import RunConfig

    cfg = load_config(RunConfig, [out])
    assert cfg.trainer.name == "qwen3_30b_dapo" and cfg.metrics.wandb_project == "igakuqa-grpo"
    assert cfg.trainer.max_steps == 100 and cfg.trainer.mini_batches == 4


@pytest.mark.slow  # imports ms-swift's argument classes (torch, transformers, trl, megatron)
def test_the_source_reader_sees_what_dataclasses_sees():
    """:mod:`megagrpo.swift.source` (ast, no import) gives every field and its declaring class
    exactly as ``dataclasses.fields`` of the imported classes do (Megatron's import of
    ``mcore_bridge``, not installed here, is served by test_from_swift_loss's stub)."""
    import dataclasses
    import importlib.util
    import sys

    pytest.importorskip("swift")
    from test_from_swift_loss import _StubFinder

    finder = _StubFinder() if importlib.util.find_spec("mcore_bridge") is None else None
    if finder is not None:
        sys.meta_path.insert(0, finder)
    try:
        from swift.arguments import RLHFArguments
        from swift.megatron.arguments import MegatronRLHFArguments
    finally:
        if finder is not None:
            sys.meta_path.remove(finder)
    for flavor, cls in (("swift", RLHFArguments), ("megatron", MegatronRLHFArguments)):
        ours = {n: f.owner for n, f in argument_fields(flavor).items()}
        theirs = {
            f.name: next(
                k for k in cls.__mro__ if f.name in getattr(k, "__annotations__", {})
            ).__name__
            for f in dataclasses.fields(cls)
        }
        assert ours == theirs, flavor
