"""Prompt rendering: a problem's question and choices become chat messages.

The default asks, in Japanese, for reasoning first and then one final line
``答え: <letters>``, which is what :mod:`megagrpo.rewards` extracts first. Templates are
configurable (``data.prompt.system`` / ``data.prompt.user_template`` with ``{question}``
and ``{choices}`` placeholders).

:func:`prompt_ids` is the one place messages become prompt token ids (chat template with
``data.prompt`` kwargs such as ``enable_thinking``, or the truncated ids the prompt policy
stored); engines and the trainer must all go through it.
"""

from __future__ import annotations

from typing import Any

from megagrpo.data.config import PromptConfig
from megagrpo.errors import ConfigError, DataError
from megagrpo.types import Problem

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


def render_prompt_text(tokenizer: Any, problem: Problem) -> str:
    """The prompt text of ``problem``: its messages through the tokenizer's chat template
    (generation prompt on, with ``meta['chat_template_kwargs']``, e.g. ``enable_thinking``),
    or the contents joined by newlines for a tokenizer without a template."""
    if not problem.messages:
        raise DataError(f"problem {problem.id!r} has no messages")
    if getattr(tokenizer, "chat_template", None):
        kwargs = dict(problem.meta.get("chat_template_kwargs") or {})
        return tokenizer.apply_chat_template(
            problem.messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    return "\n".join(str(m["content"]) for m in problem.messages)


def prompt_ids(tokenizer: Any, problem: Problem) -> list[int]:
    """The prompt token ids ``[P]`` of ``problem`` as every engine and the trainer must see
    them: ``meta['prompt_ids']`` when the truncation policy set it
    (:func:`megagrpo.data.truncation.apply_prompt_policy`), else the rendered prompt text
    (:func:`render_prompt_text`) tokenised with ``add_special_tokens=False`` (the template
    already holds any BOS)."""
    fixed = problem.meta.get("prompt_ids")
    if fixed is not None:
        return [int(t) for t in fixed]
    text = render_prompt_text(tokenizer, problem)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
