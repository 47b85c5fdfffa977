"""Prompt rendering: a problem's question and choices become chat messages.

The default asks, in Japanese, for reasoning first and then one final line
``答え: <letters>``, which is what :mod:`megagrpo.rewards` extracts first. Templates are
configurable (``data.prompt.system`` / ``data.prompt.user_template`` with ``{question}``
and ``{choices}`` placeholders).
"""

from __future__ import annotations

from megagrpo.data.config import PromptConfig
from megagrpo.errors import ConfigError

LETTERS = "abcdefghijklmnopqrstuvwxyz"

DEFAULT_SYSTEM = (
    "あなたは日本の医師国家試験の問題に答える医学の専門家です。"
    "まず段階的に考え、最後の行に「答え: 」に続けて選択肢の記号（例: 答え: c、"
    "複数選ぶ場合は 答え: b,d）または数値だけを書いてください。"
)

DEFAULT_USER = "{question}\n\n{choices}"


def format_choices(choices: list[str]) -> str:
    """``["x", "y"]`` -> ``"a. x\\nb. y"``; an empty list (numeric answer) gives ``""``."""
    return "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))


def render_messages(
    question: str, choices: list[str], prompt: PromptConfig | None = None
) -> list[dict[str, str]]:
    """Chat messages ``[system, user]`` for one multiple-choice or numeric question."""
    prompt = prompt or PromptConfig()
    system = DEFAULT_SYSTEM if prompt.system == "default" else prompt.system
    template = DEFAULT_USER if prompt.user_template == "default" else prompt.user_template
    try:
        user = template.format(question=question.strip(), choices=format_choices(choices))
    except (KeyError, IndexError) as exc:
        raise ConfigError(
            f"config key 'data.prompt.user_template': unknown placeholder {exc}; "
            "use {question} and {choices}"
        ) from exc
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user.strip()})
    return messages
