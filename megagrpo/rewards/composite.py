"""Composite reward: a weighted sum of reward functions, per-function values kept for metrics.

``total[i] = sum_k weight_k * value_k[i]``. What a failing function does depends on
``rewards.on_error``:

* ``count`` (default): scoring never crashes a step. When a function raises (or returns a
  wrong number of values, or a non-finite value), it is re-run one completion at a time;
  every completion whose scoring still fails is logged with the problem id, counted
  (``reward/errors`` in :meth:`CompositeReward.pop_metrics`), and scores 0 for that function.
* ``fail`` (ms-swift's behaviour): the first failure raises :class:`RewardError` naming the
  function, the problem and the completion.

``rewards.timeout_s`` (120 s unless set; 0: no limit) bounds every call of a function (one
call scores one group): a call that has not returned by then counts as an error for each of
its completions (and in ``reward/timeouts``), without a per-completion retry. Python cannot
stop a thread, so the call keeps running in a daemon thread in the background; its result is
discarded, and once :data:`MAX_HUNG_CALLS` such calls are still running the run stops with a
RewardError naming the setting (a reward that hangs every call must not pile up threads). Only
wiring mistakes (a length-based reward called without ``lengths``) raise regardless.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megagrpo.errors import MegagrpoError
from megagrpo.rewards.config import ON_ERROR, RewardsConfig
from megagrpo.rewards.plugins import ORMS_PREFIX, load_external_plugins
from megagrpo.rewards.registry import RewardFn, get
from megagrpo.rewards.swift_adapter import SwiftORMReward, TrainerState, swift_reward
from megagrpo.types import Group, Problem

logger = logging.getLogger(__name__)


def _accepts(fn: RewardFn, arg: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return arg in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class RewardError(MegagrpoError):
    """A reward function failed while ``rewards.on_error`` is ``fail``."""


class RewardTimeout(Exception):
    """A reward call did not return within ``rewards.timeout_s``."""


MAX_HUNG_CALLS = 4
"""Timed-out reward calls still running at once before the run stops (each holds a thread
that Python cannot stop: a reward that hangs every call would pile them up)."""


def call_with_timeout(
    fn: Callable[[], Any], timeout_s: float, hung: list[threading.Thread] | None = None
) -> Any:
    """``fn()``, or RewardTimeout when it has not returned after ``timeout_s`` (> 0) seconds;
    the call is then left running in a daemon thread (appended to ``hung``). ``timeout_s <=
    0``: a plain call. RewardError when :data:`MAX_HUNG_CALLS` of ``hung`` still run."""
    if timeout_s <= 0:
        return fn()
    _hung = hung if hung is not None else []
    _hung[:] = [t for t in _hung if t.is_alive()]
    if len(_hung) >= MAX_HUNG_CALLS:
        raise RewardError(
            f"{len(_hung)} reward calls that timed out (rewards.timeout_s={timeout_s:g} s) are "
            "still running: a reward function hangs; fix it or raise rewards.timeout_s"
        )
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="megagrpo-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _hung.append(thread)
        raise RewardTimeout(
            f"did not return within rewards.timeout_s={timeout_s:g} s (left running)"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass
class _Term:
    name: str
    weight: float
    fn: RewardFn
    takes_lengths: bool
    takes_token_ids: bool


class CompositeReward:
    """``(completions [G], problem, lengths [G]=None, token_ids=None) -> (total [G],
    parts {name: [G]})``. The first term is the correctness reward (used for collapse stats)."""

    def __init__(
        self,
        terms: list[tuple[str, float, RewardFn]],
        *,
        on_error: str = "count",
        timeout_s: float = 120.0,
        trainer_state: TrainerState | None = None,
        swift_calls: str = "group",
    ) -> None:
        if not terms:
            raise ValueError("a composite reward needs at least one function")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.terms = [
            _Term(n, float(w), f, _accepts(f, "lengths"), _accepts(f, "token_ids"))
            for n, w, f in terms
        ]
        self.on_error = on_error
        self.timeout_s = float(timeout_s)
        self.swift_calls = swift_calls
        self.trainer_state = trainer_state or TrainerState()
        for term in self.terms:  # ms-swift ORMs read the step from it
            if isinstance(term.fn, SwiftORMReward):
                term.fn.trainer_state = self.trainer_state
        self.num_errors = 0
        self._errors_since_pop = 0
        self._timeouts_since_pop = 0
        self._hung: list[threading.Thread] = []

    def begin_step(self, step: int, max_steps: int) -> None:
        """Call before scoring the rollouts of optimiser step ``step`` (1-based): ms-swift
        ORMs then see ``trainer_state.global_step == step - 1`` (steps completed) and
        ``trainer_state.max_steps == max_steps``."""
        self.trainer_state.global_step = int(step) - 1
        self.trainer_state.max_steps = int(max_steps)

    @property
    def names(self) -> list[str]:
        """Term names, in config order (the keys of ``parts``)."""
        return [t.name for t in self.terms]

    def __call__(
        self,
        completions: list[str],
        problem: Problem,
        lengths: Sequence[int] | None = None,
        token_ids: Sequence[Sequence[int]] | None = None,
    ) -> tuple[list[float], dict[str, list[float]]]:
        n = len(completions)
        total = [0.0] * n
        parts: dict[str, list[float]] = {}
        for term in self.terms:
            if term.takes_lengths and lengths is None and not term.takes_token_ids:
                raise TypeError(f"reward '{term.name}' needs completion lengths; pass lengths=")
            values = self._score(term, completions, problem, lengths, token_ids)
            parts[term.name] = values
            total = [t + term.weight * v for t, v in zip(total, values)]
        return total, parts

    def score_groups(self, groups: Sequence[Group]) -> None:
        """Score a generation round in place (``rewards``, ``reward_parts`` of each group):
        per group, except ms-swift ORMs with ``swift_calls: batch`` (one call for the whole
        round; a failing batch call is retried group by group, which isolates the error)."""
        parts: list[dict[str, list[float]]] = [{} for _ in groups]
        for term in self.terms:
            batch = None
            if self.swift_calls == "batch" and isinstance(term.fn, SwiftORMReward) and groups:
                batch = self._score_batch(term, groups)
            for i, g in enumerate(groups):
                parts[i][term.name] = batch[i] if batch is not None else self._score_group(term, g)
        for g, part in zip(groups, parts):
            total = [0.0] * len(g.completions)
            for term in self.terms:
                total = [t + term.weight * v for t, v in zip(total, part[term.name])]
            g.rewards, g.reward_parts = total, part

    def _score_batch(self, term: _Term, groups: Sequence[Group]) -> list[list[float]] | None:
        """The batch call's values per group, or None when it failed (then per group)."""
        fn = term.fn
        assert isinstance(fn, SwiftORMReward)
        slices = [g.member_slices() for g in groups]
        items = []
        for g, s in zip(groups, slices):
            for problem, idx in s:
                completions, lengths, token_ids = _members(g, idx)
                items.append((completions, problem, lengths or None, token_ids or None))
        try:
            out = call_with_timeout(lambda: fn.call_batch(items), self.timeout_s)
            if not all(math.isfinite(v) for vals in out for v in vals):
                raise ValueError("returned a non-finite value")
            it = iter(out)
            return [
                _scatter(g.size, [(idx, next(it)) for _, idx in s]) for g, s in zip(groups, slices)
            ]
        except Exception as exc:  # noqa: BLE001 - retried per group, which names the failure
            logger.warning(
                "reward '%s': the batch call failed (%s: %s); scoring group by group",
                term.name,
                type(exc).__name__,
                exc,
            )
            return None

    def _call(self, term: _Term, completions, problem, lengths, token_ids) -> list[float]:
        kwargs = {}
        if term.takes_lengths and lengths is not None:
            kwargs["lengths"] = list(lengths)
        if term.takes_token_ids and token_ids is not None:
            kwargs["token_ids"] = list(token_ids)
        out = call_with_timeout(
            lambda: term.fn(list(completions), problem, **kwargs), self.timeout_s, self._hung
        )
        values = [float(v) for v in out]
        if len(values) != len(completions):
            raise ValueError(f"returned {len(values)} values for {len(completions)} completions")
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"returned a non-finite value: {values}")
        return values

    def _score_group(self, term: _Term, g: Group) -> list[float]:
        """``term``'s values ``[G]`` for group ``g``, each completion scored against the
        rendering it answered (:meth:`~megagrpo.types.Group.member_slices`: one call for the
        group unless its members answered variants)."""
        parts = []
        for problem, idx in g.member_slices():
            completions, lengths, token_ids = _members(g, idx)
            parts.append((idx, self._score(term, completions, problem, lengths, token_ids)))
        return _scatter(g.size, parts)

    def _score(self, term: _Term, completions, problem, lengths, token_ids) -> list[float]:
        try:
            return self._call(term, completions, problem, lengths, token_ids)
        except RewardError:
            raise
        except RewardTimeout as exc:
            self._timeouts_since_pop += 1
            for i in range(len(completions)):
                self._failed(term, problem, i, exc)
            return [0.0] * len(completions)
        except Exception as exc:  # noqa: BLE001 - isolate per completion below
            if self.on_error == "fail":
                self._failed(term, problem, None, exc)
        values = []
        for i, text in enumerate(completions):
            one_len = None if lengths is None else [lengths[i]]
            one_ids = None if token_ids is None else [token_ids[i]]
            try:
                values.append(self._call(term, [text], problem, one_len, one_ids)[0])
            except RewardError:
                raise
            except Exception as exc:  # noqa: BLE001 - a reward must never crash a step
                if isinstance(exc, RewardTimeout):
                    self._timeouts_since_pop += 1
                self._failed(term, problem, i, exc)
                values.append(0.0)
        return values

    def _failed(self, term: _Term, problem: Problem, index: int | None, exc: Exception) -> None:
        """Count one failed completion (or raise RewardError under on_error=fail)."""
        where = f"problem {problem.id}" + ("" if index is None else f", completion {index}")
        if self.on_error == "fail":
            raise RewardError(
                f"reward '{term.name}' failed on {where}: {type(exc).__name__}: {exc} "
                "(rewards.on_error=fail; 'count' scores it 0 and counts it instead)"
            ) from exc
        self.num_errors += 1
        self._errors_since_pop += 1
        logger.warning(
            "reward '%s' failed on %s: %s: %s", term.name, where, type(exc).__name__, exc
        )

    def pop_metrics(self) -> dict[str, float]:
        """``reward/errors`` (completions whose scoring failed) and ``reward/timeouts`` (calls
        that timed out) since the last pop."""
        out = {
            "reward/errors": float(self._errors_since_pop),
            "reward/timeouts": float(self._timeouts_since_pop),
        }
        self._errors_since_pop = 0
        self._timeouts_since_pop = 0
        return out


def build_composite(cfg: RewardsConfig, run_args: dict[str, Any] | None = None) -> CompositeReward:
    """Build the weighted composite from ``cfg.functions`` (ConfigError on bad entries).

    ``cfg.external_plugins`` are imported first. Names with a ``:`` (``'module:Name'``,
    ``'orms:<name>'``) go through :func:`~megagrpo.rewards.swift_adapter.swift_reward`, which
    checks what it may construct; ``run_args`` (e.g. ``{"max_completion_length": ...}``) are
    offered to ms-swift classes that read settings from ``args``.
    """
    load_external_plugins(cfg.external_plugins)
    terms = []
    for spec in cfg.functions:
        kwargs = dict(spec.kwargs)
        if ":" in spec.name or spec.name.startswith(ORMS_PREFIX):
            fn = swift_reward(spec.name, run_args, **kwargs)
        else:
            fn = get(spec.name, **kwargs)
        terms.append((spec.label or spec.name, spec.weight, fn))
    return CompositeReward(
        terms, on_error=cfg.on_error, timeout_s=cfg.timeout_s, swift_calls=cfg.swift_calls
    )


def _members(g: Group, idx: list[int]) -> tuple[list[str], list[int], list]:
    """(completions, lengths, token_ids) of the completions ``idx`` of ``g`` (a list the
    group leaves empty stays empty); the group's own lists when ``idx`` is all of it."""
    if idx == list(range(g.size)):
        return g.completions, g.lengths, g.token_ids

    def pick(xs: list) -> list:
        return [xs[i] for i in idx] if len(xs) == g.size else []

    return pick(g.completions), pick(g.lengths), pick(g.token_ids)


def _scatter(size: int, parts: list[tuple[list[int], list[float]]]) -> list[float]:
    """Values ``[size]`` from ``(indices, values)`` parts."""
    out = [0.0] * size
    for idx, values in parts:
        for i, v in zip(idx, values):
            out[i] = v
    return out
