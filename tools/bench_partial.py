"""Partial rollouts vs synchronous rounds on a long-tail workload (generation side).

The workload: most completions are short and a few are 10x longer than the median (the tail a
thinking model's long answers make). SmolLM2-135M decodes every token on the HF engine (real
model, real batched ``generate``); each completion ends at a length drawn per completion —
median ``--median`` tokens, a ``--tail-frac`` of them ``--tail-mult`` x the median — as if the
model emitted its stop token there (:class:`TailLengths`: the engine never stops earlier, and a
completion continued in a later chunk keeps its length). Both sides draw the same lengths for
the same step, problem and answer.

Each step generates B problems x G answers; the synchronous side runs every completion to its
end (a round lasts as long as its longest completion, the whole batch decoding meanwhile, as
the HF engine's padded batch does), the partial side (``rollout.partial``: chunks,
finish_fraction, carried completions) stops at its budget and continues the rest next step.
Both sides run interleaved in one process (step k sync, step k partial, ...) so a loaded
machine slows both alike. Reported: completions of finished groups (what would train) per
second of generation, generated tokens per trained token. Training is not run (fixed
weights: the version tags still advance).

    python tools/bench_partial.py            # the long-tail workload, 6 steps
    python tools/bench_partial.py --quick    # CI smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import time

from megagrpo.data.loader import load_problems
from megagrpo.model.pretrained import resolve_model_path
from megagrpo.parallel.comm import Comm
from megagrpo.placement.partial import PartialRollouts
from megagrpo.placement.rollouts import Rank0Rollouts, round_seed
from megagrpo.rollout import RolloutConfig, SamplingSpec, build_engine
from megagrpo.rollout.base import sample_counts
from megagrpo.rollout.config import PartialConfig
from megagrpo.testing import DEMO_EVAL
from megagrpo.types import Group

log = logging.getLogger("bench_partial")

LONG = " Explain your reasoning step by step in detail before giving the answer."


class NoReward:
    names = ["none"]

    def __call__(self, completions, problem, lengths=None, token_ids=None):
        return [0.0] * len(completions), {"none": [0.0] * len(completions)}

    def score_groups(self, groups) -> None:
        for g in groups:
            g.rewards, g.reward_parts = [0.0] * g.size, {"none": [0.0] * g.size}


class TailLengths:
    """A RolloutEngine around a real one: every completion ends at its drawn length (module
    doc). A fresh request draws one length per answer (in request order, from ``seed``); a
    continuation (prompt + a carried prefix) looks its completion up by its token ids. The
    wrapped engine decodes ``min(call max_tokens, longest remaining length)`` tokens for the
    whole call and never stops on its own stop tokens."""

    def __init__(self, engine, median: int, mult: float, frac: float, seed: int):
        self.engine, self.tokenizer = engine, engine.tokenizer
        engine.eos_ids = []  # lengths come from the draw, not from the model's stop token
        self.median, self.mult, self.frac = median, mult, frac
        self.rng = random.Random(seed)
        self.live: dict[tuple[int, ...], tuple[int, int]] = {}
        """prompt + tokens so far -> (the completion's drawn length, tokens so far)."""

    def draw(self) -> int:
        if self.rng.random() < self.frac:
            return int(self.median * self.mult)
        return self.rng.randint(max(1, self.median // 2), self.median * 3 // 2)

    def generate(self, problems, n, spec: SamplingSpec) -> list[Group]:
        counts = sample_counts(n, len(problems))
        plans = []  # per problem: (prompt ids, [(drawn length, tokens so far) per answer])
        for p, c in zip(problems, counts):
            prompt = self.engine.prompt_ids(p)
            if tuple(prompt) in self.live:  # a carried completion, continued
                plans.append((prompt, [self.live.pop(tuple(prompt))]))
            else:
                plans.append((prompt, [(self.draw(), 0) for _ in range(c)]))
        left = [target - done for _, answers in plans for target, done in answers]
        cap = spec.max_tokens or self.engine.cfg.max_tokens
        spec = dataclasses.replace(spec, max_tokens=max(1, min(cap, max(left))))
        out = self.engine.generate(problems, counts, spec)
        k = 0
        for g, (prompt, answers) in zip(out, plans):
            for i, (target, done) in enumerate(answers):
                ids, lps = g.token_ids[i][: left[k]], g.logprobs[i][: left[k]]
                g.token_ids[i], g.logprobs[i] = ids, lps
                g.finish_reasons[i] = "stop" if len(ids) >= left[k] else "length"
                if len(ids) < left[k]:  # continued in a later chunk: keeps its length
                    self.live[tuple(prompt + ids)] = (target, done + len(ids))
                k += 1
            g.lengths = [len(t) for t in g.token_ids]
        return out

    def __getattr__(self, name: str):  # everything else is the wrapped engine's
        return getattr(self.engine, name)

    def close(self) -> None:
        self.engine.close()


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 steps, short lengths")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4, help="problems per step")
    ap.add_argument("--group", type=int, default=4, help="answers per problem")
    ap.add_argument("--median", type=int, default=12, help="median completion length")
    ap.add_argument("--tail-mult", type=float, default=10.0, help="tail length / median")
    ap.add_argument("--tail-frac", type=float, default=0.125, help="completions in the tail")
    ap.add_argument("--chunk", type=int, default=24)
    ap.add_argument("--finish-fraction", type=float, default=0.75)
    ap.add_argument("--max-staleness", type=int, default=2)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.batch, args.group, args.median, args.chunk = 2, 2, 2, 4, 8
    return args


def main() -> None:
    args = _parse()
    logging.basicConfig(level=logging.WARNING)
    max_tokens = int(args.median * args.tail_mult) + 8
    cfg = RolloutConfig(engine="hf", group_size=args.group, max_tokens=max_tokens)
    cfg.max_model_len = 1024
    path = str(resolve_model_path("smollm2-135m"))
    problems = load_problems([str(DEMO_EVAL.with_name("demo_train.jsonl"))])
    for p in problems:
        p.messages = [dict(m) for m in p.messages]
        p.messages[-1]["content"] += LONG
    sides = {}
    for name in ("sync", "partial"):
        engine = TailLengths(
            build_engine(cfg, path, seed=0), args.median, args.tail_mult, args.tail_frac, seed=1
        )
        sides[name] = {
            "rollouts": Rank0Rollouts(engine, Comm(), NoReward()),  # type: ignore[arg-type]
            "engine": engine,
            "s": 0.0,
            "completions": 0,
            "gen_tokens": 0,
            "trained_tokens": 0,
        }
    part_cfg = PartialConfig(True, args.finish_fraction, 0, args.chunk, args.max_staleness)
    partial = PartialRollouts(part_cfg, max_tokens, seed=0)
    for step in range(1, args.steps + 1):
        batch = [problems[(step * args.batch + j) % len(problems)] for j in range(args.batch)]
        s = sides["sync"]
        t = time.perf_counter()
        groups = s["rollouts"].generate_round(batch, args.group, round_seed(0, step, 0))
        s["s"] += time.perf_counter() - t
        tokens = sum(sum(g.lengths) for g in groups)
        s["completions"] += sum(g.size for g in groups)
        s["gen_tokens"] += tokens
        s["trained_tokens"] += tokens
        p = sides["partial"]
        t = time.perf_counter()
        partial.begin_step()
        groups = partial.generate_round(p["rollouts"], batch, [args.group] * len(batch), step, 0)
        p["s"] += time.perf_counter() - t
        p["completions"] += sum(g.size for g in groups)
        p["gen_tokens"] += partial.stats.gen_tokens
        p["trained_tokens"] += sum(sum(g.lengths) for g in groups)
        log.warning(
            "step %d/%d: sync %.1f s, partial %.1f s (%d carried)",
            step,
            args.steps,
            s["s"],
            p["s"],
            partial.metrics()["partial/carried_completions"],
        )
    out: dict = {
        "workload": {
            "median_tokens": args.median,
            "tail_tokens": int(args.median * args.tail_mult),
            "tail_frac": args.tail_frac,
            "batch": args.batch,
            "group": args.group,
            "steps": args.steps,
            "chunk": args.chunk,
            "finish_fraction": args.finish_fraction,
            "max_staleness": args.max_staleness,
        }
    }
    for name, side in sides.items():
        out[name] = {
            "seconds": round(side["s"], 2),
            "trained_completions": side["completions"],
            "completions_per_s": round(side["completions"] / max(side["s"], 1e-9), 3),
            "gen_tokens_per_trained_token": round(
                side["gen_tokens"] / max(side["trained_tokens"], 1), 3
            ),
        }
        side["engine"].close()
    out["speedup"] = round(
        out["partial"]["completions_per_s"] / max(out["sync"]["completions_per_s"], 1e-9), 3
    )
    out["carried_at_end"] = partial.metrics()["partial/carried_completions"]
    print(json.dumps(out, indent=1))  # CLI output


if __name__ == "__main__":
    main()
