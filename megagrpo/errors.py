"""Project error types: user errors name the offending key, file or line."""

import math


class MegagrpoError(Exception):
    """Base class for errors caused by user input (configs, data, checkpoints)."""


class ConfigError(MegagrpoError, ValueError):
    """A config key is unknown, has the wrong type, or an invalid value (message names it)."""


class DataError(MegagrpoError, ValueError):
    """A data file is malformed (message names the file and line) or inconsistent."""


class CheckpointError(MegagrpoError):
    """A checkpoint is missing, incomplete or does not match the model/layout."""


def require(cond: bool, key: str, msg: str) -> None:
    """Raise ConfigError for ``key`` unless ``cond``: the one-liner config validators use."""
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


def require_finite(value: object, key: str) -> None:
    """Raise ConfigError for ``key`` unless ``value`` is a finite real number.

    Range checks (``> 0``, ``in [0, 1)``) compare as False for NaN but True for ``inf``, so
    every float key is checked with this first: ``trainer.lr=inf`` or ``loss.entropy_coef=nan``
    would otherwise reach the weights and fail far away, blaming something else.
    """
    finite = (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    )
    require(finite, key, f"must be a finite number, got {value!r}")
