"""megagrpo.config.merge: YAML files whose containers do not match the schema, and overrides
that index into lists, give ConfigError naming the file / override and the key (issue 14.9,
red-team rows 15-16). Before, both raised ``TypeError: Cannot merge incompatible container
types`` out of ``load_config`` (exit 1, nothing named).

The reference for what an indexed override must produce is the same change written as a YAML
list, merged by OmegaConf itself.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from megagrpo.config import load_config
from megagrpo.config.merge import apply_override, merge_file
from megagrpo.errors import ConfigError
from megagrpo.trainer.config import RunConfig

TWO_REWARDS = {
    "rewards": {
        "functions": [
            {"name": "mcq_accuracy", "weight": 1.0},
            {"name": "soft_overlong", "weight": 0.5, "kwargs": {"max_len": 64}},
        ]
    }
}


@pytest.fixture
def schema():
    cfg = OmegaConf.structured(RunConfig)
    OmegaConf.set_struct(cfg, True)  # as load_config does
    return merge_file(cfg, OmegaConf.create(TWO_REWARDS), "base.yaml")


def _as_yaml(data: dict) -> RunConfig:
    cfg = OmegaConf.structured(RunConfig)
    OmegaConf.set_struct(cfg, True)
    obj = OmegaConf.to_object(OmegaConf.merge(cfg, OmegaConf.create(data)))
    assert isinstance(obj, RunConfig)
    return obj


def _functions(**second) -> dict:
    funcs = [dict(f) for f in TWO_REWARDS["rewards"]["functions"]]
    funcs[1].update(second)
    return {"rewards": {"functions": funcs}}


@pytest.mark.parametrize(
    ("override", "same_as_yaml"),
    [
        ("rewards.functions.1.weight=2", _functions(weight=2.0)),
        ("rewards.functions.1.kwargs.max_len=128", _functions(kwargs={"max_len": 128})),
        ("rewards.functions.1.label=len", _functions(label="len")),
        (  # a mapping value replaces the entry (schema defaults for what it leaves out)
            "rewards.functions.1={name: toy_first_token}",
            {"rewards": {"functions": [{"name": "mcq_accuracy"}, {"name": "toy_first_token"}]}},
        ),
    ],
)
def test_indexed_override_equals_the_same_yaml_list(schema, override, same_as_yaml):
    assert OmegaConf.to_object(apply_override(schema, override)) == _as_yaml(same_as_yaml)


def test_indexed_override_of_a_scalar_list():
    cfg = OmegaConf.structured(RunConfig)
    OmegaConf.set_struct(cfg, True)
    got = OmegaConf.to_object(apply_override(cfg, "curriculum.keep_levels.1=6"))
    assert isinstance(got, RunConfig)
    assert got.curriculum.keep_levels == [2, 6, 4, 5]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "rewards.functions.2.weight=1",
            "config key 'rewards.functions' has 2 entries, no index '2'",
        ),
        ("rewards.functions.x.weight=1", "no index 'x'"),
        ("rewards.functions.1.wieght=1", "config key 'rewards.functions.1.wieght': Key 'wieght'"),
        ("rewards.functions.1.weight=abc", "config key 'rewards.functions.1.weight': Value 'abc'"),
        ("rewards.functions.1.name.x=1", "config key 'rewards.functions.1.name' is not a list"),
        ("trainer.adam_betas.1=0.5", "config key 'trainer.adam_betas' is null"),
        ("rewards.functions={a: 1}", "config key 'rewards.functions' is a list"),
        ("trainer=[1]", "config key 'trainer' is a mapping"),
        ("trainer.max_stepz=3", "config key 'trainer.max_stepz': Key 'max_stepz'"),
        ("trainer.max_steps", "is not of the form key=value"),
    ],
)
def test_bad_override_is_named(schema, override, message):
    with pytest.raises(ConfigError) as err:
        apply_override(schema, override)
    assert str(err.value).startswith(f"override '{override}'") and message in str(err.value)


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("- a\n- b\n", "the top level must be a mapping of sections"),
        ("trainer: [1, 2]\n", "config key 'trainer': expected a mapping, got a list"),
        ("rewards:\n  functions:\n    0: {weight: 2}\n", "'rewards.functions': expected a list"),
        ("data:\n  train: {a: 1}\n", "config key 'data.train': expected a list, got a mapping"),
        ("trainer:\n  adam_betas: {a: 1}\n", "'trainer.adam_betas': expected a list"),
    ],
)
def test_yaml_with_the_wrong_container_names_file_and_key(tmp_path, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text, encoding="utf-8")
    cfg = OmegaConf.structured(RunConfig)
    OmegaConf.set_struct(cfg, True)
    with pytest.raises(ConfigError) as err:
        merge_file(cfg, OmegaConf.load(path), path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


# Through load_config (the loader calls merge_file / apply_override).


def test_load_config_list_index_override(tmp_path):
    cfg = load_config(RunConfig, [], ["rewards.functions.0.weight=2"])
    assert cfg.rewards.functions[0].weight == 2.0


def test_load_config_top_level_list_names_the_file(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- trainer\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="list.yaml: the top level must be a mapping"):
        load_config(RunConfig, [path])
