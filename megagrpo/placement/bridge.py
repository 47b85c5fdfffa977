"""The wire between trainer ranks and engine ranks (``rollout.placement: separate``).

A :class:`Channel` carries pickled control messages and tensor buckets between two processes,
in order per tag: :class:`PgChannel` over the launch's bridge group (every process; gloo for
control messages, NCCL for the buckets of a GPU run), :class:`ThreadChannel` between two
threads of one process (tests, ``tools/bench_placement.py``). Requests go from trainer rank 0
to the engine ranks (``REQ``); replies travel on their own tags (generation, push, control),
so the trainer can take a push's verdict while the groups generated before it wait for the
next step; weight buckets go from the trainer ranks that own them (``FEED``).

Buckets stay on the compute device end to end: :func:`send_named` concatenates on the
tensors' device, :class:`PgChannel` hands them to NCCL as they are, and :func:`recv_named`
yields views of the received device buffer (no host round trip; the engine's loader takes
device tensors).
"""

from __future__ import annotations

import copy
import logging
import pickle
import queue
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megagrpo.parallel.strict import check_on_device

log = logging.getLogger(__name__)

REQ, GEN, PUSH, CTRL, FEED = 1, 2, 3, 4, 5
"""Tags: requests (trainer rank 0 -> engine); replies of generate, push, hello/close; weight
buckets (owner trainer rank -> engine)."""


class Channel(Protocol):
    """Ordered messages per tag between the trainer and the engine rank."""

    def send(self, tag: int, obj: Any) -> None:
        """Queue ``obj`` (pickled); returns without waiting for the peer."""
        ...

    def recv(self, tag: int) -> Any:
        """The next message of ``tag`` (blocks)."""
        ...

    def send_tensor(self, tag: int, t: torch.Tensor) -> None:
        """Queue a flat tensor (a bucket), from the device it is on."""
        ...

    def recv_tensor(self, tag: int, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The next bucket of ``tag``: ``dtype [numel]`` on the channel's device."""
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

    def recv_tensor(self, tag: int, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        t = self._in[tag].get()
        assert t.numel() == numel and t.dtype == dtype, (t.numel(), numel, t.dtype, dtype)
        return t

    def close(self) -> None:
        pass


def thread_pair() -> tuple[ThreadChannel, ThreadChannel]:
    """(trainer end, engine end) of an in-process channel."""
    a = {t: queue.Queue() for t in (REQ, GEN, PUSH, CTRL, FEED)}
    b = {t: queue.Queue() for t in (REQ, GEN, PUSH, CTRL, FEED)}
    return ThreadChannel(a, b), ThreadChannel(b, a)


class PgChannel:
    """A channel to global rank ``peer`` over the bridge process group ``pg`` (control
    messages: a length, then the pickled bytes); buckets over ``data_pg`` on ``device`` (NCCL
    on GPU: CUDA tensors; the same gloo group on CPU). Sends are asynchronous: the tensors
    stay alive until their work completes. A bucket already on ``device`` is sent as it is
    (strict mode checks it: :func:`megagrpo.parallel.strict.check_on_device`), a received one
    stays on ``device``."""

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
        if torch.cuda.is_available() and t.device != self.device:
            t = t.to(self.device)  # (a bucket built on the compute device is not moved)
        t = t.contiguous()
        check_on_device("bridge bucket", bucket=t)
        self._isend(self.data_pg, t, tag)

    def recv_tensor(self, tag: int, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device=self.device)
        self.data_pg.recv([t], self.peer, tag).wait()
        return t

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
    ch: Channel | list[Channel],
    tag: int,
    tensors: Iterator[tuple[str, torch.Tensor]],
    mb: float,
) -> int:
    """Stream ``tensors`` as byte buckets of at most ``mb`` MiB (a larger tensor forms its own)
    to ``ch`` (or to each of a list of channels: every engine rank of a separate placement):
    per bucket a ``("bucket", specs)`` message and the bytes, then ``("end",)``. A bucket is
    concatenated on its tensors' device (the first tensor's; others are moved there), never
    via the host. Returns the bytes sent (per channel)."""
    channels = ch if isinstance(ch, list) else [ch]
    limit, specs, parts, size, total = int(mb * 2**20), [], [], 0, 0

    def flush() -> None:
        nonlocal specs, parts, size
        if parts:
            bucket = torch.cat(parts)
            for c in channels:
                c.send(tag, ("bucket", specs))
                c.send_tensor(tag, bucket)
        specs, parts, size = [], [], 0

    for name, t in tensors:
        if parts and t.device != parts[0].device:
            t = t.to(parts[0].device)
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if parts and size + raw.numel() > limit:
            flush()
        specs.append(Spec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), raw.numel()))
        parts.append(raw)
        size += raw.numel()
        total += raw.numel()
    flush()
    for c in channels:
        c.send(tag, ("end",))
    return total


def recv_named(ch: Channel, tag: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of :func:`send_named`, bucket by bucket, views of the received buffer on the
    channel's device (drain it to the end)."""
    while (msg := ch.recv(tag))[0] == "bucket":
        specs: list[Spec] = msg[1]
        flat = ch.recv_tensor(tag, sum(s.nbytes for s in specs))
        at = 0
        for s in specs:
            raw = flat[at : at + s.nbytes]
            at += s.nbytes
            yield s.name, raw.view(getattr(torch, s.dtype)).reshape(s.shape)
