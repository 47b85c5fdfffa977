"""m2: what a partial rollout's chunk sends between ranks does not grow with its prefix.

Sharded rollouts gather each replica's groups on rank 0 and broadcast them to every rank,
once per chunk. A continuation's problem carries its prompt + kept prefix
(``meta['prompt_ids']``, :func:`megagrpo.placement.rounds.continuation`) and its group
repeats them (``Group.prompt_ids``): every rank already holds the problem, so neither may
travel. The payloads are the pickled objects the collectives (``gather_object``,
``broadcast_object``) would send, measured at a 4-token and a 16,000-token prefix.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from megagrpo.placement.rollouts import ShardedRollouts
from megagrpo.placement.rounds import continuation
from megagrpo.rollout import SamplingSpec
from megagrpo.types import Group, Problem


class _Comm:
    """Rank 0 of 2 (one replica each); the other replica's share arrives as ``other``."""

    rank, world_size, is_main = 0, 2, True

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.other: list[Group] = []

    def broadcast_object(self, obj, src: int = 0):
        self.sent.append(pickle.dumps(obj))
        return pickle.loads(self.sent[-1])

    def gather_object(self, obj):
        self.sent.append(pickle.dumps(obj))
        return [pickle.loads(self.sent[-1]), self.other]

    def all_gather_object(self, obj):  # the engines' verifier states, once at start-up
        return [obj, obj]


class _Engine:
    probe_token_ids = [1, 2, 3]

    def supports_adapter_sync(self) -> bool:
        return False

    def generate(self, problems, n, spec):
        return [_answer(p) for p in problems]


def _answer(p: Problem) -> Group:
    """What an engine returns for a continuation: its prompt ids are the problem's."""
    return Group(
        problem=p,
        completions=["x"],
        token_ids=[[7, 8, 9]],
        logprobs=[[-0.1, -0.2, -0.3]],
        prompt_ids=list(p.meta["prompt_ids"]),
        finish_reasons=["length"],
    )


def _chunk(prefix: int) -> tuple[list[int], list[Group], list[Problem]]:
    base = Problem(id="q", messages=[{"role": "user", "content": "?"}], answer=["a"])
    problems = [
        continuation(base, list(range(50)), list(range(prefix)), room=64),
        continuation(Problem(id="r", messages=[], answer=[]), [1], list(range(prefix)), 64),
    ]
    comm = _Comm()
    rollouts = ShardedRollouts(_Engine(), comm, reward_fn=SimpleNamespace(), replica_size=1)  # type: ignore[arg-type]
    comm.sent.clear()
    from megagrpo.placement import rollouts as module

    send = getattr(module, "lean", list)  # what replica 1 sends (this code's format)
    comm.other = send([_answer(problems[1])])
    groups = rollouts.generate(problems, 1, SamplingSpec(max_tokens=64))
    return [len(b) for b in comm.sent], groups, problems


def test_chunk_payload_does_not_grow_with_the_prefix():
    """Fails on cabf39c: each payload carried the 16,000-token prompt + prefix twice (the
    group's prompt ids and the problem's ``meta['prompt_ids']``), ~160 kB per group."""
    small, _, _ = _chunk(4)
    large, groups, problems = _chunk(16_000)
    assert len(large) == 2  # rank 0's gather, then its broadcast
    for a, b in zip(small, large):
        assert b - a < 200, (small, large)  # the same bytes but for pickling's int widths
    for g, p in zip(groups, problems):  # every rank gets them back from its own problems
        assert g.problem is p
        assert g.prompt_ids == p.meta["prompt_ids"] and len(g.prompt_ids) > 16_000
        assert g.token_ids == [[7, 8, 9]] and g.logprobs == [[-0.1, -0.2, -0.3]]
