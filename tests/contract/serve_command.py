"""The `vllm serve` line of docs/evaluation.md ("Serve the trained adapter"), as the argv
vLLM's own ``vllm serve`` parser takes (the words after ``vllm serve``), with the model and
the adapter directory replaced by the contract tier's tiny Qwen3-MoE and its
``megagrpo export --format vllm`` output. Everything else is the documented line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"


def documented_command() -> list[str]:
    """The words of the documented ``vllm serve ...`` line (continuations joined)."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Serve the trained adapter", 1)[1].split("\n## ", 1)[0]
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            if words[:2] == ["vllm", "serve"]:
                return words
    raise AssertionError(f"{DOC}: no `vllm serve` line under 'Serve the trained adapter'")


def serve_argv(model: Path, adapter: Path) -> list[str]:
    """The documented line's argv after ``vllm serve``, on the tiny model and adapter."""
    words = documented_command()[2:]
    out = [str(model)] + words[1:]  # the base model is the first positional argument
    i = out.index("--lora-modules")
    name, _, _ = out[i + 1].partition("=")
    out[i + 1] = f"{name}={adapter}"
    return out
