"""Values a config reads from the environment (``${oc.env:SECRET}``) are written as their
interpolation, never as the secret: config.yaml, every checkpoint manifest, W&B's config."""

from __future__ import annotations

from test_trainer_reliability import _context, _train

from megagrpo.config import load_config, to_yaml
from megagrpo.config.loader import written
from megagrpo.trainer.config import RunConfig

SECRET = "s3cr3t-token-value"


def test_environment_values_are_not_written(bigram_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAGRPO_TEST_SECRET", SECRET)
    entity = "${oc.env:MEGAGRPO_TEST_SECRET}"
    ctx = _context(bigram_dir, tmp_path, "s", metrics={"wandb_entity": entity})
    assert ctx.cfg.metrics.wandb_entity == SECRET  # the run uses the value
    assert written(ctx.cfg)["metrics"]["wandb_entity"] == entity
    _train(ctx)
    run = tmp_path / "s"
    files = [p for p in run.rglob("*") if p.is_file() and p.suffix in (".yaml", ".json")]
    assert any(p.name == "meta.json" for p in files) and (run / "config.yaml") in files
    for path in files:
        assert SECRET not in path.read_text(), path
    assert entity in (run / "config.yaml").read_text()
    again = load_config(RunConfig, [run / "config.yaml"])  # loads to the same values
    assert again.metrics.wandb_entity == SECRET and to_yaml(again) == to_yaml(ctx.cfg)
