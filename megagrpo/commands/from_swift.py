"""`megagrpo from-swift [--out CONFIG.yaml] -- <ms-swift arguments>`: migrate an ms-swift run.

Translates an ms-swift GRPO command line (``swift rlhf --rlhf_type grpo ...`` or ``megatron
rlhf --rlhf_type grpo ...``; leading ``VAR=value`` environment assignments are read for
``NPROC_PER_NODE``/``NNODES``), an ms-swift YAML config (the flat ``flag: value`` file that
``swift rlhf config.yaml`` takes) or a shell script holding such a command, into a complete
megagrpo config: YAML on stdout, or written to ``--out``. The config is loaded through
megagrpo's own schema and validation before it is written.

On stderr it reports, flag by flag, what maps exactly (``=``), what maps with a different
meaning or default (``~``), what is harmless (``-``: logging, run names, hubs, checkpoints,
kernels, placement: how ms-swift runs, not what it trains), what megagrpo does not train
(``x``: out of scope by design, or a value the shell computes) and what from-swift does not
know (``?``: check it), including the ms-swift defaults that differ from megagrpo's and were
applied although the flag was not given (beta, temperature, lora_alpha, epsilon_high,
dynamic_sample, LR schedule, ...). ``x`` and ``?`` stop the config from being written unless
``--allow-partial`` / ``--allow-unknown``. The rules are in :mod:`megagrpo.swift` (the
translator; ms-swift 4.6's flags and defaults: :mod:`megagrpo.swift.catalog`).

example:
  megagrpo from-swift --out configs/mine.yaml -- train_grpo.sh
  megagrpo from-swift --allow-unknown --allow-partial --transformers 5 --out mine.yaml -- \\
      swift rlhf --rlhf_type grpo --model /models/Qwen3-30B-A3B --dataset data.jsonl ...
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from megagrpo import fileio
from megagrpo.errors import ConfigError
from megagrpo.swift.fidelity import blocking, unknown
from megagrpo.swift.shell import Unexpanded
from megagrpo.swift.translate import (
    comment_line,
    input_file,
    read_swift_args,
    report_lines,
    to_config,
    translate,
)

DESCRIPTION = __doc__
log = logging.getLogger(__name__)


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
        "--allow-unknown",
        action="store_true",
        help="write the config although some flags are not known to from-swift (listed "
        "with '?'; they are left out of the config)",
    )
    parser.add_argument(
        "swift_args",
        nargs=argparse.REMAINDER,
        help="-- then the ms-swift command line, a YAML config, or a .sh script",
    )


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


def _env_world_known(env: dict[str, str]) -> bool:
    value = env.get("NPROC_PER_NODE")
    return value is not None and not isinstance(value, Unexpanded)


def _named(entries) -> str:
    return ", ".join(f"--{e.flag}" if e.given else e.flag for e in entries)


def refusal_lines(blockers, unknowns) -> list[str]:
    """Why no config is written: flags megagrpo trains differently (``x``) and flags
    from-swift does not know (``?``), each with the option that writes it anyway."""
    lines = []
    if blockers:
        lines.append(
            f"from-swift: no config written: {len(blockers)} flag(s) train differently in "
            f"megagrpo: {_named(blockers)} (see 'not supported' above; --allow-partial writes "
            "the config anyway)"
        )
    if unknowns:
        lines.append(
            f"from-swift: no config written: {len(unknowns)} flag(s) not known to from-swift: "
            f"{_named(unknowns)}: check what they do in your ms-swift version "
            "(--allow-unknown writes the config without them)"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from megagrpo.config import to_yaml

    _check_out(args.out, input_file(list(args.swift_args)))
    flags, flavor, env = read_swift_args(list(args.swift_args))
    flavor = args.flavor or flavor or "swift"
    if args.world_size:
        env = {k: v for k, v in env.items() if k not in ("NPROC_PER_NODE", "NNODES")}
    world = _world_size(args, env)
    t = translate(
        flags,
        flavor,
        world,
        args.keep_swift_accuracy,
        env,
        args.transformers,
        world_known=bool(args.world_size) or _env_world_known(env),
    )
    print("\n".join(report_lines(t)), file=sys.stderr)
    blockers, unknowns = blocking(t), unknown(t)
    refusals = refusal_lines(
        blockers if not args.allow_partial else [], unknowns if not args.allow_unknown else []
    )
    if refusals:
        print("\n".join(refusals), file=sys.stderr)
        return 2
    cfg = to_config(t)
    source = " ".join(f"--{k} {v}" for k, v in flags.items())
    text = comment_line(f"# megagrpo from-swift ({flavor} rlhf): {source[:300]}") + "\n"
    if blockers:
        partial = ", ".join(e.flag for e in blockers)
        text += comment_line(f"# PARTIAL (--allow-partial): trains differently: {partial}") + "\n"
    if unknowns:
        left = ", ".join(e.flag for e in unknowns)
        text += comment_line(f"# --allow-unknown: not known to from-swift, left out: {left}") + "\n"
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
