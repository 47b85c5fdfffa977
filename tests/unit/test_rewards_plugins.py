"""Reward plugins named in configs: what may be constructed (issue 14.2), import failures
(14.9), per-call timeouts (14.10), the error policy, trainer_state, ms-swift ``orms`` names with
``external_plugins`` files, and soft_overlong against rollout.max_tokens (issues 12.3/12.4)."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import textwrap
import time

import pytest

from megagrpo.errors import ConfigError
from megagrpo.rewards import build_composite, get
from megagrpo.rewards.composite import CompositeReward, RewardError
from megagrpo.rewards.config import RewardsConfig, RewardSpec, resolve_soft_overlong
from megagrpo.rewards.plugins import check_reward_object, code_origin
from megagrpo.types import Problem

PROBLEM = Problem("112A1", [{"role": "user", "content": "q"}], ["e"], {"choices": list("vwxyz")})


def _swift_orm():
    try:
        return importlib.import_module("swift.rewards.orm")
    except Exception:  # noqa: BLE001 - not installed
        pytest.skip("ms-swift not importable (install the swift extra)")


@pytest.fixture()
def plugin_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def write(name: str, code: str):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
        made.append(name)
        return tmp_path / f"{name}.py"

    yield write
    for name in made:
        sys.modules.pop(name, None)


# ----------------------------------------------------------------------------- 14.2


def test_popen_from_a_config_runs_nothing(tmp_path):
    """Was: the shell command ran, then 'is not callable' (red-team row 79)."""
    marker = tmp_path / "pwned"
    cfg = RewardsConfig(
        functions=[
            RewardSpec("mcq_accuracy"),
            RewardSpec(
                "subprocess:Popen",
                0.0,
                {"args": f"touch {marker}", "shell": True},
                label="x",
            ),
        ]
    )
    with pytest.raises(ConfigError, match="refusing to construct or call.*stdlib"):
        build_composite(cfg)
    time.sleep(0.2)  # a spawned shell would have created the file by now
    assert not marker.exists()


@pytest.mark.parametrize(
    "name",
    ["os:system", "builtins:eval", "shutil:rmtree", "subprocess:run", "functools:partial"],
)
def test_stdlib_and_builtin_callables_are_refused(name):
    with pytest.raises(ConfigError, match=f"reward '{name}'"):
        get(name)


def test_site_packages_code_needs_an_orm_base_or_the_marker(tmp_path, monkeypatch):
    site = tmp_path / "lib" / "site-packages"
    site.mkdir(parents=True)
    (site / "pkg_rewards.py").write_text(
        "from megagrpo.rewards import reward_plugin\n"
        "def plain(completions, **kwargs):\n    return [1.0] * len(completions)\n"
        "@reward_plugin\n"
        "def marked(completions, **kwargs):\n    return [2.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(site))
    try:
        import pkg_rewards

        assert code_origin(pkg_rewards.plain) == "site"
        with pytest.raises(ConfigError, match="from site code"):
            get("pkg_rewards:plain")
        assert get("pkg_rewards:marked")(["a", "b"], PROBLEM) == [2.0, 2.0]
    finally:
        sys.modules.pop("pkg_rewards", None)


def test_user_code_needs_the_orm_call_shape(plugin_dir):
    plugin_dir(
        "shapes",
        """
        import os
        def good(completions, **kwargs):
            return [0.5] * len(completions)
        def no_kwargs(completions):
            return [0.0] * len(completions)
        def runner(cmd, **kwargs):  # has the shape: allowed, it is the user's own code
            return [0.0]
        class NoCall:
            def __init__(self, **kwargs):
                open(os.environ["MARK"], "w").write("constructed")
        class Good:
            def __call__(self, completions, solution, **kwargs):
                return [1.0] * len(completions)
        instance = Good()
        """,
    )
    assert get("shapes:good")(["a"], PROBLEM) == [0.5]
    assert get("shapes:Good")(["a"], PROBLEM) == [1.0]
    assert get("shapes:instance")(["a", "b"], PROBLEM) == [1.0, 1.0]
    with pytest.raises(ConfigError, match="ORM call shape"):
        get("shapes:no_kwargs")
    with pytest.raises(ConfigError, match="ORM call shape"):
        get("shapes:NoCall")  # checked before construction: nothing is written
    import shapes

    assert check_reward_object(shapes.runner, "shapes:runner") is None


def test_swift_orm_subclasses_are_allowed_wherever_they_live():
    orm = _swift_orm()
    assert code_origin(orm.Format) == "site"
    fn = get("swift.rewards.orm:Format")
    out = fn(["<think>x</think>\n<answer>e</answer>", "e"], PROBLEM)
    assert out == [1.0, 0.0]
    with pytest.raises(ConfigError, match="not a Python class or function"):
        check_reward_object(print, "builtins:print")


# ----------------------------------------------------------------------------- 14.9


def test_plugin_raising_on_import_names_the_plugin(plugin_dir):
    plugin_dir("broken_plugin", "raise RuntimeError('bad config at import time')\n")
    with pytest.raises(
        ConfigError, match="broken_plugin:X.*raised RuntimeError: bad config at import"
    ):
        get("broken_plugin:X")


def test_swift_install_hint_only_for_a_missing_swift(plugin_dir):
    plugin_dir("swift_like_name", "import not_installed_pkg_xyz\n")
    with pytest.raises(ConfigError) as info:
        get("swift_like_name:X")
    assert "not_installed_pkg_xyz" in str(info.value) and "pip install" not in str(info.value)


# ----------------------------------------------------------------------------- 14.10, policy


def _sleepy_and_fast(plugin_dir):
    plugin_dir(
        "slow_rewards",
        """
        import time
        def sleepy(completions, **kwargs):
            time.sleep(30)
            return [1.0] * len(completions)
        def fast(completions, **kwargs):
            return [0.25] * len(completions)
        """,
    )


def test_hanging_reward_times_out_and_counts_as_errors(plugin_dir):
    _sleepy_and_fast(plugin_dir)
    comp = build_composite(
        RewardsConfig(
            functions=[
                RewardSpec("slow_rewards:fast", 1.0, label="fast"),
                RewardSpec("slow_rewards:sleepy", 1.0, label="sleepy"),
            ],
            timeout_s=0.3,
        )
    )
    start = time.perf_counter()
    total, parts = comp(["a", "b", "c"], PROBLEM)
    took = time.perf_counter() - start
    assert took < 3.0  # one timeout for the group, no per-completion retries (3 x 0.3 s)
    assert parts == {"fast": [0.25] * 3, "sleepy": [0.0] * 3}
    assert total == [0.25] * 3
    assert comp.pop_metrics() == {"reward/errors": 3.0, "reward/timeouts": 1.0}


def test_on_error_fail_stops_with_a_named_error(plugin_dir):
    _sleepy_and_fast(plugin_dir)
    plugin_dir(
        "raising",
        """
        def boom(completions, **kwargs):
            raise KeyError('target')
        """,
    )
    comp = build_composite(RewardsConfig(functions=[RewardSpec("raising:boom")], on_error="fail"))
    with pytest.raises(RewardError, match="'raising:boom' failed on problem 112A1.*KeyError"):
        comp(["a"], PROBLEM)
    comp = build_composite(
        RewardsConfig(functions=[RewardSpec("slow_rewards:sleepy")], on_error="fail", timeout_s=0.2)
    )
    with pytest.raises(RewardError, match="timeout_s=0.2"):
        comp(["a"], PROBLEM)
    for bad in ({"on_error": "ignore"}, {"timeout_s": -1.0}, {"external_plugins": ["x.txt"]}):
        with pytest.raises(ConfigError):
            RewardsConfig(**bad).validate("rewards")


def test_free_text_gold_is_an_error_not_a_silent_zero():
    comp = build_composite(RewardsConfig())
    p = Problem("p1", [], [], {"choices": [], "solution": "The mitochondria"})
    total, _ = comp(["答え: c"], p)
    assert total == [0.0] and comp.pop_metrics()["reward/errors"] == 1.0


# ----------------------------------------------------------------------------- 12.4


def test_trainer_state_reaches_orms(plugin_dir):
    """ms-swift example plugins read trainer_state.global_step (was: None -> AttributeError)."""
    plugin_dir(
        "stepped",
        """
        class StepReward:
            def __call__(self, completions, trainer_state, **kwargs):
                return [trainer_state.global_step + trainer_state.max_steps / 100] * len(
                    completions
                )
        """,
    )
    comp = build_composite(RewardsConfig(functions=[RewardSpec("stepped:StepReward")]))
    assert comp(["a"], PROBLEM)[0] == [0.0]  # before any step: a state, not None
    comp.begin_step(5, 10)
    total, _ = comp(["a", "b"], PROBLEM)
    assert total == [4.1, 4.1]  # 4 steps completed before step 5, as transformers counts
    assert comp.pop_metrics()["reward/errors"] == 0.0


def test_orms_registry_names_with_an_external_plugin_file(tmp_path):
    """``--external_plugins plugin.py --reward_funcs my_len`` as ms-swift users write it."""
    _swift_orm()
    plugin = tmp_path / "team_plugin.py"
    plugin.write_text(
        textwrap.dedent(
            """
            from typing import List
            from swift.rewards import ORM, orms

            class LetterLength(ORM):
                def __call__(self, completions, solution, **kwargs) -> List[float]:
                    return [float(len(s)) for s in solution]

            orms['letter_length'] = LetterLength
            """
        )
    )
    try:
        cfg = RewardsConfig(
            functions=[
                RewardSpec("mcq_accuracy"),
                RewardSpec("orms:letter_length", 1.0, label="len"),
                RewardSpec("team_plugin:LetterLength", 1.0, label="by_path"),
                RewardSpec("orms:soft_overlong", 0.0, {"soft_cache_length": 2}, label="so"),
            ],
            external_plugins=[str(plugin)],
        )
        cfg = resolve_soft_overlong(cfg, max_tokens=6)
        assert cfg.functions[3].kwargs == {"soft_cache_length": 2, "soft_max_length": 6}
        comp = build_composite(cfg)
        total, parts = comp(["答え: e", "x"], PROBLEM, lengths=[3, 5])
        assert parts["len"] == [1.0, 1.0] and parts["by_path"] == [1.0, 1.0]
        assert parts["so"] == [0.0, -0.5]  # ms-swift's SoftOverlong with max 6, cache 2
        with pytest.raises(ConfigError, match="not in ms-swift's orms registry"):
            get("orms:nope")
    finally:
        sys.modules.pop("team_plugin", None)


def test_unknown_accuracy_name_explains_ms_swift_semantics():
    with pytest.raises(ConfigError, match="MathAccuracy.*0.0 on every multiple-choice"):
        get("accuracy")


# ----------------------------------------------------------------------------- 12.3


def test_soft_overlong_defaults_to_max_tokens_and_rejects_unreachable():
    cfg = RewardsConfig(
        functions=[RewardSpec("mcq_accuracy"), RewardSpec("soft_overlong", 0.2, {"cache_len": 64})]
    )
    out = resolve_soft_overlong(cfg, max_tokens=256)
    assert out.functions[1].kwargs == {"cache_len": 64, "max_len": 256}
    assert cfg.functions[1].kwargs == {"cache_len": 64}  # input untouched
    fn = build_composite(out)
    total, _ = fn(["答え: e", "答え: e"], PROBLEM, lengths=[192, 256])
    assert total == pytest.approx([1.0, 1.0 - 0.2])  # -1 exactly at rollout.max_tokens
    bad = RewardsConfig(functions=[RewardSpec("soft_overlong", 1.0, {"max_len": 8192})])
    with pytest.raises(ConfigError, match=r"functions\.0\.kwargs\.max_len.*max_tokens=4096"):
        resolve_soft_overlong(bad, max_tokens=4096)


def test_composite_rejects_unknown_policy():
    with pytest.raises(ValueError, match="on_error"):
        CompositeReward([("x", 1.0, get("mcq_accuracy"))], on_error="ignore")


def test_plugin_importing_swift_keeps_megagrpo_logging(tmp_path):
    """A plugin's ``from swift.rewards import ORM, orms`` sets the root handlers to ERROR
    (ms-swift's logger setup); megagrpo's INFO/WARNING lines after it must still show."""
    import subprocess
    import sys

    pytest.importorskip("swift")
    plugin = tmp_path / "swift_plugin.py"
    plugin.write_text(
        "from swift.rewards import ORM, orms\n\n"
        "class Len(ORM):\n"
        "    def __call__(self, completions, **kwargs):\n"
        "        return [float(len(c)) for c in completions]\n\n"
        "orms['my_len'] = Len\n"
    )
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from megagrpo.rewards.plugins import load_external_plugins, load_object\n"
        f"load_external_plugins([{str(plugin)!r}])\n"
        "load_object('orms:my_len')\n"
        "logging.getLogger('megagrpo.trainer').info('INFO after the plugin')\n"
        "logging.getLogger('megagrpo.trainer').warning('WARNING after the plugin')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "INFO after the plugin" in proc.stdout and "WARNING after the plugin" in proc.stdout


def test_swift_orms_are_called_once_per_batch(plugin_dir):
    """ms-swift calls an ORM once per batch (compute_rewards_per_func over the whole batch);
    a batch-level plugin (here: the completion's rank in the batch by length, and a call
    counter) gives ms-swift's values only when called the same way."""
    from megagrpo.types import Group

    _swift_orm()
    plugin_dir(
        "batchy",
        """
        from swift.rewards import ORM

        class RankInBatch(ORM):
            calls = 0

            def __call__(self, completions, solution, problem_id, **kwargs):
                RankInBatch.calls += 1
                order = sorted(range(len(completions)), key=lambda i: len(completions[i]))
                rank = {i: r / max(len(completions) - 1, 1) for r, i in enumerate(order)}
                return [rank[i] + (s == "b") for i, s in enumerate(solution)]
        """,
    )
    import batchy

    problems = [
        Problem(f"p{j}", [], ["b" if j else "a"], {"choices": ["x", "y"]}) for j in range(3)
    ]
    texts = [["x" * (5 * j + i + 1) for i in range(4)] for j in range(3)]

    def groups():
        return [Group(problem=p, completions=list(t), token_ids=[[1] * len(x) for x in t],
                      logprobs=[[]] * 4, lengths=[len(x) for x in t])
                for p, t in zip(problems, texts)]  # fmt: skip

    spec = RewardsConfig(functions=[RewardSpec("batchy:RankInBatch")])
    flat = [x for t in texts for x in t]
    want = batchy.RankInBatch()(
        flat, solution=[p.answer[0] for p in problems for _ in range(4)],
        problem_id=[p.id for p in problems for _ in range(4)],
    )  # fmt: skip
    batchy.RankInBatch.calls = 0
    batch = groups()
    build_composite(spec).score_groups(batch)
    assert batchy.RankInBatch.calls == 1
    assert [r for g in batch for r in g.rewards] == pytest.approx(want)
    per_group = groups()
    build_composite(dataclasses.replace(spec, swift_calls="group")).score_groups(per_group)
    assert batchy.RankInBatch.calls == 4  # one more per group
    assert [r for g in per_group for r in g.rewards] != pytest.approx(want)
