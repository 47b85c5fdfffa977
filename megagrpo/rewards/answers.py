"""What guessing scores, read the way the rewards read answers: the best constant answer and
chance on a question set, the answer-bias of a step's completions, and the guessing metrics
of a held-out evaluation. The statistics that need no answer reading (the Wilson interval,
the verdict, the warning) are :mod:`megagrpo.metrics.answers`."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megagrpo.metrics.answers import LETTERS, answer_shares


@dataclass(frozen=True)
class GuessBaselines:
    """What question-blind answering scores on a question set."""

    best_constant: float
    """Accuracy of the best single answer given to every question."""
    best_answer: str
    """That answer (``""`` when no single letter is right for any question)."""
    chance: float
    """Expected accuracy of one option drawn uniformly per question."""


def guess_baselines(golds: Sequence[Sequence[str]], options: Sequence[str]) -> GuessBaselines:
    """Baselines for questions with gold answer sets ``golds`` and option letters
    ``options[i]`` (``"abcd"``). A single letter counts as right where
    :func:`megagrpo.rewards.mcq.answers_match` accepts it (a multi-answer gold: never)."""
    from megagrpo.rewards.mcq import answers_match

    if len(golds) != len(options):
        raise ValueError(f"{len(golds)} golds but {len(options)} option sets")
    if not golds:
        return GuessBaselines(0.0, "", 0.0)
    hits: Counter[str] = Counter()
    chance = 0.0
    for gold, letters in zip(golds, options):
        right = [c for c in letters if answers_match([c], list(gold))]
        hits.update(right)
        chance += len(right) / len(letters) if letters else 0.0
    n = len(golds)
    if not hits:
        return GuessBaselines(0.0, "", chance / n)
    letter, count = min(hits.items(), key=lambda kv: (-kv[1], kv[0]))
    return GuessBaselines(count / n, letter, chance / n)


NONE = "none"
"""The answer key of a completion with no readable answer."""


def member_answers(groups: Sequence[Any]) -> list[tuple[Any, int, str, list[str]]]:
    """``(group, index, answer key, gold)`` of every multiple-choice completion, each member
    read against its own rendering (the key: ``"c"``, ``"c,d"``, :data:`NONE`)."""
    from megagrpo.rewards.mcq import extract_answer

    out = []
    for g in groups:
        if not g.problem.meta.get("choices"):
            continue
        for problem, idx in g.member_slices():
            for i in idx:
                letters = extract_answer(g.completions[i], problem)
                out.append((g, i, ",".join(letters) if letters else NONE, list(problem.answer)))
    return out


def answer_bias(groups: Sequence[Any]) -> dict[str, float]:
    """``collapse/answer_bias``: share of the most common answer among the completions of
    ``groups`` (multiple-choice problems only; unreadable answers count in the total), and
    ``collapse/answer_bias_gold``: the share of those completions whose problem that answer
    is right for (what a policy that solves every problem would show);
    ``collapse/answer_bias_letter``: that answer as an index (0 = ``a``; NaN for a
    multi-letter answer). NaN without multiple-choice completions."""
    from megagrpo.rewards.mcq import answers_match

    rows = member_answers(groups)
    answers = [key for _, _, key, _ in rows]
    golds = [gold for *_, gold in rows]
    given = [a for a in answers if a != NONE]
    if not given:
        return dict.fromkeys(
            ("collapse/answer_bias", "collapse/answer_bias_gold", "collapse/answer_bias_letter"),
            math.nan,
        )
    top, count = min(Counter(given).items(), key=lambda kv: (-kv[1], kv[0]))
    right = sum(answers_match(top.split(","), gold) for gold in golds)
    return {
        "collapse/answer_bias": count / len(answers),
        "collapse/answer_bias_gold": right / len(answers),
        "collapse/answer_bias_letter": float(LETTERS.index(top)) if top in LETTERS else math.nan,
    }


def eval_guess_metrics(problems: Sequence[Any], predictions: Sequence[str]) -> dict[str, float]:
    """Held-out metrics next to ``eval/accuracy``: ``eval/best_constant`` and
    ``eval/chance`` (:func:`guess_baselines` on the multiple-choice ``problems``),
    ``eval/answer_share/<x>`` per answer given (``predictions``: ``"c"``, ``"c,d"``, ``""``;
    ``none``: unreadable) and ``eval/answer_top_share`` (the most common one). Empty when no
    problem has choices."""
    from megagrpo.rewards.mcq import valid_letters

    pairs = [(p, a) for p, a in zip(problems, predictions) if p.meta.get("choices")]
    if not pairs:
        return {}
    base = guess_baselines([p.answer for p, _ in pairs], [valid_letters(p) for p, _ in pairs])
    shares = answer_shares([a for _, a in pairs])
    out = {"eval/best_constant": base.best_constant, "eval/chance": base.chance}
    out["eval/answer_top_share"] = max((v for k, v in shares.items() if k != "none"), default=0.0)
    out.update({f"eval/answer_share/{k}": v for k, v in shares.items()})
    return out
