"""The loss a translated config trains equals ms-swift 4.6.0's own loss code, run on CPU,
over several micro-batches and data-parallel ranks.

ms-swift side: ``MegatronGRPOTrainer.loss_func`` (``swift/megatron/trainers/grpo_trainer.py``)
and ``GRPOTrainer._compute_loss_and_metrics`` (``swift/rlhf_trainers/grpo_trainer.py``)
themselves, on trainer objects that carry only the attributes these methods read (the model
forward is replaced by given log-probs). Megatron's import of ``mcore_bridge`` (not installed
here, and not used by the loss) is satisfied by an empty stub package. Around them the
schedules are composed as upstream composes them: megatron-core's forward step divides a
2-tuple loss by ``num_microbatches`` (``pipeline_parallel/schedules.py``), transformers'
``Trainer.training_step`` divides by the gradient-accumulation steps (ms-swift sets
``model_accepts_loss_kwargs = False``), and data-parallel gradient reduction averages over
ranks (both). megagrpo side: ``policy_loss`` per micro-batch x ``microbatch_weight`` against
the step's totals / dp_size, as ``trainer.optimize.prepare_update`` builds them.

What the CPU test cannot show: the GPU kernels (the fused Triton loss has its own parity
tests against ``policy_loss``) and real NCCL reductions (a mean, stated here).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections import defaultdict

import pytest
import torch

from megagrpo.algo.losses import policy_loss
from megagrpo.swift.flags import DIFFERS, EXACT
from megagrpo.swift.translate import parse_tokens, to_config, translate
from megagrpo.trainer.batch import BatchTotals, MicroBatch, microbatch_weight

MEGATRON = ["megatron", "rlhf", "--rlhf_type", "grpo", "--tuner_type", "lora",
            "--train_iters", "5", "--beta", "0", "--max_completion_length", "12",
            "--epsilon", "0.2", "--epsilon_high", "0.3"]  # fmt: skip
SWIFT = ["swift", "rlhf", "--rlhf_type", "grpo", "--max_steps", "5", "--beta", "0",
         "--num_generations", "2",
         "--max_completion_length", "12", "--epsilon", "0.2", "--epsilon_high", "0.3"]  # fmt: skip
T = 12


class _StubPackage(types.ModuleType):
    __path__: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``mcore_bridge`` and its submodules as empty packages (import-time names only)."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "mcore_bridge" or fullname.startswith("mcore_bridge."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubPackage(spec.name)

    def exec_module(self, module):
        pass


pytestmark = pytest.mark.slow  # importing ms-swift's trainers (trl, vLLM, megatron-core):
# 15-60 s on 2 shared cores


@pytest.fixture(scope="module")
def swift_megatron():
    pytest.importorskip("swift")
    finder = _StubFinder() if importlib.util.find_spec("mcore_bridge") is None else None
    if finder is not None:
        sys.meta_path.insert(0, finder)
    try:
        from swift.megatron.trainers import grpo_trainer
    finally:
        if finder is not None:
            sys.meta_path.remove(finder)
    return grpo_trainer


@pytest.fixture(scope="module")
def swift_hf():
    pytest.importorskip("swift")
    from swift.rlhf_trainers import grpo_trainer

    return grpo_trainer


def _batches(ranks: int, micro: int, size: int, seed: int = 0, equal_tokens: bool = False):
    """``[rank][micro]`` dicts of logp (leaf) / old / adv / mask / truncated ``[size, T]``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ranks):
        row = []
        for _ in range(micro):
            if equal_tokens:
                lengths = torch.full((size,), 6)
            else:
                lengths = torch.randint(1, T + 1, (size,), generator=gen)
            mask = torch.arange(T)[None] < lengths[:, None]
            old = -torch.rand(size, T, generator=gen) * 3
            logp = (old + 0.4 * torch.randn(size, T, generator=gen)).requires_grad_()
            adv = torch.randn(size, 1, generator=gen).expand(size, T).contiguous()
            row.append({"logp": logp, "old": old, "adv": adv, "mask": mask,
                        "truncated": lengths >= T - 3})  # fmt: skip
        out.append(row)
    return out


def _leaves(data):
    return [mb["logp"] for row in data for mb in row]


def _megatron_total(module, loss_type, data, overlong=False, taus=(1.0, 1.05)):
    """ms-swift's Megatron loss over ``data`` ([rank][micro]): each rank's sum of
    ``loss_func`` / num_microbatches, averaged over ranks."""
    ranks, micro = len(data), len(data[0])
    tokens = sum(float(mb["mask"].sum()) for row in data for mb in row)  # the step's, all ranks
    ns = types.SimpleNamespace
    tr = module.MegatronGRPOTrainer.__new__(module.MegatronGRPOTrainer)
    tr.__dict__.update(
        loss_type=loss_type, micro_batch_size=data[0][0]["mask"].shape[0],
        disable_rollout_importance_sampling=True, rollout_importance_sampling_mode=None,
        log_rollout_offpolicy_metrics=False, beta=0.0, kl_in_reward=False,
        importance_sampling_level="token", _has_teacher=False, off_policy_sequence_mask_delta=None,
        epsilon_low=0.2, epsilon_high=0.3, max_completion_length=T, compute_entropy=False,
        _metrics=defaultdict(lambda: defaultdict(list)), unwrapped_models=[ns(training=True)],
        _step=1, steps_per_generation=1, num_generations=2,
        args=ns(overlong_filter=overlong, num_microbatches=micro, delta=None, report_to=[]),
        is_main_process=False, tau_pos=taus[0], tau_neg=taus[1],
    )  # fmt: skip
    tr._all_reduce_metric = lambda metric, *a, **k: metric
    tr._flush_log_completions = lambda: None
    saved = module.mpu, module.gather
    module.mpu = ns(get_data_parallel_world_size=lambda: ranks,
                    get_data_parallel_group=lambda **k: None)  # fmt: skip
    module.gather = lambda x, group=None: x
    try:
        total = 0.0
        for row in data:
            for mb in row:
                batch = module.GRPOBatch(
                    completion_mask=mb["mask"], truncated_mask=mb["truncated"],
                    seq_lengths=mb["mask"].sum(-1), old_per_token_logps=mb["old"],
                    advantages=mb["adv"], num_items_in_batch=torch.tensor(tokens),
                )  # fmt: skip
                loss, _ = tr.loss_func(mb["logp"], data={"grpo_batch": batch})
                total = total + loss / micro  # megatron-core: 2-tuple loss / num_microbatches
        return total / ranks  # DP gradient reduction: the mean over ranks
    finally:
        module.mpu, module.gather = saved


def _hf_total(module, loss_type, data, generations=1, taus=(1.0, 1.05)):
    """ms-swift's swift rlhf loss over ``data`` ([rank][micro-step]): each micro-step's
    ``_compute_loss_and_metrics`` / gradient-accumulation steps, summed, averaged over ranks;
    ``generations``: the micro-steps of a step come from this many generated batches
    (``num_items_in_batch`` is each generation's tokens, all ranks)."""
    ranks, micro = len(data), len(data[0])
    per_gen = micro // generations
    ns = types.SimpleNamespace
    tr = module.GRPOTrainer.__new__(module.GRPOTrainer)
    tr.__dict__.update(
        model=ns(training=True),
        args=ns(delta=None, log_entropy=False, top_entropy_quantile=1.0,
                gradient_accumulation_steps=micro),
        compute_entropy=False, overlong_filter=False, beta=0.0, kl_in_reward=False,
        rollout_importance_sampling_mode=None, log_rollout_offpolicy_metrics=False,
        disable_rollout_importance_sampling=True, importance_sampling_level="token",
        _has_teacher=False, off_policy_sequence_mask_delta=None, loss_type=loss_type,
        epsilon_low=0.2, epsilon_high=0.3, max_completion_length=T, chord_sft_iterator=None,
        sdar_loss_coef=0.0, model_accepts_loss_kwargs=False, compute_loss_func=None,
        current_gradient_accumulation_steps=micro,
        accelerator=ns(num_processes=ranks, gather_for_metrics=lambda x: x.reshape(-1)),
        tau_pos=taus[0], tau_neg=taus[1],
    )  # fmt: skip
    total = 0.0
    for row in data:
        for i, mb in enumerate(row):
            k = i // per_gen
            gen_tokens = sum(
                float(r[j]["mask"].sum())
                for r in data
                for j in range(k * per_gen, (k + 1) * per_gen)
            )
            tr._get_per_token_logps_and_entropies = lambda *a, _lp=mb["logp"], **kw: (_lp, None)
            batch = module.GRPOBatch(
                completion_mask=mb["mask"], truncated_mask=mb["truncated"],
                seq_lengths=mb["mask"].sum(-1), old_per_token_logps=mb["old"],
                advantages=mb["adv"], num_items_in_batch=torch.tensor(gen_tokens),
            )  # fmt: skip
            loss, _ = tr._compute_loss_and_metrics(None, {}, batch)
            total = total + loss / micro  # Trainer.training_step: loss / gradient accumulation
    return total / ranks


def _megagrpo_total(cfg, data, overlong=False):
    """megagrpo's loss over the same micro-batches: each rank's policy_loss x
    microbatch_weight against the step's totals / dp_size, averaged over ranks."""
    ranks = len(data)
    mbs = []
    for row in data:
        for mb in row:
            keep = mb["mask"] & ~(mb["truncated"][:, None] & overlong)
            shape = mb["mask"].shape
            z = torch.zeros(shape)
            mbs.append(
                MicroBatch(z.long(), z.long(), z.long(), keep.float(), z, z, list(range(shape[0])))
            )
    seqs = sum(mb["mask"].shape[0] for row in data for mb in row)
    nonempty = sum(int((mb["mask"].sum(-1) > 0).sum()) for row in data for mb in row)
    tokens = sum(float(mb["mask"].sum()) for row in data for mb in row)
    totals = BatchTotals(seqs=seqs / ranks, nonempty=nonempty / ranks, tokens=tokens / ranks)
    agg = cfg.resolved_loss_agg()
    total, k = 0.0, 0
    for row in data:
        for mb in row:
            keep = mbs[k].mask
            loss, _ = policy_loss(mb["logp"], mb["old"], mb["adv"], keep, cfg)
            total = total + loss * microbatch_weight(mbs[k], agg, totals)
            k += 1
    return total / ranks


def _cfg(tokens):
    flags, flavor, env = parse_tokens(tokens)
    t = translate(flags, flavor or "swift", 1, env=env)
    entry = next(e for e in t.entries if e.flag == "loss_type")
    return t, entry, to_config(t).loss


def _same(a, b, data):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    ga = torch.autograd.grad(a, _leaves(data), retain_graph=True)
    gb = torch.autograd.grad(b, _leaves(data), retain_graph=True)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_megatron_loss_types_over_microbatches_and_ranks(swift_megatron, loss_type):
    """megatron rlhf, 2 DP ranks x 3 micro-batches of 2: the translated loss (and its
    gradient) is ms-swift 4.6.0's, Megatron's / num_microbatches included."""
    _, entry, cfg = _cfg([*MEGATRON, "--loss_type", loss_type])
    assert entry.status == EXACT
    data = _batches(2, 3, 2, seed=1)
    _same(_megagrpo_total(cfg, data), _megatron_total(swift_megatron, loss_type, data), data)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_megatron_overlong_filter(swift_megatron, loss_type):
    """--overlong_filter true: truncated completions carry no loss, and still count in the
    normalisers (ms-swift masks inside loss_func, after num_items_in_batch was taken)."""
    t, _, cfg = _cfg([*MEGATRON, "--loss_type", loss_type, "--overlong_filter", "true"])
    assert cfg.overlong_filter
    data = _batches(2, 2, 3, seed=2)
    assert any(bool(mb["truncated"].any()) for row in data for mb in row)
    ours = _megagrpo_total(cfg, data, overlong=True)
    _same(ours, _megatron_total(swift_megatron, loss_type, data, overlong=True), data)


def test_swift_bnpo_is_a_per_microbatch_token_mean(swift_hf):
    """F2. swift rlhf's bnpo is a token mean per micro-batch, averaged: at
    per_device_train_batch_size 1 (2 ranks x 4 micro-steps of 1) that is grpo's sequence
    mean, translated exactly; at 2 it is neither, translated as a token mean and marked ~
    (cd819e6 marked both '=' and trained the whole step's token mean)."""
    _, entry, cfg = _cfg([*SWIFT, "--loss_type", "bnpo", "--gradient_accumulation_steps", "4"])
    assert entry.status == EXACT and cfg.loss_agg == "seq_mean_token_mean"
    data = _batches(2, 4, 1, seed=3)
    _same(_megagrpo_total(cfg, data), _hf_total(swift_hf, "bnpo", data), data)
    two = [*SWIFT, "--loss_type", "bnpo", "--per_device_train_batch_size", "2",
           "--gradient_accumulation_steps", "4"]  # fmt: skip
    _, entry, cfg = _cfg(two)
    assert entry.status == DIFFERS and "per micro-batch" in entry.note
    data = _batches(2, 4, 2, seed=4)
    diff = float(_megagrpo_total(cfg, data) - _hf_total(swift_hf, "bnpo", data))
    assert abs(diff) > 1e-3  # the difference the ~ states is real


def test_swift_dapo_scale_of_its_generation(swift_hf):
    """F4. swift rlhf's dapo divides by the tokens of the generated batch (the gradient
    accumulation division undone): exactly megagrpo's token mean when one generation is one
    optimizer step; with steps_per_generation 2 < gradient_accumulation_steps 4 (two
    generations per step) it is 2 x that, which the translation marks ~ with the factor
    (cd819e6 marked it '=')."""
    _, entry, cfg = _cfg([*SWIFT, "--loss_type", "dapo", "--gradient_accumulation_steps", "4"])
    assert entry.status == EXACT
    data = _batches(2, 4, 2, seed=5)
    _same(_megagrpo_total(cfg, data), _hf_total(swift_hf, "dapo", data), data)
    split = [*SWIFT, "--loss_type", "dapo", "--gradient_accumulation_steps", "4",
             "--steps_per_generation", "2"]  # fmt: skip
    _, entry, cfg = _cfg(split)
    assert entry.status == DIFFERS and "about 2 x" in entry.note
    data = _batches(2, 4, 2, seed=6, equal_tokens=True)
    ours, theirs = _megagrpo_total(cfg, data), _hf_total(swift_hf, "dapo", data, generations=2)
    torch.testing.assert_close(theirs, 2 * ours, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_swift_sequence_losses(swift_hf, loss_type):
    _, entry, cfg = _cfg([*SWIFT, "--loss_type", loss_type, "--gradient_accumulation_steps", "4"])
    assert entry.status == EXACT
    data = _batches(2, 4, 2, seed=7)
    _same(_megagrpo_total(cfg, data), _hf_total(swift_hf, loss_type, data), data)


def test_sapo_is_ms_swifts(swift_megatron, swift_hf):
    """--loss_type sapo --tau_pos/--tau_neg (refused at 776dce3): SAPO's soft gate against
    ms-swift's own loss code of both launchers, 2 ranks x several micro-batches, off-policy
    (old != logp), value and gradient."""
    taus = (0.8, 1.3)
    extra = ["--loss_type", "sapo", "--tau_pos", "0.8", "--tau_neg", "1.3"]
    _, entry, cfg = _cfg([*MEGATRON, *extra])
    assert entry.status == EXACT and (cfg.variant, cfg.sapo_tau_pos, cfg.sapo_tau_neg) == (
        "sapo", 0.8, 1.3)  # fmt: skip
    data = _batches(2, 3, 2, seed=8)
    want = _megatron_total(swift_megatron, "sapo", data, taus=taus)
    _same(_megagrpo_total(cfg, data), want, data)
    _, entry, cfg = _cfg([*SWIFT, *extra, "--gradient_accumulation_steps", "4"])
    assert entry.status == EXACT
    data = _batches(2, 4, 2, seed=9)
    _same(_megagrpo_total(cfg, data), _hf_total(swift_hf, "sapo", data, taus=taus), data)
