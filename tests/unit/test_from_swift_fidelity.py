"""`megagrpo from-swift` says ``=`` only when megagrpo trains what ms-swift 4.6 trains, and
writes no config for a recipe it cannot train (exit 2) unless --allow-partial.

References: ms-swift's own code, compiled alone from its installed source where importing
its module would load its trainers' stack (``rl_core/advantage.py``, ``utils/hf_config.py``:
tests/unit/swift_source.py), else its loss as written in
``swift/megatron/trainers/grpo_trainer.py`` (lines cited at each re-statement), and ms-swift's
GRPO example scripts (tests/fixtures/ms_swift_grpo/, Apache-2.0, attributed in each file).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from swift_source import swift_advantage, swift_class, swift_defs, swift_function

from megagrpo.algo.advantages import group_advantages
from megagrpo.algo.config import LossConfig
from megagrpo.algo.losses import policy_loss
from megagrpo.cli import main
from megagrpo.config import load_config
from megagrpo.errors import ConfigError
from megagrpo.swift.advantage import SCALE_DEFAULTS
from megagrpo.swift.fidelity import blocking
from megagrpo.swift.flags import EXACT, MISSING
from megagrpo.swift.shell import Unexpanded, command_from_script
from megagrpo.swift.translate import parse_tokens, read_swift_args, to_config, translate
from megagrpo.trainer.config import RunConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ms_swift_grpo"
SCRIPTS = sorted(FIXTURES.glob("*.sh"))
BASE = ["megatron", "rlhf", "--rlhf_type", "grpo", "--tuner_type", "lora", "--train_iters", "5"]


def _t(tokens: list[str], env: dict | None = None):
    flags, flavor, parsed_env = parse_tokens(tokens)
    return translate(flags, flavor or "swift", 1, env=env or parsed_env)


def _world(env: dict) -> int:
    """NPROC_PER_NODE x NNODES as the script sets them (1 where the shell computes them)."""
    world = 1
    for key in ("NPROC_PER_NODE", "NNODES"):
        value = env.get(key, "1")
        world *= 1 if isinstance(value, Unexpanded) else int(value)
    return world


def _status(t, flag: str) -> str:
    return next(e.status for e in t.entries if e.flag == flag)


# ----------------------------------------------------------------------------- examples


def test_ms_swift_lora_examples_are_all_read():
    assert len(SCRIPTS) == 19  # every LoRA GRPO script of examples/{megatron,train}/grpo


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_example_scripts_write_nothing_they_cannot_train(script, tmp_path, capsys):
    """Each ms-swift LoRA GRPO example: a blocking flag -> exit 2 and no file; with
    --allow-partial the config is written, loads, and carries ms-swift's semantics."""
    out = tmp_path / "c.yaml"
    flags, flavor, env = read_swift_args([str(script)])
    t = translate(flags, flavor or "swift", _world(env), env=env)
    code = main(["from-swift", "--out", str(out), "--", str(script)])
    err = capsys.readouterr().err
    if blocking(t):
        assert code == 2 and not out.exists() and "no config written" in err
        code = main(["from-swift", "--allow-partial", "--out", str(out), "--", str(script)])
        assert "# PARTIAL" in out.read_text()
    assert code == 0
    cfg = load_config(RunConfig, [out])
    assert cfg.trainer.old_logprobs == "recompute"  # ms-swift: the training model's
    assert cfg.curriculum.retire_streak == 0  # ms-swift never drops rows
    assert cfg.loss.tis_cap == 0.0 or "rollout_importance_sampling_mode" in flags
    est = flags.get("advantage_estimator", "grpo")
    scale = flags.get("scale_rewards", SCALE_DEFAULTS[est])  # ms-swift's default per estimator
    assert cfg.loss.advantage_scale == scale
    exact = {e.flag for e in t.entries if e.status == EXACT}
    assert not exact & {"loss_type", "model"} or flags.get("loss_type", "grpo") in (
        "grpo", "bnpo", "dapo", "dr_grpo")  # fmt: skip


def test_example_blockers_are_what_megagrpo_lacks():
    found = {}
    for script in SCRIPTS:
        flags, flavor, env = read_swift_args([str(script)])
        t = translate(flags, flavor or "swift", _world(env), env=env)
        found[script.stem] = {e.flag for e in blocking(t)}
    assert found["megatron__grpo__moe_colocate_lora"] == {"dataset", "num_train_epochs"}  # hub
    assert {"vllm_mode", "vllm_server_host"} <= found["train__grpo__external__moe_lora"]
    assert {"max_pixels", "model"} <= found["train__grpo__internal__vllm_vl7b"]
    assert {"quant_method"} <= found["train__grpo__internal__qlora"]
    assert "advantage_estimator" not in found["train__grpo__internal__rloo"]  # trained now
    assert {"teacher_model"} <= found["train__grpo__opd_rl"]
    assert "top_k" not in found["train__grpo__internal__vllm_72b_4gpu"]  # rollout.top_k


# ----------------------------------------------------------------------------- algorithm


def _swift_loss(loss_type, level, logp, old, adv, mask, eps_low, eps_high, max_len):
    """ms-swift 4.6 swift/megatron/trainers/grpo_trainer.py, one micro-batch, one DP rank:
    the ratio (lines 1014-1031), the clip (1057-1062), the normaliser (1127-1149)."""
    log_ratio = logp - old
    if level == "sequence":
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_w = log_ratio
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    return (per_token * mask).sum() / (mask.shape[0] * max_len)  # dr_grpo


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_loss_types_train_ms_swifts_loss(loss_type, level):
    t = _t([*BASE, "--loss_type", loss_type, "--importance_sampling_level", level,
            "--epsilon", "0.2", "--epsilon_high", "0.3", "--max_completion_length", "12",
            "--beta", "0"])  # fmt: skip
    cfg = to_config(t)
    assert _status(t, "loss_type") == EXACT
    gen = torch.Generator().manual_seed(0)
    b, s = 6, 12
    mask = (torch.rand(b, s, generator=gen) > 0.3).float()
    old = -torch.rand(b, s, generator=gen) * 3
    logp = (old + 0.4 * torch.randn(b, s, generator=gen)).requires_grad_()
    adv = torch.randn(b, 1, generator=gen).expand(b, s).contiguous()
    want = _swift_loss(loss_type, level, logp, old, adv, mask, 0.2, 0.3, 12)
    ours, _ = policy_loss(logp, old, adv, mask, cfg.loss)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    g_want = torch.autograd.grad(want, logp)[0]
    g_ours = torch.autograd.grad(policy_loss(logp, old, adv, mask, cfg.loss)[0], logp)[0]
    torch.testing.assert_close(g_ours, g_want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("scale", [None, "group", "batch", "none"])
def test_advantages_are_ms_swifts(loss_type, scale):
    compute_advantages = swift_advantage("compute_advantages")

    extra = [] if scale is None else ["--scale_rewards", scale]
    cfg = to_config(_t([*BASE, "--loss_type", loss_type, "--num_generations", "4", *extra]))
    rewards = torch.tensor([[1.0, 0.0, 0.5, 1.0], [0.2, 0.2, 0.9, 0.0], [1.0, 1.0, 1.0, 1.0]])
    want, _ = compute_advantages(
        rewards.reshape(-1, 1), torch.ones(1), 4, scale_rewards=scale or "group"
    )
    ours = group_advantages(rewards, scale=LossConfig(**vars(cfg.loss)).resolved_advantage_scale())
    torch.testing.assert_close(ours.reshape(-1), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantage_estimators_are_ms_swifts(estimator, scale):
    """--advantage_estimator rloo | reinforce_plus_plus (refused at cd819e6) against
    ms-swift's own compute_advantages."""
    compute_advantages = swift_advantage("compute_advantages")

    t = _t([*BASE, "--advantage_estimator", estimator, "--scale_rewards", scale,
            "--kl_in_reward", "false", "--num_generations", "4"])  # fmt: skip
    assert _status(t, "advantage_estimator") == EXACT and not blocking(t)
    cfg = to_config(t)
    rewards = torch.tensor([[1.0, 0.0, 0.5, 1.0], [0.2, 0.2, 0.9, 0.0], [0.0, 1.0, 1.0, 1.0]])
    want, _ = compute_advantages(
        rewards.reshape(-1, 1), torch.ones(1), 4, advantage_estimator=estimator,
        scale_rewards=scale,
    )  # fmt: skip
    ours = group_advantages(
        rewards, scale=cfg.loss.advantage_scale, estimator=cfg.loss.advantage_estimator
    )
    torch.testing.assert_close(ours.reshape(-1), want, rtol=1e-5, atol=1e-6)


def test_unsupported_losses_block(tmp_path, capsys):
    for loss in ("cispo", "real", "fipo"):
        t = _t([*BASE, "--loss_type", loss, "--tau_pos", "1.0"])
        flags = {e.flag for e in blocking(t)}
        assert "loss_type" in flags and "tau_pos" not in flags, loss  # tau: SAPO's, no effect
    out = tmp_path / "cispo.yaml"
    assert main(["from-swift", "--out", str(out), "--", *BASE, "--loss_type", "cispo"]) == 2
    assert not out.exists() and "--loss_type" in capsys.readouterr().err
    assert main(["from-swift", "--allow-partial", "--out", str(out), "--", *BASE,
                 "--loss_type", "cispo"]) == 0  # fmt: skip
    assert out.read_text().startswith("# megagrpo from-swift")
    t = _t([*BASE, "--loss_type", "sapo", "--importance_sampling_level", "sequence"])
    assert "importance_sampling_level" in {e.flag for e in blocking(t)}
    t = _t([*BASE, "--importance_sampling_level", "sequence_token"])
    assert "importance_sampling_level" in {e.flag for e in blocking(t)}


def test_generation_and_sampling_knobs():
    """Several optimizer steps per generation, the overlong filter and the sampler settings
    are trained as ms-swift trains them (they blocked at cd819e6); server mode, async
    generation and full fine-tuning still block."""
    topk = to_config(_t([*BASE, "--top_k", "50", "--min_p", "0.1", "--top_p", "0.9",
                         "--repetition_penalty", "1.05"]))  # fmt: skip
    ro = topk.rollout
    assert (ro.top_k, ro.min_p, ro.top_p, ro.repetition_penalty) == (50, 0.1, 0.9, 1.05)
    assert ro.logprobs == "sampling"  # ms-swift trains on logits / T whatever the sampler
    assert to_config(_t([*BASE, "--top_k", "-1"])).rollout.top_k == 0
    spg = _t([*BASE, "--global_batch_size", "32", "--steps_per_generation", "4"])
    assert _status(spg, "steps_per_generation") == EXACT and not blocking(spg)
    cfg = to_config(spg)
    assert (cfg.trainer.batch_groups, cfg.trainer.mini_batches) == (4 * 32 // 8, 4)
    gen = to_config(_t([*BASE, "--global_batch_size", "32", "--generation_batch_size", "96"]))
    assert (gen.trainer.batch_groups, gen.trainer.mini_batches) == (12, 3)
    with pytest.raises(ConfigError, match="generation_batch_size"):
        _t([*BASE, "--global_batch_size", "32", "--generation_batch_size", "40"])
    swift = ["swift", "rlhf", "--rlhf_type", "grpo", "--max_steps", "3"]
    two_gen = _t([*swift, "--gradient_accumulation_steps", "4", "--steps_per_generation", "2",
                  "--per_device_train_batch_size", "8"])  # fmt: skip
    assert _status(two_gen, "steps_per_generation") == EXACT  # 2 generations per step
    assert to_config(two_gen).trainer.mini_batches == 1
    more = _t([*swift, "--gradient_accumulation_steps", "2", "--steps_per_generation", "4",
               "--per_device_train_batch_size", "8"])  # fmt: skip
    assert to_config(more).trainer.mini_batches == 2 and not blocking(more)
    straddle = _t([*swift, "--gradient_accumulation_steps", "2", "--steps_per_generation", "3",
                   "--per_device_train_batch_size", "8"])  # fmt: skip
    assert "steps_per_generation" in {e.flag for e in blocking(straddle)}
    assert to_config(_t([*BASE, "--overlong_filter", "true"])).loss.overlong_filter is True
    assert to_config(_t([*BASE, "--overlong_filter", "false"])).loss.overlong_filter is False
    assert "async_generate" in {e.flag for e in blocking(_t([*BASE, "--async_generate", "true"]))}
    assert "vllm_mode" in {e.flag for e in blocking(_t([*BASE, "--vllm_mode", "server"]))}
    full = _t(["megatron", "rlhf", "--rlhf_type", "grpo", "--train_iters", "5"])
    assert "tuner_type" in {e.flag for e in blocking(full)}  # megatron's default is full
    assert not blocking(_t(["swift", "rlhf", "--rlhf_type", "grpo", "--max_steps", "5"]))


def test_old_logprobs_recomputed_and_no_tis_unless_asked():
    cfg = to_config(_t([*BASE, "--bf16", "true"]))
    assert cfg.trainer.old_logprobs == "recompute" and cfg.loss.tis_cap == 0.0
    tis = ["--rollout_importance_sampling_mode", "token_truncate",
           "--rollout_importance_sampling_threshold", "3"]  # fmt: skip
    cfg = to_config(_t([*BASE, "--bf16", "true", *tis]))
    assert cfg.trainer.old_logprobs == "recompute" and cfg.loss.tis_cap == 3.0


# ----------------------------------------------------------------------------- model, steps


def test_dtype_is_the_models_own(tmp_path):
    # ms-swift's HfConfigFactory compiled alone (swift.utils.hf_config imports transformers'
    # model stack); a config dict never reaches its PretrainedConfig branches
    HfConfigFactory = swift_class(  # noqa: N806 - ms-swift's class name
        "utils/hf_config.py", "HfConfigFactory",
        PretrainedConfig=type("PretrainedConfig", (), {}),
        deep_getattr=swift_function("utils/utils.py", "deep_getattr"),
    )  # fmt: skip

    model = tmp_path / "m"
    model.mkdir()
    hf = {"model_type": "qwen3", "torch_dtype": "bfloat16"}
    (model / "config.json").write_text(json.dumps(hf))
    want = str(HfConfigFactory.get_torch_dtype(hf, {})).replace("torch.", "")
    cfg = to_config(_t([*BASE, "--model", str(model)]))
    assert cfg.model.dtype == want == "bfloat16" and cfg.rollout.dtype == "bfloat16"
    cfg = to_config(_t([*BASE, "--model", str(model), "--fp16", "true"]))
    assert cfg.model.dtype == "float16"
    hub = _t([*BASE, "--model", "Qwen/Qwen3-8B"])
    note = next(e.note for e in hub.entries if e.flag == "torch_dtype")
    assert "config.json torch_dtype" in note and _status(hub, "torch_dtype") != EXACT


def test_unsupported_architectures_block(tmp_path):
    for hub in ("Qwen/Qwen3.5-2B", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-Omni-7B"):
        assert "model" in {e.flag for e in blocking(_t([*BASE, "--model", hub]))}, hub
    assert not blocking(_t([*BASE, "--model", "Qwen/Qwen3-30B-A3B-Instruct-2507"]))
    model = tmp_path / "vl"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    assert "model" in {e.flag for e in blocking(_t([*BASE, "--model", str(model)]))}
    env = {"MAX_PIXELS": "1003520"}
    assert "max_pixels" in {e.flag for e in blocking(_t(BASE, env=env))}


def _swift_train_iters(rows, mbs, dp, g, epochs, gbs):
    """ms-swift 4.6 megatron_args.py init_iters (lines 1138-1152)."""
    step_batch = mbs * dp
    return (rows // step_batch * step_batch * g) * epochs // gbs


def test_max_steps_from_epochs(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"query": f"q{i}", "response": "A"}) + "\n" for i in range(40))
    )
    cmd = ["megatron", "rlhf", "--rlhf_type", "grpo", "--tuner_type", "lora", "--dataset",
           str(data), "--num_train_epochs", "2", "--global_batch_size", "16",
           "--micro_batch_size", "2", "--num_generations", "8"]  # fmt: skip
    cfg = to_config(_t(cmd))
    assert cfg.trainer.max_steps == _swift_train_iters(40, 2, 1, 8, 2, 16) == 40
    cfg = to_config(_t([*cmd[:7], f"{data}#24", *cmd[8:]]))
    assert cfg.trainer.max_steps == _swift_train_iters(24, 2, 1, 8, 2, 16)
    hub = _t(["megatron", "rlhf", "--tuner_type", "lora", "--dataset", "AI-MO/x"])
    assert "num_train_epochs" in {e.flag for e in blocking(hub)}
    assert to_config(_t([*BASE])).trainer.max_steps == 5


# ----------------------------------------------------------------------------- curriculum


def test_translated_configs_retire_nothing_and_name_their_signal():
    cfg = to_config(_t([*BASE, "--reward_funcs", "format", "accuracy"]))
    assert cfg.curriculum.retire_streak == 0
    assert cfg.curriculum.signal_reward == "accuracy"


def test_signal_reward_is_named_not_the_first():
    from megagrpo.curriculum.config import CurriculumConfig
    from megagrpo.curriculum.sampler import CurriculumSampler
    from megagrpo.rewards.config import RewardsConfig, RewardSpec
    from megagrpo.types import Group, Problem

    two = RewardsConfig(functions=[RewardSpec(name="orms:format", label="format"),
                                   RewardSpec(name="mcq_accuracy", label="accuracy")])  # fmt: skip
    with pytest.raises(ConfigError, match="curriculum.signal_reward"):
        RunConfig(rewards=two).validate()
    with pytest.raises(ConfigError, match="curriculum.signal_reward"):
        RunConfig(rewards=two, curriculum=CurriculumConfig(signal_reward="nope")).validate()
    run = RunConfig(rewards=two, curriculum=CurriculumConfig(signal_reward="accuracy"))
    run.validate()
    assert run.curriculum_signal() == "accuracy"
    problems = [Problem(id=f"p{i}", messages=[], answer=["a"]) for i in range(4)]

    def groups():
        return [Group(problem=p, completions=["x"] * 4, token_ids=[[1]] * 4, logprobs=[[0.0]] * 4,
                      rewards=[1.5, 1.0, 1.0, 1.5], lengths=[1] * 4,
                      reward_parts={"format": [1.0] * 4, "accuracy": [0.5, 0.0, 0.0, 0.5]})
                for p in problems]  # fmt: skip

    def retired(key: str) -> int:
        sampler = CurriculumSampler(problems, CurriculumConfig(retire_streak=2), None,
                                    correctness_key=key)  # fmt: skip
        for _ in range(2):
            sampler.observe(groups())
        return int(sampler.retired.sum())

    assert retired("format") == 4  # format passes every answer: all-correct, retired
    assert retired(run.curriculum_signal()) == 0  # accuracy varies: trained on


# ----------------------------------------------------------------------------- parsing


def test_scripts_are_read_not_run(tmp_path):
    marker = tmp_path / "ran"
    script = f"""SYSTEM_PROMPT="You are
a careful doctor. Answer with \\"A\\"."
NPROC_PER_NODE=$(nproc) \\
swift rlhf --rlhf_type grpo --max_steps 2 \\
    --system "$SYSTEM_PROMPT" \\
    --learning_rate $LR --temperature 0.7 `touch {marker}` \\
    --logging_dir "$(touch {marker})" --output_dir $'runs\\nx'
"""
    words = command_from_script(script)
    assert not marker.exists()
    flags, _, env = parse_tokens(words)
    assert isinstance(env["NPROC_PER_NODE"], Unexpanded)
    assert flags["system"] == 'You are\na careful doctor. Answer with "A".'
    assert flags["output_dir"] == "runs\nx" and isinstance(flags["logging_dir"], Unexpanded)
    assert isinstance(flags["learning_rate"], Unexpanded)
    t = translate(flags, "swift", 1, env=env)
    statuses = {e.flag: e.status for e in t.entries}
    assert statuses["learning_rate"] == MISSING and statuses["NPROC_PER_NODE"] == MISSING
    assert "trainer.lr" not in t.overrides and statuses["system"] == EXACT
    assert not marker.exists()
    passwd = parse_tokens(command_from_script('swift rlhf --system "$(cat /etc/passwd)"\n'))[0]
    t = translate(passwd, "swift", 1)
    assert _status(t, "system") == MISSING and "data.prompt.system" not in t.overrides


def test_qlora_example_multi_line_prompt_parses():
    flags, _, _ = read_swift_args([str(FIXTURES / "train__grpo__internal__qlora.sh")])
    assert flags["rlhf_type"] == "grpo" and flags["quant_bits"] == 4


@pytest.mark.parametrize(
    "bad, flag",
    [
        (["--lr", "abc"], "--lr"),
        (["--num_generations", "8.5"], "--num_generations"),
        (["--bf16", "maybe"], "--bf16"),
        (["--temperature", "0.7", "0.9"], "--temperature"),
        (["--global_batch_size", "x"], "--global_batch_size"),
        (["--max_completion_length", "1e3"], "--max_completion_length"),
    ],
)
def test_malformed_values_name_the_flag(bad, flag):
    with pytest.raises(ConfigError, match=flag):
        _t([*BASE, *bad])
    with pytest.raises(ConfigError, match="no closing"):
        command_from_script('swift rlhf --system "unterminated\n')


def test_soft_max_length_beyond_the_completion_limit_is_translated(tmp_path, capsys):
    """ms-swift accepts --soft_max_length 4096 with its default max_completion_length 512:
    the penalty then starts at 2048 tokens and never fires; megagrpo leaves the term out."""
    cmd = [*BASE, "--reward_funcs", "accuracy", "soft_overlong", "--soft_max_length", "4096",
           "--soft_cache_length", "2048"]  # fmt: skip
    out = tmp_path / "c.yaml"
    assert main(["from-swift", "--out", str(out), "--", *cmd]) == 0
    assert "reward is 0 for every completion" in capsys.readouterr().err
    cfg = load_config(RunConfig, [out])
    assert [f.name for f in cfg.rewards.functions] == ["mcq_accuracy"]
    # ms-swift's SoftOverlong and ORM compiled alone (swift.rewards imports trl and vLLM)
    SoftOverlong = swift_defs("rewards/orm.py", "ORM", "SoftOverlong")["SoftOverlong"]  # noqa: N806

    class Args:
        soft_max_length, soft_cache_length, max_completion_length = 4096, 2048, 512

    orm = SoftOverlong(Args())
    assert orm(["x"] * 3, response_token_ids=[[0] * 1, [0] * 300, [0] * 512]) == [0.0, 0.0, 0.0]
    cut = [*cmd, "--max_completion_length", "3000"]
    assert "soft_max_length" in {e.flag for e in blocking(_t(cut))}
