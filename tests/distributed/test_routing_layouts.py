"""MoE routing replay (issue 16) under gloo layouts: TP2 with sequence parallelism (each rank
routes its chunk of the padded sequence) and EP2 give what one process gives, with the
router perturbed between generation and training (see tests/unit/test_routing_replay.py):
r3 log-probs equal the HF engine's, the own routing's equal world 1's, agreement counts
and router gradients (summed over the SP ranks) equal world 1's."""

from __future__ import annotations

import pytest
import torch
from routing_verify import (
    replay_worker,
    router_inputs,
    selection_preserving_perturbation,
)

from megagrpo.rollout.base import SamplingSpec
from megagrpo.rollout.config import RolloutConfig
from megagrpo.testing import TINY_PROBLEMS, scaled_tol
from megagrpo.trainer.batch import build_samples, micro_batches

pytestmark = pytest.mark.distributed

ULPS = 256  # another layout of the same fp32 math (testing.scaled_tol)
LAYOUTS = {"tp2": dict(tp=2, sequence_parallel=True), "ep2": dict(ep=2)}


@pytest.fixture(scope="module")
def job(tiny_moe_dir):
    from megagrpo.rollout.hf_engine import HFEngine

    engine = HFEngine(RolloutConfig(engine="hf", max_tokens=7, max_model_len=256), tiny_moe_dir)
    for max_tokens in (6, 7):  # an odd length, so sequence parallelism pads
        spec = SamplingSpec(seed=3, max_tokens=max_tokens)
        groups = engine.generate([TINY_PROBLEMS[1]], 3, spec)
        mb = next(micro_batches(build_samples(groups, torch.zeros(1, 3)), 8))
        if mb.input_ids.shape[1] % 2:
            break
    assert mb.input_ids.shape[1] % 2
    assert mb.routing is not None and mb.routing_valid is not None
    valid = mb.routing_valid.reshape(-1)
    perturbation = {}
    for layer, (h, _) in router_inputs(engine.model, mb.input_ids).items():
        selected = mb.routing[:, :, layer].reshape(h.shape[0], -1).long()
        logits = h @ engine.model.model.layers[layer].mlp.gate.weight.T
        perturbation[layer] = selection_preserving_perturbation(
            h, selected, valid, logits.shape[1], 3.0 * logits.std().item(), seed=layer
        )
    batch = dict(
        input_ids=mb.input_ids,
        target_ids=mb.target_ids,
        mask=mb.mask,
        routing=mb.routing,
        valid=mb.routing_valid,
    )
    return dict(
        hf_dir=str(tiny_moe_dir),
        perturbation=perturbation,
        mb=batch,
        engine_logprobs=mb.rollout_logprobs.double(),
    )


@pytest.fixture(scope="module")
def runs(job):
    from megagrpo.parallel.launch import launch

    work = {k: v for k, v in job.items() if k != "engine_logprobs"}
    out = replay_worker(0, dict(work, layouts={"w1": {}}))
    assert out is not None
    reports = launch(replay_worker, 2, dict(work, layouts=LAYOUTS))[0]
    return out | reports


@pytest.mark.parametrize("name", ["w1", *LAYOUTS])
def test_layout_replays_like_one_process(runs, job, name):
    r, w1 = runs[name], runs["w1"]
    m = job["mb"]["mask"].bool()
    ref = job["engine_logprobs"]
    tol = scaled_tol(ref[m], ULPS, torch.float32)
    assert (r["r3"] - ref)[m].abs().max() <= tol  # the engine's, router perturbed
    assert (r["off"] - w1["off"])[m].abs().max() <= tol  # own routing: world 1's
    assert (w1["off"] - ref)[m].abs().max() > 1000 * tol  # ... which is far from the engine
    for mode in ("r3", "off"):
        agree, total = r[f"{mode}_counts"]
        assert total == w1[f"{mode}_counts"][1] == int(job["mb"]["valid"].sum()) * 2
        assert abs(agree - w1[f"{mode}_counts"][0]) <= 1  # a near tie may flip one set
        assert agree / total < 0.6
    for layer, g in w1["router_grads"].items():
        assert g.abs().max() > 1e-3
        assert (r["router_grads"][layer] - g).abs().max() <= scaled_tol(g, ULPS), layer
