"""Problem-data config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from megagrpo.errors import require

TRUNCATION = ("delete", "left", "error")
VARIANTS = ("per_member", "rotate", "ignore")


def pairs(entries: list[str], key: str) -> list[tuple[str, str]]:
    """``["a=b", ...]`` -> ``[("a", "b"), ...]``; ConfigError naming ``key`` for an entry
    without ``=`` or with an empty name."""
    out = []
    for i, entry in enumerate(entries):
        name, eq, value = str(entry).partition("=")
        require(bool(eq) and bool(name.strip()), f"{key}.{i}", f"{entry!r} is not 'name=value'")
        out.append((name.strip(), value.strip()))
    return out


@dataclass
class PromptConfig:
    """How a problem becomes chat messages and prompt tokens (see megagrpo.data.prompts)."""

    system: str = "default"
    """System prompt text, or "default" for the built-in Japanese instruction. An explicit
    text is also given to ms-swift rows that carry no system message (ms-swift's --system)."""
    user_template: str = "default"
    """User message template with {question} and {choices}, or "default"."""
    enable_thinking: bool | None = None
    """Chat-template switch of hybrid-thinking models (Qwen3): false renders the empty
    '<think></think>' block so the model answers without reasoning. None: the template's
    default. Shorthand for chat_template_kwargs.enable_thinking."""
    chat_template_kwargs: list[str] = field(default_factory=list)
    """Extra keyword arguments for the tokenizer's apply_chat_template (ms-swift/vLLM
    chat_template_kwargs) as "name=value" entries, the value read as YAML (a list, not a
    mapping, so a later file or override replaces it whole)."""

    def template_kwargs(self, path: str = "data.prompt") -> dict[str, Any]:
        """The keyword arguments the chat template is rendered with."""
        out = {
            k: yaml.safe_load(v)
            for k, v in pairs(self.chat_template_kwargs, f"{path}.chat_template_kwargs")
        }
        if self.enable_thinking is not None:
            out["enable_thinking"] = self.enable_thinking
        return out

    def validate(self, path: str = "data.prompt") -> None:
        given = {
            k: yaml.safe_load(v)
            for k, v in pairs(self.chat_template_kwargs, f"{path}.chat_template_kwargs")
        }
        reserved = {"tokenize", "add_generation_prompt", "conversation", "messages"}
        bad = sorted(reserved & set(given))
        require(not bad, f"{path}.chat_template_kwargs", f"{bad} are set by megagrpo itself")
        require(
            self.enable_thinking is None
            or given.get("enable_thinking", self.enable_thinking) == self.enable_thinking,
            f"{path}.enable_thinking",
            "contradicts chat_template_kwargs enable_thinking",
        )


@dataclass
class DataConfig:
    """Where training/eval problems come from, and how over-long prompts are handled."""

    train: list[str] = field(default_factory=list)
    """Training problem files or directories (IgakuQA EXAM-BLOCK.jsonl, ms-swift messages /
    query-response / sharegpt JSONL)."""
    eval: list[str] = field(default_factory=list)
    """Held-out problem files or directories for periodic evaluation."""
    exclude_images: bool = True
    """Skip IgakuQA questions with text_only: false (counted and reported, never silent)."""
    columns: list[str] = field(default_factory=list)
    """Rename record keys before the format is detected, "source=target" entries (ms-swift
    --columns '{"answer": "solution"}' is ["answer=solution"])."""
    max_prompt_tokens: int = 0
    """Longest prompt in tokens (chat template included); 0: rollout.max_model_len minus
    rollout.max_tokens, so every prompt keeps the full completion budget (ms-swift
    max_length in GRPO)."""
    truncation: str = "delete"
    """What to do with a longer prompt, checked when the data loads: delete (drop the
    problem; counted and logged) | left (keep its last max_prompt_tokens tokens, as ms-swift's
    GRPO default) | error (stop, naming the problems)."""
    variants: str = "per_member"
    """Problems that list 'variants' (equivalent renderings whose gold letter differs, e.g.
    the options in another order; megagrpo.data.variants): per_member | ignore. per_member:
    the G answers of a group go to the variants in turn, so a policy that always gives the
    same letter is right for some members and wrong for others and its groups keep an
    advantage (an answer-bias collapse cannot silence them). rotate: per_member, and every
    problem rendered from a question and choices (IgakuQA) without listed variants gets its
    options' rotations. ignore: only the problem itself. Evaluation and the level profile
    always use the problem itself."""
    prompt: PromptConfig = field(default_factory=PromptConfig)

    def validate(self, path: str) -> None:
        require(
            all(isinstance(p, str) and p for p in self.train),
            f"{path}.train",
            "entries must be non-empty paths",
        )
        require(
            self.variants in VARIANTS,
            f"{path}.variants",
            f"must be one of {VARIANTS}, got {self.variants!r}",
        )
        require(self.max_prompt_tokens >= 0, f"{path}.max_prompt_tokens", "must be >= 0")
        require(
            self.truncation in TRUNCATION,
            f"{path}.truncation",
            f"must be one of {TRUNCATION}, got {self.truncation!r}",
        )
        targets = list(self.column_map(path).values())
        require(
            len(set(targets)) == len(targets),
            f"{path}.columns",
            f"two columns renamed to the same name: {targets}",
        )

    def column_map(self, path: str = "data") -> dict[str, str]:
        """``columns`` as ``{source: target}``."""
        return dict(pairs(self.columns, f"{path}.columns"))
