"""megagrpo.model: Qwen3-MoE / Qwen3 / Llama on Megatron-core with LoRA, HF weights in/out.

    from megagrpo.model import build_policy
    policy = build_policy(model_cfg, pgs)   # pgs from megagrpo.parallel.init_parallel

:class:`Policy` is what the trainer needs of a policy; :class:`MegatronPolicy` (imported
lazily: megatron is heavy) implements it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from megagrpo.model.config import LoraConfig, ModelConfig
from megagrpo.model.model_inputs import LossFn

if TYPE_CHECKING:
    from megagrpo.model.policy import MegatronPolicy
    from megagrpo.model.routing import Routing
    from megagrpo.parallel.state import ParallelGroups


class Policy(Protocol):
    """The trained model as the GRPO loop sees it (every method is called on every rank;
    the ones marked collective must be)."""

    spec: str
    """Layer spec: ``local`` or ``te``; says which shared-prefix route its forwards take
    (``trainer.shared_prefix``; a policy without attention between positions: ``local``)."""

    def forward_logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        """Vocab-parallel logits ``[B, T, V/TP]`` of token ids ``[B, T]`` (collective; one
        pipeline stage only; ``cu_seqlens``: a packed row, :mod:`megagrpo.trainer.batch`;
        ``routing``: MoE experts to replay / measure / record, MoE policies only)."""
        ...

    def forward_backward(
        self,
        batches: Sequence[Any],
        loss_fn: LossFn,
        *,
        forward_only: bool = False,
        broadcast: bool = True,
        routing: Callable[[int], Routing | None] | None = None,
    ) -> list[Any]:
        """``loss_fn(logits, i) -> (loss, out)`` over micro-batches ``batches`` with backward
        (unless ``forward_only``); the ``out`` values in order (collective; any pipeline
        depth: Megatron's schedule when pp > 1, ``out`` on the last stage, broadcast to every
        stage when ``broadcast``, else ``None`` elsewhere); ``routing(i)``: micro-batch
        ``i``'s MoE routing (one pipeline stage only)."""
        ...

    def lora_parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, in a fixed order."""
        ...

    def grad_norm_params(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """``(dense, expert)`` trainable parameters with every distinct element counted once
        per model replica (TP-replicated factors only on TP rank 0), for the global grad norm."""
        ...

    def finish_grad_sync(self) -> None:
        """All-reduce gradients over the parallel groups after backward (collective)."""
        ...

    def hidden_output(self) -> AbstractContextManager[torch.Tensor | None]:
        """Inside the block forwards hand ``loss_fn`` the final hidden states ``[B, T, H]`` in
        place of the logits; yields the output weight ``[V/TP, H]`` (None: logits as usual,
        e.g. a pipeline stage without the output layer)."""
        ...

    def scoring(self) -> AbstractContextManager[None]:
        """Deterministic, gradient-free forwards inside (eval mode: no LoRA dropout): every
        forward whose result is compared or reused rather than trained on."""
        ...

    def merge_survival(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """``sync/lora_survival`` etc. of the last merged export: how much of the LoRA update
        survived the cast to the base dtype (collective over ``group``)."""
        ...

    def adapters_disabled(self) -> AbstractContextManager[None]:
        """Inside the block the policy is the frozen base model (the KL reference)."""
        ...

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's trainable tensors (copies), for checkpoints."""
        ...

    def load_lora_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load :meth:`lora_state_dict` of the same layout (CheckpointError otherwise)."""
        ...

    def lora_pieces(self, optimizer: torch.optim.Optimizer | None = None) -> list[dict] | None:
        """This rank's share of the layout-free LoRA + optimiser state (a checkpoint that any
        layout resumes: :mod:`megagrpo.model.lora_state`); None: the policy has none, its
        checkpoints hold :meth:`lora_state_dict` (same layout only)."""
        ...

    def load_lora_pieces(
        self, pieces: list[dict], optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Load the :meth:`lora_pieces` of every rank of a checkpoint of any layout."""
        ...

    def export_bytes_received(self) -> int:
        """Bytes this rank received from the other trainer ranks in the last
        :meth:`export_hf_weights` (0 for a single process)."""
        ...

    def export_hf_weights(
        self,
        merge_lora: bool = True,
        bucket_bytes: int = 256 << 20,
        dtype: torch.dtype | None = None,
        transport: str = "allreduce",
        needs: Any = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Merged HF-named tensors in buckets (collective): every tensor on every rank, or
        with ``transport="sliced"`` the regions ``needs`` names
        (:mod:`megagrpo.model.sync_transport`)."""
        ...

    def stream_adapter(
        self, dtype: torch.dtype, dst: int | None, experts: Any = None
    ) -> dict[str, torch.Tensor] | None:
        """The PEFT state dict the engines serve (per-expert names) in ``dtype`` on global
        rank ``dst`` (None: every rank; ``experts``: per rank the experts its engine holds),
        None elsewhere; collective (bucketed, no files)."""
        ...

    def export_peft_adapter(self, out_dir: str | Path, expert_format: str = "fused") -> Path | None:
        """Write a PEFT adapter directory (collective; rank 0 writes and gets the path;
        ``expert_format``: fused (peft) | per_expert (vLLM))."""
        ...


def build_policy(model_cfg: ModelConfig, pgs: ParallelGroups) -> MegatronPolicy:
    """See :func:`megagrpo.model.policy.build_policy` (imported lazily: megatron is heavy)."""
    from megagrpo.model.policy import build_policy as _build

    return _build(model_cfg, pgs)


def __getattr__(name: str):
    if name == "MegatronPolicy":
        from megagrpo.model.policy import MegatronPolicy

        return MegatronPolicy
    raise AttributeError(name)


__all__ = ["LoraConfig", "MegatronPolicy", "ModelConfig", "Policy", "build_policy"]
