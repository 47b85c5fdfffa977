"""The rollout engine protocol and what every engine shares.

An engine turns problems into :class:`~megagrpo.types.Group` s of G sampled answers (with the
sampled tokens' log-probs), sleeps while the trainer runs, and takes new weights every step.
Weight sync is the most dangerous step in RL post-training: an engine that silently keeps
its old weights trains on stale rollouts forever. So every :meth:`RolloutEngine.update_weights`
ends with a *probe*: the engine scores a fixed token sequence; its log-probs must have moved as
the trainer predicts and stay within a dtype-aware distance of the trainer's, and the streamed
names must cover the engine's parameters (megagrpo.rollout.verify). A failed check raises
:class:`WeightSyncError`; it never warns.

Nothing here imports vllm; the trainer depends on this module only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from megagrpo.data.prompts import prompt_ids
from megagrpo.errors import MegagrpoError
from megagrpo.types import Group, Problem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megagrpo.rollout.lora import PeftAdapter

log = logging.getLogger(__name__)


class EngineError(MegagrpoError):
    """The rollout engine failed to start or to generate (message names config keys)."""


class WeightSyncError(EngineError):
    """A weight update did not take effect (the verification probe failed)."""


@dataclass
class SamplingSpec:
    """Per-call sampling settings; ``None`` fields fall back to the engine's RolloutConfig."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    """Base seed of this call; request i of problem j gets a seed derived from (seed, j, i)."""
    problem_offset: int = 0
    """Index of ``problems[0]`` in the whole round: problem j is seeded as problem
    ``problem_offset + j``, so a shard of a round draws what the whole round would."""


@dataclass
class SyncReport:
    """What a weight sync cost and whether it was verified.

    Attributes:
        bytes: tensor bytes streamed to the engine (in the engine's dtype).
        seconds: wall time of transfer + verification.
        verified: True when every check passed (a failed check raises instead).
        max_probe_diff: max |engine - expected| probe log-prob when ``expected_probe`` was
            given, else the max |after - before| change of the probe.
        num_tensors: tensors streamed; num_buckets: buckets they were streamed in;
        max_bucket_bytes: the largest bucket (the sync's transient memory).
        mode: "full" (merged weights) or "adapter" (LoRA tensors only).
        mean_probe_diff: mean |engine - expected| probe log-prob (nan without a trainer probe).
        predicted_change / observed_change: rms probe change since the reference point, as
            the trainer predicts it and as the engine shows it; change_error: rms of their
            difference over the predicted rms (1.0 = nothing moved).
        change_verified: the change test decided (predicted change above
            ``rollout.verify_change_floor``); False: judged cumulatively at later syncs.
        full_check_tensors: (parameter, expert) units whose checksums were compared (0: the
            full check did not run); full_check_s: wall time of the engine-side checksums
            (before and after the load) and their comparison.
    """

    bytes: int
    seconds: float
    verified: bool
    max_probe_diff: float
    num_tensors: int = 0
    num_buckets: int = 0
    max_bucket_bytes: int = 0
    mode: str = "full"
    mean_probe_diff: float = float("nan")
    predicted_change: float = float("nan")
    observed_change: float = float("nan")
    change_error: float = float("nan")
    change_verified: bool = False
    full_check_tensors: int = 0
    full_check_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        """What was streamed and what was checked, in words (NaN fields left out)."""
        what = "merged weights" if self.mode == "full" else "the LoRA adapter"
        out = (
            f"{what}: {self.num_tensors} tensors in {self.num_buckets} buckets, "
            f"{self.bytes / 2**20:.1f} MiB, {self.seconds:.2f} s"
        )
        if math.isnan(self.mean_probe_diff):  # no trainer prediction (eval, verify-rollout)
            out += f"; probe log-probs moved by up to {self.max_probe_diff:.3g} (loaded)"
        else:
            out += (
                f"; probe |engine - trainer| max {self.max_probe_diff:.3g}, mean "
                f"{self.mean_probe_diff:.3g}"
            )
        if not math.isnan(self.change_error):
            out += f"; change vs prediction error {self.change_error:.3g}" + (
                "" if self.change_verified else " (judged at later syncs)"
            )
        if self.full_check_tensors:
            out += f"; checksums of {self.full_check_tensors} tensors matched"
        return out


@runtime_checkable
class RolloutEngine(Protocol):
    """What the GRPO loop needs from an inference engine (vLLM, HF ``generate``)."""

    tokenizer: PreTrainedTokenizerBase
    """The HF tokenizer the engine decodes with (the trainer tokenises with the same one)."""
    probe_token_ids: list[int]
    """The fixed token sequence ``[probe_len]`` every weight sync is verified on."""

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The exact prompt token ids ``[P]`` (chat template + generation prompt)."""
        ...

    def generate(
        self, problems: list[Problem], n: int | Sequence[int], sampling: SamplingSpec | None = None
    ) -> list[Group]:
        """Sample ``n`` completions per problem (or ``n[j]`` for problem j: one call with
        mixed counts, rollout budgets); one Group per problem, in order.

        Fills ``completions``, ``token_ids`` ``[L_i]``, ``logprobs`` ``[L_i]`` (sampled
        tokens, raw model distribution), ``lengths``, ``prompt_ids`` and ``finish_reasons``.
        ``problems`` may be empty (returns ``[]``; engines whose replicas step together must
        still take part).
        """
        ...

    def probe_logprobs(self) -> list[float]:
        """Log-probs ``[probe_len - 1]`` of :attr:`probe_token_ids` under current weights."""
        ...

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        expected_probe: Sequence[float] | None = None,
        expected_before: Sequence[float] | None = None,
        full_check: bool | None = None,
    ) -> SyncReport:
        """Load HF-named full tensors (streamed in buckets), verify, report; raise
        WeightSyncError. May be called asleep: the engine wakes in stages (weights, stream,
        KV cache, probe). ``expected_probe``: the trainer's probe log-probs
        ``[probe_len - 1]`` under the new weights; ``expected_before``: under the weights the
        engine holds now (the change test: :mod:`megagrpo.rollout.verify`); ``full_check``:
        force/skip the per-tensor checksums (None: ``rollout.full_check_every``; every rank
        passes the same value)."""
        ...

    def supports_adapter_sync(self) -> bool:
        """True when :meth:`update_adapter` can serve a LoRA adapter for the targeted modules
        on the engine's base weights (else sync merged weights)."""
        ...

    def update_adapter(
        self,
        adapter: PeftAdapter,
        expected_probe: Sequence[float] | None = None,
        expected_before: Sequence[float] | None = None,
        in_memory: bool = False,
    ) -> SyncReport:
        """Serve ``adapter`` on the base weights (replacing the previous one); verified like
        :meth:`update_weights` (no checksums). EngineError when :meth:`supports_adapter_sync`
        is False. ``in_memory``: hand the tensors over in memory (no PEFT directory)."""
        ...

    def weight_regions(self) -> Any:
        """What this engine rank holds of each HF tensor, as
        ``needs(hf_name, shape) -> regions | None`` (None: all of it; ``[]``: nothing), for a
        sliced weight sync (:mod:`megagrpo.model.sync_transport`); None: every tensor whole."""
        ...

    def expert_block(self) -> tuple[int, int, int] | None:
        """``(ep_rank, local, global)``: the MoE experts this engine rank serves LoRA for
        under expert parallelism (a streamed adapter sync sends it only those); None: all."""
        ...

    def sleep(self) -> None:
        """Free the engine's device memory (KV cache, weights) while the trainer runs."""
        ...

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next :meth:`generate`."""
        ...

    dtype: torch.dtype
    """The dtype the engine holds its weights (and serves LoRA) in."""

    @property
    def weights_dropped(self) -> bool:
        """True while a sleep has dropped the weights (vLLM level 2): waking is not enough,
        the engine needs a full weight sync before it can generate."""
        ...

    def close(self) -> None:
        """Release everything; the engine cannot be used afterwards."""
        ...


# ----------------------------------------------------------------------------- prompts


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, problem: Problem) -> list[int]:
    """The prompt ids ``[P]`` every engine and the trainer see for ``problem``: the prompt the
    data layer fixed (a truncated one, ``meta['prompt_ids']``), else ``problem.messages``
    through the tokenizer's chat template (generation prompt on; the problem's
    ``chat_template_kwargs``, e.g. ``enable_thinking``), tokenised with
    ``add_special_tokens=False`` (no second BOS): :func:`megagrpo.data.prompts.prompt_ids`."""
    if not problem.messages and "prompt_ids" not in problem.meta:
        raise EngineError(f"problem {problem.id!r} has no messages")
    return prompt_ids(tokenizer, problem)


MAX_TOKENS_KEY = "max_tokens"
"""``problem.meta[MAX_TOKENS_KEY]``: the most tokens this problem's completions may take in
this call (partial rollouts continue a member with only its remaining room)."""


def problem_max_tokens(problem: Problem, default: int) -> int:
    """``default`` capped by the problem's own ``meta['max_tokens']`` (when set)."""
    cap = problem.meta.get(MAX_TOKENS_KEY)
    return default if cap is None else max(1, min(default, int(cap)))


def sample_counts(n: int | Sequence[int], num_problems: int) -> list[int]:
    """Completions per problem ``[num_problems]`` of a generate call's ``n`` (one count for
    every problem, or one per problem); EngineError on a count < 1 or a length mismatch."""
    counts = [int(n)] * num_problems if isinstance(n, int) else [int(x) for x in n]
    if len(counts) != num_problems:
        raise EngineError(f"generate: {len(counts)} sample counts for {num_problems} problems")
    if any(c < 1 for c in counts):
        raise EngineError(f"generate: sample counts must be >= 1, got {min(counts)}")
    return counts


def request_seed(base: int, problem_index: int, sample_index: int) -> int:
    """Deterministic per-request seed from (call seed, problem index, sample index)."""
    return (base * 1_000_003 + problem_index * 8191 + sample_index) % (2**31 - 1)


def decode_completion(tokenizer, token_ids: Sequence[int]) -> str:
    """Decode sampled ids, skipping special tokens and ids beyond the tokenizer's vocab
    (the embedding is padded past it; a random model may sample those)."""
    vocab = len(tokenizer)
    return tokenizer.decode([t for t in token_ids if t < vocab], skip_special_tokens=True)


def default_probe_ids(tokenizer, length: int) -> list[int]:
    """A fixed token sequence ``[length]`` for sync verification: a short chat turn,
    padded/truncated to ``length`` with a deterministic id pattern."""
    text = "<|im_start|>user\nThe answer is c. 答え: b,d<|im_end|>\n<|im_start|>assistant\n"
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    vocab = len(tokenizer)
    i = 0
    while len(ids) < length:
        ids.append((7 + 31 * i) % vocab)
        i += 1
    return ids[:length]
