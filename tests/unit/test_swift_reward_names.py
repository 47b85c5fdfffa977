"""Per-function reward dashboards under ms-swift's names (reviews/ms-swift-users-3.md F5:
ms-swift keys them by class, ``rewards/MathAccuracy/mean``, so panels stayed empty).

The reference is ms-swift's own code, read from its installed source without importing it
(``swift.rewards`` pulls in trl and vLLM: ~50 s here): the ``orms`` registry literal of
``swift/rewards/orm.py`` and ``resolve_reward_funcs`` of ``swift/rlhf_trainers/utils.py``,
compiled alone and run on the same reward functions."""

from __future__ import annotations

import ast
import importlib
import sys
import types

import pytest
from swift_source import swift_function, swift_tree

from megagrpo.metrics.names import SWIFT_ORM_CLASSES, swift_aliases, swift_reward_names
from megagrpo.rewards.composite import build_composite
from megagrpo.swift.translate import parse_tokens, to_config, translate


def _swift_registry() -> dict[str, str]:
    """``swift.rewards.orm.orms`` as ``{name: class name}``, read off its literal."""
    _, tree = swift_tree("rewards/orm.py")
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(x, ast.Name) and x.id == "orms" for x in node.targets
        ):
            assert isinstance(node.value, ast.Dict)
            return {
                ast.literal_eval(k): v.id  # pyright: ignore[reportAttributeAccessIssue]
                for k, v in zip(node.value.keys, node.value.values)
                if k is not None
            }
    raise AssertionError("no orms literal in swift/rewards/orm.py")


def _resolve_reward_funcs(registry: dict[str, str]):
    """ms-swift's ``resolve_reward_funcs``, its ``from swift.rewards import orms`` served by
    stand-in classes of the registry's class names."""
    resolve = swift_function("rlhf_trainers/utils.py", "resolve_reward_funcs")
    stub = types.ModuleType("swift.rewards")
    stub.orms = {  # pyright: ignore[reportAttributeAccessIssue]
        k: type(v, (), {"__init__": lambda self, args=None: None}) for k, v in registry.items()
    }

    def call(funcs):
        saved = sys.modules.get("swift.rewards")
        sys.modules["swift.rewards"] = stub
        try:
            return resolve(funcs)[1]
        finally:
            if saved is None:
                del sys.modules["swift.rewards"]
            else:
                sys.modules["swift.rewards"] = saved

    return call


def test_builtin_class_names_are_ms_swifts_registry():
    assert SWIFT_ORM_CLASSES == _swift_registry()


PLUGIN = """
def brevity_reward(completions, **kwargs):
    return [1.0 / (1 + len(c)) for c in completions]


class LetterFormat:
    def __call__(self, completions, **kwargs):
        return [float(c.strip()[:1].isalpha()) for c in completions]
"""


def test_reward_dashboards_under_ms_swifts_names(tmp_path):
    """A translated --reward_funcs accuracy soft_overlong, and plugin rewards (a function
    and a class): each reward's dashboard name is the one ms-swift's resolve_reward_funcs
    gives the same functions, and its rows carry rewards/<that name>/mean and /std."""
    plugin = tmp_path / "myplug.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    tokens = ["swift", "rlhf", "--rlhf_type", "grpo", "--tuner_type", "lora", "--max_steps", "3",
              "--reward_funcs", "accuracy", "soft_overlong", "--soft_cache_length", "64",
              "--beta", "0"]  # fmt: skip
    flags, flavor, env = parse_tokens(tokens)
    cfg = to_config(translate(flags, flavor or "swift", 1, env=env)).rewards
    cfg.external_plugins = [str(plugin)]
    cfg.functions += [
        type(cfg.functions[0])(name="myplug:brevity_reward"),
        type(cfg.functions[0])(name="myplug:LetterFormat"),
    ]
    composite = build_composite(cfg, {"max_completion_length": 512})
    ours = swift_reward_names(composite.terms, cfg.functions)
    mod = sys.modules.get("myplug") or importlib.import_module("myplug")
    theirs = _resolve_reward_funcs(_swift_registry())(
        ["accuracy", "soft_overlong", mod.brevity_reward, mod.LetterFormat()]
    )
    assert theirs == ["MathAccuracy", "SoftOverlong", "brevity_reward", "LetterFormat"]
    # the same functions keep ms-swift's names; mcq_accuracy, which from-swift put in place
    # of ms-swift's MathAccuracy, is not drawn on MathAccuracy's panel (review 4, F3)
    assert [ours[t.name] for t in composite.terms] == ["MCQAccuracy", *theirs[1:]]
    row: dict[str, float | None] = {
        f"reward/{t.name}/{s}": 0.5 for t in composite.terms for s in ("mean", "std")
    }
    aliases = swift_aliases(row, [t.name for t in composite.terms], 8, "group", ours)
    assert "rewards/MathAccuracy/mean" not in aliases
    for name in ["MCQAccuracy", *theirs[1:]]:
        assert aliases[f"rewards/{name}/mean"] == 0.5
        assert aliases[f"rewards/{name}/std"] == pytest.approx(0.5 * (8 / 7) ** 0.5)
