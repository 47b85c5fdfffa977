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
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megagrpo.rollout import SamplingSpec
from megagrpo.rollout.config import PartialConfig
from megagrpo.trainer.rollouts import Rollouts, round_seed
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)


@dataclass
class PendingGroup:
    """A group whose completions are generated across steps.

    ``token_ids`` / ``logprobs`` / ``versions`` ``[G][L_i]``: the kept prefix of each member,
    the engine's log-prob of each token and the policy version (step) that sampled it;
    ``finish``: the finish reason of a finished member, ``""`` while it runs."""

    problem: Problem
    size: int
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    started: bool = False

    def __post_init__(self) -> None:
        for name in ("token_ids", "logprobs", "versions"):
            if not getattr(self, name):
                setattr(self, name, [[] for _ in range(self.size)])
        if not self.finish:
            self.finish = [""] * self.size

    @property
    def done(self) -> bool:
        return all(self.finish)

    def unfinished(self) -> list[int]:
        return [i for i, f in enumerate(self.finish) if not f]

    def oldest(self, i: int, now: int) -> int:
        """The oldest policy version in member ``i`` (``now`` when it has no token yet)."""
        return min(self.versions[i], default=now)

    def staleness(self, now: int) -> int:
        """Versions the oldest token of the group lags ``now``."""
        return max((now - self.oldest(i, now) for i in range(self.size)), default=0)


def continuation(problem: Problem, prompt_ids: list[int], prefix: list[int]) -> Problem:
    """``problem`` whose prompt is its exact prompt ids + the kept prefix (engines take a
    fixed prompt from ``meta['prompt_ids']``)."""
    meta = dict(problem.meta, prompt_ids=list(prompt_ids) + list(prefix))
    return dataclasses.replace(problem, meta=meta)


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
    carried groups between steps. Every rank makes the same calls (collectives)."""

    def __init__(self, cfg: PartialConfig, max_tokens: int, seed: int):
        self.cfg, self.max_tokens, self.seed = cfg, max_tokens, seed
        self.rollouts: Rollouts | None = None
        self.pending: list[PendingGroup] = []
        self.stats = RoundStats()

    # ------------------------------------------------------------------ rounds

    def begin_step(self) -> None:
        self.stats = RoundStats()

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
        self.rollouts = rollouts
        work = self.pending + [PendingGroup(p, n) for p, n in zip(problems, counts)]
        total = sum(g.size for g in work)
        need = math.ceil(self.cfg.finish_fraction * total - 1e-9)
        tokens, chunk = 0, 0
        while True:
            active = self._active(work, step, tokens, need)
            if not active:
                break
            tokens += self._chunk(
                active, step, round_seed(self.seed, step, 1000 * round_idx + chunk)
            )
            chunk += 1
        self.stats.chunks += chunk
        self.stats.gen_tokens += tokens
        done = [g for g in work if g.done]
        self.pending = [g for g in work if not g.done]
        groups = rollouts.score([self._group(g, step) for g in done]) if done else []
        for pg, g in zip(done, groups):
            self._count(pg, g, step)
        return groups

    def _active(
        self, work: list[PendingGroup], step: int, tokens: int, need: int
    ) -> list[tuple[PendingGroup, int]]:
        """The (group, member) pairs the next chunk generates: every unfinished one until the
        budget is met, then only those at the staleness limit (run to their end)."""
        running = [(g, i) for g in work for i in g.unfinished()]
        finished = sum(g.size for g in work) - len(running)
        token_met = self.cfg.token_budget > 0 and tokens >= self.cfg.token_budget
        if finished < need and not token_met:
            return running
        limit = self.cfg.max_staleness
        return [(g, i) for g, i in running if step - g.oldest(i, step) >= limit]

    def _chunk(self, active: list[tuple[PendingGroup, int]], step: int, seed: int) -> int:
        """Generate one chunk for ``active``: fresh groups (no prompt ids yet) as one request
        of their size, started members one request each from prompt + prefix. Returns the
        tokens generated."""
        fresh: list[PendingGroup] = []
        for g, _ in active:
            if not g.started and all(g is not f for f in fresh):
                fresh.append(g)
        cont = [(g, i) for g, i in active if g.started]
        problems = [g.problem for g in fresh] + [
            continuation(g.problem, g.prompt_ids, g.token_ids[i]) for g, i in cont
        ]
        counts = [g.size for g in fresh] + [1] * len(cont)
        spec = SamplingSpec(seed=seed, max_tokens=self.cfg.chunk_tokens)
        assert self.rollouts is not None
        out = self.rollouts.generate(problems, counts, spec)
        tokens = 0
        for g, res in zip(fresh, out[: len(fresh)]):
            g.started, g.prompt_ids = True, list(res.prompt_ids)
            for i in range(g.size):
                tokens += self._append(g, i, res, i, step)
        for (g, i), res in zip(cont, out[len(fresh) :]):
            tokens += self._append(g, i, res, 0, step)
        return tokens

    def _append(self, g: PendingGroup, i: int, res: Group, j: int, step: int) -> int:
        """Append completion ``j`` of ``res`` to member ``i`` of ``g``; decide if it finished."""
        room = self.max_tokens - len(g.token_ids[i])
        ids, lps = list(res.token_ids[j])[:room], list(res.logprobs[j])[:room]
        g.token_ids[i] += ids
        g.logprobs[i] += lps
        g.versions[i] += [step] * len(ids)
        reason = res.finish_reasons[j] if res.finish_reasons else "length"
        if reason == "stop" and len(ids) == len(res.token_ids[j]):
            g.finish[i] = "stop"
        elif len(g.token_ids[i]) >= self.max_tokens or not ids:
            g.finish[i] = "length"
        return len(ids)

    def _group(self, g: PendingGroup, step: int) -> Group:
        return Group(
            problem=g.problem,
            completions=self._decode(g.token_ids),
            token_ids=[list(t) for t in g.token_ids],
            logprobs=[list(lp) for lp in g.logprobs],
            prompt_ids=list(g.prompt_ids),
            finish_reasons=list(g.finish),
            meta={"policy_versions": [list(v) for v in g.versions], "staleness": g.staleness(step)},
        )

    def _decode(self, token_ids: list[list[int]]) -> list[str]:
        assert self.rollouts is not None
        return self.rollouts.decode(token_ids)

    def _count(self, pg: PendingGroup, g: Group, step: int) -> None:
        s = self.stats
        s.trained_groups += 1
        s.trained_completions += pg.size
        s.trained_tokens += sum(g.lengths)
        for i in range(pg.size):
            lag = step - pg.oldest(i, step)
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
