"""HF ⇄ Megatron weight mapping for both layer specs, as per-rank *placement plans*.

A plan maps each HF tensor name to the pieces of it this rank holds: ``Piece(param, dst,
src)`` says ``megatron_param[dst] == hf_tensor[src]``. Import streams safetensors and copies
only those slices (nothing else is read); export writes the pieces into a zero HF tensor and
sums it over the group holding one full copy (``mp`` = TP x PP, ``expert_mp`` = ETP x EP x
PP): every element has exactly one owner, so the sum is an exact gather.

Megatron names differ by spec; both are covered here:

HF (``model.layers.i.``) -> local spec (``decoder.layers.l.``) | Transformer Engine spec:

- input_layernorm.weight -> input_layernorm.weight
  | TE: self_attention.linear_qkv.layer_norm_weight
- self_attn.{q,k,v}_proj -> self_attention.linear_qkv.weight, per query group
  cat(q_g, k_g, v_g) | TE: same
- self_attn.o_proj -> self_attention.linear_proj.weight | TE: same
- self_attn.{q,k}_norm -> self_attention.{q,k}_layernorm.weight | TE: same
- post_attention_layernorm -> pre_mlp_layernorm.weight
  | TE: MoE same; dense mlp.linear_fc1.layer_norm_weight
- mlp.{gate,up}_proj -> mlp.linear_fc1.weight = cat(gate, up) | TE: same
- mlp.down_proj -> mlp.linear_fc2.weight | TE: same
- mlp.gate (router) -> mlp.router.weight | TE: same
- mlp.experts.e.{gate,up} -> mlp.experts.local_experts.j.linear_fc1
  | TE grouped: mlp.experts.linear_fc1.weight{j}
- mlp.experts.e.down_proj -> mlp.experts.local_experts.j.linear_fc2
  | TE grouped: mlp.experts.linear_fc2.weight{j}

plus ``model.embed_tokens`` → ``embedding.word_embeddings``, ``model.norm`` →
``decoder.final_layernorm``, ``lm_head`` → ``output_layer`` (absent when tied: the last stage
then holds a non-owning copy of the embedding). Local expert ``j`` on EP rank ``r`` is global
expert ``r * E / ep + j``; ``l`` is the layer index inside this pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from megagrpo.model.arch import Arch
from megagrpo.parallel.state import ParallelGroups

ALL = slice(None)


@dataclass(frozen=True)
class Piece:
    """``megatron_param[dst] == hf_tensor[src]``; ``owner`` marks the copy that export uses."""

    param: str
    dst: tuple
    src: tuple
    owner: bool = True
    expert: bool = False


def hf_weight_shapes(a: Arch) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the model (global names, full shapes), in checkpoint order."""
    h, hd = a.hidden_size, a.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, h)}
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (a.num_heads * hd, h)
        out[p + "self_attn.k_proj.weight"] = (a.num_kv_heads * hd, h)
        out[p + "self_attn.v_proj.weight"] = (a.num_kv_heads * hd, h)
        if a.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (a.num_heads * hd,)
            out[p + "self_attn.k_proj.bias"] = (a.num_kv_heads * hd,)
            out[p + "self_attn.v_proj.bias"] = (a.num_kv_heads * hd,)
        out[p + "self_attn.o_proj.weight"] = (h, a.num_heads * hd)
        if a.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if a.moe_layers and a.moe_layers[i]:
            f = a.moe_ffn_hidden_size
            out[p + "mlp.gate.weight"] = (a.num_experts, h)
            for e in range(a.num_experts):
                q = f"{p}mlp.experts.{e}."
                out[q + "gate_proj.weight"] = (f, h)
                out[q + "up_proj.weight"] = (f, h)
                out[q + "down_proj.weight"] = (h, f)
        else:
            f = a.ffn_hidden_size
            out[p + "mlp.gate_proj.weight"] = (f, h)
            out[p + "mlp.up_proj.weight"] = (f, h)
            out[p + "mlp.down_proj.weight"] = (h, f)
    out["model.norm.weight"] = (h,)
    if not a.tie_word_embeddings:
        out["lm_head.weight"] = (a.vocab_size, h)
    return out


def _rows(start: int, stop: int) -> tuple:
    return (slice(start, stop),)


class _Planner:
    def __init__(self, a: Arch, g: ParallelGroups, spec: str, grouped: bool):
        self.a, self.g, self.spec, self.grouped = a, g, spec, grouped
        self.plan: dict[str, list[Piece]] = {}
        self.rep_owner = g.tp_rank == 0  # TP-replicated tensors: one owner per MP group

    def add(self, hf: str, piece: Piece) -> None:
        self.plan.setdefault(hf, []).append(piece)

    def col(self, hf, param, size, rank, tp, dst_off=0, expert=False):
        """Column-parallel: rows [rank*size/tp, ...) of ``hf`` → rows [dst_off, ...)."""
        n = size // tp
        self.add(
            hf,
            Piece(
                param, _rows(dst_off, dst_off + n), _rows(rank * n, (rank + 1) * n), expert=expert
            ),
        )

    def row(self, hf, param, size, rank, tp, expert=False):
        n = size // tp
        self.add(
            hf,
            Piece(param, (ALL, slice(0, n)), (ALL, slice(rank * n, (rank + 1) * n)), expert=expert),
        )

    def rep(self, hf, param, owner=None):
        self.add(hf, Piece(param, (ALL,), (ALL,), self.rep_owner if owner is None else owner))

    def qkv(self, p: str, m: str, suffix: str) -> None:
        a, g = self.a, self.g
        hd, qpg = a.head_dim, a.heads_per_group
        per = (qpg + 2) * hd
        groups_local = a.num_kv_heads // g.tp_size
        for j in range(groups_local):
            grp = g.tp_rank * groups_local + j
            base = j * per
            self.add(
                f"{p}self_attn.q_proj.{suffix}",
                Piece(
                    f"{m}self_attention.linear_qkv.{suffix}",
                    _rows(base, base + qpg * hd),
                    _rows(grp * qpg * hd, (grp + 1) * qpg * hd),
                ),
            )
            for k, name in ((0, "k_proj"), (1, "v_proj")):
                lo = base + (qpg + k) * hd
                self.add(
                    f"{p}self_attn.{name}.{suffix}",
                    Piece(
                        f"{m}self_attention.linear_qkv.{suffix}",
                        _rows(lo, lo + hd),
                        _rows(grp * hd, (grp + 1) * hd),
                    ),
                )

    def layer(self, i: int, local: int) -> None:
        a, g, te = self.a, self.g, self.spec == "te"
        p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        moe = bool(a.moe_layers and a.moe_layers[i])
        self.rep(
            p + "input_layernorm.weight",
            m + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"),
        )
        self.qkv(p, m, "weight")
        if a.qkv_bias:
            self.qkv(p, m, "bias")
        self.row(
            p + "self_attn.o_proj.weight",
            m + "self_attention.linear_proj.weight",
            a.num_heads * a.head_dim,
            g.tp_rank,
            g.tp_size,
        )
        if a.qk_norm:
            self.rep(p + "self_attn.q_norm.weight", m + "self_attention.q_layernorm.weight")
            self.rep(p + "self_attn.k_norm.weight", m + "self_attention.k_layernorm.weight")
        self.rep(
            p + "post_attention_layernorm.weight",
            m
            + (
                "mlp.linear_fc1.layer_norm_weight" if te and not moe else "pre_mlp_layernorm.weight"
            ),
        )
        if moe:
            self.rep(p + "mlp.gate.weight", m + "mlp.router.weight")
            self.experts(p, m)
        else:
            f = a.ffn_hidden_size
            fc1 = m + "mlp.linear_fc1.weight"
            self.col(p + "mlp.gate_proj.weight", fc1, f, g.tp_rank, g.tp_size)
            self.col(p + "mlp.up_proj.weight", fc1, f, g.tp_rank, g.tp_size, f // g.tp_size)
            self.row(
                p + "mlp.down_proj.weight", m + "mlp.linear_fc2.weight", f, g.tp_rank, g.tp_size
            )

    def experts(self, p: str, m: str) -> None:
        a, g = self.a, self.g
        f, n_local = a.moe_ffn_hidden_size, a.num_experts // g.ep_size
        for j in range(n_local):
            e = g.ep_rank * n_local + j
            if self.grouped:
                fc1, fc2 = (
                    f"{m}mlp.experts.linear_fc1.weight{j}",
                    f"{m}mlp.experts.linear_fc2.weight{j}",
                )
            else:
                q = f"{m}mlp.experts.local_experts.{j}."
                fc1, fc2 = q + "linear_fc1.weight", q + "linear_fc2.weight"
            h = f"{p}mlp.experts.{e}."
            self.col(h + "gate_proj.weight", fc1, f, g.etp_rank, g.etp_size, expert=True)
            self.col(
                h + "up_proj.weight", fc1, f, g.etp_rank, g.etp_size, f // g.etp_size, expert=True
            )
            self.row(h + "down_proj.weight", fc2, f, g.etp_rank, g.etp_size, expert=True)

    def build(self) -> dict[str, list[Piece]]:
        a, g = self.a, self.g
        offset, per_stage = g.layer_span(a.num_layers)
        v = a.vocab_size
        if g.is_first_stage:
            self.col(
                "model.embed_tokens.weight",
                "embedding.word_embeddings.weight",
                v,
                g.tp_rank,
                g.tp_size,
            )
        for local in range(per_stage):
            self.layer(offset + local, local)
        if g.is_last_stage:
            self.rep("model.norm.weight", "decoder.final_layernorm.weight")
            if not a.tie_word_embeddings:
                self.col("lm_head.weight", "output_layer.weight", v, g.tp_rank, g.tp_size)
            elif not g.is_first_stage:  # tied, PP>1: last stage keeps a copy of the embedding
                n = v // g.tp_size
                self.add(
                    "model.embed_tokens.weight",
                    Piece(
                        "output_layer.weight",
                        _rows(0, n),
                        _rows(g.tp_rank * n, (g.tp_rank + 1) * n),
                        owner=False,
                    ),
                )
        return self.plan


def build_plan(
    a: Arch, groups: ParallelGroups, spec: str = "local", grouped_experts: bool = False
) -> dict[str, list[Piece]]:
    """This rank's placement plan: HF name → pieces held here (see module docstring)."""
    return _Planner(a, groups, spec, grouped_experts).build()
