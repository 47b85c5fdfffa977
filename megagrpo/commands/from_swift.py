"""`megagrpo from-swift [--out CONFIG.yaml] -- <ms-swift arguments>`: migrate an ms-swift run.

Translates an ms-swift GRPO command line (``swift rlhf --rlhf_type grpo ...`` or ``megatron
rlhf --rlhf_type grpo ...``; leading ``VAR=value`` environment assignments are read for
``NPROC_PER_NODE``/``NNODES``), an ms-swift YAML config (the flat ``flag: value`` file that
``swift rlhf config.yaml`` takes) or a shell script holding such a command, into a complete
megagrpo config: YAML on stdout, or written to ``--out``. The config is loaded through
megagrpo's own schema and validation before it is written.

On stderr it reports, flag by flag, what maps exactly (``=``), what maps with a different
meaning or default (``~``), and what has no equivalent (``x``), including the ms-swift
defaults that differ from megagrpo's and were applied although the flag was not given (beta,
temperature, lora_alpha, epsilon_high, dynamic_sample, LR schedule, ...). The rules are in
:mod:`megagrpo.commands.swift_flags`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from megagrpo import fileio
from megagrpo.commands.swift_advantage import translate_advantage
from megagrpo.commands.swift_batching import translate_batches, translate_launch
from megagrpo.commands.swift_fidelity import (
    blocking,
    check_values,
    translate_architecture,
    translate_curriculum,
    translate_dtype,
    translate_loss_type,
    translate_old_logprobs,
    translate_steps,
    translate_tuner,
    translate_unexpanded,
    translate_unsupported,
)
from megagrpo.commands.swift_flags import (
    DIFFERS,
    EXACT,
    MISSING,
    NO_EQUIVALENT,
    Translation,
    translate_algorithm,
    translate_lengths,
    translate_model,
    translate_rollout,
)
from megagrpo.commands.swift_flags_run import translate_data_rewards, translate_optim
from megagrpo.commands.swift_shell import Unexpanded, command_from_script, read_launcher
from megagrpo.errors import ConfigError, not_utf8

DESCRIPTION = __doc__
log = logging.getLogger(__name__)
MARKS = {EXACT: "=", DIFFERS: "~", MISSING: "x"}
HEADINGS = {
    EXACT: "maps exactly",
    DIFFERS: "maps with a different meaning or default",
    MISSING: "no equivalent in megagrpo (not yet supported or out of scope)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", default=None, metavar="CONFIG.yaml", help="write the config here (default: stdout)"
    )
    parser.add_argument(
        "--flavor",
        choices=("swift", "megatron"),
        default=None,
        help="ms-swift front end whose defaults apply (default: from the command)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes of the ms-swift run (swift rlhf batch size; default "
        "NPROC_PER_NODE x NNODES from the command, else 1)",
    )
    parser.add_argument(
        "--transformers",
        type=int,
        choices=(4, 5),
        default=5,
        help="transformers major version of the ms-swift run (swift rlhf's all-linear on a "
        "MoE model: attention only on 5, ms-swift 4.6's default; also experts and router on 4)",
    )
    parser.add_argument(
        "--keep-swift-accuracy",
        action="store_true",
        help="map 'accuracy' to ms-swift's MathAccuracy, not mcq_accuracy",
    )
    parser.add_argument(
        "--allow-partial",
        action="store_true",
        help="write the config although some flags train differently in megagrpo (listed "
        "as blocking; without this flag from-swift then writes nothing and exits 2)",
    )
    parser.add_argument(
        "swift_args",
        nargs=argparse.REMAINDER,
        help="-- then the ms-swift command line, a YAML config, or a .sh script",
    )


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
) -> Translation:
    """Every rule of :mod:`~megagrpo.commands.swift_flags`, then the flags no rule took."""
    check_values(flags)
    t = Translation(dict(flags), flavor, world_size, transformers_major)
    translate_unexpanded(t, env or {})
    translate_tuner(t)
    translate_algorithm(t)
    translate_advantage(t)
    lay = translate_batches(t)
    translate_loss_type(t, lay)
    translate_model(t)
    translate_architecture(t)
    translate_dtype(t)
    translate_lengths(t)
    translate_rollout(t)
    translate_optim(t)
    translate_data_rewards(t, keep_swift_accuracy)
    translate_old_logprobs(t)
    translate_steps(t, lay)
    translate_curriculum(t)
    translate_launch(t, env or {})
    translate_unsupported(t)
    for flag in flags:
        if flag in t.done:
            continue
        why = NO_EQUIVALENT.get(flag, "unknown to megagrpo from-swift: no equivalent")
        t.add(flag, MISSING, {}, why)
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


def _comment(text: str) -> str:
    """``text`` for one YAML comment line: line breaks and other unprintable characters
    escaped (``\\n``), so a value cannot end the comment and become YAML."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _check_out(out: str | None, source: Path | None) -> None:
    """``--out`` names a file other than the YAML config / script it translates (L1: it
    silently replaced the script) and not a directory; ConfigError otherwise."""
    if not out:
        return
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"--out {out} is a directory: name the config file to write")
    if source is not None and (
        path.resolve() == source.resolve()
        or (path.exists() and source.exists() and os.path.samefile(path, source))
    ):
        raise ConfigError(f"--out {out} is the file it translates ({source}): choose another")


def report_lines(t: Translation) -> list[str]:
    """The flag-by-flag report (what stderr shows)."""
    lines = [f"ms-swift ({t.flavor} rlhf, {len(t.flags)} flags) -> megagrpo"]
    for status in (EXACT, DIFFERS, MISSING):
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


def _world_size(args: argparse.Namespace, env: dict[str, str]) -> int:
    if args.world_size is not None:
        if args.world_size < 1:
            raise ConfigError(f"--world-size {args.world_size}: must be at least 1")
        return int(args.world_size)
    world = 1
    for key in ("NPROC_PER_NODE", "NNODES"):
        value = env.get(key, "1")
        if isinstance(value, Unexpanded):
            continue  # reported by the translation (pass --world-size)
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"{key}={str(value)[:40]!r}: not a number of processes")
        world *= n
    return world


def run(args: argparse.Namespace) -> int:
    from megagrpo.config import to_yaml

    _check_out(args.out, input_file(list(args.swift_args)))
    flags, flavor, env = read_swift_args(list(args.swift_args))
    flavor = args.flavor or flavor or "swift"
    if args.world_size:
        env = {k: v for k, v in env.items() if k not in ("NPROC_PER_NODE", "NNODES")}
    t = translate(
        flags, flavor, _world_size(args, env), args.keep_swift_accuracy, env, args.transformers
    )
    print("\n".join(report_lines(t)), file=sys.stderr)
    blockers = blocking(t)
    if blockers and not args.allow_partial:
        print(
            f"from-swift: no config written: {len(blockers)} flag(s) would train differently "
            "in megagrpo: "
            + ", ".join(f"--{e.flag}" if e.given else e.flag for e in blockers)
            + " (see 'no equivalent' above; --allow-partial writes the config anyway)",
            file=sys.stderr,
        )
        return 2
    cfg = to_config(t)
    source = " ".join(f"--{k} {v}" for k, v in flags.items())
    text = _comment(f"# megagrpo from-swift ({flavor} rlhf): {source[:300]}") + "\n"
    if blockers:
        partial = ", ".join(e.flag for e in blockers)
        text += _comment(f"# PARTIAL (--allow-partial): trains differently: {partial}") + "\n"
    text += to_yaml(cfg)
    if args.out:
        try:
            out = fileio.write_text(args.out, text)
        except OSError as exc:
            raise ConfigError(f"--out {args.out}: cannot write ({exc.strerror})") from None
        print(f"wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
