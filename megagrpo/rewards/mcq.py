"""Multiple-choice (and numeric) answer extraction from free-form model output, and the
``mcq_accuracy`` reward: 1.0 iff the extracted answer set equals the gold set, else 0.0.

Extraction rules (``extract_answer(text, problem)``), applied in this order:

1. **Reasoning blocks.** If the text contains ``</think>``, only what follows the last
   ``</think>`` is read (the opening tag may sit in the prompt). A ``<think>`` that is never
   closed means the model ran out of budget mid-thought: no answer (``None``).
2. **Normalisation.** Full-width ASCII (``ａ``-``ｈ``, ``Ａ``-``Ｈ``, ``：``, ``（）``,
   ``０``-``９``)
   becomes ASCII, the text is lower-cased, runs of spaces and blank lines collapse; markdown
   emphasis (``*``, `````, ``#``) and the brackets ``「」『』［］<>`` are dropped; a heading
   ``【解答】`` reads as ``解答:``. ``\\boxed{X}`` and ``<answer>X</answer>`` read as
   ``answer: X``. Round-bracket groups are kept only when they hold nothing but an
   answer (``(c)``, ``(c, d)``); others (``(A型肝炎)``, ``(a is wrong)``) are removed, so
   asides cannot add letters.
3. **Candidates.** Every place that states an answer yields a candidate at its position:
   - *answer phrases*: ``答え``/``正解``/``正答``/``解答``/``回答``/``答`` (optionally after
     ``最終(的な)``) followed by ``は``, ``:``, ``=``, ``→`` or a line end; English
     ``answer(s)``/``final answer``/``correct answer|option|choice`` followed by ``:``,
     ``is``/``are``/``would be`` or a line end. The answer is read from the rest of that line,
     up to the end of its sentence (``。``, ``.␣``, ``!``, ``?``); if the rest is empty, from the
     next non-empty line.
   - *trailing phrases*: an answer group directly followed by ``が正解``/``が正しい``/
     ``が(最も)適切``/``が妥当``/``が答え``/``を選ぶ``/``を選択``, or by ``is/are (the) correct``.
   - *final line*: the last non-empty line when it is nothing but an answer (``c``,
     ``c, d.``, ``cd``, ``c です``) or an answer letter followed by ``.``/``:``/``)`` and text.
   The candidate with the **largest position wins** ("last stated answer"), so letters
   mentioned during reasoning, or an answer that is later revised, never count.
4. **Letters.** In an answer span, every option letter standing alone counts: not glued to
   other ASCII letters or digits, not preceded by katakana, not followed by katakana or kanji
   (``A型`` is not an answer) except the separators ``及び``/``並びに``/``又は``. Any separators
   work (``c,d``, ``c と d``, ``c・d``, ``c、d``, ``c and d``, ``c/d``, spaces); order is free;
   duplicates collapse. An English article "a" followed by a word is not an answer. A run of
   distinct letters (``cd``) counts only when it is the whole span. Letters beyond the
   problem's options (5 options: a-e; ``meta['choices']`` sets the count, up to h) are
   ignored. A hedge (``c or d``) yields both letters, which is wrong for a one-answer question.
5. **Numeric questions** (no choices, gold is a number): the question's ``解答：①②.③``-style
   template (with optional fixed leading digits, ``1, ①②③ kcal``) is read from
   ``meta['problem_text']``/``meta['question']`` or the prompt. The answer is either
   slot-wise (``①2 ②6``) or a number (``26 Torr``, ``1,130 kcal``, ``7.2``) that fits the
   template: the fixed digits must match, the integer digit count must equal the
   template's, and decimals beyond the template's must be zeros (``7.2`` fills ``①.②③``
   as 7.20). An integer written with exactly as many digits as the template has slots,
   under a template with decimal slots or fixed leading digits, is read as the slot digits
   themselves (``21`` for ``①.②`` is 2.1, ``04`` is 0.4, ``130`` for ``1, ①②③`` is 1130).
   The extracted answer is the slot digits (``["720"]``). In an answer span the
   first fitting number counts; on the final line the last one. Without a template any
   number is taken as written.
6. Nothing found, a refusal, or an empty text: ``None`` (reward 0.0).

Comparison (:func:`answers_match`): option letters as sets; numbers by their digits only
(gold ``"1.2"`` equals slot digits ``"12"``); a gold entry ``"a or d"`` (IgakuQA 112B30)
accepts any one of the alternatives.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from megagrpo.types import Problem

_FULLWIDTH = {chr(0xFF01 + i): chr(0x21 + i) for i in range(0x5E)}
_FULLWIDTH.update({"\u3000": " ", "､": "、", "｡": "。", "・": "・", "･": "・"})
_TRANS = str.maketrans(_FULLWIDTH)
_CIRCLED = "①②③④⑤⑥⑦⑧⑨"
_NUMERIC_RE = re.compile(r"^-?\d+(?:\.\d+)?$")

# One option letter standing alone (see rule 4). Text is lower-cased before matching.
_L = (
    r"(?<![a-z0-9\u30a1-\u30fa\u30fc])[a-h]"
    r"(?![a-z0-9\u30a1-\u30fa\u30fc])(?!(?![及並又])[\u4e00-\u9fff])"
)
_SEP = r"(?:\s*(?:,|、|，|・|/|&|\+|と|and|及び|および|並びに|又は|または|or)\s*|\s+)"
_GROUP = rf"{_L}(?:{_SEP}{_L}){{0,7}}"  # at most 8 options: bounded, so scans stay linear
_LETTER_RE = re.compile(_L)
_ARTICLE_RE = re.compile(r"\s+(?!and\b|or\b)[a-z]{2,}")
_JA_MARK = re.compile(
    r"(?:最終(?:的な|的に|的)?)?(?:答え|正解|正答|解答|回答|答)"
    r"(?:と(?:なる|する)(?:の|もの|選択肢)は|の選択肢は|選択肢は|は|:|=|→|⇒|[ \t]*$)",
    re.M,
)
_EN_MARK = re.compile(
    r"\b(?:final\s+answer|correct\s+(?:answer|option|choice)s?|answers?)\b"
    r"(?:\s*(?:is|are|would\s+be|should\s+be|will\s+be)\b\s*:?|\s*(?::|=|→)|[ \t]*$)",
    re.M,
)
_TRAIL_MARK = re.compile(
    rf"({_GROUP})\s*(?:(?:が|を)\s*(?:最も)?\s*(?:正解|正しい|答え|選ぶ|選択|適切|妥当)"
    rf"|(?:is|are)\s+(?:the\s+)?(?:correct|right|best)\b)"
)
_NEXT_LINE_RE = re.compile(r"[^\S\n]*[^\s][^\n]*")
_MAX_MARKERS = 64  # only the latest answer phrases can win; bounds work on looping outputs
_ENUM_RE = re.compile(rf"{_L}\s*[.:)]")
_SENT_END = re.compile(r"。|\.(?:\s|$)|[!?！？]|\n")
_PAREN_RE = re.compile(r"[(（]([^()（）\n]*)[)）]")
_DROP_CHARS = str.maketrans({c: " " for c in "*`#「」『』【】〔〕[]<>"})
_NUM_RE = re.compile(
    r"(?<![a-z0-9.,])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d])|(?<![a-z0-9.,])\d+(?:\.\d+)?(?![\d])"
)
_SIGNED_RE = re.compile(  # a number with its sign, where no template fixes the digits
    r"(?<![a-z0-9.,])[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])"
)
_SLOT_RE = re.compile(r"([①-⑨])\s*[:=は]?\s*(\d)(?![\d,.])")
_TEMPLATE_RE = re.compile(r"解答[:：]\s*((?:\d[,，]?\s*)*)([①-⑨](?:[.．]?[①-⑨])*)")
_BARE_TEMPLATE_RE = re.compile(r"([①-⑨](?:[.．]?[①-⑨])*)")


# ----------------------------------------------------------------------------- text prep


def answer_region(text: str) -> str | None:
    """What follows the reasoning block: text after the last ``</think>``; None if a
    ``<think>`` is left open (rule 1)."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return None
    return text


def _normalise(text: str) -> str:
    text = text.translate(_TRANS).lower()
    # collapse whitespace runs: keeps every pattern linear on degenerate (looping) outputs
    text = re.sub(r"[^\S\n]+", " ", text)
    text = re.sub(r" ?\n[\s]*\n", "\n\n", text)
    text = re.sub(r"\\boxed\{([^{}]*)\}", r"\nanswer: \1\n", text)
    text = re.sub(r"<answer>(.*?)</answer>", r"\nanswer: \1\n", text, flags=re.S)
    text = re.sub(r"[【〔]([^】〕\n]*)[】〕]", r" \1: ", text)  # 【解答】c -> 解答: c
    text = text.translate(_DROP_CHARS)

    # keep "(c)" / "(c, d)", drop any other parenthesised aside
    def paren(m: re.Match) -> str:
        inner = m.group(1)
        return f" {inner} " if re.fullmatch(rf"\s*{_GROUP}\s*", inner) else " "

    return _PAREN_RE.sub(paren, text)


# ----------------------------------------------------------------------------- letters


def _letters_in(span: str, valid: str) -> list[str] | None:
    """Option letters stated in ``span`` (rule 4); None if there are none."""
    bare = re.sub(r"[\s.:;,、。!?]+|です|である|となる|だ$", "", span)
    if 2 <= len(bare) <= len(valid) and set(bare) <= set(valid) and len(set(bare)) == len(bare):
        return sorted(bare)
    found = []
    for m in _LETTER_RE.finditer(span):
        ch = m.group(0)
        if ch == "a" and _ARTICLE_RE.match(span, m.end()):
            continue
        if ch in valid:
            found.append(ch)
    return sorted(set(found)) or None


def _sentence(text: str, start: int) -> str:
    """From ``start`` to the end of its sentence; if that is empty, the next non-empty line."""
    m = _SENT_END.search(text, start)
    span = text[start : m.start()] if m else text[start:]
    if span.strip(" \t:=→"):
        return span
    nl = text.find("\n", start)
    line = _NEXT_LINE_RE.search(text, nl) if nl >= 0 else None
    if line is None:
        return ""
    m = _SENT_END.search(line.group(0))
    return line.group(0)[: m.start()] if m and m.start() > 0 else line.group(0)


def _marker_spans(text: str) -> list[tuple[int, str]]:
    """(position, span) for the last ``_MAX_MARKERS`` answer phrases in ``text`` (rule 3)."""
    found = sorted((m.start(), m.end()) for rx in (_JA_MARK, _EN_MARK) for m in rx.finditer(text))
    return [(start, _sentence(text, end)) for start, end in found[-_MAX_MARKERS:]]


def _last_lines(text: str, n: int = 2) -> list[tuple[int, str]]:
    """The last ``n`` non-empty lines as (position, line)."""
    lines = [(m.start(), m.group(0)) for m in re.finditer(r"[^\n]+", text) if m.group(0).strip()]
    return lines[-n:]


def _extract_letters(text: str, valid: str, choices: list[str]) -> list[str] | None:
    cands: list[tuple[int, list[str]]] = []
    for pos, span in _marker_spans(text):
        got = _letters_in(span, valid)
        if got:
            cands.append((pos, got))
    for m in _TRAIL_MARK.finditer(text):
        got = _letters_in(m.group(1), valid)
        if got:
            cands.append((m.start(), got))
    lines = _last_lines(text)
    if lines:
        pos, line = lines[-1]
        enumerating = len(lines) == 2 and _ENUM_RE.match(lines[0][1].strip()) is not None
        got = _final_line_letters(line, valid, choices, allow_labelled=not enumerating)
        if got:
            cands.append((pos, got))
    return max(cands, key=lambda c: c[0])[1] if cands else None


def _final_line_letters(
    line: str, valid: str, choices: list[str], allow_labelled: bool
) -> list[str] | None:
    """Letters of a final line that is only an answer, or (``allow_labelled``, i.e. not the
    end of an option list) an answer letter followed by ``.``/``:``/``)`` or its choice text."""
    s = line.strip()
    if re.fullmatch(rf"(?:{_GROUP}|[a-h]{{2,8}})\s*(?:です|だ)?\s*[.。]?", s):
        return _letters_in(s, valid)
    if not allow_labelled:
        return None
    m = re.match(rf"({_L})\s*[.:)]\s*(\S.*)?$", s)
    if m:
        return _letters_in(m.group(1), valid)
    m = re.match(rf"({_L})\s+(.+)$", s)
    if m and any(c and m.group(2).startswith(c.translate(_TRANS).lower()[:4]) for c in choices):
        return _letters_in(m.group(1), valid)
    return None


# ----------------------------------------------------------------------------- numbers


def _template(problem: Problem) -> tuple[str, str] | None:
    """(fixed leading digits, slot core like '①②.③') of the question's numeric template."""
    sources = [str(problem.meta.get(k, "")) for k in ("problem_text", "question")]
    sources += [str(m.get("content", "")) for m in problem.messages if m.get("role") == "user"]
    for src in sources:
        found = _TEMPLATE_RE.findall(src)
        if found:
            prefix, core = found[-1]
            return re.sub(r"\D", "", prefix), core.replace("．", ".")
    for src in sources:
        found = _BARE_TEMPLATE_RE.findall(src)
        if found:
            return "", found[-1].replace("．", ".")
    return None


def _fit(number: str, template: tuple[str, str] | None) -> str | None:
    """Slot digits for ``number`` under ``template`` (rule 5), or None if it does not fit."""
    number = number.replace(",", "")
    whole, _, frac = number.partition(".")
    if template is None:
        return number
    prefix, core = template
    num_slots = len(re.findall(r"[①-⑨]", core))
    if "." not in number and len(number) == num_slots and ("." in core or prefix):
        # written as the slot digits themselves: "21" for ①.② (2.1), "04" for ①.② (0.4),
        # "130" for "1, ①②③" (1130). Read as a value these never fit (too many integer
        # digits, or the fixed digits missing) or fit wrongly ("04" would be 4.0).
        return number
    int_slots = len(core.split(".")[0].replace(".", ""))
    dec_slots = len(core.split(".")[1]) if "." in core else 0
    if len(frac) > dec_slots:
        if set(frac[dec_slots:]) - {"0"}:
            return None
        frac = frac[:dec_slots]
    frac = frac.ljust(dec_slots, "0")
    whole = whole.lstrip("0") or "0"
    width = len(prefix) + int_slots
    if len(whole) > width:
        return None
    whole = whole.zfill(width)
    if not whole.startswith(prefix):
        return None
    return whole[len(prefix) :] + frac


def _numbers_in(span: str, template, last: bool) -> str | None:
    slots = _SLOT_RE.findall(span)
    if template is not None and slots:
        n = len(re.findall(r"[①-⑨]", template[1]))
        by_slot = {s: d for s, d in slots}
        if all(c in by_slot for c in _CIRCLED[:n]):
            return "".join(by_slot[c] for c in _CIRCLED[:n])
    fits = [f for f in (_fit(m.group(0), template) for m in _NUM_RE.finditer(span)) if f]
    if not fits:
        return None
    return fits[-1] if last else fits[0]


def number_value(text: str) -> str | None:
    """The canonical decimal of a written number (``"2.0"`` -> ``"2"``, ``"−0.50"`` ->
    ``"-0.5"``, ``"1,000"`` -> ``"1000"``), or None."""
    from decimal import Decimal, InvalidOperation

    try:
        value = Decimal(text.replace(",", "").replace("−", "-"))
    except InvalidOperation:
        return None
    out = format(value.normalize(), "f")
    return "0" if out in ("-0", "0") else out


def _signed_number(text: str) -> list[str] | None:
    """A template-free numeric answer (math data): the last signed number of the answer's
    marker span or last line, as its canonical value."""
    cands: list[tuple[int, str]] = []
    spans = [*_marker_spans(text), *_last_lines(text, 1)]
    for pos, span in spans:
        found = [number_value(m.group(0)) for m in _SIGNED_RE.finditer(span)]
        found = [f for f in found if f is not None]
        if found:
            cands.append((pos, found[-1]))
    return [max(cands, key=lambda c: c[0])[1]] if cands else None


def _extract_number(text: str, problem: Problem) -> list[str] | None:
    template = _template(problem)
    if template is None:
        return _signed_number(text)
    cands: list[tuple[int, str]] = []
    for pos, span in _marker_spans(text):
        got = _numbers_in(span, template, last=False)
        if got:
            cands.append((pos, got))
    lines = _last_lines(text, 1)
    if lines:
        got = _numbers_in(lines[-1][1], template, last=True)
        if got:
            cands.append((lines[-1][0], got))
    return [max(cands, key=lambda c: c[0])[1]] if cands else None


# ----------------------------------------------------------------------------- public API


def is_numeric_problem(problem: Problem) -> bool:
    """A numeric-answer question: no choices, and every gold entry is a number."""
    choices = problem.meta.get("choices")
    return (
        not choices
        and bool(problem.answer)
        and all(_NUMERIC_RE.match(str(a).strip()) for a in problem.answer)
    )


def valid_letters(problem: Problem) -> str:
    """Option letters of ``problem``: ``a``.. for its ``meta['choices']`` (a-h if unknown)."""
    choices = problem.meta.get("choices") or []
    return "abcdefgh"[: len(choices)] if 0 < len(choices) <= 8 else "abcdefgh"


def extract_answer(text: str, problem: Problem) -> list[str] | None:
    """The answer ``text`` states for ``problem`` (rules in the module docstring).

    Returns sorted unique lower-case letters (``["c", "d"]``), or for numeric questions one
    string of slot digits (``["26"]``); None when no answer can be read.
    """
    region = answer_region(text or "")
    if region is None or not region.strip():
        return None
    norm = _normalise(region)
    if is_numeric_problem(problem):
        return _extract_number(norm, problem)
    choices = [str(c) for c in problem.meta.get("choices") or []]
    return _extract_letters(norm, valid_letters(problem), choices)


def _canon(entry: str, by_value: bool = False) -> str:
    entry = str(entry).strip().lower()
    if not _NUMERIC_RE.match(entry):
        return entry
    if by_value:
        return number_value(entry) or entry
    return ("-" if entry.startswith("-") else "") + re.sub(r"\D", "", entry)


def answers_match(predicted: list[str] | None, gold: list[str], by_value: bool = False) -> bool:
    """True iff ``predicted`` equals the gold set (numbers compared by their digits and sign,
    or with ``by_value`` as decimals: 2.0 == 2; a gold entry ``"x or y"`` accepts any single
    alternative)."""
    if not predicted:
        return False
    canon = {True: lambda e: _canon(e, True), False: _canon}[by_value]
    pred = {canon(p) for p in predicted}
    if len(gold) == 1 and " or " in str(gold[0]):
        return any(pred == {canon(g)} for g in str(gold[0]).split(" or "))
    return pred == {canon(g) for g in gold}


def mcq_accuracy() -> Callable[[list[str], Problem], list[float]]:
    """Factory of the exact-set reward: ``(completions [G], problem) -> [G]`` of 0.0/1.0."""

    def reward(completions: list[str], problem: Problem) -> list[float]:
        if not problem.answer:  # a free-text gold (megagrpo.data.parse_gold): never silent
            raise ValueError(
                f"problem {problem.id} has no option-letter or numeric gold "
                f"(solution {str(problem.meta.get('solution', ''))[:60]!r}); mcq_accuracy "
                "cannot score it: use a reward that reads 'solution'"
            )
        by_value = is_numeric_problem(problem) and _template(problem) is None
        return [
            1.0 if answers_match(extract_answer(c, problem), problem.answer, by_value) else 0.0
            for c in completions
        ]

    return reward
