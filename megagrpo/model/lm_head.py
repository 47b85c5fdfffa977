"""Final hidden states in place of logits: the output projection left to the loss.

    with hidden_instead_of_logits(model) as weight:   # [V/TP, H] (None: no output layer)
        hidden = model(ids, pos, mask)                # [B, T, H] instead of [B, T, V/TP]
        loss, _ = fused_linear_policy_loss(hidden, weight, ...)

Megatron's ``GPTModel`` ends with ``output_layer(hidden, weight=output_weight)``, a
``ColumnParallelLinear`` whose input is gathered over the tensor-parallel group (the sequence
all-gather under sequence parallelism; a copy whose backward all-reduces otherwise) before the
``[T, H] x [H, V/TP]`` matmul. Inside the block the output layer does only that gather and
returns the hidden states; GPTModel then transposes them to ``[B, T, H]`` as it would the
logits. The loss (:func:`megagrpo.kernels.fused_linear_policy_loss`) computes the same
vocab-parallel logits chunk by chunk, so no ``[T, V/TP]`` tensor (nor its gradient) exists.
Its gradient w.r.t. the hidden states is this rank's partial sum over its vocab shard, and
the gather's backward (reduce-scatter / all-reduce) sums it over the group exactly as the
output layer's own backward does. The output weight is frozen (LoRA trains adapters only).

Tied embeddings: the weight is ``shared_embedding_or_output_weight()``, what GPTModel hands
the output layer itself. Multi-token prediction is refused (its loss needs the logits).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def output_weight(model: nn.Module) -> torch.Tensor | None:
    """The ``[V/TP, H]`` weight GPTModel's output layer multiplies by (None: not the last
    pipeline stage)."""
    layer: Any = getattr(model, "output_layer", None)
    if layer is None or not getattr(model, "post_process", True):
        return None
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()  # type: ignore[operator]
    return layer.weight


@contextlib.contextmanager
def hidden_instead_of_logits(model: nn.Module) -> Iterator[torch.Tensor | None]:
    """Inside the block ``model(...)`` returns the final hidden states ``[B, T, H]`` (gathered
    over the tensor-parallel group) instead of the logits; yields the output weight
    (None, and nothing changed, on a stage without the output layer). Restored on exit."""
    weight = output_weight(model)
    if weight is None:
        yield None
        return
    config = getattr(model, "config", None)
    if getattr(config, "mtp_num_layers", None):
        raise NotImplementedError("loss.fused_linear with multi-token prediction layers")
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layer: Any = model.output_layer
    if layer.gather_output:
        raise NotImplementedError("loss.fused_linear needs vocab-parallel logits (parallel_output)")

    def forward(input_: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(input_, group=layer.tp_group)
        else:
            hidden = copy_to_tensor_model_parallel_region(input_, group=layer.tp_group)
        return hidden, None

    layer.forward = forward
    try:
        yield weight
    finally:
        del layer.forward
