"""Layout-free LoRA state (megagrpo.model.lora_state): save under one layout, load under
another, on gloo ranks with the real MegatronPolicy (tiny Qwen3-MoE, LoRA on every linear).

1. TP2xEP2 (4 ranks, SP) trains 2 AdamW steps and writes its pieces. The parameter units
   equal the PEFT view that ``gather_lora`` builds by zero-fill + all-reduce (an independent
   code path), bit for bit; every unit is covered exactly once.
2. Those pieces are loaded under EP2 (2 ranks), TP2 (2 ranks) and 1 rank into fresh policies
   and fresh AdamW optimisers, which write their pieces again: every unit of parameters and
   of both moments (and the step count) comes back bit for bit.
3. The moments equal a 1-process run's after the same two steps within float noise (256
   ulps of the values' scale: the TP/EP split reorders the fp32 reductions of the gradients).
"""

from __future__ import annotations

import pytest
import torch

from megagrpo.testing import assert_close_scaled

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _policy(hf_dir: str, layout: dict):
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, init_parallel

    g = init_parallel(ParallelConfig(**layout))
    lora = LoraConfig(rank=4, alpha=8.0, targets=TARGETS)
    return build_policy(ModelConfig(hf_path=hf_dir, lora=lora), g), g


def _adam_steps(policy, g, steps: int = 2) -> torch.optim.Optimizer:
    """AdamW steps on a fixed linear loss of the logits (the same loss in every layout)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 400, (2, 8), generator=gen)
    v = policy.arch.vocab_size
    w = torch.randn((2, 8, v), generator=torch.Generator().manual_seed(7))
    n = v // g.tp_size
    w_local = w[..., g.tp_rank * n : (g.tp_rank + 1) * n]
    opt = torch.optim.AdamW(policy.lora_parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        ((policy.forward_logits(ids) * w_local).sum() / 16).backward()
        policy.finish_grad_sync()
        opt.step()
    return opt


def _save_worker(rank: int, hf_dir: str, layout: dict) -> dict:
    from megagrpo.model.peft_export import gather_lora
    from megagrpo.parallel import destroy_parallel

    torch.set_num_threads(1)
    policy, g = _policy(hf_dir, layout)
    try:
        opt = _adam_steps(policy, g)
        return {"pieces": policy.lora_pieces(opt), "gathered": gather_lora(policy)}
    finally:
        destroy_parallel()


def _load_worker(rank: int, hf_dir: str, layouts: list[dict], pieces: list[dict]) -> list:
    from megagrpo.parallel import destroy_parallel

    torch.set_num_threads(1)
    out = []
    for i, layout in enumerate(layouts):
        policy, _ = _policy(hf_dir, layout)
        try:
            opt = torch.optim.AdamW(policy.lora_parameters(), lr=0.05)
            policy.load_lora_pieces(pieces, opt)
            out.append(policy.lora_pieces(opt))
        finally:
            destroy_parallel(keep_process_group=i < len(layouts) - 1)
    return out


def _units(pieces, hf_dir: str) -> dict:
    """Every (unit, what) -> full tensor, assembled from pieces."""
    from megagrpo.model.arch import arch_from_hf, load_hf_config
    from megagrpo.model.hf_mapping import hf_weight_shapes
    from megagrpo.model.lora_state import Units

    shapes = hf_weight_shapes(arch_from_hf(load_hf_config(hf_dir)))
    units = Units(pieces, shapes, 4)
    out = {}
    for name, factor in units.index:
        for what in ["param", *sorted(units.keys(name, factor))]:
            if what == "step":
                out[(name, factor, what)] = units.scalar(name, factor, what)
            else:
                out[(name, factor, what)] = units.get(name, factor, what)
    return out


@pytest.fixture(scope="module")
def saved(tiny_moe_dir):
    from megagrpo.parallel.launch import launch

    layout = dict(tp=2, ep=2, sequence_parallel=True)
    ranks = launch(_save_worker, 4, str(tiny_moe_dir), layout)
    pieces = [p for r in ranks for p in r["pieces"]]
    (one,) = launch(_save_worker, 1, str(tiny_moe_dir), {})
    return pieces, ranks[0]["gathered"], one["pieces"]


def test_pieces_are_the_peft_view_of_the_adapters(saved, tiny_moe_dir):
    from megagrpo.model.lora_state import a_unit_of

    pieces, gathered, _ = saved
    units = _units(pieces, str(tiny_moe_dir))
    assert len(gathered) > 10
    for name, (a, b) in gathered.items():
        assert torch.equal(units[(a_unit_of(name), "A", "param")], a), name
        assert torch.equal(units[(name, "B", "param")], b), name
        assert float(b.abs().max()) > 0  # trained: B moved off zero


@pytest.mark.parametrize(
    "world, layouts",
    [(2, [dict(ep=2), dict(tp=2, sequence_parallel=True)]), (1, [{}])],
    ids=["ep2+tp2", "one_rank"],
)
def test_resharded_state_round_trips_bit_for_bit(saved, tiny_moe_dir, world, layouts):
    from megagrpo.parallel.launch import launch

    pieces, _, _ = saved
    ref = _units(pieces, str(tiny_moe_dir))
    assert {k[2] for k in ref} == {"param", "exp_avg", "exp_avg_sq", "step"}
    ranks = launch(_load_worker, world, str(tiny_moe_dir), layouts, pieces)
    for i in range(len(layouts)):
        again = _units([p for r in ranks for p in r[i]], str(tiny_moe_dir))
        assert again.keys() == ref.keys()
        for key, value in ref.items():
            assert torch.equal(again[key], value), (layouts[i], key)


def test_moments_match_a_one_process_run(saved, tiny_moe_dir):
    pieces, _, one = saved
    four, single = _units(pieces, str(tiny_moe_dir)), _units(one, str(tiny_moe_dir))
    assert four.keys() == single.keys()
    for key, value in single.items():
        if key[2] == "step":
            assert float(four[key]) == float(value) == 2.0
        else:
            assert_close_scaled(four[key], value, ulps=256, what=str(key))
