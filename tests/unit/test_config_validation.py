"""Config values that used to pass validation and fail far away (issue 14.3 / 14.10).

Each case goes through the user's path (``load_config`` with a dotted override, exactly as on
the command line) and must raise ConfigError naming the key. Before the fix every case below
was accepted (``trainer.lr=inf`` and ``loss.entropy_coef=nan`` then put NaN into the LoRA
weights and the run died blaming the weight-sync mapping; ``trainer.adam_betas=[0.9,1.5]``
died in torch after the model loaded; ``rollout.group_size=1`` trained nothing).
"""

from __future__ import annotations

import math

import pytest
import torch

from megagrpo.config import load_config
from megagrpo.errors import ConfigError, require_finite
from megagrpo.trainer.config import RunConfig

REJECTED = [
    # (override, key the error must name)
    ("trainer.lr=inf", "trainer.lr"),
    ("trainer.lr=nan", "trainer.lr"),
    ("trainer.weight_decay=nan", "trainer.weight_decay"),
    ("trainer.weight_decay=inf", "trainer.weight_decay"),
    ("trainer.weight_decay=-1", "trainer.weight_decay"),
    ("trainer.grad_clip=nan", "trainer.grad_clip"),
    ("trainer.grad_clip=inf", "trainer.grad_clip"),
    ("trainer.adam_betas=[0.9,1.5]", "trainer.adam_betas.1"),
    ("trainer.adam_betas=[0.9,1.0]", "trainer.adam_betas.1"),
    ("trainer.adam_betas=[-0.1,0.999]", "trainer.adam_betas.0"),
    ("trainer.adam_betas=[nan,0.999]", "trainer.adam_betas.0"),
    ("trainer.adam_betas=[0.9,inf]", "trainer.adam_betas.1"),
    ("loss.entropy_coef=nan", "loss.entropy_coef"),
    ("loss.entropy_coef=inf", "loss.entropy_coef"),
    ("loss.kl_coef=inf", "loss.kl_coef"),
    ("loss.kl_coef=nan", "loss.kl_coef"),
    ("loss.eps_high=inf", "loss.eps_high"),
    ("loss.eps_low=nan", "loss.eps_low"),
    ("loss.tis_cap=inf", "loss.tis_cap"),
    ("loss.positive_weight=nan", "loss.positive_weight"),
    ("loss.positive_weight=1.5", "loss.positive_weight"),
    ("loss.positive_weight=-0.1", "loss.positive_weight"),
    ("rewards.answer_balance=1.5", "rewards.answer_balance"),
    ("rollout.group_size=1", "rollout.group_size"),
    ("rollout.temperature=inf", "rollout.temperature"),
    ("rollout.top_p=nan", "rollout.top_p"),
    ("rollout.verify_tol=inf", "rollout.verify_tol"),
    ("rollout.verify_min_change=nan", "rollout.verify_min_change"),
    ("rollout.verify_min_change=-1", "rollout.verify_min_change"),
    ("rollout.gpu_memory_utilization=nan", "rollout.gpu_memory_utilization"),
    ("rollout.sync_bucket_mb=inf", "rollout.sync_bucket_mb"),
    ("dynamic.tau=inf", "dynamic.tau"),
    ("dynamic.tau=nan", "dynamic.tau"),
    ("curriculum.level_weights=[1,inf,1,1]", "curriculum.level_weights.1"),
    ("curriculum.level_weights=[1,1,nan,1]", "curriculum.level_weights.2"),
    ("curriculum.online_decay=nan", "curriculum.online_decay"),
    ("curriculum.revisit_prob=nan", "curriculum.revisit_prob"),
    ("model.lora.alpha=inf", "model.lora.alpha"),
    ("model.lora.dropout=nan", "model.lora.dropout"),
    ("cluster.gpu_memory_gib=inf", "cluster.gpu_memory_gib"),
    ("cluster.host_memory_gib=0", "cluster.host_memory_gib"),
    ("metrics.wandb_init_timeout_s=inf", "metrics.wandb_init_timeout_s"),
    ("trainer.name=..", "trainer.name"),  # was: the run written into output_dir's parent
    ("trainer.name=.", "trainer.name"),
    ("trainer.name=.hidden", "trainer.name"),
]


@pytest.mark.parametrize(("override", "key"), REJECTED, ids=[o for o, _ in REJECTED])
def test_bad_value_is_rejected_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, [], [override])
    assert f"config key '{key}'" in str(err.value)


ACCEPTED = [
    "trainer.lr=1e-6",
    "trainer.weight_decay=0",
    "trainer.weight_decay=0.1",
    "trainer.grad_clip=0",
    "trainer.adam_betas=[0.0,0.999]",
    "loss.entropy_coef=-0.01",  # an entropy penalty is a legitimate choice
    "loss.kl_coef=0.04",
    "loss.tis_cap=2",
    "rollout.group_size=2",
    "rollout.verify_min_change=0",
    "dynamic.tau=1e-6",
    "curriculum.level_weights=[1,0,2.5,1]",
    "model.lora.alpha=32",
    "trainer.name=run.v2",
]


@pytest.mark.parametrize("override", ACCEPTED)
def test_boundary_values_still_pass(override):
    load_config(RunConfig, [], [override])


@pytest.mark.parametrize(
    "betas",
    [(0.9, 0.999), (0.0, 0.0), (0.9, 1.0), (1.0, 0.9), (0.9, 1.5), (-0.1, 0.9), (0.9, -1e-9)],
)
def test_adam_betas_rule_is_torchs(betas):
    # Independent reference: torch's own AdamW check, which used to fire only after the model
    # had loaded. The config must reject exactly what torch rejects.
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], betas=betas)
        torch_ok = True
    except ValueError:
        torch_ok = False
    override = f"trainer.adam_betas=[{betas[0]},{betas[1]}]"
    if torch_ok:
        load_config(RunConfig, [], [override])
    else:
        with pytest.raises(ConfigError, match=r"trainer\.adam_betas\.\d"):
            load_config(RunConfig, [], [override])


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, "1.0", None, True])
def test_require_finite_rejects_non_numbers_and_non_finite(value):
    with pytest.raises(ConfigError, match=r"config key 'a\.b': must be a finite number"):
        require_finite(value, "a.b")


@pytest.mark.parametrize("value", [0, -3, 1e-300, 1.5e300])
def test_require_finite_accepts_finite_numbers(value):
    require_finite(value, "a.b")


@pytest.mark.parametrize("word", ["off", "no", "on", "yes", "Off"])
def test_enum_words_are_not_yaml_booleans(tmp_path, word):
    """``model.routing_replay=off`` (YAML 1.1 reads off/no/on/yes as booleans): a string
    key keeps the word, on the command line and in a file; a boolean key still reads it
    as a boolean."""
    cli = load_config(RunConfig, [], [f"trainer.name={word}", f"dynamic.enabled={word}"])
    assert cli.trainer.name == word and cli.dynamic.enabled is (word.lower() in ("on", "yes"))
    f = tmp_path / "c.yaml"
    f.write_text(f"trainer:\n  name: {word}\ndynamic:\n  enabled: {word}\n")
    from_file = load_config(RunConfig, [f])
    assert from_file.trainer.name == word and from_file.dynamic.enabled == cli.dynamic.enabled
    enums = ["model.routing_replay=off", "dynamic.preflight=off"]
    cfg = load_config(RunConfig, [], enums)
    assert (cfg.model.routing_replay, cfg.dynamic.preflight) == ("off", "off")
    f.write_text("model:\n  routing_replay: off\ndynamic:\n  preflight: off\n")
    cfg = load_config(RunConfig, [f])
    assert (cfg.model.routing_replay, cfg.dynamic.preflight) == ("off", "off")


def test_train_checks_the_layout_before_starting_anything(
    tmp_path, monkeypatch, tiny_moe_dir, capsys
):
    """tp/ep against WORLD_SIZE and the model's config.json: a ConfigError from
    `megagrpo train` before any engine or model is built."""
    import megagrpo.trainer.setup as setup
    from megagrpo.cli import main
    from megagrpo.testing import tiny_run_config, write_run_config

    def never(*a, **k):
        raise AssertionError("build_context ran before the layout was checked")

    monkeypatch.setattr(setup, "build_context", never)
    cfg = write_run_config(tmp_path / "c.yaml", tiny_run_config(tiny_moe_dir, tmp_path, "x"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    for overrides, key in (
        (["parallel.ep=2"], "parallel.ep"),
        (["parallel.tp=2", "parallel.sequence_parallel=true"], "parallel.tp"),
    ):
        assert main(["train", str(cfg), *overrides]) == 2
        assert key in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["train", str(cfg), "parallel.tp=3", "parallel.sequence_parallel=true"]) == 2
    assert "num_attention_heads" in capsys.readouterr().err  # the model's config.json
