"""MoE routing replay in the Megatron policy (``model.routing_replay``: off | r2 | r3).

Replaying routing means the trainer's forward uses a *given* top-k expert selection instead
of its own router's: the rollout engine's (R3, "rollout routing replay", arXiv 2510.11370) or
the trainer's own first forward of the step (R2). Only the discrete selection is replayed:
the gate weights are still the live router's scores at the replayed experts (megatron-core
gathers them), so the gradient flows through the router's scores, to the router weight if
it were trainable and to the LoRA parameters upstream of it.

megatron-core 0.16.1 implements the mechanism (``TransformerConfig.moe_enable_routing_replay``,
``megatron/core/transformer/moe/router_replay.py``): each ``TopKRouter`` owns a
``RouterReplay`` whose action (record / replay_forward / replay_backward) decides the top-k
inside ``topk_routing_with_score_function``. This module only arms those objects per forward,
with the selection cut to this rank's tokens, and measures agreement on the way:

- :class:`Routing` is what one forward of a ``[B, T]`` micro-batch gets: a selection
  ``[B, T, num_layers, top_k]`` (global layer index, the engines' layout:
  :mod:`megagrpo.rollout.routing`) plus the positions it covers, and what to do with it:
  ``replay``, ``measure`` (run the own router and only count agreement) or ``record``
  (fill ``indices`` from the own router, then replay them in later forwards).
- :class:`StageRouters` holds this pipeline stage's routers. A router sees its tokens as
  ``[S_local * B]`` in sequence-major order (Megatron's ``[S, B, H]``; under sequence
  parallelism ``S_local`` is this TP rank's contiguous chunk of the padded sequence), so the
  selection is transposed, padded and cut the same way. Expert parallelism needs nothing:
  routing happens before the token dispatcher, on the rank's own tokens.

The selection stays armed after the forward, until the next one, so activation recompute in
backward (``model.recompute``) replays the same experts. Pipeline schedules that run several
forwards before their backwards need megatron-core's ``REPLAY_BACKWARD`` queue instead (not
wired: ``forward_logits`` has no pipeline path yet).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megagrpo.errors import ConfigError

if TYPE_CHECKING:
    from megagrpo.model.arch import Arch
    from megagrpo.parallel.state import ParallelGroups

log = logging.getLogger(__name__)

ROUTING_MODES = ("off", "r2", "r3")
ACTIONS = ("replay", "measure", "record")


@dataclass
class Routing:
    """The expert selection one forward of a ``[B, T]`` micro-batch gets, and what it measured.

    Attributes:
        indices: ``[B, T, num_layers, top_k]`` expert ids (any int dtype; layers indexed
            globally, dense layers ignored); None before a ``record`` forward fills it.
        valid: ``[B, T]`` bool, positions the selection covers (the engine fed that token);
            other positions are replayed with experts ``0..k-1`` (their outputs only reach
            masked positions) and not measured.
        action: ``replay`` (use ``indices``), ``measure`` (own routing, count agreement with
            ``indices``) or ``record`` (own routing; ``indices`` filled after the forward with
            this rank's tokens and layers, after which the object replays them).
        measure: count agreement of the own router with ``indices`` in this forward.
        agree, total: accumulated token x layer top-k sets where the own router's set equals
            ``indices``' set, out of the ``valid`` ones measured (this rank's share).
    """

    indices: torch.Tensor | None
    valid: torch.Tensor | None
    action: str = "replay"
    measure: bool = False
    agree: float = 0.0
    total: float = 0.0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"routing action {self.action!r} is not one of {ACTIONS}")
        if self.action != "record" and (self.indices is None or self.valid is None):
            raise ValueError(f"routing action {self.action!r} needs indices and valid")

    @property
    def agreement(self) -> float | None:
        """agree / total, None before anything was measured."""
        return self.agree / self.total if self.total else None


def _router_replay_cls():
    """``RouterReplay`` subclass that also counts agreement (defined lazily: megatron)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class MeasuredRouterReplay(RouterReplay):
        """megatron-core's ``RouterReplay``, plus: once per armed forward, compare the own
        router's top-k set with ``reference`` at the ``valid`` tokens."""

        def __init__(self) -> None:
            super().__init__()
            self.reference: torch.Tensor | None = None
            self.valid: torch.Tensor | None = None
            self.measure_pending = False
            self.counts: list[torch.Tensor] = []

        def get_replay_topk(
            self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
        ):
            assert default_compute_topk is not None  # megatron always passes its top-k
            probs, idx = super().get_replay_topk(
                scores, topk, num_groups, group_topk, default_compute_topk
            )
            if self.measure_pending and self.reference is not None and self.valid is not None:
                own = idx
                if self.router_replay_action in (
                    RouterReplayAction.REPLAY_FORWARD,
                    RouterReplayAction.REPLAY_BACKWARD,
                ):
                    with torch.no_grad():
                        own = default_compute_topk(scores.detach(), topk, num_groups, group_topk)[1]
                same = (own.sort(-1).values == self.reference.sort(-1).values).all(-1)
                valid = self.valid.to(same.device)
                self.counts.append(torch.stack([(same & valid).sum(), valid.sum()]))
                self.measure_pending = False
            return probs, idx

    return MeasuredRouterReplay, RouterReplayAction


def local_rows(
    x: torch.Tensor, pad: int, tp_rank: int, tp_size: int, sequence_parallel: bool, fill
) -> torch.Tensor:
    """``[B, T, ...]`` -> this rank's router rows ``[S_local * B, ...]``: right-padded by
    ``pad`` positions with ``fill`` (broadcast over the trailing dims), sequence-major, cut to
    the TP rank's chunk under sequence parallelism."""
    if pad:
        tail = torch.as_tensor(fill, dtype=x.dtype, device=x.device)
        tail = tail.expand(x.shape[0], pad, *x.shape[2:])
        x = torch.cat([x, tail], dim=1)
    x = x.transpose(0, 1)
    if sequence_parallel and tp_size > 1:
        n = x.shape[0] // tp_size
        x = x[tp_rank * n : (tp_rank + 1) * n]
    return x.reshape(-1, *x.shape[2:])


class StageRouters:
    """This pipeline stage's MoE routers, armed per forward with a :class:`Routing`.

    Built on a GPTModel whose config has ``moe_enable_routing_replay``: each ``TopKRouter``'s
    ``RouterReplay`` is replaced by one that also measures agreement.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tp_rank: int,
        tp_size: int,
        sequence_parallel: bool,
        top_k: int,
        num_experts: int,
    ) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        replay_cls, self._actions = _router_replay_cls()
        self.tp_rank, self.tp_size, self.sp = tp_rank, tp_size, sequence_parallel
        self.top_k, self.num_experts = top_k, num_experts
        self.layers: dict[int, Any] = {}
        """Global layer index -> its router's (measuring) RouterReplay."""
        for router in model.modules():
            if not isinstance(router, TopKRouter):
                continue
            if router.router_replay is None or router.layer_number is None:
                raise RuntimeError(
                    "MoE router built without moe_enable_routing_replay or a layer number"
                )
            replay = replay_cls()
            # megatron's class-wide list would keep each armed selection alive after this
            # policy is gone; these objects are driven through this class only
            type(replay).global_router_replay_instances.remove(replay)
            router.router_replay = replay
            self.layers[int(router.layer_number) - 1] = replay
        self.current: Routing | None = None
        self._shape = (0, 0, 0)

    def arm(self, routing: Routing | None, batch: int, seq: int, pad: int) -> None:
        """Set every router up for the next forward of a ``[batch, seq]`` micro-batch that
        runs padded to ``seq + pad`` positions; None: own routing, nothing measured."""
        self.current, self._shape = routing, (batch, seq, pad)
        for replay in self.layers.values():
            replay.clear_indices()
            replay.clear_router_replay_action()
            replay.reference, replay.valid, replay.measure_pending = None, None, False
        if routing is None:
            return
        if routing.action == "record":
            for replay in self.layers.values():
                replay.set_router_replay_action(self._actions.RECORD)
            return
        self._arm_selection(routing, batch, seq, pad)

    def _arm_selection(self, routing: Routing, batch: int, seq: int, pad: int) -> None:
        idx, valid = routing.indices, routing.valid
        assert idx is not None and valid is not None  # Routing.__post_init__
        if idx.dim() != 4 or tuple(idx.shape[:2]) != (batch, seq) or idx.shape[3] != self.top_k:
            raise ValueError(
                f"routing indices {tuple(idx.shape)} do not match the micro-batch: expected "
                f"[{batch}, {seq}, num_layers, {self.top_k}]"
            )
        if tuple(valid.shape) != (batch, seq):
            raise ValueError(f"routing valid {tuple(valid.shape)} is not [{batch}, {seq}]")
        if self.layers and idx.shape[2] <= max(self.layers):
            raise ValueError(f"routing has {idx.shape[2]} layers; layer {max(self.layers)} routes")
        if idx.numel():  # one host sync per forward, not one per layer
            lo, hi = torch.aminmax(idx)
            if int(lo) < 0 or int(hi) >= self.num_experts:
                raise ValueError(f"routing has expert ids outside [0, {self.num_experts})")
        fill = torch.arange(self.top_k, dtype=idx.dtype, device=idx.device)
        rows_valid = local_rows(valid.bool(), pad, self.tp_rank, self.tp_size, self.sp, False)
        for layer, replay in self.layers.items():
            rows = local_rows(idx[:, :, layer], pad, self.tp_rank, self.tp_size, self.sp, fill)
            rows = rows.long()
            replay.reference, replay.valid = rows, rows_valid
            replay.measure_pending = routing.measure
            if routing.action == "replay":
                replay.set_target_indices(rows)
                replay.set_router_replay_action(self._actions.REPLAY_FORWARD)

    def finish(self) -> None:
        """After the forward: add the measured counts to the armed Routing; for ``record``,
        fill its ``indices`` with this rank's rows and keep replaying them (so recompute in
        backward sees the recorded experts)."""
        routing = self.current
        counts = [c for r in self.layers.values() for c in r.counts]
        for r in self.layers.values():
            r.counts = []
        if routing is None:
            return
        if counts:
            agree, total = torch.stack(counts).sum(0).tolist()
            routing.agree += agree
            routing.total += total
        if routing.action == "record":
            self._collect_record(routing)

    def _collect_record(self, routing: Routing) -> None:
        batch, seq, pad = self._shape
        num_layers = max(self.layers, default=-1) + 1
        device = next(
            (
                r.recorded_topk_idx.device
                for r in self.layers.values()
                if r.recorded_topk_idx is not None
            ),
            torch.device("cpu"),
        )
        out = torch.zeros((batch, seq, num_layers, self.top_k), dtype=torch.long, device=device)
        n_local = (seq + pad) // (self.tp_size if self.sp else 1)
        start = self.tp_rank * n_local if self.sp else 0
        stop = min(start + n_local, seq)
        for layer, replay in self.layers.items():
            rec = replay.recorded_topk_idx
            if rec is None:
                raise RuntimeError(f"router of layer {layer} recorded nothing")
            rec = rec.view(n_local, batch, self.top_k).transpose(0, 1)  # [B, S_local, k]
            if stop > start:
                out[:, start:stop, layer] = rec[:, : stop - start]
        routing.indices = out
        if routing.valid is None:
            routing.valid = torch.ones((batch, seq), dtype=torch.bool, device=device)
        routing.action = "replay"
        self._arm_selection(routing, batch, seq, pad)
        for replay in self.layers.values():
            replay.measure_pending = False


def stage_routers(
    model: torch.nn.Module, arch: Arch, groups: ParallelGroups
) -> StageRouters | None:
    """:class:`StageRouters` of a built GPTModel stage under ``groups``; None when dense."""
    if not arch.is_moe:
        return None
    return StageRouters(
        model,
        groups.tp_rank,
        groups.tp_size,
        groups.sequence_parallel,
        arch.moe_topk,
        arch.num_experts,
    )


def _engine_routing(
    indices: torch.Tensor | None, valid: torch.Tensor | None, **kw
) -> Routing | None:
    return None if indices is None or valid is None else Routing(indices, valid, **kw)


class ReplayPlan:
    """Which :class:`Routing` each forward of one training step gets (``model.routing_replay``).

    One entry per micro-batch: the engine's selection (``indices`` ``[B, T, layers, k]`` or
    None) and the positions it covers (``valid`` ``[B, T]``). The *first* forward of a
    micro-batch with the current policy (recomputed old log-probs, else the first training
    forward) and every later one ask :meth:`policy`; the KL reference forward asks
    :meth:`reference`.

    - off: the first forward runs the own router and measures agreement with the engine's.
    - r3: every forward (the reference's too) replays the engine's selection; the first one
      measures the own router against it.
    - r2: the first forward records the own selection, every later one (and the reference
      after it) replays it and measures the own router against it.
    """

    def __init__(self, mode: str, engine: list[tuple[torch.Tensor | None, torch.Tensor | None]]):
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing mode {mode!r} is not one of {ROUTING_MODES}")
        self.mode = mode
        self.engine = engine
        self.recorded: dict[int, Routing] = {}
        self.seen: set[int] = set()
        self.measured: list[Routing] = []

    def policy(self, i: int) -> Routing | None:
        """The Routing of the next policy forward of micro-batch ``i``."""
        first = i not in self.seen
        self.seen.add(i)
        indices, valid = self.engine[i]
        if self.mode == "r2":
            if first:
                rec = Routing(None, valid, action="record")
                self.recorded[i] = rec
                return rec
            rec = self.recorded[i]
            return self._measured(Routing(rec.indices, rec.valid, "replay", measure=True))
        if self.mode == "r3":
            return self._measured(_engine_routing(indices, valid, action="replay", measure=first))
        if first:
            return self._measured(_engine_routing(indices, valid, action="measure", measure=True))
        return None

    def reference(self, i: int) -> Routing | None:
        """The Routing of the KL reference forward of micro-batch ``i`` (no measurement)."""
        if self.mode == "r3":
            indices, valid = self.engine[i]
            return _engine_routing(indices, valid, action="replay")
        if self.mode == "r2" and i in self.recorded:
            rec = self.recorded[i]
            return Routing(rec.indices, rec.valid, "replay")
        return None

    def _measured(self, routing: Routing | None) -> Routing | None:
        if routing is not None and routing.measure:
            self.measured.append(routing)
        return routing

    def counts(self) -> tuple[float, float]:
        """``(agree, total)`` over every measured forward of this rank."""
        return (sum(r.agree for r in self.measured), sum(r.total for r in self.measured))

    def metrics(self, mean_over: Callable[[dict[str, float]], dict[str, float]]) -> dict:
        """``train/routing_agreement`` over every rank: ``mean_over`` averages a dict over
        the world (a collective; the ratio of means is the ratio of sums). {} when nothing
        was measured anywhere."""
        agree, total = self.counts()
        sums = mean_over({"agree": agree, "total": total})
        if sums["total"] <= 0:
            return {}
        return {"train/routing_agreement": sums["agree"] / sums["total"]}


def step_plan(
    mode: str,
    engine: list[tuple[torch.Tensor | None, torch.Tensor | None]],
    routed: bool,
    old_source: str,
    measurable: bool = True,
) -> ReplayPlan | None:
    """The training step's :class:`ReplayPlan` (``engine``: per micro-batch, its routing and
    fed positions; ``routed``: every group of the batch carries the engine's routing;
    ``old_source``: the resolved ``trainer.old_logprobs``; ``measurable``: the forward can
    take a routing, i.e. no pipeline stages and no packed rows). None when nothing is
    replayed or measured (off, and no routing or not measurable). ConfigError when the mode
    cannot run."""
    if mode == "r3" and not routed:
        raise ConfigError(
            "config key 'model.routing_replay': r3 needs the experts the rollout engine routed "
            "to, and it returned none (a dense model has none) -> rollout.return_routing=true "
            "(vLLM on a GPU) or rollout.engine=hf; or model.routing_replay=off"
        )
    if mode == "r2" and old_source != "recompute":
        raise ConfigError(
            "config key 'model.routing_replay': r2 records the routing of the old-log-prob "
            "forward and replays it in training -> set trainer.old_logprobs=recompute"
        )
    if mode == "off" and not (routed and measurable):
        return None
    return ReplayPlan(mode, engine)


def routed_forward(
    model: torch.nn.Module,
    routers: StageRouters | None,
    routing: Routing | None,
    shape: tuple[int, int, int],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``model(*args, **kwargs)`` with ``routers`` armed for ``routing``; ``shape`` is the
    micro-batch's ``(batch, seq, pad)`` (``pad`` positions appended for sequence
    parallelism)."""
    if routers is None:
        if routing is not None:
            raise ValueError("routing= given for a model without MoE routers")
        return model(*args, **kwargs)
    routers.arm(routing, *shape)
    out = model(*args, **kwargs)
    routers.finish()
    return out


def pad_routing(indices: torch.Tensor, extra: int) -> torch.Tensor:
    """``[B, T, L, k]`` right-padded by ``extra`` positions routed to experts ``0..k-1``."""
    k = indices.shape[-1]
    fill = torch.arange(k, dtype=indices.dtype, device=indices.device)
    tail = fill.expand(indices.shape[0], extra, indices.shape[2], k)
    return torch.cat([indices, tail], dim=1)


__all__ = [
    "ROUTING_MODES",
    "ReplayPlan",
    "Routing",
    "StageRouters",
    "local_rows",
    "pad_routing",
    "routed_forward",
    "stage_routers",
    "step_plan",
]
