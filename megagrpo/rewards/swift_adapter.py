"""Use an ms-swift ORM reward plugin as a megagrpo reward function.

ms-swift reward plugins follow one call convention: an object (usually a subclass of
``swift.rewards.ORM``) or a function called as ``__call__(completions, **kwargs) ->
list[float]``, where every keyword is a per-completion list: the dataset's columns
(``solution``, ...), ``messages`` and ``response_token_ids``. A reward name of the form
``'module.path:ClassName'`` imports that object (the module may import ``swift``, which comes
with the ``swift`` extra: ``pip install 'megagrpo[swift]'``).

Construction: ms-swift 4.x builds reward classes as ``cls(args=trainer_args)`` and reads
settings from that object (``SoftOverlong`` reads ``args.soft_max_length``). A class whose
``__init__`` takes ``args`` therefore gets ``args=SimpleNamespace(**spec.kwargs)`` (plus the
kwargs it names, or all of them if it takes ``**kwargs``); any other class gets
``cls(**spec.kwargs)``. Functions are used as they are. ``async`` ORMs are awaited.

Call: like ms-swift's ``compute_rewards_per_func``: ``trainer_state=None`` and per-completion
columns ``solution`` (``meta['solution']`` for ms-swift JSONL problems, else the gold answers
joined by ``,``), ``problem_id``, every ``meta`` key, ``messages`` (the prompt plus the
completion as the last assistant message) and ``response_token_ids`` (the real ids when
given, else placeholder lists of the right length: enough for length rewards like
``SoftOverlong``, not for decoding).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from megagrpo.errors import ConfigError
from megagrpo.types import Problem


def load_object(path: str) -> Any:
    """Import ``'module.path:Name'``; ConfigError naming the path when it cannot."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"reward '{path}': expected 'module.path:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = (
            " (install the swift extra: pip install 'megagrpo[swift]')"
            if "swift" in str(exc)
            else ""
        )
        raise ConfigError(f"reward '{path}': cannot import {module_name}: {exc}{hint}") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"reward '{path}': {module_name} has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


class SwiftORMReward:
    """An ms-swift ORM (``__call__(completions, **kwargs) -> list[float]``) as a megagrpo reward
    ``(completions [G], problem, lengths=None, token_ids=None) -> [G]``."""

    def __init__(self, orm: Any, name: str = "") -> None:
        if not callable(orm):
            raise ConfigError(f"reward '{name}': {orm!r} is not callable")
        self.orm = orm
        self.name = name or type(orm).__name__

    def __call__(
        self,
        completions: list[str],
        problem: Problem,
        lengths: Sequence[int] | None = None,
        token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[float]:
        n = len(completions)
        columns: dict[str, Any] = {k: v for k, v in problem.meta.items()}
        columns["solution"] = problem.meta.get("solution", ",".join(problem.answer))
        columns["problem_id"] = problem.id
        kwargs: dict[str, Any] = {k: [v] * n for k, v in columns.items()}
        kwargs["messages"] = [
            list(problem.messages) + [{"role": "assistant", "content": c}] for c in completions
        ]
        kwargs["trainer_state"] = None
        if token_ids is not None:
            kwargs["response_token_ids"] = [list(t) for t in token_ids]
        elif lengths is not None:
            kwargs["response_token_ids"] = [[0] * int(length) for length in lengths]
        out = self.orm(list(completions), **kwargs)
        if inspect.isawaitable(out):
            out = asyncio.run(_await(out))
        values = [float(v) for v in out]
        if len(values) != n:
            raise ValueError(
                f"ms-swift reward {self.name} returned {len(values)} values for {n} completions"
            )
        return values


def swift_reward(path: str, **kwargs: Any) -> SwiftORMReward:
    """Build the adapter for ``'module.path:ClassName'`` (classes get ``**kwargs``)."""
    obj = load_object(path)
    if inspect.isclass(obj):
        try:
            obj = _construct(obj, kwargs)
        except (TypeError, AttributeError, AssertionError) as exc:
            raise ConfigError(
                f"reward '{path}': cannot construct with {kwargs}: {type(exc).__name__}: {exc}"
            ) from exc
    elif kwargs:
        raise ConfigError(f"reward '{path}' is not a class; it takes no kwargs (got {kwargs})")
    return SwiftORMReward(obj, name=path)


def _construct(cls: type, kwargs: dict[str, Any]) -> Any:
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
    return cls(args=SimpleNamespace(**kwargs), **passed)


async def _await(awaitable: Any) -> Any:
    return await awaitable
