"""`megagrpo` command line: one subcommand per job.

Each subcommand lives in its own module of :mod:`megagrpo.commands` exposing
``add_arguments(parser)`` and ``run(args) -> int``; the registry below maps names to (module,
one-line help). Modules are imported only when their subcommand runs, so ``megagrpo --help``
is instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from megagrpo.errors import MegagrpoError

# name -> (module, one-line help). Keep sorted by the order a user meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "megagrpo.commands.train",
        "run GRPO training from a YAML config (+ key=value overrides); --resume continues",
    ),
    "profile": (
        "megagrpo.commands.profile",
        "sample k answers per problem and write AlphaMed difficulty levels L1-L6",
    ),
    "plan": (
        "megagrpo.commands.plan",
        "simulate curriculum + dynamic sampling: predicted collapse before renting a GPU",
    ),
    "plan-memory": (
        "megagrpo.commands.plan_memory",
        "per-GPU memory plan for a config's parallel layout (fits on 80 GB H100?)",
    ),
    "preflight": (
        "megagrpo.commands.preflight",
        "the exact config on a 2-layer copy of the model: every phase, memory vs plan",
    ),
    "score": (
        "megagrpo.commands.score",
        "official IgakuQA scoring of prediction files against gold files",
    ),
    "eval": (
        "megagrpo.commands.eval",
        "IgakuQA eval of the model (+ adapter / training step): official score per exam, 禁忌肢",
    ),
    "export": (
        "megagrpo.commands.export",
        "turn a training checkpoint (any layout) into a PEFT adapter or a merged HF model",
    ),
    "from-swift": (
        "megagrpo.commands.from_swift",
        "translate an ms-swift GRPO command line into a megagrpo config, flag by flag",
    ),
    "report": (
        "megagrpo.commands.report",
        "draw PNG plots (raw ACR vs post-filter, reward, length, levels, time) from a run",
    ),
    "verify-model": (
        "megagrpo.commands.verify_model",
        "check the Megatron model's logits against transformers (launches gloo ranks)",
    ),
    "verify-rollout": (
        "megagrpo.commands.verify_rollout",
        "check rollout log-probs vs the trainer's model and that weight sync works",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megagrpo",
        description="GRPO post-training of large MoE LLMs on Megatron-core, with a curriculum "
        "that keeps advantage collapse visible and avoidable.",
        epilog="Run 'megagrpo COMMAND --help' for a command's options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Parse only the command name here; the command's own parser takes the rest.
    top, rest = parser.parse_known_args(argv)
    # Under a launcher (torchrun sets RANK) one process speaks for the run; the others warn.
    quiet = os.environ.get("RANK", "0") != "0" and not top.verbose
    logging.basicConfig(
        level=logging.DEBUG if top.verbose else logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if top.command is None:
        parser.print_help()
        return 2
    module_name, help_text = COMMANDS[top.command]
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(
        prog=f"megagrpo {top.command}",
        description=getattr(module, "DESCRIPTION", help_text),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(sub)
    try:  # key=value overrides may follow the options (megagrpo eval CONFIG --data D k=v)
        args = sub.parse_intermixed_args(rest)
    except TypeError:  # a parser argparse cannot intermix (from-swift's remainder)
        args = sub.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except MegagrpoError as exc:
        print(f"megagrpo {top.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
