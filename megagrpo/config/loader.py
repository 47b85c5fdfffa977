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
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.basecontainer import BaseContainer
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
    env = _env_interpolations(OmegaConf.to_container(cfg, resolve=False))
    object.__setattr__(obj, ENV_ATTR, env)
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


ENV_ATTR = "_env_interpolations"
"""Attribute of a loaded config: ``{dotted key: raw text}`` of the values the environment
contributes to (``${oc.env:...}``, directly or through other keys' interpolations)."""

_TAINT = "MEGAGRPOENVTAINT7f3a"
"""What OmegaConf's ``oc.env`` returns while tracing which values the environment reaches."""


def _strings(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(dotted key, text)`` of every string value under ``node`` (list entries by index)."""
    if isinstance(node, dict | list):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            yield from _strings(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, str):
        yield prefix, node


@contextmanager
def _env_traced() -> Iterator[list[str]]:
    """OmegaConf's own ``oc.env`` resolver replaced, inside the block, by one that returns
    :data:`_TAINT` and records each call in the yielded list. Whatever spelling OmegaConf's
    grammar accepts (``${ oc.env : S }``, ``${oc.${k}:S}``, ``${${name}:S}``, quoted, nested
    in other resolvers) reads the environment only through this registry entry, so nothing
    reaches the environment unseen. The registry is global: config loading runs before any
    other thread resolves a config."""
    calls: list[str] = []

    def traced(config: Any, parent: Any, node: Any, args: Any, args_str: Any) -> str:
        calls.append(str(args_str))
        return _TAINT

    registry = BaseContainer._resolvers  # noqa: SLF001 - OmegaConf's resolver registry
    saved = registry.get("oc.env")
    registry["oc.env"] = traced
    try:
        yield calls
    finally:
        if saved is None:
            registry.pop("oc.env", None)
        else:
            registry["oc.env"] = saved


def _env_interpolations(raw: Any) -> dict[str, str]:
    """``{dotted key: raw text}`` of every value the environment contributes to: resolving
    it reads ``oc.env``, in its own text or through keys it interpolates
    (``p-${rewards.functions.1.kwargs.api_key}``), at any depth. Traced by resolving each
    interpolated value with :func:`_env_traced`; a value that cannot be traced counts as one
    (keeping its interpolation text is always safe: it loads again to the same value)."""
    texts = {key: text for key, text in _strings(raw) if "${" in text}
    if not texts:
        return {}
    out: dict[str, str] = {}
    with _env_traced() as calls:
        try:
            traced = OmegaConf.create(raw)
        except OmegaConfBaseException:  # (the config loaded, so not expected): mask them all
            return dict(texts)
        for key, text in texts.items():
            calls.clear()
            try:
                value = OmegaConf.select(traced, key, throw_on_resolution_failure=True)
                if isinstance(value, DictConfig | ListConfig):
                    value = OmegaConf.to_container(value, resolve=True)
            except Exception:  # noqa: BLE001 - untraceable: keep the interpolation
                value = _TAINT
            if calls or _TAINT in str(value):
                out[key] = text
    return out


def literal(text: str) -> str:
    """``text`` escaped so that OmegaConf reads it back as written: ``${`` is not an
    interpolation (``\\${``, the backslashes before it doubled)."""
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)


def _literal_strings(node: Any, keep: set[str], prefix: str = "") -> Any:
    """``node`` with every string value :func:`literal`, except those at the keys ``keep``."""
    if isinstance(node, dict | list):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        done = {
            k: _literal_strings(v, keep, f"{prefix}.{k}" if prefix else str(k)) for k, v in items
        }
        return done if isinstance(node, dict) else list(done.values())
    return literal(node) if isinstance(node, str) and prefix not in keep else node


def env_keys(obj: Any) -> set[str]:
    """Dotted keys of a loaded config whose values the environment contributes to."""
    return set(getattr(obj, ENV_ATTR, {}))


def written(obj: Any) -> dict[str, Any]:
    """The config as a dict for what megagrpo writes (config.yaml, checkpoint manifests, W&B):
    values that came from the environment (``${oc.env:SECRET}``) keep their interpolation
    text instead of the secret; the config loads again to the same values."""
    out = dataclasses.asdict(obj)
    for key, raw in getattr(obj, ENV_ATTR, {}).items():
        node: Any = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = raw
        else:
            node[last] = raw
    return out


def to_yaml(obj: Any) -> str:
    """The config as YAML text (environment values as their interpolation: :func:`written`;
    every other string as a literal, so ``${`` in a prompt stays text when it loads again)."""
    keep = set(getattr(obj, ENV_ATTR, {}))
    return OmegaConf.to_yaml(OmegaConf.create(_literal_strings(written(obj), keep)))


def save_config(obj: Any, run_dir: str | os.PathLike) -> Path:
    """Write the config (:func:`to_yaml`) to ``run_dir/config.yaml`` atomically; returns the
    path."""
    return fileio.write_text(Path(run_dir) / "config.yaml", to_yaml(obj))
