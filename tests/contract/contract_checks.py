"""Assertions of the contract tests: what vLLM 0.33's LoRA buffers must hold, computed from the
trainer's own LoRA factors (``gather_lora``: HF names, ``A [r, in]``, ``B [out, r]``)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

NUM_EXPERTS = 8
"""The contract model's experts: 8, so EP 2 and EP 4 keep 4 and 2 experts per rank."""
QKV = ("q_proj", "k_proj", "v_proj")
EXPERT_SLICES = {
    # vLLM's 2D MoE LoRA buffers: w13 slice 0 = w1 = gate_proj, slice 1 = w3 = up_proj
    ("w13_lora_a_stacked", 0): ("gate_proj", "A"),
    ("w13_lora_a_stacked", 1): ("up_proj", "A"),
    ("w13_lora_b_stacked", 0): ("gate_proj", "B"),
    ("w13_lora_b_stacked", 1): ("up_proj", "B"),
    ("w2_lora_a_stacked", 0): ("down_proj", "A"),
    ("w2_lora_b_stacked", 0): ("down_proj", "B"),
}


def ok(result: dict[str, Any]) -> Any:
    """The value of a probe's outcome; fails the test with upstream's traceback otherwise."""
    if not result.get("ok"):
        pytest.fail("upstream raised:\n" + str(result.get("error")), pytrace=False)
    return result["value"]


def _factor(reference: dict, name: str, which: str, scale: float) -> torch.Tensor:
    a, b = reference[f"{name}.weight"]
    return a.float() if which == "A" else scale * b.float()


def _same(got: torch.Tensor, want: torch.Tensor, what: str, errors: list[str]) -> None:
    """``got`` (a max-rank buffer) holds ``want`` in its corner and zeros elsewhere."""
    corner = got[tuple(slice(0, n) for n in want.shape)]
    if corner.shape != want.shape or not torch.allclose(corner.float(), want, atol=1e-6):
        errors.append(f"{what}: buffer differs from the trainer's factor")
        return
    rest = got.float().clone()
    rest[tuple(slice(0, n) for n in want.shape)] = 0
    if rest.abs().max() > 0:
        errors.append(f"{what}: nonzero outside the adapter's rank")


def buffer_errors(
    buffers: dict[str, dict[str, list[torch.Tensor]]],
    reference: dict,
    scale: float,
    experts: list[int] | None = None,
    tp: tuple[int, int] = (0, 1),
) -> list[str]:
    """Every mismatch between vLLM's stacked LoRA buffers of one slot (``Engine.state``) and
    the trainer's factors: attention (``qkv_proj`` = q | k | v slices, ``o_proj``) and the
    experts ``experts`` (this rank's global expert ids in local order; None: all). B is
    compared scaled by alpha / r (vLLM folds the scale into B when it loads an adapter).
    At TP rank ``tp = (rank, size)``: q's B rows and o_proj's A columns by rank (vLLM's
    column / row parallel LoRA), k / v's B rows by rank unless the KV head is replicated
    (fewer KV heads than TP ranks: the whole B)."""
    errors: list[str] = []
    seen_experts = False
    for module, fields in buffers.items():
        m = re.fullmatch(
            r"(model\.layers\.\d+)\.(self_attn\.qkv_proj|self_attn\.o_proj|mlp\.experts)", module
        )
        if m is None:  # router, embeddings, lm_head: not targeted, must stay zero
            for f, tensors in fields.items():
                if any(t.abs().max() > 0 for t in tensors):
                    errors.append(f"{module}.{f}: not targeted but nonzero")
            continue
        layer, kind = m.groups()
        if kind == "self_attn.qkv_proj":
            for i, proj in enumerate(QKV):
                name = f"{layer}.self_attn.{proj}"
                _same(
                    fields["lora_a_stacked"][i][0],
                    _factor(reference, name, "A", 1),
                    f"{name} A",
                    errors,
                )
                b = fields["lora_b_stacked"][i][0]
                want = _factor(reference, name, "B", scale)
                replicated = proj != "q_proj" and b.shape[-2] == want.shape[-2]
                if tp[1] > 1 and not replicated:
                    want = _rows(want, tp[1], tp[0])
                _same(b, want, f"{name} B", errors)
        elif kind == "self_attn.o_proj":
            name = f"{layer}.self_attn.o_proj"
            want = _factor(reference, name, "A", 1)
            if tp[1] > 1:
                want = _rows(want, tp[1], tp[0], dim=1)
            _same(fields["lora_a_stacked"][0][0], want, f"{name} A", errors)
            _same(
                fields["lora_b_stacked"][0][0],
                _factor(reference, name, "B", scale),
                f"{name} B",
                errors,
            )
        else:
            seen_experts = True
            local = fields["w13_lora_a_stacked"][0].shape[0]
            ids = list(range(local)) if experts is None else experts
            if len(ids) != local:
                errors.append(f"{module}: {local} local expert buffers, expected {len(ids)}")
                continue
            for (field, i), (proj, which) in EXPERT_SLICES.items():
                for j, e in enumerate(ids):
                    name = f"{layer}.mlp.experts.{e}.{proj}"
                    want = _factor(reference, name, which, scale if which == "B" else 1)
                    _same(fields[field][i][j], want, f"{name} {which} (local {j})", errors)
    if not seen_experts:
        errors.append("no MoE LoRA buffers (FusedMoEWithLoRA) in the engine")
    return errors


def checkpoint(model_dir) -> dict[str, torch.Tensor]:
    """The HF checkpoint's tensors (the reference every engine tensor is judged against)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _rows(t: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[rank]


def expected_engine_tensor(
    name: str, ckpt: dict[str, torch.Tensor], tp: tuple[int, int], ep: tuple[int, int]
) -> torch.Tensor | None:
    """What vLLM's Qwen3-MoE parameter ``name`` (LoRA's ``.base_layer`` removed) must hold on
    TP rank ``tp = (rank, size)`` (expert parallelism ``ep = (rank, size)``: whole experts, the
    rank's block), computed from the checkpoint alone: q rows by rank, the KV head replicated when
    ``tp`` exceeds ``kv_heads``, o_proj columns by rank, vocab rows by rank, experts fused as
    ``w13 = [gate; up]``; None for a name this reference does not know."""
    name = name.replace(".base_layer.", ".")
    rank, size = tp
    kv_heads = 1  # the contract model's
    m = re.fullmatch(r"(model\.layers\.\d+)\.(.+)", name)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _rows(ckpt[name], size, rank)
    if name == "model.norm.weight":
        return ckpt[name]
    if m is None:
        return None
    layer, rest = m.groups()
    if rest == "self_attn.qkv_proj.weight":
        q = _rows(ckpt[f"{layer}.self_attn.q_proj.weight"], size, rank)
        kv_rank, kv_tp = (0, 1) if size > kv_heads else (rank, size)
        k = _rows(ckpt[f"{layer}.self_attn.k_proj.weight"], kv_tp, kv_rank)
        v = _rows(ckpt[f"{layer}.self_attn.v_proj.weight"], kv_tp, kv_rank)
        return torch.cat([q, k, v])
    if rest == "self_attn.o_proj.weight":
        return _rows(ckpt[f"{layer}.self_attn.o_proj.weight"], size, rank, dim=1)
    e = re.fullmatch(r"mlp\.experts\.(?:routed_experts\.)?(w13|w2)_weight", rest)
    if e is not None:
        local = NUM_EXPERTS // ep[1]
        block = range(ep[0] * local, (ep[0] + 1) * local)
        ex = f"{layer}.mlp.experts"
        if e.group(1) == "w2":
            return torch.stack([ckpt[f"{ex}.{g}.down_proj.weight"] for g in block])
        return torch.stack(
            [
                torch.cat([ckpt[f"{ex}.{g}.gate_proj.weight"], ckpt[f"{ex}.{g}.up_proj.weight"]])
                for g in block
            ]
        )
    if f"{layer}.{rest}" in ckpt:  # router, norms: whole on every rank
        return ckpt[f"{layer}.{rest}"]
    return None


def engine_errors(
    tensors: dict[str, torch.Tensor], ckpt: dict, tp: tuple[int, int], ep: tuple[int, int]
) -> list[str]:
    """Every engine parameter that differs from :func:`expected_engine_tensor` (exactly:
    float32 engine, float32 checkpoint, nothing computed on the way)."""
    errors = []
    for name, got in tensors.items():
        want = expected_engine_tensor(name, ckpt, tp, ep)
        if want is None:
            errors.append(f"{name}: no reference")
        elif got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
            diff = (got.float() - want.float()).abs().max() if got.shape == want.shape else "-"
            errors.append(f"{name}: differs from the checkpoint (max |diff| {diff})")
    return errors
