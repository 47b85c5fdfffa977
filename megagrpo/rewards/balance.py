"""``rewards.answer_balance``: a multiple-choice answer given more often than it is right is
worth less, so a policy cannot settle on one letter for the questions it cannot read.

On a multiple-choice set a GRPO policy sharpens onto one answer (answer-bias collapse,
docs/learning.md): the letter it favours is reinforced wherever it happens to be right and
pulled down only where another member of the group was right. A policy that reads the
questions gives each letter about as often as that letter is right. So, over the step's
first generation round (every group, collapsed or not: the policy's own answer mix),

    share(x) = completions answering x / multiple-choice completions
    right(x) = completions whose problem (rendering) x is right for / the same total
    excess(x) = max(0, share(x) - right(x))

and in every trained group each completion answering x gets ``-answer_balance * excess(x)``,
centred on the group's mean, added to its advantage (an unreadable answer is the answer
``none``, right for nothing: its excess is its share). The term is added after the group
normalisation, not divided by the group's std: it shifts credit between the members by at
most ``answer_balance * excess`` and never outweighs being right (the correctness advantage
of a trained group is about 1 in size). Within a group whose golds agree, a right answer of an
over-used letter is reinforced less and a wrong one pulled down more, a wrong answer of a
letter given less often than it is right is pulled down less.

The first version subtracted the penalty from the rewards before dynamic sampling: groups of
wrong answers with different letters then counted as valid and, normalised by their small
std, filled the batches with full-size letter-only advantages; no seed of the demo learned
(docs/learning.md, "Answer balance"). Applied to the advantages, the rewards, the dynamic
sampler's choice, the collapse metrics, the held-out evaluation, the best constant answer and
``collapse/answer_bias`` are all unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from megagrpo.rewards.answers import NONE, member_answers


def answer_excess(groups: Sequence[Any]) -> dict[str, float]:
    """``excess(x)`` (module docstring) of every answer ``x`` given in ``groups`` with a
    positive excess; empty without multiple-choice completions."""
    from megagrpo.rewards.mcq import answers_match

    rows = member_answers(groups)
    if not rows:
        return {}
    n = len(rows)
    shares = Counter(key for _, _, key, _ in rows)
    out = {}
    for key, count in shares.items():
        right = 0 if key == NONE else sum(answers_match(key.split(","), g) for *_, g in rows)
        if count / n > right / n:
            out[key] = count / n - right / n
    return out


def balance_penalties(
    groups: Sequence[Any], excess: dict[str, float], coef: float
) -> list[list[float]]:
    """Per group, each completion's penalty ``coef * excess[its answer]`` ``[G]`` (0 for a
    problem without choices or an answer without excess)."""
    out = [[0.0] * g.size for g in groups]
    index = {id(g): j for j, g in enumerate(groups)}
    for g, i, key, _ in member_answers(groups):
        out[index[id(g)]][i] = coef * excess.get(key, 0.0)
    return out
