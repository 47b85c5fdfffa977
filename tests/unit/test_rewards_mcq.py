"""mcq_accuracy / extract_answer on every real IgakuQA 2018-2020 question.

For each question, responses stating the gold answer in many realistic formats (Japanese and
English phrasing, think blocks full of distractor letters, full-width, bold, brackets, every
separator, reversed order, a revised earlier answer) must score 1.0; responses stating a wrong
answer (another letter, a subset, a superset, a revision to a wrong answer, the gold answer
only inside an unclosed think block, refusals) must score 0.0.
"""

from __future__ import annotations

import json
import re

import pytest

from megagrpo.rewards import extract_answer, get
from megagrpo.rewards.mcq import answers_match
from megagrpo.types import Problem

FW = {c: chr(ord(c) - 0x61 + 0xFF41) for c in "abcdefgh"}  # a -> ａ
FW_UP = {c: chr(ord(c) - 0x61 + 0xFF21) for c in "abcdefgh"}  # a -> Ａ


def gold_problems(root) -> list[Problem]:
    """Problems built straight from the raw files (independent of megagrpo.data)."""
    out = []
    for path in sorted(root.glob("20*/*.jsonl")):
        if not re.fullmatch(r"\d+-[A-F]\.jsonl", path.name):
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            text = (
                rec["problem_text"]
                + "\n"
                + "\n".join(f"{chr(97 + i)}. {c}" for i, c in enumerate(rec["choices"]))
            )
            out.append(
                Problem(
                    rec["problem_id"],
                    [{"role": "user", "content": text}],
                    list(rec["answer"]),
                    {"choices": rec["choices"], "problem_text": rec["problem_text"]},
                )
            )
    return out


@pytest.fixture(scope="module")
def problems(igakuqa_dir):
    probs = gold_problems(igakuqa_dir)
    assert len(probs) == 1200
    return probs


def letter_responses(g: list[str], w: str, choices: list[str]) -> list[str]:
    """Ways to state the answer set ``g``; ``w`` is a distractor letter outside it."""
    rev = list(reversed(g))
    up = [x.upper() for x in g]
    r = [
        f"<think>\n選択肢{w}は{choices[0][:6] if choices else ''}なので誤り。"
        f"{w}が正解かもしれない。"
        f"答えは{w}?\n</think>\n\n答え: {','.join(g)}",
        f"各選択肢を検討します。\n{w}) 誤り。\n\n**答え: {' と '.join(up)}**",
        f"正解は「{'・'.join(FW[x] for x in g)}」です。",
        f"Let's think step by step. Option ({w.upper()}) is tempting but wrong.\n\n"
        f"Final answer: {', '.join(f'({x.upper()})' for x in rev)}",
        f"{w}も考えられるが、所見から否定的である。\n\n{''.join(rev)}",
        f"The answer is {' and '.join(g)}.",
        f"最初は{w}と考えた。\n答え: {w}\n\nしかし再検討すると{w}は誤り。\n\n"
        f"最終的な答え：{'、'.join(g)}",
        "\\boxed{" + ",".join(up) + "}",
        "【解答】\n" + "".join(f"({x})" for x in g),
        f"選択肢{'と'.join(g)}が正解である。",
        f"<think>{w}, {w}, {w}</think>解答：{' '.join(FW_UP[x] for x in rev)}",
        f"**Answer:** {'/'.join(g)}\n\nExplanation: ({w}) is incorrect because it is not typical.",
        f"答えは {'、'.join(f'**{x}**' for x in g)} です。{w}は誤り。",
    ]
    if len(g) == 1 and choices:
        r.append(f"{w}ではない。\n\n{g[0]}. {choices[ord(g[0]) - 97]}")
        r.append(f"<think>\nOK.\n</think>\n\n{FW_UP[g[0]]}")
    return r


def wrong_sets(g: list[str], valid: str) -> list[list[str]]:
    others = [c for c in valid if c not in g]
    out = [sorted(g[:-1] + [others[0]])]
    if len(g) > 1:
        out += [g[:-1], sorted(g + [others[-1]])]
    else:
        out += [[others[-1]], sorted(g + [others[0]])]
    return out


def numeric_value(problem: Problem) -> tuple[str, str]:
    """(gold value as written, the value with its last digit changed, the wrong slot digits)."""
    m = re.search(
        r"解答：\s*((?:\d[,，]?\s*)*)([①-⑨](?:[.．]?[①-⑨])*)", problem.meta["problem_text"]
    )
    prefix, core = re.sub(r"\D", "", m.group(1)), m.group(2)
    digits = re.sub(r"\D", "", problem.answer[0])
    assert len(digits) == len(re.findall(r"[①-⑨]", core)), problem.id

    def render(ds: str) -> str:
        it = iter(ds)
        body = "".join(ch if ch == "." else next(it) for ch in core)
        return f"{prefix},{body}" if prefix else body

    wrong = digits[:-1] + str((int(digits[-1]) + 1) % 10)
    return render(digits), render(wrong), wrong


def numeric_responses(value: str, distractor: str, slot_digits: str) -> list[str]:
    slots = "".join(f"{'①②③④⑤'[i]}{d} " for i, d in enumerate(slot_digits))
    return [
        f"<think>計算すると{distractor}になりそうだが見直す。答えは{distractor}?</think>\n"
        f"答え: {value}",
        f"計算過程は省略します。\n\n解答：{slots.strip()}",
        f"Using the formula, the result is approximately {distractor} first.\n\n"
        f"Final answer: {value}",
        f"式に代入して整理すると\n{value}",
        f"**正解：{value}**（四捨五入済み）",
    ]


def test_every_question_gold_formats_score_one_wrong_zero(problems):
    reward = get("mcq_accuracy")
    failures = []
    n_checked = 0
    for p in problems:
        if p.meta["choices"]:
            valid = "abcdefgh"[: len(p.meta["choices"])]
            golds = [["a"], ["d"]] if p.answer == ["a or d"] else [sorted(p.answer)]
            for g in golds:
                w = next(c for c in valid if c not in g and c not in "ad" * (p.id == "112B30"))
                good = letter_responses(g, w, p.meta["choices"])
                # 112B30 accepts a or d: the other alternative alone is not wrong there
                pool = "".join(c for c in valid if p.id != "112B30" or c not in "ad" or c in g)
                wrong = [
                    resp
                    for ws in wrong_sets(g, pool)
                    for resp in letter_responses(ws, g[0], p.meta["choices"])[:8]
                ]
                wrong.append(f"<think>答え: {','.join(g)}")  # unclosed: ran out of budget
                wrong.append(f"最初の答え: {','.join(g)}\n...\n最終的な答え: {w}")
                scores = reward(good, p), reward(wrong, p)
                failures += [(p.id, "good", t) for t, s in zip(good, scores[0]) if s != 1.0]
                failures += [(p.id, "wrong", t) for t, s in zip(wrong, scores[1]) if s != 0.0]
                n_checked += len(good) + len(wrong)
        else:
            value, wrong_value, wrong_digits = numeric_value(p)
            good = numeric_responses(value, wrong_value, re.sub(r"\D", "", p.answer[0]))
            wrong = numeric_responses(wrong_value, value, wrong_digits)
            scores = reward(good, p), reward(wrong, p)
            failures += [(p.id, "good", t) for t, s in zip(good, scores[0]) if s != 1.0]
            failures += [(p.id, "wrong", t) for t, s in zip(wrong, scores[1]) if s != 0.0]
            n_checked += len(good) + len(wrong)
    assert not failures, f"{len(failures)} of {n_checked} misjudged, e.g. {failures[:5]}"
    assert n_checked > 30000


def test_refusals_and_empty_score_zero(problems):
    reward = get("mcq_accuracy")
    p = next(p for p in problems if p.answer == ["c"] and p.meta["choices"])
    texts = [
        "",
        "わかりません。",
        "I cannot answer medical questions.",
        "<think>c</think>",
        "<think>\n答えはcだと思う",
        "この問題には画像が必要なため回答できません。",
        "The correct answer cannot be determined from the information given.",
    ]
    assert reward(texts, p) == [0.0] * len(texts)
    assert extract_answer("", p) is None


@pytest.mark.parametrize(
    "text,expected",
    [
        ("答え: c, d", ["c", "d"]),
        ("答えはc（aとbは誤り）とd", ["c", "d"]),  # asides do not add letters
        ("答え: c (A型肝炎)", ["c"]),  # 'A型' is not an answer
        ("答え: c 及び d", ["c", "d"]),
        ("Answer: a", ["a"]),
        ("The answer is a combination of factors, so c.", ["c"]),  # article "a" skipped
        ("選択肢cとdが正解", ["c", "d"]),
        ("答え: c\n\n解説: aは誤り。", ["c"]),
        ("a. Gaucher病\nb. von Gierke病\nc. Hurler症候群", None),  # an option list is not an answer
        ("答え: b\n再考すると\n答え: e、c", ["c", "e"]),
        ("HbA1c が高いので答えは ｅ", ["e"]),
        ("<answer>B</answer>", ["b"]),
        ("以上より c が最も適切である。", ["c"]),
        ("(C) is the correct answer.", ["c"]),
        ("aが正しいように見えるが、実際にはcが正解", ["c"]),
        ("正解: c\n\n解説:\na. 誤り\nb. 誤り\nd. 誤り\ne. 誤り", ["c"]),
        ("c or d", ["c", "d"]),  # hedging: both letters (wrong for one-answer)
    ],
)
def test_extraction_rules(text, expected):
    p = Problem("x", [{"role": "user", "content": "q"}], ["c"], {"choices": list("12345")})
    assert extract_answer(text, p) == expected


def test_options_beyond_e_and_numeric_digits():
    p8 = Problem("8", [], ["g"], {"choices": list("ａｂｃｄｅｆｇｈ")})
    assert extract_answer("答え：ｇ", p8) == ["g"]
    p5 = Problem("5", [], ["c"], {"choices": list("12345")})
    assert extract_answer("答え: g", p5) is None  # not an option of this question
    num = Problem(
        "n",
        [{"role": "user", "content": "求めよ。解答：①②.③/人口1,000対"}],
        ["100"],
        {"choices": []},
    )
    assert extract_answer("答え: 10.0", num) == ["100"]
    assert extract_answer("答え: 10", num) == ["100"]
    assert extract_answer("答え: 10.04", num) is None  # not rounded as the question says
    assert answers_match(["12"], ["1.2"]) and not answers_match(["13"], ["1.2"])
    assert answers_match(["d"], ["a or d"]) and not answers_match(["a", "d"], ["a or d"])


def test_loader_problems_are_scored_the_same(igakuqa_dir):
    """Problems from megagrpo.data (rendered prompts) extract like the raw ones."""
    from megagrpo.data import load_problems

    probs = load_problems([igakuqa_dir / "2019"])
    reward = get("mcq_accuracy")
    assert len(probs) == 400
    for p in probs:
        if p.meta.get("choices"):
            g = ["a"] if p.answer == ["a or d"] else sorted(p.answer)
            assert reward([f"答え: {','.join(g)}"], p) == [1.0], p.id
        else:
            digits = re.sub(r"\D", "", p.answer[0])
            slots = " ".join(f"{'①②③④⑤'[i]}{d}" for i, d in enumerate(digits))
            assert reward([f"解答：{slots}"], p) == [1.0], p.id


def test_agrees_with_baseline_parsed_predictions(igakuqa_dir, problems):
    """The baselines' ``explanation`` (raw model text) extracts to their parsed ``prediction``."""
    by_id = {p.id: p for p in problems}
    checked = 0
    for path in sorted((igakuqa_dir / "baseline_results").glob("*/*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            p = by_id[rec["problem_id"]]
            if not p.meta["choices"] or not re.fullmatch(r"[a-h](,[a-h])*", rec["prediction"]):
                continue
            got = extract_answer(rec["explanation"], p)
            assert got == sorted(set(rec["prediction"].split(","))), (path.name, rec)
            checked += 1
    assert checked > 5000


@pytest.mark.parametrize(
    "text",
    [
        "a " * 10000,
        "a" + " " * 20000 + "!",
        "答え: " * 5000,
        "answer is " * 3000,
        "c, " * 8000,
        "cとd" * 5000,
        "(c)" * 6000,
        "1 " * 10000,
    ],
)
def test_degenerate_looping_outputs_stay_linear(text):
    """RL policies loop; extraction must not backtrack quadratically (was 55 s on 'a a a ...')."""
    import time

    p = Problem("x", [], ["c"], {"choices": list("12345")})
    num = Problem("n", [{"role": "user", "content": "解答：①②Torr"}], ["26"], {"choices": []})
    start = time.perf_counter()
    extract_answer(text, p)
    extract_answer(text, num)
    assert time.perf_counter() - start < 3.0


def test_numeric_answers_written_as_slot_digits(problems):
    """Issue 12.6, on the real templates of every numeric IgakuQA 2018-2020 question: an
    answer written as the slot digits (``答え: 12`` for ``①.②``, gold ``1.2``) scores 1, and a
    leading zero is a slot (``答え: 04`` for ``①.②`` is 0.4, not 4.0). Before the fix the
    decimal and fixed-prefix templates (112F84, 113F84, 114C75, 114F75) scored 0 and ``04``
    read as ``40``."""
    reward = get("mcq_accuracy")
    numeric = [p for p in problems if not p.meta["choices"]]
    assert len(numeric) == 7
    decimal = 0
    for p in numeric:
        digits = re.sub(r"\D", "", p.answer[0])
        wrong = digits[:-1] + str((int(digits[-1]) + 1) % 10)
        assert reward([f"答え: {digits}", f"答え: {wrong}"], p) == [1.0, 0.0], p.id
        m = re.search(r"解答：\s*((?:\d[,，]?\s*)*)([①-⑨](?:[.．]?[①-⑨])*)", p.meta["problem_text"])
        core = m.group(2)
        if "." not in core:
            continue
        decimal += 1
        lead_zero = "0" + "4" * (len(digits) - 1)  # e.g. 0.4 under ①.②, 04.4 under ①②.③
        assert extract_answer(f"答え: {lead_zero}", p) == [lead_zero], p.id
        value = lead_zero[: core.index(".")] + "." + lead_zero[core.index(".") :]
        zero_gold = Problem(p.id, p.messages, [value], p.meta)
        assert reward([f"答え: {lead_zero}", f"答え: {value}"], zero_gold) == [1.0, 1.0], p.id
        as_number = Problem(p.id, p.messages, [lead_zero.lstrip("0") + "0"], p.meta)
        assert reward([f"答え: {lead_zero}"], as_number) == [0.0], p.id  # not 4.0
    assert decimal == 3


def test_numeric_answers_keep_their_sign_and_value():
    """Math data (no IgakuQA template): -2 is not 2, and 2.0 is 2."""
    from megagrpo.data.gold import parse_gold
    from megagrpo.rewards.mcq import mcq_accuracy

    reward = mcq_accuracy()

    def score(text: str, gold: str) -> float:
        answer = parse_gold(gold)
        assert answer is not None, gold
        return reward([text], Problem("m1", [], answer, {"choices": []}))[0]

    assert score("\\boxed{-2}", "2") == 0.0
    assert score("The answer is -2", "2") == 0.0
    assert score("\\boxed{-2}", "-2") == 1.0 and score("答え: −2", "-2") == 1.0
    assert score("\\boxed{2.0}", "2") == 1.0 and score("\\boxed{2}", "2.0") == 1.0
    assert score("so x = 0.50", "0.5") == 1.0 and score("\\boxed{1,000}", "1000") == 1.0
    assert score("\\boxed{20}", "2") == 0.0 and score("\\boxed{2}", "20") == 0.0


def test_free_text_golds_fail_at_load_time(tmp_path):
    """A `\\frac{3}{4}` solution with mcq_accuracy: ConfigError naming file:line before the
    model is built, not a reward error at every step."""
    import json

    from megagrpo.data import load_problems
    from megagrpo.errors import ConfigError
    from megagrpo.trainer.config import RunConfig
    from megagrpo.trainer.setup import check_golds_scorable

    data = tmp_path / "math.jsonl"
    rows = [{"query": "1+1?", "solution": "2"}, {"query": "3/4?", "solution": "\\frac{3}{4}"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = load_problems([str(data)])
    with pytest.raises(ConfigError, match=r"math.jsonl:2.*frac"):
        check_golds_scorable(RunConfig(), problems)
    from megagrpo.rewards.config import RewardsConfig, RewardSpec

    other = RunConfig(rewards=RewardsConfig(functions=[RewardSpec(name="orms:accuracy")]))
    check_golds_scorable(other, problems)  # math_verify reads the solution itself
