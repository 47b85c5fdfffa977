"""Level-filtered curriculum sampler with online difficulty.

- Keeps the configured levels (default L2-L5) of a levels file (``megagrpo profile``);
  optional per-level mixing weights.
- Deterministic: each stream walks a permutation of its problems that depends only on
  ``(seed, stream, level bucket, epoch)``. Two independent streams: ``main`` (the first
  round of every step) and ``resample`` (dynamic sampling's extra rounds), so how many
  resample rounds a step needed never shifts which problems later steps start with.
- Online difficulty: :meth:`observe` updates each problem's pass-rate posterior
  Beta(a + s, b + f) from every rollout; older evidence is decayed by ``online_decay`` at
  each observation so the estimate follows the policy. Levels are re-estimated from it
  (:meth:`level_histogram`). A problem that was all-correct or all-wrong in
  ``retire_streak`` consecutive groups is retired; when drawn, it is served anyway with
  probability ``revisit_prob`` and un-retires as soon as one of its groups splits.
- :meth:`state_dict` / :meth:`load_state_dict` restore all of it: a resumed run draws
  exactly the same problems.

Deliberately left out: within one call a problem can repeat across an epoch boundary of a
small pool (the walk is never reshuffled mid-epoch).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megagrpo.curriculum.config import CurriculumConfig
from megagrpo.curriculum.levels import BetaPrior, histogram
from megagrpo.curriculum.stats import SOLVED_THRESHOLD
from megagrpo.errors import CheckpointError, ConfigError
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)

STREAMS = ("main", "resample")
ONLINE_PRIOR_MAX_STRENGTH = 2.0


def stratified_order(
    members: np.ndarray, classes: np.ndarray, rng: np.random.Generator
) -> list[int]:
    """``members`` shuffled within each class, then dealt a round at a time: each round
    takes the next member of every class not yet exhausted, in a fresh random class order.
    Every window of a round holds one member of each class (until the smaller classes run
    out, after which the larger ones continue on their own)."""
    queues = [
        members[classes == c][rng.permutation(int((classes == c).sum()))].tolist()
        for c in np.unique(classes)
    ]
    out: list[int] = []
    depth = 0
    while True:
        live = [q for q in queues if depth < len(q)]
        if not live:
            return out
        out.extend(live[j][depth] for j in rng.permutation(len(live)).tolist())
        depth += 1


class _Walk:
    """Endless walk over ``members``: a fresh seeded permutation per epoch."""

    def __init__(
        self,
        members: np.ndarray,
        seed: int,
        stream: int,
        bucket: int,
        classes: np.ndarray | None = None,
    ) -> None:
        self.members = members
        self.classes = classes  # [len(members)] class of each member (balance_answers)
        self.key = (seed, stream, bucket)
        self.epoch = 0
        self.pos = 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        rng = np.random.default_rng([*self.key, self.epoch])
        if self.classes is None:
            return self.members[rng.permutation(len(self.members))].tolist()
        return stratified_order(self.members, self.classes, rng)

    def next(self) -> int:
        if self.pos >= len(self._order):
            self.epoch += 1
            self.pos = 0
            self._order = self._permutation()
        idx = self._order[self.pos]
        self.pos += 1
        return idx

    def take(self, m: int) -> np.ndarray:
        """The next ``m`` indices ``[m]`` (crossing epoch boundaries)."""
        out: list[int] = []
        while len(out) < m:
            if self.pos >= len(self._order):
                self.epoch += 1
                self.pos = 0
                self._order = self._permutation()
            end = min(len(self._order), self.pos + m - len(out))
            out.extend(self._order[self.pos : end])
            self.pos = end
        return np.asarray(out, dtype=np.int64)

    def state(self) -> list[int]:
        return [self.epoch, self.pos]

    def load(self, state: Sequence[int]) -> None:
        self.epoch, self.pos = int(state[0]), int(state[1])
        self._order = self._permutation()


class CurriculumSampler:
    """Draws training problems; learns their difficulty from the rollouts.

    Args:
        problems: all training problems (ids unique).
        cfg: the curriculum config.
        levels: ``{problem id: level}`` from a levels file, or None (no filter).
        correctness_key: ``Group.reward_parts`` key of the 0/1 correctness reward used by
            :meth:`observe`; None or missing: the total reward (>= 0.5 counts as correct).
    """

    def __init__(
        self,
        problems: Sequence[Problem],
        cfg: CurriculumConfig,
        levels: Mapping[str, int] | None = None,
        correctness_key: str | None = None,
        level_k: int | None = None,
    ) -> None:
        self.problems = list(problems)
        self.cfg = cfg
        self.correctness_key = correctness_key
        self.k = level_k or cfg.level_k
        self.index = {p.id: i for i, p in enumerate(self.problems)}
        if len(self.index) != len(self.problems):
            raise ConfigError("curriculum: problem ids are not unique")
        n = len(self.problems)
        self.profile_level = np.zeros(n, dtype=np.int64)  # 0 = not profiled
        if levels:
            for pid, level in levels.items():
                i = self.index.get(pid)
                if not 1 <= int(level) <= self.k + 1:
                    raise ConfigError(
                        f"curriculum: problem {pid} has level L{level}, outside "
                        f"L1..L{self.k + 1} of k={self.k} (curriculum.level_k)"
                    )
                if i is not None:
                    self.profile_level[i] = int(level)
        profiled = self.profile_level > 0
        self._level_by_id = {
            self.problems[i].id: int(self.profile_level[i])
            for i in np.flatnonzero(profiled).tolist()
        }
        hist = histogram(self.profile_level[profiled].tolist(), self.k + 1)
        self.prior = self._online_prior(hist) if profiled.any() else BetaPrior(1, 1)
        # Online evidence, seeded with the profile's counts.
        correct0 = np.where(profiled, self.k - self.profile_level + 1, 0).astype(np.float64)
        self.succ = correct0
        self.fail = np.where(profiled, self.k - correct0, 0.0)
        self.streak = np.zeros(n, dtype=np.int64)
        self.retired = np.zeros(n, dtype=bool)
        self.num_observed = np.zeros(n, dtype=np.int64)
        self._build_pool(levels is not None and len(levels) > 0)
        self._refresh_levels()
        self._rng = {s: np.random.default_rng([cfg.seed, j, 7919]) for j, s in enumerate(STREAMS)}

    @staticmethod
    def _online_prior(hist: dict[int, int]) -> BetaPrior:
        """Population prior fitted to the levels, capped at ONLINE_PRIOR_MAX_STRENGTH
        pseudo-samples: a narrow population (say, only L3) must not freeze each problem's
        own estimate."""
        k = max(hist) - 1
        prior = BetaPrior.fit_histogram(hist, k)
        strength = prior.a + prior.b
        if strength <= ONLINE_PRIOR_MAX_STRENGTH:
            return prior
        scale = ONLINE_PRIOR_MAX_STRENGTH / strength
        return BetaPrior(prior.a * scale, prior.b * scale)

    # ------------------------------------------------------------------ pool and walks

    def _build_pool(self, filtered: bool) -> None:
        cfg = self.cfg
        n = len(self.problems)
        if filtered:
            keep = np.isin(self.profile_level, cfg.keep_levels)
            unprofiled = self.profile_level == 0
            if unprofiled.any():
                log.info(
                    "curriculum: %d problems have no level (%s)",
                    int(unprofiled.sum()),
                    "kept" if cfg.keep_unprofiled else "dropped",
                )
                if cfg.keep_unprofiled:
                    keep |= unprofiled
        else:
            keep = np.ones(n, dtype=bool)
        self.pool = np.flatnonzero(keep)
        if len(self.pool) == 0:
            raise ConfigError(
                f"curriculum.keep_levels={cfg.keep_levels}: no problem left "
                f"(of {n}) after the level filter"
            )
        self.bucket_weights: np.ndarray | None = None
        buckets: list[np.ndarray] = [self.pool]
        if filtered and cfg.level_weights:
            buckets, weights = [], []
            for level, w in zip(cfg.keep_levels, cfg.level_weights):
                members = np.flatnonzero(self.profile_level == level)
                if len(members) and w > 0:
                    buckets.append(members)
                    weights.append(w)
            if not buckets:
                raise ConfigError("curriculum.level_weights: every weighted level is empty")
            self.bucket_weights = np.asarray(weights, dtype=np.float64) / sum(weights)
        answer = self._answer_classes() if cfg.balance_answers else None
        self.walks = {
            s: [
                _Walk(m, cfg.seed, j, b, None if answer is None else answer[m])
                for b, m in enumerate(buckets)
            ]
            for j, s in enumerate(STREAMS)
        }
        log.info("curriculum: %d of %d problems in the pool", len(self.pool), n)

    def _answer_classes(self) -> np.ndarray:
        """``[n]`` class id of each problem's gold answer (``curriculum.balance_answers``)."""
        ids: dict[tuple[str, ...], int] = {}
        classes = np.asarray(
            [ids.setdefault(tuple(sorted(p.answer)), len(ids)) for p in self.problems],
            dtype=np.int64,
        )
        if len(ids) > len(self.problems) // 2:
            log.warning(
                "curriculum.balance_answers: %d distinct gold answers among %d problems "
                "(free-form answers?): a round holds nearly every problem, so it balances "
                "nothing; it is meant for a few answer letters",
                len(ids),
                len(self.problems),
            )
        return classes

    # ------------------------------------------------------------------ drawing

    def next_problems(self, n: int, resample: bool = False) -> list[Problem]:
        """The next ``n`` problems of the main stream (or of the resample stream)."""
        stream = "resample" if resample else "main"
        walks, rng = self.walks[stream], self._rng[stream]
        if self.bucket_weights is None:
            idx = self._draw(walks[0], n, rng)
        else:
            buckets = rng.choice(len(walks), size=n, p=self.bucket_weights)
            idx = np.empty(n, dtype=np.int64)
            for b in range(len(walks)):
                where = np.flatnonzero(buckets == b)
                if len(where):
                    idx[where] = self._draw(walks[b], len(where), rng)
        problems = self.problems
        return [problems[i] for i in idx.tolist()]

    def _draw(self, walk: _Walk, m: int, rng: np.random.Generator) -> np.ndarray:
        """``m`` indices from ``walk``; a retired one is skipped unless revisited."""
        if self.cfg.retire_streak == 0 or not self.retired[walk.members].any():
            return walk.take(m)
        got: list[np.ndarray] = []
        have, dry = 0, 0
        while have < m:
            if dry >= len(walk.members):  # a whole pass rejected: all retired, serve anyway
                got.append(walk.take(m - have))
                break
            cand = walk.take(m - have)
            keep = ~self.retired[cand] | (rng.random(len(cand)) < self.cfg.revisit_prob)
            num_kept = int(keep.sum())
            dry = dry + len(cand) if num_kept == 0 else 0
            got.append(cand[keep])
            have += num_kept
        return np.concatenate(got)

    # ------------------------------------------------------------------ online difficulty

    def observe(self, groups: Sequence[Group]) -> None:
        """Update pass-rate posteriors and retirement streaks from scored groups ``[N]`` (their
        sizes may differ: budgeted rollouts)."""
        if not self.cfg.online or not groups:
            return
        index = self.index
        pairs = []
        for g in groups:
            i = index.get(g.problem.id)
            if i is not None and g.rewards:
                pairs.append((i, g))
        if not pairs:
            return
        idx = np.fromiter((i for i, _ in pairs), dtype=np.int64, count=len(pairs))
        correct, sizes = self._correct_counts([g for _, g in pairs])
        if len(np.unique(idx)) == len(idx):
            self._update(idx, correct, sizes)
        else:  # a problem twice in one call: keep the sequential semantics
            for j in range(len(idx)):
                self._update(idx[j : j + 1], correct[j : j + 1], sizes[j : j + 1])

    def _correct_counts(self, groups: Sequence[Group]) -> tuple[np.ndarray, np.ndarray]:
        """``(correct [N], size [N])`` of groups, judged on the correctness values."""
        key = self.correctness_key
        rows = [g.reward_parts.get(key, g.rewards) if key else g.rewards for g in groups]
        sizes = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        if len(set(sizes.tolist())) == 1:
            values = np.asarray(rows, dtype=np.float64)
            return (values >= SOLVED_THRESHOLD).sum(axis=1).astype(np.float64), sizes
        correct = np.fromiter(
            (sum(1 for v in r if v >= SOLVED_THRESHOLD) for r in rows),
            dtype=np.float64,
            count=len(rows),
        )
        return correct, sizes

    def _update(self, idx: np.ndarray, correct: np.ndarray, sizes: np.ndarray) -> None:
        decay, streak_max = self.cfg.online_decay, self.cfg.retire_streak
        n = sizes.astype(np.float64)
        self.succ[idx] = decay * self.succ[idx] + correct
        self.fail[idx] = decay * self.fail[idx] + (n - correct)
        self.num_observed[idx] += 1
        collapsed = (correct == 0) | (correct == n)
        self._move_levels(idx)
        self.streak[idx] = np.where(collapsed, self.streak[idx] + 1, 0)
        if streak_max:
            self.retired[idx] = np.where(
                collapsed, self.retired[idx] | (self.streak[idx] >= streak_max), False
            )
        else:
            self.retired[idx] = False

    def pass_rate(self, problem_id: str) -> float:
        """Posterior mean pass rate of one problem."""
        i = self.index[problem_id]
        return float(
            (self.prior.a + self.succ[i])
            / (self.prior.a + self.prior.b + self.succ[i] + self.fail[i])
        )

    def posterior(self, idx: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Beta posterior ``(a [K], b [K])`` of the pass rates of problems ``idx``: the levels
        prior (capped, :data:`ONLINE_PRIOR_MAX_STRENGTH`) plus the profile counts and the
        decayed online evidence (unprofiled problems: the prior alone)."""
        idx = np.asarray(idx, dtype=np.int64)
        return self.prior.a + self.succ[idx], self.prior.b + self.fail[idx]

    def posterior_of(self, problems: Sequence[Problem]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`posterior` of problems by id (ids must belong to this sampler)."""
        return self.posterior([self.index[p.id] for p in problems])

    def pool_posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`posterior` of the pool's problems that are not retired (the population the
        next draws come from; all of the pool when every problem is retired)."""
        live = self.pool[~self.retired[self.pool]]
        return self.posterior(live if len(live) else self.pool)

    def current_levels(self, idx: np.ndarray | None = None) -> np.ndarray:
        """Online level estimate (L1..L{k+1}; 0 = no evidence yet) of problems ``idx``
        (default all) ``[len(idx)]``."""
        succ = self.succ if idx is None else self.succ[idx]
        fail = self.fail if idx is None else self.fail[idx]
        a, b = self.prior.a, self.prior.b
        p = (a + succ) / (a + b + succ + fail)
        level = self.k - np.rint(p * self.k).astype(np.int64) + 1
        return np.where(succ + fail > 0, level, 0)

    @property
    def has_levels(self) -> bool:
        """True when some problem has a profile level (a levels file was given)."""
        return bool(self._level_by_id)

    def level_of(self, problem_id: str) -> int | None:
        """The profile (pre-training) level of a problem, or None."""
        return self._level_by_id.get(problem_id)

    def _refresh_levels(self) -> None:
        """Recompute the cached online levels and the pool's level counts."""
        self._in_pool = np.zeros(len(self.problems), dtype=bool)
        self._in_pool[self.pool] = True
        self._level = self.current_levels()
        self._level_counts = np.bincount(self._level[self.pool], minlength=self.k + 2)

    def _move_levels(self, idx: np.ndarray) -> None:
        """Update cached levels/counts of problems ``idx`` (unique) after new evidence."""
        new = self.current_levels(idx)
        in_pool = self._in_pool[idx]
        np.subtract.at(self._level_counts, self._level[idx][in_pool], 1)
        np.add.at(self._level_counts, new[in_pool], 1)
        self._level[idx] = new

    def levels_of(self, groups: Sequence[Group]) -> np.ndarray:
        """``[N]`` profile levels of the groups' problems (0: not profiled)."""
        get = self._level_by_id.get
        return np.fromiter(
            (get(g.problem.id, 0) for g in groups), dtype=np.int64, count=len(groups)
        )

    def level_histogram(self) -> dict[int, int]:
        """``{level: count}`` of the pool's current (online) levels, L1..L{k+1}."""
        return {lv: int(self._level_counts[lv]) for lv in range(1, self.k + 2)}

    def metrics(self) -> dict[str, float]:
        """``curriculum/level_hist/L{k}``, ``curriculum/retired``, ``curriculum/pool``."""
        out = {f"curriculum/level_hist/L{lv}": float(n) for lv, n in self.level_histogram().items()}
        out["curriculum/retired"] = float(self.retired[self.pool].sum())
        out["curriculum/pool"] = float(len(self.pool))
        out["curriculum/epoch"] = float(self.walks["main"][0].epoch)
        return out

    # ------------------------------------------------------------------ state

    def _fingerprint(self) -> str:
        h = hashlib.sha1()
        for p in self.problems:
            h.update(p.id.encode())
            h.update(b"\0")
        h.update(np.asarray(self.pool).tobytes())
        if self.cfg.balance_answers:  # another order: a resume must not switch it silently
            h.update(b"balance_answers")
        return h.hexdigest()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue drawing exactly as this sampler would (JSON-able)."""
        return {
            "version": 1,
            "fingerprint": self._fingerprint(),
            "walks": {s: [w.state() for w in ws] for s, ws in self.walks.items()},
            "rng": {s: r.bit_generator.state for s, r in self._rng.items()},
            "succ": self.succ.tolist(),
            "fail": self.fail.tolist(),
            "streak": self.streak.tolist(),
            "retired": self.retired.tolist(),
            "num_observed": self.num_observed.tolist(),
        }

    def _check_shapes(self, state: Mapping[str, Any]) -> None:
        """CheckpointError naming the field of ``state`` that does not fit: a walk count or
        position (a position past its permutation would silently start another epoch), an
        array that is not one value per problem."""
        n = len(self.problems)
        for key in ("succ", "fail", "streak", "retired", "num_observed"):
            values = state.get(key)
            if not isinstance(values, list) or len(values) != n:
                got = len(values) if isinstance(values, list) else type(values).__name__
                raise CheckpointError(f"curriculum state '{key}': {got} values for {n} problems")
        walks = state.get("walks")
        walks = walks if isinstance(walks, dict) else {}
        for s, ws in self.walks.items():
            saved = walks.get(s)
            if not isinstance(saved, list) or len(saved) != len(ws):
                raise CheckpointError(f"curriculum state 'walks.{s}': not {len(ws)} walks")
            for i, (w, st) in enumerate(zip(ws, saved)):
                ok = isinstance(st, list) and len(st) == 2
                ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in st)
                if not (ok and st[0] >= 0 and 0 <= st[1] <= len(w.members)):
                    raise CheckpointError(
                        f"curriculum state 'walks.{s}[{i}]': {str(st)[:40]} is not "
                        f"[epoch, position <= {len(w.members)}]"
                    )
        if not isinstance(state.get("rng"), dict) or set(self._rng) - set(state["rng"]):
            raise CheckpointError(f"curriculum state 'rng': needs streams {sorted(self._rng)}")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises CheckpointError if the problem set differs or a
        field does not fit this sampler (naming it: ``walks.main[0]``, ``rng.resample``,
        ``succ``)."""
        if state.get("version") != 1:
            raise CheckpointError(f"curriculum state: unknown version {state.get('version')}")
        if state.get("fingerprint") != self._fingerprint():
            raise CheckpointError(
                "curriculum state: saved for a different problem set or "
                "level filter (fingerprint mismatch)"
            )
        self._check_shapes(state)
        for s, ws in self.walks.items():
            for w, st in zip(ws, state["walks"][s]):
                w.load(st)
        for s, r in self._rng.items():
            try:
                r.bit_generator.state = state["rng"][s]
            except (TypeError, ValueError, KeyError) as exc:
                raise CheckpointError(
                    f"curriculum state 'rng.{s}': not a generator state ({exc})"
                ) from None
        self.succ = np.asarray(state["succ"], dtype=np.float64)
        self.fail = np.asarray(state["fail"], dtype=np.float64)
        self.streak = np.asarray(state["streak"], dtype=np.int64)
        self.retired = np.asarray(state["retired"], dtype=bool)
        self.num_observed = np.asarray(state["num_observed"], dtype=np.int64)
        self._refresh_levels()
