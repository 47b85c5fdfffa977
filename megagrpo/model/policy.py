"""``MegatronPolicy``: the trained model: Megatron GPTModel stage + LoRA, HF weights in/out.

    groups = init_parallel(run.parallel)
    policy = build_policy(run.model, groups)
    logits = policy.forward_logits(input_ids)     # [B, T, V/TP], vocab-parallel (groups.tp)
    loss.backward(); policy.finish_grad_sync(); optimizer.step()
    with policy.scoring():                        # eval mode + no_grad: deterministic
        old = policy.forward_logits(input_ids)    # probe, old/ref log-probs, evaluation
    for bucket in policy.export_hf_weights(): engine.update_weights(bucket)
    metrics |= policy.merge_survival(groups.mp)   # how much of the LoRA update the cast kept

Only LoRA parameters are trainable; base weights are frozen in ``model_cfg.dtype``.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megagrpo.errors import CheckpointError, ConfigError
from megagrpo.model.arch import Arch, arch_from_hf, load_hf_config
from megagrpo.model.config import LoraConfig, ModelConfig
from megagrpo.model.hf_mapping import build_plan, hf_weight_shapes
from megagrpo.model.lm_head import hidden_instead_of_logits
from megagrpo.model.lora import LoraAdapter, attach_lora, lora_grad_sync
from megagrpo.model.merge_precision import MergeStats, merge_delta
from megagrpo.model.model_inputs import LossFn, model_inputs
from megagrpo.model.peft_export import ExpertBlocks
from megagrpo.model.provider import DTYPES, build_gpt_model
from megagrpo.model.routing import Routing, routed_forward, stage_routers
from megagrpo.model.shared_prefix import (
    Segments,
    install_thd_attention,
    rope_positions,
    te_attend,
    torch_attend,
)
from megagrpo.model.sync_transport import Counter, ExportLayout, RegionFn, exchange_layout
from megagrpo.model.weights import export_hf_tensors, load_hf_weights
from megagrpo.parallel.config import ParallelConfig
from megagrpo.parallel.state import ParallelGroups, validate_layout

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_KINDS = {
    "self_attention.linear_qkv": ("column", "linear_qkv"),
    "self_attention.linear_proj": ("row", "linear_proj"),
    "mlp.linear_fc1": ("column", "linear_fc1"),
    "mlp.linear_fc2": ("row", "linear_fc2"),
}
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.)?(linear_fc[12])$")


def layout_of(groups: ParallelGroups) -> ParallelConfig:
    """The ``ParallelConfig`` that produced ``groups``."""
    return ParallelConfig(
        tp=groups.tp_size,
        ep=groups.ep_size,
        etp=groups.etp_size,
        pp=groups.pp_size,
        num_layers_in_first_pipeline_stage=groups.first_stage_layers,
        num_layers_in_last_pipeline_stage=groups.last_stage_layers,
        sequence_parallel=groups.sequence_parallel,
    )


@dataclass
class AdapterSite:
    """One targeted Megatron linear and how its adapter is laid out.

    ``is_expert`` comes from the module *path* (``mlp.experts.``), never from the module:
    megatron-core's Transformer Engine wrappers (``TEGroupedLinear``, TE column/row linears
    used as experts) do not set ``is_expert`` (0.16.1, 0.19.2), only the local spec does.
    Experts use the expert-TP group and size, dense layers the TP group; experts carry
    ``explicit_expert_comm`` exactly when Megatron sets it (``is_expert and (etp > 1 or
    ep > 1)``: the token dispatcher then owns the communication).
    """

    name: str
    module: nn.Module
    kind: str
    in_local: int
    out_local: int
    keys: list[str]
    num_experts: int
    is_expert: bool

    def build(self, lora: LoraConfig, g: ParallelGroups) -> LoraAdapter:
        """The zero-B adapter for this site under layout ``g``."""
        weight = _first_weight(self.module)
        return LoraAdapter(
            self.kind,
            self.in_local,
            self.out_local,
            lora.rank,
            lora.alpha,
            lora.dropout,
            tp_group=g.etp if self.is_expert else g.tp,
            tp_size=g.etp_size if self.is_expert else g.tp_size,
            tp_rank=g.etp_rank if self.is_expert else g.tp_rank,
            sequence_parallel=g.sequence_parallel and not self.is_expert,
            explicit_expert_comm=self.is_expert and (g.etp_size > 1 or g.ep_size > 1),
            is_expert=self.is_expert,
            global_keys=self.keys,
            seed=lora.init_seed,
            num_experts=self.num_experts,
        ).to(weight.device)


def _first_weight(mod: nn.Module) -> torch.Tensor:
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor):
        w = getattr(mod, "weight0", None)  # TE grouped experts: weight0..weight{n-1}
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{type(mod).__name__} has neither 'weight' nor 'weight0'")
    return w


def adapter_sites(
    model: nn.Module, arch: Arch, lora: LoraConfig, g: ParallelGroups
) -> list[AdapterSite]:
    """The linears of ``model`` (this rank's stage) that ``lora.targets`` adapts, in module
    order, with layout-independent keys (global layer and expert indices)."""
    offset = g.layer_span(arch.num_layers)[0]
    n_local = arch.num_experts // g.ep_size if arch.is_moe else 0
    sites = []
    for name, mod in model.named_modules():
        m = _LAYER.match(name)
        if not m:
            continue
        layer, rest = int(m.group(1)) + offset, m.group(2)
        em = _EXPERT.match(rest)
        if em:
            fc = em.group(2)
            if fc not in lora.targets and f"expert_{fc}" not in lora.targets:
                continue
            kind = "column" if fc == "linear_fc1" else "row"
            grouped = em.group(1) is None  # TE grouped experts: one module, n_local experts
            first = g.ep_rank * n_local + (0 if grouped else int(em.group(1)))
            count = n_local if grouped else 1
            keys = [f"layers.{layer}.experts.{e}.{fc}" for e in range(first, first + count)]
            num_experts, is_expert = (n_local if grouped else 0), True
        elif rest in _KINDS:
            kind, target = _KINDS[rest]
            if target not in lora.targets:
                continue
            keys, num_experts, is_expert = [f"layers.{layer}.{rest}"], 0, False
        else:
            continue
        out_local, in_local = _first_weight(mod).shape
        sites.append(
            AdapterSite(name, mod, kind, in_local, out_local, keys, num_experts, is_expert)
        )
    return sites


class MegatronPolicy(nn.Module):
    """One rank's pipeline stage of the policy with LoRA adapters.

    Attributes: ``model`` (Megatron GPTModel), ``arch``, ``hf_config`` (dict of config.json),
    ``groups``, ``spec`` ("local" | "te"), ``adapters`` (Megatron module name → LoraAdapter).
    """

    def __init__(
        self,
        model: nn.Module,
        arch: Arch,
        model_cfg: ModelConfig,
        groups: ParallelGroups,
        spec: str,
    ):
        super().__init__()
        self.model, self.arch, self.cfg, self.groups, self.spec = (
            model,
            arch,
            model_cfg,
            groups,
            spec,
        )
        self.hf_config = arch.raw
        self.grouped_experts = any(
            ".experts.linear_fc1.weight" in n for n, _ in model.named_parameters()
        )
        self.plan = build_plan(arch, groups, spec, self.grouped_experts)
        self.adapters: dict[str, LoraAdapter] = {}
        self.merge_stats = MergeStats()
        """Sums of the last merged export (:meth:`merge_survival`)."""
        self.routers = stage_routers(model, arch, groups)
        """This stage's MoE routers, for routing replay (None for a dense model)."""
        self.export_counter = Counter()
        """Bytes this rank sent / received in the last export (by transport)."""
        self._layouts: dict[tuple, tuple[ExportLayout, Any]] = {}
        self.prefix_route = "thd"
        """How segment rows (shared prefixes) attend (:mod:`megagrpo.model.shared_prefix`):
        thd (TE's varlen kernel on the TE spec, torch's on the local spec) | mask (the local
        spec's own attention under the segments' mask: T^2 per row, kept as a check)."""
        install_thd_attention(model, te_attend if spec == "te" else torch_attend)

    # ------------------------------------------------------------------ building
    def params(self) -> dict[str, torch.Tensor]:
        """Megatron parameter name → tensor (this stage, base weights and adapters)."""
        return dict(self.model.named_parameters())

    def attach_adapters(self) -> None:
        """Wrap every targeted linear with a zero-B LoRA adapter; freeze everything else."""
        for site in adapter_sites(self.model, self.arch, self.cfg.lora, self.groups):
            adapter = site.build(self.cfg.lora, self.groups)
            attach_lora(site.module, adapter)
            self.adapters[site.name] = adapter
        for pname, p in self.model.named_parameters():
            p.requires_grad_(".adapter.lora_" in pname)
        log.info(
            "LoRA: %d adapters, %d trainable parameters on this rank",
            len(self.adapters),
            sum(p.numel() for p in self.lora_parameters()),
        )

    # ------------------------------------------------------------------ training API
    def forward_logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        routing: Routing | None = None,
        segments: Segments | None = None,
    ) -> torch.Tensor:
        """Vocab-parallel logits of this TP rank: [B, T] token ids → [B, T, V/TP].

        Logits are in the base dtype (float32 on CPU; bfloat16 on GPU: upcast in the loss).
        Column ``t`` of TP rank ``r`` is vocab id ``r * V/TP + t``; reduce over ``groups.tp``.
        ``position_ids``: None or 0..T-1 per row (RoPE positions are 0..T-1; shifted positions
        are rejected). ``attention_mask`` [B, T] (1 = token, 0 = padding) masks padded keys on
        top of the causal mask; right padding needs no mask. ``cu_seqlens`` [n + 1] (a packed
        micro-batch, B = 1: :mod:`megagrpo.trainer.batch`): sample ``i`` is tokens
        ``cu_seqlens[i]:cu_seqlens[i+1]`` and attends only to itself (position_ids then restart
        at 0 per sample, or None). With pipeline parallelism use :meth:`forward_backward`.
        ``routing``: the MoE expert selection to replay, measure or record in this forward
        (:class:`megagrpo.model.routing.Routing`, ``[B, T, num_layers, top_k]``; not with
        ``cu_seqlens``); None: the own routers decide. ``segments``: a segment row (B = 1, a
        group's prompt once and its completions after it: :mod:`megagrpo.model.shared_prefix`;
        routing may be given).
        """
        if self.groups.pp_size > 1:
            raise NotImplementedError(
                "forward_logits with pp > 1: only the last stage has logits; use "
                "policy.forward_backward (Megatron's pipeline schedule)"
            )
        if routing is not None and cu_seqlens is not None:
            raise NotImplementedError("routing replay with packed rows (trainer.pack_tokens)")
        x = model_inputs(
            self.groups,
            self.spec,
            input_ids,
            position_ids,
            attention_mask,
            cu_seqlens,
            segments,
            self.prefix_route,
        )
        shape = (input_ids.shape[0], x.length, x.input_ids.shape[1] - x.length)
        with rope_positions(self.model, x.rope_positions):
            logits = routed_forward(
                self.model,
                self.routers,
                routing,
                shape,
                x.input_ids,
                x.position_ids,
                x.attention_mask,
                **x.extra,
            )
        return logits[:, : x.length] if x.padded else logits

    def forward_backward(
        self,
        batches: Sequence[Any],
        loss_fn: LossFn,
        *,
        forward_only: bool = False,
        broadcast: bool = True,
        routing: Callable[[int], Routing | None] | None = None,
    ) -> list[Any]:
        """Run micro-batches through the policy: ``loss_fn(logits, i) -> (loss, out)`` on the
        logits of ``batches[i]`` (objects with ``input_ids``/``position_ids`` [B, T] and
        optionally ``cu_seqlens``), ``loss.backward()`` unless ``forward_only``; returns the
        ``out`` values in order. pp == 1: today's loop. pp > 1: Megatron's pipeline
        schedule (1F1B, the loss on the last stage); ``out`` is broadcast from the last stage
        to every stage when ``broadcast`` (else ``None`` there); ``routing(i)``: micro-batch
        ``i``'s MoE routing (replay is not wired into the pipeline schedule: pp == 1).
        Collective over the pipeline. See :mod:`megagrpo.model.pipeline`."""
        from megagrpo.model.pipeline import (
            broadcast_from_last_stage,
            micro_batch_loop,
            pipeline_schedule,
        )

        if self.groups.pp_size == 1:
            return micro_batch_loop(self, batches, loss_fn, forward_only, routing)
        if routing is not None and any(routing(i) is not None for i in range(len(batches))):
            raise NotImplementedError(
                "MoE routing replay with pipeline parallelism (parallel.pp > 1)"
            )
        outs = pipeline_schedule(self, batches, loss_fn, forward_only)
        return broadcast_from_last_stage(outs, self.groups) if broadcast else outs

    @contextlib.contextmanager
    def hidden_output(self) -> Iterator[torch.Tensor | None]:
        """Inside the block :meth:`forward_logits` / :meth:`forward_backward` hand ``loss_fn``
        the final hidden states ``[B, T, H]`` (gathered over TP) in place of the logits, and
        the block yields the output weight ``[V/TP, H]`` the loss multiplies them by, chunk by
        chunk (None, nothing changed, on a pipeline stage without the output layer). See
        :mod:`megagrpo.model.lm_head`."""
        with hidden_instead_of_logits(self.model) as weight:
            yield weight

    @contextlib.contextmanager
    def scoring(self) -> Iterator[None]:
        """Deterministic, gradient-free forwards: eval mode and ``torch.no_grad()`` inside.

        LoRA dropout (``model.lora.dropout`` > 0; ms-swift's default is 0.05) is active in
        training mode, so two forwards of the same input differ and neither equals the policy
        the engine serves. Wrap every forward whose result is *compared or reused* rather
        than trained on: the weight-sync probe, recomputed old log-probs, the KL reference
        forward and evaluation. Megatron's full recompute is training-only as well, so no
        recompute happens in here. Each module's training flag is restored on exit, also
        on error; nesting is fine.
        """
        modes = [(m, m.training) for m in self.modules()]
        self.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for m, training in modes:
                m.training = training

    def lora_parameters(self) -> list[nn.Parameter]:
        """Trainable LoRA parameters of this rank, in a fixed order."""
        return [p for n, p in self.model.named_parameters() if ".adapter.lora_" in n]

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's LoRA shards (Megatron names → detached copies), for checkpoints."""
        return {
            n: p.detach().clone() for n, p in self.model.named_parameters() if ".adapter.lora_" in n
        }

    def load_lora_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load shards saved by :meth:`lora_state_dict` under the same layout."""
        own = {n: p for n, p in self.model.named_parameters() if ".adapter.lora_" in n}
        missing, unexpected = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
        if missing or unexpected:
            raise CheckpointError(
                f"LoRA state mismatch: missing {missing[:3]}, unexpected "
                f"{unexpected[:3]} (saved under another layout or targets?)"
            )
        with torch.no_grad():
            for n, p in own.items():
                if tuple(sd[n].shape) != tuple(p.shape):
                    raise CheckpointError(
                        f"LoRA tensor '{n}': shape {tuple(sd[n].shape)}, model has {tuple(p.shape)}"
                    )
                p.copy_(sd[n])

    def lora_pieces(self, optimizer: torch.optim.Optimizer | None = None) -> list[dict]:
        """This rank's share of the layout-free LoRA state (adapters + ``optimizer``'s
        moments in HF space, each element written by exactly one rank of the world), for
        checkpoints any layout can resume: :mod:`megagrpo.model.lora_state`."""
        from megagrpo.model.lora_state import lora_pieces

        return lora_pieces(self, optimizer)

    def load_lora_pieces(
        self, pieces: list[dict], optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Load :meth:`lora_pieces` of every rank of a checkpoint written under any layout
        (and rebuild ``optimizer``'s state for this rank's parameters)."""
        from megagrpo.model.lora_state import load_lora_pieces

        load_lora_pieces(self, pieces, optimizer)

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """The frozen base model (the KL reference policy): every LoRA adapter's scaling set
        to 0 inside the block."""
        if not self.adapters:
            raise NotImplementedError("loss.kl_coef > 0 needs a policy with LoRA adapters")
        saved = [a.scaling for a in self.adapters.values()]
        try:
            for a in self.adapters.values():
                a.scaling = 0.0
            yield
        finally:
            for a, scaling in zip(self.adapters.values(), saved):
                a.scaling = scaling

    def grad_norm_params(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """``(dense, expert)`` LoRA parameters counted once per model replica for the grad
        norm: the TP-replicated factor (A of a column-parallel adapter, B of a row-parallel
        one) only on TP rank 0 (expert-TP rank 0 for experts)."""
        g = self.groups
        dense: list[nn.Parameter] = []
        expert: list[nn.Parameter] = []
        for a in self.adapters.values():
            is_expert = bool(getattr(a.lora_A, "lora_expert", False))
            first = (g.etp_rank if is_expert else g.tp_rank) == 0
            replicated = a.lora_A if a.kind == "column" else a.lora_B
            sharded = a.lora_B if a.kind == "column" else a.lora_A
            picked = [sharded] + ([replicated] if first or a.tp_size == 1 else [])
            (expert if is_expert else dense).extend(picked)
        return dense, expert

    def finish_grad_sync(self) -> None:
        """All-reduce LoRA grads: SP/ETP partial sums, then mean over DP (expert-DP for
        expert adapters), as Megatron's DDP does. Call after backward, before the step."""
        lora_grad_sync(self.lora_parameters(), self.groups)

    # ------------------------------------------------------------------ export
    def merged_param(
        self, name: str, merge_lora: bool = True, params: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Local Megatron tensor ``name``, with its adapter's delta added when ``merge_lora``
        (``params``: :meth:`params`, built once by a caller that merges many tensors)."""
        p = (self.params() if params is None else params)[name].detach()
        mod_name, _, leaf = name.rpartition(".")
        adapter = self.adapters.get(mod_name)
        if not merge_lora or adapter is None:
            return p
        delta = adapter.delta_weight()
        m = re.fullmatch(r"weight(\d+)", leaf)
        if leaf != "weight" and not m:
            return p
        if m:  # TE grouped experts
            delta = delta[int(m.group(1))]
        if p.device != delta.device:  # offloaded base (trainer.offload_during_rollout)
            p = p.to(delta.device, non_blocking=True)
        merged = merge_delta(p, delta)
        self.merge_stats.add(p, delta, merged)
        return merged

    def merge_survival(self, group=None) -> dict[str, float]:
        """Fraction of the LoRA update that survived the cast to the base dtype in the last
        merged export (:mod:`megagrpo.model.merge_precision`): ``sync/lora_survival`` and
        ``sync/lora_unchanged_frac``. With ``group`` the sums are all-reduced over it first
        (a collective: every rank of ``group`` calls it, after consuming the export);
        ``groups.mp`` plus ``groups.expert_mp`` cover one model copy, the world group all."""
        return self.merge_stats.reduce(group, self.groups.device).metrics()

    def export_hf_weights(
        self,
        merge_lora: bool = True,
        bucket_bytes: int = 256 << 20,
        dtype: torch.dtype | None = None,
        transport: str = "allreduce",
        needs: RegionFn | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF tensors ``[(hf_name, tensor)]`` in buckets of <= ``bucket_bytes``, on
        ``groups.device``, in the base dtype unless ``dtype``, gathered over each tensor's
        model-parallel group by ``transport`` (:mod:`megagrpo.model.sync_transport`:
        allreduce | broadcast: every tensor on every rank; sliced: only the regions
        ``needs`` names, the whole tensor when ``needs`` is None). Collective: all ranks
        must consume the iterator. LoRA is merged into the base weights (fp32 add, then cast)
        when ``merge_lora``. Bytes sent / received: :attr:`export_counter` afterwards."""
        cache: dict[str, torch.Tensor] = {}
        if merge_lora:
            self.merge_stats = MergeStats()
        layout = None
        if transport != "allreduce":
            key = (transport, id(needs))
            if key not in self._layouts:  # exchanged once (needs kept alive by the key's owner)
                shapes = hf_weight_shapes(self.arch)
                self._layouts[key] = (
                    exchange_layout(self.plan, shapes, self.groups, transport, needs),
                    needs,
                )
            layout = self._layouts[key][0]
        self.export_counter = Counter()
        params = self.params()  # one walk of the module tree, not one per tensor

        def get(name: str) -> torch.Tensor:
            if name not in cache:
                cache.clear()  # pieces of one Megatron tensor are consecutive: keep one
                cache[name] = self.merged_param(name, merge_lora, params)
            return cache[name]

        yield from export_hf_tensors(
            get,
            self.plan,
            self.arch,
            self.groups,
            dtype or DTYPES[self.cfg.dtype],
            bucket_bytes,
            transport=transport,
            layout=layout,
            counter=self.export_counter,
        )

    def export_bytes_received(self) -> int:
        """Bytes this rank received in the last :meth:`export_hf_weights` (any transport)."""
        return self.export_counter.received

    def stream_adapter(
        self, dtype: torch.dtype, dst: int | None, experts: ExpertBlocks | None = None
    ) -> dict[str, torch.Tensor] | None:
        """The adapter the engines serve, as a PEFT state dict with per-expert names
        (``mlp.experts.{e}.{gate,up,down}_proj``: vLLM's 2D MoE LoRA layout, what Qwen3-MoE's
        ``FusedMoEWithLoRA`` loads), in ``dtype``, built from bucketed collectives on global
        rank ``dst`` (None: every rank; ``experts``: per rank the experts its engine holds,
        the others' are not sent there); None where nothing arrives. Collective
        (:func:`megagrpo.model.peft_export.stream_lora`)."""
        from megagrpo.model.peft_export import check_exportable, peft_tensors, stream_lora

        check_exportable(self.cfg.lora, self.arch.is_moe, "per_expert")
        lora = stream_lora(self, dtype, dst, experts=experts)
        if not lora:
            return None
        return peft_tensors(lora, self.arch.num_experts, "per_expert")[0]

    def export_peft_adapter(self, out_dir: str | Path, expert_format: str = "fused") -> Path | None:
        """Write a PEFT adapter (adapter_config.json + adapter_model.safetensors) that peft
        loads onto the HF model (``expert_format="per_expert"``: vLLM's per-expert names, what
        the engines load); collective, rank 0 writes. Returns the dir on rank 0."""
        from megagrpo.model.peft_export import export_peft_adapter

        return export_peft_adapter(self, out_dir, expert_format)


def build_policy(
    model_cfg: ModelConfig, groups: ParallelGroups, load_weights: bool = True
) -> MegatronPolicy:
    """Build this rank's stage, stream HF weights from ``model_cfg.hf_path``, add LoRA.

    ``load_weights=False`` leaves the base weights uninitialised (only config.json is read),
    for loading Megatron shards instead (:mod:`megagrpo.model.megatron_ckpt`).
    Raises ConfigError (bad config/layout) or CheckpointError (missing/mismatched tensors).
    """
    model_cfg.validate("model")
    model_cfg.lora.validate("model.lora")
    if not model_cfg.hf_path:
        raise ConfigError("config key 'model.hf_path': empty")
    from megagrpo.model.pretrained import resolve_model_path

    hf_dir = resolve_model_path(model_cfg.hf_path, need_tokenizer=False)
    arch = arch_from_hf(load_hf_config(hf_dir))
    validate_layout(layout_of(groups), arch.raw, groups.world_size)
    from megagrpo.model.peft_export import check_exportable

    check_exportable(model_cfg.lora, arch.is_moe)
    model, spec = build_gpt_model(arch, model_cfg, groups)
    policy = MegatronPolicy(model, arch, model_cfg, groups, spec)
    if load_weights:
        stats = load_hf_weights(policy.params(), policy.plan, arch, hf_dir)
        log.info(
            "loaded %d HF tensors (%.1f MB on this rank) from %s",
            stats["tensors"],
            stats["bytes_read"] / 1e6,
            hf_dir,
        )
    policy.attach_adapters()
    return policy
