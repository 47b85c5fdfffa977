"""Read an ms-swift GRPO launch (command line, YAML config or shell script) and translate it
flag by flag into megagrpo config overrides (:func:`translate`), then into a validated
:class:`~megagrpo.trainer.config.RunConfig` (:func:`to_config`).

The rules live beside this module: :mod:`~megagrpo.swift.flags` (tables, defaults,
statuses), :mod:`~megagrpo.swift.flags_run` (data, rewards, optimiser),
:mod:`~megagrpo.swift.batching` (batch sizes, launchers), :mod:`~megagrpo.swift.advantage`,
:mod:`~megagrpo.swift.fidelity` (the checks against ms-swift 4.6's own behaviour) and
:mod:`~megagrpo.swift.shell` (the shell reader).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from megagrpo import fileio
from megagrpo.errors import ConfigError, not_utf8
from megagrpo.swift.advantage import translate_advantage
from megagrpo.swift.batching import translate_batches, translate_launch
from megagrpo.swift.fidelity import (
    check_values,
    translate_architecture,
    translate_curriculum,
    translate_dtype,
    translate_loss_type,
    translate_old_logprobs,
    translate_tuner,
    translate_unexpanded,
    translate_unsupported,
)
from megagrpo.swift.flags import (
    DIFFERS,
    EXACT,
    HARMLESS,
    MISSING,
    UNKNOWN,
    Translation,
    translate_algorithm,
    translate_lengths,
    translate_model,
    translate_rollout,
)
from megagrpo.swift.flags_extra import translate_extra
from megagrpo.swift.flags_run import translate_data_rewards, translate_optim
from megagrpo.swift.shell import Unexpanded, command_from_script, read_launcher
from megagrpo.swift.status import apply_renames, classify_rest, restore_names
from megagrpo.swift.steps import translate_steps

MARKS = {EXACT: "=", DIFFERS: "~", HARMLESS: "-", MISSING: "x", UNKNOWN: "?"}
HEADINGS = {
    EXACT: "maps exactly",
    DIFFERS: "maps with a different meaning or default",
    HARMLESS: "harmless: changes how ms-swift runs or logs, not what it trains (not carried over)",
    MISSING: "not supported: trains differently in megagrpo (out of scope by design, or a "
    "value the shell computes)",
    UNKNOWN: "not known to from-swift: check what these do in your ms-swift version",
}


# ----------------------------------------------------------------------------- parsing


def _scalar(text: str) -> Any:
    """``true`` -> True, ``8`` -> 8, ``1e-6`` -> 1e-6, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _word_value(text: str, word: str) -> Any:
    """A flag's value: typed (:func:`_scalar`), or left :class:`Unexpanded` as written."""
    return Unexpanded(text) if isinstance(word, Unexpanded) else _scalar(text)


def parse_tokens(tokens: list[str]) -> tuple[dict[str, Any], str | None, dict[str, str]]:
    """``(flags, flavor, env)`` from a tokenised command: leading ``VAR=value`` assignments,
    the launcher (``swift rlhf``, ``megatron rlhf``, ``python -m swift.cli.rlhf``,
    ``torchrun ... swift/cli/rlhf.py``: :func:`read_launcher`), then ``--flag value...`` /
    ``--flag=value`` / ``--flag``."""
    env: dict[str, str] = {}
    i = 0
    while i < len(tokens) and "=" in tokens[i] and not tokens[i].startswith("-"):
        key, _, value = tokens[i].partition("=")
        env[key] = Unexpanded(value) if isinstance(tokens[i], Unexpanded) else value
        i += 1
    i, flavor, launch = read_launcher(tokens, i)
    for key, value in launch.items():
        env.setdefault(key, value)
    flags: dict[str, Any] = {}
    name = None
    for tok in tokens[i:]:
        if tok.startswith("--"):
            name, eq, value = tok[2:].partition("=")
            name = name.replace("-", "_")
            if name in flags:
                raise ConfigError(f"--{name} given twice")
            flags[name] = _word_value(value, tok) if eq else True
            name = None if eq else name
        elif name is None:
            raise ConfigError(f"value {tok!r} without a --flag")
        else:
            v = _word_value(tok, tok)
            prev = flags[name]
            flags[name] = v if prev is True else (prev if isinstance(prev, list) else [prev]) + [v]
    return flags, flavor, env


MAX_INPUT_BYTES = 4 << 20
"""The largest YAML config or shell script from-swift reads (launch files are kilobytes)."""


def input_file(args: list[str]) -> Path | None:
    """The YAML config or shell script ``args`` name (None: a command line)."""
    args = args[1:] if args and args[0] == "--" else args
    if len(args) == 1 and args[0].endswith((".yaml", ".yml", ".json", ".sh")):
        return Path(args[0])
    return None


def _read_text(path: Path, what: str) -> str:
    """The UTF-8 text of ``path``; ConfigError/DataError naming it (missing, unreadable,
    larger than :data:`MAX_INPUT_BYTES`, not UTF-8: file:line)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_INPUT_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what} ({exc.strerror})") from None
    if len(data) > MAX_INPUT_BYTES:
        raise ConfigError(f"{path}: over {MAX_INPUT_BYTES >> 20} MiB, not an ms-swift {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise not_utf8(path) from None


def _flag_value(value: Any, key: str, path: Path) -> Any:
    """A YAML config's flag value: a scalar, or a list / mapping of scalars (``columns``)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    if any(isinstance(v, dict | list) for v in items) or not isinstance(
        value, dict | list | str | int | float | bool | type(None)
    ):
        raise ConfigError(f"{path}: '{key}': expected a value or a list of values")
    return value


def _read_yaml(path: Path) -> tuple[dict[str, Any], str | None, dict[str, str]]:
    text = _read_text(path, "YAML config")
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{path}: cannot read an ms-swift YAML config: {why}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: an ms-swift config is a mapping of flag: value")
    env = data.pop("ENV", None) or {}
    if not isinstance(env, dict) or any(isinstance(v, dict | list) for v in env.values()):
        raise ConfigError(f"{path}: 'ENV' must be a mapping of VARIABLE: value")
    flags = {str(k).replace("-", "_"): _flag_value(v, str(k), path) for k, v in data.items()}
    return flags, None, {str(k): str(v) for k, v in env.items()}


def read_swift_args(args: list[str]) -> tuple[dict[str, Any], str | None, dict[str, str]]:
    """Flags from a command line, an ms-swift YAML config, or a shell script (one command)."""
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        raise ConfigError("give the ms-swift command after --, or a YAML config / .sh script")
    for arg in args:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"argument {arg!r:.60}: not UTF-8") from None
    path = input_file(args)
    if path is not None and path.suffix == ".sh":
        return parse_tokens(command_from_script(_read_text(path, "launch script")))
    if path is not None:
        return _read_yaml(path)
    return parse_tokens(list(args))


# ----------------------------------------------------------------------------- translate


def translate(
    flags: dict[str, Any],
    flavor: str = "swift",
    world_size: int = 1,
    keep_swift_accuracy: bool = False,
    env: dict[str, str] | None = None,
    transformers_major: int = 5,
    world_known: bool | None = None,
) -> Translation:
    """Every rule of :mod:`~megagrpo.swift.flags`, then the flags no rule took
    (:func:`~megagrpo.swift.status.classify_rest`). ``world_known``: the world size was given
    (--world-size, NPROC_PER_NODE); default: ``world_size > 1`` or NPROC_PER_NODE in ``env``."""
    check_values(flags)
    t = Translation(dict(flags), flavor, world_size, transformers_major)
    env = env or {}
    nproc = env.get("NPROC_PER_NODE")
    t.world_known = (
        world_known
        if world_known is not None
        else world_size > 1 or (nproc is not None and not isinstance(nproc, Unexpanded))
    )
    t.world_from_shell = any(
        isinstance(env.get(k), Unexpanded) for k in ("NPROC_PER_NODE", "NNODES", "TORCHRUN")
    )
    apply_renames(t)
    translate_unexpanded(t, env)
    translate_tuner(t)
    translate_algorithm(t)
    translate_advantage(t)
    lay = translate_batches(t)
    translate_loss_type(t, lay)
    translate_model(t)
    translate_extra(t)
    translate_architecture(t)
    translate_dtype(t)
    translate_lengths(t)
    translate_rollout(t)
    translate_optim(t)
    translate_data_rewards(t, keep_swift_accuracy)
    translate_old_logprobs(t)
    translate_steps(t, lay)
    translate_curriculum(t)
    translate_launch(t, env)
    translate_unsupported(t)
    classify_rest(t)
    restore_names(t)
    return t


def to_config(t: Translation) -> Any:
    """The megagrpo RunConfig the overrides describe, loaded and validated by megagrpo."""
    from omegaconf import OmegaConf

    from megagrpo.config import load_config
    from megagrpo.trainer.config import RunConfig

    nested = OmegaConf.create({})
    for key, value in t.overrides.items():  # ms-swift values are text: no interpolation
        OmegaConf.update(nested, key, _literal(value), force_add=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "translated.yaml"
        fileio.write_text(path, OmegaConf.to_yaml(nested))
        return load_config(RunConfig, [path])


def _literal(value: Any) -> Any:
    """``value`` with every string escaped for OmegaConf (:func:`~megagrpo.config.loader.
    literal`): ``--system '${oc.env:HOME}'`` is that text in ms-swift, never the variable."""
    from megagrpo.config.loader import literal

    if isinstance(value, str):
        return literal(value)
    if isinstance(value, list | tuple):
        return [_literal(v) for v in value]
    if isinstance(value, dict):
        return {k: _literal(v) for k, v in value.items()}
    return value


def comment_line(text: str) -> str:
    """``text`` for one YAML comment line: line breaks and other unprintable characters
    escaped (``\\n``), so a value cannot end the comment and become YAML."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def report_lines(t: Translation) -> list[str]:
    """The flag-by-flag report (what stderr shows)."""
    lines = [f"ms-swift ({t.flavor} rlhf, {len(t.flags)} flags) -> megagrpo"]
    for status in (EXACT, DIFFERS, HARMLESS, MISSING, UNKNOWN):
        entries = [e for e in t.entries if e.status == status]
        if not entries:
            continue
        lines.append(f"{HEADINGS[status]}:")
        for e in entries:
            if e.flag.startswith("["):
                shown = f"({e.flag[1:-1]})"
            else:
                shown = f"--{e.flag} {e.value}" if e.given else f"(--{e.flag} not given)"
            keys = ", ".join(f"{k}={v}" for k, v in e.keys.items()) or "-"
            if len(keys) > 90:
                keys = keys[:87] + "..."
            lines.append(f"  {MARKS[status]} {shown:<44} -> {keys}")
            if e.note:
                lines.append(f"      {e.note}")
    return lines
