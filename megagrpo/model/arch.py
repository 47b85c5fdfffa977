"""HF ``config.json`` → a normalised architecture description, and closed-form param counts.

Supported families (one provider): Qwen3-MoE (``qwen3_moe``), Qwen3 (``qwen3``), Qwen2
(``qwen2``: qkv bias), Llama/SmolLM2 (``llama``, tied embeddings allowed), Mistral-style
dense models without sliding windows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagrpo.errors import ConfigError

SUPPORTED = ("qwen3_moe", "qwen3", "qwen2", "llama", "mistral")


@dataclass
class Arch:
    """Architecture facts the provider, the weight mapping and the counts need."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[bool] = field(default_factory=list)
    """Per layer: True when the layer's MLP is a MoE block."""
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def load_hf_config(path: str | Path) -> dict:
    """Read ``config.json`` from a model directory (or the file itself) as a dict."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(f"HF config not found: {f}")
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, too deep, a huge int
        raise ConfigError(f"{f}: invalid JSON: {str(exc)[:200]}") from None


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if kind not in (None, "default"):
        raise ConfigError(
            f"config key 'rope_scaling': rope type {kind!r} is not supported (only plain RoPE)"
        )
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def arch_from_hf(cfg: dict | Any) -> Arch:
    """Normalise an HF config (dict or PretrainedConfig). Raises ConfigError naming the key."""
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict()
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise ConfigError(
            f"config key 'model_type': {mt!r} is not supported ({', '.join(SUPPORTED)})"
        )
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(cfg.get(key), int):
            raise ConfigError(f"config key '{key}': missing or not an integer")
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        raise ConfigError(f"config key 'num_key_value_heads': {kv} does not divide {heads}")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window"):
        raise ConfigError(
            "config key 'use_sliding_window': sliding-window attention is not supported"
        )
    n = cfg["num_hidden_layers"]
    experts = (
        int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if mt == "qwen3_moe" else 0
    )
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_mlp = set(cfg.get("mlp_only_layers") or [])
    moe_layers = [bool(experts) and i not in only_mlp and (i + 1) % step == 0 for i in range(n)]
    return Arch(
        model_type=mt,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        ffn_hidden_size=int(cfg.get("intermediate_size") or 0),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        qkv_bias=bool(cfg.get("attention_bias", mt == "qwen2")),
        num_experts=experts,
        moe_topk=int(cfg.get("num_experts_per_tok") or 0),
        moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_layers=moe_layers,
        raw=cfg,
    )


def param_counts(a: Arch) -> dict[str, int]:
    """Closed-form parameter counts from the HF config: ``total`` and ``active`` (per token:
    top-k experts instead of all), plus ``embedding`` (embedding + untied head)."""
    h, hd = a.hidden_size, a.head_dim
    attn = h * hd * (a.num_heads + 2 * a.num_kv_heads) + a.num_heads * hd * h
    if a.qkv_bias:
        attn += hd * (a.num_heads + 2 * a.num_kv_heads)
    if a.qk_norm:
        attn += 2 * hd
    norms = 2 * h
    dense_mlp = 3 * h * a.ffn_hidden_size
    expert = 3 * h * a.moe_ffn_hidden_size
    total = active = 0
    for moe in a.moe_layers or [False] * a.num_layers:
        base = attn + norms
        if moe:
            router = a.num_experts * h
            total += base + router + a.num_experts * expert
            active += base + router + a.moe_topk * expert
        else:
            total += base + dense_mlp
            active += base + dense_mlp
    emb = a.vocab_size * h * (1 if a.tie_word_embeddings else 2)
    total += emb + h
    active += emb + h
    return {"total": total, "active": active, "embedding": emb}
