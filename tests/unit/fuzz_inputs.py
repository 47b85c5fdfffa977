"""Seeded random and adversarial inputs for the JSONL readers and from-swift (run by
tests/unit/test_fuzz_inputs.py in a child process under memory and CPU limits).

``python tests/unit/fuzz_inputs.py SEED CASES DIR`` feeds every reader (problems, gold,
predictions, levels, metrics rows) and from-swift (command lines, shell scripts, YAML configs)
CASES inputs each, drawn from a ``random.Random(SEED)``, and prints one JSON object:
``{"cases": n, "ok": n, "named": n, "failures": [{"what", "input", "error"}]}``. A case passes
when it returns or raises a :class:`megagrpo.errors.MegagrpoError` (a named error, exit 2);
anything else (a traceback) is a failure. A config from-swift writes must load again.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

KEYS = (
    "problem_id problem_text choices answer points text_only messages query response solution "
    "conversations history system id variants prediction step k correct human_accuracy role "
    "content from value level kinki reward/mean time"
).split()
ADVERSARIAL_LINES = [
    "[" * 100_000 + "]" * 100_000,
    '{"a": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"points": ' + "9" * 5001 + "}",
    '{"step": ' + "9" * 4300 + "}",
    '{"step": 1e999, "reward/mean": NaN}',
    '{"step": Infinity}',
    '{"problem_id": "\\ud800", "answer": ["\\udfff"], "choices": ["a"], "points": 1}',
    "\ufeff{}",
    '{"messages": "x" \x00}',
    '{"messages": [{"role": "user", "content": "q"}], "solution": "' + "a" * 200_000 + '"}',
    '{"messages": [{"role": "user", "content": 5}], "solution": ["a", ["b"]]}',
    '{"query": null, "solution": "a"}',
    '{"conversations": [{"from": "alien", "value": "x"}], "solution": "a"}',
    '{"history": [[1, 2, 3]], "query": "q", "solution": "a"}',
    '{"problem_id": 1, "problem_text": "t", "answer": "z", "choices": ["x"], "points": "1"}',
    '{"problem_id": "1", "problem_text": "t", "answer": ["a"], "choices": "abc", "points": []}',
    '{"id": "x", "k": "5", "correct": 9, "level": -1}',
    '{"problem_id": "116A1", "prediction": ["a"]}',
    '{"variants": [[]], "messages": [{"role": "user", "content": "q"}], "solution": "a"}',
    '{"variants": {"a": 1}, "query": "q", "solution": "a"}',
    '{"messages": [{"role": "user", "content": "q"}], "solution": "a", "choices": {"a": 1}}',
    "{" * 3 + "}",
    '"just a string"',
]


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(11 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 5, 2**31, 2**64, 10**4000, -(10**300)])
    if kind == 3:
        return rng.choice([0.5, -0.0, 1e308, 1e-320, float("nan"), float("inf")])
    if kind in (4, 5, 6):
        alphabet = ["a", "b", "c", "z", ",", " ", "、", "ａ", "答え: ", "<answer>", "${", "}", "\n"]
        alphabet += ["\x00", "\u2028", "\\", '"', "é", "日本", "\ud800", "1", "26", "or "]
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
    if kind in (7, 8):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(KEYS): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


TEMPLATES: list[dict[str, Any]] = [
    {
        "problem_id": "116A1",
        "problem_text": "q",
        "choices": ["x", "y", "z"],
        "answer": ["a"],
        "points": 1,
        "text_only": True,
    },
    {
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        "solution": "b",
        "choices": ["x", "y"],
        "id": "p1",
    },
    {"query": "q", "response": "a", "history": [["q0", "r0"]], "system": "s", "solution": "a"},
    {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "c"}]},
    {
        "messages": [{"role": "user", "content": "q"}],
        "solution": "a",
        "variants": [{"messages": [{"role": "user", "content": "q2"}], "solution": "b"}],
    },
    {"problem_id": "116A1", "prediction": "a,b"},
    {"id": "p1", "k": 5, "correct": 3, "level": 2},
    {"step": 1, "time": 1.5, "reward/mean": 0.5, "collapse/acr_raw": None},
]


def _mutate(rng: random.Random, node: Any, depth: int = 0) -> Any:
    """``node`` with a few values replaced, keys dropped or added (recursively)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            roll = rng.random()
            if roll < 0.08:
                continue
            out[key] = _value(rng) if roll < 0.2 else _mutate(rng, value, depth + 1)
        if rng.random() < 0.1:
            out[rng.choice(KEYS)] = _value(rng)
        return out
    if isinstance(node, list):
        items = [_mutate(rng, v, depth + 1) for v in node if rng.random() > 0.1]
        return items + ([_value(rng)] if rng.random() < 0.1 else [])
    return _value(rng) if rng.random() < 0.1 else node


def _jsonl(rng: random.Random, templates: list[dict[str, Any]]) -> bytes:
    lines: list[bytes] = []
    template = rng.choice(templates)
    for _ in range(rng.randrange(1, 5)):
        roll = rng.random()
        if roll < 0.12:
            lines.append(rng.choice(ADVERSARIAL_LINES).encode("utf-8", "surrogatepass"))
        elif roll < 0.15:
            lines.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))))
        else:
            obj = _mutate(rng, template) if rng.random() < 0.8 else template
            text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, allow_nan=True)
            if rng.random() < 0.05:
                text = text[: rng.randrange(len(text) + 1)]  # torn
            lines.append(text.encode("utf-8", "surrogatepass"))
    return b"\n".join(lines) + (b"\n" if rng.random() < 0.8 else b"")


def _readers() -> dict[str, tuple[Callable[[Path], Any], list[dict[str, Any]]]]:
    """``{name: (reader, the templates of its format)}``."""
    from megagrpo.curriculum.levels import read_levels_file
    from megagrpo.data import load_problems
    from megagrpo.metrics.logger import read_metrics
    from megagrpo.rewards.igakuqa import read_gold, read_predictions

    return {
        "load_problems": (lambda p: load_problems([p]), TEMPLATES[:5]),
        "load_problems columns": (
            lambda p: load_problems([p], columns={"prompt": "query", "answer": "solution"}),
            TEMPLATES[1:5],
        ),
        "read_gold": (lambda p: read_gold([p]), TEMPLATES[:1]),
        "read_predictions": (lambda p: read_predictions([p]), TEMPLATES[5:6]),
        "read_levels_file": (read_levels_file, TEMPLATES[6:7]),
        "read_metrics": (read_metrics, TEMPLATES[7:8]),
    }


FLAGS = (
    "num_generations max_completion_length lora_rank lora_alpha beta temperature epsilon "
    "epsilon_high dynamic_sample max_resample_times loss_type per_device_train_batch_size "
    "gradient_accumulation_steps global_batch_size micro_batch_size steps_per_generation "
    "generation_batch_size learning_rate lr_scheduler_type system columns dataset "
    "reward_funcs reward_weights train_type target_modules torch_dtype max_steps top_k top_p "
    "num_iterations importance_sampling_level overlong_filter vllm_mode external_plugins"
).split()
VALUES = [
    "0",
    "-1",
    "1",
    "8",
    "1e-6",
    "1e999",
    "nan",
    "inf",
    "9" * 5000,
    "true",
    "maybe",
    "",
    "${oc.env:HOME}",
    "${foo",
    "\\${x}",
    "a\nb: 1",
    "{bad",
    '{"a": "b"}',
    "[1,2]",
    "x.txt",
    "\u2028",
    "日本語",
    "grpo",
    "bnpo",
    "dr_grpo",
    "lora",
    "all-linear",
    "cosine",
    "a,b",
]


def _command(rng: random.Random) -> list[str]:
    words = ["swift" if rng.random() < 0.7 else "megatron", "rlhf", "--rlhf_type", "grpo"]
    words += ["--model", rng.choice(["Qwen/Qwen3-8B", "Qwen/Qwen3-30B-A3B", "${M}", "m"])]
    for _ in range(rng.randrange(6)):
        flag = (
            rng.choice(FLAGS)
            if rng.random() < 0.9
            else "".join(rng.choice("a-_=x") for _ in range(4))
        )
        words.append(f"--{flag}")
        for _ in range(rng.choice([0, 1, 1, 1, 2])):
            words.append(rng.choice(VALUES))
    if rng.random() < 0.1:
        words.insert(rng.randrange(len(words) + 1), rng.choice(VALUES))
    return words


def _script(rng: random.Random) -> str:
    parts = []
    for i in range(rng.randrange(4)):
        parts.append(f'V{i}="{rng.choice(VALUES)}${{V{max(i - 1, 0)}}}$V{max(i - 1, 0)}"')
    cmd = " ".join(
        rng.choice([w, f"'{w}'", f'"{w}"', f"$'{w}'", f"\\\n{w}"]) for w in _command(rng)
    )
    parts.append(rng.choice(["", "export NPROC_PER_NODE=8 ", "NNODES=$(x) ", "A=`b` "]) + cmd)
    if rng.random() < 0.2:
        parts.append(rng.choice(["'unclosed", '"unclosed', "$(", "`", "${", "$'\\"]))
    return "\n".join(parts) + "\n"


def _yaml(rng: random.Random) -> str:
    lines = [f"{rng.choice(FLAGS)}: {json.dumps(rng.choice(VALUES))}" for _ in range(4)]
    extra = [
        "ENV: [a]",
        "ENV: {A: [1]}",
        "ENV: {NPROC_PER_NODE: 0}",
        "a: &a [1, 2]\nb: [*a, *a]",
        "columns: {a: b}",
        "x: !!python/object:os.system {}",
        "[1, 2]",
        "a: " + "[" * 2000,
        "model: {x: 1}",
        "- a",
        "rlhf_type: grpo\nmodel: m",
    ]
    if rng.random() < 0.6:
        lines.append(rng.choice(extra))
    return "\n".join(lines) + "\n"


def _run(failures: list[dict], what: str, shown: str, call: Callable[[], Any]) -> str:
    from megagrpo.errors import MegagrpoError

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            call()
    except MegagrpoError:
        return "named"
    except SystemExit as exc:  # argparse's own usage error: exit 2 with a message
        if exc.code in (0, 2):
            return "named"
        failures.append({"what": what, "input": shown[:300], "error": f"exit {exc.code}"})
        return "failed"
    except BaseException:  # noqa: BLE001 - the point: anything else is a defect
        error = traceback.format_exc(limit=-3)
        failures.append({"what": what, "input": shown[:300], "error": error[-1500:]})
        return "failed"
    return "ok"


def _from_swift(args: list[str], out: Path) -> None:
    """``megagrpo from-swift``; a config it writes must load again (exit 2 otherwise)."""
    from megagrpo.cli import main
    from megagrpo.config import load_config
    from megagrpo.errors import ConfigError
    from megagrpo.trainer.config import RunConfig

    out.unlink(missing_ok=True)
    rc = main(["from-swift", "--allow-partial", "--out", str(out), "--", *args])
    if rc not in (0, 2):
        raise AssertionError(f"exit {rc}")
    if rc == 0:
        try:
            load_config(RunConfig, [out])
        except ConfigError as exc:
            raise AssertionError(f"the written config does not load: {exc}") from None


def fuzz(seed: int, cases: int, workdir: Path, full_runs: int = 12) -> dict[str, Any]:
    """Run every case (see module docstring); ``full_runs`` from-swift inputs go all the way
    through the config loader (1-2 s each), the rest through parsing and translation."""
    from megagrpo.swift import translate as from_swift

    rng = random.Random(seed)
    failures: list[dict] = []
    counts = {"ok": 0, "named": 0, "failed": 0}
    data = workdir / "data.jsonl"
    for _ in range(cases):
        for name, (reader, templates) in _readers().items():
            data.write_bytes(_jsonl(rng, templates))
            shown = data.read_bytes()[:300].decode("utf-8", "replace")
            counts[_run(failures, name, shown, lambda r=reader: r(data))] += 1

    def translated(args: list[str]) -> None:
        flags, flavor, env = from_swift.read_swift_args(args)
        t = from_swift.translate(flags, flavor or "swift", 1, False, env)
        from_swift.report_lines(t)

    script, config, out = workdir / "s.sh", workdir / "c.yaml", workdir / "out.yaml"
    for i in range(cases):
        full = i < full_runs
        inputs: list[tuple[str, list[str], str]] = [("command line", _command(rng), "")]
        script.write_text(_script(rng), encoding="utf-8", errors="surrogatepass")
        inputs.append(("shell script", [str(script)], script.read_text("utf-8", "replace")))
        config.write_text(_yaml(rng), encoding="utf-8", errors="surrogatepass")
        inputs.append(("YAML config", [str(config)], config.read_text("utf-8", "replace")))
        for what, args, text in inputs:
            call = (lambda a=args: _from_swift(a, out)) if full else (lambda a=args: translated(a))
            counts[_run(failures, f"from-swift {what}", text or " ".join(args), call)] += 1
    return {"cases": sum(counts.values()), **counts, "failures": failures}


if __name__ == "__main__":
    seed, cases, workdir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    print(json.dumps(fuzz(seed, cases, workdir)))
