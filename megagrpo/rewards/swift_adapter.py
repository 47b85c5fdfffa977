"""Use an ms-swift ORM reward plugin as a megagrpo reward function.

ms-swift reward plugins follow one call convention: an object (usually a subclass of
``swift.rewards.ORM``) or a function called as ``__call__(completions, **kwargs) ->
list[float]``, where every keyword is a per-completion list: the dataset's columns
(``solution``, ...), ``messages`` and ``response_token_ids``. A reward name of the form
``'module.path:ClassName'`` imports that object (the module may import ``swift``, which comes
with the ``swift`` extra: ``pip install 'megagrpo[swift]'``); classes are instantiated with the
spec's kwargs.

Columns passed: ``solution`` (``meta['solution']`` when the problem came from ms-swift JSONL,
else the gold answers joined by ``,``), ``problem_id``, ``messages`` (the prompt), every
``meta`` key, and ``response_token_ids`` (the real token ids when given, else placeholder
lists of the right length, enough for length-based rewards like ms-swift's SoftOverlong).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
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
        hint = " (install the swift extra: pip install 'megagrpo[swift]')" \
            if "swift" in str(exc) else ""
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

    def __call__(self, completions: list[str], problem: Problem,
                 lengths: Sequence[int] | None = None,
                 token_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
        n = len(completions)
        columns: dict[str, Any] = {k: v for k, v in problem.meta.items()}
        columns["solution"] = problem.meta.get("solution", ",".join(problem.answer))
        columns["problem_id"] = problem.id
        columns["messages"] = problem.messages
        kwargs = {k: [v] * n for k, v in columns.items()}
        if token_ids is not None:
            kwargs["response_token_ids"] = [list(t) for t in token_ids]
        elif lengths is not None:
            kwargs["response_token_ids"] = [[0] * int(length) for length in lengths]
        out = self.orm(list(completions), **kwargs)
        values = [float(v) for v in out]
        if len(values) != n:
            raise ValueError(f"ms-swift reward {self.name} returned {len(values)} values "
                             f"for {n} completions")
        return values


def swift_reward(path: str, **kwargs: Any) -> SwiftORMReward:
    """Build the adapter for ``'module.path:ClassName'`` (classes get ``**kwargs``)."""
    obj = load_object(path)
    if inspect.isclass(obj):
        try:
            obj = obj(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"reward '{path}': cannot construct with {kwargs}: {exc}") from exc
    elif kwargs:
        raise ConfigError(f"reward '{path}' is not a class; it takes no kwargs (got {kwargs})")
    return SwiftORMReward(obj, name=path)
