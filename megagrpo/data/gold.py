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
