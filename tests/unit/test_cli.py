"""The `megagrpo` entry point: --help lists every subcommand; every registered module exists."""

from __future__ import annotations

import importlib
import subprocess
import sys

from megagrpo.cli import COMMANDS, main


def test_help_lists_all_commands():
    out = subprocess.run(
        [sys.executable, "-m", "megagrpo.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in COMMANDS:
        assert name in out


def test_every_command_module_has_the_protocol():
    for name, (module, _help) in COMMANDS.items():
        mod = importlib.import_module(module)
        assert callable(getattr(mod, "add_arguments", None)), name
        assert callable(getattr(mod, "run", None)), name


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out
