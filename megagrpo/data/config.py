"""Problem-data config."""

from __future__ import annotations

from dataclasses import dataclass, field

from megagrpo.errors import require


@dataclass
class PromptConfig:
    """How a problem becomes chat messages (see megagrpo.data.prompts)."""

    system: str = "default"
    """System prompt text, or "default" for the built-in Japanese instruction."""
    user_template: str = "default"
    """User message template with {question} and {choices}, or "default"."""


@dataclass
class DataConfig:
    """Where training/eval problems come from."""

    train: list[str] = field(default_factory=list)
    """Training problem files or directories (IgakuQA EXAM-BLOCK.jsonl or ms-swift JSONL)."""
    eval: list[str] = field(default_factory=list)
    """Held-out problem files or directories for periodic evaluation."""
    exclude_images: bool = True
    """Skip IgakuQA questions with text_only: false (counted and reported, never silent)."""
    prompt: PromptConfig = field(default_factory=PromptConfig)

    def validate(self, path: str) -> None:
        require(
            all(isinstance(p, str) and p for p in self.train),
            f"{path}.train",
            "entries must be non-empty paths",
        )
