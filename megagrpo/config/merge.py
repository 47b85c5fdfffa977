"""Merging one YAML file or one ``key=value`` override onto the structured config, with errors
that name the file, the override and the key.

:func:`megagrpo.config.loader.load_config` calls these. Two things OmegaConf alone gets wrong:

* a value whose container type differs from the schema (a YAML file whose top level is a
  list, ``rewards.functions: {0: ...}`` where a list is expected) raises a bare
  ``TypeError: Cannot merge incompatible container types`` naming nothing;
* an override that indexes into a list (``rewards.functions.0.weight=2``) is parsed by
  ``OmegaConf.from_dotlist`` as a mapping with key ``"0"`` and fails the same way. Here such an
  override edits that list entry (the index must exist; lengthen or shorten a list by
  replacing it whole: ``rewards.functions=[...]``).
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import StringNode

from megagrpo.errors import ConfigError


def describe(exc: OmegaConfBaseException) -> str:
    """One line for an OmegaConf error, prefixed with the config key it names (if any)."""
    key = getattr(exc, "full_key", None)
    msg = (getattr(exc, "msg", None) or str(exc)).strip().splitlines()[0]
    return f"config key '{key}': {msg}" if key else msg


def container_mismatch(schema: Any, value: Any, prefix: str = "") -> tuple[str, str] | None:
    """``(dotted key, what the schema expects there)`` for the first key where ``value`` holds
    a mapping and ``schema`` a list, or the other way round (what makes OmegaConf's merge raise
    a bare TypeError); None if there is none."""
    if isinstance(schema, DictConfig) and isinstance(value, DictConfig) and not schema._is_none():
        for key in value:
            if key in schema and not OmegaConf.is_missing(schema, key):
                child = container_mismatch(
                    schema._get_node(key), value._get_node(key), f"{prefix}{key}."
                )
                if child:
                    return child
        return None
    where = prefix.rstrip(".") or "<top level>"
    if isinstance(schema, ListConfig) and isinstance(value, DictConfig):
        return where, "a list"
    if isinstance(schema, DictConfig) and isinstance(value, ListConfig):
        return where, "a mapping"
    return None


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _kind(node: Any) -> str:
    return "a list" if isinstance(node, ListConfig) else type(node).__name__


def merge_file(cfg: DictConfig, loaded: Any, source: str | os.PathLike) -> DictConfig:
    """``cfg`` merged with the YAML content ``loaded`` of file ``source``.

    Raises ConfigError naming the file (and the key) when the top level is not a mapping of
    sections, a value has another container type than the schema, or OmegaConf rejects it.
    """
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"{source}: the top level must be a mapping of sections (model:, trainer:, ...), "
            f"got {_kind(loaded)}"
        )
    mismatch = container_mismatch(cfg, loaded)
    if mismatch:
        where, expected = mismatch
        got = "a mapping" if expected == "a list" else "a list"
        raise ConfigError(f"{source}: config key '{where}': expected {expected}, got {got}")
    try:
        return OmegaConf.merge(cfg, loaded)  # type: ignore[return-value]
    except (OmegaConfBaseException, TypeError) as exc:
        msg = describe(exc) if isinstance(exc, OmegaConfBaseException) else str(exc)
        raise ConfigError(f"{source}: {msg}") from exc


def _first_list_step(cfg: DictConfig, parts: list[str], item: str) -> int | None:
    """Position in ``parts`` of the first index into a list (checked to exist), or None."""
    node: Any = cfg
    for i, part in enumerate(parts):
        if isinstance(node, ListConfig):
            parent = ".".join(parts[:i])
            if node._is_none():
                raise ConfigError(
                    f"override '{item}': config key '{parent}' is null; set it "
                    f"whole: {parent}=[...]"
                )
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"override '{item}': config key '{parent}' has {_entries(len(node))}, no "
                    f"index {part!r}; replace the whole list with {parent}=[...]"
                )
            return i
        if not (isinstance(node, DictConfig) and not node._is_none() and part in node):
            return None  # an unknown key or a leaf: OmegaConf's merge names it
        node = node._get_node(part)
    return None


def _set_path(node: Any, parts: list[str], value: Any, where: str, item: str) -> None:
    """Set ``value`` at ``parts`` inside plain lists/dicts (what the schema merge then checks)."""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = ".".join([where, *parts[:i]])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"override '{item}': config key '{here}' has {_entries(len(node))}, no "
                    f"index {part!r}"
                )
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})  # an unknown key: the merge names it
        else:
            raise ConfigError(f"override '{item}': config key '{here}' is not a list or mapping")


YAML11_WORDS = frozenset({"on", "off", "yes", "no", "y", "n", "true", "false"})
"""Words YAML reads as booleans: kept as written for a string-typed config key (an enum such
as ``trainer.shared_prefix: auto | true | false`` takes ``true`` as the word)."""


def _is_str_key(cfg: DictConfig, key: str) -> bool:
    """Whether the config key holds a string (or is string-typed and null)."""
    try:
        if isinstance(OmegaConf.select(cfg, key, throw_on_missing=False), str):
            return True
    except OmegaConfBaseException:
        return False
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig | ListConfig) or node._is_none():
            return False
        index = int(part) if isinstance(node, ListConfig) and part.isdigit() else part
        try:
            node = node._get_node(index)  # pyright: ignore[reportArgumentType]
        except (OmegaConfBaseException, IndexError, KeyError):
            return False
    return isinstance(node, StringNode)


def _value(cfg: DictConfig, key: str, raw: str, item: str) -> Any:
    """An override's value, read as YAML like ``OmegaConf.from_dotlist`` does. For a string
    key, a YAML 1.1 boolean word stays the word, and text YAML reads as a mapping or a list or
    cannot read at all (``{question} [x]``, ``Answer: A``) is the string as written: the key
    cannot hold anything else. Elsewhere unreadable YAML is an error naming the override."""
    import yaml

    string_key = _is_str_key(cfg, key)
    if string_key and raw.strip().lower() in YAML11_WORDS:
        return raw.strip()  # a word for an enum key, not a YAML 1.1 boolean
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=False)
    except yaml.YAMLError as exc:
        if string_key:
            return raw
        mark = getattr(exc, "problem_mark", None)
        where = f" at column {mark.column + 1}" if mark is not None and not mark.line else ""
        why = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise ConfigError(
            f"override '{item}': config key '{key}': the value is not valid YAML{where} ({why})"
        ) from exc
    assert isinstance(parsed, dict)
    value = parsed["v"]
    return raw if string_key and isinstance(value, dict | list) else value


def keep_words(cfg: DictConfig, loaded: Any, text: str) -> None:
    """In ``loaded`` (a YAML file's content, ``text``), put back the words YAML 1.1 turned
    into booleans (``routing_replay: off`` -> False) where the schema's key is a string: an
    enum such as ``off | r2 | r3`` takes ``off`` as the word."""
    import yaml

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for k, v in node.value:
            key = f"{prefix}{k.value}"
            if isinstance(v, yaml.ScalarNode) and str(v.value).lower() in YAML11_WORDS:
                if not v.style and _is_str_key(cfg, key):
                    OmegaConf.update(loaded, key, v.value, merge=False)
            walk(v, key + ".")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        return  # OmegaConf.load already parsed it; nothing to restore


def _apply(cfg: DictConfig, key: str, raw: str, item: str) -> DictConfig:
    parts = key.split(".")
    step = _first_list_step(cfg, parts, item)
    value = _value(cfg, key, raw, item)
    if step is None:
        nested: Any = value
        for part in reversed(parts):
            nested = {part: nested}
        parsed = OmegaConf.create(nested)
        mismatch = container_mismatch(cfg, parsed)
        if mismatch:
            where, expected = mismatch
            hint = f"; or set one entry: {where}.0...=..." if expected == "a list" else ""
            raise ConfigError(
                f"override '{item}': config key '{where}' is {expected}: set it whole "
                f"({where}=...){hint}"
            )
        return OmegaConf.merge(cfg, parsed)  # type: ignore[return-value]
    # Edit a plain copy of the list and merge it back whole: each entry is then checked
    # against the schema exactly as if the YAML file had listed it.
    list_key = ".".join(parts[:step])
    entries = OmegaConf.to_container(OmegaConf.select(cfg, list_key), resolve=False)
    assert isinstance(entries, list)
    _set_path(entries, parts[step:], value, list_key, item)
    patch: Any = entries
    for part in reversed(parts[:step]):
        patch = {part: patch}
    try:
        return OmegaConf.merge(cfg, OmegaConf.create(patch))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        msg = (getattr(exc, "msg", None) or str(exc)).strip().splitlines()[0]
        raise ConfigError(f"override '{item}': config key '{key}': {msg}") from exc


def apply_override(cfg: DictConfig, item: str) -> DictConfig:
    """``cfg`` with one ``key=value`` override applied (values parsed as YAML, like
    ``OmegaConf.from_dotlist``). Keys may index lists: ``rewards.functions.0.weight=2`` sets
    that entry's weight, ``rewards.functions.0={name: toy}`` replaces the entry; the list is
    then checked entry by entry exactly as if a YAML file had listed it.

    Raises ConfigError naming the override and the key.
    """
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, raw = item.split("=", 1)
    try:
        return _apply(cfg, key.strip(), raw, item)
    except (OmegaConfBaseException, TypeError) as exc:
        msg = describe(exc) if isinstance(exc, OmegaConfBaseException) else str(exc)
        raise ConfigError(f"override '{item}': {msg}") from exc
