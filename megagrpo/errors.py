"""Project error types: user errors name the offending key, file or line."""

import functools
import math
import os
import typing
from pathlib import Path


class MegagrpoError(Exception):
    """Base class for errors caused by user input (configs, data, checkpoints)."""


class ConfigError(MegagrpoError, ValueError):
    """A config key is unknown, has the wrong type, or an invalid value (message names it)."""


class DataError(MegagrpoError, ValueError):
    """A data file is malformed (message names the file and line) or inconsistent."""


class CheckpointError(MegagrpoError):
    """A checkpoint is missing, incomplete or does not match the model/layout."""


def not_utf8(path: str | os.PathLike) -> DataError:
    """DataError naming the first byte of ``path`` that is not UTF-8 (file:line, column).

    Text-mode reads raise ``UnicodeDecodeError`` with an offset into an internal chunk and no
    file name; this re-reads the raw bytes to say where the problem is.
    """
    raw = Path(path).read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        return DataError(
            f"{path}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {col}); "
            "save the file as UTF-8"
        )
    return DataError(f"{path}: not UTF-8")  # pragma: no cover - the caller saw a decode error


def require(cond: bool, key: str, msg: str) -> None:
    """Raise ConfigError for ``key`` unless ``cond``: the one-liner config validators use."""
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


@functools.cache
def choices(cls: type, key: str) -> tuple:
    """The allowed values of config field ``key`` of dataclass ``cls``: the values of its
    ``Literal[...]`` annotation (the one place a key's choices are written)."""
    return typing.get_args(typing.get_type_hints(cls)[key])


def require_choice(obj: object, key: str, path: str) -> None:
    """Raise ConfigError for ``path.key`` unless ``obj.key`` is one of :func:`choices`."""
    allowed, value = choices(type(obj), key), getattr(obj, key)
    require(value in allowed, f"{path}.{key}", f"must be one of {allowed}, got {value!r}")


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
