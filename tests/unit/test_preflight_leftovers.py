"""`megagrpo preflight` under Slurm (red team 3: M1, M2, L3): SIGTERM removes what preflight
created and exits 143; a leftover of a killed launch with the same ID (a requeue keeps its job
id, a plain ``torchrun`` always gets port 29500) is never used for another model; ``--layers
0`` is a named error. The phases themselves are replaced by a stub (they are the integration
test's): what is checked is what the command does around them."""

from __future__ import annotations

import json
import os
import signal
import tempfile

import pytest

from megagrpo.cli import main
from megagrpo.commands import preflight
from megagrpo.model.arch import load_hf_config
from megagrpo.testing import tiny_run_config, write_run_config

RUN_ID = "29500"


@pytest.fixture
def tmp_dir(tmp_path, monkeypatch):
    """Preflight's $TMPDIR (the model copy), empty; the launch ID fixed."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("MEGAGRPO_PREFLIGHT_ID", RUN_ID)
    return tmp


@pytest.fixture
def seen(monkeypatch):
    """Stub phases: record the model config each launch ran on, then pass."""
    models: list[dict] = []

    def phases(cfg, before_phase=None):
        models.append(load_hf_config(cfg.model.hf_path))
        return []

    monkeypatch.setattr("megagrpo.preflight.phases.run_phases", phases)
    return models


def _config(tmp_path, model_dir, name="p"):
    out = tmp_path / "runs"
    return write_run_config(tmp_path / f"{name}.yaml", tiny_run_config(model_dir, out, name))


def test_a_leftover_dense_copy_is_never_used_for_a_moe_preflight(
    tmp_path, tmp_dir, seen, tiny_dense_dir, tiny_moe_dir
):
    """M1: a dense launch SIGKILLed with ID 29500 left its model copy; a MoE preflight with
    the same ID passed on it."""
    preflight._model_copy(tiny_dense_dir, 2, RUN_ID)  # what the killed launch left
    left = sorted(tmp_dir.iterdir())
    assert main(["preflight", str(_config(tmp_path, tiny_moe_dir)), "--layers", "2"]) == 0
    expected = preflight.truncated_hf_config(load_hf_config(tiny_moe_dir), 2)
    assert seen == [expected]  # the MoE's own config, not the dense leftover
    assert sorted(tmp_dir.iterdir()) == left  # the leftover untouched, ours removed
    assert not (tmp_path / "runs" / ".preflight").exists()


def test_a_copy_of_the_same_name_with_other_files_is_refused(
    tmp_path, tmp_dir, seen, tiny_dense_dir, capfd
):
    """A directory where the copy goes that does not hold the same bytes (tampered, or written
    by something else) is named, never used nor removed."""
    copy, _ = preflight._model_copy(tiny_dense_dir, 2, RUN_ID)
    (copy / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    assert main(["preflight", str(_config(tmp_path, tiny_dense_dir)), "--layers", "2"]) == 2
    err = capfd.readouterr().err
    assert f"{copy} exists but does not hold" in err, err
    assert json.loads((copy / "config.json").read_text()) == {"num_hidden_layers": 1}
    assert seen == []


def test_sigterm_removes_both_directories_and_exits_143(
    tmp_path, tmp_dir, tiny_dense_dir, monkeypatch, capfd
):
    """M2: SIGTERM (Slurm's time limit) during a phase left ``.preflight/NAME-ID`` and the
    model copy behind; a requeue then reused them. Now: both removed, 143, and the requeue
    (same ID) runs."""
    dirs: list = []

    def phases(cfg, before_phase=None):
        dirs.extend([cfg.model.hf_path, os.path.join(cfg.trainer.output_dir, cfg.trainer.name)])
        os.makedirs(dirs[-1])  # what the phases write
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop preflight")  # pragma: no cover

    class NotHandled(BaseException):
        pass

    def unhandled(signum, frame):  # the test's own: preflight must install its handler
        raise NotHandled

    monkeypatch.setattr("megagrpo.preflight.phases.run_phases", phases)
    cfg = _config(tmp_path, tiny_dense_dir)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        rc = main(["preflight", str(cfg), "--layers", "2"])
    finally:
        assert signal.getsignal(signal.SIGTERM) is unhandled  # preflight restored it
        signal.signal(signal.SIGTERM, previous)
    assert rc == 143
    assert "stopped by SIGTERM" in capfd.readouterr().err
    assert len(dirs) == 2 and not any(os.path.exists(d) for d in dirs)
    assert list(tmp_dir.iterdir()) == [] and not (tmp_path / "runs" / ".preflight").exists()
    monkeypatch.setattr("megagrpo.preflight.phases.run_phases", lambda cfg, before_phase: [])
    assert main(["preflight", str(cfg), "--layers", "2"]) == 0  # the requeue


def test_layers_zero_is_a_named_error(tmp_path, tmp_dir, tiny_dense_dir, capfd):
    """L3: ``--layers 0`` was a raw ValueError (exit 1)."""
    assert main(["preflight", str(_config(tmp_path, tiny_dense_dir)), "--layers", "0"]) == 2
    assert "--layers must be >= 1, got 0" in capfd.readouterr().err
    assert list(tmp_dir.iterdir()) == []
