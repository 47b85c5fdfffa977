"""The loop's reliability (issue 14) on the bigram policy and engine of test_trainer_loop.py
(real config, data, curriculum, loss, optimiser, checkpoints; a fake model only): the run
directory (14.4), prompt lengths (14.5), non-finite updates (14.3), stop signals (14.6), a
damaged newest checkpoint (14.7), changed settings on resume (14.8), steps that train
nothing (14.10)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import signal
from pathlib import Path

import pytest
import torch
from test_trainer_loop import BigramEngine, BigramPolicy

from megagrpo.checkpoint import format as checkpoint
from megagrpo.config import load_config
from megagrpo.errors import CheckpointError, ConfigError, DataError
from megagrpo.metrics import read_metrics
from megagrpo.testing import tiny_run_config, write_run_config
from megagrpo.trainer.config import RunConfig

DEMO = Path(__file__).resolve().parents[2] / "megagrpo" / "assets" / "demo_train.jsonl"
LONG_TEXT = "What is the name of the long river that flows through the city? " * 12
"""Some 870 prompt tokens with the tiny tokenizer (the demo prompts: 146-181)."""


def _sections(**sections) -> dict:
    """test_trainer_loop's settings: 4 steps, a checkpoint every 2, torch loss backend."""
    sections.setdefault("loss", {"backend": "torch"})
    sections["trainer"] = {
        "max_steps": 4,
        "lr": 0.05,
        "save_every": 2,
        **sections.get("trainer", {}),
    }
    sections["rollout"] = {"max_tokens": 3, "probe_len": 8, **sections.get("rollout", {})}
    return sections


def _context(bigram_dir: Path, out: Path, name: str, *, calls=None, engine=BigramEngine, **kw):
    """build_context on the bigram fakes; ``calls`` records each policy construction."""
    from megagrpo.trainer.setup import build_context

    flags = {k: kw.pop(k) for k in ("resume", "overwrite", "allow_base_change") if k in kw}
    cfg = tiny_run_config(bigram_dir, out, name, **_sections(**kw))
    run = load_config(RunConfig, [write_run_config(out / f"{name}.yaml", cfg)])

    def policy(model_cfg, pgs):
        if calls is not None:
            calls.append(name)
        return BigramPolicy()

    return build_context(run, policy_factory=policy, engine_factory=engine, **flags)


def _train(ctx, stop=None):
    from megagrpo.trainer.loop import train
    from megagrpo.trainer.setup import shutdown

    try:
        return train(ctx) if stop is None else train(ctx, stop)
    finally:
        shutdown(ctx)


def _snapshot(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def _rows(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")


def _same_rows(expected: list[dict], actual: list[dict]) -> None:
    """Every non-timing metric of metrics.jsonl rows equal, bit for bit."""
    assert [r["step"] for r in actual] == [r["step"] for r in expected]
    for a, b in zip(expected, actual, strict=True):
        for key, value in a.items():
            if key.startswith("perf/") or key in ("time", "sync/engine_s"):
                continue
            assert b.get(key) == value, (a["step"], key)


def _same_state(dir_a: Path, dir_b: Path) -> None:
    """LoRA weights and the whole optimiser state of two checkpoints, bit for bit."""
    a = torch.load(dir_a / "rank00000.pt", weights_only=True)
    b = torch.load(dir_b / "rank00000.pt", weights_only=True)
    for key in a["lora"]:
        assert torch.equal(a["lora"][key], b["lora"][key]), key
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for idx, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][idx][key]), (idx, key)


# ----------------------------------------------------------------------------- run directory


def test_a_fresh_start_over_a_run_is_refused_and_changes_nothing(bigram_dir, tmp_path):
    _train(_context(bigram_dir, tmp_path, "run", trainer={"max_steps": 2}))
    before = _snapshot(tmp_path / "run")
    calls: list[str] = []
    with pytest.raises(ConfigError, match=r"'trainer.name'.*already holds a run") as err:
        _context(bigram_dir, tmp_path, "run", calls=calls, trainer={"max_steps": 2, "seed": 7})
    assert "metrics.jsonl with 2 row(s)" in str(err.value) and "step_000002" in str(err.value)
    assert calls == []  # refused before any model was built
    assert _snapshot(tmp_path / "run") == before


def test_overwrite_moves_the_old_run_aside(bigram_dir, tmp_path):
    _train(_context(bigram_dir, tmp_path, "run", trainer={"max_steps": 2}))
    before = _snapshot(tmp_path / "run")
    _train(_context(bigram_dir, tmp_path, "run", overwrite=True, trainer={"max_steps": 1}))
    (aside,) = tmp_path.glob("run.old-*")
    assert _snapshot(aside) == before  # moved, never deleted
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_resume_without_a_checkpoint_fails_before_the_model(bigram_dir, tmp_path):
    calls: list[str] = []
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        _context(bigram_dir, tmp_path, "none", calls=calls, resume=True)
    assert calls == []


def test_a_failed_start_writes_no_config_and_can_be_retried(bigram_dir, tmp_path):
    class BrokenEngine(BigramEngine):
        def __init__(self, *args):
            raise RuntimeError("engine does not start")

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "memory_plan.txt").write_text("plan\n")  # the Slurm launcher's
    with pytest.raises(RuntimeError, match="engine does not start"):
        _context(bigram_dir, tmp_path, "run", engine=BrokenEngine)
    assert not (tmp_path / "run" / "config.yaml").exists()
    _train(_context(bigram_dir, tmp_path, "run", trainer={"max_steps": 1}))
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert (tmp_path / "run" / "memory_plan.txt").read_text() == "plan\n"


# ----------------------------------------------------------------------------- prompt lengths


def _data_with_a_long_prompt(tmp_path: Path) -> str:
    lines = DEMO.read_text(encoding="utf-8").splitlines()
    record = json.loads(lines[0])
    record["id"] = "long1"
    record["messages"][-1]["content"] = LONG_TEXT
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([*lines, json.dumps(record)]) + "\n", encoding="utf-8")
    return str(path)


def _template_length(bigram_dir: Path, data_file: str, pid: str) -> int:
    """Prompt length of ``pid`` by transformers' own chat-template tokenisation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bigram_dir)
    for line in Path(data_file).read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record["id"] == pid:
            ids = tok.apply_chat_template(record["messages"], add_generation_prompt=True)
            return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    raise KeyError(pid)


def test_an_over_long_prompt_is_an_error_naming_it_before_the_model(bigram_dir, tmp_path):
    data = {"train": [_data_with_a_long_prompt(tmp_path)], "truncation": "error"}
    n = _template_length(bigram_dir, data["train"][0], "long1")
    assert n > 256 - 3  # rollout.max_model_len - rollout.max_tokens
    calls: list[str] = []
    with pytest.raises(DataError, match=rf"1 prompts are longer than .*=253: long1 \({n} tokens\)"):
        _context(bigram_dir, tmp_path, "long", calls=calls, data=data)
    assert calls == [] and not (tmp_path / "long" / "config.yaml").exists()


class RecordingEngine(BigramEngine):
    generated: list[str] = []

    def generate(self, problems, n, sampling=None):
        RecordingEngine.generated.extend(p.id for p in problems)
        return super().generate(problems, n, sampling)


def test_an_over_long_prompt_is_dropped_counted_and_resume_checks_the_set(bigram_dir, tmp_path):
    data = {"train": [_data_with_a_long_prompt(tmp_path)]}  # truncation: delete (default)
    RecordingEngine.generated = []
    rows = _train(
        _context(
            bigram_dir,
            tmp_path,
            "drop",
            engine=RecordingEngine,
            data=data,
            trainer={"max_steps": 2, "batch_groups": 28},
        )
    )
    assert RecordingEngine.generated and "long1" not in RecordingEngine.generated
    assert all(r["data/prompts_dropped"] == 1.0 for r in rows)
    manifest = json.loads((tmp_path / "drop/checkpoints/step_000002/meta.json").read_text())
    assert manifest["problems"]["dropped"] == ["long1"] and manifest["problems"]["count"] == 56
    resumed = _context(
        bigram_dir,
        tmp_path,
        "drop",
        resume=True,
        engine=RecordingEngine,
        data=data,
        trainer={"batch_groups": 28},
    )
    assert resumed.step == 2
    _train(resumed)
    calls: list[str] = []
    with pytest.raises(CheckpointError, match=r"problem set differs.*56 -> 57") as err:
        _context(
            bigram_dir,
            tmp_path,
            "drop",
            calls=calls,
            resume=True,
            data=data,
            rollout={"max_model_len": 1024},
            trainer={"batch_groups": 28, "max_steps": 6},
        )
    assert "['long1']" in str(err.value) and "rollout.max_model_len: 256 -> 1024" in str(err.value)
    assert calls == []


def test_left_truncation_reaches_the_engines_or_is_refused(bigram_dir, tmp_path):
    """``data.truncation=left`` keeps a prompt's last max_prompt_tokens tokens in
    ``meta['prompt_ids']``, which the engines' chat_prompt_ids returns (rollout/base.py
    delegates to data.prompts.prompt_ids); a build whose engines ignored them would refuse
    it at start-up rather than crash at step N."""
    from transformers import AutoTokenizer

    from megagrpo.rollout.base import chat_prompt_ids

    data = {"train": [_data_with_a_long_prompt(tmp_path)], "truncation": "left"}
    ctx = _context(bigram_dir, tmp_path, "left", data=data)
    long1 = next(p for p in ctx.sampler.problems if p.id == "long1")
    tok = AutoTokenizer.from_pretrained(bigram_dir)
    full = tok.apply_chat_template(long1.messages, add_generation_prompt=True, tokenize=False)
    full_ids = tok(full, add_special_tokens=False)["input_ids"]
    assert chat_prompt_ids(tok, long1) == full_ids[-253:]  # the last 256 - 3 tokens
    assert ctx.data_metrics["data/prompts_truncated"] == 1.0
    _train(ctx)


# ----------------------------------------------------------------------------- non-finite


def _nan_advantages_at(monkeypatch, steps: set[int]) -> None:
    from megagrpo.trainer import loop

    real = loop.compute_advantages

    def compute(ctx, groups):
        adv = real(ctx, groups)  # one row per group
        return [torch.full_like(a, float("nan")) for a in adv] if ctx.step + 1 in steps else adv

    monkeypatch.setattr(loop, "compute_advantages", compute)


def test_a_nonfinite_update_is_skipped_and_leaves_weights_and_optimizer_unchanged(
    bigram_dir, tmp_path, monkeypatch
):
    _nan_advantages_at(monkeypatch, {2})
    ctx = _context(
        bigram_dir,
        tmp_path,
        "nan",
        trainer={"max_steps": 3, "save_every": 1, "keep_checkpoints": 3},
    )
    rows = _train(ctx)
    assert [r["train/skipped_nonfinite"] for r in rows] == [0.0, 1.0, 0.0]
    assert rows[1]["loss/policy"] != rows[1]["loss/policy"]  # NaN (logged as null)
    assert rows[2]["train/optimizer_steps"] == 1.0
    ckpts = tmp_path / "nan" / "checkpoints"
    _same_state(ckpts / "step_000001", ckpts / "step_000002")  # step 2 changed nothing
    assert torch.isfinite(ctx.policy.weight()).all()


def test_nonfinite_updates_in_a_row_stop_the_run_naming_the_step(bigram_dir, tmp_path, monkeypatch):
    from megagrpo.trainer.optimize import NonFiniteError

    _nan_advantages_at(monkeypatch, {2, 3})
    ctx = _context(bigram_dir, tmp_path, "nan2", trainer={"max_nonfinite_steps": 2})
    with pytest.raises(NonFiniteError, match=r"at step 3: 2 optimiser steps in a row"):
        _train(ctx)
    steps = [r["step"] for r in read_metrics(tmp_path / "nan2" / "metrics.jsonl")]
    assert steps == [1, 2, 3]


# ----------------------------------------------------------------------------- signals


class SignalAtSleep(BigramEngine):
    """Sends ``signum`` to this process during phase 4 of step ``at``."""

    signum, at = signal.SIGINT, 2

    def __init__(self, *args):
        super().__init__(*args)
        self.sleeps = 0

    def sleep(self):
        super().sleep()
        self.sleeps += 1
        if self.sleeps == self.at:
            signal.raise_signal(self.signum)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_mid_step_checkpoints_and_resume_continues_identically(
    bigram_dir, tmp_path, signum
):
    from megagrpo.parallel.signals import StopSignals

    _train(_context(bigram_dir, tmp_path, "full", trainer={"save_every": 0}))
    full = _rows(tmp_path / "full")
    SignalAtSleep.signum = signum
    stop = StopSignals().install()
    try:
        ctx = _context(
            bigram_dir, tmp_path, "stop", engine=SignalAtSleep, trainer={"save_every": 0}
        )
        part = _train(ctx, stop)
    finally:
        stop.restore()
    assert ctx.stopped_by == signal.Signals(signum).name
    assert len(part) == 2  # step 2 finished, then stopped
    assert checkpoint.latest(tmp_path / "stop" / "checkpoints").name == "step_000002"
    _train(_context(bigram_dir, tmp_path, "stop", resume=True, trainer={"save_every": 0}))
    _same_rows(full, _rows(tmp_path / "stop"))
    ckpt = "checkpoints/step_000004"
    _same_state(tmp_path / "full" / ckpt, tmp_path / "stop" / ckpt)


def test_a_stop_before_the_first_step_writes_no_checkpoint_and_a_restart_runs(bigram_dir, tmp_path):
    """A requeued job stopped during start-up starts again with the same command (a step-0
    checkpoint would hold an untrained LoRA and refuse the plain restart)."""
    from megagrpo.parallel.signals import StopSignals

    _train(_context(bigram_dir, tmp_path, "full"))
    stop = StopSignals()
    stop.signum = signal.SIGUSR1  # arrived while the run was starting
    ctx = _context(bigram_dir, tmp_path, "early")
    assert _train(ctx, stop) == [] and ctx.stopped_by == "SIGUSR1"
    assert checkpoint.latest(tmp_path / "early" / "checkpoints") is None
    _train(_context(bigram_dir, tmp_path, "early"))
    _same_rows(_rows(tmp_path / "full"), _rows(tmp_path / "early"))


def test_signal_handler_records_and_a_second_ctrl_c_stops_at_once():
    from megagrpo.parallel.comm import Comm
    from megagrpo.parallel.signals import StopSignals

    previous = signal.getsignal(signal.SIGINT)
    stop = StopSignals().install()
    try:
        assert stop.agreed(Comm()) is None
        signal.raise_signal(signal.SIGUSR1)
        assert stop.requested and stop.agreed(Comm()) == "SIGUSR1"
        signal.raise_signal(signal.SIGTERM)  # repeats (torchrun forwarding) are ignored
        signal.raise_signal(signal.SIGINT)  # the first Ctrl-C only asks to stop
        assert stop.agreed(Comm()) == "SIGUSR1"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is previous


# ----------------------------------------------------------------------------- checkpoints


def test_a_damaged_newest_checkpoint_falls_back_and_continues_identically(
    bigram_dir, tmp_path, caplog
):
    _train(_context(bigram_dir, tmp_path, "full", trainer={"save_every": 1}))
    _train(_context(bigram_dir, tmp_path, "bad", trainer={"save_every": 1, "max_steps": 3}))
    shard = tmp_path / "bad/checkpoints/step_000003/rank00000.pt"
    shard.write_bytes(shard.read_bytes()[:1000])  # red-team row 57
    with caplog.at_level(logging.WARNING):
        ctx = _context(bigram_dir, tmp_path, "bad", resume=True, trainer={"save_every": 1})
    assert ctx.step == 2
    assert any(
        "step_000003" in r.getMessage() and "rank00000.pt: 1000 bytes" in r.getMessage()
        for r in caplog.records
    )
    _train(ctx)
    _same_rows(_rows(tmp_path / "full"), _rows(tmp_path / "bad"))
    _same_state(tmp_path / "full/checkpoints/step_000004", tmp_path / "bad/checkpoints/step_000004")


# ----------------------------------------------------------------------------- changed settings


def test_a_changed_lr_on_resume_reaches_the_restored_optimizer(bigram_dir, tmp_path, caplog):
    _train(_context(bigram_dir, tmp_path, "lr", trainer={"max_steps": 2}))
    with caplog.at_level(logging.WARNING):
        ctx = _context(bigram_dir, tmp_path, "lr", resume=True, trainer={"lr": 0.01})
    assert ctx.optimizer.param_groups[0]["lr"] == 0.01  # the checkpoint's was 0.05
    assert any("trainer.lr: 0.05 -> 0.01" in r.getMessage() for r in caplog.records)
    _train(ctx)


def test_settings_a_checkpoint_cannot_continue_under_are_all_named(bigram_dir, tmp_path):
    _train(_context(bigram_dir, tmp_path, "ref", trainer={"max_steps": 2}))
    calls: list[str] = []
    with pytest.raises(CheckpointError) as err:
        _context(
            bigram_dir,
            tmp_path,
            "ref",
            calls=calls,
            resume=True,
            data={"prompt": {"system": "Answer."}},
            model={"lora": {"rank": 8, "alpha": 8.0, "targets": ["linear_qkv"]}},
        )
    msg = str(err.value)
    assert "data.prompt.system: 'default' -> 'Answer.'" in msg
    assert "model.lora.rank: 4 -> 8" in msg and "model.lora.targets" in msg
    assert calls == []


def test_a_changed_group_size_on_resume_runs(bigram_dir, tmp_path):
    _train(
        _context(
            bigram_dir,
            tmp_path,
            "g",
            trainer={"max_steps": 2},
            dynamic={"policy": "carry", "max_resample": 2},
        )
    )
    saved = json.loads((tmp_path / "g/checkpoints/step_000002/trainer.json").read_text())
    assert len(saved["dynamic"]["carry"]) > 0  # groups of 4 carried into step 3
    ctx = _context(
        bigram_dir,
        tmp_path,
        "g",
        resume=True,
        rollout={"group_size": 6},
        dynamic={"policy": "carry", "max_resample": 2},
    )
    assert ctx.dynamic.carry == []  # red-team row 56: np.concatenate of G=4 and G=6 rows
    _train(ctx)
    assert [r["step"] for r in _rows(tmp_path / "g")] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- silent states


def test_steps_that_train_nothing_are_visible(bigram_dir, tmp_path, caplog):
    from megagrpo.metrics.report import make_report

    with caplog.at_level(logging.WARNING):
        rows = _train(
            _context(
                bigram_dir, tmp_path, "flat", rewards={"functions": [{"name": "mcq_accuracy"}]}
            )
        )
    assert all(r["train/skipped_empty_batch"] == 1.0 for r in rows)
    for r in rows:  # a post-filter 0.0 would read as "dynamic sampling filled the batch"
        assert math.isnan(r["collapse/frac_reward_zero_std"]) and math.isnan(r["collapse/acr_post"])
        assert r["collapse/acr_raw"] == 1.0
    warned = [r.getMessage() for r in caplog.records if "trains nothing" in r.getMessage()]
    assert len(warned) == 4 and all(
        r.levelno == logging.WARNING for r in caplog.records if "trains nothing" in r.getMessage()
    )
    saved = _rows(tmp_path / "flat")
    assert all(r["collapse/frac_reward_zero_std"] is None for r in saved)  # null
    assert all(r["collapse/acr_post"] is None for r in saved)
    assert all("frac_reward_zero_std" in r and r["frac_reward_zero_std"] is None for r in saved)
    make_report(tmp_path / "flat")
    summary = json.loads((tmp_path / "flat" / "report" / "summary.json").read_text())
    assert summary["steps_trained_nothing"] == 4 and summary["steps_skipped_nonfinite"] == 0


# ----------------------------------------------------------------------------- resume rules


def test_resume_rules_classify_each_kind_of_change():
    from megagrpo.trainer.resume_check import ADAPT, INFO, REFUSE, WARN, compare_configs

    saved = {
        "parallel": {"tp": 2},
        "trainer": {"max_steps": 10, "lr": 1e-4, "seed": 0},
        "loss": {"kl_coef": 0.0},
        "curriculum": {"levels_file": "a.jsonl", "online": True},
        "rollout": {"group_size": 4},
        "new_section": {"x": 1},
    }
    new = {
        "parallel": {"tp": 2},
        "trainer": {"max_steps": 20, "lr": 5e-4, "seed": 1},
        "loss": {"kl_coef": 0.05},
        "curriculum": {"levels_file": "b.jsonl", "online": False},
        "rollout": {"group_size": 8},
    }
    kinds = {c.key: c.kind for c in compare_configs(saved, new, 2, 4)}
    assert kinds == {
        "world size": REFUSE,
        "curriculum.levels_file": REFUSE,
        "rollout.group_size": ADAPT,
        "trainer.lr": ADAPT,
        "loss.kl_coef": WARN,
        "trainer.seed": WARN,
        "curriculum.online": WARN,
        "trainer.max_steps": INFO,
    }


def test_optimizer_settings_follow_the_config_through_the_scheduler():
    """A changed lr goes through LambdaLR's warm-up as if set from the start; unchanged
    settings leave the restored values bit for bit (a resumed run stays identical)."""
    from megagrpo.trainer.config import TrainerConfig
    from megagrpo.trainer.resume_check import apply_optimizer_settings

    def build(lr):
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        for _ in range(1):
            p.grad = torch.ones(3)
            opt.step()
            sched.step()
        return opt, sched

    opt, sched = build(1e-4)
    state, sched_state = opt.state_dict(), sched.state_dict()
    fresh, fresh_sched = build(3e-4)  # built from the new config, then restored
    fresh.load_state_dict(state)
    fresh_sched.load_state_dict(sched_state)
    assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"]  # the silent restore
    apply_optimizer_settings(fresh, fresh_sched, TrainerConfig(lr=3e-4, weight_decay=0.1))
    assert fresh.param_groups[0]["lr"] == 3e-4 * (2 / 3)  # warm-up step 1 of 3
    assert fresh.param_groups[0]["weight_decay"] == 0.1
    fresh_sched.step()
    assert fresh.param_groups[0]["lr"] == 3e-4  # warm-up done, at the new rate
    same, same_sched = build(1e-4)
    before = [dict(g) for g in same.param_groups]
    apply_optimizer_settings(same, same_sched, TrainerConfig(lr=1e-4, weight_decay=0.01))
    assert [dict(g) for g in same.param_groups] == before
