"""Reward registry: names -> factories of reward functions.

A reward function maps ``(completions: list[str], problem: Problem) -> list[float]`` (one value
per completion); it may also accept ``lengths`` (completion token lengths) and ``token_ids``,
which the composite passes when the function's signature names them. Register a factory
with ``@register("name")``; ``get("name", **kwargs)`` calls it. A name with a colon,
``'module.path:ClassName'``, loads an ms-swift ORM plugin (:mod:`.swift_adapter`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megagrpo.errors import ConfigError
from megagrpo.rewards.length import soft_overlong
from megagrpo.rewards.mcq import mcq_accuracy
from megagrpo.rewards.toy import toy_first_token

RewardFn = Callable[..., list[float]]

SWIFT_BUILTIN_HINTS = {
    "accuracy": ". ms-swift's 'accuracy' is MathAccuracy (math_verify): it scores 0.0 on every "
    "multiple-choice letter; use mcq_accuracy for MCQ/numeric exams, or 'orms:accuracy' for "
    "ms-swift's own (needs math_verify)",
    "format": ". ms-swift's 'format' is 'orms:format' (<think>...</think><answer>...</answer>)",
    "cosine": ". ms-swift's 'cosine' is 'orms:cosine' (built on MathAccuracy)",
    "repetition": ". ms-swift's 'repetition' is 'orms:repetition'",
    "react_format": ". ms-swift's 'react_format' is 'orms:react_format'",
}
"""ms-swift built-in reward names that are not megagrpo registry names, and what to use."""
_FACTORIES: dict[str, Callable[..., RewardFn]] = {}


def register(name: str) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Decorator: register a factory ``(**kwargs) -> reward function`` under ``name``."""
    if ":" in name:
        raise ValueError(f"reward name '{name}' must not contain ':' (reserved for import paths)")

    def deco(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if name in _FACTORIES and _FACTORIES[name] is not factory:
            raise ValueError(f"reward '{name}' is already registered")
        _FACTORIES[name] = factory
        return factory

    return deco


def names() -> list[str]:
    """Registered reward names."""
    return sorted(_FACTORIES)


def get(name: str, /, **kwargs: Any) -> RewardFn:
    """The reward function called ``name``, built with ``kwargs``.

    ``'module.path:ClassName'`` loads an ms-swift ORM plugin. ConfigError for unknown names
    or bad kwargs.
    """
    if ":" in name:
        from megagrpo.rewards.swift_adapter import swift_reward

        return swift_reward(name, **kwargs)
    if name not in _FACTORIES:
        hint = SWIFT_BUILTIN_HINTS.get(name, "")
        raise ConfigError(
            f"unknown reward '{name}'; known: {', '.join(names())} "
            "(or 'module.path:ClassName' for a plugin, 'orms:<name>' for an ms-swift orms "
            f"registry name){hint}"
        )
    try:
        return _FACTORIES[name](**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"reward '{name}' with kwargs {kwargs}: {exc}") from exc


register("mcq_accuracy")(mcq_accuracy)
register("soft_overlong")(soft_overlong)
register("toy_first_token")(toy_first_token)
