"""Registry, weighted composite (error isolation, reward/errors), soft_overlong, and the
ms-swift ORM plugin adapter."""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import sys
import textwrap

import pytest

from megagrpo.errors import ConfigError
from megagrpo.rewards import build_composite, get, names, register
from megagrpo.rewards.config import RewardsConfig, RewardSpec
from megagrpo.rewards.length import soft_overlong_value
from megagrpo.types import Problem

PROBLEM = Problem(
    "112A1",
    [{"role": "user", "content": "高アンモニア血症をきたす疾患はどれか。"}],
    ["e"],
    {"choices": ["v", "w", "x", "y", "z"]},
)


def closed_form(length: int, max_len: int, cache_len: int) -> float:
    """DAPO soft overlong punishment, written piecewise (independent of the implementation)."""
    start = max_len - cache_len
    if length <= start:
        return 0.0
    return (start - length) / cache_len  # -1 at max_len, keeps falling beyond


@pytest.mark.parametrize("max_len,cache_len", [(4096, 2048), (100, 20), (10, 3)])
def test_soft_overlong_closed_form(max_len, cache_len):
    fn = get("soft_overlong", max_len=max_len, cache_len=cache_len)
    lengths = list(range(0, 2 * max_len + 1, max(1, max_len // 64))) + [
        max_len - cache_len,
        max_len,
        max_len + 1,
    ]
    got = fn(["x"] * len(lengths), PROBLEM, lengths=lengths)
    want = [closed_form(n, max_len, cache_len) for n in lengths]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-12


def test_soft_overlong_article_setting_points():
    fn = get("soft_overlong")  # defaults: max 4096, cache 2048 (the article's setting)
    got = fn(["x"] * 5, PROBLEM, lengths=[0, 2048, 3072, 4096, 5120])
    assert got == [0.0, 0.0, -0.5, -1.0, -1.5]


def _swift_soft_overlong():
    for mod in ("swift.rewards.orm", "swift.plugin.orm"):
        try:
            return importlib.import_module(mod).SoftOverlong
        except Exception:  # noqa: BLE001 - not installed / older layout
            continue
    pytest.skip("ms-swift not importable (install the swift extra for the parity test)")


def test_soft_overlong_matches_ms_swift():
    cls = _swift_soft_overlong()
    from types import SimpleNamespace

    if "args" in inspect.signature(cls).parameters:  # 4.x: cls(args=trainer_args)
        ref = cls(args=SimpleNamespace(soft_max_length=4096, soft_cache_length=2048))
    else:  # older releases: explicit lengths
        ref = cls(soft_max_length=4096, soft_cache_length=2048)
    lengths = [0, 1, 2047, 2048, 2049, 3000, 4095, 4096, 4097, 6000, 9000]
    want = ref(["x"] * len(lengths), response_token_ids=[[7] * n for n in lengths])
    ours = get("soft_overlong", max_len=4096, cache_len=2048)
    assert ours(["x"] * len(lengths), PROBLEM, lengths=lengths) == pytest.approx(want, abs=0)
    # and ms-swift's class through the plugin adapter, in the composite
    comp = build_composite(
        RewardsConfig(
            functions=[
                RewardSpec(
                    name=f"{cls.__module__}:SoftOverlong",
                    label="swift_soft",
                    kwargs={"soft_max_length": 4096, "soft_cache_length": 2048},
                )
            ]
        )
    )
    total, parts = comp(["x"] * len(lengths), PROBLEM, lengths=lengths)
    assert parts["swift_soft"] == pytest.approx(want, abs=0)


def test_soft_overlong_bad_args_and_value_helper():
    with pytest.raises(ConfigError):
        get("soft_overlong", max_len=100, cache_len=100)
    assert soft_overlong_value(3072, 4096, 2048) == -0.5


def test_composite_weighted_sum_and_parts():
    cfg = RewardsConfig(
        functions=[
            RewardSpec("mcq_accuracy", 1.0),
            RewardSpec("soft_overlong", 0.2, {"max_len": 4096, "cache_len": 2048}),
        ]
    )
    cfg.validate("rewards")
    comp = build_composite(cfg)
    texts = ["答え: e", "答え: a", "<think>長い思考", "Final answer: E"]
    lengths = [100, 3072, 4096, 5120]
    total, parts = comp(texts, PROBLEM, lengths=lengths)
    assert parts["mcq_accuracy"] == [1.0, 0.0, 0.0, 1.0]
    assert parts["soft_overlong"] == [0.0, -0.5, -1.0, -1.5]
    assert total == pytest.approx([1.0, -0.1, -0.2, 0.7])
    assert comp.names == ["mcq_accuracy", "soft_overlong"]
    with pytest.raises(TypeError, match="lengths"):
        comp(texts, PROBLEM)  # wiring bug: a length reward without lengths


@register("_test_flaky")
def _flaky():
    def reward(completions, problem):
        out = []
        for c in completions:
            if "BOOM" in c:
                raise RuntimeError("scorer exploded")
            out.append(math.nan if "NAN" in c else float(len(c)))
        return out

    return reward


def test_composite_isolates_errors_per_completion(caplog):
    comp = build_composite(
        RewardsConfig(functions=[RewardSpec("_test_flaky", 0.5), RewardSpec("mcq_accuracy", 1.0)])
    )
    texts = ["abc", "BOOM 答え: e", "答え: e", "NAN"]
    with caplog.at_level(logging.WARNING, logger="megagrpo.rewards.composite"):
        total, parts = comp(texts, PROBLEM)
    assert parts["_test_flaky"] == [3.0, 0.0, 5.0, 0.0]
    assert parts["mcq_accuracy"] == [0.0, 1.0, 1.0, 0.0]
    assert total == [1.5, 1.0, 3.5, 0.0]
    assert comp.num_errors == 2
    assert "112A1" in caplog.text and "scorer exploded" in caplog.text
    assert comp.pop_metrics() == {"reward/errors": 2.0, "reward/timeouts": 0.0}
    assert comp.pop_metrics() == {"reward/errors": 0.0, "reward/timeouts": 0.0}
    comp(["abc"], PROBLEM)
    assert comp.num_errors == 2


def test_registry_errors():
    assert {"mcq_accuracy", "soft_overlong"} <= set(names())
    with pytest.raises(ConfigError, match="unknown reward"):
        get("no_such_reward")
    with pytest.raises(ConfigError, match="max_len"):
        get("soft_overlong", max_len="x", nonsense=1)
    with pytest.raises(ValueError):
        register("a:b")
    cfg = RewardsConfig(functions=[RewardSpec("mcq_accuracy"), RewardSpec("mcq_accuracy")])
    with pytest.raises(ConfigError, match="duplicate"):
        cfg.validate("rewards")
    with pytest.raises(ConfigError, match="cannot import"):
        get("not_a_module_xyz:Thing")
    with pytest.raises(ConfigError, match="no attribute"):
        get("megagrpo.rewards.toy:NoSuchClass")
    with pytest.raises(ConfigError, match="standard library"):
        get("math:NoSuchClass")


ORM_MODULE = textwrap.dedent("""
    class ORM:  # the shape of swift.rewards.ORM: __call__(completions, **kwargs) -> list[float]
        def __call__(self, **kwargs):
            raise NotImplementedError

    class ExactSolution(ORM):
        def __init__(self, bonus=1.0):
            self.bonus = bonus

        def __call__(self, completions, solution, trainer_state=None, **kwargs):
            assert all(isinstance(col, list) and len(col) == len(completions)
                       for col in kwargs.values()), "ms-swift passes per-completion columns"
            assert [m[-1]["content"] for m in kwargs["messages"]] == completions
            return [
                self.bonus * float(c.strip().endswith(s)) for c, s in zip(completions, solution)
            ]

    class ArgsStyle(ORM):  # ms-swift 4.x builtins: cls(args=trainer_args)
        def __init__(self, args=None, **kwargs):
            self.cap = args.max_chars

        def __call__(self, completions, **kwargs):
            return [min(len(c), self.cap) / self.cap for c in completions]

    class AsyncLen:
        async def __call__(self, completions, **kwargs):
            return [float(len(c)) for c in completions]

    class TokenCount(ORM):
        def __call__(self, completions, response_token_ids=None, **kwargs):
            return [float(len(ids)) for ids in response_token_ids]

    def plain_function(completions, problem_id, **kwargs):
        return [1.0 if pid == "112A1" else 0.0 for pid in problem_id]
""")


@pytest.fixture()
def orm_module(tmp_path, monkeypatch):
    (tmp_path / "my_swift_plugin.py").write_text(ORM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_swift_plugin"
    sys.modules.pop("my_swift_plugin", None)


def test_swift_orm_adapter(orm_module):
    comp = build_composite(
        RewardsConfig(
            functions=[
                RewardSpec(f"{orm_module}:ExactSolution", 2.0, {"bonus": 0.5}, label="exact"),
                RewardSpec(f"{orm_module}:TokenCount", 0.0, label="ntok"),
                RewardSpec(f"{orm_module}:plain_function", 1.0, label="fn"),
                RewardSpec(f"{orm_module}:ArgsStyle", 0.0, {"max_chars": 10}, label="args"),
                RewardSpec(f"{orm_module}:AsyncLen", 0.0, label="async"),
            ]
        )
    )
    total, parts = comp(["答え: e", "答え: a"], PROBLEM, lengths=[4, 9])
    assert parts["exact"] == [0.5, 0.0]  # solution column = gold joined by ','
    assert parts["ntok"] == [4.0, 9.0]  # response_token_ids of the given lengths
    assert parts["fn"] == [1.0, 1.0]
    assert parts["args"] == [0.5, 0.5] and parts["async"] == [5.0, 5.0]
    assert total == [2.0, 1.0]
    _, parts = comp(["x"], PROBLEM, token_ids=[[5, 6, 7]])
    assert parts["ntok"] == [3.0]
    with pytest.raises(ConfigError, match="cannot construct"):
        get(f"{orm_module}:ExactSolution", nope=1)


def test_rewards_package_is_pure():
    """megagrpo.rewards imports no megatron, vllm, torch (nor torch.distributed)."""
    import subprocess

    code = (
        "import sys, megagrpo.rewards, megagrpo.commands.score, megagrpo.rewards.igakuqa, "
        "megagrpo.rewards.swift_adapter; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'vllm', 'torch')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_yaml_config_builds_the_article_composite(tmp_path):
    from megagrpo.config.loader import load_config

    path = tmp_path / "rewards.yaml"
    path.write_text(
        "functions:\n"
        "  - {name: mcq_accuracy, weight: 1.0}\n"
        "  - {name: soft_overlong, weight: 0.2, "
        "kwargs: {max_len: 4096, cache_len: 2048}}\n"
    )
    comp = build_composite(load_config(RewardsConfig, [path]))
    total, _ = comp(["答え: e"], PROBLEM, lengths=[3072])
    assert total == pytest.approx([1.0 - 0.2 * 0.5])
    path.write_text("functions:\n  - {name: mcq_accuracy, weight: .nan}\n")
    with pytest.raises(ConfigError, match="weight"):
        load_config(RewardsConfig, [path])
