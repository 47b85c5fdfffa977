"""Micro-batches through the policy: a plain loop (pp == 1) or Megatron's pipeline schedule.

    outs = policy.forward_backward(mbs, loss_fn)                     # training pass
    with policy.scoring():
        logps = policy.forward_backward(mbs, logp_fn, forward_only=True, broadcast=False)

``loss_fn(logits, i) -> (loss, out)`` sees the vocab-parallel logits ``[B, T, V/TP]`` of
micro-batch ``i``. With one stage this is exactly the loop the trainer ran before: forward,
``loss_fn``, ``loss.backward()``, one micro-batch after the other.

With ``pp > 1`` megatron-core's own schedule runs (``get_forward_backward_func``: 1F1B, or
all-forward when ``forward_only``), the micro-batches being the schedule's micro-batches:
every stage receives the previous stage's hidden states, ``loss_fn`` runs on the last stage
only (the only one with logits), and the backward pass flows back stage by stage. Micro-batch
lengths differ (length-sorted, or packed), so the model config carries
``variable_seq_lengths`` (the schedule sends each tensor's shape first; the provider sets it
whenever pp > 1), and ``calculate_per_token_loss`` so the schedule hands ``loss_fn``'s loss
to backward unscaled (without it Megatron divides every loss by the number of micro-batches:
the trainer's micro-batch weights already normalise). This is how slime and NeMo-RL drive
Megatron (``forward_backward_func(forward_step_func=..., forward_only=...)``, the loss
closure on the last stage, log-probs collected there).

What ``loss_fn`` returns stays on the last stage unless ``broadcast``: then one
``broadcast_object_list`` over the pipeline group hands it to every stage (metrics, the
weight-sync probe). Old / reference log-probs need no broadcast: only the last stage's loss
uses them.

CPU: megatron-core's pipeline code calls ``torch.cuda.synchronize()`` around its shape
exchange and allocates a token counter with ``device="cuda"``;
:func:`megagrpo.parallel.cpu_shims.pipeline_schedule_compat` turns the first into a no-op and
puts the second on the CPU while the schedule runs (only without CUDA; on a GPU nothing is
changed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from megagrpo.model.model_inputs import LossFn, model_inputs
from megagrpo.model.shared_prefix import rope_positions
from megagrpo.parallel.cpu_shims import pipeline_schedule_compat

if TYPE_CHECKING:
    from megagrpo.model.routing import Routing
    from megagrpo.parallel.state import ParallelGroups


class MegatronPolicy(Protocol):
    """What the schedules read of :class:`megagrpo.model.policy.MegatronPolicy` (which calls
    them): the Megatron model, its groups and layer spec, and its logits forward."""

    model: Any
    groups: ParallelGroups
    spec: str
    prefix_route: str
    """Shared-prefix attention route of segment rows (:mod:`megagrpo.model.shared_prefix`)."""
    forward_logits: Callable[..., torch.Tensor]


log = logging.getLogger(__name__)


def micro_batch_loop(
    policy: MegatronPolicy,
    batches: Sequence[Any],
    loss_fn: LossFn,
    forward_only: bool,
    routing: Callable[[int], Routing | None] | None = None,
) -> list[Any]:
    """pp == 1: forward, ``loss_fn``, ``loss.backward()`` (unless ``forward_only``), one
    micro-batch after the other; ``routing(i)``: micro-batch ``i``'s MoE routing."""
    outs = []
    for i, mb in enumerate(batches):
        logits = policy.forward_logits(
            mb.input_ids,
            mb.position_ids,
            cu_seqlens=getattr(mb, "cu_seqlens", None),
            routing=None if routing is None else routing(i),
            segments=getattr(mb, "segments", None),
        )
        loss, out = loss_fn(logits, i)
        if not forward_only:
            if loss is None:
                raise ValueError(f"loss_fn returned no loss for micro-batch {i} (training pass)")
            loss.backward()
        outs.append(out)
        del logits, loss
    return outs


def pipeline_schedule(
    policy: MegatronPolicy, batches: Sequence[Any], loss_fn: LossFn, forward_only: bool
) -> list[Any]:
    """Megatron's schedule over ``batches``; ``loss_fn``'s outputs on the last stage, ``None``
    per micro-batch elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    g = policy.groups
    config: Any = getattr(policy.model, "config")  # noqa: B009 - TransformerConfig
    if not (config.variable_seq_lengths and config.calculate_per_token_loss):
        raise RuntimeError(
            "pipeline schedule needs variable_seq_lengths and calculate_per_token_loss in the "
            "model config (megagrpo.model.provider sets both when pp > 1)"
        )
    if not batches:
        return []

    def forward_step(data_iterator: Iterator[int], model: torch.nn.Module):
        i = next(data_iterator)
        mb = batches[i]
        x = model_inputs(
            g,
            policy.spec,
            mb.input_ids,
            mb.position_ids,
            cu_seqlens=getattr(mb, "cu_seqlens", None),
            segments=getattr(mb, "segments", None),
            route=policy.prefix_route,
        )
        with rope_positions(model, x.rope_positions):  # every stage builds its rotary table
            output = model(x.input_ids, x.position_ids, x.attention_mask, **x.extra)

        def loss_func(output_tensor: torch.Tensor, non_loss_data: bool = False):
            logits = output_tensor[:, : x.length] if x.padded else output_tensor
            loss, out = loss_fn(logits, i)
            if non_loss_data:  # forward-only: Megatron stores what we return
                return out
            if loss is None:
                raise ValueError(f"loss_fn returned no loss for micro-batch {i} (training pass)")
            # (loss, num_tokens, reduced): with calculate_per_token_loss the schedule leaves
            # the loss as it is; the token count only feeds finalize_model_grads (unused).
            return loss, torch.zeros((), dtype=torch.int, device=loss.device), out

        return output, loss_func

    kwargs: dict[str, Any] = {}
    if g.pg_collection is not None:  # explicit groups (else Megatron reads its own globals)
        kwargs.update(
            p2p_communicator=P2PCommunicator(pp_group=g.pp, config=config),
            pg_collection=g.pg_collection,
        )
    first = batches[0].input_ids
    schedule = get_forward_backward_func(pp_size=g.pp_size, vp_size=None)
    with pipeline_schedule_compat():
        outs = schedule(
            forward_step_func=forward_step,
            data_iterator=iter(range(len(batches))),
            model=policy.model,
            num_microbatches=len(batches),
            seq_length=first.shape[1],  # ignored: variable_seq_lengths exchanges shapes
            micro_batch_size=first.shape[0],
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
            **kwargs,
        )
    return list(outs) if g.is_last_stage else [None] * len(batches)


def broadcast_from_last_stage(outs: list[Any], g) -> list[Any]:
    """``outs`` of the last pipeline stage on every stage (one object broadcast)."""
    src = dist.get_global_rank(g.pp, g.pp_size - 1)
    box: list[Any] = [outs if g.is_last_stage else None]
    dist.broadcast_object_list(box, src=src, group=g.pp, device=g.device)
    return list(box[0])
