"""The first hour of an ms-swift team with `megagrpo from-swift` (reviews/ms-swift-users-3.md
F6), and the acceptance over ms-swift 4.6's LoRA GRPO commands: the example scripts
(tests/fixtures/ms_swift_grpo/) and the commands of its documentation
(tests/fixtures/ms_swift_docs/, every ``rlhf_type grpo`` block of docs/source_en but one
fragment of ``...``): every command from-swift refuses is refused for something megagrpo
leaves out by design, never for a missing GRPO training feature, and performance flags are
accepted with a note."""

from __future__ import annotations

from pathlib import Path

import pytest

from megagrpo.cli import main
from megagrpo.config import load_config
from megagrpo.errors import ConfigError
from megagrpo.swift.fidelity import blocking
from megagrpo.swift.translate import read_swift_args, to_config, translate
from megagrpo.trainer.config import RunConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
COMMANDS = sorted((FIXTURES / "ms_swift_grpo").glob("*.sh")) + sorted(
    (FIXTURES / "ms_swift_docs").glob("*.sh")
)
DATA = Path(__file__).resolve().parents[2] / "megagrpo" / "assets" / "demo_train.jsonl"

MULTI_NODE = """# examples/train/grpo/multi_node/colocate_multi_node1.sh's layout
export CUDA_VISIBLE_DEVICES=0,1,2,3
export NNODES=2
export NODE_RANK=0
export NPROC_PER_NODE=4

swift rlhf \\
    --rlhf_type grpo \\
    --model Qwen/Qwen2.5-Math-7B \\
    --tuner_type lora \\
    --dataset {data} \\
    --per_device_train_batch_size 1 \\
    --gradient_accumulation_steps 2 \\
    --num_generations 8 \\
    --max_steps 10
"""


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.sh"
    path.write_text(text.format(data=DATA), encoding="utf-8")
    return path


def test_exported_nproc_and_nnodes_size_the_batch_and_the_cluster(tmp_path, capsys):
    """T1: ``export NPROC_PER_NODE=4`` / ``export NNODES=2`` are the launch's 8 processes:
    1 x 8 x 2 = 16 completions = 2 problems of 8, on a cluster of 2 nodes x 4 (cd819e6
    ignored the exports: "2 completions per step is not a multiple of num_generations")."""
    out = tmp_path / "c.yaml"
    assert main(["from-swift", "--out", str(out), "--", str(_script(tmp_path, MULTI_NODE))]) == 0
    cfg = load_config(RunConfig, [out])
    assert cfg.trainer.batch_groups == 2
    assert (cfg.cluster.num_nodes, cfg.cluster.gpus_per_node) == (2, 4)
    assert "world size 8" in capsys.readouterr().err


def test_batch_error_suggests_world_size(tmp_path, capsys):
    one = MULTI_NODE.replace("export NNODES=2\n", "").replace("export NPROC_PER_NODE=4\n", "")
    assert main(["from-swift", "--", str(_script(tmp_path, one))]) == 2
    err = capsys.readouterr().err
    assert "not a multiple of num_generations=8" in err and "--world-size" in err
    assert main(["from-swift", "--world-size", "8", "--", str(_script(tmp_path, one))]) == 0


@pytest.mark.parametrize(
    "launcher, flavor",
    [
        ("python3 -m swift.cli.rlhf", "swift"),
        ("python -m swift.cli._megatron.rlhf", "megatron"),
        ("torchrun --nproc_per_node 8 --nnodes=2 /opt/ms-swift/swift/cli/rlhf.py", "swift"),
    ],
)
def test_python_and_torchrun_launchers(tmp_path, launcher, flavor):
    """T2: scripts that run ms-swift's entry point through python -m or torchrun (cd819e6:
    "no 'swift rlhf' or 'megatron rlhf' command in the script")."""
    text = (
        f"{launcher} \\\n    --rlhf_type grpo --tuner_type lora --dataset {{data}} \\\n"
        "    --num_generations 8 --global_batch_size 16 --max_steps 3\n"
    )
    flags, parsed, env = read_swift_args([str(_script(tmp_path, text))])
    assert parsed == flavor and flags["rlhf_type"] == "grpo"
    if "torchrun" in launcher:
        assert (env["NPROC_PER_NODE"], env["NNODES"]) == ("8", "2")
    assert main(["from-swift", "--", str(_script(tmp_path, text))]) == 0


def test_unknown_launcher_word_is_an_error():
    with pytest.raises(ConfigError, match="unexpected word 'deepspeed'"):
        read_swift_args(["deepspeed", "rlhf", "--rlhf_type", "grpo"])


def test_a_model_not_mounted_here_is_not_found(capsys):
    """A local model path that does not exist on the translating machine is reported as not
    found (written as given, checked when `megagrpo train` loads it), not as an unsupported
    family; a hub id keeps its own note."""
    path = "/mnt/llm/models/my-math-sft-7b"
    t = translate({"rlhf_type": "grpo", "model": path, "max_steps": 3, "tuner_type": "lora"})
    entry = next(e for e in t.entries if e.flag == "model")
    assert "not found here" in entry.note and "unsupported" not in entry.note
    assert not {e.flag for e in blocking(t)} & {"model"}
    assert to_config(t).model.hf_path == path
    vl = translate({"rlhf_type": "grpo", "model": "/mnt/models/Qwen2.5-VL-7B", "max_steps": 3})
    assert "model" in {e.flag for e in blocking(vl)}  # a VL model is refused wherever it is


def test_offload_and_performance_flags_are_accepted_with_a_note():
    flags = {"rlhf_type": "grpo", "tuner_type": "lora", "train_iters": 3,
             "offload_model": True, "offload_optimizer": True, "optimizer_cpu_offload": True,
             "use_precision_aware_optimizer": True, "offload_bridge": False}  # fmt: skip
    t = translate(flags, "megatron")
    assert not blocking(t)
    assert to_config(t).trainer.offload_during_rollout is True
    notes = {e.flag: e.note for e in t.entries}
    assert "performance knob" in notes["optimizer_cpu_offload"]
    assert "performance knob" in notes["use_precision_aware_optimizer"]


# ----------------------------------------------------------------------------- acceptance

OUT_OF_SCOPE = {
    "dataset": "hub datasets / path#N subsampling (download, convert, write the rows)",
    "num_train_epochs": "no step count without the local dataset (hub datasets)",
    "system": "a --system file not found here (ms-swift reads it at start; F8)",
    "model": "vision-language models and families megagrpo has no provider for",
    "max_pixels": "vision-language models",
    "freeze_vit": "vision-language models",
    "tuner_type": "full fine-tuning",
    "vllm_mode": "server mode",
    "vllm_server_host": "server mode",
    "vllm_server_port": "server mode",
    "vllm_server_base_url": "server mode",
    "multi_turn_scheduler": "multi-turn environments",
    "use_gym_env": "multi-turn environments",
    "gym_env": "multi-turn environments",
    "max_turns": "multi-turn environments",
    "reward_model": "reward models",
    "reward_model_plugin": "reward models",
    "teacher_model": "distillation from a teacher",
    "teacher_model_server": "distillation from a teacher",
    "teacher_kl_coef": "distillation from a teacher",
    "num_generations": "distillation from a teacher (groups of one answer)",
    "quant_method": "quantised base weights (QLoRA)",
    "quant_bits": "quantised base weights (QLoRA)",
    "bnb_4bit_quant_type": "quantised base weights (QLoRA)",
}
"""Blocking flags and the scope decision each names (docs/migrating-from-ms-swift.md)."""
KNOWN_GAPS: set[str] = set()
"""GRPO training features still missing: none over these commands (776dce3: SAPO and KL in
the reward)."""


def test_every_refusal_names_something_out_of_scope():
    gaps = set()
    for script in COMMANDS:
        flags, flavor, env = read_swift_args([str(script)])
        world = 1
        for key in ("NPROC_PER_NODE", "NNODES"):
            value = env.get(key, "1")
            world *= int(value) if str(value).isdigit() else 1
        t = translate(flags, flavor or "swift", world, env=env)
        for entry in blocking(t):
            if entry.flag in KNOWN_GAPS:
                gaps.add(entry.flag)
                continue
            assert entry.flag in OUT_OF_SCOPE, (script.name, entry.flag, entry.note)
            if entry.flag == "model":
                assert "multimodal" in entry.note or "no provider" in entry.note, entry.note
    assert len(COMMANDS) == 19 + 14
    assert gaps <= KNOWN_GAPS
