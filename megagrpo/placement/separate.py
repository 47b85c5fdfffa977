"""Placement ``separate``: engines on their own ranks, one step ahead of training.

The last ``rollout.engine_ranks`` processes serve engines in replicas of
``rollout.tensor_parallel_size`` ranks (e.g. one vLLM TP 8 replica per node:
:func:`megagrpo.placement.engine_rank.serve_engine`) and never train; the others train in their
own Megatron world (any layout the trainer supports: :func:`megagrpo.parallel.split.split_world`).
Trainer rank 0 sends each replica its share of a round (cut as :func:`~megagrpo.placement.rollouts
.shard_split` cuts sharded rollouts) and shares what the replicas' leaders return with the other
trainer ranks, so :class:`SeparateRollouts` is a :class:`~megagrpo.placement.rollouts.Rollouts`
like the others: generate, score, push verified. An adapter push goes from the trainer ranks
that own its buckets straight to every engine rank (:mod:`megagrpo.placement.feed`); merged
weights stream from trainer rank 0.

Versions: the trainer counts its weight pushes (:attr:`SeparateRollouts.version`, the weights
it trains from); the engine stamps each group with the version it held when it sampled it
(``meta['policy_version']``, per token ``meta['policy_versions']`` = version + 1 in step
numbering). A batch that lags more than its bound raises
:class:`megagrpo.placement.staleness.StalenessError` before it trains.

``max_staleness: 1`` (the default here): right after step k's batch is collected, the first
round of step k+1 is drawn (exactly what the curriculum would draw at k+1's start: nothing
between the two observes the samplers) and sent to the engines, which generate it with the
weights of version k-1 while the trainer trains step k (slime's / verl's one-step
off-policy). The push of version k queues behind it, so step k+1's further rounds (dynamic
resampling) and evaluations run on version k. The loss corrects the lag as for partial
rollouts: recomputed old log-probs and token-level importance weights against the engines'
log-probs (``loss.tis_cap``). ``max_staleness: 0``: nothing is sent ahead (on-policy).

With partial rollouts (``rollout.partial``) each replica runs whole partial rounds on its share
(:func:`megagrpo.placement.rounds.run_round`: no message per chunk), the round sent ahead
included; its unfinished completions come back and are carried. One bound counts both kinds
of lag: ``rollout.partial.max_staleness`` caps the versions any trained token lags its training
step, whether it was carried from earlier steps or generated ahead (so it must exceed
``rollout.max_staleness``).

A checkpoint of step k holds the samplers and the carried groups as they were before step
k+1's first round started, so a resumed run draws that round again (on-policy this time: the
round in flight is not saved). ``perf/overlap_frac``: the fraction of the step during which the
trainer trained while an engine generated (both clocks are ``time.time()`` of one machine or
NTP-synchronised nodes).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from megagrpo.data.variants import expand_round, fold_round, has_variants
from megagrpo.errors import ConfigError
from megagrpo.parallel.comm import Comm
from megagrpo.parallel.split import WorldSplit
from megagrpo.placement.bridge import CTRL, FEED, GEN, PUSH, REQ, Channel, PgChannel, send_named
from megagrpo.placement.engine_rank import EngineSide, PartialRequest, PushHeader, serve_engine
from megagrpo.placement.feed import feed_adapter
from megagrpo.placement.rollouts import (
    Counts,
    EngineFactory,
    Rollouts,
    WeightUpdate,
    _everything,
    _nothing,
    _report_metrics,
    _worst,
    shard_split,
)
from megagrpo.placement.rounds import PendingGroup, RoundResult, split_work
from megagrpo.placement.staleness import (
    check_staleness,
    check_token_staleness,
    stamp_staleness,
)
from megagrpo.rewards import CompositeReward
from megagrpo.rollout import SamplingSpec
from megagrpo.rollout.base import WeightSyncError
from megagrpo.types import Group, Problem

if TYPE_CHECKING:
    from megagrpo.parallel.signals import StopSignals
    from megagrpo.placement.partial import PartialRollouts
    from megagrpo.rollout.config import RolloutConfig

log = logging.getLogger(__name__)

NO_GATHER = -1
""":attr:`SeparateRollouts.adapter_dst`: no trainer rank gathers a streamed adapter (its
owners feed the engines: :mod:`megagrpo.placement.feed`)."""


@dataclass
class EngineLink:
    """A trainer rank's links to the engine ranks: ``control`` (trainer rank 0 only: engine
    rank -> channel), ``feed`` (every trainer rank: engine rank -> channel for adapter
    buckets), ``replicas`` (engine ranks per replica, the first one its leader)."""

    control: dict[int, Channel] = field(default_factory=dict)
    feed: dict[int, Channel] = field(default_factory=dict)
    replicas: list[list[int]] = field(default_factory=lambda: [[0]])

    @classmethod
    def single(cls, channel: Channel) -> EngineLink:
        """One engine rank behind one channel (tests, threads)."""
        return cls({0: channel}, {0: channel}, [[0]])

    @property
    def engines(self) -> list[int]:
        return [e for r in self.replicas for e in r]


@dataclass
class _Sent:
    """A round sent ahead whose reply was not collected yet."""

    kind: str
    """generate | partial."""
    problems: list[Problem]
    plan: Any = None
    """How its problems' variants were spread (None: no variants)."""
    step: int = 0


class SeparateRollouts(Rollouts):
    """The trainer's side of placement separate (module docstring). ``link``: this rank's links
    to the engine ranks (a bare channel: one engine rank)."""

    adapter_dst: int | None = NO_GATHER

    def __init__(
        self,
        link: EngineLink | Channel | None,
        comm: Comm,
        reward_fn: CompositeReward,
        max_staleness: int,
        bucket_mb: float = 512.0,
    ):
        # not Rollouts.__init__: there is no engine in this process
        self.engine, self.comm, self.reward_fn = None, comm, reward_fn
        if link is not None and not isinstance(link, EngineLink):
            link = EngineLink.single(link)
        self.link, self.max_staleness, self.bucket_mb = link, max_staleness, bucket_mb
        self.policy: Any = None
        """The trainer's policy (:meth:`attach`): its owner ranks feed the adapter."""
        self.training_step = 0
        """The step being trained: a push carries the weights current for the next one."""
        hello, hellos = None, []
        if comm.is_main:
            if link is None or not link.control:
                raise ConfigError(
                    "config key 'rollout.placement': separate runs under `megagrpo train` "
                    "launched with 2 or more processes (the last ones serve the engines)"
                )
            for e in link.engines:
                link.control[e].send(REQ, ("hello",))
            hellos = [_reply(link.control[e].recv(CTRL), "hello")[0] for e in link.engines]
            hello = hellos[0]
        hello = comm.broadcast_object(hello)
        self.probe_token_ids: list[int] = hello["probe_token_ids"]
        self.supports_adapter_sync: bool = hello["adapters"]
        self._engine_dtype = getattr(torch, hello["dtype"])
        self.last_probe: list[float] | None = None
        self._regions = None
        self.verifiers = [h.get("verifier") for h in hellos] if comm.is_main else None
        self.resumed_verifiers = None  # (rank 0: one state per engine rank)
        self.version = 0
        """Weight pushes sent: the version of the weights the trainer trains from."""
        self.submitted: list[_Sent] = []
        """Rounds sent ahead whose replies were not collected yet (oldest first)."""
        self.engine_busy: list[tuple[float, float]] = []
        """The engines' generation intervals reported since :meth:`pop_engine_busy`."""
        self.lags: list[int] = []
        """Staleness of every training group collected since :meth:`pop_staleness` (rank 0)."""
        self._early: list[list[tuple]] = []
        """Rank 0: replies to rounds sent ahead, received before a synchronous round's."""

    def attach(self, policy: Any, step: int = 0) -> None:
        """The policy whose owner ranks feed a streamed adapter to the engines, and the last
        completed step (a resumed run's)."""
        self.policy, self.training_step = policy, step

    # ------------------------------------------------------------------ requests

    def _replicas(self) -> list[list[int]]:
        assert self.link is not None
        return self.link.replicas

    def _send(self, messages: list[tuple]) -> None:
        """Rank 0: ``messages[j]`` to every rank of replica ``j``."""
        assert self.link is not None
        for msg, ranks in zip(messages, self._replicas()):
            for e in ranks:
                self.link.control[e].send(REQ, msg)

    def _replies(self) -> list[tuple]:
        """Rank 0: one generation reply from each replica's leader, in replica order."""
        assert self.link is not None
        return [self.link.control[r[0]].recv(GEN) for r in self._replicas()]

    def _next_replies(self) -> list[tuple]:
        """Rank 0: the replies of the next synchronous request (those of rounds sent ahead
        come first: kept for :meth:`collect`)."""
        while len(self._early) < len(self.submitted):
            self._early.append(self._replies())
        return self._replies()

    def _shares(self, problems: list[Problem], n: Counts, spec: SamplingSpec) -> list[tuple]:
        """``("generate", ...)`` of each replica's contiguous share of a round."""
        out, reps = [], len(self._replicas())
        for j in range(reps):
            start, end = shard_split(n, len(problems), reps, j)
            share = n if isinstance(n, int) else n[start:end]
            offset = dataclasses.replace(spec, problem_offset=spec.problem_offset + start)
            out.append(("generate", problems[start:end], share, offset))
        return out

    def _signalled(self, msg: tuple, kind: str) -> tuple:
        """The payload of an engine reply of ``kind`` without its last element, the stop
        signal the engine rank received: the first one is kept in :attr:`engine_signal`."""
        *payload, signum = _reply(msg, kind)
        if signum and not self.engine_signal:
            self.engine_signal = int(signum)
        return tuple(payload)

    def _groups(self, replies: list[tuple]) -> list[Group]:
        groups = [g for reply in replies for g in self._signalled(reply, "groups")[0]]
        check_staleness(groups, self.version, self.max_staleness)
        return groups

    # ------------------------------------------------------------------ generation

    def _generate_on_main(self, problems: list[Problem], n: Counts, spec: SamplingSpec):
        if not self.comm.is_main:
            return []
        self._send(self._shares(problems, n, spec))
        return self._groups(self._next_replies())

    def generate_round(self, problems, n, seed) -> list[Group]:
        groups = super().generate_round(problems, n, seed)
        lags = stamp_staleness(groups, self.version)
        if self.comm.is_main:
            self.lags += lags
        return groups

    def submit(self, problems: list[Problem], n: Counts, spec: SamplingSpec) -> None:
        """Collective: rank 0 sends a round to the engines without waiting (:meth:`collect`)."""
        plan = None
        asked, counts = problems, n
        if any(has_variants(p) for p in problems):  # data.variants, as generate_round does
            asked, counts, plan = expand_round(problems, n, int(spec.seed or 0))
        if self.comm.is_main:
            self._send(self._shares(asked, counts, spec))
        self.submitted.append(_Sent("generate", problems, plan))

    def collect(self) -> list[Group]:
        """Collective: the oldest round sent ahead, checked against the staleness bound at the
        version about to train on it, scored, on every rank."""
        sent = self.submitted.pop(0)
        groups = []
        if self.comm.is_main:
            replies = self._early.pop(0) if self._early else self._replies()
            groups = self._groups(replies)
            groups = groups if sent.plan is None else fold_round(groups, sent.problems, sent.plan)
            self.lags += stamp_staleness(groups, self.version)
        return self._score_and_share(groups, sent.problems)

    # ------------------------------------------------------------------ partial rollouts

    def _partial_messages(
        self, work: list[PendingGroup], partial: PartialRollouts, step: int, round_idx: int
    ) -> list[tuple]:
        """``("partial", ...)`` of each replica's share of a round (the token budget shared)."""
        shares = split_work(work, len(self._replicas()))
        cfg = partial.cfg
        if cfg.token_budget:
            cfg = dataclasses.replace(cfg, token_budget=-(-cfg.token_budget // len(shares)))
        args = (cfg, partial.max_tokens, partial.seed, step, round_idx)
        return [("partial", PartialRequest(share, *args)) for share in shares]

    def _round_result(self, replies: list[tuple], step: int, bound: int) -> RoundResult:
        out = RoundResult([], [])
        for reply in replies:
            res, _ = self._signalled(reply, "partial")
            out.finished += res.finished
            out.remaining += res.remaining
            out.chunks = max(out.chunks, res.chunks)
            out.tokens += res.tokens
        check_token_staleness(out.finished, step, bound)
        self.lags += [int(g.meta.get("staleness", 0)) for g in out.finished]
        return out

    def partial_round(
        self, work: list[PendingGroup], partial: PartialRollouts, step: int, round_idx: int
    ) -> RoundResult:
        """Collective: one partial round run by the engines (each replica on its share), its
        result on every rank."""
        res = None
        if self.comm.is_main:
            self._send(self._partial_messages(work, partial, step, round_idx))
            res = self._round_result(self._next_replies(), step, partial.cfg.max_staleness)
        return self.comm.broadcast_object(res)

    def submit_partial(self, work: list[PendingGroup], partial: PartialRollouts, step: int) -> None:
        """Collective: rank 0 sends step ``step``'s first partial round without waiting."""
        if self.comm.is_main:
            self._send(self._partial_messages(work, partial, step, 0))
        self.submitted.append(_Sent("partial", [], step=step))

    def collect_partial(self, bound: int) -> RoundResult:
        """Collective: the result of the partial round sent ahead, on every rank."""
        sent = self.submitted.pop(0)
        res = None
        if self.comm.is_main:
            replies = self._early.pop(0) if self._early else self._replies()
            res = self._round_result(replies, sent.step, bound)
        return self.comm.broadcast_object(res)

    # ------------------------------------------------------------------ weights

    def _push_here(self, update: WeightUpdate, expected: list[float] | None) -> Any:
        """Collective: feed ``update`` to every engine rank; rank 0 returns their reports."""
        version = self.version + 1
        policy = self.policy
        fed = update.mode == "adapter" and update.in_memory and policy is not None
        manifest = None
        if fed:  # every trainer rank takes part; the owners send their buckets
            assert self.link is not None
            feeds = [self.link.feed[e] for e in self.link.engines]

            def send(flat: torch.Tensor) -> None:
                for ch in feeds:
                    ch.send_tensor(FEED, flat)

            manifest = feed_adapter(policy, self._engine_dtype, self.bucket_mb, send)
        if not self.comm.is_main:
            return None  # (Rollouts.push drains this rank's share of a merged export)
        assert self.link is not None
        head = PushHeader(update.mode, version, expected, self.last_probe, update.full_check)
        head.weights_step = self.training_step + 1
        tensors: Any = update.stream
        if update.mode == "adapter":
            lora = policy.cfg.lora if fed and policy is not None else update.adapter
            assert lora is not None, "the adapter is fed by its owners or built on rank 0"
            head.rank, head.alpha = lora.rank, lora.alpha
            if fed and policy is not None:
                head.manifest, head.num_experts = manifest, policy.arch.num_experts
                tensors = None
            else:
                assert update.adapter is not None
                tensors = [(f"a:{k}", v) for k, v in update.adapter.a.items()]
                tensors += [(f"b:{k}", v) for k, v in update.adapter.b.items()]
        channels = [self.link.control[e] for e in self.link.engines]
        saved, self.resumed_verifiers = self.resumed_verifiers, None
        for i, ch in enumerate(channels):  # a resumed run's engines take the saved state
            mine = None if saved is None else saved[i]
            ch.send(REQ, ("push", dataclasses.replace(head, verifier=mine)))
        if tensors is not None:
            send_named(channels, REQ, iter(tensors), self.bucket_mb)
        reports, errors, states = [], [], []
        for ch in channels:
            report, error, busy, state = self._signalled(ch.recv(PUSH), "pushed")
            self.engine_busy += busy
            if error:
                errors.append(error)
            reports.append(report)
            states.append(state)
        if errors:
            raise WeightSyncError("; ".join(errors))
        self.version, self.verifiers = version, states
        return reports

    def push(self, update: WeightUpdate, expected: list[float]) -> dict[str, float]:
        """Collective: :meth:`_push_here`; ``sync/*`` the worst engine rank's checks,
        ``sync/verified_engines`` every engine rank's verdict."""
        error, metrics = None, None
        try:
            reports = self._push_here(update, expected)
            if reports is not None:
                metrics = _worst([_report_metrics(r) for r in reports])
                metrics["sync/verified_engines"] = float(len(reports))
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = f"rank {self.comm.rank}: {type(exc).__name__}: {exc}"
        finally:
            for _ in update.stream or ():  # a failed load still finishes the collective export
                pass
        errors = [e for e in self.comm.all_gather_object(error) if e]
        if errors:
            raise WeightSyncError("weight sync failed on " + "; ".join(errors))
        self.last_probe = expected
        self.version = self.comm.broadcast_object(self.version)
        return self.comm.broadcast_object(metrics)

    def regions(self):
        """Trainer rank 0 sends whole tensors to the engine ranks; the others send nothing."""
        return _everything if self.comm.is_main else _nothing

    def engine_dtype(self) -> torch.dtype:
        return self._engine_dtype

    def weights_dropped(self) -> bool:
        return False  # the engine ranks never sleep

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
        """Collect what is still in flight, then stop the engine ranks (best effort: after a
        failure an engine rank may be gone, and the failure is what the run reports)."""
        link, self.link = self.link, None
        if self.comm.is_main and link is not None and link.control:
            try:
                for _ in range(len(self.submitted) - len(self._early)):
                    for r in link.replicas:
                        link.control[r[0]].recv(GEN)
                for e in link.engines:
                    link.control[e].send(REQ, ("close",))
                for e in link.engines:
                    _reply(link.control[e].recv(CTRL), "closed")
                    link.control[e].close()
            except Exception:  # noqa: BLE001 - at exit; the engine rank's own error is logged there
                log.warning("engine ranks did not close cleanly", exc_info=True)
        self.submitted, self._early = [], []


def _reply(msg: tuple, kind: str) -> tuple:
    """The payload of a reply of ``kind``; RuntimeError with the engine's error otherwise."""
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    if msg[0] != kind:
        raise RuntimeError(f"engine rank replied {msg[0]!r} to a {kind!r} request")
    return msg[1:]


def trainer_link(split: WorldSplit | None) -> EngineLink | None:
    """A trainer rank's links to the engine ranks (control on trainer rank 0 only)."""
    if split is None:
        return None

    def channel(e: int) -> PgChannel:
        return PgChannel(split.bridge, e, split.data, split.device)

    feed: dict[int, Channel] = {e: channel(e) for e in split.engines}
    control: dict[int, Channel] = {}
    if split.rank == 0:
        control = {e: channel(e) for e in split.engines}
    return EngineLink(control, feed, split.replicas)


def serve_engine_rank(
    rollout: RolloutConfig,
    hf_path: str,
    seed: int,
    split: WorldSplit,
    engine_factory: EngineFactory | None = None,
    stop: StopSignals | None = None,
) -> int:
    """An engine rank of placement separate (the run's ``rollout`` config, ``model.hf_path``
    and ``trainer.seed``): join the replica's private world (several ranks
    per replica), start the engine on the model, serve trainer rank 0 until it closes the link
    (:func:`megagrpo.placement.engine_rank.serve_engine`). ``stop``: this rank's signal
    handlers (re-asserted once the engine started); what they record goes with each reply, and
    the trainers stop at their next step boundary (red team 3, L6: it was ignored)."""
    import torch.distributed as dist

    from megagrpo.model.pretrained import resolve_model_path
    from megagrpo.rollout import build_engine

    assert split.is_engine
    if split.replica_size > 1 and not dist.is_initialized():  # vLLM's external_launcher world
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    model_path = str(resolve_model_path(hf_path))
    engine = (engine_factory or build_engine)(rollout, model_path, seed)

    def feed(rank: int) -> PgChannel:
        return PgChannel(split.bridge, rank, split.data, split.device)

    signalled = (lambda: int(stop.signum or 0)) if stop is not None else (lambda: 0)
    if stop is not None:
        stop.install()  # an engine may have replaced the handlers while it started
    side = EngineSide(feed(0), feed, split.leader, split.replica, signalled)
    try:
        return serve_engine(engine, side)
    finally:
        engine.close()
