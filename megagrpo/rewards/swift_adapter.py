"""Use an ms-swift ORM reward plugin as a megagrpo reward function.

ms-swift reward plugins follow one call convention: an object (usually a subclass of
``swift.rewards.ORM``) or a function called as ``__call__(completions, **kwargs) ->
list[float]``, where every keyword is a per-completion list: the dataset's columns
(``solution``, ...), ``messages`` and ``response_token_ids``. A reward name of the form
``'module.path:ClassName'`` imports that object (the module may import ``swift``, which comes
with the ``swift`` extra: ``pip install 'megagrpo[swift]'``).

Construction: ms-swift 4.x builds reward classes as ``cls(args=trainer_args)`` and reads
settings from that object (``SoftOverlong`` reads ``args.soft_max_length``). A class whose
``__init__`` takes ``args`` therefore gets ``args=SimpleNamespace(**run_args, **spec.kwargs)``
(``run_args``: run settings ms-swift classes read, such as ``max_completion_length``; plus the
kwargs it names, or all of them if it takes ``**kwargs``); any other class gets
``cls(**spec.kwargs)``. Functions are used as they are. ``async`` ORMs are awaited.

Call: like ms-swift's ``compute_rewards_per_func``: ``trainer_state`` (a :class:`TrainerState`
shared with the composite, see :meth:`~megagrpo.rewards.composite.CompositeReward.begin_step`)
and per-completion columns ``solution`` (``meta['solution']`` for ms-swift JSONL problems,
else the gold answers joined by ``,``), ``problem_id``, every ``meta`` key, ``messages`` (the
prompt plus the completion as the last assistant message) and ``response_token_ids`` (the
real ids when given, else placeholder lists of the right length: enough for length rewards
like ``SoftOverlong``, not for decoding).

What may be named and constructed at all is decided by :mod:`.plugins` (checked before any
construction).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from megagrpo.errors import ConfigError
from megagrpo.rewards.plugins import check_reward_object, load_object
from megagrpo.types import Problem

__all__ = ["SwiftORMReward", "TrainerState", "load_object", "swift_reward"]

BatchItem = tuple[Sequence[str], Problem, "Sequence[int] | None", "Sequence[Sequence[int]] | None"]
"""One group of a batch call: (completions, problem, lengths, token_ids)."""


@dataclass
class TrainerState:
    """The ``trainer_state`` ms-swift passes to ORMs (fields ORM plugins read).

    ``global_step`` counts optimiser steps *completed* before the rewards are computed, as in
    transformers' and Megatron-SWIFT's TrainerState (0 while scoring step 1's rollouts);
    ``iteration`` is the Megatron-SWIFT name of the same number.
    """

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: int = 1
    log_history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def iteration(self) -> int:
        return self.global_step


class SwiftORMReward:
    """An ms-swift ORM (``__call__(completions, **kwargs) -> list[float]``) as a megagrpo reward
    ``(completions [G], problem, lengths=None, token_ids=None) -> [G]``."""

    def __init__(self, orm: Any, name: str = "", trainer_state: TrainerState | None = None) -> None:
        if not callable(orm):
            raise ConfigError(f"reward '{name}': {orm!r} is not callable")
        self.orm = orm
        self.name = name or type(orm).__name__
        self.trainer_state = trainer_state if trainer_state is not None else TrainerState()

    def __call__(
        self,
        completions: list[str],
        problem: Problem,
        lengths: Sequence[int] | None = None,
        token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[float]:
        kwargs = self._columns(completions, problem, lengths, token_ids)
        return self._run(list(completions), kwargs)

    def call_batch(self, items: Sequence[BatchItem]) -> list[list[float]]:
        """One ORM call over every completion of ``items`` (``(completions, problem, lengths,
        token_ids)`` per group), as ms-swift calls an ORM once per batch: a batch-level plugin
        (normalising over the batch, counting calls) sees the same batch. Values per item."""
        columns = [self._columns(c, p, n, t) for c, p, n, t in items]
        keys: list[str] = []
        for col in columns:
            keys += [k for k in col if k not in keys]
        merged: dict[str, Any] = {k: [] for k in keys}
        completions: list[str] = []
        for (texts, *_), col in zip(items, columns):
            completions += list(texts)
            for k in keys:
                merged[k] += col.get(k, [None] * len(texts))
        values = self._run(completions, merged)
        out, start = [], 0
        for texts, *_ in items:
            out.append(values[start : start + len(texts)])
            start += len(texts)
        return out

    def _columns(
        self,
        completions: Sequence[str],
        problem: Problem,
        lengths: Sequence[int] | None,
        token_ids: Sequence[Sequence[int]] | None,
    ) -> dict[str, list[Any]]:
        n = len(completions)
        columns: dict[str, Any] = {k: v for k, v in problem.meta.items()}
        columns["solution"] = problem.meta.get("solution", ",".join(problem.answer))
        columns["problem_id"] = problem.id
        kwargs: dict[str, Any] = {k: [v] * n for k, v in columns.items()}
        kwargs["messages"] = [
            list(problem.messages) + [{"role": "assistant", "content": c}] for c in completions
        ]
        if token_ids is not None:
            kwargs["response_token_ids"] = [list(t) for t in token_ids]
        elif lengths is not None:
            kwargs["response_token_ids"] = [[0] * int(length) for length in lengths]
        return kwargs

    def _run(self, completions: list[str], kwargs: dict[str, Any]) -> list[float]:
        out: Any = self.orm(completions, trainer_state=self.trainer_state, **kwargs)
        if inspect.isawaitable(out):
            out = asyncio.run(_await(out))
        values = [float(v) for v in out]
        if len(values) != len(completions):
            raise ValueError(
                f"ms-swift reward {self.name} returned {len(values)} values for "
                f"{len(completions)} completions"
            )
        return values


def swift_reward(
    path: str, run_args: dict[str, Any] | None = None, **kwargs: Any
) -> SwiftORMReward:
    """Build the adapter for ``'module.path:Name'`` or ``'orms:<name>'``.

    The object is checked by :func:`~megagrpo.rewards.plugins.check_reward_object` before it
    is constructed. Classes get ``**kwargs`` (or ms-swift's ``args`` namespace, holding
    ``run_args``, e.g. ``max_completion_length``, overridden by ``kwargs``).
    """
    obj = load_object(path)
    check_reward_object(obj, path)
    if inspect.isclass(obj):
        try:
            obj = _construct(obj, kwargs, run_args or {})
        except Exception as exc:  # noqa: BLE001 - a plugin constructor may raise anything
            raise ConfigError(
                f"reward '{path}': cannot construct with {kwargs}: {type(exc).__name__}: {exc}"
            ) from exc
    elif kwargs:
        raise ConfigError(f"reward '{path}' is not a class; it takes no kwargs (got {kwargs})")
    return SwiftORMReward(obj, name=path)


def _construct(cls: type, kwargs: dict[str, Any], run_args: dict[str, Any]) -> Any:
    """ms-swift style ``cls(args=namespace)`` when ``__init__`` takes ``args``, else
    ``cls(**kwargs)``."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return cls(**kwargs)
    if "args" not in params or "args" in kwargs:
        return cls(**kwargs)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    passed = {k: v for k, v in kwargs.items() if var_kw or k in params}
    return cls(args=SimpleNamespace(**{**run_args, **kwargs}), **passed)


async def _await(awaitable: Any) -> Any:
    return await awaitable
