#!/usr/bin/env python
"""Padding in training micro-batches: padded (length-sorted, ``micro_batch_size`` samples
padded to the longest) against packed rows (megagrpo.trainer.batch), on real batches.

Sources (one table row each):
  * ``--completions FILE`` (the trainer's completions log, e.g. runs/demo_cpu/completions.jsonl):
    the real completion lengths of every step's batch; prompt lengths are the problems' real
    prompt ids under ``--tokenizer`` when ``--problems`` names their file, else
    ``--prompt-tokens``.
  * ``--igakuqa DIR`` (data/igakuqa: docs/igakuqa.md): the real IgakuQA prompts (text + choices,
    the built-in Japanese prompt), 96 problems x G=8 per step as in the seed's job, with
    completion lengths drawn from a stated model (log-normal, median ``--median``, sigma
    ``--sigma``, clipped to [16, ``--max-tokens``]) because no 235B completions exist here.
    Prompt tokens: ``--igakuqa-tokenizer`` (a Qwen3 tokenizer dir, on the cluster) or,
    without one, characters x ``--tokens-per-char`` (a stated ratio) + 40 template tokens;
    prompt + completion is capped at ``--max-model-len`` (the engine's limit).

Prints, per source: samples per batch, mean / max length, the padded waste (fraction of
computed token slots that are padding) at several micro-batch sizes, and packed rows at
several row budgets (rows, fill). Usage:
  python tools/bench_packing.py --igakuqa data/igakuqa [--completions FILE]
  python tools/bench_packing.py --quick   (the bundled demo problems as prompts, 2 steps of 4 x 4)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import defaultdict
from pathlib import Path

from megagrpo.trainer.batch import padding_stats

MICRO = (1, 2, 4, 8)
ROWS = (5120, 8192, 16384)
REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--completions", nargs="*", default=[], help="trainer completions logs")
    p.add_argument("--problems", default=None, help="the problems file of those logs")
    p.add_argument("--prompt-tokens", type=int, default=60)
    p.add_argument("--igakuqa", default=None, help="IgakuQA data dir")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir of the logged run")
    p.add_argument("--igakuqa-tokenizer", default=None, help="Qwen3 tokenizer dir")
    p.add_argument("--max-model-len", type=int, default=5120)
    p.add_argument("--tokens-per-char", type=float, default=0.9)
    p.add_argument("--groups", type=int, default=96)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--median", type=float, default=900.0)
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--quick", action="store_true", help="the bundled demo problems as prompts, 2 small steps"
    )
    a = p.parse_args(argv)
    if a.quick:
        a.igakuqa = a.igakuqa or str(REPO / "megagrpo" / "assets" / "demo_train.jsonl")
        a.groups, a.group_size, a.steps, a.median, a.max_tokens = 4, 4, 2, 64.0, 256
    return a


def _prompt_lengths(problems, tokenizer_dir: str | None, per_char: float) -> dict[str, int]:
    if tokenizer_dir:
        from transformers import AutoTokenizer

        from megagrpo.data.prompts import prompt_ids

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        return {p.id: len(prompt_ids(tok, p)) for p in problems}
    return {
        p.id: 40 + round(per_char * sum(len(str(m["content"])) for m in p.messages))
        for p in problems
    }


def completions_batches(args) -> list[list[int]]:
    """Per logged step, the batch's sample lengths (prompt + completion tokens)."""
    prompts: dict[str, int] = {}
    if args.problems:
        from megagrpo.data.loader import load_problems

        prompts = _prompt_lengths(
            load_problems([args.problems]), args.tokenizer, args.tokens_per_char
        )
    steps: dict[tuple[str, int], list[int]] = defaultdict(list)
    for f in args.completions:
        for line in Path(f).read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            prompt = prompts.get(r.get("problem_id", ""), args.prompt_tokens)
            steps[(f, int(r["step"]))].append(prompt + int(r["length"]))
    return [steps[s] for s in sorted(steps)]


def igakuqa_batches(args) -> list[list[int]]:
    """Seed-job batches: real IgakuQA prompt lengths, modelled completion lengths."""
    from megagrpo.data.loader import load_problems

    problems = list(load_problems([args.igakuqa], exclude_images=True))
    prompts = list(_prompt_lengths(problems, args.igakuqa_tokenizer, args.tokens_per_char).values())
    rng = random.Random(args.seed)
    batches = []
    for _ in range(args.steps):
        batch = []
        for p in rng.sample(prompts, args.groups):
            for _ in range(args.group_size):
                c = rng.lognormvariate(0.0, args.sigma) * args.median
                n = p + int(min(max(c, 16), args.max_tokens))
                batch.append(min(n, args.max_model_len))
        batches.append(batch)
    return batches


def summarise(name: str, batches: list[list[int]]) -> dict:
    """Mean over batches of :func:`megagrpo.trainer.batch.padding_stats`."""
    longest = max(max(b) for b in batches)
    out: dict = {
        "source": name,
        "batches": len(batches),
        "samples_per_batch": statistics.mean(len(b) for b in batches),
        "mean_len": statistics.mean(x for b in batches for x in b),
        "max_len": longest,
    }
    for m in MICRO:
        waste = [padding_stats(b, m, max(longest, 1))["padded_waste"] for b in batches]
        out[f"padded_waste_mbs{m}"] = statistics.mean(waste)
    for row in (r for r in ROWS if r >= longest):
        stats = [padding_stats(b, 1, row) for b in batches]
        out[f"packed_rows_{row}"] = statistics.mean(s["packed_rows"] for s in stats)
        out[f"packed_fill_{row}"] = statistics.mean(
            s["real"] / (s["packed_rows"] * row) for s in stats
        )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    if args.completions:
        rows.append(summarise("completions log", completions_batches(args)))
    if args.igakuqa:
        rows.append(summarise("IgakuQA prompts, modelled completions", igakuqa_batches(args)))
    if not rows:
        raise SystemExit("give --completions FILE and/or --igakuqa DIR")
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        print(
            f"{r['source']}: {r['batches']} batches of {r['samples_per_batch']:.0f} samples, "
            f"length mean {r['mean_len']:.0f}, max {r['max_len']}"
        )
        print(
            "  padded waste (length-sorted micro-batches): "
            + ", ".join(f"mbs={m}: {100 * r[f'padded_waste_mbs{m}']:.1f}%" for m in MICRO)
        )
        for row in ROWS:
            if f"packed_rows_{row}" in r:
                print(
                    f"  packed rows of {row} tokens: {r[f'packed_rows_{row}']:.0f} rows "
                    f"(vs {r['samples_per_batch']:.0f} micro-batches at mbs=1), "
                    f"fill {100 * r[f'packed_fill_{row}']:.1f}%"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
