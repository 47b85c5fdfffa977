"""Partial rollouts (``rollout.partial``) on the bigram policy and engine of test_trainer_loop.py
(real config, loop, loss, checkpoints; a fake model only), with an engine that stops on a stop
token, honours the call's ``max_tokens`` and continues from ``meta['prompt_ids']`` like the real
engines: the staleness bound, complete groups only, importance weights against a reference
computed by hand from the version tags, and carried completions across a SIGTERM + resume."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from test_trainer_loop import VOCAB, BigramEngine, BigramPolicy

from megagrpo.config import load_config
from megagrpo.errors import ConfigError
from megagrpo.metrics import read_metrics
from megagrpo.rollout.base import request_seed, sample_counts
from megagrpo.testing import tiny_run_config, write_run_config
from megagrpo.trainer.config import RunConfig
from megagrpo.types import Group

STOP = 0
"""Token that ends a completion (finish reason ``stop``)."""
MAX_TOKENS = 12
CURRENT = {"step": 0}
"""The step being run (the importance-weight spy keys what it records by it)."""


class Tok:
    """What Rollouts.decode needs of a tokenizer."""

    def __len__(self) -> int:
        return VOCAB

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


class StoppingBigram(BigramEngine):
    """BigramEngine that stops at :data:`STOP`, takes the call's ``max_tokens`` and a fixed
    prompt from ``meta['prompt_ids']`` (prompt + carried prefix)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.tokenizer = Tok()

    def prompt_ids(self, problem) -> list[int]:
        if "prompt_ids" in problem.meta:
            return list(problem.meta["prompt_ids"])
        return super().prompt_ids(problem)

    def generate(self, problems, n, sampling=None):
        seed = sampling.seed if sampling and sampling.seed is not None else 0
        offset = sampling.problem_offset if sampling else 0
        limit = (sampling.max_tokens if sampling else None) or self.cfg.max_tokens
        out = []
        for j, (problem, n_j) in enumerate(zip(problems, sample_counts(n, len(problems)))):
            prompt = self.prompt_ids(problem)
            tokens, logprobs, reasons = [], [], []
            for i in range(n_j):
                gen = torch.Generator().manual_seed(request_seed(seed, offset + j, i))
                last, toks, lps, reason = prompt[-1], [], [], "length"
                for _ in range(limit):
                    logp = torch.log_softmax(self.weight[last], -1)
                    last = int(torch.multinomial(logp.exp(), 1, generator=gen))
                    toks.append(last)
                    lps.append(float(logp[last]))
                    if last == STOP:
                        reason = "stop"
                        break
                tokens.append(toks)
                logprobs.append(lps)
                reasons.append(reason)
            out.append(Group(problem, [""] * n_j, tokens, logprobs, [], [], prompt, reasons))
        return out


def _context(bigram_dir: Path, out: Path, name: str, *, engine=StoppingBigram, partial=None, **kw):
    from megagrpo.trainer.setup import build_context

    resume = kw.pop("resume", False)
    part = {"enabled": True, "chunk_tokens": 2, "finish_fraction": 0.5, "max_staleness": 2}
    sections = {
        "loss": {"backend": "torch"},
        "trainer": {
            "max_steps": 6,
            "lr": 0.3,
            "save_every": 0,
            "keep_checkpoints": 10,
            **kw.pop("trainer", {}),
        },
        "rollout": {
            "max_tokens": MAX_TOKENS,
            "probe_len": 8,
            "partial": {**part, **(partial or {})},
        },
        "dynamic": {"enabled": False},
        **kw,
    }
    cfg = tiny_run_config(bigram_dir, out, name, **sections)
    run = load_config(RunConfig, [write_run_config(out / f"{name}.yaml", cfg)])
    return build_context(
        run, resume=resume, policy_factory=lambda m, p: BigramPolicy(), engine_factory=engine
    )


def _train(ctx, stop=None):
    from megagrpo.trainer.loop import train
    from megagrpo.trainer.setup import shutdown

    try:
        return train(ctx) if stop is None else train(ctx, stop)
    finally:
        shutdown(ctx)


def _record_batches(monkeypatch) -> list[tuple[int, torch.Tensor, list[Group]]]:
    """(step, the policy's weights when the step generates = the engines' = the trainer's when
    it trains, the trained groups) of every step."""
    from megagrpo.trainer import loop

    seen: list[tuple[int, torch.Tensor, list[Group]]] = []
    real = loop.collect_batch

    def record(ctx, step):
        CURRENT["step"] = step
        weights = ctx.policy.weight().detach().clone()
        batch, gen = real(ctx, step)
        seen.append((step, weights, list(batch.groups)))
        return batch, gen

    monkeypatch.setattr(loop, "collect_batch", record)
    return seen


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_staleness_bound_is_never_exceeded_and_groups_train_complete(
    bigram_dir, tmp_path, monkeypatch, limit
):
    seen = _record_batches(monkeypatch)
    rows = _train(_context(bigram_dir, tmp_path, "run", partial={"max_staleness": limit}))
    carried = [r["partial/carried_completions"] for r in rows]
    assert (max(carried) > 0) == (limit > 0), carried  # the budget did stop rounds early
    assert all(r["partial/staleness_max"] <= limit for r in rows)
    if limit:
        assert max(r["partial/staleness_max"] for r in rows) >= 1
    for step, _, groups in seen:
        for g in groups:
            assert len(g.meta["policy_versions"]) == g.size
            for ids, lps, versions, reason in zip(
                g.token_ids, g.logprobs, g.meta["policy_versions"], g.finish_reasons
            ):
                assert len(ids) == len(lps) == len(versions) >= 1
                assert versions == sorted(versions) and step - versions[0] <= limit
                assert max(versions) <= step
                # complete: ended on the stop token, or ran to max_tokens
                assert (reason == "stop" and ids[-1] == STOP) or (
                    reason == "length" and len(ids) == MAX_TOKENS and STOP not in ids
                ), (reason, ids)


def spy_tis_weights(monkeypatch) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(training step, engine log-probs, importance weights) of every ``tis_weights`` call
    (the reference loss and the kernel's epilogue both reach it through algo.tis_factor)."""
    from megagrpo.algo import losses

    recorded: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    real = losses.tis_weights

    def spy(old, rollout, cap, mode="truncate"):
        w = real(old, rollout, cap, mode)
        r, flat = rollout.detach().reshape(-1).clone(), w.reshape(-1).clone()
        recorded.append((CURRENT["step"], r, flat))
        return w

    monkeypatch.setattr(losses, "tis_weights", spy)
    return recorded


def check_weights_from_version_tags(seen, recorded, cap: float) -> None:
    """Every trained token's weight equals min(pi_now(tok) / pi_v(tok), cap), computed here
    from the bigram weights of each step (``seen``: (step, weights, groups)) with pi_v those of
    the token's version tag; fails unless some stale token has a weight != 1."""
    weights = {step: w for step, w, _ in seen}
    got = {
        (step, round(float(r), 5)): float(w) for step, rs, ws in recorded for r, w in zip(rs, ws)
    }
    stale = 0
    for step, _, groups in seen:
        for g in groups:
            for ids, lps, versions in zip(g.token_ids, g.logprobs, g.meta["policy_versions"]):
                prev = [g.prompt_ids[-1], *ids[:-1]]
                for p, t, lp, v in zip(prev, ids, lps, versions):
                    behaviour = float(torch.log_softmax(weights[v][p], -1)[t])
                    now = float(torch.log_softmax(weights[step][p], -1)[t])
                    assert lp == pytest.approx(behaviour, abs=1e-5)  # the engine's, version v
                    ref = min(torch.exp(torch.tensor(now - behaviour)).item(), cap)
                    assert got[(step, round(lp, 5))] == pytest.approx(ref, rel=1e-4, abs=1e-5)
                    stale += v < step and abs(ref - 1.0) > 1e-3
    assert stale > 0, "no stale token with a weight != 1: the test would not see a mix-up"


def test_importance_weights_equal_a_reference_from_the_version_tags(
    bigram_dir, tmp_path, monkeypatch
):
    """Each trained token's weight is min(pi_now(tok) / pi_v(tok), cap) with pi_v the weights of
    the step that sampled it (its version tag) and pi_now the trainer's at the training step."""
    seen = _record_batches(monkeypatch)
    recorded = spy_tis_weights(monkeypatch)
    ctx = _context(bigram_dir, tmp_path, "run", trainer={"max_steps": 5})
    cap = ctx.cfg.loss.tis_cap
    assert cap == 2.0 and ctx.cfg.trainer.old_logprobs == "recompute"
    _train(ctx)
    check_weights_from_version_tags(seen, recorded, cap)


class SignalAtSleep(StoppingBigram):
    """Sends SIGTERM to this process during phase 4 of the second step that trains."""

    sleeps = 0

    def sleep(self) -> None:
        super().sleep()
        SignalAtSleep.sleeps += 1
        if SignalAtSleep.sleeps == 2:
            signal.raise_signal(signal.SIGTERM)


def _pending(run_dir: Path, step: int) -> dict:
    state = json.loads((run_dir / f"checkpoints/step_{step:06d}/trainer.json").read_text())
    return state["partial"]


def test_carried_completions_survive_sigterm_and_resume(bigram_dir, tmp_path):
    from megagrpo.parallel.signals import StopSignals

    _train(_context(bigram_dir, tmp_path, "full", trainer={"save_every": 1}))
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    stop = StopSignals().install()
    try:
        ctx = _context(bigram_dir, tmp_path, "stop", engine=SignalAtSleep)
        part = _train(ctx, stop)
    finally:
        stop.restore()
    stopped = len(part)  # the second trained step (a step that trains nothing never sleeps)
    assert ctx.stopped_by == "SIGTERM" and 2 <= stopped < 6
    saved = _pending(tmp_path / "stop", stopped)
    assert saved["pending"], "nothing was carried at the stop: the test would prove nothing"
    assert saved == _pending(tmp_path / "full", stopped)
    _train(_context(bigram_dir, tmp_path, "stop", resume=True, trainer={"save_every": 1}))
    resumed = read_metrics(tmp_path / "stop" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for a, b in zip(full, resumed, strict=True):
        for key, value in a.items():
            if not key.startswith("perf/") and key not in ("time", "sync/engine_s"):
                assert b.get(key) == value, (a["step"], key)
    for step in range(stopped + 1, 7):
        assert _pending(tmp_path / "stop", step) == _pending(tmp_path / "full", step)


def test_partial_needs_recomputed_old_logprobs(bigram_dir, tmp_path):
    with pytest.raises(ConfigError, match="rollout.partial.enabled"):
        _context(bigram_dir, tmp_path, "bad", trainer={"old_logprobs": "rollout"})


class CappedBigram(StoppingBigram):
    """StoppingBigram that honours a request's own cap (``meta['max_tokens']``, as the vLLM
    and HF engines do) and records, per continued member, its prefix length and cap."""

    asked: list[tuple[int, int]] = []

    def generate(self, problems, n, sampling=None):
        import dataclasses

        from megagrpo.rollout.base import problem_max_tokens

        limit = (sampling.max_tokens if sampling else None) or self.cfg.max_tokens
        out = []
        for j, problem in enumerate(problems):
            cap = problem_max_tokens(problem, limit)
            if "prompt_ids" in problem.meta:
                base = dict(problem.meta)
                prefix = len(base.pop("prompt_ids")) - len(
                    super().prompt_ids(dataclasses.replace(problem, meta=base))
                )
                self.asked.append((prefix, cap))
            spec = dataclasses.replace(sampling, max_tokens=cap, problem_offset=j)
            counts = sample_counts(n, len(problems))[j]
            out += super().generate([problem], counts, spec)
        return out


def test_continued_members_ask_only_for_their_room(bigram_dir, tmp_path):
    """Audit 3 m6: a continued member asks the engine for at most its remaining room
    (rollout.max_tokens - its prefix), not a whole chunk that the round then cuts."""
    CappedBigram.asked = []
    _train(
        _context(
            bigram_dir,
            tmp_path,
            "capped",
            engine=CappedBigram,
            partial={"chunk_tokens": 5, "max_staleness": 2},
            trainer={"max_steps": 3},
        )
    )
    asked = CappedBigram.asked
    assert asked and all(cap == min(5, MAX_TOKENS - prefix) for prefix, cap in asked)
    assert any(cap < 5 for _, cap in asked)  # the case: less room than a chunk
