"""The sampler's logits processing, as vLLM 0.32's V1 sampler does it (the HF engine's; the
vLLM engine passes the same settings to vLLM's ``SamplingParams``).

In vLLM's order (``vllm/v1/sample/sampler.py``): the repetition penalty on every token seen
in the prompt or the output so far (a positive logit divided by the penalty, any other
multiplied: ``_custom_ops.apply_repetition_penalties_torch``), the temperature, min-p (drop
tokens whose probability is below ``min_p`` x the largest:
``logits_processor.builtin.MinPLogitsProcessor``), then top-k and top-p over what is left
(``ops.topk_topp_sampler.apply_top_k_top_p_pytorch``: top-p removes the least likely tokens
whose cumulative probability stays <= 1 - p, at least one kept). transformers applies min-p
after top-k/top-p, so its min-p threshold is taken on the renormalised distribution; the HF
engine follows vLLM, the engine ms-swift samples with.

``rollout.logprobs: sampling`` reports the log-probs of this processed distribution (vLLM's
``processed_logprobs``, which ms-swift requests too); the trainer's are of logits /
temperature, as ms-swift's training log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (neutral values switch a step off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: off."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def truncates(self) -> bool:
        """Whether the sampled distribution differs from softmax(logits / temperature)."""
        return (
            self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0 or self.repetition_penalty != 1.0
        )


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits`` [B, V] with ``penalty`` applied where ``seen`` [B, V] (bool) is set."""
    if penalty == 1.0:
        return logits
    scale = torch.where(seen, torch.full_like(logits, penalty), torch.ones_like(logits))
    return logits * torch.where(logits > 0, 1.0 / scale, scale)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Tokens below ``min_p`` x the most likely token's probability set to -inf."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's top-k then top-p masks (-inf outside), over the sorted logits."""
    if top_k <= 0 and top_p >= 1.0:
        return logits
    ordered, idx = logits.sort(dim=-1, descending=False)
    if 0 < top_k < logits.shape[-1]:
        kth = ordered[:, logits.shape[-1] - top_k].unsqueeze(1)
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if top_p < 1.0:
        cum = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False  # at least one
        ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, ordered)


def process_logits(
    logits: torch.Tensor, seen: torch.Tensor | None, params: SamplingParams
) -> torch.Tensor:
    """``[B, V]`` logits to sample from (float32, float64 kept): penalty, temperature, min-p,
    top-k/top-p (``seen``: ``[B, V]`` tokens of each row's prompt and output so far; None:
    no penalty)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    if seen is not None:
        x = repetition_penalty(x, seen, params.repetition_penalty)
    x = x / params.temperature
    x = min_p_filter(x, params.min_p)
    return top_k_top_p(x, params.top_k, params.top_p)
