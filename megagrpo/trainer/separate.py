"""Placement ``separate``: the engine on its own rank, one step ahead of training.

The last process of the run serves one engine (:func:`megagrpo.trainer.bridge.serve_engine`)
and never trains; the others train in their own Megatron world (any layout the trainer
supports: the split is :func:`megagrpo.parallel.split.split_world`). Global trainer rank 0
talks to the engine over a :class:`~megagrpo.trainer.bridge.Channel` and shares what it
receives with the other trainer ranks, so :class:`SeparateRollouts` is a
:class:`~megagrpo.trainer.rollouts.Rollouts` like the others: generate, score, push verified.

Versions: the trainer counts its weight pushes (:attr:`SeparateRollouts.version`, the weights
it trains from); the engine stamps each group with the version it held when it sampled it
(``meta['policy_version']``). A group's staleness is the difference; a batch that lags more
than ``rollout.max_staleness`` raises :class:`StalenessError` before it trains.

``max_staleness: 1`` (the default here): right after step k's batch is collected, the first
round of step k+1 is drawn (exactly what the curriculum would draw at k+1's start: nothing
between the two observes the samplers) and sent to the engine, which generates it with the
weights of version k-1 while the trainer trains step k (slime's / verl's one-step
off-policy). The push of version k queues behind it, so step k+1's further rounds (dynamic
resampling) and evaluations run on version k. The loss corrects the lag exactly as for partial
rollouts: recomputed old log-probs and token-level importance weights against the engine's
log-probs (``loss.tis_cap``). ``max_staleness: 0``: nothing is sent ahead, every round waits
for the new adapter (on-policy, no overlap).

A checkpoint of step k holds the samplers as they were before step k+1's rounds started, so
a resumed run draws the same first round again (on-policy this time: the round in flight is
not saved). What it drops: more than one engine rank (engine replicas, vLLM TP across ranks).
``perf/overlap_frac``: the fraction of the step during which the trainer trained while the
engine generated (both clocks are ``time.time()`` of one machine or NTP-synchronised nodes).
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch

from megagrpo.data.variants import expand_round, fold_round, has_variants
from megagrpo.errors import ConfigError
from megagrpo.parallel.split import WorldSplit
from megagrpo.rewards import CompositeReward
from megagrpo.rollout import SamplingSpec, SyncReport
from megagrpo.rollout.base import WeightSyncError
from megagrpo.trainer.bridge import (
    CTRL,
    GEN,
    PUSH,
    REQ,
    Channel,
    PgChannel,
    PushHeader,
    send_named,
    serve_engine,
)
from megagrpo.trainer.context import Ahead, Comm
from megagrpo.trainer.rollouts import Counts, EngineFactory, Rollouts, WeightUpdate, round_seed
from megagrpo.types import Group, Problem

if TYPE_CHECKING:
    from megagrpo.curriculum.rounds import Rounds
    from megagrpo.trainer.config import RunConfig
    from megagrpo.trainer.context import TrainContext

log = logging.getLogger(__name__)


class StalenessError(RuntimeError):
    """A batch lags the trainer's weights by more than ``rollout.max_staleness`` versions."""


def staleness(groups: list[Group], version: int) -> list[int]:
    """Versions each group lags ``version`` (the weights the trainer trains from)."""
    return [version - int(g.meta["policy_version"]) for g in groups]


def check_staleness(groups: list[Group], version: int, limit: int) -> list[int]:
    """:func:`staleness` of ``groups``; StalenessError when one exceeds ``limit`` or is from
    the future (the engine cannot hold weights the trainer has not pushed)."""
    lags = staleness(groups, version)
    bad = [lag for lag in lags if lag > limit or lag < 0]
    if bad:
        raise StalenessError(
            f"a batch {max(bad, key=abs)} versions behind the trainer's weights (version "
            f"{version}; rollout.max_staleness={limit}): not trained"
        )
    return lags


def stamp_staleness(groups: list[Group], version: int) -> list[int]:
    """:func:`staleness` of ``groups``, also written to each group's ``meta['staleness']``."""
    lags = staleness(groups, version)
    for g, lag in zip(groups, lags):
        g.meta["staleness"] = lag
    return lags


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the time both ``a`` and ``b`` cover (each a list of disjoint
    ``(start, end)`` intervals)."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


class SeparateRollouts(Rollouts):
    """The trainer's side of placement separate (module docstring). ``channel``: the link to
    the engine rank on global rank 0, None on the other trainer ranks."""

    adapter_dst: int | None = 0

    def __init__(
        self,
        channel: Channel | None,
        comm: Comm,
        reward_fn: CompositeReward,
        max_staleness: int,
        bucket_mb: float = 512.0,
    ):
        # not Rollouts.__init__: there is no engine in this process
        self.engine, self.comm, self.reward_fn = None, comm, reward_fn
        self.channel, self.max_staleness, self.bucket_mb = channel, max_staleness, bucket_mb
        hello = None
        if comm.is_main:
            if channel is None:
                raise ConfigError(
                    "config key 'rollout.placement': separate runs under `megagrpo train` "
                    "launched with 2 or more processes (the last one serves the engine)"
                )
            channel.send(REQ, ("hello",))
            hello = _reply(channel.recv(CTRL), "hello")[0]
        hello = comm.broadcast_object(hello)
        self.probe_token_ids: list[int] = hello["probe_token_ids"]
        self.supports_adapter_sync: bool = hello["adapters"]
        self._engine_dtype = getattr(torch, hello["dtype"])
        self.last_probe: list[float] | None = None
        self._regions = None
        self.version = 0
        """Weight pushes sent: the version of the weights the trainer trains from."""
        self.submitted: list[list[Problem]] = []
        """Rounds sent ahead whose groups were not collected yet (oldest first)."""
        self.engine_busy: list[tuple[float, float]] = []
        """The engine's generation intervals reported since :meth:`pop_engine_busy`."""
        self.lags: list[int] = []
        """Staleness of every training group collected since :meth:`pop_staleness` (rank 0)."""
        self._plans: list = []
        """Per submitted round, how its problems' variants were spread (None: no variants)."""
        self._early: list[list[Group]] = []
        """Rank 0: replies to submitted rounds received before a synchronous round's."""

    # ------------------------------------------------------------------ generation

    def _generate_on_main(self, problems: list[Problem], n: Counts, spec: SamplingSpec):
        if not self.comm.is_main:
            return []
        assert self.channel is not None
        while len(self._early) < len(self.submitted):  # rounds sent ahead reply first
            self._early.append(self._receive())
        self.channel.send(REQ, ("generate", problems, n, spec))
        return self._receive()

    def generate_round(self, problems, n, seed) -> list[Group]:
        groups = super().generate_round(problems, n, seed)
        lags = stamp_staleness(groups, self.version)
        if self.comm.is_main:
            self.lags += lags
        return groups

    def submit(self, problems: list[Problem], n: Counts, spec: SamplingSpec) -> None:
        """Collective: rank 0 sends a round to the engine without waiting (:meth:`collect`)."""
        plan = None
        if any(has_variants(p) for p in problems):  # data.variants, as generate_round does
            requests, sizes, plan = expand_round(problems, n, int(spec.seed or 0))
        if self.comm.is_main:
            assert self.channel is not None
            asked = (problems, n) if plan is None else (requests, sizes)
            self.channel.send(REQ, ("generate", *asked, spec))
        self.submitted.append(problems)
        self._plans.append(plan)

    def _receive(self) -> list[Group]:
        """Rank 0: the next generation reply, checked against the staleness bound."""
        assert self.channel is not None
        groups, _ = _reply(self.channel.recv(GEN), "groups")
        check_staleness(groups, self.version, self.max_staleness)
        return groups

    def collect(self) -> list[Group]:
        """Collective: the oldest submitted round, checked against the staleness bound at the
        version about to train on it, scored, on every rank."""
        problems, plan = self.submitted.pop(0), self._plans.pop(0)
        groups = []
        if self.comm.is_main:
            groups = self._early.pop(0) if self._early else self._receive()
            groups = groups if plan is None else fold_round(groups, problems, plan)
            check_staleness(groups, self.version, self.max_staleness)
            self.lags += stamp_staleness(groups, self.version)
        return self._score_and_share(groups, problems)

    # ------------------------------------------------------------------ weights

    def _push_here(self, update: WeightUpdate, expected: list[float] | None) -> SyncReport | None:
        version = self.version + 1
        if not self.comm.is_main:
            return None  # (Rollouts.push drains this rank's share of a merged export)
        assert self.channel is not None
        head = PushHeader(update.mode, version, expected, self.last_probe, update.full_check)
        if update.mode == "adapter":
            assert update.adapter is not None, "the adapter is built on trainer rank 0"
            head.rank, head.alpha = update.adapter.rank, update.adapter.alpha
            tensors: Any = [(f"a:{k}", v) for k, v in update.adapter.a.items()]
            tensors += [(f"b:{k}", v) for k, v in update.adapter.b.items()]
        else:
            assert update.stream is not None
            tensors = update.stream
        self.channel.send(REQ, ("push", head))
        send_named(self.channel, REQ, iter(tensors), self.bucket_mb)
        report, error, busy = _reply(self.channel.recv(PUSH), "pushed")
        self.engine_busy += busy
        if error:
            raise WeightSyncError(error)
        self.version = version
        return report

    def push(self, update: WeightUpdate, expected: list[float]) -> dict[str, float]:
        metrics = super().push(update, expected)
        self.version = self.comm.broadcast_object(self.version)
        return metrics

    def regions(self):
        """Trainer rank 0 sends whole tensors to the engine rank; the others send nothing."""
        from megagrpo.trainer.rollouts import _everything, _nothing

        return _everything if self.comm.is_main else _nothing

    def engine_dtype(self) -> torch.dtype:
        return self._engine_dtype

    def weights_dropped(self) -> bool:
        return False  # the engine rank never sleeps

    # ------------------------------------------------------------------ metrics, close

    def pop_staleness(self) -> dict[str, float]:
        """``offpolicy/staleness_mean`` / ``_max`` of the groups collected since the last call."""
        lags, self.lags = self.lags, []
        lags = self.comm.broadcast_object(lags)
        return {
            "offpolicy/staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "offpolicy/staleness_max": float(max(lags, default=0)),
        }

    def pop_engine_busy(self) -> list[tuple[float, float]]:
        busy, self.engine_busy = self.engine_busy, []
        return busy

    def close(self) -> None:
        """Collect what is still in flight, then stop the engine rank (best effort: after a
        failure the engine rank may be gone, and the failure is what the run reports)."""
        channel, self.channel = self.channel, None
        if self.comm.is_main and channel is not None:
            try:
                for _ in range(len(self.submitted) - len(self._early)):
                    channel.recv(GEN)
                channel.send(REQ, ("close",))
                _reply(channel.recv(CTRL), "closed")
                channel.close()
            except Exception:  # noqa: BLE001 - at exit; the engine rank's own error is logged there
                log.warning("engine rank did not close cleanly", exc_info=True)
        self.submitted, self._early, self._plans = [], [], []


def _reply(msg: tuple, kind: str) -> tuple:
    """The payload of a reply of ``kind``; RuntimeError with the engine's error otherwise."""
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    if msg[0] != kind:
        raise RuntimeError(f"engine rank replied {msg[0]!r} to a {kind!r} request")
    return msg[1:]


# ------------------------------------------------------------------ one step ahead


def submit_ahead(ctx: TrainContext, step: int) -> None:
    """After step ``step``'s batch is collected (``rollout.max_staleness`` 1 on separate
    ranks): start step ``step + 1``'s rounds and send its first round to the engine, which
    generates it while this step trains."""
    rollouts = ctx.rollouts
    if not isinstance(rollouts, SeparateRollouts) or rollouts.max_staleness < 1:
        return
    if step >= ctx.cfg.trainer.max_steps:
        return
    nxt = step + 1
    samplers = copy.deepcopy(sampler_states(ctx))  # what this step's checkpoint holds
    rounds = ctx.dynamic.start(ctx.sampler, ctx.cfg.trainer.batch_groups, nxt)
    ctx.ahead = Ahead(nxt, rounds, samplers)
    requests = rounds.next_requests()
    if requests is not None:
        problems, counts = [r.problem for r in requests], [r.n for r in requests]
        seed = round_seed(ctx.cfg.trainer.seed, nxt, 0)
        rollouts.submit(problems, counts, SamplingSpec(seed=seed))


def sampler_states(ctx: TrainContext) -> dict[str, Any]:
    """The samplers' state a checkpoint of the last completed step holds: as they were before
    :func:`submit_ahead` started the next step's rounds, else as they are."""
    if ctx.ahead is not None and ctx.ahead.samplers:
        return ctx.ahead.samplers
    return {"sampler": ctx.sampler.state_dict(), "dynamic": ctx.dynamic.state_dict()}


def take_ahead(ctx: TrainContext, step: int) -> tuple[Rounds, list[Group] | None] | None:
    """Step ``step``'s rounds started by :func:`submit_ahead` and its first round's groups
    (None: nothing was started ahead)."""
    ahead = ctx.ahead
    if ahead is None:
        return None
    ctx.ahead = None
    if ahead.step != step:
        raise RuntimeError(f"rounds started ahead for step {ahead.step}, collected at {step}")
    rollouts = ctx.rollouts
    assert isinstance(rollouts, SeparateRollouts)
    first = rollouts.collect() if rollouts.submitted else None
    return ahead.rounds, first


def overlap_metrics(ctx: TrainContext, step_s: float) -> dict[str, float]:
    """``perf/overlap_frac`` (the share of the step during which the trainer trained while
    the engine generated) and ``offpolicy/staleness_*``; {} for other placements."""
    rollouts = ctx.rollouts
    if not isinstance(rollouts, SeparateRollouts):
        return {}
    busy = rollouts.pop_engine_busy()
    train = [iv for key, iv in ctx.intervals.items() if key == "train"]
    both = overlap_seconds(busy, train)
    both = ctx.comm.broadcast_object(both)
    return {
        "perf/overlap_frac": both / step_s if step_s > 0 else 0.0,
        "perf/overlap_s": both,
        **rollouts.pop_staleness(),
    }


def trainer_channel(split: WorldSplit | None) -> Channel | None:
    """Trainer rank 0's end of the bridge (None elsewhere, and without a split)."""
    if split is None or split.bridge is None:
        return None
    return PgChannel(split.bridge, split.peer, split.data, split.device)


def serve_engine_rank(
    cfg: RunConfig, split: WorldSplit, engine_factory: EngineFactory | None = None
) -> int:
    """The engine rank of placement separate: start the engine on the model, serve the
    trainer until it closes the link (:func:`megagrpo.trainer.bridge.serve_engine`)."""
    from megagrpo.model.pretrained import resolve_model_path
    from megagrpo.rollout import build_engine

    assert split.is_engine and split.bridge is not None
    model_path = str(resolve_model_path(cfg.model.hf_path))
    engine = (engine_factory or build_engine)(cfg.rollout, model_path, cfg.trainer.seed)
    try:
        return serve_engine(engine, PgChannel(split.bridge, split.peer, split.data, split.device))
    finally:
        engine.close()
