"""Generate the demo's problem set (megagrpo/assets/demo_mcq_{train,eval}.jsonl).

English four-option questions in ms-swift GRPO format (``messages`` + ``solution`` +
``choices``) whose right option follows from a rule stated in the question, on a ladder of
difficulty for a small model (:data:`RULE_TEMPLATES`): the question names the option's
letter ("Choose option c."), its position ("Choose the third option."), its text ("Which
option is the number 47?"), a one-digit sum, the largest of four numbers. The gold letters
are balanced: every template puts its right option at a, b, c, d in turn, so on each split
every letter is the gold of exactly a quarter of the questions and the best constant answer
scores 0.25: a policy that beats it reads the question. The held-out questions are new
instances of the same templates (no question text is shared with the training set).

SmolLM2-135M-Instruct answers most of them at chance and often in no readable form
(docs/learning.md gives the measured base accuracy and the AlphaMed levels);
GRPO with a 0/1 accuracy reward teaches it the answer form and the easy rules, while the
groups of questions it cannot yet or can already answer collapse.

    python tools/make_demo_mcq.py                 # rewrites the two files, byte-identical
    python tools/make_demo_mcq.py --train 400 --eval 240 --out DIR   (the defaults)
    python tools/make_demo_mcq.py --task easy --options 2            (the earlier demo set)
    python tools/make_demo_mcq.py --quick         # writes nothing: do they still regenerate?

tests/unit/test_demo_mcq_assets.py checks that the defaults regenerate the shipped files byte
for byte. :func:`build` (the earlier easy templates, :data:`TEMPLATES` and
:data:`OTHER_TEMPLATES`) stays for tools/repro_article.py.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

SYSTEM = (
    "You answer multiple-choice questions. Think briefly, then finish with a line "
    "'Answer: <letter>'."
)
LETTERS = "abcd"

CATEGORIES = {
    "fruit": ["apple", "banana", "orange", "grape", "pear", "cherry", "lemon", "mango", "peach"],
    "animal": ["dog", "cat", "horse", "cow", "lion", "tiger", "rabbit", "mouse", "elephant"],
    "colour": ["red", "blue", "green", "yellow", "purple", "pink", "brown", "black", "white"],
    "vehicle": ["car", "bus", "train", "bicycle", "truck", "boat", "plane", "taxi", "tractor"],
    "body part": ["hand", "foot", "nose", "ear", "eye", "knee", "elbow", "finger", "mouth"],
    "tool": ["hammer", "saw", "drill", "wrench", "screwdriver", "shovel", "rake", "axe"],
    "country": ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Italy", "Mexico"],
    "drink": ["water", "milk", "tea", "coffee", "juice", "lemonade", "soda"],
}
CONFUSABLE = {("fruit", "colour"), ("colour", "fruit")}  # "orange" is both
CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Germany", "Berlin"),
    ("Spain", "Madrid"),
    ("England", "London"),
    ("Russia", "Moscow"),
    ("China", "Beijing"),
    ("Egypt", "Cairo"),
    ("Greece", "Athens"),
    ("Canada", "Ottawa"),
    ("Ireland", "Dublin"),
    ("Portugal", "Lisbon"),
    ("Austria", "Vienna"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Poland", "Warsaw"),
    ("Thailand", "Bangkok"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
]
FIRST_LETTER_WORDS = [
    "apple", "banana", "cat", "dog", "egg", "fish", "goat", "hat", "ice", "juice", "kite",
    "lion", "moon", "nose", "orange", "pig", "queen", "rain", "sun", "tree", "umbrella",
    "van", "water", "yellow", "zebra",
]  # fmt: skip

Question = tuple[str, str, list[str]]
"""(question, right option, three wrong options)."""


def _sum(rng: random.Random) -> Question:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    wrong = rng.sample([x for x in range(2, 19) if x != a + b], 3)
    return f"What is {a} + {b}?", str(a + b), [str(x) for x in wrong]


def _successor(rng: random.Random) -> Question:
    a = rng.randint(1, 60)
    wrong = rng.sample([x for x in range(max(0, a - 5), a + 8) if x != a + 1], 3)
    return f"Which number comes right after {a}?", str(a + 1), [str(x) for x in wrong]


def _extreme(rng: random.Random) -> Question:
    xs = rng.sample(range(1, 100), 4)
    word, pick = rng.choice([("largest", max), ("smallest", min)])
    right = pick(xs)
    return f"Which number is the {word}?", str(right), [str(x) for x in xs if x != right]


def _even(rng: random.Random) -> Question:
    right = rng.choice(range(2, 99, 2))
    return (
        "Which of these numbers is even?",
        str(right),
        [str(x) for x in rng.sample(range(1, 99, 2), 3)],
    )


def _category(rng: random.Random) -> Question:
    cat = rng.choice(sorted(CATEGORIES))
    others = [c for c in sorted(CATEGORIES) if c != cat and (cat, c) not in CONFUSABLE]
    wrong = [rng.choice(CATEGORIES[c]) for c in rng.sample(others, 3)]
    article = "an" if cat[0] in "aeiou" else "a"
    return f"Which of these is {article} {cat}?", rng.choice(CATEGORIES[cat]), wrong


def _capital(rng: random.Random) -> Question:
    country, city = rng.choice(CAPITALS)
    wrong = rng.sample([c for _, c in CAPITALS if c != city], 3)
    return f"What is the capital of {country}?", city, wrong


def _first_letter(rng: random.Random) -> Question:
    words = rng.sample(FIRST_LETTER_WORDS, 4)
    return f"Which word starts with the letter {words[0][0].upper()}?", words[0], words[1:]


def _same_word(rng: random.Random) -> Question:
    words = rng.sample(sorted({w for ws in CATEGORIES.values() for w in ws}), 4)
    return f"Which option is the word '{words[0]}'?", words[0], words[1:]


def _capitals(rng: random.Random) -> Question:
    words = rng.sample(sorted({w for ws in CATEGORIES.values() for w in ws}), 4)
    return "Which option is written in capital letters?", words[0].upper(), words[1:]


def _same_number(rng: random.Random) -> Question:
    xs = rng.sample(range(10, 100), 4)
    return f"Which option is the number {xs[0]}?", str(xs[0]), [str(x) for x in xs[1:]]


TEMPLATES: dict[str, Callable[[random.Random], Question]] = {
    "sum": _sum,
    "next": _successor,
    "extreme": _extreme,
    "even": _even,
    "category": _category,
    "capital": _capital,
    "letter": _first_letter,
}
"""The demo's templates (problem set A of tools/repro_article.py)."""
OTHER_TEMPLATES: dict[str, Callable[[random.Random], Question]] = {
    "word": _same_word,
    "upper": _capitals,
    "number": _same_number,
}
"""A second family (problem set B of tools/repro_article.py: reading the options)."""


def _record(rng: random.Random, pid: str, q: Question, num_options: int = 4) -> dict:
    question, right, wrong = q
    options = [right, *wrong[: num_options - 1]]
    rng.shuffle(options)
    body = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
    return {
        "id": pid,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{question}\n{body}"},
        ],
        "solution": LETTERS[options.index(right)],
        "choices": options,
    }


def build(
    num_train: int,
    num_eval: int,
    seed: int = 0,
    templates: dict[str, Callable[[random.Random], Question]] | None = None,
    num_options: int = 4,
) -> tuple[list[dict], list[dict]]:
    """(train, eval) records: templates in turn, every prompt distinct, none shared;
    ``num_options`` (2-4): the right option and the first wrong ones."""
    templates = templates or TEMPLATES
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict] = []
    names = list(templates)
    attempts = 0
    while len(out) < num_train + num_eval:
        attempts += 1
        if attempts > 100 * (num_train + num_eval):
            raise RuntimeError("not enough distinct questions for the requested sizes")
        name = names[len(out) % len(names)]
        rec = _record(rng, f"{name}{len(out):04d}", templates[name](rng), num_options)
        key = rec["messages"][-1]["content"]
        if key in seen:
            continue
        seen.add(key)
        out.append(rec)
    rng.shuffle(out)
    return out[:num_train], out[num_train:]


ORDINALS = ("first", "second", "third", "fourth")


def _numbers(rng: random.Random, pos: int, k: int = 4) -> list[str]:
    return [str(x) for x in rng.sample(range(10, 100), k)]


def _rule_letter(rng: random.Random, pos: int) -> tuple[str, list[str]]:
    return f"Choose option {LETTERS[pos]}.", _numbers(rng, pos)


def _rule_ordinal(rng: random.Random, pos: int) -> tuple[str, list[str]]:
    return f"Choose the {ORDINALS[pos]} option.", _numbers(rng, pos)


def _rule_number(rng: random.Random, pos: int) -> tuple[str, list[str]]:
    options = _numbers(rng, pos)
    return f"Which option is the number {options[pos]}?", options


def _rule_sum(rng: random.Random, pos: int) -> tuple[str, list[str]]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    wrong = rng.sample([x for x in range(2, 19) if x != a + b], 3)
    options = [str(x) for x in wrong]
    options.insert(pos, str(a + b))
    return f"What is {a} + {b}?", options


def _rule_largest(rng: random.Random, pos: int) -> tuple[str, list[str]]:
    xs = sorted(rng.sample(range(10, 100), 4))
    top, rest = xs[-1], xs[:-1]
    rng.shuffle(rest)
    rest.insert(pos, top)
    return "Which number is the largest?", [str(x) for x in rest]


RuleQuestion = tuple[str, list[str]]
"""(question, four options); the right one at the position the template was given."""
RULE_TEMPLATES: dict[str, Callable[[random.Random, int], RuleQuestion]] = {
    "letter": _rule_letter,
    "ordinal": _rule_ordinal,
    "number": _rule_number,
    "sum": _rule_sum,
    "largest": _rule_largest,
}
"""The demo's ladder, easiest first for a reader of the question: copy the named letter,
map a position to a letter, find a number among the options, add, compare."""


def rule_variants(name: str, question: str, options: list[str], pos: int) -> list[dict]:
    """The question rendered with its gold at a, b, c and d in turn (``data.variants``: the
    members of a group answer different ones, so a policy that always gives one letter is
    right for exactly one of four and its group keeps an advantage): the letter and ordinal
    rules name the k-th option instead; the others move the right option to position k
    (the options rotated, their cyclic order kept)."""
    out = []
    for k, letter in enumerate(LETTERS):
        if name == "letter":
            text, opts = f"Choose option {letter}.", options
        elif name == "ordinal":
            text, opts = f"Choose the {ORDINALS[k]} option.", options
        else:
            shift = k - pos
            text, opts = (
                question,
                [options[(i - shift) % len(options)] for i in range(len(options))],
            )
        body = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(opts))
        out.append({"query": f"{text}\n{body}", "solution": letter})
    return out


def build_rule(
    num_train: int,
    num_eval: int,
    seed: int = 0,
    templates: dict[str, Callable[[random.Random, int], RuleQuestion]] | None = None,
) -> tuple[list[dict], list[dict]]:
    """(train, eval) four-option records: templates in turn, template t's j-th question with
    its right option at letter j mod 4 (each split balanced when its size is a multiple of
    4 x templates), every prompt distinct, none shared between the splits; each training
    record lists its four renderings as ``variants`` (:func:`rule_variants`)."""
    templates = templates or RULE_TEMPLATES
    rng = random.Random(seed)
    names = list(templates)
    seen: set[str] = set()
    splits: list[list[dict]] = []
    for size in (num_train, num_eval):
        out: list[dict] = []
        attempts = 0
        while len(out) < size:
            attempts += 1
            if attempts > 100 * size:
                raise RuntimeError("not enough distinct questions for the requested sizes")
            name = names[len(out) % len(names)]
            pos = (len(out) // len(names)) % len(LETTERS)
            question, options = templates[name](rng, pos)
            body = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
            content = f"{question}\n{body}"
            if content in seen or len(set(options)) != len(options):
                continue
            seen.add(content)
            rec = {
                "id": f"{name}{len(seen):04d}",
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": content},
                ],
                "solution": LETTERS[pos],
                "choices": options,
            }
            if not splits:  # training questions: one rendering per gold letter
                rec["variants"] = rule_variants(name, question, options, pos)
            out.append(rec)
        rng.shuffle(out)
        splits.append(out)
    return splits[0], splits[1]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megagrpo import fileio

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--eval", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default="rule", choices=("rule", "easy"))
    parser.add_argument("--options", type=int, default=2, choices=(2, 3, 4), help="--task easy")
    default_out = Path(__file__).resolve().parents[1] / "megagrpo" / "assets"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="write nothing: exit 1 unless the defaults regenerate the shipped files",
    )
    args = parser.parse_args()
    if args.task == "rule":
        train, evals = build_rule(args.train, args.eval, args.seed)
    else:
        train, evals = build(args.train, args.eval, args.seed, num_options=args.options)
    files = {"demo_mcq_train.jsonl": train, "demo_mcq_eval.jsonl": evals}
    texts = {n: "".join(json.dumps(r) + "\n" for r in recs) for n, recs in files.items()}
    if args.quick:
        same = all((default_out / n).read_text(encoding="utf-8") == t for n, t in texts.items())
        print(f"quick: the shipped demo_mcq files regenerate byte for byte: {same}")
        raise SystemExit(0 if same else 1)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        path = args.out / name
        fileio.write_text(path, text)
        print(f"{path}: {len(files[name])} problems")


if __name__ == "__main__":
    main()
