"""Problem data: IgakuQA and ms-swift JSONL loaders, gold parsing, prompt rendering and the
over-long prompt policy."""

from megagrpo.data.gold import parse_gold
from megagrpo.data.loader import ProblemList, iter_jsonl_files, load_problems, read_jsonl
from megagrpo.data.prompts import prompt_ids, render_messages, render_prompt_text
from megagrpo.data.truncation import (
    PromptPolicyResult,
    apply_prompt_policy,
    resolve_max_prompt_tokens,
)

__all__ = [
    "ProblemList",
    "PromptPolicyResult",
    "apply_prompt_policy",
    "iter_jsonl_files",
    "load_problems",
    "parse_gold",
    "prompt_ids",
    "read_jsonl",
    "render_messages",
    "render_prompt_text",
    "resolve_max_prompt_tokens",
]
