"""How `make test` spreads the suite over its xdist workers (``-n 2 --dist loadscope``).

A scope (a module, or one test of :data:`PER_TEST_SCOPES`, or a folder of
:data:`ONE_WORKER_SCOPES`) runs whole on one worker, so module and session fixtures are built
once. The scopes are handed out longest first: their seconds come from ``tests/durations.json``
(measured: ``pytest -n 2 --dist loadscope --store-durations`` rewrites it); a scope not in it
is estimated from its test count and folder (:data:`SECONDS_PER_TEST`). Longest first, the
minutes-long scopes start at once on both workers and the sub-second unit modules fill in at
the end, so both workers finish together (xdist's own order, most tests first, started the
tools' one-test scopes last: a 4-minute test alone at the end of the run).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().with_name("durations.json")
REPO_ROOT = DURATIONS.parents[1]

ONE_WORKER_SCOPES = ("tests/contract/",)
"""Folders one worker runs whole: the contract tier shares one upstream subprocess (~2 min)
per worker that runs any of its tests."""
PER_TEST_SCOPES = ("tests/integration/test_tools_quick.py::",)
"""Modules whose tests share no fixture worth keeping together: each test its own scope."""
SECONDS_PER_TEST = (
    ("tests/integration/test_tools_quick.py", 60.0),
    ("tests/distributed/", 40.0),
    ("tests/integration/", 40.0),
    ("tests/contract/", 3.0),
    ("tests/", 0.5),
)
"""The estimate for a scope missing from durations.json (first matching prefix)."""


def scope_of(nodeid: str) -> str:
    for scope in ONE_WORKER_SCOPES:
        if nodeid.startswith(scope):
            return scope
    if nodeid.startswith(PER_TEST_SCOPES):
        return nodeid
    return nodeid.split("::", 1)[0]


def _known() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError):
        return {}


def order_longest_first(items: list) -> None:
    """Sort ``items`` (in place, stable) so scopes come longest first."""
    known = _known()
    counts: dict[str, int] = {}
    for item in items:
        counts[scope_of(item.nodeid)] = counts.get(scope_of(item.nodeid), 0) + 1

    def cost(scope: str) -> float:
        if scope in known:
            return known[scope]
        per_test = next(s for prefix, s in SECONDS_PER_TEST if scope.startswith(prefix))
        return per_test * counts[scope]

    costs = {scope: cost(scope) for scope in counts}
    items.sort(key=lambda item: -costs[scope_of(item.nodeid)])


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--store-durations",
        action="store_true",
        help="rewrite tests/durations.json with this run's seconds per xdist scope",
    )


def pytest_collection_modifyitems(config, items) -> None:
    order_longest_first(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with :func:`scope_of`'s scopes in the collection's order (longest
    first, :func:`order_longest_first`), not xdist's (most tests first)."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class _Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return _Scheduling(config, log)


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    scope = scope_of(report.nodeid)
    _seconds[scope] = _seconds.get(scope, 0.0) + float(getattr(report, "duration", 0.0))


def pytest_sessionfinish(session) -> None:
    config = session.config
    if not config.getoption("store_durations") or hasattr(config, "workerinput"):
        return  # the controller (or a run without xdist) writes it
    merged = {**_known(), **{k: round(v, 1) for k, v in _seconds.items()}}
    DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
