"""(d) What vLLM 0.33 does to megagrpo's adapter on an idle lock-stepped rank (W1).

A lock-stepped DP rank without requests runs ``execute_dummy_batch`` -> V2
``GPUModelRunner._dummy_run``, which wraps its forward in
``LoRAModelRunnerMixin.maybe_dummy_run_with_lora(lora_config, tokens, None,
remove_lora=True, num_active_loras=max_loras)``. Here that context runs on the real LoRA
manager of a vLLM 0.33 Qwen3-MoE (world 1, and each rank at EP 2 / EP 4) holding megagrpo's
synced adapter: upstream's own method (recorded: it puts an all-zero warm-up adapter, id 1,
in slot 0 and removes every adapter on exit) and the method as megagrpo's in-memory LoRA hook
leaves it (the served adapter stays registered and in its slot, the dummy tokens map to it,
nothing is removed).

Not run on CPU: the forward of the dummy batch, and the EP all-gather that carries the busy
ranks' tokens (with their slot indices) to the idle rank's experts;
tests/gpu/test_rollout_moe_lora_gpu.py compares one rank idle with both busy on 2 GPUs.
"""

from __future__ import annotations

from contract_checks import buffer_errors, ok


def test_megagrpo_ids_never_collide_with_warmup_ids(upstream):
    engine = ok(upstream["engine"])
    max_loras = engine["lora_config"]["max_loras"]
    assert engine["request_id"] > max_loras  # warm-up adapters are ids 1..max_loras
    assert engine["lora_config"]["max_cpu_loras"] >= 2  # old + new version during a switch


def test_upstream_dummy_run_evicts_the_adapter(upstream):
    """Documents the upstream behaviour megagrpo guards against (fails when vLLM changes it:
    then the guard may go)."""
    engine = ok(upstream["engine"])
    seen = ok(engine["dummy_upstream"])
    ours = engine["request_id"]
    assert seen["inside"]["slots"] != [ours]  # a warm-up adapter took the slot
    assert seen["token_mapping"] and ours not in seen["token_mapping"]
    assert ours not in seen["after"]["registered"]  # removed on exit


def test_idle_rank_keeps_the_adapter(upstream):
    """Fails on cd819e6 (W1): the dummy run swapped the adapter for zeros and removed it."""
    sent = ok(upstream["sent"])
    scale = sent["config"]["lora_alpha"] / sent["config"]["r"]
    engine = ok(upstream["engine"])
    ours = engine["request_id"]
    seen = ok(engine["dummy_megagrpo"])
    for when in ("inside", "after"):
        state = seen[when]
        assert state["slots"] == [ours] and ours in state["registered"], when
        assert buffer_errors(state["buffers"], sent["reference"], scale) == [], when
    assert seen["token_mapping"] and set(seen["token_mapping"]) == {ours}
    for ep, ranks in ok(upstream["ep"]).items():
        local = 8 // ep
        for rank, result in enumerate(ranks):
            seen = ok(ok(result)["dummy_megagrpo"])
            mine = list(range(rank * local, (rank + 1) * local))
            for when in ("inside", "after"):
                state = seen[when]
                assert state["slots"] == [ours], (ep, rank, when)
                errors = buffer_errors(state["buffers"], sent["reference"], scale, mine)
                assert errors == [], (ep, rank, when)
