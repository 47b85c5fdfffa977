"""Gold answers written the ways ms-swift datasets write them.

:func:`parse_gold` turns a ``solution`` into megagrpo's gold set (lower-case option letters,
or number strings). Datasets prepared for ms-swift's ``MathAccuracy`` wrap the answer
(``<answer> b </answer>``, ``\\boxed{b}``) or prefix a phrase (``答え: b``, ``Answer: b,d``);
splitting those on whitespace gave ``["<answer>", "b", "</answer>"]``, a gold no completion
could match, so ``mcq_accuracy`` silently scored every completion 0. Now the wrapper is
stripped first, and a solution that is still not letters or numbers (free text such as
``"#### 72"`` or a sentence) parses to ``None``: the loader keeps it in ``meta['solution']``
for plugin rewards, counts it, and ``mcq_accuracy`` reports those problems as errors.
"""

from __future__ import annotations

import re

from megagrpo.errors import DataError

_FULLWIDTH = str.maketrans(
    "ａｂｃｄｅｆｇｈＡＢＣＤＥＦＧＨ０１２３４５６７８９：，、．（）",
    "abcdefghabcdefgh0123456789:,,.()",
)
_WRAPPERS = (
    re.compile(r"<answer>(.*?)</answer>", re.S | re.I),
    re.compile(r"\\boxed\{([^{}]*)\}"),
)
_PHRASE = re.compile(
    r"^\s*(?:最終(?:的な)?)?(?:答え|正解|正答|解答|回答|答)\s*(?:は|:|=)?\s*"
    r"|^\s*(?:the\s+)?(?:final\s+|correct\s+)?answers?\s*(?:is|are|:|=)?\s*",
    re.I,
)
_TAIL = re.compile(r"\s*(?:です|である|だ)?\s*[.。]?\s*$")
_SPLIT = re.compile(r"\s*(?:,|/|・|\band\b|と|及び|および)\s*|\s+")
_TOKEN = re.compile(r"^(?:[a-z]|-?\d+(?:\.\d+)?)$")
_RUN = re.compile(r"^[a-h]{2,8}$")


def parse_gold(solution: object) -> list[str] | None:
    """Gold set of ``solution`` (a string or a list of strings), or None for free text.

    Examples: ``"b"`` -> ``["b"]``; ``"a,d"``, ``"Ａ、Ｄ"``, ``"<answer> a, d </answer>"``,
    ``"答え: a,d"``, ``"\\boxed{A and D}"``, ``["a", "d"]`` -> ``["a", "d"]``; ``"36"`` ->
    ``["36"]``; ``"(c)"`` -> ``["c"]``; ``"#### 72"``, ``"The mitochondria"`` -> ``None``.
    Letters keep the written order (scoring compares sets).
    """
    items = solution if isinstance(solution, list) else [solution]
    out: list[str] = []
    for item in items:
        text = str(item).translate(_FULLWIDTH).strip()
        for rx in _WRAPPERS:
            m = rx.search(text)
            if m:
                text = m.group(1)
        text = _TAIL.sub("", _PHRASE.sub("", text.strip())).lower()
        text = re.sub(r"^\((.*)\)$", r"\1", text.strip())
        parts = [p.strip("() ") for p in _SPLIT.split(text) if p.strip("() ")]
        if len(parts) == 1 and _RUN.match(parts[0]) and len(set(parts[0])) == len(parts[0]):
            parts = list(parts[0])  # "cd": a run of distinct option letters
        if not parts or not all(_TOKEN.match(p) for p in parts):
            return None
        out += parts
    return out or None


_WIDE = str.maketrans({**{chr(0xFF01 + i): chr(0x21 + i) for i in range(0x5E)}, "、": ","})
_GOLD_SPLIT = re.compile(r"\s*,\s*")
_GOLD_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")
_GOLD_LETTERS = re.compile(r"^[a-z](?: or [a-z])*$")


def check_choice_letters(letters: str | list[str], num_choices: int, where: str) -> None:
    """DataError naming ``where`` when a letter of ``letters`` (gold parts; digits and other
    characters are ignored) is not one of ``num_choices`` options ``a``, ``b``, ... (``0`` or
    over 8: any of ``a``-``h``): such a question could not be answered right."""
    valid = "abcdefgh"[:num_choices] if 0 < num_choices <= 8 else "abcdefgh"
    for part in [letters] if isinstance(letters, str) else letters:
        if _GOLD_NUMBER.match(part):
            continue
        bad = [c for c in part if c.isalpha() and c not in valid]
        if bad:
            raise DataError(
                f"{where}: answer letter {bad[0]!r} is not one of the {len(valid)} choices "
                f"({valid[0]}-{valid[-1]}): the question could not be answered right"
            )


def igakuqa_gold(answer: object, num_choices: int, where: str) -> list[str]:
    """The gold of an IgakuQA-style ``answer`` (a list of strings, or one string): the one
    normaliser of training (:func:`megagrpo.data.load_problems`) and scoring
    (:func:`megagrpo.rewards.igakuqa.read_gold`).

    Each entry is made ASCII (full-width letters, digits, ``、`` ``，``) and lower-case and
    split on commas; a number stays whole (``"26"`` -> ``["26"]``, ``"7.20"``), letters are
    option letters (``"b,c"``, ``"Ｂ、Ｃ"`` -> ``["b", "c"]``; ``"a or d"`` is kept: either
    letter is right). DataError naming ``where`` (file:line) for an empty answer, an entry
    that is neither, or a letter outside the ``num_choices`` choices (unsolvable).
    """
    items = [answer] if isinstance(answer, str) else answer
    if not isinstance(items, list):
        raise DataError(f"{where}: 'answer' must be a list of strings, got {answer!r:.60}")
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise DataError(f"{where}: 'answer' entries must be strings, got {item!r:.60}")
        for part in _GOLD_SPLIT.split(item.translate(_WIDE).strip().lower()):
            if not part:
                continue
            if not (_GOLD_NUMBER.match(part) or _GOLD_LETTERS.match(part)):
                raise DataError(
                    f"{where}: answer {item!r} is not option letters or a number ({part!r})"
                )
            check_choice_letters(part.replace(" or ", ""), num_choices, where)
            out.append(part)
    if not out:
        raise DataError(f"{where}: empty answer")
    return out
