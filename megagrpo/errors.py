"""Project error types: user errors name the offending key, file or line."""


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
