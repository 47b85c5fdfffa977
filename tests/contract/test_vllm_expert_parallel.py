"""(b) Expert slicing at EP 2 and EP 4 by vLLM 0.33.0's own code.

Each rank is a forked gloo process of one lock-stepped engine (``data_parallel_size`` N,
``enable_expert_parallel``, ``external_launcher``; the keywords megagrpo's
``engine_kwargs`` passes) with a real ``Qwen3MoeForCausalLM`` of 8 experts and its real LoRA
manager: ``FusedMoEParallelConfig.make`` and ``determine_expert_map`` place the experts,
``moe_ep_load_spec`` drives the read-time filter (``_is_remote_expert_key``),
``_restrict_to_local_experts`` and ``_slice_moe_lora_ep`` cut the packed tensors. The whole
synced adapter is loaded (what vLLM does with everything), and the subset megagrpo sends
this rank (``vllm_lora.expert_block`` + ``local_tensors``: P1, no rank receives the whole
adapter); both must leave exactly this rank's experts, equal to the trainer's factors.

Not run on CPU: the all-gather dispatch between EP ranks (``naive_dp_ep``) and the MoE-LoRA
kernels; tests/gpu/test_rollout_moe_lora_gpu.py runs DP2 x EP2 on two GPUs.
"""

from __future__ import annotations

import pytest
from contract_checks import NUM_EXPERTS, buffer_errors, ok


@pytest.mark.parametrize("ep", [2, 4])
def test_each_rank_keeps_exactly_its_experts(upstream, ep):
    sent = ok(upstream["sent"])
    scale = sent["config"]["lora_alpha"] / sent["config"]["r"]
    ranks = ok(upstream["ep"])[ep]
    assert len(ranks) == ep
    local = NUM_EXPERTS // ep
    for rank, result in enumerate(ranks):
        got = ok(result)
        mine = list(range(rank * local, (rank + 1) * local))
        full = ok(got["full"])
        for facts in full["experts"].values():  # upstream's placement of this rank
            assert (facts["ep_rank"], facts["local"], facts["global"]) == (rank, local, 8)
            assert facts["use_ep"] and facts["ep_size"] == ep and not facts["sequence_parallel"]
            placed = [e for e in range(8) if int(facts["expert_map"][e]) >= 0]
            assert placed == mine
        assert full["spec"] == {
            "ep_rank": rank,
            "local_num_experts": local,
            "global_num_experts": NUM_EXPERTS,
        }
        # the host copy vLLM keeps holds only this rank's experts
        assert full["cached"]["model.layers.0.mlp.experts"][0][0] == local
        assert buffer_errors(full["buffers"], sent["reference"], scale, mine) == []


@pytest.mark.parametrize("ep", [2, 4])
def test_megagrpo_sends_each_rank_only_its_experts(upstream, ep):
    """P1: megagrpo's per-rank subset holds every attention factor and only this rank's
    experts, and vLLM serves it exactly as it serves the whole adapter."""
    from megagrpo.rollout.lora import expert_of

    sent = ok(upstream["sent"])
    ranks = ok(upstream["ep"])[ep]
    local = NUM_EXPERTS // ep
    for rank, result in enumerate(ranks):
        got = ok(result)
        names = got["subset_names"]
        assert names is not None, "megagrpo has no per-rank expert filter"
        experts = {expert_of(n) for n in names} - {None}
        assert experts == set(range(rank * local, (rank + 1) * local))
        dense = {n for n in sent["tensors"] if expert_of(n) is None}
        assert dense <= set(names)
        whole, subset = ok(got["full"])["buffers"], ok(got["subset"])["buffers"]
        for module, fields in whole.items():
            for field, tensors in fields.items():
                for a, b in zip(tensors, subset[module][field], strict=True):
                    assert a.equal(b), f"rank {rank} {module}.{field}"
