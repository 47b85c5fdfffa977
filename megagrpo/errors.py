"""Project error types: user errors name the offending key, file or line."""

import functools
import math
import os
import typing
import unicodedata
from pathlib import Path


class MegagrpoError(Exception):
    """Base class for errors caused by user input (configs, data, checkpoints)."""


class ConfigError(MegagrpoError, ValueError):
    """A config key is unknown, has the wrong type, or an invalid value (message names it)."""


class DataError(MegagrpoError, ValueError):
    """A data file is malformed (message names the file and line) or inconsistent."""


class CheckpointError(MegagrpoError):
    """A checkpoint is missing, incomplete or does not match the model/layout."""


class StorageError(MegagrpoError):
    """A write failed for lack of space or a file size limit; the message names the file and
    the free space (what ``OSError`` from ``write`` does not)."""


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


FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
"""The largest and the smallest positive normal float32 (``torch.finfo(torch.float32)``)."""


def require_fp32(value: object, key: str) -> None:
    """Raise ConfigError for ``key`` unless ``value`` is finite and a float32 number: 0 or
    ``FLOAT32_TINY <= |value| <= FLOAT32_MAX``. For keys that become float32 tensor math (the
    loss, the optimiser, the LoRA scale): beyond it the cast overflows (a raw RuntimeError
    at step 1) or the value rounds to 0 or inf and every step is skipped as non-finite with
    the key unnamed (red team 4, N7)."""
    require_finite(value, key)
    assert isinstance(value, int | float)
    ok = value == 0 or FLOAT32_TINY <= abs(value) <= FLOAT32_MAX
    require(ok, key, f"{value!r} is outside float32's range (0 or 1.2e-38 to 3.4e38 in size)")


_HIDDEN_CATEGORIES = {
    "Cc": "a control character",
    "Cf": "an invisible format character (bidi override, zero-width)",
    "Cs": "a lone surrogate",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a run or a file megagrpo writes (``trainer.name``, ``eval
    --name``), or None: it must be one plain path component (no ``/``, ``\\``, NUL, not
    ``.``/``..``), not hidden (a leading ``.``), not an option (a leading ``-``: ``rm runs/*``
    would read ``-rf`` as one), and hold no character that changes how a listing or a log
    line reads (control characters split log lines and Slurm / W&B names; U+202E makes
    ``ls runs/`` show another name) (red team 4, N18)."""
    if not name or name in (".", ".."):
        return "is empty, '.' or '..'"
    for i, c in enumerate(name):
        if c in "/\\":
            return f"holds {c!r} at {i}: one name, not a path"
        what = _HIDDEN_CATEGORIES.get(unicodedata.category(c))
        if what:
            return f"holds {what} at {i} (U+{ord(c):04X})"
    if name[0] in ".-":
        return f"starts with {name[0]!r} ({'hidden' if name[0] == '.' else 'read as an option'})"
    return None
