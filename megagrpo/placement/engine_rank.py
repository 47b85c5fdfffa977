"""An engine rank of placement separate: its whole life is :func:`serve_engine`.

The engine ranks are the last ``rollout.engine_ranks`` processes of the launch, in replicas of
``rollout.tensor_parallel_size`` consecutive ranks (each replica one vLLM world of its own,
``external_launcher``, inside one node: :func:`megagrpo.parallel.split.split_world`). Trainer
rank 0 sends every rank of a replica the same request (the replica's share of a round), so
the replica's ranks make the same engine calls in lock-step; the replica's first rank (the
leader) replies with the groups. A loop answers:

* ``hello``: probe sequence, dtype, adapter support (every rank);
* ``generate``: unscored groups tagged with the policy version the engine held
  (``meta['policy_version']``, and per token ``meta['policy_versions']`` in the step numbering
  of partial rollouts);
* ``partial``: a whole partial-rollout round (:func:`megagrpo.placement.rounds.run_round`)
  on the replica's share of the work, new tokens stamped with the step its weights are
  current for (the push says it);
* ``push``: merged weights streamed by trainer rank 0, or the adapter's buckets straight from
  the trainer ranks that own them (:mod:`megagrpo.placement.feed`); loaded and verified by the
  engine's probe exactly as a colocated engine verifies them (every rank replies);
* ``close``.

An engine error is sent back as a reply, never swallowed. Every ``generate``, ``partial`` and
``push`` reply ends with the stop signal this rank received (SIGTERM, SIGINT, SIGUSR1: its
number, 0 for none): a signal that reaches only an engine rank stops the run as one reaching a
trainer rank does (trainer rank 0 adopts it at the next step boundary).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megagrpo.placement.bridge import CTRL, GEN, PUSH, REQ, Channel, recv_named
from megagrpo.placement.feed import FeedBucket, receive_adapter
from megagrpo.placement.rounds import PendingGroup, round_seed, run_round
from megagrpo.rollout import RolloutEngine
from megagrpo.rollout.base import decode_completion
from megagrpo.rollout.config import PartialConfig
from megagrpo.rollout.lora import PeftAdapter, expert_range
from megagrpo.rollout.verify import load_verifier_state, verifier_state


@dataclass
class EngineSide:
    """This engine rank's links: ``control`` to trainer rank 0, ``feed(rank)`` from trainer
    rank ``rank`` (adapter buckets); ``leader``: the replica's first rank (it replies to
    generation requests); ``replica``: the replica's index."""

    control: Channel
    feed: Callable[[int], Channel]
    leader: bool = True
    replica: int = 0
    stop: Callable[[], int] = lambda: 0
    """The stop signal this rank received (0: none), sent with each reply."""

    @classmethod
    def single(cls, channel: Channel) -> EngineSide:
        """One engine rank linked by one channel (tests, threads)."""
        return cls(channel, lambda rank: channel)


@dataclass
class EngineState:
    """What the engine rank knows between messages."""

    version: int = 0
    """Weight updates the engine holds (0: the weights it started with)."""
    step: int = 1
    """The training step its weights are current for (partial rollouts' numbering: a step
    that trained nothing pushes nothing, so this is not always ``version + 1``)."""
    busy: list[tuple[float, float]] = field(default_factory=list)
    """Generation intervals (``time.time()``) not yet reported to the trainer."""


def tag_versions(groups: list, version: int, step: int | None = None) -> None:
    """Stamp every group with the version its completions were sampled under:
    ``meta['policy_version']`` (weight updates held) and ``meta['policy_versions']`` per token
    in partial rollouts' numbering (``step``: the training step those weights were current
    for; default version + 1)."""
    for g in groups:
        g.meta["policy_version"] = version
        stamp = version + 1 if step is None else step
        g.meta["policy_versions"] = [[stamp] * len(ids) for ids in g.token_ids]


def serve_engine(engine: RolloutEngine, side: EngineSide | Channel) -> int:
    """The engine rank's loop (module docstring) until ``close``; returns the messages served."""
    if not isinstance(side, EngineSide):
        side = EngineSide.single(side)
    ch, state, served = side.control, EngineState(), 0
    while True:
        msg = ch.recv(REQ)
        served += 1
        kind = msg[0]
        if kind == "close":
            ch.send(CTRL, ("closed", served))
            ch.close()
            return served
        if kind == "hello":
            ch.send(CTRL, _hello(engine))
        elif kind in ("generate", "partial"):
            reply = (_generate if kind == "generate" else _partial)(engine, state, side, *msg[1:])
            if side.leader:
                ch.send(GEN, _with_signal(reply, side))
        elif kind == "push":
            ch.send(PUSH, _with_signal(_push(engine, state, side, msg[1]), side))
        else:
            ch.send(CTRL, ("error", f"unknown request {kind!r}"))


def _with_signal(reply: tuple, side: EngineSide) -> tuple:
    """``reply`` and the stop signal this rank received (an error reply as it is)."""
    return reply if reply[0] == "error" else (*reply, int(side.stop()))


def _hello(engine: RolloutEngine) -> tuple:
    return (
        "hello",
        {
            "probe_token_ids": list(engine.probe_token_ids),
            "adapters": bool(engine.supports_adapter_sync()),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "verifier": verifier_state(engine),
        },
    )


def _generate(engine: RolloutEngine, state: EngineState, side, problems, counts, spec) -> tuple:
    t0 = time.time()
    try:
        groups = engine.generate(problems, counts, spec)
    except Exception as exc:  # noqa: BLE001 - the trainer raises it
        return ("error", f"engine rank: {type(exc).__name__}: {exc}")
    tag_versions(groups, state.version, state.step)
    state.busy.append((t0, time.time()))
    return ("groups", groups, state.version)


@dataclass
class PartialRequest:
    """A partial-rollout round for one replica: its share of the work and how to run it."""

    work: list[PendingGroup]
    cfg: PartialConfig
    max_tokens: int
    seed: int
    step: int
    round_idx: int


def replica_seed(seed: int, replica: int) -> int:
    """Replica ``replica``'s seed of a chunk seeded ``seed`` (replica 0: ``seed`` itself, the
    colocated draw)."""
    return (seed ^ (replica * 0x9E3779B1)) & 0x7FFFFFFF


def _partial(engine: RolloutEngine, state: EngineState, side, req: PartialRequest) -> tuple:
    t0 = time.time()

    def seed_of(chunk: int) -> int:
        return replica_seed(
            round_seed(req.seed, req.step, 1000 * req.round_idx + chunk), side.replica
        )

    def decode(ids: list[list[int]]) -> list[str]:
        return [decode_completion(engine.tokenizer, t) for t in ids]

    try:
        res = run_round(
            req.work,
            engine.generate,
            decode,
            req.cfg,
            req.max_tokens,
            req.step,
            seed_of,
            stamp=state.step,
        )
    except Exception as exc:  # noqa: BLE001 - the trainer raises it
        return ("error", f"engine rank: {type(exc).__name__}: {exc}")
    for g in res.finished:
        g.meta["policy_version"] = state.version
    state.busy.append((t0, time.time()))
    return ("partial", res, state.version)


@dataclass
class PushHeader:
    """What a push message says before its tensors."""

    mode: str
    """adapter | merged."""
    version: int
    expected: list[float] | None
    before: list[float] | None
    full_check: bool | None = None
    rank: int = 8
    alpha: float = 16.0
    weights_step: int = 0
    """The training step the pushed weights are current for (0: version + 1)."""
    manifest: list[FeedBucket] | None = None
    """Adapter fed by its owners (:mod:`megagrpo.placement.feed`): where each bucket comes
    from; None: the adapter's tensors follow on the control channel (``a:``/``b:`` names)."""
    num_experts: int = 0
    verifier: dict | None = None
    """A resumed run's saved verification state for this engine, taken over before the
    update is verified (:meth:`megagrpo.placement.rollouts.Rollouts.resume_verifiers`)."""


def _push(engine: RolloutEngine, state: EngineState, side: EngineSide, head: PushHeader) -> tuple:
    """Load the pushed tensors (drained in full even when loading fails) and verify them."""
    stream: Any = iter(()) if head.manifest is not None else recv_named(side.control, REQ)
    try:
        load_verifier_state(engine, head.verifier)
        if head.mode == "adapter":
            if head.manifest is not None:
                block = engine.expert_block()  # only this rank's experts stay (P1)
                experts = None if block is None else expert_range(block)
                adapter, _ = receive_adapter(
                    head.manifest, side.feed, head.rank, head.alpha, head.num_experts, experts
                )
            else:
                adapter = PeftAdapter(rank=head.rank, alpha=head.alpha)
                for name, t in stream:
                    part, module = name.split(":", 1)
                    (adapter.a if part == "a" else adapter.b)[module] = t
            report = engine.update_adapter(adapter, head.expected, head.before, in_memory=True)
        else:
            report = engine.update_weights(stream, head.expected, head.before, head.full_check)
        error = None
    except Exception as exc:  # noqa: BLE001 - the trainer raises it
        report, error = None, f"engine rank: {type(exc).__name__}: {exc}"
    for _ in stream:
        pass
    if error is None:
        state.version = head.version
        state.step = head.weights_step or head.version + 1
    busy, state.busy = state.busy, []
    return ("pushed", report, error, busy, verifier_state(engine))
