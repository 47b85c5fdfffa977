"""The wire between the trainer and an engine on its own rank (``rollout.placement: separate``).

A :class:`Channel` carries pickled control messages and raw tensor buckets between global
trainer rank 0 and the engine rank, in order per tag: :class:`PgChannel` over a two-rank
process group (gloo on CPU; the buckets of a GPU run over NCCL), :class:`ThreadChannel` between
two threads of one process (tests, ``tools/bench_placement.py``). Replies travel on their own
tags (generation, push, control), so the trainer can take a push's verdict while the groups
generated before it wait for the next step.

:func:`serve_engine` is the engine rank's whole life: a loop that answers ``hello`` (probe
sequence, dtype, adapter support), ``generate`` (groups tagged with the policy version the
engine held: ``meta['policy_version']``, and per token ``meta['policy_versions']`` in the
step numbering of partial rollouts), ``push`` (named tensors in byte buckets: an adapter or
merged weights, loaded and verified by the engine's probe exactly as a colocated engine
verifies them) and ``close``. An engine error is sent back as a reply, never swallowed.
"""

from __future__ import annotations

import copy
import logging
import pickle
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megagrpo.rollout import RolloutEngine
from megagrpo.rollout.lora import PeftAdapter

log = logging.getLogger(__name__)

REQ, GEN, PUSH, CTRL = 1, 2, 3, 4
"""Tags: requests (trainer -> engine); replies of generate, push, hello/close."""


class Channel(Protocol):
    """Ordered messages per tag between the trainer and the engine rank."""

    def send(self, tag: int, obj: Any) -> None:
        """Queue ``obj`` (pickled); returns without waiting for the peer."""
        ...

    def recv(self, tag: int) -> Any:
        """The next message of ``tag`` (blocks)."""
        ...

    def send_tensor(self, tag: int, t: torch.Tensor) -> None:
        """Queue a flat ``uint8`` tensor (a bucket)."""
        ...

    def recv_tensor(self, tag: int, numel: int) -> torch.Tensor:
        """The next bucket of ``tag``: ``uint8 [numel]``."""
        ...

    def close(self) -> None:
        """Wait for every queued send."""
        ...


class ThreadChannel:
    """One end of an in-process channel (:func:`thread_pair`)."""

    def __init__(self, out: dict[int, queue.Queue], inbox: dict[int, queue.Queue]):
        self._out, self._in = out, inbox

    def send(self, tag: int, obj: Any) -> None:
        self._out[tag].put(copy.deepcopy(obj))  # the receiver owns its copy, as over a wire

    def recv(self, tag: int) -> Any:
        return self._in[tag].get()

    def send_tensor(self, tag: int, t: torch.Tensor) -> None:
        self._out[tag].put(t.clone())

    def recv_tensor(self, tag: int, numel: int) -> torch.Tensor:
        t = self._in[tag].get()
        assert t.numel() == numel, (t.numel(), numel)
        return t

    def close(self) -> None:
        pass


def thread_pair() -> tuple[ThreadChannel, ThreadChannel]:
    """(trainer end, engine end) of an in-process channel."""
    a = {t: queue.Queue() for t in (REQ, GEN, PUSH, CTRL)}
    b = {t: queue.Queue() for t in (REQ, GEN, PUSH, CTRL)}
    return ThreadChannel(a, b), ThreadChannel(b, a)


class PgChannel:
    """A channel to ``peer`` over the two-rank process group ``pg`` (control messages: a
    length, then the pickled bytes); buckets over ``data_pg`` on ``device`` (NCCL on GPU:
    CUDA tensors; the same gloo group on CPU). Sends are asynchronous: the tensors stay alive
    until their work completes."""

    def __init__(
        self,
        pg: Any,
        peer: int,
        data_pg: Any = None,
        device: torch.device | None = None,
    ):
        self.pg, self.peer = pg, peer
        self.data_pg = data_pg or pg
        self.device = device or torch.device("cpu")
        self._pending: list[tuple[Any, list[torch.Tensor]]] = []

    def _isend(self, pg: Any, t: torch.Tensor, tag: int) -> None:
        self._pending = [(w, ts) for w, ts in self._pending if not w.is_completed()]
        self._pending.append((pg.send([t], self.peer, tag), [t]))

    def send(self, tag: int, obj: Any) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._isend(self.pg, torch.tensor([payload.numel()], dtype=torch.int64), tag)
        self._isend(self.pg, payload, tag)

    def recv(self, tag: int) -> Any:
        size = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([size], self.peer, tag).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.recv([payload], self.peer, tag).wait()
        # the job's own peer rank over its process group, as torch.distributed's object
        # collectives (which unpickle too); never a file
        return pickle.loads(payload.numpy().tobytes())  # unpickle: peer rank, not a file

    def send_tensor(self, tag: int, t: torch.Tensor) -> None:
        self._isend(self.data_pg, t.to(self.device).contiguous(), tag)

    def recv_tensor(self, tag: int, numel: int) -> torch.Tensor:
        t = torch.empty(numel, dtype=torch.uint8, device=self.device)
        self.data_pg.recv([t], self.peer, tag).wait()
        return t.cpu()

    def close(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []


# ------------------------------------------------------------------ named tensors on the wire


@dataclass
class Spec:
    """Where one tensor sits in a byte bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


def send_named(
    ch: Channel, tag: int, tensors: Iterator[tuple[str, torch.Tensor]], mb: float
) -> int:
    """Stream ``tensors`` as byte buckets of at most ``mb`` MiB (a larger tensor forms its own):
    per bucket a ``("bucket", specs)`` message and the bytes, then ``("end",)``. Returns the
    bytes sent."""
    limit, specs, parts, size, total = int(mb * 2**20), [], [], 0, 0

    def flush() -> None:
        nonlocal specs, parts, size
        if parts:
            ch.send(tag, ("bucket", specs))
            ch.send_tensor(tag, torch.cat(parts))
        specs, parts, size = [], [], 0

    for name, t in tensors:
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if parts and size + raw.numel() > limit:
            flush()
        specs.append(Spec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), raw.numel()))
        parts.append(raw)
        size += raw.numel()
        total += raw.numel()
    flush()
    ch.send(tag, ("end",))
    return total


def recv_named(ch: Channel, tag: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of :func:`send_named`, bucket by bucket (drain it to the end)."""
    while (msg := ch.recv(tag))[0] == "bucket":
        specs: list[Spec] = msg[1]
        flat = ch.recv_tensor(tag, sum(s.nbytes for s in specs))
        at = 0
        for s in specs:
            raw = flat[at : at + s.nbytes]
            at += s.nbytes
            yield s.name, raw.view(getattr(torch, s.dtype)).reshape(s.shape)


# ------------------------------------------------------------------ the engine rank


@dataclass
class EngineState:
    """What the engine rank knows between messages."""

    version: int = 0
    """Weight updates the engine holds (0: the weights it started with)."""
    busy: list[tuple[float, float]] = field(default_factory=list)
    """Generation intervals (``time.time()``) not yet reported to the trainer."""


def tag_versions(groups: list, version: int) -> None:
    """Stamp every group with the version its completions were sampled under:
    ``meta['policy_version']`` (weight updates held) and ``meta['policy_versions']`` per token
    in partial rollouts' numbering (the step those weights were current for: version + 1)."""
    for g in groups:
        g.meta["policy_version"] = version
        g.meta["policy_versions"] = [[version + 1] * len(ids) for ids in g.token_ids]


def serve_engine(engine: RolloutEngine, ch: Channel) -> int:
    """The engine rank's loop (module docstring) until ``close``; returns the messages served."""
    state, served = EngineState(), 0
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
        elif kind == "generate":
            ch.send(GEN, _generate(engine, state, *msg[1:]))
        elif kind == "push":
            ch.send(PUSH, _push(engine, state, ch, msg[1]))
        else:
            ch.send(CTRL, ("error", f"unknown request {kind!r}"))


def _hello(engine: RolloutEngine) -> tuple:
    return (
        "hello",
        {
            "probe_token_ids": list(engine.probe_token_ids),
            "adapters": bool(engine.supports_adapter_sync()),
            "dtype": str(engine.dtype).removeprefix("torch."),
        },
    )


def _generate(engine: RolloutEngine, state: EngineState, problems, counts, spec) -> tuple:
    t0 = time.time()
    try:
        groups = engine.generate(problems, counts, spec)
    except Exception as exc:  # noqa: BLE001 - the trainer raises it
        return ("error", f"engine rank: {type(exc).__name__}: {exc}")
    tag_versions(groups, state.version)
    state.busy.append((t0, time.time()))
    return ("groups", groups, state.version)


@dataclass
class PushHeader:
    """What a push message says before its buckets."""

    mode: str
    """adapter | merged."""
    version: int
    expected: list[float] | None
    before: list[float] | None
    full_check: bool | None = None
    rank: int = 8
    alpha: float = 16.0


def _push(engine: RolloutEngine, state: EngineState, ch: Channel, head: PushHeader) -> tuple:
    """Load the pushed tensors (drained in full even when loading fails) and verify them."""
    stream = recv_named(ch, REQ)
    try:
        if head.mode == "adapter":
            adapter = PeftAdapter(rank=head.rank, alpha=head.alpha)
            for name, t in stream:
                side, module = name.split(":", 1)
                (adapter.a if side == "a" else adapter.b)[module] = t
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
    busy, state.busy = state.busy, []
    return ("pushed", report, error, busy)
