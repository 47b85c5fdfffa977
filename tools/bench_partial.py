"""Partial rollouts vs synchronous rounds on a long-tail workload (generation side).

Free-text answers (the demo problems asked to explain at length) with ``max_tokens`` 256 on
the HF engine with SmolLM2-135M: lengths spread up to the cap. Each step generates B problems
x G answers; the synchronous side runs every completion to its end, the partial side
(``rollout.partial``: chunks, finish_fraction, carried completions) stops at its budget and
continues the rest next step. Both sides run interleaved in one process (step k sync, step k
partial, ...) so a loaded machine slows both alike. Reported: completions of finished groups
(what would train) per second of generation, the fraction hitting the cap, generated tokens
per trained token. Training is not run (fixed weights: the version tags still advance).

    python tools/bench_partial.py --quick
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from megagrpo.data.loader import load_problems
from megagrpo.model.pretrained import resolve_model_path
from megagrpo.rollout import RolloutConfig, build_engine
from megagrpo.rollout.config import PartialConfig
from megagrpo.testing import DEMO_EVAL
from megagrpo.trainer.context import Comm
from megagrpo.trainer.partial import PartialRollouts
from megagrpo.trainer.rollouts import Rank0Rollouts, round_seed

log = logging.getLogger("bench_partial")

LONG = " Explain your reasoning step by step in detail before giving the answer."


class NoReward:
    names = ["none"]

    def __call__(self, completions, problem, lengths=None, token_ids=None):
        return [0.0] * len(completions), {"none": [0.0] * len(completions)}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 steps per side, max_tokens 128")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--finish-fraction", type=float, default=0.75)
    ap.add_argument("--max-staleness", type=int, default=2)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.max_tokens = 3, 128
    logging.basicConfig(level=logging.WARNING)
    cfg = RolloutConfig(engine="hf", group_size=args.group, max_tokens=args.max_tokens)
    cfg.max_model_len = 1024
    engine = build_engine(cfg, str(resolve_model_path("smollm2-135m")), seed=0)
    rollouts = Rank0Rollouts(engine, Comm(), NoReward())  # type: ignore[arg-type]
    problems = load_problems([str(DEMO_EVAL.with_name("demo_train.jsonl"))])
    for p in problems:
        p.messages = [dict(m) for m in p.messages]
        p.messages[-1]["content"] += LONG
    part_cfg = PartialConfig(True, args.finish_fraction, 0, args.chunk, args.max_staleness)
    partial = PartialRollouts(part_cfg, args.max_tokens, seed=0)
    sides = {
        "sync": [0.0, 0, 0, 0, 0],
        "partial": [0.0, 0, 0, 0, 0],
    }  # s, compl, clip, gen, trained
    for step in range(1, args.steps + 1):
        batch = [problems[(step * args.batch + j) % len(problems)] for j in range(args.batch)]
        t = time.perf_counter()
        groups = rollouts.generate_round(batch, args.group, round_seed(0, step, 0))
        s = sides["sync"]
        s[0] += time.perf_counter() - t
        s[1] += sum(g.size for g in groups)
        s[2] += sum(r == "length" for g in groups for r in g.finish_reasons)
        tokens = sum(sum(g.lengths) for g in groups)
        s[3] += tokens
        s[4] += tokens
        t = time.perf_counter()
        partial.begin_step()
        groups = partial.generate_round(rollouts, batch, [args.group] * len(batch), step, 0)
        p = sides["partial"]
        p[0] += time.perf_counter() - t
        p[1] += sum(g.size for g in groups)
        p[2] += sum(r == "length" for g in groups for r in g.finish_reasons)
        p[3] += partial.stats.gen_tokens
        p[4] += sum(sum(g.lengths) for g in groups)
        log.warning("step %d: sync %.1fs, partial %.1fs %s", step, s[0], p[0], partial.metrics())
    out = {}
    for name, (sec, compl, clip, gen, trained) in sides.items():
        out[name] = {
            "seconds": round(sec, 2),
            "trained_completions": compl,
            "completions_per_s": round(compl / sec, 3),
            "clip_frac": round(clip / max(compl, 1), 3),
            "gen_tokens_per_trained_token": round(gen / max(trained, 1), 3),
        }
    out["speedup"] = round(
        out["partial"]["completions_per_s"] / out["sync"]["completions_per_s"], 3
    )
    out["carried_at_end"] = partial.metrics()["partial/carried_completions"]
    print(json.dumps(out, indent=1))  # CLI output
    engine.close()


if __name__ == "__main__":
    main()
