"""A secret reached through another key's interpolation is masked too (red team 3, M7):
``config.yaml``, every checkpoint's ``meta.json`` and W&B's files hold the interpolation text,
never the value, and the written config loads again to the same values. Literal ``${`` in a
value (escaped in the YAML) stays text when config.yaml loads again."""

from __future__ import annotations

from test_trainer_reliability import _context, _train

from megagrpo.config import load_config, to_yaml
from megagrpo.config.loader import env_keys, written
from megagrpo.trainer.config import RunConfig

SECRET = "s3cr3t-Indirect-v4lue"


def test_values_an_environment_variable_reaches_through_other_keys_are_masked(
    bigram_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("MEGAGRPO_TEST_SECRET", SECRET)
    monkeypatch.setenv("WANDB_MODE", "offline")
    prompt = {
        "system": "${oc.env:MEGAGRPO_TEST_SECRET}",
        "user_template": "{question} (${.system})\n\n{choices}",  # relative, one hop
    }
    ctx = _context(
        bigram_dir,
        tmp_path,
        "s",
        data={"prompt": prompt},
        metrics={"wandb_mode": "offline"},
        trainer={"max_steps": 2},
    )
    assert SECRET in ctx.cfg.data.prompt.user_template  # the run uses the value
    assert env_keys(ctx.cfg) == {"data.prompt.system", "data.prompt.user_template"}
    assert SECRET not in str(written(ctx.cfg))
    _train(ctx)
    run = tmp_path / "s"
    files = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.name == "meta.json" for p in files) and any(p.suffix == ".wandb" for p in files)
    for path in files:
        assert SECRET.encode() not in path.read_bytes(), path
    again = load_config(RunConfig, [run / "config.yaml"])
    assert again.data.prompt == ctx.cfg.data.prompt
    assert to_yaml(again) == to_yaml(ctx.cfg)


def test_literal_interpolation_text_stays_text(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/somebody")
    path = tmp_path / "c.yaml"
    path.write_text(
        'data:\n  prompt:\n    system: "see \\\\${oc.env:HOME} and \\\\${open"\n',
        encoding="utf-8",
    )
    cfg = load_config(RunConfig, [path])
    assert cfg.data.prompt.system == "see ${oc.env:HOME} and ${open"
    (tmp_path / "again.yaml").write_text(to_yaml(cfg), encoding="utf-8")
    again = load_config(RunConfig, [tmp_path / "again.yaml"])
    assert again.data.prompt.system == cfg.data.prompt.system


def test_every_hop_and_only_those_are_traced():
    from megagrpo.config.loader import _env_interpolations

    raw = {
        "a": {"key": "${oc.env:S}", "list": ["x", "${a.key}"]},
        "b": "p-${a.list.1}",  # two hops, through a list entry
        "c": "${oc.decode:${oc.env:N,3}}",  # inside another resolver
        "d": "${b}-${e}",
        "e": "plain ${f}",  # an interpolation without the environment: kept resolved
        "f": 1,
        "g": "${missing.key}",  # untraceable: masked (always safe)
    }
    assert set(_env_interpolations(raw)) == {"a.key", "a.list.1", "b", "c", "d", "g"}
    assert _env_interpolations({"x": "${y}", "y": "1"}) == {}
