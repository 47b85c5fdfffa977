"""Benchmark the curriculum: planner speed and per-step sampler overhead.

1. Planner: 100k problems (the specialist exam's level mix, scaled), 1,000 simulated steps,
   G=8, B=96, R=3, per policy.
2. Per-step overhead of CurriculumSampler + DynamicSampler for 1,000 groups of G=8
   (draw 1,000 problems, observe them, filter, collapse stats), generation excluded:
   the generate_fn hands back pre-built groups. Side by side: a naive pure-Python
   statistics.pstdev filter + per-group dict bookkeeping, as a peer trainer loop does.

    python tools/bench_curriculum.py [--problems 100000] [--steps 1000] [--groups 1000]
    python tools/bench_curriculum.py --quick     # 2,000 problems, 20 steps, 50 groups: does it run?
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np

from megagrpo.curriculum.config import CurriculumConfig, DynamicSamplingConfig
from megagrpo.curriculum.dynamic import DynamicSampler
from megagrpo.curriculum.sampler import CurriculumSampler
from megagrpo.plan.simulate import BernoulliEngine, PlanSetup, run_plan, synthetic_population

SPECIALIST = {1: 2164, 2: 294, 3: 223, 4: 180, 5: 216, 6: 636}


def bench_planner(num_problems: int, steps: int) -> None:
    total = sum(SPECIALIST.values())
    hist = {lv: round(n * num_problems / total) for lv, n in SPECIALIST.items()}
    print(f"planner: {sum(hist.values())} problems, {steps} steps, G=8, B=96, R=3")
    print(
        f"{'keep':<7}{'policy':<10}{'seconds':>9}{'ms/step':>9}{'gen/step':>10}"
        f"{'acr_raw':>9}{'ds_ok':>7}"
    )
    for keep in ([1, 2, 3, 4, 5, 6], [2, 3, 4, 5]):
        for policy in ("original", "carry"):
            cur = CurriculumConfig(keep_levels=keep, retire_streak=0)
            dyn = DynamicSamplingConfig(policy=policy, max_resample=3)
            r = run_plan(PlanSetup(hist, 5, 8, 96, steps, cur), dyn).to_dict()
            print(
                f"{'L1-L6' if len(keep) == 6 else 'L2-L5':<7}{policy:<10}{r['seconds']:>9.2f}"
                f"{1e3 * r['seconds'] / steps:>9.2f}{r['gen_batches_per_step']:>10.2f}"
                f"{r['acr_raw_mean']:>9.3f}{r['ds_success_rate']:>7.2f}"
            )


def _naive_step(problems, groups, counts) -> list:
    """Peer-style: pure-Python std per group, dict-of-lists bookkeeping."""
    valid = [g for g in groups if statistics.pstdev(g.rewards) > 0]
    for g in groups:
        c = counts.setdefault(g.problem.id, [0, 0])
        c[0] += sum(1 for r in g.rewards if r >= 0.5)
        c[1] += len(g.rewards)
    acr = 1 - len(valid) / len(groups)
    return [valid, acr]


def _timed(fn, repeats: int) -> tuple[float, float, float]:
    """(median wall ms, min wall ms, median CPU ms) of ``fn()``."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return 1e3 * float(np.median(wall)), 1e3 * min(wall), 1e3 * float(np.median(cpu))


def bench_overhead(num_problems: int, num_groups: int, repeats: int = 50) -> float:
    """Per-step overhead; returns the median wall ms of ours."""
    total = sum(SPECIALIST.values())
    problems, levels, ps = synthetic_population(
        {lv: n * num_problems // total for lv, n in SPECIALIST.items()}, 5
    )
    sampler = CurriculumSampler(
        problems, CurriculumConfig(keep_levels=[1, 2, 3, 4, 5, 6]), levels, "correct"
    )
    ds = DynamicSampler(
        DynamicSamplingConfig(policy="carry", max_resample=0), "correct", group_size=8
    )
    cache = BernoulliEngine(ps).generate(problems[:num_groups], 8)

    def generate(batch):
        # pre-built groups re-labelled with the drawn problems: generation cost excluded
        for g, p in zip(cache, batch):
            g.problem = p
            g.meta.clear()
        return cache[: len(batch)]

    step = iter(range(10**9))

    def ours():  # the trainer's collect_batch, generation excluded
        rounds = ds.start(sampler, num_groups, next(step))
        while (requests := rounds.next_requests()) is not None:
            rounds.add(generate([r.problem for r in requests]))
        rounds.finish()
        sampler.metrics()

    counts: dict = {}
    rng = np.random.default_rng(0)

    def naive():
        batch = [problems[i] for i in rng.integers(0, len(problems), num_groups)]
        _naive_step(batch, generate(batch), counts)

    print(
        f"sampler overhead per step, {num_groups} groups x G=8, {len(problems)} problems "
        f"({repeats} steps; generation excluded)"
    )
    print(f"  {'':<58}{'median':>8}{'min':>8}{'cpu':>8}  (ms)")
    m, lo, cpu = _timed(ours, repeats)
    print(
        f"  {'megagrpo CurriculumSampler + DynamicSampler rounds + metrics':<58}"
        f"{m:>8.2f}{lo:>8.2f}{cpu:>8.2f}"
    )
    nm, nlo, ncpu = _timed(naive, repeats)
    print(
        f"  {'naive pure-Python filter + bookkeeping (no curriculum)':<58}"
        f"{nm:>8.2f}{nlo:>8.2f}{ncpu:>8.2f}"
    )
    print(f"  target < 10 ms: {'OK' if m < 10 else 'MISSED'} (median wall)\n")
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    args = parser.parse_args()
    if args.quick:
        args.problems, args.steps, args.groups = 2000, 20, 50
    logging.basicConfig(level=logging.WARNING)
    bench_overhead(args.problems, args.groups)
    bench_planner(args.problems, args.steps)


if __name__ == "__main__":
    main()
