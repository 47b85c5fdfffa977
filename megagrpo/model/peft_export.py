"""Gather LoRA shards into HF-named full factors and write a PEFT adapter.

Megatron fuses q/k/v (per query group) and gate/up; LoRA on a fused linear has one A and a
fused B, so the HF adapter gets, per projection, the same A and its rows of B (exact:
``B A`` restricted to those rows). Experts are written in one of two layouts:

* ``fused`` (default; what peft >= 0.17 loads onto transformers 5's fused expert tensors,
  via ``target_parameters``): per layer ``mlp.experts.base_layer.lora_{A,B}`` for
  ``gate_up_proj`` and ``mlp.experts.lora_{A,B}`` for ``down_proj``; A is [E*r, in] (expert
  e in rows e*r..), B is [out, r*E] viewed as [out, r, E].
* ``per_expert``: ``mlp.experts.{e}.{gate,up,down}_proj.lora_{A,B}`` (vLLM's MoE LoRA keys).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo import fileio
from megagrpo.errors import ConfigError
from megagrpo.model.config import LoraConfig
from megagrpo.model.hf_mapping import hf_weight_shapes

_TARGET = [
    (re.compile(r"\.self_attn\.[qkv]_proj\.weight$"), "linear_qkv", "column"),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), "linear_proj", "row"),
    (re.compile(r"\.mlp\.(gate|up)_proj\.weight$"), "linear_fc1", "column"),
    (re.compile(r"\.mlp\.down_proj\.weight$"), "linear_fc2", "row"),
    (re.compile(r"\.mlp\.experts\.\d+\.(gate|up)_proj\.weight$"), "expert_linear_fc1", "column"),
    (re.compile(r"\.mlp\.experts\.\d+\.down_proj\.weight$"), "expert_linear_fc2", "row"),
]


def lora_target(hf_name: str, targets: list[str]) -> tuple[str, bool] | None:
    """``(kind, is_expert)`` when the HF weight ``hf_name`` carries LoRA under ``targets``."""
    for pat, target, kind in _TARGET:
        if pat.search(hf_name):
            expert = target.startswith("expert_")
            on = target in targets or (expert and target[len("expert_") :] in targets)
            return (kind, expert) if on else None
    return None


def _adapter_for(policy, param: str):
    mod, _, leaf = param.rpartition(".")
    adapter = policy.adapters[mod]
    j = re.fullmatch(r"weight(\d+)", leaf)
    if adapter.num_experts:
        if j is None:
            raise KeyError(f"{param}: a grouped-expert adapter needs a weight<i> parameter")
        k = int(j.group(1))
        return adapter.lora_A[k], adapter.lora_B[k], adapter.lora_A, adapter.lora_B
    return adapter.lora_A, adapter.lora_B, adapter.lora_A, adapter.lora_B


def gather_lora(policy, use_grad: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{hf_weight_name: (A [r, in], B [out, r])}`` full fp32 factors (or their gradients
    with ``use_grad``), identical on every rank; collective over all ranks. The scale
    ``alpha / r`` is not folded in."""
    g, lc = policy.groups, policy.cfg.lora
    out = {}
    for name, shape in hf_weight_shapes(policy.arch).items():
        hit = lora_target(name, lc.targets)
        if hit is None:
            continue
        kind, expert = hit
        a = torch.zeros(lc.rank, shape[1], device=g.device)  # collectives need NCCL's device
        b = torch.zeros(shape[0], lc.rank, device=g.device)
        lead = (g.etp_rank if expert else g.tp_rank) == 0  # owns the TP-replicated factor
        for p in policy.plan.get(name, []):
            if not p.owner:
                continue
            la, lb, pa, pb = _adapter_for(policy, p.param)
            if use_grad:
                la = _grad_view(la, pa)
                lb = _grad_view(lb, pb)
            la, lb = la.detach().float().to(g.device), lb.detach().float().to(g.device)
            _place_shard(kind, p, a, b, la, lb, lead)
        group = g.expert_mp if expert else g.mp
        if dist.get_world_size(group) > 1:
            dist.all_reduce(a, group=group)
            dist.all_reduce(b, group=group)
        out[name] = (a.cpu(), b.cpu())
    return out


ExpertBlocks = list[tuple[int, int] | None]
"""Per global rank: the ``[lo, hi)`` experts its engine holds (vLLM expert parallelism), or
None when it needs every expert (or has no engine that takes experts)."""


def stream_lora(
    policy,
    dtype: torch.dtype,
    dst: int | None,
    bucket_bytes: int = 256 << 20,
    experts: ExpertBlocks | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`gather_lora`'s full factors in ``dtype`` (the engines' LoRA dtype), bucketed: the
    owner ranks write their shards into one flat buffer per bucket (zeros elsewhere) and one
    collective per bucket sums it over the model-parallel group (expert factors: the
    expert-model-parallel group), instead of two fp32 all-reduces per HF tensor. Every element
    has exactly one writer, so the sum is exact in any dtype. ``dst``: the global rank that
    needs the factors (a ``reduce`` in the groups holding it; other groups send nothing); None:
    every rank (``all_reduce``). ``experts`` (with ``dst=None``): per global rank the experts
    its engine holds; each expert factor then goes only to the ranks that hold it, in every
    group that holds one (:func:`_deliveries`: a ``reduce`` to a group's one holder, an
    ``all_reduce`` kept by its holders when it has several; independent replicas: one holder
    per replica), so no rank receives another engine rank's experts. Collective over all
    ranks; ``{}`` on ranks that receive none."""
    g, lc = policy.groups, policy.cfg.lora
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    units = [
        (name, shape, *hit)
        for name, shape in hf_weight_shapes(policy.arch).items()
        if (hit := lora_target(name, lc.targets)) is not None
    ]
    world = dist.get_world_size()
    for expert in (False, True):
        group = g.expert_mp if expert else g.mp
        members = dist.get_process_group_ranks(group) if dist.get_world_size(group) > 1 else None
        mine = [u for u in units if u[3] == expert]
        blocks = experts if expert else None
        for keep, part in _deliveries(mine, dst, blocks, world, members or [g.rank]):
            for bucket in _buckets(part, lc.rank, max(1, bucket_bytes // _itemsize(dtype))):
                flat, views = _fill_bucket(policy, bucket, dtype)
                if members is not None:
                    if len(keep) == 1:
                        dist.reduce(flat, dst=keep[0], group=group)
                    else:
                        dist.all_reduce(flat, group=group)
                if g.rank in keep:
                    out.update({k: (a.cpu(), b.cpu()) for k, (a, b) in views.items()})
    return out


def _holders(u, dst: int | None, experts: ExpertBlocks | None, world: int) -> list[int]:
    """The global ranks that receive unit ``u``: ``dst``; without it every rank, or with
    ``experts`` the ranks whose block holds its expert (a None block: every expert)."""
    if dst is not None:
        return [dst]
    if experts is None:
        return list(range(world))
    e = _expert_index(u[0])
    return [r for r, b in enumerate(experts[:world]) if b is None or b[0] <= e < b[1]]


def _deliveries(
    units: list, dst: int | None, experts: ExpertBlocks | None, world: int, members: list[int]
) -> list[tuple[tuple[int, ...], list]]:
    """``units`` split by the ranks of this rank's group ``members`` (global ranks; one group
    of the partition that owns them: every group holds every unit's shards) that receive them,
    the same list on every member: ``(receivers, units)``, in the order of ``receivers``;
    units no member receives are left out (the group sends nothing for them). One receiver: a
    ``reduce`` to it; several: an ``all_reduce`` that they keep (the others drop the bucket,
    which never leaves the device)."""
    group = set(members)
    by: dict[tuple[int, ...], list] = {}
    for u in units:  # keep: never empty
        keep = tuple(r for r in _holders(u, dst, experts, world) if r in group)
        if keep:
            by.setdefault(keep, []).append(u)
    return sorted(by.items())


def _expert_index(hf_name: str) -> int:
    m = re.search(r"\.experts\.(\d+)\.", hf_name)
    assert m is not None, hf_name
    return int(m.group(1))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _buckets(units: list, rank: int, max_elems: int) -> list[list]:
    """``units`` (name, shape, kind, expert) in buckets of at most ``max_elems`` elements
    (a bigger unit alone)."""
    out: list[list] = [[]]
    size = 0
    for u in units:
        n = rank * (u[1][0] + u[1][1])
        if out[-1] and size + n > max_elems:
            out.append([])
            size = 0
        out[-1].append(u)
        size += n
    return [b for b in out if b]


def _fill_bucket(policy, bucket: list, dtype: torch.dtype):
    """A zeroed flat buffer with this rank's owned pieces of every unit in ``bucket`` written
    in, and the ``{name: (A [r, in], B [out, r])}`` views into it."""
    g, r = policy.groups, policy.cfg.lora.rank
    total = sum(r * (shape[0] + shape[1]) for _, shape, _, _ in bucket)
    flat = torch.zeros(total, dtype=dtype, device=g.device)
    views, offset = {}, 0
    for name, shape, kind, expert in bucket:
        a = flat[offset : offset + r * shape[1]].view(r, shape[1])
        offset += r * shape[1]
        b = flat[offset : offset + shape[0] * r].view(shape[0], r)
        offset += shape[0] * r
        lead = (g.etp_rank if expert else g.tp_rank) == 0  # owns the TP-replicated factor
        for p in policy.plan.get(name, []):
            if not p.owner:
                continue
            la, lb, _, _ = _adapter_for(policy, p.param)
            la, lb = la.detach().to(g.device, dtype), lb.detach().to(g.device, dtype)
            _place_shard(kind, p, a, b, la, lb, lead)
        views[name] = (a, b)
    return flat, views


def _place_shard(kind: str, p, a, b, la, lb, lead: bool) -> None:
    """Write one rank's LoRA shards ``la [r, in/TP]``, ``lb [out/TP, r]`` of placement ``p``
    into the full factors ``a [r, in]``, ``b [out, r]``: a column-parallel layer splits B's
    rows, a row-parallel one A's columns; the TP-replicated factor is copied by the lead rank."""
    if kind == "column":
        b[p.src[0]] = lb[p.dst[0]]
        if lead:
            a.copy_(la)
    else:
        a[:, p.src[1]] = la[:, p.dst[1]]
        if lead:
            b.copy_(lb)


def _grad_view(view: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if param.grad is None:
        return torch.zeros_like(view)
    if view is param:
        return param.grad
    idx = next(i for i in range(param.shape[0]) if param[i].data_ptr() == view.data_ptr())
    return param.grad[idx]


def peft_tensors(
    lora: dict, num_experts: int, expert_format: str = "fused"
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """PEFT state dict + ``target_modules`` + ``target_parameters`` from :func:`gather_lora`."""
    sd: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    experts: dict[str, dict] = {}
    for name, (a, b) in lora.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m and expert_format == "fused":
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = (a, b)
            continue
        base = "base_model.model." + name[: -len(".weight")]
        sd[base + ".lora_A.weight"], sd[base + ".lora_B.weight"] = a.contiguous(), b.contiguous()
        modules.add(name[: -len(".weight")].rsplit(".", 1)[1])
    params: list[str] = []
    for prefix, parts in experts.items():
        fused = {}
        if any(k[1] == "gate" for k in parts):
            fused["gate_up_proj"] = [
                (parts[(e, "gate")][0], torch.cat([parts[(e, "gate")][1], parts[(e, "up")][1]]))
                for e in range(num_experts)
            ]
        if any(k[1] == "down" for k in parts):
            fused["down_proj"] = [parts[(e, "down")] for e in range(num_experts)]
        for pname, per in fused.items():
            a = torch.cat([ae for ae, _ in per])  # [E*r, in]
            b = torch.stack([be for _, be in per], dim=-1)  # [out, r, E]
            inner = len(fused) == 2 and pname == "gate_up_proj"  # peft nests the first
            key = f"base_model.model.{prefix}{'.base_layer' if inner else ''}"
            sd[key + ".lora_A.weight"] = a.contiguous()
            sd[key + ".lora_B.weight"] = b.reshape(b.shape[0], -1).contiguous()
            if f"mlp.experts.{pname}" not in params:
                params.append(f"mlp.experts.{pname}")
    order = {"mlp.experts.gate_up_proj": 0, "mlp.experts.down_proj": 1}
    return sd, sorted(modules), sorted(params, key=lambda p: order.get(p, len(order)))


def check_exportable(lora: LoraConfig, is_moe: bool, expert_format: str = "fused") -> None:
    """ConfigError naming ``model.lora.dropout`` when the adapter cannot be written in
    ``expert_format``: peft's fused-expert LoRA (``target_parameters``, peft >= 0.17) refuses
    ``lora_dropout != 0`` (``ParamWrapper.__init__``), and the trainer exports the adapter
    for adapter sync and at the end of a run. Called when the policy is built, i.e. before
    any weight is read, not at the first sync or after the last step."""
    experts = any(t.endswith(("linear_fc1", "linear_fc2")) for t in lora.targets)
    if lora.dropout and is_moe and experts and expert_format == "fused":
        raise ConfigError(
            f"config key 'model.lora.dropout': {lora.dropout} with expert targets "
            f"({', '.join(t for t in lora.targets if t.endswith(('fc1', 'fc2')))}) on a MoE "
            "model: peft's fused-expert LoRA (target_parameters) has no dropout, so the "
            "adapter could not be exported; set model.lora.dropout=0 or target only "
            "linear_qkv / linear_proj"
        )


def peft_config(
    lora: LoraConfig, modules: list[str], params: list[str], base: str
) -> dict[str, object]:
    """``adapter_config.json`` of a LoRA adapter written by :func:`write_peft_dir`."""
    config: dict[str, object] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "base_model_name_or_path": base,
    }
    if params:
        config["target_parameters"] = params
    return config


def write_peft_dir(
    lora_units: dict,
    lora: LoraConfig,
    num_experts: int,
    out_dir: str | Path,
    base: str,
    expert_format: str = "fused",
    replace: bool = False,
) -> Path:
    """Write the PEFT adapter of ``{hf_name: (A, B)}`` (:func:`gather_lora`'s view) into
    ``out_dir`` atomically (temp dir, then rename). ``out_dir`` must be absent or empty at
    the rename, unless ``replace`` (a directory the caller owns, such as the run's own
    ``adapter/`` under its lock: replaced if unchanged while writing)."""
    from safetensors.torch import save_file

    sd, modules, params = peft_tensors(lora_units, num_experts, expert_format)
    config = peft_config(lora, modules, params, base)
    out = Path(out_dir)
    with fileio.atomic_dir(out, unique=True, expected=replace) as tmp:
        fileio.library_write(
            tmp / "adapter_model.safetensors",
            lambda path: save_file(sd, path, metadata={"format": "pt"}),
        )
        fileio.write_text(tmp / "adapter_config.json", json.dumps(config, indent=2))
    return out


def export_peft_adapter(policy, out_dir: str | Path, expert_format: str = "fused") -> Path | None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (rank 0, atomically:
    temp dir then rename). Collective. Returns the directory on rank 0, else None."""
    lc = policy.cfg.lora
    check_exportable(lc, policy.arch.is_moe, expert_format)
    lora = gather_lora(policy)
    if dist.get_rank() != 0:
        return None
    return write_peft_dir(  # the run's own adapter/ (or a temp dir): a new one replaces it
        lora, lc, policy.arch.num_experts, out_dir, str(policy.cfg.hf_path), expert_format, True
    )
