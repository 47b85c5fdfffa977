"""Problem-data config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megagrpo.errors import require

TRUNCATION = ("delete", "left", "error")


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
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the tokenizer's apply_chat_template (ms-swift/vLLM
    chat_template_kwargs)."""

    def template_kwargs(self) -> dict[str, Any]:
        """The keyword arguments the chat template is rendered with."""
        out = dict(self.chat_template_kwargs)
        if self.enable_thinking is not None:
            out["enable_thinking"] = self.enable_thinking
        return out

    def validate(self, path: str = "data.prompt") -> None:
        reserved = {"tokenize", "add_generation_prompt", "conversation", "messages"}
        bad = sorted(reserved & set(self.chat_template_kwargs))
        require(not bad, f"{path}.chat_template_kwargs", f"{bad} are set by megagrpo itself")
        require(
            self.enable_thinking is None
            or self.chat_template_kwargs.get("enable_thinking", self.enable_thinking)
            == self.enable_thinking,
            f"{path}.enable_thinking",
            "contradicts chat_template_kwargs.enable_thinking",
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
    columns: dict[str, str] = field(default_factory=dict)
    """Rename record keys before the format is detected, {source: target} (ms-swift
    --columns), e.g. {answer: solution} or {question: query}."""
    max_prompt_tokens: int = 0
    """Longest prompt in tokens (chat template included); 0: rollout.max_model_len minus
    rollout.max_tokens, so every prompt keeps the full completion budget (ms-swift
    max_length in GRPO)."""
    truncation: str = "delete"
    """What to do with a longer prompt, checked when the data loads: delete (drop the
    problem; counted and logged) | left (keep its last max_prompt_tokens tokens, as ms-swift's
    GRPO default) | error (stop, naming the problems)."""
    prompt: PromptConfig = field(default_factory=PromptConfig)

    def validate(self, path: str) -> None:
        require(
            all(isinstance(p, str) and p for p in self.train),
            f"{path}.train",
            "entries must be non-empty paths",
        )
        require(self.max_prompt_tokens >= 0, f"{path}.max_prompt_tokens", "must be >= 0")
        require(
            self.truncation in TRUNCATION,
            f"{path}.truncation",
            f"must be one of {TRUNCATION}, got {self.truncation!r}",
        )
        targets = list(self.columns.values())
        require(
            len(set(targets)) == len(targets),
            f"{path}.columns",
            f"two columns renamed to the same name: {targets}",
        )
