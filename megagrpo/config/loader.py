"""Load a run config: YAML file(s) + dotted CLI overrides, checked against the dataclass schema.

Unknown keys and values of the wrong type are errors naming the key (``ConfigError``); each
config dataclass may define ``validate(self, path)`` to check values, and is called once after
merging; the root may define ``resolve()`` to fill derived values once, after validation, and
``RENAMED_KEYS`` (old dotted key -> new one: an old key is an error naming the new). The
resolved config is written to the run directory by :func:`save_config`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megagrpo import fileio
from megagrpo.config.merge import apply_override, describe, keep_words, merge_file
from megagrpo.errors import ConfigError, require  # noqa: F401  (re-export)

T = TypeVar("T")


def load_config(
    schema: type[T],
    paths: list[str | os.PathLike] | None = None,
    overrides: list[str] | None = None,
) -> T:
    """Merge ``paths`` (YAML, in order) then ``overrides`` (``a.b=value``) onto ``schema``.

    Returns a validated instance of the dataclass ``schema``, on which ``resolve()`` (when the
    schema defines it) has filled the derived values.
    Raises ConfigError naming the file or key on any problem.
    """
    cfg = OmegaConf.structured(schema)
    OmegaConf.set_struct(cfg, True)
    renamed: dict[str, str] = getattr(schema, "RENAMED_KEYS", {})
    for p in paths or []:
        p = Path(p)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = OmegaConf.load(p)
        except Exception as exc:  # yaml errors come in many types
            raise ConfigError(f"{p}: cannot parse YAML: {exc}") from exc
        for old, new in renamed.items():
            if isinstance(loaded, DictConfig) and _has_key(loaded, old):
                raise ConfigError(f"{p}: config key '{old}' is now '{new}'")
        keep_words(cfg, loaded, p.read_text(encoding="utf-8"))
        cfg = merge_file(cfg, loaded, p)
    for item in overrides or []:
        key = item.partition("=")[0].strip()
        if key in renamed:
            raise ConfigError(f"override '{item}': config key '{key}' is now '{renamed[key]}'")
        cfg = apply_override(cfg, item)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(describe(exc)) from exc
    if not isinstance(obj, schema):
        raise ConfigError(f"config did not produce a {schema.__name__}")
    validate(obj)
    resolve = getattr(obj, "resolve", None)
    if callable(resolve):  # derived values, filled once before anything saves the config
        resolve()
    return obj


def _has_key(node: DictConfig, dotted: str) -> bool:
    """Whether the loaded YAML ``node`` sets the dotted key (sections are mappings)."""
    *sections, key = dotted.split(".")
    for section in sections:
        child = node.get(section) if isinstance(node, DictConfig) else None
        if not isinstance(child, DictConfig):
            return False
        node = child
    return key in node


def validate(obj: Any, path: str = "") -> None:
    """Call ``validate(path)`` on every nested config dataclass, depth first."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        validate(getattr(obj, f.name), f"{path}{f.name}.")
    check = getattr(obj, "validate", None)
    if callable(check):
        check(path.rstrip("."))


def to_yaml(obj: Any) -> str:
    """The resolved config as YAML text."""
    return OmegaConf.to_yaml(OmegaConf.structured(obj))


def save_config(obj: Any, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config to ``run_dir/config.yaml`` atomically; returns the path."""
    return fileio.write_text(Path(run_dir) / "config.yaml", to_yaml(obj))
