"""``--advantage_estimator`` sets ms-swift's ``scale_rewards`` and ``kl_in_reward`` defaults
(rloo: none / KL in the reward; reinforce_plus_plus: batch / KL in the reward). Checked
against ms-swift's own argument code (``_init_grpo`` of both launchers, run on a namespace):
at 776dce3 from-swift wrote ``scale_rewards: group`` and the KL as a loss term for
``--advantage_estimator rloo`` and marked it ``=`` (it trained differently), and refused
``--kl_in_reward`` (false included, although that is megagrpo's KL). The KL in the reward is
trained as ms-swift's: tests/unit/test_kl_in_reward.py."""

from __future__ import annotations

import itertools
import types

import pytest
from swift_source import swift_function

from megagrpo.swift.fidelity import blocking
from megagrpo.swift.translate import to_config, translate


class _Args(types.SimpleNamespace):
    def _init_generation_batch_params(self):  # megatron's; the batch layout is not at issue
        return None


INIT_GRPO = {
    "swift": ("arguments/rlhf_args.py", "RLHFArguments"),
    "megatron": ("megatron/arguments/megatron_args.py", "RLHFMegatronArgumentsMixin"),
}


def _swift_resolved(flavor: str, flags: dict) -> _Args:
    """ms-swift 4.6's own resolution of the GRPO arguments' defaults."""
    args = _Args(
        rlhf_type="grpo", cached_dataset=None, cached_val_dataset=None, use_vllm=True,
        async_generate=False, vllm_mode="colocate", truncation_strategy=None, beta=None,
        reward_funcs=[], advantage_estimator="grpo", kl_in_reward=None, loss_type="grpo",
        scale_rewards=None, sync_ref_model=False, num_iterations=1, dataset_shuffle=None,
        use_ray=False, use_gym_env=None, gym_env=None,
    )  # fmt: skip
    for k, v in flags.items():
        setattr(args, k, v)
    path, cls = INIT_GRPO[flavor]
    swift_function(path, "_init_grpo", cls, set_default_ddp_config=lambda: None)(args)
    return args


CASES = list(
    itertools.product(
        ["swift", "megatron"],
        ["grpo", "rloo", "reinforce_plus_plus"],
        [None, True, False],  # kl_in_reward
        [None, 0.0, 0.1],  # beta
        [None, "group"],  # scale_rewards
    )
)


@pytest.mark.parametrize("flavor, est, kl_in_reward, beta, scale", CASES)
def test_estimator_defaults_are_ms_swifts(flavor, est, kl_in_reward, beta, scale):
    given = {"advantage_estimator": est}
    for k, v in (("kl_in_reward", kl_in_reward), ("beta", beta), ("scale_rewards", scale)):
        if v is not None:
            given[k] = v
    want = _swift_resolved(flavor, given)
    flags = {"rlhf_type": "grpo", "tuner_type": "lora", "max_steps": 3, **given}
    if flavor == "megatron":
        flags = {**flags, "train_iters": 3}
        del flags["max_steps"]
    t = translate(flags, flavor)
    blocked = {e.flag for e in blocking(t)}
    cfg = to_config(t)
    assert cfg.loss.advantage_scale == want.scale_rewards
    assert cfg.loss.advantage_estimator == want.advantage_estimator
    assert not blocked, blocked
    assert cfg.loss.kl_coef == pytest.approx(want.beta)
    assert cfg.loss.kl_in_reward == (want.kl_in_reward and want.beta != 0.0), vars(want)
