"""Routing replay against transformers' own Qwen3-MoE: the references the replay tests use.

- :func:`router_inputs`: what each HF router sees (its input hidden states) and picks in a
  teacher-forced forward: the engine's routing, recomputed independently of ``generate``.
- :func:`selection_preserving_perturbation`: a change of the router weights that moves the
  router's own top-k for many tokens but leaves the logits of the experts a given selection
  picked unchanged (per expert, a direction orthogonal to every hidden state routed to it).
  Replaying that selection must then reproduce the unperturbed log-probs within float32
  noise, since the gate weights are a softmax over exactly those logits; the own routing
  must not.
- :func:`forced_routing`: transformers' router made to return a given selection, with gate
  weights from its live logits (an independent implementation of replay: the gradient
  reference).
- :func:`replay_worker`: one rank of a layout run (gloo tests), comparing layouts with one
  process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


def router_inputs(
    hf_model: torch.nn.Module, input_ids: torch.Tensor
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Layer -> (router input ``[B * T, H]``, own top-k ``[B * T, k]``) of a no-grad HF
    forward of ``input_ids`` ``[B, T]`` (rows ``b * T + t``)."""
    from megagrpo.rollout.routing import moe_routers

    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for layer, router in moe_routers(hf_model).items():

        def hook(module, args, output, layer=layer):
            seen[layer] = (args[0].detach().reshape(-1, args[0].shape[-1]), output[2].detach())

        handles.append(router.register_forward_hook(hook))
    try:
        with torch.no_grad():
            hf_model(input_ids=input_ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def selection_preserving_perturbation(
    hidden: torch.Tensor,
    selected: torch.Tensor,
    valid: torch.Tensor,
    num_experts: int,
    logit_std: float,
    seed: int = 0,
) -> torch.Tensor:
    """``[E, H]`` added to one router's weight: row e is orthogonal to the hidden states of
    every ``valid`` token whose ``selected`` set holds e, and scaled so that its logit
    change has ``logit_std`` standard deviation over all tokens.

    Needs fewer distinct hidden states per expert than H (short batches); raises ValueError
    when an expert's tokens span the whole space (nothing would be left to move).
    """
    gen = torch.Generator().manual_seed(seed)
    h = hidden.double()
    rows = []
    for e in range(num_experts):
        mine = h[valid & (selected == e).any(-1)]
        r = torch.randn(h.shape[1], generator=gen, dtype=torch.float64)
        if mine.shape[0]:
            _, s, vh = torch.linalg.svd(mine, full_matrices=False)
            basis = vh[s > s[0] * 1e-10]
            if basis.shape[0] >= h.shape[1]:
                raise ValueError(f"expert {e}: its tokens span all {h.shape[1]} dimensions")
            r = r - basis.T @ (basis @ r)
        r = r / (h @ r).std().clamp_min(1e-12) * logit_std
        rows.append(r)
    return torch.stack(rows).to(hidden.dtype)


@contextlib.contextmanager
def forced_routing(hf_model: torch.nn.Module, selection: dict[int, torch.Tensor]) -> Iterator[None]:
    """Inside: transformers' router of layer l returns ``selection[l]`` ``[B * T, k]`` as its
    indices, with ``softmax(logits)`` renormalised over them as gate weights (Qwen3-MoE with
    ``norm_topk_prob``), so gradients reach its weight through those logits."""
    from megagrpo.rollout.routing import moe_routers

    routers = moe_routers(hf_model)
    saved = {layer: r.forward for layer, r in routers.items()}

    def make(router, idx):
        def forward(hidden_states):
            h = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(h, router.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            top = probs.gather(1, idx)
            top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        return forward

    try:
        for layer, router in routers.items():
            router.forward = make(router, selection[layer].long())
        yield
    finally:
        for layer, router in routers.items():
            router.forward = saved[layer]


def target_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float64 log-probs of ``target_ids`` under full-vocab ``logits``."""
    return torch.log_softmax(logits.double(), -1).gather(-1, target_ids[..., None])[..., 0]


def replay_worker(rank: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """One rank: for each layout in ``job["layouts"]``, build the policy, add
    ``job["perturbation"]`` (layer -> ``[E, H]``) to its routers, and score the micro-batch
    ``job["mb"]`` (input_ids, target_ids, routing, valid) with the engine's routing replayed
    (``r3``) and with the own routing (``off``), with their agreement counts; also the router
    gradients of the r3 loss (sum of the masked log-probs). Counts and gradients are summed
    over the sequence-parallel ranks. Rank 0 returns ``{layout name: {...}}``."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megagrpo.model.config import ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.model.routing import Routing
    from megagrpo.model.verify import gather_vocab
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    out: dict[str, Any] = {}
    names = list(job["layouts"])
    for n, name in enumerate(names):
        groups = init_parallel(ParallelConfig(**job["layouts"][name]))
        try:
            policy = build_policy(ModelConfig(hf_path=job["hf_dir"]), groups)
            routers = perturb_routers(policy, job["perturbation"], trainable=True)
            mb = job["mb"]
            report: dict[str, Any] = {}
            for mode in ("r3", "off"):
                routing = Routing(
                    mb["routing"], mb["valid"], "replay" if mode == "r3" else "measure", True
                )
                logits = policy.forward_logits(mb["input_ids"], routing=routing)
                full = gather_vocab(logits.detach(), groups)
                report[mode] = target_logprobs(full, mb["target_ids"])
                counts = torch.tensor([routing.agree, routing.total], dtype=torch.float64)
                if groups.sequence_parallel and groups.tp_size > 1:  # each rank: its chunk
                    dist.all_reduce(counts, group=groups.tp)
                report[f"{mode}_counts"] = tuple(counts.tolist())
                if mode == "r3":  # vocab-parallel log-probs, differentiable under TP
                    nll = vocab_parallel_cross_entropy(
                        logits.float().contiguous(), mb["target_ids"]
                    )
                    (-nll * mb["mask"]).sum().backward()
                    grads = {}
                    for layer, w in routers.items():
                        if w.grad is None:
                            raise RuntimeError(f"router of layer {layer} got no gradient")
                        g = w.grad.detach().clone()
                        if groups.sequence_parallel and groups.tp_size > 1:
                            dist.all_reduce(g, group=groups.tp)
                        grads[layer] = g
                    report["router_grads"] = grads
            out[name] = report
        finally:
            destroy_parallel(keep_process_group=n < len(names) - 1)
    return out if rank == 0 else None


def perturb_routers(
    policy: Any, perturbation: dict[int, torch.Tensor], trainable: bool = False
) -> dict[int, torch.nn.Parameter]:
    """Add ``perturbation[layer]`` to the Megatron router weight of each layer of this
    stage; returns layer -> weight (``requires_grad`` when ``trainable``)."""
    weights: dict[int, torch.nn.Parameter] = {}
    for name, p in policy.model.named_parameters():
        if name.endswith(".mlp.router.weight"):
            layer = int(name.split(".")[2])  # decoder.layers.N.mlp.router.weight
            with torch.no_grad():
                p.add_(perturbation[layer].to(p.device, p.dtype))
            p.requires_grad_(trainable)
            weights[layer] = p
    return weights
