"""from-swift never tracebacks (red team 3: M4, M5, L1, L2): a variable-doubling script stops
at a size limit naming the line, the 8 kinds of bad input that raised end in exit 2 naming
the file, flag or key, ``--out`` never replaces the file it reads, and the header comment and
literal ``${...}`` in values are escaped (the written config loads to the values given)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from megagrpo.cli import main

SWIFT = ["swift", "rlhf", "--rlhf_type", "grpo", "--model", "Qwen/Qwen3-8B"]


def _limits() -> None:  # in the child: 2 GiB of address space, 60 s of CPU
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (60, 60))


def test_a_variable_doubling_script_stops_at_the_size_limit(tmp_path):
    """M4: 39 doubling lines expanded to 18 GB; now exit 2 naming a line, in bounded memory."""
    lines = ['V0="xxxxxxxxxxxxxxxx"'] + [f'V{i}="$V{i - 1}$V{i - 1}"' for i in range(1, 40)]
    script = tmp_path / "s.sh"
    script.write_text("\n".join([*lines, "swift rlhf --rlhf_type grpo --model $V39", ""]))
    proc = subprocess.run(
        [sys.executable, "-m", "megagrpo.cli", "from-swift", "--", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limits,
        env=dict(os.environ),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "script line" in proc.stderr and "MiB" in proc.stderr
    assert "Traceback" not in proc.stderr


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """The red team's 8 kinds: ``{name: (from-swift arguments, what the error names)}``."""
    (tmp_path / "bad.sh").write_bytes(b'swift rlhf --rlhf_type grpo --system "\xff"\n')
    (tmp_path / "bad.yaml").write_bytes(b"model: \xff\n")
    (tmp_path / "env.yaml").write_text("ENV: [a]\nmodel: x\n")
    (tmp_path / "outdir").mkdir()
    partial = ["--allow-partial"]
    return {
        "missing .sh": (["--", str(tmp_path / "nope.sh")], "nope.sh: cannot read"),
        "non-UTF-8 .sh": (["--", str(tmp_path / "bad.sh")], "bad.sh:1: not UTF-8"),
        "non-UTF-8 .yaml": (["--", str(tmp_path / "bad.yaml")], "bad.yaml:1: not UTF-8"),
        "ENV a list": (["--", str(tmp_path / "env.yaml")], "'ENV' must be a mapping"),
        "--columns bad JSON": ([*partial, "--", *SWIFT, "--columns", "{bad"], "--columns"),
        "--num_generations 0": ([*partial, "--", *SWIFT, "--num_generations", "0"], "at least 1"),
        "--out a directory": (
            [*partial, "--out", str(tmp_path / "outdir"), "--", *SWIFT],
            "is a directory",
        ),
        "--out /proc/version": ([*partial, "--out", "/proc/version", "--", *SWIFT], "--out"),
        "--system ${foo": (
            [*partial, "--out", str(tmp_path / "c.yaml"), "--", *SWIFT, "--system", "${foo"],
            "",
        ),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "missing .sh",
        "non-UTF-8 .sh",
        "non-UTF-8 .yaml",
        "ENV a list",
        "--columns bad JSON",
        "--num_generations 0",
        "--out a directory",
        "--out /proc/version",
        "--system ${foo",
    ],
)
def test_bad_input_is_a_named_error_not_a_traceback(tmp_path, capsys, kind):
    """M5: each raised FileNotFoundError, UnicodeDecodeError, AttributeError, JSONDecodeError,
    ZeroDivisionError, IsADirectoryError or GrammarParseError; now exit 2 naming the place
    (``${foo`` is ms-swift text, so it translates: exit 0)."""
    args, named = _bad_inputs(tmp_path)[kind]
    rc = main(["from-swift", *args])
    err = capsys.readouterr().err
    assert rc == (0 if kind == "--system ${foo" else 2), err[-2000:]
    assert named in err


def test_out_never_replaces_the_script_it_reads(tmp_path, capsys):
    """L1: ``from-swift --out s.sh -- s.sh`` replaced the script with the config."""
    script = tmp_path / "s.sh"
    text = "swift rlhf --rlhf_type grpo --model Qwen/Qwen3-8B\n"
    script.write_text(text)
    for out in (script, tmp_path / "." / "s.sh"):
        assert main(["from-swift", "--allow-partial", "--out", str(out), "--", str(script)]) == 2
        assert "is the file it translates" in capsys.readouterr().err
    assert script.read_text() == text


def test_header_comment_and_literal_interpolations_are_escaped(tmp_path, monkeypatch):
    """L2: a newline in ``--system`` ended the header comment (the config did not load);
    ``${oc.env:HOME}`` was written as a live interpolation (it read the environment)."""
    from megagrpo.config import load_config
    from megagrpo.trainer.config import RunConfig

    monkeypatch.setenv("HOME", "/home/somebody")
    for system in ("be brief\nZZZ: 1", "${oc.env:HOME}", "a\\${b} \u2028 c"):
        out = tmp_path / "c.yaml"
        args = ["from-swift", "--allow-partial", "--out", str(out), "--", *SWIFT]
        assert main([*args, "--system", system]) == 0
        header = out.read_text(encoding="utf-8").splitlines()[0]
        assert header.startswith("# megagrpo from-swift") and "\\n" in header or "\n" not in system
        assert load_config(RunConfig, [out]).data.prompt.system == system.strip()
