"""Partial rollouts (``rollout.partial``): a generation round that stops at its budget.

A synchronous round waits for its longest completion: with lengths spread up to
``rollout.max_tokens`` the engine decodes the long tail at a small batch. Here a round runs in
chunks of ``chunk_tokens``; after each chunk it stops once its budget is met (a fraction of its
completions finished, or a token budget spent). Unfinished completions keep their prefix and
are carried to the next step, where the engine continues them from prompt + prefix under the
new weights (the same call as a fresh prompt: ``meta['prompt_ids']``, so every engine does it),
batched together with the new problems (slime's partial rollout, APRIL's active partial
rollouts, Kimi k1.5's segments).

Every token carries the policy version that sampled it (the training step whose weights the
engine held) and the engine's log-prob. The trainer recomputes the behaviour log-probs under its
current weights and weights each token by its importance ratio against the engine's log-prob
(``loss.tis_cap`` / ``loss.tis_mode``: token-level TIS or MIS), which corrects both the
staleness and the engine/trainer mismatch. A group trains only when all its members finished;
a completion ``max_staleness`` versions behind is run to its end in that step, so no trained
token lags the trainer by more. The carried groups are part of the checkpoint
(:meth:`PartialRollouts.state_dict`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megagrpo.placement.rollouts import Rollouts
from megagrpo.placement.rounds import (
    PendingGroup,
    RoundResult,
    member_lags,
    round_seed,
    run_round,
)
from megagrpo.rollout.config import PartialConfig
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)


@dataclass
class RoundStats:
    """What the partial rounds of one step did (``partial/*`` metrics)."""

    chunks: int = 0
    gen_tokens: int = 0
    trained_groups: int = 0
    trained_tokens: int = 0
    staleness_sum: float = 0.0
    staleness_max: int = 0
    trained_completions: int = 0

    def metrics(self, carried: int, carried_groups: int) -> dict[str, float]:
        n = max(self.trained_completions, 1)
        return {
            "partial/carried_completions": float(carried),
            "partial/carried_groups": float(carried_groups),
            "partial/staleness_mean": self.staleness_sum / n,
            "partial/staleness_max": float(self.staleness_max),
            "partial/chunks": float(self.chunks),
            "partial/gen_tokens": float(self.gen_tokens),
            "partial/gen_tokens_per_trained_token": (
                self.gen_tokens / self.trained_tokens if self.trained_tokens else 0.0
            ),
        }


class PartialRollouts:
    """Generates the rounds of a run with partial rollouts (module docstring); holds the
    carried groups between steps. Every rank makes the same calls (collectives). Where the
    placement runs whole rounds on its engines (``Rollouts.partial_round``: a separate
    placement), a round is one request; otherwise :func:`~megagrpo.placement.rounds.run_round`
    runs here, one collective ``generate`` per chunk."""

    def __init__(self, cfg: PartialConfig, max_tokens: int, seed: int):
        self.cfg, self.max_tokens, self.seed = cfg, max_tokens, seed
        self.pending: list[PendingGroup] = []
        self.stats = RoundStats()

    # ------------------------------------------------------------------ rounds

    def begin_step(self) -> None:
        self.stats = RoundStats()

    def work(self, problems: list[Problem], counts: list[int]) -> list[PendingGroup]:
        """The next round's groups: the carried ones, then one new group per problem."""
        return self.pending + [PendingGroup(p, n) for p, n in zip(problems, counts)]

    def generate_round(
        self,
        rollouts: Rollouts,
        problems: list[Problem],
        counts: list[int],
        step: int,
        round_idx: int,
    ) -> list[Group]:
        """One round at step ``step`` (the policy version of its tokens) on ``rollouts``: the
        carried groups and ``problems`` (``counts[j]`` answers each) generated chunk by chunk
        until the budget is met; returns the groups that finished, scored (carried first)."""
        work = self.work(problems, counts)
        res = rollouts.partial_round(work, self, step, round_idx)  # the engines run it all
        if res is None:
            res = run_round(
                work,
                rollouts.generate,
                rollouts.decode,
                self.cfg,
                self.max_tokens,
                step,
                lambda chunk: round_seed(self.seed, step, 1000 * round_idx + chunk),
            )
        return self.absorb(rollouts, res, step)

    def absorb(self, rollouts: Rollouts, res: RoundResult, step: int) -> list[Group]:
        """Take a round's result (the same on every rank): carry its unfinished groups, score
        the finished ones (collective), count them for the step's metrics."""
        self.stats.chunks += res.chunks
        self.stats.gen_tokens += res.tokens
        self.pending = list(res.remaining)
        groups = rollouts.score(res.finished) if res.finished else []
        for g in groups:
            self._count(g, step)
        return groups

    def _count(self, g: Group, step: int) -> None:
        s = self.stats
        s.trained_groups += 1
        s.trained_completions += g.size
        s.trained_tokens += sum(g.lengths)
        for lag in member_lags(g, step):
            s.staleness_sum += lag
            s.staleness_max = max(s.staleness_max, lag)

    def metrics(self) -> dict[str, float]:
        """The step's ``partial/*`` metrics (after its rounds)."""
        carried = sum(len(g.unfinished()) for g in self.pending)
        return self.stats.metrics(carried, len(self.pending))

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The carried groups as plain data."""
        return {"version": 1, "pending": [dataclasses.asdict(g) for g in self.pending]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pending = []
        for d in state.get("pending", []):
            d = dict(d)
            problem = Problem(**d.pop("problem"))
            pending.append(PendingGroup(problem=problem, **d))
        self.pending = pending
