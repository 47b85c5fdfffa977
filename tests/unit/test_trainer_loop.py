"""The GRPO loop without Megatron or an inference engine: `build_context` with a small policy
and engine (a bigram language model, exact and fast), then real `grpo_step`s.

The rest is real: config loading and resolution, parallel state (one gloo rank), curriculum and
dynamic samplers, composite reward, micro-batching, the fused loss (torch backend), the
optimiser, verified weight sync (the engine checks its probe against the trainer's), metrics
rows, checkpoints and resume. This is the fast-tier guard of the loop's wiring; the end-to-end
runs on the real stack are in tests/integration/test_trainer_e2e.py (slow).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from megagrpo.config import load_config
from megagrpo.metrics import missing_metrics, read_metrics
from megagrpo.rollout.base import request_seed, sample_counts
from megagrpo.rollout.stream import SyncMeter
from megagrpo.rollout.verify import SyncVerifier, sync_report, thresholds_for
from megagrpo.testing import tiny_run_config, write_run_config
from megagrpo.trainer.config import RunConfig
from megagrpo.trainer.loop import PHASES, phase_times
from megagrpo.types import Group

VOCAB, RANK = 16, 2


def _bigram_logits(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits ``[B, T, V]`` of a bigram model with table ``weight`` ``[V, V]``."""
    return weight[ids]


class BigramPolicy:
    """A bigram model ``W [V, V]`` (frozen) plus a LoRA delta ``scale * B @ A``: the Policy
    contract in 50 lines. Its only HF tensor is ``bigram.weight``."""

    spec = "local"  # its logits read one token: every segment row is exact

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.base = torch.randn(VOCAB, VOCAB, generator=gen)
        self.lora_a = nn.Parameter(0.1 * torch.randn(RANK, VOCAB, generator=gen))
        self.lora_b = nn.Parameter(torch.zeros(VOCAB, RANK))
        self.scaling = 1.0

    def weight(self) -> torch.Tensor:
        return self.base + self.scaling * self.lora_b @ self.lora_a

    def forward_logits(self, input_ids, position_ids=None, attention_mask=None):
        return _bigram_logits(self.weight(), input_ids)

    def forward_backward(
        self, batches, loss_fn, *, forward_only=False, broadcast=True, routing=None
    ):
        outs = []
        for i, mb in enumerate(batches):  # one pipeline stage: the plain loop
            loss, out = loss_fn(self.forward_logits(mb.input_ids), i)
            if loss is not None and not forward_only:
                loss.backward()
            outs.append(out)
        return outs

    def lora_parameters(self):
        return [self.lora_a, self.lora_b]

    def grad_norm_params(self):
        return self.lora_parameters(), []

    def finish_grad_sync(self) -> None:
        pass

    @contextlib.contextmanager
    def hidden_output(self):  # no output layer of its own: the loss takes the logits
        yield None

    @contextlib.contextmanager
    def scoring(self):
        with torch.no_grad():
            yield

    def merge_survival(self, group=None):
        return {"sync/lora_survival": 1.0}

    @contextlib.contextmanager
    def adapters_disabled(self):
        saved, self.scaling = self.scaling, 0.0
        try:
            yield
        finally:
            self.scaling = saved

    def lora_state_dict(self):
        return {"a": self.lora_a.detach().clone(), "b": self.lora_b.detach().clone()}

    def load_lora_state_dict(self, sd) -> None:
        with torch.no_grad():
            self.lora_a.copy_(sd["a"])
            self.lora_b.copy_(sd["b"])

    def lora_pieces(self, optimizer=None):
        return None  # checkpoints hold lora_state_dict (same layout only)

    def load_lora_pieces(self, pieces, optimizer=None) -> None:
        raise AssertionError("a bigram checkpoint holds no layout-free pieces")

    def export_bytes_received(self) -> int:
        return 0

    def export_hf_weights(self, merge_lora=True, bucket_bytes=256 << 20, dtype=None, **_):
        yield [("bigram.weight", self.weight().detach().clone())]

    def export_peft_adapter(self, out_dir):
        return None


class BigramEngine:
    """The RolloutEngine contract over a bigram table: seeded sampling, raw log-probs, weight
    updates verified by the same probe check as the real engines."""

    def __init__(self, rollout_cfg, model_path: str, seed: int) -> None:
        self.cfg = rollout_cfg
        self.weight = BigramPolicy().base.clone()  # starts from the base, like a real engine
        self.probe_token_ids = [(3 * i + 1) % VOCAB for i in range(rollout_cfg.probe_len)]
        self.tokenizer = None
        self.calls: list[str] = []
        th = thresholds_for(rollout_cfg, "float32")
        self.verifier = SyncVerifier(th, rollout_cfg.full_check_every, self.probe_logprobs())

    def prompt_ids(self, problem) -> list[int]:
        return [sum(map(ord, problem.id)) % VOCAB, 1]

    def weight_regions(self):
        return None  # every tensor whole

    def expert_block(self):
        return None  # every expert

    def generate(self, problems, n, sampling=None):
        seed = sampling.seed if sampling and sampling.seed is not None else 0
        offset = sampling.problem_offset if sampling else 0
        out = []
        for j, (problem, n_j) in enumerate(zip(problems, sample_counts(n, len(problems)))):
            prompt = self.prompt_ids(problem)
            tokens, logprobs = [], []
            for i in range(n_j):
                gen = torch.Generator().manual_seed(request_seed(seed, offset + j, i))
                last, toks, lps = prompt[-1], [], []
                for _ in range(self.cfg.max_tokens):
                    logp = torch.log_softmax(self.weight[last], -1)
                    last = int(torch.multinomial(logp.exp(), 1, generator=gen))
                    toks.append(last)
                    lps.append(float(logp[last]))
                tokens.append(toks)
                logprobs.append(lps)
            out.append(
                Group(
                    problem=problem,
                    completions=[" ".join(map(str, t)) for t in tokens],
                    token_ids=tokens,
                    logprobs=logprobs,
                    prompt_ids=prompt,
                    finish_reasons=["length"] * n_j,
                )
            )
        return out

    def probe_logprobs(self):
        ids = torch.tensor(self.probe_token_ids)
        logp = torch.log_softmax(self.weight[ids[:-1]], -1)
        return logp.gather(1, ids[1:, None])[:, 0].double().tolist()

    def update_weights(
        self, named_tensors, expected_probe=None, expected_before=None, full_check=None
    ):
        meter = SyncMeter()
        full = self.verifier.full_check_due() if full_check is None else full_check
        checked = 0
        for name, tensor in meter.stream([list(named_tensors)]):
            assert name == "bigram.weight"
            self.weight = tensor.detach().clone()
            checked += int(full and torch.equal(self.weight, tensor))  # the real engines' cadence
        verdict = self.verifier.verify(
            self.probe_logprobs(), expected_probe, expected_before, "bigram"
        )
        self.calls.append("update_weights")
        return sync_report(verdict, meter, 0.0, "full", checked)

    def supports_adapter_sync(self):
        return False

    def update_adapter(self, adapter, expected_probe=None, expected_before=None):
        raise AssertionError("not used")

    weights_dropped = False  # the RolloutEngine protocol: a sleep that keeps weights
    dtype = torch.float32

    def sleep(self):
        self.calls.append("sleep")

    def wake_up(self):
        self.calls.append("wake_up")

    def close(self):
        self.calls.append("close")


def _context(bigram_dir: Path, out: Path, name: str, resume: bool = False, **sections):
    from megagrpo.trainer.setup import build_context

    sections.setdefault("loss", {"backend": "torch"})
    sections.setdefault("trainer", {})
    sections["trainer"] = {"max_steps": 4, "lr": 0.05, "save_every": 2, **sections["trainer"]}
    sections.setdefault("rollout", {"max_tokens": 3, "probe_len": 8})
    cfg = tiny_run_config(bigram_dir, out, name, **sections)
    run = load_config(RunConfig, [write_run_config(out / f"{name}.yaml", cfg)])
    return build_context(
        run,
        resume=resume,
        policy_factory=lambda model_cfg, pgs: BigramPolicy(),
        engine_factory=BigramEngine,
    )


def _train(ctx):
    from megagrpo.trainer.loop import train
    from megagrpo.trainer.setup import shutdown

    try:
        return train(ctx)
    finally:
        shutdown(ctx)


def test_steps_train_sync_and_log_every_metric(bigram_dir, tmp_path):
    ctx = _context(
        bigram_dir, tmp_path, "run", metrics={"log_completions": True, "progress_bar": False}
    )
    engine = ctx.rollouts.engine
    rows = _train(ctx)
    assert [r for r in rows if missing_metrics(r, ["toy_first_token"])] == []
    trained = [r for r in rows if r["train/skipped_empty_batch"] == 0.0]
    assert trained, "no step trained"
    assert all(r["sync/verified_engines"] == 1.0 for r in trained)
    assert any(r["sync/change_verified"] == 1.0 for r in trained)  # the update was seen
    assert float(ctx.policy.lora_b.detach().abs().max()) > 0  # the update reached the adapters
    torch.testing.assert_close(engine.weight, ctx.policy.weight().detach(), rtol=0, atol=0)
    for r in rows:  # the dynamic sampler asked for at most 1 + R rounds
        assert 1 <= r["dynamic/gen_batches"] <= 2
    assert engine.calls.count("sleep") == len(trained) and engine.calls[-1] == "close"
    saved = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in saved] == [1, 2, 3, 4]
    for r in saved:  # both naming schemes: megagrpo's and the ms-swift / TRL dashboards'
        assert r["reward"] == r["reward/mean"] and "frac_reward_zero_std" in r
        assert "completions/mean_length" in r and "rewards/toy_first_token/mean" in r
    logged = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    assert sorted({row["step"] for row in logged}) == [1, 2, 3, 4]
    _check_swift_dashboards(saved, logged)
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_collapsed_steps_skip_the_update(bigram_dir, tmp_path):
    # mcq_accuracy scores every bigram completion 0: every group collapses, nothing trains
    ctx = _context(bigram_dir, tmp_path, "flat", rewards={"functions": [{"name": "mcq_accuracy"}]})
    before = ctx.policy.lora_state_dict()
    rows = _train(ctx)
    assert all(r["train/skipped_empty_batch"] == 1.0 for r in rows)
    assert all(r["collapse/acr_raw"] == 1.0 and r["dynamic/success"] == 0.0 for r in rows)
    assert all(r["loss/policy"] is None for r in rows)
    for key, value in ctx.policy.lora_state_dict().items():
        assert torch.equal(value, before[key])


def test_resume_continues_like_the_uninterrupted_run(bigram_dir, tmp_path):
    full = _train(_context(bigram_dir, tmp_path, "full"))
    part = _context(bigram_dir, tmp_path, "part", trainer={"max_steps": 2})
    _train(part)
    resumed = _context(bigram_dir, tmp_path, "part", resume=True)
    assert resumed.step == 2
    rest = _train(resumed)
    assert [r["step"] for r in read_metrics(tmp_path / "part" / "metrics.jsonl")] == [1, 2, 3, 4]
    for a, b in zip(full[2:], rest, strict=True):
        for key, value in a.items():
            if key.startswith("perf/") or key == "sync/engine_s":
                continue
            assert b[key] == value or (value != value and b[key] != b[key]), key  # NaN: NaN


def test_train_and_sync_time_is_broken_into_its_parts(bigram_dir, tmp_path):
    """``perf/train_s`` = old / reference log-probs + forward-backward + optimiser + checks +
    the rest (batch building); ``perf/sync_s`` >= probe + push. Fails before the breakdown:
    none of the ``perf/train/*`` keys existed."""
    ctx = _context(
        bigram_dir,
        tmp_path,
        "parts",
        loss={"backend": "torch", "kl_coef": 0.05},  # a reference forward
        trainer={"old_logprobs": "recompute", "ppo_epochs": 2},  # an old-log-prob forward
    )
    rows = _train(ctx)
    trained = [r for r in rows if r["train/optimizer_steps"]]
    assert trained
    for r in trained:
        parts = [r[f"perf/train/{p}_s"] for p in PHASES["train"]] + [r["perf/train/other_s"]]
        assert all(p >= 0.0 for p in parts)
        first = r["train/epoch"] == 1.0  # the batch's old and reference log-probs, once
        for p in ("old_logprobs", "ref_logprobs", "fwd_bwd", "optim", "checks"):
            if first or p not in ("old_logprobs", "ref_logprobs"):
                assert r[f"perf/train/{p}_s"] > 0.0, p
            else:
                assert r[f"perf/train/{p}_s"] == 0.0, p
        assert sum(parts) == pytest.approx(r["perf/train_s"], rel=1e-9, abs=1e-12)
        if first:  # the engines stay asleep between two steps on one generated batch
            assert r["perf/sync_s"] < 1e-3 and r["perf/sync_bytes"] == 0.0
        else:
            assert 0.0 < r["perf/sync/probe_s"] + r["perf/sync/push_s"] <= r["perf/sync_s"]


def test_phase_times_closed_form():
    t = {"train": 10.0, "train/fwd_bwd": 6.0, "train/optim": 1.5, "sync/probe": 0.25}
    out = phase_times(t)
    assert out["perf/train/fwd_bwd_s"] == 6.0 and out["perf/train/optim_s"] == 1.5
    assert out["perf/train/old_logprobs_s"] == 0.0 and out["perf/sync/push_s"] == 0.0
    assert out["perf/train/other_s"] == 2.5 and out["perf/sync/probe_s"] == 0.25


class NoisyBigramEngine(BigramEngine):
    """A bigram engine whose returned log-probs carry a deterministic error of up to 0.15 per
    token, as a bf16 engine's do against an fp32/bf16 trainer (the samples are exact)."""

    def generate(self, problems, n, sampling=None):
        groups = super().generate(problems, n, sampling)
        for group in groups:
            group.logprobs = [
                [lp + 0.15 * ((7 * k + 3 * i) % 5 - 2) / 2 for k, lp in enumerate(lps)]
                for i, lps in enumerate(group.logprobs)
            ]
        return groups


def _noisy_rows(bigram_dir: Path, out: Path, name: str, **trainer) -> list[dict]:
    from megagrpo.trainer.setup import build_context

    cfg = tiny_run_config(
        bigram_dir,
        out,
        name,
        loss={"backend": "torch", "tis_cap": 2.0},
        trainer={"max_steps": 2, "lr": 0.05, **trainer},
        rollout={"max_tokens": 3, "probe_len": 8},
    )
    run = load_config(RunConfig, [write_run_config(out / f"{name}.yaml", cfg)])
    ctx = build_context(
        run,
        policy_factory=lambda model_cfg, pgs: BigramPolicy(),
        engine_factory=NoisyBigramEngine,
    )
    return [r for r in _train(ctx) if r["train/skipped_empty_batch"] == 0.0]


def test_old_logprobs_are_recomputed_by_default(bigram_dir, tmp_path):
    """The default, as ms-swift: old log-probs from a trainer forward, so an on-policy step's
    ratio is exactly 1 although the engine's log-probs are off; the engine's log-probs still
    weight the tokens (TIS) and measure the mismatch. With ``rollout`` the ratio is the
    engine's error and the clip acts on it."""
    assert RunConfig().trainer.old_logprobs == "recompute"
    rows = _noisy_rows(bigram_dir, tmp_path, "default")
    assert rows, "no step trained"
    for r in rows:
        assert r["train/old_logprobs_recompute"] == 1.0
        assert r["loss/ratio_min"] == 1.0 and r["loss/ratio_max"] == 1.0
        assert r["loss/clip_frac"] == 0.0
        assert r["train/logprob_mismatch"] > 0.05  # the engine's error, measured
        assert r["loss/tis_weight_mean"] != 1.0  # TIS still reads the engine's log-probs
    engine_rows = _noisy_rows(bigram_dir, tmp_path, "rollout", old_logprobs="rollout")
    assert engine_rows[0]["loss/ratio_min"] < 0.9 and engine_rows[0]["loss/ratio_max"] > 1.1
    assert engine_rows[0]["loss/tis_weight_mean"] == 1.0  # old = rollout: weight 1 exactly


def test_reused_training_forward_equals_a_separate_old_forward(bigram_dir, tmp_path, monkeypatch):
    """With one update per batch the old log-probs come from the training forward itself
    (``train/old_logprobs_reused``, no ``perf/train/old_logprobs_s``): every loss metric, the
    importance weights, the gradient norm and the engine mismatch equal those of a run with
    the separate no-grad forward, step after step (so the updated weights are equal too)."""
    from megagrpo.trainer import minibatch

    reused = _noisy_rows(bigram_dir, tmp_path, "reused")
    monkeypatch.setattr(minibatch, "reuses_training_forward", lambda cfg: False)
    separate = _noisy_rows(bigram_dir, tmp_path, "separate")
    assert len(reused) == len(separate) >= 2
    keys = [k for k in separate[0] if k.startswith("loss/")] + [
        "train/grad_norm",
        "train/logprob_mismatch",
        "train/logprob_mismatch_max",
    ]
    assert "loss/tis_weight_mean" in keys and "loss/ratio_max" in keys
    for a, b in zip(reused, separate):
        assert a["train/old_logprobs_reused"] == 1.0 and b["train/old_logprobs_reused"] == 0.0
        assert a["perf/train/old_logprobs_s"] == 0.0 < b["perf/train/old_logprobs_s"]
        assert not any(k.startswith("loss/logprob_mismatch") for k in a)
        for k in keys:  # fp32 bigram, same ops in both forwards: equal to rounding
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), k


def test_old_forward_runs_when_the_training_forward_differs():
    """A second update (weights moved), LoRA dropout (a noisy training forward) or r2 (it
    records the old forward's routing) keep the separate no-grad forward."""
    from megagrpo.trainer.optimize import reuses_training_forward

    assert reuses_training_forward(RunConfig())
    two, mini, dropout, r2 = RunConfig(), RunConfig(), RunConfig(), RunConfig()
    two.trainer.ppo_epochs = 2
    mini.trainer.mini_batches = 2
    dropout.model.lora.dropout = 0.05
    r2.model.routing_replay = "r2"
    assert not any(reuses_training_forward(c) for c in (two, mini, dropout, r2))


def _check_swift_dashboards(saved: list[dict], logged: list[dict]) -> None:
    """reward_std of each trained step is ms-swift's quantity over the completions the
    step logged (compute_reward_metrics, scale_rewards group); advantages are logged with
    them (group-normalised: each group's sum is 0); entropy/mean and the clip extremes are
    in every trained row."""
    from swift_source import swift_advantage

    compute_reward_metrics = swift_advantage("compute_reward_metrics")

    for r in saved:
        if r.get("train/skipped_empty_batch") == 1.0:
            continue
        rows = [x for x in logged if x["step"] == r["step"]]
        groups = sorted({x["group"] for x in rows})
        size = len(rows) // len(groups)
        t = torch.tensor(
            [x["reward"] for x in sorted(rows, key=lambda x: (x["group"], x["sample"]))],
            dtype=torch.float64,
        )
        want = compute_reward_metrics(t, t[:, None], ["r"], size, "group")
        assert r["reward_std"] == pytest.approx(want.reward_std, rel=1e-9, abs=1e-12)
        for g in groups:
            assert abs(sum(x["advantage"] for x in rows if x["group"] == g)) < 1e-4
        assert r["entropy/mean"] > 0
        assert 0 <= r["clip_ratio/low_min"] <= r["clip_ratio/low_mean"] + 1e-12
        assert r["clip_ratio/high_max"] >= r["clip_ratio/high_mean"] - 1e-12
