"""Config loading: YAML + dotted overrides onto the dataclass schema, errors name the key."""

from __future__ import annotations

import pytest
import yaml

from megagrpo.config import load_config, save_config
from megagrpo.errors import ConfigError
from megagrpo.trainer.config import RunConfig


def write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data), encoding="utf-8")
    return p


def test_yaml_and_overrides_merge_in_order(tmp_path):
    a = write(tmp_path, {"trainer": {"max_steps": 5, "lr": 1e-3}}, "a.yaml")
    b = write(tmp_path, {"trainer": {"max_steps": 7}}, "b.yaml")
    cfg = load_config(RunConfig, [a, b], ["trainer.lr=0.5", "rollout.group_size=4"])
    assert isinstance(cfg, RunConfig)
    assert cfg.trainer.max_steps == 7 and cfg.trainer.lr == 0.5
    assert cfg.rollout.group_size == 4
    assert cfg.data.exclude_images is True  # untouched default


def test_unknown_key_in_yaml_is_named(tmp_path):
    p = write(tmp_path, {"trainer": {"max_stepz": 5}})
    with pytest.raises(ConfigError, match=r"trainer\.max_stepz"):
        load_config(RunConfig, [p])


def test_unknown_key_in_override_is_named():
    with pytest.raises(ConfigError, match=r"rollout\.groupsize"):
        load_config(RunConfig, [], ["rollout.groupsize=8"])


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"trainer\.max_steps"):
        load_config(RunConfig, [], ["trainer.max_steps=lots"])


def test_override_without_equals_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(RunConfig, [], ["trainer.max_steps"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(RunConfig, [tmp_path / "nope.yaml"])


def test_malformed_yaml_names_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("trainer: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(RunConfig, [p])


def test_validate_hook_names_key():
    with pytest.raises(ConfigError, match=r"rewards\.functions"):
        load_config(RunConfig, [], ["rewards.functions=[]"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(RunConfig, [], ["trainer.max_steps=3", "trainer.name=x"])
    out = save_config(cfg, tmp_path / "run")
    again = load_config(RunConfig, [out])
    assert again == cfg
    assert not list((tmp_path / "run").glob("*.tmp"))
