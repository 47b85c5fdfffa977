"""One round of partial rollouts (``rollout.partial``): generated chunk by chunk until its
budget is met, the unfinished completions carried with their prefix.

:func:`run_round` is the loop; it runs where generation runs: on every trainer rank with
colocated engines (``generate`` is the placement's collective), or on the engine ranks of a
separate placement (``generate`` is the replica's own engine: the round runs there without a
message per chunk, and one step ahead of training). The caller scores the finished groups and
keeps the carried ones (:class:`megagrpo.placement.partial.PartialRollouts`).

Versions: a token carries the policy version that sampled it, in step numbering (the training
step whose weights the engine held). ``step`` is the step the round is for; ``stamp`` the
version of the weights generating it: ``step`` colocated, the engine's version (one less when
the round runs ahead of the update) in a separate placement. The staleness limit counts both:
a member whose oldest token lags ``step`` by ``cfg.max_staleness`` is run to its end in this
round, so no trained token lags its training step by more.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megagrpo.rollout import SamplingSpec
from megagrpo.rollout.base import MAX_TOKENS_KEY
from megagrpo.rollout.config import PartialConfig
from megagrpo.types import Group, Problem

Generate = Callable[[list[Problem], list[int], SamplingSpec], list[Group]]
"""``(problems, counts, spec) -> unscored groups`` (one per problem)."""


def round_seed(base: int, step: int, round_idx: int) -> int:
    """A deterministic sampling seed per (run seed, step, generation round): a resumed run
    draws exactly the rollouts the uninterrupted one drew."""
    return zlib.crc32(f"{base}:{step}:{round_idx}".encode()) & 0x7FFFFFFF


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


def continuation(
    problem: Problem, prompt_ids: list[int], prefix: list[int], room: int | None = None
) -> Problem:
    """``problem`` whose prompt is its exact prompt ids + the kept prefix (engines take a
    fixed prompt from ``meta['prompt_ids']``); ``room``: the most tokens it may still take
    (``meta['max_tokens']``: the engine stops there instead of decoding a whole chunk that
    would be cut)."""
    meta = dict(problem.meta, prompt_ids=list(prompt_ids) + list(prefix))
    if room is not None:
        meta[MAX_TOKENS_KEY] = room
    return dataclasses.replace(problem, meta=meta)


@dataclass
class RoundResult:
    """What a round did: the finished groups (unscored, completions decoded, per-token
    ``meta['policy_versions']``, ``meta['staleness']``), the carried ones, its chunks and
    generated tokens."""

    finished: list[Group]
    remaining: list[PendingGroup]
    chunks: int = 0
    tokens: int = 0


@dataclass
class _Round:
    """The loop's state: settings, the engine call, the versions."""

    cfg: PartialConfig
    max_tokens: int
    generate: Generate
    step: int
    stamp: int


def run_round(
    work: list[PendingGroup],
    generate: Generate,
    decode: Callable[[list[list[int]]], list[str]],
    cfg: PartialConfig,
    max_tokens: int,
    step: int,
    seed_of: Callable[[int], int],
    stamp: int | None = None,
) -> RoundResult:
    """Generate ``work`` (carried groups first, then new ones) chunk by chunk until the budget
    of ``cfg`` is met, then the members at the staleness limit to their end (module doc).
    ``seed_of(chunk)``: the sampling seed of each chunk; ``stamp``: the version of the new
    tokens (default ``step``)."""
    r = _Round(cfg, max_tokens, generate, step, step if stamp is None else stamp)
    total = sum(g.size for g in work)
    need = math.ceil(cfg.finish_fraction * total - 1e-9)
    tokens = chunk = 0
    while True:
        active = _active(r, work, tokens, need)
        if not active:
            break
        tokens += _chunk(r, active, seed_of(chunk))
        chunk += 1
    done = [g for g in work if g.done]
    finished = [_group(g, step, decode) for g in done]
    return RoundResult(finished, [g for g in work if not g.done], chunk, tokens)


def _active(
    r: _Round, work: list[PendingGroup], tokens: int, need: int
) -> list[tuple[PendingGroup, int]]:
    """The (group, member) pairs the next chunk generates: every unfinished one until the
    budget is met, then only those at the staleness limit (run to their end)."""
    running = [(g, i) for g in work for i in g.unfinished()]
    finished = sum(g.size for g in work) - len(running)
    token_met = r.cfg.token_budget > 0 and tokens >= r.cfg.token_budget
    if finished < need and not token_met:
        return running
    limit = r.cfg.max_staleness
    return [(g, i) for g, i in running if r.step - g.oldest(i, r.stamp) >= limit]


def _chunk(r: _Round, active: list[tuple[PendingGroup, int]], seed: int) -> int:
    """Generate one chunk for ``active``: fresh groups (no prompt ids yet) as one request of
    their size, started members one request each from prompt + prefix. Returns the tokens
    generated."""
    fresh: list[PendingGroup] = []
    for g, _ in active:
        if not g.started and all(g is not f for f in fresh):
            fresh.append(g)
    cont = [(g, i) for g, i in active if g.started]
    problems = [g.problem for g in fresh] + [
        continuation(g.problem, g.prompt_ids, g.token_ids[i], r.max_tokens - len(g.token_ids[i]))
        for g, i in cont
    ]
    counts = [g.size for g in fresh] + [1] * len(cont)
    out = r.generate(problems, counts, SamplingSpec(seed=seed, max_tokens=r.cfg.chunk_tokens))
    tokens = 0
    for g, res in zip(fresh, out[: len(fresh)]):
        g.started, g.prompt_ids = True, list(res.prompt_ids)
        for i in range(g.size):
            tokens += _append(r, g, i, res, i)
    for (g, i), res in zip(cont, out[len(fresh) :]):
        tokens += _append(r, g, i, res, 0)
    return tokens


def _append(r: _Round, g: PendingGroup, i: int, res: Group, j: int) -> int:
    """Append completion ``j`` of ``res`` to member ``i`` of ``g``; decide if it finished."""
    room = r.max_tokens - len(g.token_ids[i])
    ids, lps = list(res.token_ids[j])[:room], list(res.logprobs[j])[:room]
    g.token_ids[i] += ids
    g.logprobs[i] += lps
    g.versions[i] += [r.stamp] * len(ids)
    reason = res.finish_reasons[j] if res.finish_reasons else "length"
    if reason == "stop" and len(ids) == len(res.token_ids[j]):
        g.finish[i] = "stop"
    elif len(g.token_ids[i]) >= r.max_tokens or not ids:
        g.finish[i] = "length"
    return len(ids)


def _group(g: PendingGroup, step: int, decode: Callable[[list[list[int]]], list[str]]) -> Group:
    return Group(
        problem=g.problem,
        completions=decode(g.token_ids),
        token_ids=[list(t) for t in g.token_ids],
        logprobs=[list(lp) for lp in g.logprobs],
        prompt_ids=list(g.prompt_ids),
        finish_reasons=list(g.finish),
        meta={"policy_versions": [list(v) for v in g.versions], "staleness": g.staleness(step)},
    )


def member_lags(group: Group, step: int) -> list[int]:
    """Versions each member's oldest token lags ``step`` (0 for a member without tokens)."""
    return [step - min(v, default=step) for v in group.meta.get("policy_versions", [])]


def split_work(work: Sequence[PendingGroup], parts: int) -> list[list[PendingGroup]]:
    """``work`` cut into ``parts`` contiguous shares of about the same number of unfinished
    completions (one per engine replica; a share may be empty)."""
    sizes = [len(g.unfinished()) or 1 for g in work]
    total = sum(sizes)
    shares: list[list[PendingGroup]] = [[] for _ in range(parts)]
    running = 0
    for g, n in zip(work, sizes):
        k = min(parts - 1, int((running + n / 2) * parts / max(total, 1)))
        shares[k].append(g)
        running += n
    return shares
