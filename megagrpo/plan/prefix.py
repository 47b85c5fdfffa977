"""Shared prefix in the plan (``trainer.shared_prefix``): the training tokens with each
group's prompt computed once.

The trainer computes a group's prompt once when it shares it
(:mod:`megagrpo.trainer.prefix_batch`), else once per completion. It shares a group when
the run resolves the key on (``Scenario.shared_prefix``: ``RunConfig.shared_prefix_decision``
for the TE spec) and the group fits one micro-batch: ``P + sum C <= budget``, the budget
being ``trainer.pack_tokens`` or ``micro_batch_size`` rows of ``max_model_len`` (the planner's
micro-batch; the trainer's is ``micro_batch_size`` x the batch's longest sample, at most
that). With G completion lengths from the planner's log-normal, the group total is taken as
normal with mean ``P + G E[C]`` and variance ``G Var[C]``; the fraction of groups that fit
train their prompt once, the others ``G`` times. Renderings (``data.variants``) give a group
several prompts: ``prompts_per_group`` of them, each shared by its members.

The prompt lengths come from ``data.train`` when it and the model's tokenizer are readable
here (:func:`prompt_stats`, a sample of the problems rendered with the chat template as the
engines receive them); otherwise ``Assumptions.mean_prompt_tokens`` (330, range 200-500 in
:data:`megagrpo.plan.ranges.RANGES`) with one rendering per group, and the plan says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SAMPLE = 512
"""Problems of ``data.train`` read to measure the prompt lengths (the first ones)."""


@dataclass(frozen=True)
class PromptStats:
    """Prompt lengths of a run's training data (or the assumption standing in for them)."""

    mean_tokens: float
    prompts_per_group: float
    """Distinct renderings per group (``data.variants``; 1 when ignore or none listed)."""
    source: str
    """Where the figures come from: ``data.train (N prompts, tokenizer of ...)`` or the
    reason the assumption stands."""
    measured: bool


def prompt_stats(cfg: Any, default_tokens: float) -> PromptStats:
    """Mean prompt tokens and renderings per group of ``cfg.data.train`` (a ``RunConfig``)
    rendered by the model's tokenizer; the assumption ``default_tokens`` (and one rendering)
    with the reason when the files or the tokenizer are not here."""
    try:
        from transformers import AutoTokenizer

        from megagrpo.data import load_problems
        from megagrpo.data.prompts import prompt_ids
        from megagrpo.data.variants import rotated_choices
        from megagrpo.model.pretrained import resolve_model_path

        data = cfg.data
        problems = list(
            load_problems(
                data.train,
                exclude_images=data.exclude_images,
                prompt=data.prompt,
                columns=data.column_map(),
            )
        )[:SAMPLE]
        path = resolve_model_path(cfg.model.hf_path, need_tokenizer=True)
        tok = AutoTokenizer.from_pretrained(path)
        lengths = [len(prompt_ids(tok, p)) for p in problems]
    except Exception as exc:  # noqa: BLE001 - any unreadable input: the assumption stands
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        return PromptStats(
            default_tokens, 1.0, f"assumption (data.train not read: {reason})", False
        )
    if not lengths:
        return PromptStats(default_tokens, 1.0, "assumption (data.train holds no problem)", False)
    g = cfg.rollout.group_size
    renderings = []
    for p in problems:  # members answer the listed variants in turn (megagrpo.data.variants)
        n = len(p.meta.get("variants") or [])
        if cfg.data.variants == "rotate" and not n:
            n = len(rotated_choices(p, cfg.data.prompt))
        renderings.append(1 if cfg.data.variants == "ignore" else min(g, max(n, 1)))
    source = f"data.train ({len(lengths)} prompts, tokenizer of {cfg.model.hf_path})"
    mean = sum(lengths) / len(lengths)
    return PromptStats(mean, sum(renderings) / len(renderings), source, True)


def group_fit_fraction(sc: Any, prompt: float, mean_c: float, var_c: float) -> float:
    """Fraction of groups whose ``P + sum C`` fits one micro-batch (module doc)."""
    budget = sc.pack_tokens or sc.micro_batch_size * sc.max_model_len
    g = sc.group_size
    mean = prompt + g * mean_c
    sd = math.sqrt(max(g * var_c, 0.0))
    if sd == 0:
        return 1.0 if mean <= budget else 0.0
    return 0.5 * (1 + math.erf((budget - mean) / (sd * math.sqrt(2))))


def prompt_copies(sc: Any, prompt: float, mean_c: float, second_c: float) -> float:
    """Prompt copies the trainer computes per group: ``G`` without sharing; with it
    ``prompts_per_group`` for the groups that fit a micro-batch, ``G`` for the others.
    ``second_c``: ``E[C^2]``."""
    g = sc.group_size
    if not getattr(sc, "shared_prefix", False):
        return float(g)
    fit = group_fit_fraction(sc, prompt, mean_c, second_c - mean_c**2)
    shared = min(float(g), getattr(sc, "prompts_per_group", 1.0))
    return fit * shared + (1 - fit) * g


def computed_train_tokens(sc: Any, prompt: float, mean_c: float, second_c: float) -> float:
    """Tokens the trainer computes per step: the trained groups' completions, and their
    prompts :func:`prompt_copies` times."""
    copies = prompt_copies(sc, prompt, mean_c, second_c)
    return sc.trained_groups * (copies * prompt + sc.group_size * mean_c)


def saving(prompt: float, completion: float, g: int) -> float:
    """Fraction of the training tokens sharing removes when every group shares one prompt:
    ``(G - 1) P / (G (P + C))``."""
    return (g - 1) * prompt / (g * (prompt + completion))
