"""Generate the bundled demo problem set (megagrpo/assets/demo_{train,eval}.jsonl).

Easy English multiple-choice questions (small-number arithmetic, colours, opposites,
animal facts, counting) in ms-swift GRPO format (``messages`` + ``solution``), written from
templates with a fixed seed: free to ship, and a 135M instruct model answers some of them
correctly some of the time, so on the demo the reward and the collapse metrics both move.

    python tools/make_demo_problems.py            # rewrites the two files
    python tools/make_demo_problems.py --quick    # writes nothing: do they still regenerate?
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SYSTEM = (
    "You answer multiple-choice questions. Think briefly, then finish with a line "
    "'Answer: <letter>'."
)
LETTERS = "abcd"

FACTS = [
    ("What colour is the sky on a clear day?", "blue", ["green", "red", "black"]),
    ("What colour is grass?", "green", ["blue", "purple", "white"]),
    ("What colour is snow?", "white", ["black", "green", "orange"]),
    ("What colour is a ripe banana?", "yellow", ["blue", "black", "purple"]),
    ("Which animal says 'moo'?", "cow", ["cat", "dog", "bird"]),
    ("Which animal barks?", "dog", ["cow", "fish", "horse"]),
    ("Which animal can fly?", "bird", ["fish", "cow", "pig"]),
    ("Which animal lives in water and has fins?", "fish", ["dog", "cat", "horse"]),
    ("How many legs does a dog have?", "four", ["two", "six", "eight"]),
    ("How many legs does a spider have?", "eight", ["two", "four", "six"]),
    ("How many days are in a week?", "seven", ["five", "ten", "twelve"]),
    ("How many months are in a year?", "twelve", ["seven", "ten", "five"]),
    ("What is the opposite of hot?", "cold", ["warm", "big", "fast"]),
    ("What is the opposite of up?", "down", ["left", "high", "over"]),
    ("What is the opposite of big?", "small", ["tall", "wide", "heavy"]),
    ("What is the opposite of day?", "night", ["sun", "morning", "week"]),
    ("What do bees make?", "honey", ["milk", "bread", "cheese"]),
    ("What do cows give us to drink?", "milk", ["juice", "tea", "water"]),
    ("Which one is a fruit?", "apple", ["carrot", "bread", "stone"]),
    ("Which one is a vegetable?", "carrot", ["apple", "banana", "grape"]),
    ("Where does the sun rise?", "east", ["west", "north", "south"]),
    ("What do we use to see?", "eyes", ["ears", "nose", "hands"]),
    ("What do we use to hear?", "ears", ["eyes", "feet", "knees"]),
    ("Which is the largest?", "elephant", ["mouse", "cat", "ant"]),
    ("Which is frozen water?", "ice", ["steam", "sand", "glass"]),
    ("What is the capital of France?", "Paris", ["Berlin", "Madrid", "Rome"]),
    ("What is the capital of Japan?", "Tokyo", ["Osaka", "Seoul", "Beijing"]),
    ("What is the capital of Italy?", "Rome", ["Paris", "Vienna", "Athens"]),
    ("Which planet do we live on?", "Earth", ["Mars", "Venus", "Jupiter"]),
    ("What shape has three sides?", "triangle", ["square", "circle", "hexagon"]),
    ("What shape has four equal sides?", "square", ["triangle", "circle", "line"]),
    ("Which season is the coldest?", "winter", ["summer", "spring", "autumn"]),
]


def _mcq(rng: random.Random, question: str, right: str, wrong: list[str], pid: str) -> dict:
    options = [right, *wrong[:3]]
    rng.shuffle(options)
    letter = LETTERS[options.index(right)]
    body = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
    return {
        "id": pid,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{question}\n{body}"},
        ],
        "solution": letter,
        "choices": options,
    }


def _arithmetic(rng: random.Random, pid: str) -> dict:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    op = rng.choice(["+", "-"]) if a > b else "+"
    right = a + b if op == "+" else a - b
    wrong = rng.sample([x for x in range(0, 19) if x != right], 3)
    return _mcq(rng, f"What is {a} {op} {b}?", str(right), [str(w) for w in wrong], pid)


def build(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, eval) problem records."""
    rng = random.Random(seed)
    records = [_mcq(rng, q, r, list(w), f"fact{i:02d}") for i, (q, r, w) in enumerate(FACTS)]
    records += [_arithmetic(rng, f"arith{i:02d}") for i in range(40)]
    rng.shuffle(records)
    return records[:-16], records[-16:]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megagrpo import fileio

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="write nothing: exit 1 unless the shipped files regenerate byte for byte",
    )
    args = parser.parse_args()
    out = Path(__file__).resolve().parents[1] / "megagrpo" / "assets"
    train, evals = build()
    files = {"demo_train.jsonl": train, "demo_eval.jsonl": evals}
    texts = {
        n: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
        for n, recs in files.items()
    }
    if args.quick:
        same = all((out / n).read_text(encoding="utf-8") == t for n, t in texts.items())
        print(f"quick: the shipped demo_train/demo_eval files regenerate byte for byte: {same}")
        raise SystemExit(0 if same else 1)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        fileio.write_text(out / name, text)
        print(f"{out / name}: {len(files[name])} problems")


if __name__ == "__main__":
    main()
