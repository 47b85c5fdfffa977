"""`megagrpo report --out` and `megagrpo eval --out` never replace what they did not write
(red team 4, N8), a full disk or a read-only run directory in `report` is named (N16), two
`megagrpo profile` on one levels file cannot lose records (N12), and `eval --step` checks the
base weights (N3)."""

from __future__ import annotations

import errno
import json
import shutil
import threading
from pathlib import Path

import pytest

from megagrpo import fileio
from megagrpo.cli import main
from megagrpo.testing import tiny_run_config, write_run_config


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    rows = [{"step": s, "reward/mean": 0.1 * s, "perf/gen_s": 1.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_report_never_writes_over_a_users_directory(tmp_path, capsys):
    """N8: ``report --out DIR`` replaced the user's reward.png and summary.json there."""
    run = _run_dir(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "reward.png").write_text("my own figure")
    (mine / "summary.json").write_text("mine")
    assert main(["report", str(run), "--out", str(mine)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (mine / "reward.png").read_text() == "my own figure"
    assert (mine / "summary.json").read_text() == "mine"
    # the default RUN_DIR/report: an earlier report is replaced, a file of the user's is not
    from megagrpo.metrics.report import REPORT_FILES, check_report_out

    assert main(["report", str(run)]) == 0 and (run / "report" / "summary.json").is_file()
    earlier = check_report_out(run / "report", default=True)
    assert sorted(fileio.files_in(earlier)) == sorted(REPORT_FILES[:6] + ("summary.json",))
    (run / "report" / "notes.txt").write_text("mine")
    assert main(["report", str(run)]) == 2
    assert "notes.txt" in capsys.readouterr().err
    assert (run / "report" / "notes.txt").read_text() == "mine"
    assert not [p for p in run.iterdir() if fileio.is_tmp(p)]


def test_report_on_a_full_disk_is_named(tmp_path, capsys):
    """N16: ``ulimit -f`` in report was a raw ``OSError: [Errno 27] File too large``."""
    import resource

    run = _run_dir(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, hard))  # a PNG does not fit
    try:
        rc = main(["report", str(run), "--out", str(tmp_path / "rep")])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err
    assert rc == 2 and "report not written (writing" in err and "EFBIG" in err, err
    assert not (tmp_path / "rep").exists() and not [
        p for p in tmp_path.iterdir() if fileio.is_tmp(p)
    ]


def test_report_in_a_read_only_run_directory_is_named(tmp_path, monkeypatch, capsys):
    """N16: a read-only run directory (the review remounted a tmpfs read-only: this machine's
    tests run as root, where permissions do not stop a write, and cannot mount) was a raw
    ``OSError: [Errno 30]``; the mkdir of the report's directory fails the same way here."""
    run = _run_dir(tmp_path)
    real = Path.mkdir

    def read_only(self, *a, **kw):
        if self.parent == run:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Read-only file system (errno 30, EROFS)" in err and "pass --out DIR" in err, err


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built before the inputs were checked")

    monkeypatch.setattr("megagrpo.rollout.build_engine", refuse)


def _gold(tmp_path: Path) -> Path:
    exam = tmp_path / "gold" / "2018" / "112-A.jsonl"
    exam.parent.mkdir(parents=True)
    row = {"problem_id": "112A1", "problem_text": "q", "choices": list("vwxyz"),
           "answer": ["a"], "points": "1"}  # fmt: skip
    exam.write_text(json.dumps(row) + "\n")
    return exam


def test_eval_never_writes_over_a_users_directory(tmp_path, tiny_dense_dir, no_engine, capsys):
    """N8 (eval): ``--out`` was written into whatever was there (``OUT/YEAR/EXAM_NAME.jsonl``,
    ``OUT/score.json``); now refused before the engine, and the default directory holds only
    what an evaluation of the same files rewrites."""
    cfg = write_run_config(tmp_path / "c.yaml", tiny_run_config(tiny_dense_dir, tmp_path, "e"))
    exam = _gold(tmp_path)
    mine = tmp_path / "mine"
    (mine / "2018").mkdir(parents=True)
    (mine / "score.json").write_text("my scores")
    assert main(["eval", str(cfg), "--data", str(exam), "--out", str(mine)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (mine / "score.json").read_text() == "my scores"
    default = tmp_path / "e" / "eval" / "base"
    (default / "2018").mkdir(parents=True)
    (default / "2018" / "112-B_megagrpo.jsonl").write_text("another exam's predictions")
    assert main(["eval", str(cfg), "--data", str(exam)]) == 2
    assert "2018/112-B_megagrpo.jsonl" in capsys.readouterr().err


def test_eval_step_checks_the_base_weights(tmp_path, tiny_dense_dir, no_engine, capsys):
    """N3 (eval --step): the LoRA of a checkpoint was served on whatever base was under
    model.hf_path; now the checkpoint's fingerprint is compared before the engine."""
    from lora_pieces import whole_lora_pieces

    from megagrpo.checkpoint import format as checkpoint
    from megagrpo.model.config import LoraConfig
    from megagrpo.model.fingerprint import base_fingerprint
    from megagrpo.testing import EMPTY_SAMPLER_STATE

    model = Path(shutil.copytree(tiny_dense_dir, tmp_path / "model"))
    checkpoint.save(
        tmp_path / "e" / "checkpoints", 1, rank=0, world_size=1,
        rank_state={"pieces": whole_lora_pieces(model, LoraConfig(rank=4)),
                    "optimizer_groups": [], "scheduler": None},
        trainer_state={"sampler": EMPTY_SAMPLER_STATE, "dynamic": {}}, meta={},
        extra={"lora_layout": checkpoint.LAYOUT_FREE, "base": base_fingerprint(model),
               "config": {"model": {"hf_path": str(model), "lora": {"rank": 4}}}},
    )  # fmt: skip
    from safetensors.torch import load_file, save_file

    for shard in model.glob("*.safetensors"):  # rebuilt in place: same sizes, other values
        save_file({k: t + 0.01 for k, t in load_file(str(shard)).items()}, str(shard))
    cfg = write_run_config(tmp_path / "c.yaml", tiny_run_config(model, tmp_path, "e"))
    assert main(["eval", str(cfg), "--data", str(_gold(tmp_path)), "--step", "1"]) == 2
    err = capsys.readouterr().err
    assert "are not those step_000001's LoRA was trained on" in err, err


def test_a_second_profile_of_one_levels_file_is_refused(tmp_path):
    """N12: a second ``megagrpo profile`` of the same levels file rewrote it under the first
    one's appends (which went on into the unlinked file): the first one's records were lost."""
    from megagrpo.curriculum.levels import read_levels_file
    from megagrpo.curriculum.profile import run_profile
    from megagrpo.errors import ConfigError
    from megagrpo.plan.simulate import BernoulliEngine, synthetic_population

    problems, _, ps = synthetic_population({1: 10, 6: 10}, 5, seed=1)
    out = tmp_path / "levels.jsonl"
    started, release = threading.Event(), threading.Event()

    class Slow(BernoulliEngine):
        def generate(self, batch, n, sampling=None):
            started.set()
            release.wait(30)
            return super().generate(batch, n, sampling)

    def exact(completions, problem):
        return [1.0 if c == ",".join(problem.answer) else 0.0 for c in completions]

    first = threading.Thread(
        target=run_profile, args=(problems, Slow(ps, seed=0, fill_rewards=False), exact, 5, out, 5)
    )
    first.start()
    assert started.wait(30)
    try:
        with pytest.raises(ConfigError, match=r"levels.jsonl is being written by another"):
            run_profile(problems, BernoulliEngine(ps, seed=1, fill_rewards=False), exact, 5, out, 5)
    finally:
        release.set()
        first.join(60)
    assert len(read_levels_file(out)) == 20 and not Path(f"{out}.lock").exists()
